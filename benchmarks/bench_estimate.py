"""The cost model against this machine: the planner's estimated time per run beside the measured.

Every family of the differential suite (tests/differential/zoo.py: width 64, 2 layers, seq 16)
is built for 2, 3 and 4 CPU devices of the default cluster, and a training step (the Llama of
the zoo with AdamW, data_parallel_size 2 x tensor_parallel_size 1 and tensor parallel 2).
For each, the table sets the plan's estimate (`manifest.plan.estimated_time_s`) beside
the median of `Session.run_graph` over 30 runs after 3 warm-up runs (one session; workers are
reused between packages of the same device count), and the ratio measured / estimated. The
cost model is meant to keep that ratio within 0.67-1.5; the last line counts the rows that do.
`--width` scales the zoo's width (heads stay 4) and `--batch` the batch, so that compute, not
fixed costs, dominates; the zoo's own sizes are the default.

`--micro` first measures the terms the cost model is made of on this machine, each with the
host's cores shared as a build's devices share them: a matmul's FLOP/s and a large copy's
bytes/s in each of N processes at once (N = 1, 2, 4, one thread each), and the time of a gloo
all_reduce between N local processes at 4 B (latency) and 4 MiB (bandwidth), a program's small
operators run by N processes at once (how much slower than their share of the cores they run)
and an all_gather between those operators (a collective step between processes that were
computing, the latency the planner uses), beside the figures of the "cpu" soc profile.

The host's load average is printed before and after: figures taken while other work shares the
cores are not the model's to meet.

    python benchmarks/bench_estimate.py [--devices 2 3 4] [--families gpt2 llama]
    python benchmarks/bench_estimate.py --width 256 --batch 4
    python benchmarks/bench_estimate.py --micro
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WARMUP, REPEAT = 3, 30
ZOO = Path(__file__).resolve().parent.parent / "tests" / "differential" / "zoo.py"
ZOO_SIZES = "HIDDEN, HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 256, 16"
LOW, HIGH = 0.67, 1.5


def zoo(width: int):
    """The differential suite's model zoo, its width set to `width` (64 is the zoo's own)."""
    source = ZOO.read_text()
    if ZOO_SIZES not in source:
        raise SystemExit(f"{ZOO} no longer sets its sizes as {ZOO_SIZES!r}: update this benchmark")
    source = source.replace(ZOO_SIZES, ZOO_SIZES.replace("= 64,", f"= {width},"))
    spec = importlib.util.spec_from_loader(f"zoo_w{width}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, str(ZOO), "exec"), module.__dict__)
    return module


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def measure(session, path: str, inputs) -> float:
    """Median seconds of `run_graph` after warm-up, the package loaded as graph 0."""
    session.load_graph(0, {}, path)
    try:
        times = []
        for i in range(WARMUP + REPEAT):
            t = time.perf_counter()
            session.run_graph(0, inputs)
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
    finally:
        session.remove_graph(0)
    return statistics.median(times)


def inference_rows(families, devices: list[int], batch: int, tmp: str) -> list[tuple]:
    import tessel

    rows = []
    with tessel.Session() as session:
        for world in devices:
            for name, spec in families.items():
                model = spec.make()
                inputs = spec.inputs(batch)
                built = tessel.build(model, inputs, cluster=world)
                path = str(built.save(os.path.join(tmp, f"{name}_{world}")))
                estimate = built.manifest.plan.estimated_time_s
                measured = measure(session, path, list(inputs))
                rows.append((name, world, estimate, measured))
                print(f"  {name} x{world}: {fmt(rows[-1])}", flush=True)
    return rows


def training_rows(families, batch: int, tmp: str) -> list[tuple]:
    """A training step of the zoo's Llama (loss from labels, AdamW): dp 2, and tp 2."""
    import tessel
    from tessel.config.parallel_option import parallel_option_from_dict

    spec = families["llama"]
    rows = []
    tessel.initialize({"ge.graphRunMode": "1"})
    try:
        with tessel.Session() as session:
            for label, dp, tp in (("llama train dp2", 2, 1), ("llama train tp2", 1, 2)):
                model = spec.make().train().model  # the causal LM: its loss from labels
                (ids,) = spec.inputs(2 * batch)
                data = {"input_ids": ids, "labels": ids}
                sizes = {
                    "auto": False,
                    "tensor_parallel_option": {"tensor_parallel_size": tp},
                    "data_parallel_option": {"data_parallel_size": dp},
                }
                policy = parallel_option_from_dict({"graph_parallel_option": sizes}, "policy")
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                built = tessel.build(model, data, cluster=2, policy=policy, optimizer=optimizer)
                path = str(built.save(os.path.join(tmp, label.replace(" ", "_"))))
                estimate = built.manifest.plan.estimated_time_s
                rows.append((label, 2, estimate, measure(session, path, data)))
                print(f"  {label}: {fmt(rows[-1])}", flush=True)
    finally:
        tessel.finalize()
    return rows


