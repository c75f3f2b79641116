"""Pre-sliced models into one offline model: each rank's slice becomes that rank's program, its
weights that rank's weights, the relation config's groups the workers' process groups.

The package is the same kind a partitioned build writes (mode `partitioned`, one submodel per
device of the cluster, a mesh of one `rank` axis), so a Session, `tessel run` and `tessel
inspect` take it alike; rank 0's outputs are the model's outputs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tessel._version import __version__ as tessel_version
from tessel.builder.packing import collective_lines
from tessel.builder.pipeline import BuiltModel
from tessel.config.cluster import ClusterConfig
from tessel.dtypes import dtype_name
from tessel.lower.program import groups_in
from tessel.package.format import FORMAT_VERSION, Manifest, Member
from tessel.package.manifest import Mesh, Submodel, TensorSpec
from tessel.package.plan_report import PlanReport, RankLine, Verified
from tessel.slices.read import Slice, read_slices
from tessel.slices.relation import ModelRelation, read_model_relation

_SHARED = "weights/replicated.safetensors"
_NOT_CHECKED = "built from pre-sliced models: there is no single-device model to check against"


def build_from_slices(
    shard_model_dir: str | Path,
    model_relation_config: str | Path,
    cluster: ClusterConfig,
    soc_version: str = "cpu",
) -> BuiltModel:
    """One offline model from the slices in `shard_model_dir`, deployed as
    `model_relation_config` says on `cluster`'s devices."""
    t = time.perf_counter()
    relation = read_model_relation(model_relation_config)
    cluster_ranks = _cluster_ranks(relation, cluster)
    slices = read_slices(shard_model_dir, relation, cluster_ranks)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    manifest, members = _pack(slices, relation, cluster, cluster_ranks, soc_version)
    timings = {"read slices": read_s, "pack": time.perf_counter() - t}
    return BuiltModel.checked(manifest, members, timings)


def _cluster_ranks(relation: ModelRelation, cluster: ClusterConfig) -> dict[int, int]:
    """Each slice rank's device rank in the cluster; every device runs one slice."""
    devices = {d.logical_id: d for d in cluster.devices}
    ranks = {}
    for s in relation.slices:
        device = devices.get(s.device)
        if device is None:
            raise relation.error(
                s.key_path.removesuffix("submodel_name") + "deploy_device_id_list",
                f"device {s.device!r} is not in the cluster config {cluster.source} (its devices: "
                f"{', '.join(sorted(devices))})",
            )
        ranks[s.rank] = device.rank
    if len(ranks) != cluster.world_size:
        unused = sorted(set(devices) - {s.device for s in relation.slices})
        raise relation.error(
            "deploy_config",
            f"deploys {len(ranks)} slices on a cluster of {cluster.world_size} devices; every "
            f"device runs one slice (no slice for {', '.join(unused)})",
        )
    return ranks


def _pack(
    slices: list[Slice],
    relation: ModelRelation,
    cluster: ClusterConfig,
    cluster_ranks: dict[int, int],
    soc_version: str,
) -> tuple[Manifest, dict[str, Member]]:
    members: dict[str, Member] = {}
    by_device = {cluster_ranks[s.entry.rank]: s for s in slices}
    shared = _held_alike(slices)
    if shared:
        members[_SHARED] = _own_storage({n: slices[0].weights[n] for n in sorted(shared)})
    submodels, ranks = [], []
    for device in cluster.devices:
        s = by_device[device.rank]
        program = f"programs/rank_{device.rank}.json"
        members[program] = json.dumps(s.program).encode()
        own = {n: t for n, t in s.weights.items() if n not in shared}
        weights = [_SHARED] if shared else []
        if own:
            weights.append(f"weights/rank_{device.rank}.safetensors")
            members[weights[-1]] = _own_storage(own)
        submodels.append(
            Submodel(
                rank=device.rank,
                logical_device=device.logical_id,
                node_id=device.node_id,
                device_id=device.device_id,
                program=program,
                weights=tuple(weights),
                weight_order=tuple(s.weights),
                tied={},
                comm_groups=tuple(map(tuple, groups_in(s.program))),
            )
        )
        ranks.append(
            RankLine(
                rank=device.rank,
                logical_device=device.logical_id,
                slice=s.entry.submodel_name,
                weight_bytes=sum(t.numel() * t.element_size() for t in s.weights.values()),
                collectives=collective_lines(s.program, s.shapes),
            )
        )
    leader = by_device[0]
    members["layouts.json"] = b"{}"  # a slice's weights are whatever its author cut
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        tessel_version=tessel_version,
        torch_version=torch.__version__,
        mode="partitioned",
        soc_version=soc_version,
        device_type=cluster.soc.device_type,
        backend=cluster.soc.backend,
        world_size=cluster.world_size,
        cluster=cluster.raw,
        mesh=Mesh((cluster.world_size,), ("rank",)),
        inputs=tuple(TensorSpec(i.shape, dtype_name(i.dtype), i.name) for i in leader.inputs),
        outputs=tuple(TensorSpec(o.shape, dtype_name(o.dtype)) for o in leader.outputs),
        submodels=tuple(submodels),
        layouts="layouts.json",
        strategy=None,
        plan=PlanReport(
            source="slices",
            relation_config=str(relation.source),
            groups={name: tuple(r) for name, r in relation.groups.items()},
            ranks=tuple(ranks),
            verify=Verified(skipped=_NOT_CHECKED),
        ),
    )
    return manifest, members


def _held_alike(slices: list[Slice]) -> set[str]:
    """Weights every slice holds under one name with equal values (an unsharded embedding, a
    norm's scale): stored once, read by every rank."""
    first, rest = slices[0].weights, slices[1:]
    return {
        name
        for name, t in first.items()
        if all(
            name in s.weights
            and s.weights[name].dtype == t.dtype
            and s.weights[name].shape == t.shape
            and torch.equal(s.weights[name], t)
            for s in rest
        )
    }


def _own_storage(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as contiguous tensors, none sharing storage with another (safetensors
    stores each tensor on its own)."""
    seen: set[int] = set()
    out = {}
    for name, t in weights.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        out[name] = t.clone() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
    return out
