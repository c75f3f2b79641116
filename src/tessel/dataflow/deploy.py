"""The data_flow_deploy_info.json grammar: logical device ids, lists, ranges and the file itself.

`logic_device_list` is `cluster:server:device[:numa]` (three parts mean numa 0), comma lists of
such ids, and `a~b` ranges in any part, expanded as a Cartesian product. `-1` as the device means
the host of that server. The file holds `batch_deploy_info` entries (or the legacy `deploy_info`),
each naming flow nodes and their devices, with an optional `invoke_list` for invoked closures.
Reading the file only checks its own syntax; placement.py checks it against a graph and a cluster.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError
from tessel.config.fields import Fields, describe, str_value
from tessel.config.jsonfile import load_json
from tessel.dataflow.errors import RULE_INVOKE_ONE_OF, RULE_SYNTAX, DeployError

DEPLOY_INFO_OPTION = "ge.experiment.data_flow_deploy_info_path"
HOST = -1
_MAX_PART = 32767  # INT16_MAX, as CANN's parser allows
_MAX_EXPANSION = 65535  # UINT16_MAX
_PART = re.compile(r"(-1|[0-9]{1,5})(?:~([0-9]{1,5}))?")  # ASCII digits only


@dataclass(frozen=True, order=True)
class LogicDevice:
    """One logical device: `cluster:server:device:numa`; device -1 is the server's host."""

    cluster: int
    server: int
    device: int
    numa: int = 0

    @property
    def is_host(self) -> bool:
        return self.device == HOST

    def __str__(self) -> str:
        return f"{self.cluster}:{self.server}:{self.device}:{self.numa}"


def parse_logic_device_list(
    text: str, source: object = None, key: str = "logic_device_list", keep_order: bool = True
) -> list[LogicDevice]:
    """Expand a logic_device_list string into devices, in the written order unless keep_order is
    False (then sorted part by part, as CANN does). Duplicates are an error."""
    if not isinstance(text, str) or not text.strip():
        raise DeployError(
            source, key, RULE_SYNTAX, f"expected a non-empty string, found {describe(text)}"
        )
    out: list[LogicDevice] = []
    for item in text.split(","):
        parts = [p.strip() for p in item.strip().split(":")]
        if len(parts) not in (3, 4):
            raise DeployError(
                source,
                key,
                RULE_SYNTAX,
                f"{item.strip()!r} has {len(parts)} parts; expected cluster:server:device[:numa]",
            )
        ranges = []
        for pos, part in enumerate(parts):
            m = _PART.fullmatch(part)
            if not m:
                raise DeployError(
                    source, key, RULE_SYNTAX, f"{item.strip()!r}: part {part!r} is not N or N~M"
                )
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if lo == HOST and (pos != 2 or m.group(2) is not None):
                raise DeployError(
                    source, key, RULE_SYNTAX, f"{item.strip()!r}: -1 is allowed only as the device"
                )
            if hi < lo:
                raise DeployError(
                    source, key, RULE_SYNTAX, f"{item.strip()!r}: range {part!r} has start > end"
                )
            if hi > _MAX_PART:
                raise DeployError(
                    source, key, RULE_SYNTAX, f"{item.strip()!r}: {hi} exceeds {_MAX_PART}"
                )
            ranges.append(range(lo, hi + 1))
        if len(ranges) == 3:
            ranges.append(range(0, 1))
        count = 1
        for r in ranges:
            count *= len(r)
        if len(out) + count > _MAX_EXPANSION:
            raise DeployError(
                source, key, RULE_SYNTAX, f"expands to more than {_MAX_EXPANSION} ids"
            )
        out.extend(LogicDevice(*ids) for ids in itertools.product(*ranges))
    seen: set[LogicDevice] = set()
    for d in out:
        if d in seen:
            raise DeployError(source, key, RULE_SYNTAX, f"lists device {d} twice")
        seen.add(d)
    return out if keep_order else sorted(out)


@dataclass
class InvokeEntry:
    """Where an invoked closure of a node goes: devices, or a nested deploy file."""

    name: str
    devices: list[LogicDevice] | None = None
    nested: DeployInfo | None = None
    key_path: str = ""


@dataclass
class DeployEntry:
    """One `batch_deploy_info` entry: these nodes on these devices."""

    nodes: list[str]
    devices: list[LogicDevice]
    invokes: dict[str, InvokeEntry] = field(default_factory=dict)
    redundant: list[LogicDevice] = field(default_factory=list)
    key_path: str = ""


@dataclass
class DeployInfo:
    """A parsed deploy-info file."""

    source: str
    entries: list[DeployEntry]
    keep_logic_device_order: bool = False
    dynamic_schedule_enable: bool = False

    def placements(self) -> dict[str, tuple[DeployEntry, str]]:
        """Node name (as written) -> (its entry, key path); a name listed twice is an error."""
        from tessel.dataflow.errors import RULE_ONCE

        out: dict[str, tuple[DeployEntry, str]] = {}
        for e in self.entries:
            for i, name in enumerate(e.nodes):
                where = f"{e.key_path}.flow_node_list[{i}]"
                if name in out:
                    raise DeployError(
                        self.source,
                        where,
                        RULE_ONCE,
                        f"is listed again (first at {out[name][1]}); place each node once",
                        node=name,
                    )
                out[name] = (e, where)
        return out


