"""Benchmark 3: each worker's peak memory, as the build predicts it and as measured.

A Llama whose weights dominate (width 1024, 4 layers, about 330 MiB of fp32 weights) is built for
1, 2 and 4 CPU devices too small to hold replicated weights (each holds 1.05/N of the weights plus
the activations, so only small tensors can be replicated), loaded and run 4 times.

The build predicts each rank's peak (`plan.ranks[].peak_bytes` in the manifest: the rank's
weights plus the most activation bytes its program holds at once). We measure it in the worker:
its peak RSS (VmHWM) once it is idle, having loaded and run a one-layer model of the same shape,
so that what any worker holds before a model (torch, tessel's runtime, the process group, the
kernels' code) is counted; then, in the same worker (the session reuses it), its peak RSS after
it loaded the model, after one run and after all. The difference is what the model costs the
worker; the ratio is measured/predicted after all runs, over the ranks.

Workers fix glibc's mmap threshold at 128 KiB (see `runtime/worker.py`), so each activation is
mapped when made and returned when freed and a worker holds what its program holds (the session
option `tessel.reuse_freed_memory` turns this off, for speed). Beyond the
program's tensors a worker also holds the program itself and what the first run of its kernels
allocates once (a few MiB), and rank 0 copies its outputs into shared memory for the pipe to the
session.

    python benchmarks/bench_memory.py [--devices 1 2 4] [--share 1.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HIDDEN, LAYERS, HEADS, VOCAB = 1024, 4, 16, 8192
MIB = 2**20


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def idle_process_rss() -> int:
    """Peak RSS of a process that imported torch and tessel's runtime and nothing else."""
    code = "import torch, tessel.runtime.worker, tessel.lower.program; print(open('/proc/self/status').read())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    line = next(s for s in out.splitlines() if s.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--share",
        type=float,
        default=1.05,
        help="device memory: this many N-ths of the weights, plus the activations",
    )
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    import tessel
    from tessel.capture import capture
    from tessel.config.cluster import cluster_from_dict
    from tessel.demo import llama_config, tight_cluster
    from tessel.package import Package
    from tessel.plan import has_rule

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(LAYERS, HIDDEN, HEADS, vocab=VOCAB)).eval()
    weights = sum(p.numel() * 4 for p in model.parameters())
    ids = torch.randint(0, VOCAB, (2, 64))
    captured = capture(model, {"input_ids": ids, "use_cache": False}, keep=has_rule)
    small = LlamaForCausalLM(llama_config(1, 64, 4, vocab=256)).eval()
    small_ids = torch.randint(0, 256, (2, 16))
    print(
        f"model weights {weights / MIB:.0f} MiB; a process that imported torch and tessel's "
        f"runtime peaks at {idle_process_rss() / MIB:.0f} MiB RSS"
    )
    print(
        f"{'devices':>7} {'idle worker':>12} {'predicted':>10} "
        f"{'after load':>11} {'1 run':>10} {f'{RUNS} runs':>10} {'measured/predicted':>19} "
        f"{'run':>8}"
    )
    for n in args.devices:
        tight = tight_cluster(captured, n, share=args.share)
        cluster = cluster_from_dict(tight, "tight") if n > 1 else 1
        with tempfile.TemporaryDirectory() as tmp:
            path = tessel.build(captured, cluster=cluster, graph_parallel=n > 1).save(
                os.path.join(tmp, "m")
            )
            warm = tessel.build(
                small,
                example_kwargs={"input_ids": small_ids, "use_cache": False},
                cluster=cluster,
                graph_parallel=n > 1,
                verify=False,
            ).save(os.path.join(tmp, "small"))
            ranks = Package.open(path).manifest.plan.ranks
            predicted = [r.peak_bytes for r in sorted(ranks, key=lambda r: r.rank)]
            idle, loaded, first, ran, run_s = measure(path, ids, warm, small_ids)
            ratios = [m / p for m, p in zip(ran, predicted)]
            spread = f"{min(ratios):.2f}" + (f"-{max(ratios):.2f}" if n > 1 else "")
            print(
                f"{n:>7} {max(idle) / MIB:>8.0f} MiB "
                f"{max(predicted) / MIB:>6.1f} MiB {max(loaded) / MIB:>7.1f} MiB "
                f"{max(first) / MIB:>6.1f} MiB {max(ran) / MIB:>6.1f} MiB {spread:>19} "
                f"{1e3 * run_s:>5.0f} ms",
                flush=True,
            )


def measure(
    path: str, ids: torch.Tensor, warm: str, warm_ids: torch.Tensor
) -> tuple[list[int], list[int], list[int], list[int], float]:
    """Each worker's peak RSS when idle, and above that after loading `path`, after one run and
    after `RUNS`; and the median time of a run after the first."""
    import tessel

    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, warm)
        session.run_graph(0, [warm_ids])
        pids = [p.pid for p in session._graphs[0].procs]
        session.remove_graph(0)
        idle = [peak_rss(p) for p in pids]
        session.load_graph(1, {}, path)
        assert [p.pid for p in session._graphs[1].procs] == pids, "the workers were not reused"
        loaded = [peak_rss(p) - i for p, i in zip(pids, idle)]
        times, first = [], []
        for _ in range(RUNS):
            t = time.perf_counter()
            session.run_graph(1, [ids])
            times.append(time.perf_counter() - t)
            first = first or [peak_rss(p) - i for p, i in zip(pids, idle)]
        ran = [peak_rss(p) - i for p, i in zip(pids, idle)]
    finally:
        tessel.finalize()
    return idle, loaded, first, ran, statistics.median(times[1:])


RUNS = 4


if __name__ == "__main__":
    main()
