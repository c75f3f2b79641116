"""Benchmark 3 of issue 2: peak RSS per worker against the single-process model.

A Llama whose weights dominate (width 1024, 4 layers, about 330 MiB of fp32 weights) is built for
1, 2 and 4 CPU devices too small to hold replicated weights (each holds 1.05/N of the weights plus
the activations, so only small tensors can be replicated), loaded and run once. For each worker
we read its peak RSS (VmHWM) and its RSS after the run, subtract the peak RSS of an idle worker
(a process that imported torch and tessel's runtime and nothing else), and report what remains
as a fraction of the model's weight bytes. Both should fall as 1/N; the peak holds a rank's
weights twice for a moment (the checked bytes read from the file, then the tensors).

    python benchmarks/bench_memory.py [--devices 1 2 4] [--share 1.05]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

HIDDEN, LAYERS, HEADS, VOCAB = 1024, 4, 16, 8192


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def current_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def idle_worker_rss() -> int:
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
    from tessel.plan import has_rule

    torch.manual_seed(0)
    cfg = llama_config(LAYERS, HIDDEN, HEADS, vocab=VOCAB)
    model = LlamaForCausalLM(cfg).eval()
    weights = sum(p.numel() * 4 for p in model.parameters())
    kwargs = {"input_ids": torch.randint(0, VOCAB, (2, 64)), "use_cache": False}
    captured = capture(model, kwargs, keep=has_rule)
    idle = idle_worker_rss()
    print(f"model weights {weights / 2**20:.0f} MiB; idle worker peak RSS {idle / 2**20:.0f} MiB")
    print(f"single process holding the model: weight share 1.00 ({weights / 2**20:.0f} MiB)")
    print(
        f"{'devices':>7} {'peak RSS/worker MiB':>20} {'peak share':>11} {'RSS after run MiB':>18} {'steady share':>13} {'1/N':>6}"
    )
    for n in args.devices:
        tight = tight_cluster(captured, n, share=args.share)
        cluster = cluster_from_dict(tight, "tight") if n > 1 else 1
        built = tessel.build(captured, cluster=cluster, graph_parallel=n > 1)
        with tempfile.TemporaryDirectory() as tmp:
            path = built.save(os.path.join(tmp, "m"))
            tessel.initialize()
            try:
                session = tessel.Session()
                session.load_graph(0, {}, path)
                session.run_graph(0, [kwargs["input_ids"]])
                procs = session._graphs[0].procs
                peaks = [peak_rss(p.pid) for p in procs]
                steady = [current_rss(p.pid) for p in procs]
            finally:
                tessel.finalize()
        worst, now = max(peaks), max(steady)
        print(
            f"{n:>7} {worst / 2**20:>20.0f} {(worst - idle) / weights:>11.2f} "
            f"{now / 2**20:>18.0f} {(now - idle) / weights:>13.2f} {1 / n:>6.2f}"
        )


if __name__ == "__main__":
    main()
