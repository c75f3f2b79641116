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
    python benchmarks/bench_build.py --llama3-8b [--layers 32]  # meta model + 16 GB checkpoint

`--llama3-8b` builds a Llama-3-8B-shaped model (width 4096, MLP 14336, 32/8 heads, vocab 128,256,
bf16; batch 8 x 2048 tokens, autoparallel's "big" preset) from the meta device on 2 nodes of 4
H100s, with `weights=` a checkpoint it first writes itself (random bf16 values in safetensors
shards of about 2 GB, with an index, as the hub gives one). It prints the plan's time (everything
but writing the weights: capture, mesh choice, solve, lowering) beside autoparallel's 211 s for
the same model and mesh, and the save's time, which streams every rank's slices from the
checkpoint, against the disk's speed measured by copying the checkpoint's files.

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
PEER_LLAMA3_8B_S = 210.6  # autoparallel, Llama-3-8B, mesh (2, 4), end to end
H100_2X4 = {
    "cluster": [
        {
            "cluster_nodes": [
                {
                    "node_id": n,
                    "node_type": "DGX",
                    "ipaddr": f"10.0.0.{n + 1}",
                    "port": 29500,
                    "is_local": n == 0,
                    "item_list": [{"item_id": d, "device_id": d} for d in range(4)],
                }
                for n in range(2)
            ],
            "nodes_topology": {
                "type": "star",
                "protocol": "RDMA:400Gb",
                "topos": [{"plane_id": 0, "devices": [0, 1, 2, 3]}],
            },
        }
    ],
    "item_def": [{"item_type": "H100", "memory": "[HBM:80GB]"}],
    "node_def": [{"node_type": "DGX", "item_topology": [{"links_mode": "HCCS:3600Gb"}]}],
}


def gpt2(layers: int, training: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_head=12, n_layer=layers, vocab_size=50304, n_positions=1024)
    if training:  # programs draw no random numbers
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    return model if training else model.eval()


def llama3_8b(layers: int):
    """Llama-3-8B's shapes in bf16, its parameters on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tessel

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        with tessel.empty_weights():
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def write_checkpoint(model, folder: str, shard_bytes: int = 2 << 30) -> int:
    """Random values for every parameter of the meta `model`, written as the hub writes a
    checkpoint: safetensors shards and `model.safetensors.index.json`. Returns the bytes."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0
    generator = torch.Generator().manual_seed(0)

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, p in model.named_parameters():
        value = torch.empty(p.shape, dtype=p.dtype)
        value.uniform_(-0.02, 0.02, generator=generator)
        shard[name] = value
        total += value.nbytes
        if sum(t.nbytes for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return total


def disk_seconds(folder: str) -> float:
    """Seconds to read every file of `folder` and write a copy beside it (then removed)."""
    import shutil

    copy = folder.rstrip("/") + ".copy"
    t = time.perf_counter()
    shutil.copytree(folder, copy)
    os.sync()
    seconds = time.perf_counter() - t
    shutil.rmtree(copy)
    return seconds


def bench_llama3_8b(layers: int, batch: int, seq: int) -> None:
    """The meta-device Llama-3-8B case on 2 x 4 H100s (see the module's docstring)."""
    import tessel
    from tessel.config.cluster import cluster_from_dict

    model = llama3_8b(layers)
    ids = torch.randint(0, 128256, (batch, seq))
    cluster = cluster_from_dict(H100_2X4, "2 x 4 H100", "H100")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        folder = os.path.join(tmp, "llama3_8b")
        t = time.perf_counter()
        size = write_checkpoint(model, folder)
        print(
            f"wrote a {size / 1e9:.1f} GB checkpoint in {time.perf_counter() - t:.1f} s", flush=True
        )
        disk = disk_seconds(folder)
        t = time.perf_counter()
        built = tessel.build(
            model, {"input_ids": ids, "use_cache": False}, cluster=cluster, weights=folder
        )
        plan_s = time.perf_counter() - t
        t = time.perf_counter()
        package = built.save(os.path.join(tmp, "llama3_8b.tessel"))
        save_s = time.perf_counter() - t
        row = {
            "layers": layers,
            "tokens": [batch, seq],
            "mesh": built.manifest.mesh.to_json(),
            "phases_s": {k: round(v, 2) for k, v in built.timings.items()},
            "plan_s": round(plan_s, 2),
            "peer_total_s": PEER_LLAMA3_8B_S if layers == 32 else None,
            "checkpoint_GB": round(size / 1e9, 2),
            "package_GB": round(package.stat().st_size / 1e9, 2),
            "save_s": round(save_s, 2),
            "disk_copy_s": round(disk, 2),
        }
    print(json.dumps(row), flush=True)
    print()
    peer = f"{PEER_LLAMA3_8B_S / plan_s:.1f}x" if layers == 32 else "n/a"
    print(f"plan (all but the weights): {plan_s:.1f} s; autoparallel end to end 210.6 s: {peer}")
    print(f"save (weights streamed): {save_s:.1f} s; copying the checkpoint: {disk:.1f} s, "
          f"ratio {save_s / disk:.2f}")  # fmt: skip


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
        "--llama3-8b",
        action="store_true",
        help="Llama-3-8B's shapes from the meta device with a generated checkpoint, on 2 x 4 H100s",
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
    if args.llama3_8b:
        layers = args.layers[0] if args.layers != [2, 8, 32] else 32
        seq = args.seq if args.seq != 512 else 2048
        bench_llama3_8b(layers, args.batch, seq)
        return

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
        solver = built.manifest.plan.solver
        rows.append(
            {
                "layers": layers,
                "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                "phases_s": phases,
                "total_s": round(total, 2),
                "mesh": built.manifest.mesh.to_json(),
                "peer_total_s": peers.get(layers),
                "ratio": round(total / peers[layers], 3) if layers in peers else None,
                "decisions": solver.decisions,
                "ilp_variables": solver.variables,
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
