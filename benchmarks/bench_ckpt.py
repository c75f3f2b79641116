"""Benchmark offline checkpoint conversion against a plain copy and torch DCP resharding.

A synthetic fp32 checkpoint of transformer-shaped parameters (embedding, per-layer qkv / out /
w1 / w2 / norms, lm_head; default 4 GiB in total) is written as full tensors, then sharded. Timed:

* copy baselines of the same bytes: ``shutil.copyfile`` (in-kernel) and a Python read+write loop;
* tessel: TP4 -> TP2, TP2xDP2 with optimizer sharding -> TP8, unify TP4 -> HF shards,
  and DCP(TP4) -> TP2;
* torch DCP: load TP4 DCP into TP2 DTensors (``dcp.load``, one fake-PG rank at a time, then save
  each rank's shards) and ``dcp_to_torch_save`` (torch's unify).

Every task runs in a child process; peak RSS is that child's ``ru_maxrss`` (with worker
processes: the sampled sum of their PSS). Before each run dirty pages are synced and the source
files are dropped from the page cache (``posix_fadvise(DONTNEED)``), so reads come from disk as
in a real conversion; ``--warm`` instead reads them into the cache first, which measures the
CPU/memory cost without the disk. Each timed task runs ``--repeat`` times; the median is shown.

Usage: ``python benchmarks/bench_ckpt.py [--size 4GiB] [--workdir DIR] [--processes 2] [--warm]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------------ model shape


def model_shapes(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Transformer-shaped fp32 params totalling about ``size_bytes`` (4 layers, vocab 8H)."""
    h = max(64, int(math.sqrt(size_bytes / 256)) // 64 * 64)
    v = 8 * h
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(4):
        p = f"layers.{i}."
        shapes.update({
            p + "attn.qkv.weight": (3 * h, h),
            p + "attn.out.weight": (h, h),
            p + "mlp.w1.weight": (4 * h, h),
            p + "mlp.w2.weight": (h, 4 * h),
            p + "norm1.weight": (h,),
            p + "norm2.weight": (h,),
        })  # fmt: skip
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def tp_dim(name: str) -> int | None:
    """Megatron TP: column-parallel (dim 0) or row-parallel (dim 1); norms replicated."""
    if "norm" in name:
        return None
    if "attn.out" in name or "w2" in name:
        return 1
    return 0


def write_strategy(path: Path, shapes: dict, dp: int, tp: int, opt: bool) -> None:
    from tessel.parallel import Layout, save_strategy_file

    lay = Layout((dp, tp), ("dp", "tp"))
    spec = {}
    for n, s in shapes.items():
        d = tp_dim(n)
        tm = ["None"] * len(s)
        if d is not None:
            tm[d] = "tp"
        opts = {"opt_shard_size": dp} if opt and dp > 1 else {}
        spec[n] = (lay(*tm), s, "float32", opts)
    save_strategy_file(path, spec)


# ------------------------------------------------------------------------------ child tasks


def _task_gen(hf: str, size: str) -> None:
    from safetensors.torch import save_file

    shapes = model_shapes(int(size))
    Path(hf).mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    batch: dict[str, torch.Tensor] = {}
    k = 0

    def flush() -> None:
        nonlocal batch, k
        if batch:
            save_file(batch, f"{hf}/part-{k:03d}.safetensors")
            k += 1
            batch = {}

    for n, s in shapes.items():
        batch[n] = torch.randn(s, generator=g)
        if sum(t.numel() * 4 for t in batch.values()) >= 1 << 30:
            flush()
    flush()


def _task_shard(hf: str, out: str, strategy: str) -> None:
    from tessel.parallel import shard_checkpoint

    shard_checkpoint(hf, out, strategy)


def _task_copyfile(src: str, out: str) -> None:
    for f in sorted(Path(src).rglob("*.safetensors")):
        t = Path(out) / f.relative_to(src)
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, t)


def _task_copy_rw(src: str, out: str) -> None:
    buf = bytearray(16 << 20)
    mv = memoryview(buf)
    for f in sorted(Path(src).rglob("*.safetensors")):
        t = Path(out) / f.relative_to(src)
        t.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "rb", buffering=0) as a, open(t, "wb", buffering=0) as b:
            while n := a.readinto(buf):
                b.write(mv[:n])


