"""model_relation_config.json, read as CANN writes it: which slice runs on which device as which
rank, and which ranks each communication group holds.

    deploy_config[]:            submodel_name, deploy_device_id_list ("cluster:node:item")
    model_name_to_instance_id[]: submodel_name, model_instance_id
    comm_group[] (optional):     group_name, group_rank_list ("[0,1]", as the documents write it)
    rank_table[] (optional):     rank_id, model_instance_id

Without a rank table each instance id is its rank. Reading checks the file's own rules; the
slices and the cluster config are checked against it where the package is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError
from tessel.config.fields import Fields, Unique
from tessel.config.jsonfile import load_json

_DEVICE = re.compile(r"\s*([0-9]{1,9})\s*:\s*([0-9]{1,9})\s*:\s*([0-9]{1,9})\s*")
_TOP_KEYS = ("deploy_config", "model_name_to_instance_id", "comm_group", "rank_table")


@dataclass(frozen=True)
class SliceEntry:
    """One slice: its file in the slice directory, the device it runs on, and its rank."""

    submodel_name: str
    device: str  # "cluster:node:item", as the cluster config's devices name themselves
    instance_id: int
    rank: int
    key_path: str  # where the file names it, for errors


@dataclass(frozen=True)
class ModelRelation:
    """The parsed file: slices in rank order and the groups their collectives name."""

    source: str
    slices: tuple[SliceEntry, ...]
    groups: dict[str, tuple[int, ...]]  # group name -> ranks, ascending

    def error(self, key: str | None, message: str) -> ConfigError:
        return ConfigError(self.source, key, message)


def read_model_relation(path: str | Path) -> ModelRelation:
    """Parse and check `path`; every error names the file, the key path, what was found and what
    is allowed."""
    top = Fields(load_json(path), path)
    top.check_keys(_TOP_KEYS)
    devices = Unique("device")
    names = Unique("submodel_name")
    deploy: dict[str, tuple[str, str]] = {}
    for entry in top.children("deploy_config", nonempty=True):
        entry.check_keys(("submodel_name", "deploy_device_id_list"))
        name = _file_name(entry)
        names.add(name, entry, "submodel_name")
        device = _device(entry)
        devices.add(device, entry, "deploy_device_id_list")
        deploy[name] = (device, entry.path("submodel_name"))

    instances: dict[str, int] = {}
    ids = Unique("model_instance_id")
    seen = Unique("submodel_name")
    for entry in top.children("model_name_to_instance_id", nonempty=True):
        entry.check_keys(("submodel_name", "model_instance_id"))
        name = entry.string("submodel_name")
        seen.add(name, entry, "submodel_name")
        if name not in deploy:
            raise entry.error(
                f"{name!r} is not deployed; deploy_config names {sorted(deploy)}", "submodel_name"
            )
        instance = entry.integer("model_instance_id")
        ids.add(instance, entry, "model_instance_id")
        instances[name] = instance
    missing = sorted(set(deploy) - set(instances))
    if missing:
        raise top.error(f"no model_instance_id for {missing}", "model_name_to_instance_id")

    by_instance = {i: name for name, i in instances.items()}
    rank_of: dict[str, int] = {}
    if top.has("rank_table"):
        ranks = Unique("rank_id")
        mapped = Unique("model_instance_id")
        for entry in top.children("rank_table", nonempty=True):
            entry.check_keys(("rank_id", "model_instance_id"))
            rank = entry.integer("rank_id")
            ranks.add(rank, entry, "rank_id")
            instance = entry.integer("model_instance_id")
            if instance not in by_instance:
                raise entry.error(
                    f"names instance {instance}, which model_name_to_instance_id does not give; "
                    f"known instances: {sorted(by_instance)}",
                    "model_instance_id",
                )
            mapped.add(instance, entry, "model_instance_id")
            rank_of[by_instance[instance]] = rank
        unranked = sorted(set(instances) - set(rank_of))
        if unranked:
            raise top.error(f"gives no rank_id to the slices {unranked}", "rank_table")
    else:
        rank_of = dict(instances)
    world = len(rank_of)
    if sorted(rank_of.values()) != list(range(world)):
        raise top.error(
            f"the ranks of the {world} slices are {sorted(rank_of.values())}; expected each of "
            f"0..{world - 1} once",
            "rank_table" if top.has("rank_table") else "model_name_to_instance_id",
        )

    groups: dict[str, tuple[int, ...]] = {}
    group_names = Unique("group_name")
    for entry in top.children("comm_group", default=None):
        entry.check_keys(("group_name", "group_rank_list"))
        name = entry.string("group_name")
        group_names.add(name, entry, "group_name")
        groups[name] = _rank_list(entry, world)

    slices = [
        SliceEntry(name, device, instances[name], rank_of[name], where)
        for name, (device, where) in deploy.items()
    ]
    return ModelRelation(str(path), tuple(sorted(slices, key=lambda s: s.rank)), groups)


def _file_name(entry: Fields) -> str:
    """`submodel_name`: a file in the slice directory itself (no directory part: a path that
    leaves the directory, or an absolute one, is refused)."""
    name = entry.string("submodel_name")
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise entry.error(
            f"found {name!r}; expected the name of a file in the slice directory, such as "
            '"rank0.pt2" (no directory part)',
            "submodel_name",
        )
    return name


def _device(entry: Fields) -> str:
    text = entry.string("deploy_device_id_list", pattern=_DEVICE, example="0:0:1")
    return ":".join(str(int(part)) for part in text.split(":"))


def _rank_list(entry: Fields, world: int) -> tuple[int, ...]:
    """`group_rank_list`: a string such as "[0,1]" (as CANN's documents write it) or a list."""
    key = "group_rank_list"
    value = entry.obj.get(key)
    if value is None:
        raise entry.error('required key is missing (expected a string such as "[0,1]")', key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise entry.error(
                f'found string {value!r}; expected a list of ranks such as "[0,1]"', key
            ) from None
    if not isinstance(value, list) or not value or not all(_is_int(r) for r in value):
        raise entry.error(
            f'expected a non-empty list of ranks such as "[0,1]", found {value!r}', key
        )
    bad = [r for r in value if not 0 <= r < world]
    if bad:
        raise entry.error(f"names ranks {bad}; the slices' ranks are 0..{world - 1}", key)
    if len(set(value)) != len(value):
        raise entry.error(f"lists a rank twice: {value}", key)
    if value != sorted(value):
        raise entry.error(
            f"lists ranks {value} out of order; list a group's ranks ascending (a group's "
            "collectives put its ranks' parts together in rank order)",
            key,
        )
    return tuple(value)


def _is_int(value: Any) -> bool:
    return type(value) is int
