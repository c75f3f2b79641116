"""Pre-sliced models: run_graph latency of slices exported from torch TP, against torch TP itself.

The Llama of bench_run (4 layers, width 256, 8 heads, vocab 8192, seq 128, batch 4, fp32) is
parallelised with torch's `parallelize_module` (the Megatron plan) on N gloo processes. Each
process times torch TP's forward (the median of 20 runs after 3 warm-up runs, the slowest rank)
and then writes its slice with `tessel.export_slice`. tessel then builds the slices into one
package (timed) and a Session runs it on N workers, the inputs given to and the whole output
returned to the calling process, with the workers' default memory policy and with
`tessel.reuse_freed_memory`. Every round runs all of it afresh (N processes share this
machine's cores); the table shows medians over the rounds and the range of the ratios.

    python benchmarks/bench_slices.py [--devices 2 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

import bench_run
from bench_run import LAYERS, REPEAT, WARMUP, inputs, llama, megatron_plan


def _rank(rank: int, world: int, port: int, threads: int, folder: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import tessel

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = llama()
    ids = inputs()
    parallelize_module(model, init_device_mesh("cpu", (world,)), megatron_plan())
    times = []
    with torch.no_grad():
        for i in range(WARMUP + REPEAT):
            dist.barrier()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            dist.barrier()
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
    worst = torch.tensor(times)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    t = time.perf_counter()
    tessel.export_slice(model, (), folder, example_kwargs={"input_ids": ids, "use_cache": False})
    if rank == 0:
        out["torch_ms"] = 1e3 * statistics.median(worst.tolist())
        out["export_s"] = time.perf_counter() - t
    model = None  # its DTensors hold the process group: release it before destroying the group
    gc.collect()
    dist.destroy_process_group()


def one_round(world: int, threads: int) -> dict:
    import tessel
    from tessel.config.cluster import local_cluster

    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        out = manager.dict()
        folder = os.path.join(tmp, "slices")
        port = bench_run._free_port()
        mp.spawn(_rank, args=(world, port, threads, folder, out), nprocs=world, join=True)
        result = dict(out)
        manager.shutdown()
        t = time.perf_counter()
        built = tessel.build_from_slices(
            folder, os.path.join(folder, "model_relation_config.json"), local_cluster(world)
        )
        path = built.save(os.path.join(tmp, "tp"))
        result["build_s"] = time.perf_counter() - t
        ids = inputs()
        with torch.no_grad():
            expected = llama()(input_ids=ids, use_cache=False).logits
        for reuse in (False, True):
            tessel.initialize()
            try:
                session = tessel.Session()
                options = {"tessel.threads_per_worker": threads, "tessel.reuse_freed_memory": reuse}
                session.load_graph(0, options, path)
                times = []
                for i in range(WARMUP + REPEAT):
                    t = time.perf_counter()
                    (logits,) = session.run_graph(0, [ids])
                    if i >= WARMUP:
                        times.append(time.perf_counter() - t)
            finally:
                tessel.finalize()
            key = "reused" if reuse else "returned"
            result[f"tessel_ms_{key}"] = 1e3 * statistics.median(times)
            result["max_abs_diff"] = max(
                result.get("max_abs_diff", 0.0), (logits - expected).abs().max().item()
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    for world in args.devices:
        threads = max(1, cores // world)
        runs = []
        for r in range(args.rounds):
            runs.append(one_round(world, threads))
            print(f"{world} processes, round {r}: {runs[-1]}", flush=True)
        rows.append((world, runs))
    print(f"\nLlama {LAYERS} layers, width 256, vocab 8192, batch 4 x 128; medians of the rounds")
    print(
        f"{'procs':>5} {'torch TP ms':>11} {'freed memory':<13} {'tessel ms':>9} "
        f"{'ratio (range)':>18} {'export s':>8} {'build s':>7} {'max diff':>9}"
    )
    for world, runs in rows:
        torch_ms = statistics.median(r["torch_ms"] for r in runs)
        for key in ("returned", "reused"):
            ratios = [r[f"tessel_ms_{key}"] / r["torch_ms"] for r in runs]
            print(
                f"{world:>5} {torch_ms:>11.1f} {key:<13} "
                f"{statistics.median(r[f'tessel_ms_{key}'] for r in runs):>9.1f} "
                f"{statistics.median(ratios):>6.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                f"{statistics.median(r['export_s'] for r in runs):>8.2f} "
                f"{statistics.median(r['build_s'] for r in runs):>7.2f} "
                f"{max(r['max_abs_diff'] for r in runs):>9.1e}"
            )


if __name__ == "__main__":
    main()