def _task_convert(src: str, out: str, a: str, b: str, procs: str) -> None:
    from tessel.parallel import convert_checkpoints

    convert_checkpoints(src, out, "checkpoint_", a if a != "-" else None, b, int(procs))


def _task_unify(src: str, out: str, a: str) -> None:
    from tessel.parallel import unified_safetensors

    unified_safetensors(src, a if a != "-" else None, out, max_process_num=1)


def _task_dcp_save(src: str, out: str, a: str, rank: str, world: str, init: str) -> None:
    """One gloo rank: load its tessel TP shard and dcp.save it as a DTensor."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tessel.checkpoint.strategy import load_strategy

    r, n = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=r, world_size=n)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    st = load_strategy(a)
    local = load_file(f"{src}/rank_{r}/checkpoint_{r}.safetensors")
    sd = {}
    for name, t in local.items():
        d = tp_dim(name)
        pl = [Replicate()] if d is None else [Shard(d)]
        p = st.params[name]
        sd[name] = DTensor.from_local(t, mesh, pl, run_check=False, shape=torch.Size(p.shape),
                                      stride=torch.empty(p.shape, device="meta").stride())  # fmt: skip
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def _task_dcp_reshard(src: str, out: str, tp: str, b: str) -> None:
    """torch DCP resharding: per destination rank, dcp.load into DTensors, save the shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessel.checkpoint.strategy import load_strategy

    n = int(tp)
    st = load_strategy(b)
    for r in range(n):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
        sd = {}
        for name, p in st.params.items():
            d = tp_dim(name)
            shape = list(p.shape)
            if d is not None:
                shape[d] //= n
            pl = [Replicate()] if d is None else [Shard(d)]
            sd[name] = DTensor.from_local(torch.empty(shape), mesh, pl, run_check=False,
                                          shape=torch.Size(p.shape),
                                          stride=torch.empty(p.shape, device="meta").stride())  # fmt: skip
        dcp.load(sd, checkpoint_id=src, no_dist=True)
        Path(f"{out}/rank_{r}").mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.to_local() for k, v in sd.items()}, f"{out}/rank_{r}/checkpoint_{r}.safetensors"
        )
        del sd
        dist.destroy_process_group()


def _task_dcp_unify(src: str, out: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    Path(out).mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(src, f"{out}/model.pt")


def _task_noop() -> None:
    import tessel.parallel  # noqa: F401


TASKS = {k[6:]: v for k, v in globals().items() if k.startswith("_task_")}


def _sample_rss(stop: threading.Event, peak: list[int]) -> None:
    """Peak memory of this process + its worker processes, sampled every 20 ms.

    With workers, their PSS is summed (pages shared after fork counted once); alone, RSS.
    """
    import psutil

    me = psutil.Process()
    while not stop.wait(0.02):
        kids = me.children(recursive=True)
        if not kids:
            continue
        total = 0
        for p in [me, *kids]:
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)


def child_main(name: str, args: list[str]) -> None:
    import safetensors.torch  # noqa: F401 - imports are not part of the timed work
    import torch.distributed.checkpoint  # noqa: F401

    import tessel.parallel  # noqa: F401

    peak = [0]
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(stop, peak), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    TASKS[name](*args)
    dt = time.perf_counter() - t0
    stop.set()
    sampler.join()
    rss = (
        max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        )
        * 1024
    )
    print("RESULT " + json.dumps({"seconds": dt, "maxrss": max(rss, peak[0])}))


# ------------------------------------------------------------------------------ orchestration


def evict(paths: list[Path]) -> None:
    """Write back dirty pages, then drop the given files from the page cache."""
    os.sync()
    for root in paths:
        if not root.exists():
            continue
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


REPEAT = 1
WARM = False


