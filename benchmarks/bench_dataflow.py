"""DataFlow pipeline benchmark: tessel.dataflow vs plain multiprocessing queues vs Ray actors.

The pipeline: pre-process UDF -> model node (.pt2, 2 instances) -> post-process UDF, over
`--count` transactions of `--mib` MiB float32 tensors, with at most `--window` transactions in
flight. Reports transactions per second and, from a separate run with one transaction in flight,
the median end-to-end latency and per-hop latency (4 hops: feed->pre->model->post->fetch).

    .venv/bin/python benchmarks/bench_dataflow.py --count 10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HOPS = 4


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


def pre(x: torch.Tensor) -> torch.Tensor:
    return x + 1.0


def post(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


def export_model(path: Path, numel: int) -> None:
    ep = torch.export.export(Scale(), (torch.ones(numel),))
    torch.export.save(ep, str(path))


def load_model(path: str) -> Callable:
    module = torch.export.load(path).module()
    return lambda x: module(x)


def drive(
    feed: Callable, fetch: Callable, count: int, window: int, numel: int
) -> tuple[float, list]:
    """Feed `count` transactions keeping `window` in flight; check values; returns (s, latencies)."""
    x = torch.randn(numel)
    want = ((x + 1.0) * 2.0 + 1.0) * 0.5
    sent: list[float] = []
    lat: list[float] = []
    got = 0
    t0 = time.perf_counter()
    for i in range(count):
        if i - got >= window:
            out = fetch()
            lat.append(time.perf_counter() - sent[got])
            if got == 0:
                torch.testing.assert_close(out, want)
            got += 1
        sent.append(time.perf_counter())
        feed(x)
    while got < count:
        fetch()
        lat.append(time.perf_counter() - sent[got])
        got += 1
    return time.perf_counter() - t0, lat


# ---- tessel.dataflow ---------------------------------------------------------------------
def run_tessel(
    model: Path, tmp: Path, count: int, window: int, numel: int, backend: str = "local"
) -> tuple[float, list]:
    import tessel.dataflow as df

    df.init({"tessel.dataflow.local_devices": "2", "tessel.dataflow.backend": backend})
    x = df.FlowData()
    pre_node = df.pyflow(pre).fnode(name="pre")
    model_node = df.GraphProcessPoint(df.Framework.PYTORCH, str(model), name="model").fnode()
    post_node = df.pyflow(post).fnode(name="post")
    deploy = {
        "batch_deploy_info": [
            {"flow_node_list": ["pre"], "logic_device_list": "0:0:0"},
            {"flow_node_list": ["model"], "logic_device_list": "0:0:0~1"},
            {"flow_node_list": ["post"], "logic_device_list": "0:0:1"},
        ]
    }
    (tmp / "deploy.json").write_text(json.dumps(deploy))
    g = df.FlowGraph(
        [post_node(model_node(pre_node(x)))],
        {df.DEPLOY_INFO_OPTION: str(tmp / "deploy.json")},
    )
    g.start()
    try:
        return drive(
            lambda v: g.feed_data({x: v}), lambda: g.fetch_data()[0][0], count, window, numel
        )
    finally:
        df.finalize()


# ---- plain multiprocessing queues -----------------------------------------------------------
def _mp_stage(fn_name: str, model: str, inq, outqs) -> None:
    torch.set_num_threads(1)
    fn = load_model(model) if fn_name == "model" else {"pre": pre, "post": post}[fn_name]
    while True:
        item = inq.get()
        if item is None:
            return
        tid, value = item
        out = outqs[tid % len(outqs)] if len(outqs) > 1 else outqs[0]
        out.put((tid, fn(value)))


class PlainPipeline:
    """The same pipeline by hand: one process per stage, multiprocessing.Queue between them."""

    def __init__(self, model: Path, numpy_payload: bool) -> None:
        ctx = mp.get_context("fork")
        self.np = numpy_payload
        self.q_in = ctx.Queue(16)
        self.q_model = [ctx.Queue(16), ctx.Queue(16)]
        self.q_post = ctx.Queue(16)
        self.q_out = ctx.Queue()
        target = _mp_stage_np if numpy_payload else _mp_stage
        self.procs = [ctx.Process(target=target, args=("pre", "", self.q_in, self.q_model))]
        for q in self.q_model:
            self.procs.append(
                ctx.Process(target=target, args=("model", str(model), q, [self.q_post]))
            )
        self.procs.append(ctx.Process(target=target, args=("post", "", self.q_post, [self.q_out])))
        for p in self.procs:
            p.daemon = True
            p.start()
        self.tid = 0
        self.pending: dict[int, torch.Tensor] = {}
        self.next = 0

    def feed(self, x: torch.Tensor) -> None:
        self.q_in.put((self.tid, x.numpy() if self.np else x))
        self.tid += 1

    def fetch(self) -> torch.Tensor:
        while self.next not in self.pending:
            tid, v = self.q_out.get()
            self.pending[tid] = v
        v = self.pending.pop(self.next)
        self.next += 1
        return torch.from_numpy(v) if self.np else v

    def close(self) -> None:
        self.q_in.put(None)
        for q in self.q_model:
            q.put(None)
        self.q_post.put(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _mp_stage_np(fn_name: str, model: str, inq, outqs) -> None:
    torch.set_num_threads(1)
    fn = load_model(model) if fn_name == "model" else {"pre": pre, "post": post}[fn_name]
    while True:
        item = inq.get()
        if item is None:
            return
        tid, value = item
        out = outqs[tid % len(outqs)] if len(outqs) > 1 else outqs[0]
        out.put((tid, fn(torch.from_numpy(value)).numpy()))


def run_plain(model: Path, count: int, window: int, numel: int, numpy_payload: bool):
    p = PlainPipeline(model, numpy_payload)
    try:
        return drive(p.feed, p.fetch, count, window, numel)
    finally:
        p.close()


# ---- Ray actors ---------------------------------------------------------------------------------
def run_ray(model: Path, tmp: Path, count: int, window: int, numel: int, lat_count: int):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp / "ray"), log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Stage:
            def __init__(self, name: str, path: str) -> None:
                torch.set_num_threads(1)
                self.fn = load_model(path) if name == "model" else {"pre": pre, "post": post}[name]

            def run(self, x):
                return self.fn(x)

        p = Stage.remote("pre", "")
        ms = [Stage.remote("model", str(model)) for _ in range(2)]
        q = Stage.remote("post", "")
        ray.get([a.__ray_ready__.remote() for a in (p, *ms, q)])
        refs: list = []

        def feed(x):
            tid = len(refs)
            refs.append(q.run.remote(ms[tid % 2].run.remote(p.run.remote(x))))

        state = {"next": 0}

        def fetch():
            v = ray.get(refs[state["next"]])
            refs[state["next"]] = None
            state["next"] += 1
            return v

        thr = drive(feed, fetch, count, window, numel)
        refs.clear()
        state["next"] = 0
        lat = drive(feed, fetch, lat_count, 1, numel)
        return thr, lat
    finally:
        ray.shutdown()


def summarize(name: str, count: int, thr: tuple[float, list], lat: tuple[float, list]) -> dict:
    seconds = thr[0]
    med = statistics.median(lat[1]) * 1000
    row = {
        "pipeline": name,
        "tx_per_s": count / seconds,
        "latency_ms": med,
        "per_hop_ms": med / HOPS,
    }
    print(
        f"{name:28s} {row['tx_per_s']:9.1f} tx/s   e2e {med:7.3f} ms   per hop {med / HOPS:7.3f} ms",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10000, help="transactions (default 10000)")
    ap.add_argument("--mib", type=float, default=1.0, help="tensor size in MiB (default 1)")
    ap.add_argument("--window", type=int, default=16, help="transactions in flight (default 16)")
    ap.add_argument("--latency-count", type=int, default=300, help="transactions for latency")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument(
        "--tessel-ray", action="store_true", help="also run tessel.dataflow on its Ray backend"
    )
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    numel = int(args.mib * (1 << 20) // 4)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_df_") as d:
        tmp = Path(d)
        model = tmp / "scale.pt2"
        export_model(model, numel)
        print(
            f"pipeline pre -> model x2 -> post, {args.count} tx of {args.mib} MiB, "
            f"window {args.window}, {os.cpu_count()} CPUs",
            flush=True,
        )
        n, w = args.count, args.window
        rows.append(
            summarize(
                "tessel.dataflow",
                n,
                run_tessel(model, tmp, n, w, numel),
                run_tessel(model, tmp, args.latency_count, 1, numel),
            )
        )
        rows.append(
            summarize(
                "mp.Queue (torch tensors)",
                n,
                run_plain(model, n, w, numel, False),
                run_plain(model, args.latency_count, 1, numel, False),
            )
        )
        rows.append(
            summarize(
                "mp.Queue (numpy, pickled)",
                n,
                run_plain(model, n, w, numel, True),
                run_plain(model, args.latency_count, 1, numel, True),
            )
        )
        if not args.skip_ray:
            thr, lat = run_ray(model, tmp, n, w, numel, args.latency_count)
            rows.append(summarize("Ray actors", n, thr, lat))
        if args.tessel_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            import ray

            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp / "ray2"))
            try:
                thr = run_tessel(model, tmp, n, w, numel, "ray")
                lat = run_tessel(model, tmp, args.latency_count, 1, numel, "ray")
            finally:
                ray.shutdown()
            rows.append(summarize("tessel.dataflow (Ray backend)", n, thr, lat))
    base = rows[0]["tx_per_s"]
    print("\nratios (tessel.dataflow throughput / other):")
    for r in rows[1:]:
        print(f"  vs {r['pipeline']:28s} {base / r['tx_per_s']:6.2f}x")
    best_plain = max(r["tx_per_s"] for r in rows if r["pipeline"].startswith("mp.Queue"))
    print(f"  plain-queue limit / tessel: {best_plain / base:.2f}x (target <= 1.5x)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
