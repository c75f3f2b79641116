"""Training step time against torch's own data and tensor parallelism, and the memory a rank
holds for weights, gradients and optimizer states against ZeRO's formula.

Llama (4 layers, width 256, 8 heads, vocab 8192, seq 128, global batch 8), fp32, AdamW, four
CPU processes. Side by side in one run, every setting afresh in each of `--rounds` rounds:
  - torch DDP (`DistributedDataParallel`) against tessel with data_parallel_size 4;
  - torch FSDP2 (`fully_shard` on every layer and the root) against tessel with
    data_parallel_size 4 and weight sharding with prefetch (ZeRO-3, as FSDP2 is), and with
    optimizer state and gradient sharding alone (ZeRO-2);
  - torch FSDP2 + TP on a 2 x 2 mesh (the Megatron plan on `tp`, `fully_shard` over `dp`, as
    torchtitan composes them) against tessel with data_parallel_size 2 x tensor_parallel_size 2.
Each figure is the median step time of 10 steps after 3 warm-up steps (torch: rank 0 between
barriers, so the slowest rank's; tessel: `Session.run_graph`, which also hands the batch to the
workers). tessel runs with its default CPU allocation (the block cache of
`tessel.runtime.cpu_cache`: freed blocks reused, never more held than the program's peak in
use), and with `tessel.reuse_freed_memory` (glibc's own policy, as torch's processes run).

Memory: each worker's peak of anonymous memory over steps 2 and 3 (VmHWM, reset after the first
step, less the file-backed pages resident when it was reset: shared library code is not what a
rank holds), less the anonymous memory of a process that does what every torch training
process does without a model (imports what a worker imports, joins a one-rank gloo group, and
steps torch's AdamW over one weight), against ZeRO's formula for the level plus the plan's
activations: none 16P, optimizer state sharding 8P + 8P/dp, + gradient sharding 4P + 12P/dp,
+ weight sharding 16P/dp plus the largest gathered layer and the prefetch buffer (fp32 AdamW,
P the parameters a rank holds: all of them over tp). Workers run with tessel's default. With
pipeline stages (pp 2 x dp 2, pp 4), each rank's peak against 16P for the weights its stage
trains plus the activations its plan counts for the stage's passes held in 1F1B order.

Weight prefetch: ZeRO-3 step time without prefetch, with the default buffer (the largest
layer) and with a buffer of three layers, and the most prefetched bytes a rank held at once
(`Session.training_stats`) against the buffer.

    python benchmarks/bench_training.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 8192, 128, 8
WARMUP, REPEAT, WORLD = 3, 10, 4


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(LAYERS, HIDDEN, HEADS, vocab=VOCAB))


def batch() -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron(model: torch.nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):  # fmt: skip
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    # each rank holds its heads: the attention reshapes by the local head count
    for layer in model.model.layers:
        layer.self_attn.config = copy.copy(layer.self_attn.config)
        layer.self_attn.config.num_attention_heads //= tp_mesh.size()
        layer.self_attn.config.num_key_value_heads //= tp_mesh.size()


def fsdp2_tp(model: torch.nn.Module, data: dict, rank: int) -> dict:
    """Compose `model` as torchtitan does on a dp 2 x tp 2 mesh (the Megatron plan on `tp`,
    `fully_shard` over `dp`); returns the rows of `data` this rank's replica takes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _megatron(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    rows, replica = BATCH // 2, rank // 2
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in data.items()}


def _torch_worker(rank: int, kind: str, port: int, threads: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    model = llama()
    data = batch()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        rows = BATCH // WORLD
        mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in data.items()}
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = BATCH // WORLD
        mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in data.items()}
    else:
        mine = fsdp2_tp(model, data, rank)
    opt = adamw(model)
    times = []
    for i in range(WARMUP + REPEAT):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        model(**mine).loss.backward()
        opt.step()
        dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def torch_step_ms(kind: str, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_torch_worker, args=(kind, _free_port(), threads, out), nprocs=WORLD)
        with open(out) as f:
            return 1e3 * statistics.median(json.load(f))