def warm(paths: list[Path]) -> None:
    """Read the given files once so the timed run finds them in the page cache."""
    os.sync()
    buf = bytearray(16 << 20)
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def run(name: str, *args: str, cold: list[Path] = (), out: Path | None = None) -> dict:
    """Run a task REPEAT times (output dir cleared between); median time, max peak RSS."""
    results = []
    for _ in range(REPEAT):
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
        if WARM:
            warm(list(cold))
        else:
            evict(list(cold))
        cmd = [sys.executable, str(HERE), "--child", name, *map(str, args)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"task {name} failed:\n{res.stdout}\n{res.stderr}")
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[7:]))
        if out is None:
            break
    times = sorted(r["seconds"] for r in results)
    return {
        "seconds": times[len(times) // 2],
        "maxrss": max(r["maxrss"] for r in results),
        "runs": times,
    }


def run_parallel(name: str, argsets: list[list[str]]) -> dict:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(HERE), "--child", name, *a],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argsets]  # fmt: skip
    rss = 0
    try:
        for p in procs:
            o, e = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"task {name} failed:\n{o}\n{e}")
            line = [x for x in o.splitlines() if x.startswith("RESULT ")][-1]
            rss += json.loads(line[7:])["maxrss"]
    finally:
        for p in procs:
            p.kill()
    return {"seconds": time.perf_counter() - t0, "maxrss": rss}


def tensor_bytes(d: Path) -> int:
    from tessel.checkpoint.st_io import read_header

    total = 0
    for f in d.rglob("*.safetensors"):
        total += sum(loc.nbytes for loc in read_header(f)[0].values())
    return total


