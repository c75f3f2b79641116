"""How long a Session takes to start its workers and load a model, against torch's own launch.

A 1-layer Llama (width 64, vocab 256) built for N CPU devices. Side by side in one run:
  - torch: `torch.multiprocessing.start_processes` with the spawn start method, N processes that
    each join a gloo process group and meet at a barrier (what a torchrun-style launch costs
    before any model is loaded);
  - tessel, first session of the process: the fork server starts, N workers are forked from it,
    join their groups and load the package;
  - tessel, a later session (a new Session, no workers reused): the server is warm.
Each figure is the median of `--repeat` starts; the table gives the wall time, the CPU time of
the processes started (their user + system time), and each tessel figure over torch's.

    python benchmarks/bench_start.py [--devices 2 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _join(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def torch_start(world: int) -> tuple[float, float]:
    """Wall and CPU seconds of spawning `world` processes that join a gloo group."""
    cpu, t = _children_cpu(), time.perf_counter()
    mp.start_processes(_join, args=(world, _free_port()), nprocs=world, start_method="spawn")
    return time.perf_counter() - t, _children_cpu() - cpu


def tessel_start(path: Path, with_server: bool = False) -> tuple[float, float]:
    """Wall and CPU seconds of a new Session loading `path`, until its workers are ready: the
    workers' CPU since they were forked, and the fork server's where `with_server`."""
    import tessel

    t = time.perf_counter()
    with tessel.Session() as session:
        session.load_graph(0, {}, path)
        wall = time.perf_counter() - t
        started = [psutil.Process(p.pid) for p in session._graphs[0].procs]
        if with_server:
            started.append(started[0].parent())
        cpu = sum(sum(p.cpu_times()[:2]) for p in started)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from transformers import LlamaForCausalLM

    import tessel
    from tessel.demo import llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(1, 64, 4, vocab=256)).eval()
    ids = torch.randint(0, 256, (2, 16))
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessel-bench-start-") as tmp:
        for world in args.devices:
            path = tessel.save(tessel.build(model, (ids,), cluster=world), Path(tmp) / f"m{world}")
            peer = [torch_start(world) for _ in range(args.repeat)]
            tessel.initialize()
            try:
                cold = tessel_start(path, with_server=True)  # the fork server starts here
                warm = [tessel_start(path) for _ in range(args.repeat)]
            finally:
                tessel.finalize()
            rows.append((world, peer, cold, warm))

    def median(runs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in runs)

    print(f"{'N':>2}  {'torch spawn':>18}  {'tessel first':>18}  {'tessel later':>18}  "
          f"{'first/torch':>11}  {'later/torch':>11}")  # fmt: skip
    print(f"{'':>2}  {'wall s':>8} {'cpu s':>9}  {'wall s':>8} {'cpu s':>9}  {'wall s':>8} "
          f"{'cpu s':>9}  {'wall':>11}  {'wall':>11}")  # fmt: skip
    for world, peer, cold, warm in rows:
        p_wall, p_cpu = median(peer, 0), median(peer, 1)
        w_wall, w_cpu = median(warm, 0), median(warm, 1)
        print(
            f"{world:>2}  {p_wall:8.2f} {p_cpu:9.1f}  {cold[0]:8.2f} {cold[1]:9.1f}  "
            f"{w_wall:8.2f} {w_cpu:9.1f}  {cold[0] / p_wall:11.2f}  {w_wall / p_wall:11.2f}"
        )
    print("tessel's times include loading the model; its first CPU time includes the server's")


if __name__ == "__main__":
    main()
