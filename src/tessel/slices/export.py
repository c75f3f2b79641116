"""`export_slice`: inside a torchrun job, write this rank's slice of a model parallelised with
torch's own tensor parallelism (or any module whose forward calls functional collectives).

The forward is traced with `make_fx` while the parameters are DTensors over their local shards:
DTensor's dispatch turns every sharded operator into local ATen calls and
`torch.ops._c10d_functional` collectives naming the job's process groups, so the trace is the
rank's own program. That program, with the rank's local weights under their original names,
is saved with `torch.export.save` as `<prefix><rank>.pt2`. Rank 0 also writes
`model_relation_config.json` (each slice's device and rank, and every group any rank's
collectives name). Every file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from tessel._torch import C10D_FUNCTIONAL, group_ranks, tree_leaves, tree_map
from tessel.atomic import replace_atomically
from tessel.config.errors import ConfigError

RELATION_FILE = "model_relation_config.json"


def export_slice(
    model: torch.nn.Module,
    example_inputs: tuple | list | torch.Tensor,
    directory: str | Path,
    *,
    example_kwargs: dict | None = None,
    cluster_config: str | Path | None = None,
    prefix: str = "rank",
) -> Path:
    """Write this rank's slice of `model` to `directory` and return its path.

    Call it on every rank of the job (it is a collective). Outputs that are DTensors are made
    whole, so rank 0's outputs are the model's. With `cluster_config`, rank r is deployed on the
    cluster's r-th device; otherwise on `0:<node>:<local rank>`, nodes of torchrun's
    LOCAL_WORLD_SIZE ranks each.
    """
    if not dist.is_initialized():
        raise ConfigError(
            "export_slice", None, "needs an initialised process group (run under torchrun)"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)

    state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    names = list(state)
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
    layouts = [
        (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        for t in state.values()
    ]
    flat_inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        weights, inputs = flat[: len(names)], list(flat[len(names) :])
        params = {
            name: w
            if layout is None
            else DTensor.from_local(
                w, layout[0], layout[1], run_check=False, shape=layout[2], stride=layout[3]
            )
            for name, w, layout in zip(names, weights, layouts)
        }
        it = iter(inputs)
        a, k = tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        out = torch.func.functional_call(model, params, a, k, tie_weights=False)
        return [_whole(x) for x in tree_leaves(out) if isinstance(x, torch.Tensor)]

    with torch.no_grad():
        traced = make_fx(run, tracing_mode="fake")(*locals_, *flat_inputs)
    groups = _groups_named(traced)
    program = _SliceModule(traced, names, [w.detach() for w in locals_])
    exported = torch.export.export(program, tuple(flat_inputs))
    path = folder / f"{prefix}{rank}.pt2"
    with replace_atomically(path, suffix=".tmp.pt2") as tmp:  # torch.export.save wants .pt2
        torch.export.save(exported, tmp)

    # only rank 0 writes the relation, so the groups go to it point to point (no all-gather:
    # torch 2.13's gloo all-gather is the path that corrupted heaps in tessel's workers)
    if rank == 0:
        everyone: list[Any] = [groups]
        for source in range(1, world):
            received: list[Any] = [None]
            dist.recv_object_list(received, src=source)
            everyone.append(received[0])
        relation = _relation(prefix, world, everyone, cluster_config)
        with replace_atomically(folder / RELATION_FILE) as tmp:
            tmp.write_text(json.dumps(relation, indent=2))
    else:
        dist.send_object_list([groups], dst=0)
    dist.barrier()
    return path


def _whole(x: torch.Tensor) -> torch.Tensor:
    """An output as the single-device model returns it: a DTensor made whole on every rank."""
    if isinstance(x, DTensor):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
    return x


class _SliceModule(torch.nn.Module):
    """The traced program over the rank's local weights, held under their original names."""

    def __init__(self, traced: torch.fx.GraphModule, names: list[str], weights: list) -> None:
        super().__init__()
        self.traced = traced
        self.names = names
        for name, w in zip(names, weights):
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_buffer(leaf, w)

    def forward(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        weights = [self.get_buffer(n) for n in self.names]
        return self.traced(*weights, *inputs)


def _groups_named(gm: torch.fx.GraphModule) -> dict[str, list[int]]:
    """Every process group the traced collectives name, with its global ranks."""
    found = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith(C10D_FUNCTIONAL):
            continue
        schema = n.target._schema.arguments
        for i, a in enumerate(n.args):
            if i < len(schema) and schema[i].name == "group_name" and isinstance(a, str):
                found[a] = group_ranks(a)
    return found


def _relation(
    prefix: str, world: int, groups_per_rank: list[dict], cluster_config: str | Path | None
) -> dict:
    if cluster_config is not None:
        from tessel.config.cluster import read_cluster_config

        devices = [d.logical_id for d in read_cluster_config(cluster_config).devices]
        if len(devices) != world:
            raise ConfigError(
                cluster_config,
                None,
                f"has {len(devices)} devices, but the job has {world} ranks (a slice each)",
            )
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # torchrun's, per node
        devices = [f"0:{r // local}:{r % local}" for r in range(world)]
    names = [f"{prefix}{r}.pt2" for r in range(world)]
    groups: dict[str, list[int]] = {}
    for found in groups_per_rank:
        groups.update(found)
    return {
        "deploy_config": [
            {"submodel_name": n, "deploy_device_id_list": d} for n, d in zip(names, devices)
        ],
        "model_name_to_instance_id": [
            {"submodel_name": n, "model_instance_id": r} for r, n in enumerate(names)
        ],
        "comm_group": [
            {"group_name": g, "group_rank_list": json.dumps(sorted(r))}
            for g, r in sorted(groups.items())
        ],
        "rank_table": [{"rank_id": r, "model_instance_id": r} for r in range(world)],
    }
