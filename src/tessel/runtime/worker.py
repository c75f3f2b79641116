"""One worker process per logical device: joins the process groups, loads its rank, runs it."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tessel.package.format import Package
from tessel.package.manifest import Manifest, TensorSpec
from tessel.runtime.loader import load_rank


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, passed at spawn (plain values only)."""

    rank: int
    world_size: int
    package: str
    master_addr: str
    master_port: int
    backend: str
    device_type: str
    device_index: int
    threads: int
    timeout_s: float
    distributed: bool


_STOP, _RUN = 0, 1


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent dies; elsewhere a watchdog thread does."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _device(spec: WorkerSpec) -> torch.device:
    if spec.device_type == "cpu":
        return torch.device("cpu")
    device = torch.device(spec.device_type, spec.device_index)
    getattr(torch, spec.device_type).set_device(device)
    return device


def _groups(manifest: Manifest, world: int) -> dict[tuple[int, ...], str]:
    """Create every group any rank uses, in one order on all ranks; map rank lists to names."""
    names: dict[tuple[int, ...], str] = {}
    wanted = sorted({g for s in manifest.submodels for g in s.comm_groups})
    for ranks in wanted:
        if list(ranks) == list(range(world)):
            names[ranks] = dist.group.WORLD.group_name
        else:
            names[ranks] = dist.new_group(list(ranks)).group_name
    return names


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the session decides when workers stop
    _die_with_parent()
    torch.set_num_threads(max(1, spec.threads))
    try:
        device = _device(spec)
        package = Package.open(spec.package)
        groups: dict[tuple[int, ...], str] = {}
        if spec.distributed:
            dist.init_process_group(
                spec.backend,
                init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=datetime.timedelta(seconds=spec.timeout_s),
            )
            groups = _groups(package.manifest, spec.world_size)
        program, weights = load_rank(package, spec.rank, device, groups)
        conn.send(("ready", spec.rank, None))
        _serve(spec, conn, program, weights, device, package.manifest.inputs)
    except BaseException as exc:  # noqa: BLE001 - report everything to the session, then exit
        # plain strings: an exception object may not unpickle on the other side
        report = (type(exc).__name__, str(exc), traceback.format_exc())
        with contextlib.suppress(Exception):
            conn.send(("error", spec.rank, report))
        os._exit(1)
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    os._exit(0)


def _serve(
    spec: WorkerSpec,
    conn: Connection,
    program,
    weights: list,
    device: torch.device,
    input_specs: tuple[TensorSpec, ...],
) -> None:
    leader = spec.rank == 0 or not spec.distributed
    while True:
        inputs: list[torch.Tensor] = []
        if leader:
            message = conn.recv()
            command = _RUN if message[0] == "run" else _STOP
            if command == _RUN:
                inputs = [x.to(device) for x in message[1]]
        if spec.distributed:
            # the session checked the inputs against the manifest, so only the command travels
            word = torch.tensor([command if leader else _STOP], device=device)
            dist.broadcast(word, src=0)
            command = int(word.item())
            if not leader and command == _RUN:
                inputs = [
                    torch.empty(x.shape, dtype=getattr(torch, x.dtype), device=device)
                    for x in input_specs
                ]
            for x in inputs:
                dist.broadcast(x, src=0)
        if command == _STOP:
            if spec.distributed:
                dist.barrier()
            return
        with torch.inference_mode():
            outputs = program(*weights, *inputs)
        if leader:
            conn.send(("result", spec.rank, [o.cpu() for o in outputs]))