ZERO2 = ("optimizer_state_sharding", "gradient_sharding")
ZERO3 = ("model_weight_sharding", "model_weight_prefetch")


def build(
    tmp: str,
    dp: int,
    tp: int,
    sharding: tuple[str, ...],
    buffer_mb: int = 0,
    pp: int = 1,
    micro: int = 1,
) -> str:
    import tessel

    g: dict = {
        "auto": False,
        "tensor_parallel_option": {"tensor_parallel_size": tp},
        "data_parallel_option": {"data_parallel_size": dp},
    }
    if pp > 1:
        g["pipeline_parallel_option"] = {"pipe_stage_num": pp, "micro_batch_num": micro}
    if sharding:
        g["tensor_sharding"] = {k: True for k in sharding}
    if buffer_mb:
        g["tensor_sharding"]["model_weight_prefetch_buffer_size"] = buffer_mb
    name = f"{pp}x{dp}x{tp}_{'_'.join(sharding)}_{buffer_mb}"
    policy = os.path.join(tmp, f"policy_{name}.json")
    with open(policy, "w") as f:
        json.dump({"graph_parallel_option": g}, f)
    model = llama()
    built = tessel.build(model, batch(), cluster=WORLD, policy=policy, optimizer=adamw(model))
    return str(built.save(os.path.join(tmp, f"train_{name}")))


def tessel_step_ms(path: str, threads: int, glibc: bool) -> tuple[float, dict]:
    import tessel

    data = batch()
    tessel.initialize({"ge.graphRunMode": "1"})
    try:
        with tessel.Session() as session:
            options = {"tessel.threads_per_worker": threads, "tessel.reuse_freed_memory": glibc}
            session.load_graph(0, options, path)
            times = []
            for i in range(WARMUP + REPEAT):
                t = time.perf_counter()
                session.run_graph(0, data)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t)
            stats = session.training_stats(0)
    finally:
        tessel.finalize()
    return 1e3 * statistics.median(times), stats