def parse_size(s: str) -> int:
    from tessel.checkpoint.api import _parse_size

    return _parse_size(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="4GiB", help="checkpoint size (default 4GiB)")
    ap.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    ap.add_argument("--processes", type=int, default=2, help="process_num for the parallel run")
    ap.add_argument("--no-dcp", action="store_true", help="skip the torch DCP comparisons")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--repeat", type=int, default=3, help="runs per timed task (median taken)")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse sharded inputs already in --workdir (skip the setup writes)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="sources in the page cache (default: evicted, read from disk)",
    )
    args = ap.parse_args()
    global REPEAT, WARM
    REPEAT, WARM = args.repeat, args.warm
    size = parse_size(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = model_shapes(size)
    largest = max(math.prod(s) * 4 for s in shapes.values())
    total = sum(math.prod(s) * 4 for s in shapes.values())
    print(f"checkpoint: {len(shapes)} fp32 params, {total / 1e9:.2f} GB, largest param "
          f"{largest / 2**20:.0f} MiB, workdir {work}", flush=True)  # fmt: skip
    s = {k: work / f"{k}.json" for k in ("tp4", "tp2", "dp2tp2", "tp8")}
    write_strategy(s["tp4"], shapes, 1, 4, False)
    write_strategy(s["tp2"], shapes, 1, 2, False)
    write_strategy(s["dp2tp2"], shapes, 2, 2, True)
    write_strategy(s["tp8"], shapes, 1, 8, False)
    hf, a4, a22 = work / "hf", work / "tp4", work / "dp2tp2"
    rows = []

    def record(label, res, nbytes, kind):
        rows.append({"task": label, "kind": kind, "bytes": nbytes, **res})
        runs = " ".join(f"{t:.1f}" for t in res.get("runs", []))
        print(f"  {label:<44} {res['seconds']:7.2f} s [{runs}]  {nbytes / res['seconds'] / 1e9:6.2f} GB/s"
              f"  peak RSS {res['maxrss'] / 2**20:7.0f} MiB", flush=True)  # fmt: skip

    def clean(*ds):
        for d in ds:
            shutil.rmtree(d, ignore_errors=True)

    try:
        print("setup:", flush=True)
        if not hf.exists():
            run("gen", hf, size)
        base = run("noop")
        print(f"  baseline RSS of python + torch + tessel: {base['maxrss'] / 2**20:.0f} MiB")
        if not (args.reuse and a4.exists() and a22.exists()):
            clean(a4, a22)
            record("tessel shard HF -> TP4", run("shard", hf, a4, s["tp4"], cold=[hf]), total,
                   "shard")  # fmt: skip
            record(
                "tessel shard HF -> TP2xDP2+opt",
                run("shard", hf, a22, s["dp2tp2"], cold=[hf]),
                total,
                "shard",
            )
        nbytes = tensor_bytes(a4)
        how = "read into the page cache" if WARM else "evicted from the page cache"
        print(f"timed (sources {how} before each run; median of {REPEAT}):", flush=True)
        out = work / "out"
        clean(out)
        record("copy: shutil.copyfile (TP4 files)", run("copyfile", a4, out, cold=[a4], out=out),
               nbytes, "copy")  # fmt: skip
        clean(out)
        record("copy: python read+write (TP4 files)", run("copy_rw", a4, out, cold=[a4], out=out),
               nbytes, "copy")  # fmt: skip
        clean(out)
        record("tessel TP4 -> TP2", run("convert", a4, out, s["tp4"], s["tp2"], 1, cold=[a4], out=out),
               nbytes, "tessel")  # fmt: skip
        clean(out)
        record(f"tessel TP4 -> TP2 (process_num={args.processes})",
               run("convert", a4, out, s["tp4"], s["tp2"], args.processes, cold=[a4], out=out),
               nbytes, "tessel")  # fmt: skip
        clean(out)
        n22 = tensor_bytes(a22)
        record(
            "tessel TP2xDP2+opt -> TP8",
            run("convert", a22, out, s["dp2tp2"], s["tp8"], 1, cold=[a22], out=out),
            n22,
            "tessel",
        )
        clean(out)
        record("tessel unify TP4 -> HF shards", run("unify", a4, out, s["tp4"], cold=[a4], out=out),
               nbytes, "tessel")  # fmt: skip
        clean(out)
        if not args.no_dcp:
            dcp_dir = work / "dcp_tp4"
            if not (args.reuse and (dcp_dir / ".metadata").exists()):
                clean(dcp_dir)
                init = work / "gloo_init"
                init.unlink(missing_ok=True)
                res = run_parallel("dcp_save", [[str(a4), str(dcp_dir), str(s["tp4"]), str(r),
                                                 "4", str(init)] for r in range(4)])  # fmt: skip
                record("(setup) torch dcp.save TP4, 4 gloo ranks", res, nbytes, "setup")
            record(
                "torch DCP reshard TP4 -> TP2 (dcp.load)",
                run("dcp_reshard", dcp_dir, out, 2, s["tp2"], cold=[dcp_dir], out=out),
                nbytes,
                "dcp",
            )
            clean(out)
            record("tessel DCP(TP4) -> TP2",
                   run("convert", dcp_dir, out, "-", s["tp2"], 1, cold=[dcp_dir], out=out), nbytes,
                   "tessel")  # fmt: skip
            clean(out)
            record(
                "torch dcp_to_torch_save (unify)",
                run("dcp_unify", dcp_dir, out, cold=[dcp_dir], out=out),
                nbytes,
                "dcp",
            )
            clean(out)
            record(
                "tessel unify DCP(TP4) -> HF shards",
                run("unify", dcp_dir, out, "-", cold=[dcp_dir], out=out),
                nbytes,
                "tessel",
            )
            clean(out)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    copyfile = next(r for r in rows if r["task"].startswith("copy: shutil"))
    rw = next(r for r in rows if r["task"].startswith("copy: python"))
    gbps = lambda r: r["bytes"] / r["seconds"] / 1e9  # noqa: E731
    print()
    print(f"largest param {largest / 2**20:.0f} MiB; baseline RSS {base['maxrss'] / 2**20:.0f} MiB")
    print(f"{'task':<44} {'GB/s':>6} {'/copyfile':>9} {'/read+write':>11} {'peak RSS MiB':>12} "
          f"{'RSS/param':>9} {'(RSS-base)/param':>16}")  # fmt: skip
    for r in rows:
        print(
            f"{r['task']:<44} {gbps(r):6.2f} {gbps(r) / gbps(copyfile):9.2f} "
            f"{gbps(r) / gbps(rw):11.2f} {r['maxrss'] / 2**20:12.0f} "
            f"{r['maxrss'] / largest:9.2f} {(r['maxrss'] - base['maxrss']) / largest:16.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3:])
    else:
        main()