def fmt(row: tuple) -> str:
    name, world, estimate, measured = row
    ratio = measured / estimate if estimate else float("inf")
    return f"{name:<16} {world:>7} {1e3 * estimate:>12.3f} {1e3 * measured:>11.3f} {ratio:>7.2f}"


# -- microbenchmarks of the cost model's terms ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compute_worker(rank: int, n: int, port: int, out: dict) -> None:
    """A matmul's FLOP/s and a copy's bytes/s, all `n` processes running them at once."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    size = 256
    a, b = torch.randn(size, size), torch.randn(size, size)
    big = torch.randn(16 * 2**20 // 4)  # 16 MiB: past the caches
    dst = torch.empty_like(big)
    x = torch.randn(2, 16, 64)
    add = torch.ops.aten.add.Tensor
    figures = {}
    for what, work, amount in (
        ("flops", lambda: torch.mm(a, b), 2 * size**3),
        ("bytes", lambda: dst.copy_(big), 2 * big.numel() * 4),
        ("ops", lambda: add(x, x), 1),  # a small operator: what dispatching one costs
    ):
        work()
        dist.barrier()
        t, count = time.perf_counter(), 0
        while time.perf_counter() - t < 1.0:
            work()
            count += 1
        figures[what] = count * amount / (time.perf_counter() - t)
    out[rank] = figures
    dist.destroy_process_group()


def _collective_worker(rank: int, n: int, port: int, out: dict) -> None:
    """Median seconds of a gloo all_reduce of 4 B and of 4 MiB between `n` local processes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    figures = {}
    for nbytes in (4, 4 * 2**20):
        x = torch.zeros(nbytes // 4)
        times = []
        for _ in range(40 if nbytes == 4 else 10):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        figures[nbytes] = statistics.median(times[3:])
    out[rank] = figures
    dist.destroy_process_group()


def _program_worker(rank: int, n: int, port: int, out: dict) -> None:
    """What `n` processes sharing the host's cores make of a program: rank 0's word to run,
    `ops` small operators on every rank, and a gather to rank 0 (median seconds, by `ops`);
    and the same 400 operators with 8 all_gathers between them (`amid`), to price a
    collective between processes that were computing."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x, word = torch.randn(2, 16, 64), torch.zeros(1)
    add, gather = torch.ops.aten.add.Tensor, torch.ops._c10d_functional.all_gather_into_tensor
    wait = torch.ops._c10d_functional.wait_tensor
    figures = {}
    for ops, collectives in ((100, 0), (1600, 0), (400, 0), (400, 8)):
        times = []
        for _ in range(60):
            dist.broadcast(word, 0)
            t = time.perf_counter()
            for i in range(ops):
                y = add(x, x)
                if collectives and i % (ops // collectives) == 0:
                    wait(gather(y, n, "0"))
            dist.gather(y, [torch.empty_like(y) for _ in range(n)] if rank == 0 else None)
            times.append(time.perf_counter() - t)
        figures[ops, collectives] = statistics.median(times[10:])
    out[rank] = figures
    dist.destroy_process_group()


def _spawn(fn, n: int) -> list[dict]:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(fn, args=(n, _free_port(), out), nprocs=n, join=True)
    result = [out[r] for r in range(n)]
    manager.shutdown()
    return result


def program_terms(cores: int) -> None:
    """The slowdown of processes that outnumber the cores, beyond their share of them, and the
    cost of a collective step between processes that were computing, beside the cpu profile's."""
    from tessel.config.soc import SOCS

    cpu = SOCS["cpu"]
    print(f"{'procs':>5} {'us per op':>10} {'slowdown past share':>20} {'planner':>8} "
          f"{'collective step amid ops, us':>29} {'planner':>8}")  # fmt: skip
    single = None
    for n in (1, 2, 3, 4):
        f = _spawn(_program_worker, n)[0]  # rank 0's: it waits for the gather
        per_op = (f[1600, 0] - f[100, 0]) / 1500
        single = single or per_op
        share = min(1.0, cores / n)
        slowdown = per_op / single * share
        planned = cpu.shared_core_slowdown if share < 1 else 1.0
        step = (f[400, 8] - f[400, 0]) / 8 / max(n - 1, 1) if n > 1 else 0.0
        print(f"{n:>5} {1e6 * per_op:>10.2f} {slowdown:>20.2f} {planned:>8.2f} "
              f"{1e6 * step:>29.0f} {1e6 * cpu.link_latency:>8.0f}", flush=True)  # fmt: skip


def session_overhead(devices: list[int]) -> None:
    """`run_graph` of a model of one small operator: what a run costs beside its program."""
    import tessel

    class One(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    x = torch.zeros(4, 8)
    print(f"{'devices':>7} {'run_graph of one op, ms':>24} {'estimate ms':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        tessel.initialize()
        try:
            with tessel.Session() as session:
                for world in devices:
                    built = tessel.build(One(), (x,), cluster=world)
                    path = str(built.save(os.path.join(tmp, f"one_{world}")))
                    seconds = measure(session, path, [x])
                    estimate = built.manifest.plan.estimated_time_s
                    print(f"{world:>7} {1e3 * seconds:>24.3f} {1e3 * estimate:>12.3f}", flush=True)
        finally:
            tessel.finalize()


def micro() -> None:
    from tessel.config.soc import SOCS
    from tessel.plan.cost import all_reduce_time

    cpu = SOCS["cpu"]
    cores = os.cpu_count() or 1
    print(f"soc 'cpu': {cpu.peak_flops / 1e9:.0f} GFLOP/s, {cpu.memory_bandwidth / 1e9:.1f} GB/s "
          f"per host ({cores} cores here), link {cpu.link_bandwidth / 1e9:.2f} GB/s, "
          f"latency {1e6 * cpu.link_latency:.0f} us")  # fmt: skip
    print(f"{'procs':>5} {'GFLOP/s each':>13} {'GB/s copy each':>15} {'us per small op':>16} "
          f"{'planner GFLOP/s each':>21}")  # fmt: skip
    for n in (1, 2, 4):
        figures = _spawn(_compute_worker, n)
        share = min(1.0, cores / n)
        print(
            f"{n:>5} {min(f['flops'] for f in figures) / 1e9:>13.2f} "
            f"{min(f['bytes'] for f in figures) / 1e9:>15.2f} "
            f"{1e6 / min(f['ops'] for f in figures):>16.2f} "
            f"{cpu.peak_flops * share / 1e9:>21.2f}",
            flush=True,
        )
    print(f"{'procs':>5} {'all_reduce 4 B us':>18} {'4 MiB ms':>9} {'planner 4 B us':>15} "
          f"{'planner 4 MiB ms':>17}")  # fmt: skip
    from tessel.plan.cost import Links

    links = Links(cpu.link_bandwidth, cpu.link_latency)
    for n in (2, 3, 4):
        figures = _spawn(_collective_worker, n)
        small = max(f[4] for f in figures)
        large = max(f[4 * 2**20] for f in figures)
        print(
            f"{n:>5} {1e6 * small:>18.0f} {1e3 * large:>9.2f} "
            f"{1e6 * all_reduce_time(4, n, links):>15.0f} "
            f"{1e3 * all_reduce_time(4 * 2**20, n, links):>17.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--families", nargs="+", help="these zoo families only (default: all)")
    parser.add_argument("--width", type=int, default=64, help="the models' width (zoo: 64)")
    parser.add_argument("--batch", type=int, default=2, help="the inference batch")
    parser.add_argument("--no-training", action="store_true", help="skip the training step")
    parser.add_argument("--micro", action="store_true", help="measure the cost model's terms")
    args = parser.parse_args()
    print(load(), flush=True)
    if args.micro:
        micro()
        program_terms(os.cpu_count() or 1)
        session_overhead(args.devices)
        print(load())
        return
    import tessel

    families = zoo(args.width).FAMILIES
    if args.families:
        families = {k: families[k] for k in args.families}
    with tempfile.TemporaryDirectory() as tmp:
        tessel.initialize()
        try:
            rows = inference_rows(families, args.devices, args.batch, tmp)
        finally:
            tessel.finalize()
        if not args.no_training and "llama" in families:
            rows += training_rows(families, args.batch, tmp)
    print(f"\nwidth {args.width}, batch {args.batch}; {load()}")
    print(f"{'family':<16} {'devices':>7} {'estimate ms':>12} {'measured ms':>11} {'ratio':>7}")
    for row in rows:
        print(fmt(row))
    inside = sum(LOW <= m / e <= HIGH for _, _, e, m in rows if e)
    print(f"{inside} of {len(rows)} within {LOW}-{HIGH} (measured / estimated)")


if __name__ == "__main__":
    main()