def _status(text: str, key: str) -> int:
    """A memory line of a /proc/<pid>/status `text`, in bytes."""
    line = next(x for x in text.splitlines() if x.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def _status_of(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return _status(f.read(), key)


def baseline_anonymous() -> int:
    """Anonymous memory of a process that does what every torch training process does, without
    a model: imports what a worker imports, joins a one-rank gloo group, steps torch's AdamW."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist, tessel.runtime.worker;"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{_free_port()}',"
        " rank=0, world_size=1);"
        "w = torch.nn.Parameter(torch.zeros(1)); opt = torch.optim.AdamW([w]);"
        "w.grad = torch.zeros(1); opt.step();"
        "print(open('/proc/self/status').read())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return _status(out.stdout, "RssAnon")


def measured_peaks(path: str, threads: int, steps: int = 3) -> list[int]:
    """Each worker's peak of anonymous memory over steps 2 to `steps`, with tessel's default:
    the peak resident set from the first step's end on, less the file-backed pages resident
    then (they only grow, so this bounds the anonymous peak from above)."""
    import tessel

    data = batch()
    tessel.initialize({"ge.graphRunMode": "1"})
    try:
        with tessel.Session() as session:
            session.load_graph(0, {"tessel.threads_per_worker": threads}, path)
            session.run_graph(0, data)
            procs = session._graphs[0].workers.procs
            files = []
            for p in procs:
                with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the resident set now
                files.append(_status_of(p.pid, "RssFile"))
            for _ in range(steps - 1):
                session.run_graph(0, data)
            return [_status_of(p.pid, "VmHWM") - f for p, f in zip(procs, files)]
    finally:
        tessel.finalize()


def rank0_params(path: str) -> int:
    """The trained parameters rank 0 holds (its shards of them)."""
    from tessel.package.format import Package

    package = Package.open(path)
    held = package.weights(package.submodel(0))
    return sum(held[n].numel() for n in package.manifest.training.gradients)


def activation_bytes(path: str) -> int:
    """The plan's activations at their peak: its predicted peak less what the weights take."""
    from tessel.package.format import Package

    memory = Package.open(path).manifest.plan.memory
    return int(memory.peak_bytes - memory.weight_bytes)


def largest_layer_bytes(path: str) -> int:
    """The most bytes rank 0 gathers for one unit of weights (fp32)."""
    from tessel.package.format import Package

    package = Package.open(path)
    held = package.weights(package.submodel(0))
    return max(4 * sum(held[n].numel() for n in unit) for unit in package.manifest.training.units)


def zero_formula(params: int, dp: int, level: str, path: str) -> int:
    if level == "none":
        return 16 * params
    if level == "optimizer_state_sharding":
        return 8 * params + 8 * params // dp
    if level == "gradient_sharding":
        return 4 * params + 12 * params // dp
    from tessel.package.format import Package

    prefetch = Package.open(path).manifest.training.weight_prefetch_bytes
    return 16 * params // dp + largest_layer_bytes(path) + prefetch


def pipeline_memory(tmp: str, threads: int, base: int) -> None:
    """Each rank of a training package in pipeline stages (pp 2 x dp 2, 2 micro-batches; pp 4,
    4 micro-batches): its measured peak against 16P for its weights plus the activations
    its plan counts for its stage (the rank's planned peak less its weights)."""
    from tessel.package.format import Package

    print()
    print("pipeline stages: peak anonymous memory per rank against 16P + the stage's planned "
          "activations")  # fmt: skip
    print(
        f"{'mesh':12} {'rank':>4} {'P/rank':>9} {'16P MiB':>8} {'+ act.':>7} {'measured':>9}  ratio"
    )
    for pp, dp, micro in ((2, 2, 2), (4, 1, 4)):
        path = build(tmp, dp, 1, (), pp=pp, micro=micro)
        package = Package.open(path)
        manifest = package.manifest
        peaks = measured_peaks(path, threads)
        for rank, sub in enumerate(manifest.submodels):
            held = package.weights(sub)
            params = sum(held[n].numel() for n in manifest.training.gradients if n in held)
            line = manifest.plan.ranks[rank]
            act = line.peak_bytes - line.weight_bytes
            got = peaks[rank] - base
            print(
                f"{f'pp {pp} x dp {dp}':12} {rank:4d} {params:9d} {16 * params / 2**20:8.1f} "
                f"{act / 2**20:7.1f} {got / 2**20:9.1f}  {got / (16 * params + act):.2f}"
            )


def _describe(setting: tuple) -> str:
    dp, tp, sharding = setting
    level = {(): "", ZERO2: " zero2", ZERO3: " zero3"}[sharding]
    return f"dp {dp} x tp {tp}{level}"


def prefetch_figure(tmp: str, threads: int, rounds: int) -> None:
    """ZeRO-3 step time without prefetch, with the default buffer and with three layers'
    worth, and the measured peak of prefetched bytes against each buffer."""
    default = build(tmp, WORLD, 1, ZERO3)
    three = max(1, -(-3 * largest_layer_bytes(default) // 2**20))
    variants = {
        "no prefetch": build(tmp, WORLD, 1, ("model_weight_sharding",)),
        "default buffer": default,
        f"{three} MB buffer": build(tmp, WORLD, 1, ZERO3, buffer_mb=three),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    stats: dict[str, dict] = {}
    for _ in range(rounds):
        for name, path in variants.items():
            ms, stats[name] = tessel_step_ms(path, threads, False)
            times[name].append(ms)
    print()
    print("weight prefetch (dp 4 zero3): step time, ms (median over rounds), and the most")
    print("prefetched bytes a rank held at once against the buffer")
    base = statistics.median(times["no prefetch"])
    print(f"{'':16} {'step ms':>8} {'vs none':>8} {'buffer B':>10} {'peak B':>10}")
    for name in variants:
        ms = statistics.median(times[name])
        s = stats[name]
        print(
            f"{name:16} {ms:8.1f} {ms / base:8.2f} {s['prefetch_bytes']:10d} "
            f"{s['prefetch_peak_bytes']:10d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="skip the step times")
    parser.add_argument(
        "--memory-model",
        nargs=3,
        type=int,
        metavar=("LAYERS", "WIDTH", "VOCAB"),
        help="the Llama of the memory figure (default: the step-time model)",
    )
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // WORLD)
    settings = [
        ("ddp", "DDP", (4, 1, ())),
        ("fsdp2", "FSDP2", (4, 1, ZERO3)),
        ("fsdp2", "FSDP2", (4, 1, ZERO2)),
        ("fsdp2_tp", "FSDP2 + TP 2x2", (2, 2, ())),
    ]
    rows: dict[tuple, dict[str, list[float]]] = {}
    levels = {
        "dp 4, no sharding": (4, 1, ()),
        "dp 4, optimizer state sharding": (4, 1, ("optimizer_state_sharding",)),
        "dp 4, + gradient sharding": (4, 1, ZERO2),
        "dp 4, + weight sharding, prefetch": (4, 1, ZERO3),
        "dp 2 x tp 2, + gradient sharding": (2, 2, ZERO2),
    }
    base = baseline_anonymous()
    global LAYERS, HIDDEN, VOCAB
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for _, _, setting in settings if not args.memory_only else ():
            t = time.perf_counter()
            paths[setting] = build(tmp, *setting)
            print(f"built tessel {_describe(setting)} in {time.perf_counter() - t:.1f} s")
        for r in range(0 if args.memory_only else args.rounds):
            peers: dict[str, float] = {}
            for kind, name, setting in settings:
                row = rows.setdefault(setting, {"torch": [], "default": [], "glibc": []})
                if kind not in peers:
                    peers[kind] = torch_step_ms(kind, threads)
                row["torch"].append(peers[kind])
                row["default"].append(tessel_step_ms(paths[setting], threads, False)[0])
                row["glibc"].append(tessel_step_ms(paths[setting], threads, True)[0])
                print(
                    f"round {r + 1}: {name}: torch {row['torch'][-1]:.1f} ms, tessel "
                    f"{_describe(setting)} {row['default'][-1]:.1f} ms (default) / "
                    f"{row['glibc'][-1]:.1f} ms (glibc's policy)"
                )
        print()
        print("step time, ms (median over rounds; ratio tessel/torch, range over rounds)")
        print(f"{'peer':16} {'torch':>8} {'tessel mesh':24} {'allocation':12} {'tessel':>8}  ratio")
        for _, name, setting in settings if rows else ():
            row = rows[setting]
            for mode in ("default", "glibc"):
                ratios = [a / b for a, b in zip(row[mode], row["torch"])]
                print(
                    f"{name:16} {statistics.median(row['torch']):8.1f} {_describe(setting):24} "
                    f"{mode:12} {statistics.median(row[mode]):8.1f}  "
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                )
        if not args.memory_only:
            prefetch_figure(tmp, threads, args.rounds)
        print()
        if args.memory_model:
            LAYERS, HIDDEN, VOCAB = args.memory_model
        print(f"Llama {LAYERS} layers, width {HIDDEN}, vocab {VOCAB}: peak anonymous memory per "
              "rank against ZeRO's formula (fp32 AdamW) plus the plan's activations")  # fmt: skip
        print(
            f"(a worker's peak less the {base / 2**20:.0f} MiB of a torch training process without "
            "a model)"
        )
        header = f"{'tessel':36} {'P/rank':>9} {'ZeRO MiB':>9} {'+ act.':>7} {'measured':>9}  ratio"
        print(header)
        for name, (dp, tp, sharding) in levels.items():
            path = build(tmp, dp, tp, sharding)
            params = rank0_params(path)
            level = "none" if not sharding else sharding[-1]
            level = "weight_sharding" if sharding == ZERO3 else level
            formula = zero_formula(params, dp, level, path)
            act = activation_bytes(path)
            worst = max(measured_peaks(path, threads)) - base
            print(
                f"{name:36} {params:9d} {formula / 2**20:9.1f} {act / 2**20:7.1f} "
                f"{worst / 2**20:9.1f}  {worst / (formula + act):.2f}"
            )
        pipeline_memory(tmp, threads, base)


if __name__ == "__main__":
    main()
