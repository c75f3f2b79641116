"""Run as ``python dcp_writer.py RANK WORLD OUT_DIR INIT_FILE``: save DTensors with torch's dcp.save."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(8, 6, generator=g),
        "b": torch.randn(8, generator=g).to(torch.bfloat16),
        "r": torch.randn(4, 4, generator=g),
        "m": torch.randn(6, 4, generator=g),
        "step": torch.tensor(3),
    }


PLACEMENTS = {
    "w": lambda: [Shard(0), Shard(1)],
    "b": lambda: [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP2 + TP order
    "r": lambda: [Replicate(), Replicate()],
    "m": lambda: [Replicate(), Shard(1)],
}


def main() -> None:
    rank, world, out, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = {}
    for k, t in full_tensors().items():
        if k in PLACEMENTS:
            sd[k] = distribute_tensor(t, mesh, PLACEMENTS[k](), src_data_rank=None)
        else:
            sd[k] = t
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
