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
from tessel.config.jsonfile import load_json
from tessel.dataflow.errors import RULE_INVOKE_ONE_OF, RULE_SYNTAX, DeployError

DEPLOY_INFO_OPTION = "ge.experiment.data_flow_deploy_info_path"
HOST = -1
_MAX_PART = 32767  # INT16_MAX, as CANN's parser allows
_MAX_EXPANSION = 65535  # UINT16_MAX
_PART = re.compile(r"^(-1|\d{1,5})(?:~(\d{1,5}))?$")


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
        raise DeployError(source, key, RULE_SYNTAX, f"expected a non-empty string, found {text!r}")
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
            m = _PART.match(part)
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
            raise DeployError(source, key, RULE_SYNTAX, f"{text!r} lists device {d} twice")
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


def _bool(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise DeployError(source, key, RULE_SYNTAX, f"expected true or false, found {value!r}")
    return value


def _names(value: Any, source: str, key: str) -> list[str]:
    if isinstance(value, str):  # the doc also describes a comma-separated string
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise DeployError(
            source, key, RULE_SYNTAX, f"expected a non-empty list of node names, found {value!r}"
        )
    return list(value)


def _invoke(
    raw: Any, source: str, key: str, base: Path, keep: bool, stack: tuple[str, ...]
) -> InvokeEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("invoke_name"), str):
        raise DeployError(source, key, RULE_SYNTAX, "expected an object with a string invoke_name")
    name = raw["invoke_name"]
    has_file, has_list = "deploy_info_file" in raw, "logic_device_list" in raw
    if has_file and has_list:
        raise DeployError(
            source,
            key,
            RULE_INVOKE_ONE_OF,
            f"invoke {name!r} sets both deploy_info_file and logic_device_list; keep one",
        )
    if not (has_file or has_list):
        raise DeployError(
            source, key, RULE_SYNTAX, f"invoke {name!r} needs deploy_info_file or logic_device_list"
        )
    if has_list:
        devs = parse_logic_device_list(
            raw["logic_device_list"], source, f"{key}.logic_device_list", keep
        )
        return InvokeEntry(name, devices=devs, key_path=key)
    path = Path(raw["deploy_info_file"])
    if not path.is_absolute() and not path.exists():
        path = base / path
    if str(path.resolve()) in stack:
        raise DeployError(source, key, RULE_SYNTAX, f"deploy_info_file {path} includes itself")
    nested = read_deploy_info(path, _stack=stack)
    return InvokeEntry(name, nested=nested, key_path=key)


def parse_deploy_info(
    data: Any, source: str = "<deploy info>", base: Path | None = None, _stack: tuple[str, ...] = ()
) -> DeployInfo:
    """Check a loaded deploy-info object and turn it into a DeployInfo."""
    base = base or Path.cwd()
    if not isinstance(data, dict):
        raise DeployError(source, None, RULE_SYNTAX, "expected a JSON object at the top level")
    known = {
        "batch_deploy_info",
        "deploy_info",
        "keep_logic_device_order",
        "dynamic_schedule_enable",
    }
    for k in data:
        if k not in known:
            raise DeployError(
                source, k, RULE_SYNTAX, f"unknown key; allowed: {', '.join(sorted(known))}"
            )
    if "batch_deploy_info" not in data and "deploy_info" not in data:
        raise DeployError(
            source, None, RULE_SYNTAX, "needs batch_deploy_info (or the legacy deploy_info)"
        )
    keep = _bool(data.get("keep_logic_device_order", False), source, "keep_logic_device_order")
    dyn = _bool(data.get("dynamic_schedule_enable", False), source, "dynamic_schedule_enable")
    entries: list[DeployEntry] = []
    legacy = data.get("deploy_info", [])
    if not isinstance(legacy, list):
        raise DeployError(source, "deploy_info", RULE_SYNTAX, "expected a list")
    for i, raw in enumerate(legacy):
        key = f"deploy_info[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("flow_node_name"), str):
            raise DeployError(
                source, key, RULE_SYNTAX, "expected flow_node_name and logic_device_id"
            )
        devs = parse_logic_device_list(
            raw.get("logic_device_id"), source, f"{key}.logic_device_id", keep
        )
        entries.append(DeployEntry([raw["flow_node_name"]], devs, key_path=key))
    batch = data.get("batch_deploy_info", [])
    if not isinstance(batch, list):
        raise DeployError(source, "batch_deploy_info", RULE_SYNTAX, "expected a list")
    for i, raw in enumerate(batch):
        key = f"batch_deploy_info[{i}]"
        if not isinstance(raw, dict):
            raise DeployError(source, key, RULE_SYNTAX, "expected an object")
        allowed = {
            "flow_node_list",
            "logic_device_list",
            "invoke_list",
            "redundant_logic_device_list",
        }
        for k in raw:
            if k not in allowed:
                raise DeployError(
                    source, f"{key}.{k}", RULE_SYNTAX, f"unknown key; allowed: {sorted(allowed)}"
                )
        names = _names(raw.get("flow_node_list"), source, f"{key}.flow_node_list")
        if "logic_device_list" not in raw:
            raise DeployError(source, key, RULE_SYNTAX, "missing logic_device_list")
        devs = parse_logic_device_list(
            raw["logic_device_list"], source, f"{key}.logic_device_list", keep
        )
        red = []
        if "redundant_logic_device_list" in raw:
            red = parse_logic_device_list(
                raw["redundant_logic_device_list"], source, f"{key}.redundant_logic_device_list"
            )
        invokes: dict[str, InvokeEntry] = {}
        inv = raw.get("invoke_list", [])
        if not isinstance(inv, list):
            raise DeployError(source, f"{key}.invoke_list", RULE_SYNTAX, "expected a list")
        for j, r in enumerate(inv):
            entry = _invoke(r, source, f"{key}.invoke_list[{j}]", base, keep, _stack)
            if entry.name in invokes:
                raise DeployError(
                    source, entry.key_path, RULE_SYNTAX, f"invoke {entry.name!r} listed twice"
                )
            invokes[entry.name] = entry
        entries.append(DeployEntry(names, devs, invokes, red, key_path=key))
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
