"""Build time by phase for GPT-2 (width 768) on a 1-D mesh of 4, beside autoparallel's; with
`--nodes 2`, on a cluster of 2 nodes x 4 devices (HCCS within a node, RDMA between), where
tessel chooses the mesh's shape itself (`auto`, no sizes: it weighs every pp x dp x tp shape).

The peer, meta-pytorch/autoparallel, cannot be installed here (it is not on the package
registries), so its figures are the ones measured on this kind of machine in
shared/reference/peer-baselines.md §1.4 (gpt2, mesh 4, tp mode: 6.9 / 14.7 / 56.1 s end to end).
Note the difference in work: autoparallel plans a joint forward+backward training graph, tessel
an inference forward graph (with `--training`, the same joint graph: a training step with
AdamW), and tessel also writes the weights of every rank to one file and
checks the built model against eager where that costs less than the build (`verify`'s default;
`--verify` forces the check; its column is part of the total, 0 when skipped).

    python benchmarks/bench_build.py [--layers 2 8 32] [--trace_every_layer] [--verify]
                                     [--batch 8] [--seq 512] [--profile FILE]
    python benchmarks/bench_build.py --nodes 2 --layers 32   # autoparallel: 110 s on a 2x4 mesh
    python benchmarks/bench_build.py --training --layers 32  # a training step, as autoparallel

`--profile FILE` profiles each build and save with cProfile and writes the statistics to FILE
(FILE.<layers>L for each count when several are given); read them with `python -m pstats FILE`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import tempfile
import time

import torch

PEER_TOTAL_S = {2: 6.9, 8: 14.7, 32: 56.1}  # autoparallel, gpt2, mesh (4,), tp mode
PEER_2X4_S = {32: 110.0}  # autoparallel, gpt2 32 layers, mesh (2, 4)


def gpt2(layers: int, training: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_head=12, n_layer=layers, vocab_size=50304, n_positions=1024)
    if training:  # programs draw no random numbers
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    return model if training else model.eval()


def profile_path(base: str, layers: int, counts: int) -> str:
    """Where the profile of the build with `layers` layers goes (one file per layer count)."""
    return base if counts == 1 else f"{base}.{layers}L"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--devices", type=int, default=4, help="devices per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument(
        "--trace_every_layer", action="store_true", help="build without reusing identical layers"
    )
    parser.add_argument(
        "--training",
        action="store_true",
        help="build a training step (loss from labels, AdamW): the joint forward+backward graph "
        "autoparallel plans",
    )
    parser.add_argument(
        "--verify", action="store_true", help="check every build against eager, whatever it costs"
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="write cProfile statistics of each build and save to FILE (FILE.<layers>L if several)",
    )
    args = parser.parse_args()

    import tessel

    cluster = args.devices
    peers = PEER_TOTAL_S
    if args.nodes > 1:
        from bench_mesh import cluster_dict
        from tessel.config.cluster import cluster_from_dict

        cluster = cluster_from_dict(cluster_dict("[DDR:16GB]", args.nodes, args.devices), "nodes")
        peers = PEER_2X4_S if (args.nodes, args.devices) == (2, 4) else {}
    rows = []
    for layers in args.layers:
        model = gpt2(layers, args.training)
        ids = torch.randint(0, 50304, (args.batch, args.seq))
        profiler = cProfile.Profile() if args.profile else None
        t = time.perf_counter()
        with profiler or contextlib.nullcontext():
            if args.training:
                built = tessel.build(
                    model,
                    {"input_ids": ids, "labels": ids},
                    cluster=cluster,
                    optimizer=torch.optim.AdamW(model.parameters()),
                )
            else:
                built = tessel.build(
                    model,
                    {"input_ids": ids, "use_cache": False},
                    cluster=cluster,
                    reuse_layers=not args.trace_every_layer,
                    verify=True if args.verify else None,
                )
            with tempfile.TemporaryDirectory() as tmp:
                path = built.save(os.path.join(tmp, "gpt2"))
                size = path.stat().st_size
        total = time.perf_counter() - t
        if profiler is not None:
            out = profile_path(args.profile, layers, len(args.layers))
            profiler.dump_stats(out)
            print(f"wrote the profile of {layers} layers to {out}", flush=True)
        phases = {k: round(v, 2) for k, v in built.timings.items()}
        solver = built.manifest["plan"]["solver"]
        rows.append(
            {
                "layers": layers,
                "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                "phases_s": phases,
                "total_s": round(total, 2),
                "mesh": built.manifest["mesh"],
                "peer_total_s": peers.get(layers),
                "ratio": round(total / peers[layers], 3) if layers in peers else None,
                "decisions": solver["decisions"],
                "ilp_variables": solver["variables"],
                "package_MiB": round(size / 2**20, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del model, built
    print()
    print(
        f"{'layers':>6} {'capture':>8} {'strategies':>10} {'solve':>6} {'lower':>6} {'save':>6} {'verify':>6} {'total':>7} {'peer':>6} {'ratio':>6}"
    )
    for r in rows:
        p = r["phases_s"]
        print(
            f"{r['layers']:>6} {p.get('capture', 0):>8.2f} {p.get('strategies', 0):>10.2f} {p.get('solve', 0):>6.2f} "
            f"{p.get('lower', 0):>6.2f} {p.get('save', 0):>6.2f} {p.get('verify', 0):>6.2f} {r['total_s']:>7.2f} {r['peer_total_s'] or 0:>6.1f} {r['ratio'] or 0:>6.3f}"
        )


if __name__ == "__main__":
    main()
