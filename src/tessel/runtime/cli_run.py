"""`tessel run` and `tessel serve`: a Session driven from the command line."""

from __future__ import annotations

import argparse
import math
import signal
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tessel.atomic import replace_atomically
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name, torch_dtype
from tessel.package import Package
from tessel.package.manifest import Manifest
from tessel.runtime.session import Session, finalize, initialize


def random_inputs(manifest: Manifest) -> list[torch.Tensor]:
    """Inputs of the recorded shapes: integers below the example's bound, floats from N(0, 1);
    refused by name, before any is made, where they would not fit the available memory."""
    import psutil

    available = psutil.virtual_memory().available
    need = sum(math.prod(s.shape) * torch_dtype(s.dtype).itemsize for s in manifest.inputs)
    if need > available:
        raise ConfigError(
            "--inputs",
            None,
            f"random inputs of the recorded shapes {[list(s.shape) for s in manifest.inputs]} "
            f"take {need:,} bytes; this machine has {available:,} available",
        )
    out = []
    for spec in manifest.inputs:
        dtype = torch_dtype(spec.dtype)
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.ones(spec.shape, dtype=dtype))
        else:
            out.append(torch.randint(0, spec.high or 2, spec.shape, dtype=dtype))
    return out


def read_inputs(path: str, manifest: Manifest) -> list[torch.Tensor]:
    """`input_0, input_1, ...` from a safetensors file, each of the shape and dtype the model
    was built for; anything else is a `ConfigError` naming the file (and the tensor)."""
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file") from None
    except OSError as exc:  # a directory, a file that cannot be read
        raise ConfigError(path, None, f"cannot read it: {exc.strerror or exc}") from None
    except SafetensorError as exc:
        raise ConfigError(path, None, f"not a safetensors file ({_first_line(exc)})") from None
    names = [f"input_{i}" for i in range(len(manifest.inputs))]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(path, None, f"missing tensors {missing}; expected {names}")
    extra = sorted(set(tensors) - set(names))
    if extra:
        raise ConfigError(path, None, f"unexpected tensors {extra}; expected {names}")
    for name, spec in zip(names, manifest.inputs):
        x = tensors[name]
        dtype = dtype_name(x.dtype)
        if tuple(x.shape) != spec.shape or dtype != spec.dtype:
            raise ConfigError(
                path,
                name,
                f"expected shape {list(spec.shape)} {spec.dtype} (the model's input "
                f"{spec.name!r}), found {list(x.shape)} {dtype}",
            )
    return [tensors[n] for n in names]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def write_outputs(path: str, outputs: list[torch.Tensor]) -> None:
    """Write `output_0, output_1, ...` to a safetensors file, atomically: to a temporary name
    beside it, synced, then renamed over it; a failure leaves no temporary behind."""
    target = Path(path)
    tensors = {f"output_{i}": o.contiguous() for i, o in enumerate(outputs)}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with replace_atomically(target) as tmp:
            save_file(tensors, str(tmp))
    except OSError as exc:
        raise ConfigError(path, None, f"cannot write it: {exc.strerror or exc}") from None


def run_command(args: argparse.Namespace) -> int:
    manifest = Package.open(args.model).manifest
    inputs = read_inputs(args.inputs, manifest) if args.inputs else random_inputs(manifest)
    options = {} if args.node_id is None else {"tessel.node_id": args.node_id}
    initialize()
    try:
        session = Session()
        t = time.perf_counter()
        session.load_graph(0, options, args.model)
        print(f"loaded on {manifest.world_size} devices in {time.perf_counter() - t:.2f} s")
        times = []
        for _ in range(max(1, args.repeat)):
            t = time.perf_counter()
            outputs = session.run_graph(0, inputs)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"run_graph: {1e3 * times[len(times) // 2]:.1f} ms (median of {len(times)})")
        for i, o in enumerate(outputs):
            print(f"output_{i}: {list(o.shape)} {dtype_name(o.dtype)}")
        if args.output:
            write_outputs(args.output, outputs)
            print(f"wrote {args.output}")
    finally:
        finalize()
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Run this node's workers until the head node's session stops them."""
    initialize()
    try:
        session = Session()
        session.load_graph(0, {"tessel.node_id": args.node_id}, args.model)
        print(f"node {args.node_id}: workers joined; serving", flush=True)
        graph = session._graphs[0]
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        while not stop["now"] and all(p.is_alive() for p in graph.procs):
            time.sleep(0.2)
        for p in graph.procs:
            p.join(0)
    finally:
        finalize()
    return 0