def _syntax_error(source: Any, key: str | None, message: str) -> DeployError:
    """The error the shared reader raises for this format: a deploy-info syntax error."""
    return DeployError(source, key, RULE_SYNTAX, message)


_TOP_KEYS = (
    "batch_deploy_info",
    "deploy_info",
    "keep_logic_device_order",
    "dynamic_schedule_enable",
)
_BATCH_KEYS = ("flow_node_list", "logic_device_list", "invoke_list", "redundant_logic_device_list")
_LEGACY_KEYS = ("flow_node_name", "logic_device_id")
_INVOKE_KEYS = (
    "invoke_name",
    "deploy_info_file",
    "logic_device_list",
    "redundant_logic_device_list",
)


def _names(f: Fields, key: str) -> list[str]:
    """flow_node_list: a non-empty list of node names (the doc also describes a comma-separated
    string)."""
    value = f.obj.get(key)
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        raise f.error(f"expected a non-empty list of node names, found {describe(value)}", key)
    return [str_value(v, f.error_at(f"{f.path(key)}[{i}]")) for i, v in enumerate(value)]


def _devices(f: Fields, key: str, keep: bool = True) -> list[LogicDevice]:
    return parse_logic_device_list(f.obj.get(key), f.source, f.path(key), keep)


def _invoke(f: Fields, base: Path, keep: bool, stack: tuple[str, ...]) -> InvokeEntry:
    f.check_keys(_INVOKE_KEYS)
    name = f.string("invoke_name")
    has_file, has_list = f.has("deploy_info_file"), f.has("logic_device_list")
    if has_file and has_list:
        raise DeployError(
            f.source,
            f.key_path,
            RULE_INVOKE_ONE_OF,
            f"invoke {name!r} sets both deploy_info_file and logic_device_list; keep one",
        )
    if not (has_file or has_list):
        raise f.error(f"invoke {name!r} needs deploy_info_file or logic_device_list")
    if f.has("redundant_logic_device_list"):
        _devices(f, "redundant_logic_device_list")
    if has_list:
        devs = _devices(f, "logic_device_list", keep)
        return InvokeEntry(name, devices=devs, key_path=f.key_path)
    path = Path(f.string("deploy_info_file"))
    try:
        if not path.is_absolute() and not path.exists():
            path = base / path
        resolved = str(path.resolve())
    except (OSError, RuntimeError) as exc:  # a name too long, a symlink loop
        reason = getattr(exc, "strerror", None) or exc
        raise f.error(f"cannot use {describe(str(path))}: {reason}", "deploy_info_file") from exc
    if resolved in stack:
        raise f.error(f"deploy_info_file {path} includes itself", "deploy_info_file")
    nested = read_deploy_info(path, _stack=stack)
    return InvokeEntry(name, nested=nested, key_path=f.key_path)


def parse_deploy_info(
    data: Any, source: str = "<deploy info>", base: Path | None = None, _stack: tuple[str, ...] = ()
) -> DeployInfo:
    """Check a loaded deploy-info object in full and turn it into a DeployInfo."""
    base = base or Path.cwd()
    top = Fields(data, source, error=_syntax_error)
    top.check_keys(_TOP_KEYS)
    if not (top.has("batch_deploy_info") or top.has("deploy_info")):
        raise top.error("needs batch_deploy_info (or the legacy deploy_info)")
    keep = top.boolean("keep_logic_device_order", False)
    dyn = top.boolean("dynamic_schedule_enable", False)
    entries: list[DeployEntry] = []
    for raw in top.children("deploy_info", []):
        raw.check_keys(_LEGACY_KEYS)
        name = raw.string("flow_node_name")
        devs = _devices(raw, "logic_device_id", keep)
        entries.append(DeployEntry([name], devs, key_path=raw.key_path))
    for raw in top.children("batch_deploy_info", []):
        raw.check_keys(_BATCH_KEYS)
        names = _names(raw, "flow_node_list")
        if not raw.has("logic_device_list"):
            raise raw.error("required key is missing (expected a string)", "logic_device_list")
        devs = _devices(raw, "logic_device_list", keep)
        red = []
        if raw.has("redundant_logic_device_list"):
            red = _devices(raw, "redundant_logic_device_list")
        invokes: dict[str, InvokeEntry] = {}
        for inv in raw.children("invoke_list", []):
            entry = _invoke(inv, base, keep, _stack)
            if entry.name in invokes:
                raise inv.error(
                    f"invoke {entry.name!r} listed twice (first at {invokes[entry.name].key_path})"
                )
            invokes[entry.name] = entry
        entries.append(DeployEntry(names, devs, invokes, red, key_path=raw.key_path))
    if not entries:
        raise top.error("places no node; list at least one entry in batch_deploy_info")
    info = DeployInfo(source, entries, keep, dyn)
    info.placements()  # a name listed twice fails here, with both places named
    return info


def read_deploy_info(path: str | Path, _stack: tuple[str, ...] = ()) -> DeployInfo:
    """Read and check a deploy-info file (CANN-style JSON: comments and trailing commas allowed)."""
    path = Path(path)
    try:
        data = load_json(path)
    except DeployError:
        raise
    except ConfigError as exc:
        raise DeployError(path, exc.key, RULE_SYNTAX, exc.detail) from exc
    return parse_deploy_info(data, str(path), path.parent, _stack + (str(path.resolve()),))
