"""One worker process per logical device: joins the process groups, loads its rank, runs it."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tessel import forked
from tessel.checkpoint.errors import CheckpointError
from tessel.dtypes import torch_dtype
from tessel.log_levels import keep_torch_quiet
from tessel.package.format import Package, PackageError
from tessel.package.manifest import Manifest, TensorSpec
from tessel.runtime import cpu_cache, shared_memory
from tessel.runtime.generating import LoadedGears, generate_on_rank
from tessel.runtime.gloo import collectives_as_all_reduces
from tessel.runtime.loader import BACKWARD, load_programs, row_gear
from tessel.runtime.slots import serve_on_rank
from tessel.runtime.step import TrainingStep, data_parallel_group


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, passed when it starts (plain values only)."""

    rank: int
    world_size: int
    package: str
    environ: dict[str, str]  # the session's environment as it started this worker
    master_addr: str
    master_port: int
    backend: str
    device_type: str
    device_index: int
    threads: int
    timeout_s: float  # the session's run deadline
    distributed: bool
    reuse_freed_memory: bool = False  # keep glibc's own heap policy (see `_fix_mmap_threshold`)
    cpu_cache: str = ""  # the compiled block cache to allocate CPU tensors with (`cpu_cache`)
    shared_memory: str = ""  # the compiled meeting point of same-machine groups (`shared_memory`)
    resume: str = ""  # a training checkpoint in the package's layout to start from
    log_level: int = logging.WARNING  # the session's: torch's own warnings show at DEBUG only
    # the head's session hosts the store at master_addr:master_port (a cluster of several nodes,
    # `tessel.runtime.rendezvous`), and every rank joins it; else rank 0 hosts it
    store_at_head: bool = False

    @property
    def collective_timeout_s(self) -> float:
        """How long a collective may wait before it fails (see `collective_timeout_s`)."""
        return collective_timeout_s(self.timeout_s)


def collective_timeout_s(run_timeout_s: float) -> float:
    """The process groups' timeout for a session whose run deadline is `run_timeout_s`.

    Twice the deadline: a rank that stops answering is always reported by the session, whose
    deadline passes first (and which then stops every worker), never by a peer's collective
    timing out a moment earlier or later. The timeout still ends the workers of a node whose
    session is gone (a `tessel serve` node whose head node died).
    """
    return 2.0 * run_timeout_s


# The words rank 0 broadcasts to say what every rank does next.
_STOP, _RUN, _IDLE, _LOAD, _UNLOAD, _SAVE, _STATS, _GENERATE, _SERVE = range(9)


def die_with_parent() -> None:
    """This worker ends when its parent does: on Linux the kernel kills it
    (`forked.die_with_parent`), and on every platform a watchdog thread ends it once its
    parent changes."""
    parent = os.getppid()
    forked.die_with_parent()

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


def make_groups(manifest: Manifest, world: int, names: dict[tuple[int, ...], str]) -> None:
    """Create every group any rank uses that `names` lacks, in one order on all ranks.

    `names` maps rank lists to group names. A worker that loads several packages in turn keeps
    the groups it made for earlier ones: every rank has loaded the same packages in the same
    order, so every rank makes the same new groups in the same order here.
    """
    wanted = sorted({g for s in manifest.submodels for g in s.comm_groups} - set(names))
    for ranks in wanted:
        if list(ranks) == list(range(world)):
            names[ranks] = dist.group.WORLD.group_name
        else:
            # every rank makes every group (members get it); "" marks one made for others,
            # so a later package does not make it again on this rank only
            group = dist.new_group(list(ranks))
            names[ranks] = group.group_name if dist.get_rank() in ranks else ""


@dataclass
class _Loaded:
    """The model a worker serves now: its rank's program, weights and the model's inputs."""

    program: object
    weights: list
    inputs: tuple[TensorSpec, ...]
    step: TrainingStep | None = None  # a training package's optimizer and gradients
    strategy: bytes = b""  # a training package's strategy file, for its checkpoints
    gears: LoadedGears | None = None  # a generation package's gears over its cache


def _load(
    spec: WorkerSpec,
    path: str,
    device: torch.device,
    groups: dict[tuple[int, ...], str],
    resume: str = "",
) -> _Loaded:
    """Open a package and load this worker's rank of it (a training package's weights and
    optimizer states then from the checkpoint directory `resume`, where given, already in
    the package's layout).

    `groups` holds the groups made for earlier packages and gains the ones this package adds.
    """
    package = Package.open(path)
    if package.world_size != spec.world_size:  # the session matched them; a last check
        raise PackageError(
            path, f"built for {package.world_size} devices; these workers are {spec.world_size}"
        )
    in_shared_memory: set[str] = set()
    if spec.distributed:
        _same_package_everywhere(package, device)
        make_groups(package.manifest, spec.world_size, groups)
        if spec.shared_memory and device.type == "cpu":
            in_shared_memory = shared_memory.join(
                groups, spec.rank, spec.shared_memory, spec.collective_timeout_s
            )
    programs, weights = load_programs(package, spec.rank, device, groups)
    for loaded_program in programs.values():
        # same-machine groups meet in shared memory; gloo runs the rest as all-reduces
        shared_memory.rewrite(loaded_program, in_shared_memory)
        if spec.distributed and spec.backend == "gloo":
            collectives_as_all_reduces(loaded_program, spec.rank, groups)
    gears = package.manifest.generation
    program = programs[1 if gears is not None else None]
    step, strategy = None, b""
    if package.manifest.training is not None:
        replicas = data_parallel_group(package.manifest, spec.rank)
        # optimizer states offloaded to host memory, where the devices are not the host's CPU
        offload = package.manifest.training.optimizer_offload != "none" and device.type != "cpu"
        step = TrainingStep(
            package.manifest,
            spec.rank,
            weights,
            replicas,
            program,
            offload=torch.device("cpu") if offload else None,
            backward=programs.get(BACKWARD),
        )
        strategy = json.dumps(package.json(package.manifest.strategy)).encode()
        if resume:
            names = list(package.json(package.manifest.strategy)["params"])
            tensors = _checkpoint_tensors(resume, spec.rank, device, step.checkpoint_layout(names))
            with torch.no_grad():
                step.load_state_dict(tensors)
    loaded_gears = None
    if gears is not None:  # by prompt length, the decode gear at 1
        sub = package.submodel(spec.rank)
        loaded_gears = LoadedGears(
            gears,
            {n: p for n, p in programs.items() if isinstance(n, int)},
            weights,
            package.manifest.mesh.logits_rank,
            {name: (weights[sub.weight_order.index(name)], box) for name, box in sub.state.items()},
            rows={n: programs[row_gear(n)] for n in sub.row_gears},
        )
    _release_memory(device)  # what decoding the program left behind, before the first run
    return _Loaded(program, weights, package.manifest.inputs, step, strategy, loaded_gears)


_PATH_BYTES = 512  # a package's path, as other nodes see it in a mismatch: its first bytes


def _same_package_everywhere(package: Package, device: torch.device) -> None:
    """Every rank loads the same package (by its manifest's digest), or every rank refuses,
    naming its own file and another's: nodes started on different packages (a `tessel serve`
    given another file) would otherwise run one program against another."""
    path = str(package.path).encode()[:_PATH_BYTES]
    mine = torch.zeros(32 + _PATH_BYTES, dtype=torch.uint8)
    mine[:32] = torch.frombuffer(bytearray(bytes.fromhex(package.digest)), dtype=torch.uint8)
    mine[32 : 32 + len(path)] = torch.frombuffer(bytearray(path), dtype=torch.uint8)
    mine = mine.to(device)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, mine)
    for rank, theirs in enumerate(seen):
        theirs = bytes(theirs.cpu().tolist())
        if theirs[:32] != bytes(mine[:32].cpu().tolist()):
            other = theirs[32:].rstrip(b"\0").decode(errors="replace")
            raise PackageError(
                package.path,
                f"every node must serve the same file, and rank {rank} loads {other} "
                f"(digests {theirs[:8].hex()} there, {package.digest[:16]} here)",
            )


def _checkpoint_tensors(
    directory: str, rank: int, device: torch.device, layout: dict[str, tuple[tuple, str]]
) -> dict:
    """This rank's tensors of a checkpoint in the package's own layout, each checked to be
    there with the shape and dtype `layout` gives (nothing else taken: a resume from other
    numbers is no resume). Errors name the file and the tensor."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(directory, f"rank_{rank}", f"checkpoint_{rank}.safetensors")
    if not os.path.isfile(path):
        raise CheckpointError(path, None, f"missing: the checkpoint has no file for rank {rank}")
    try:
        with safe_open(path, "pt", device=str(device)) as f:
            missing = sorted(set(layout) - set(f.keys()))
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise CheckpointError(
                    path,
                    missing[0],
                    f"missing{more}: resuming needs every weight and optimizer state this rank "
                    "of the step holds",
                )
            tensors = {}
            for name, (shape, dtype) in layout.items():
                meta = f.get_slice(name)
                found = (tuple(meta.get_shape()), _safetensors_dtype(meta.get_dtype()))
                if found != (shape, dtype):
                    raise CheckpointError(
                        path,
                        name,
                        f"is {found[1]}{list(found[0])}; this rank of the step holds it as "
                        f"{dtype}{list(shape)}",
                    )
                tensors[name] = f.get_tensor(name)
    except SafetensorError as exc:
        raise CheckpointError(path, None, f"not a readable safetensors file ({exc})") from None
    return tensors


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _safetensors_dtype(code: str) -> str:
    return _SAFETENSORS_DTYPES.get(code, code)


def _save_checkpoint(
    spec: WorkerSpec, loaded: _Loaded, directory: str, record: dict[str, str]
) -> None:
    """Write this rank's weights and optimizer states as `rank_<r>/checkpoint_<r>.safetensors`
    under `directory` (rank 0 also the strategy file), with `record` (the checkpoint's id and
    its strategy's digest) in the file's metadata; returns when every rank has written."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from tessel.checkpoint.publish import sync_file

    names = json.loads(loaded.strategy)["params"]
    with torch.no_grad():
        tensors = loaded.step.state_dict(list(names))
    rank_dir = os.path.join(directory, f"rank_{spec.rank}")
    os.makedirs(rank_dir, exist_ok=True)
    path = os.path.join(rank_dir, f"checkpoint_{spec.rank}.safetensors")
    try:
        # copies: the weights are views of one buffer, and safetensors stores no shared memory
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
            path,
            metadata={"format": "pt", "tessel_rank": str(spec.rank), **record},
        )
        with open(path, "rb") as f:  # on disk before the tree holding it is published
            sync_file(f.fileno())
        if spec.rank == 0:
            path = os.path.join(directory, "strategy.json")
            with open(path, "wb") as f:
                f.write(loaded.strategy)
                f.flush()
                sync_file(f.fileno())
    except (OSError, SafetensorError) as exc:  # a full disk, say
        raise CheckpointError(path, None, f"could not be written: {exc}") from None
    if spec.distributed:
        dist.barrier()


def _largest_over_ranks(spec: WorkerSpec, stats: dict[str, int], device: torch.device) -> dict:
    """Each of a rank's counts, the largest over the ranks."""
    if not spec.distributed:
        return stats
    values = torch.tensor(list(stats.values()), dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(stats, values.tolist()))


def _release_memory(device: torch.device) -> None:
    """Give an unloaded model's memory back: glibc and accelerator caches keep it otherwise."""
    gc.collect()
    cpu_cache.release()
    if device.type != "cpu":
        with contextlib.suppress(Exception):
            getattr(torch, device.type).empty_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


# glibc's default mmap threshold rises to the largest block a process frees, so after the first
# run every activation below 32 MiB comes from the heap, which keeps and fragments what they free:
# a worker then holds up to a half more than its program does. A fixed threshold maps each large
# block when made and returns it when freed, so a worker holds what its program holds. Tensors
# of CPU workers come from the block cache (`cpu_cache`), which reuses them within that bound;
# without it, every large activation is faulted in afresh on every run (a third of a small
# model's step on CPU). `tessel.reuse_freed_memory` keeps glibc's policy instead.
_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number


def _fix_mmap_threshold() -> None:
    """Linux with glibc: map every allocation above 128 KiB, unless the user set the threshold."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    os.environ.clear()  # a fork server's environment is the one it started with: take ours
    os.environ.update(spec.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the session decides when workers stop
    # a worker killed by a fatal signal (a crash in native code) prints every thread's Python
    # stack to its stderr, so the report says where it died
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):  # and on the session's word, where a rank that hangs waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    die_with_parent()
    # what the worker starts with (torch and tessel, imported by the fork server or by the
    # spawned interpreter) lives as long as it does: set apart from the garbage collector, every
    # collection walks only what this worker made since. Otherwise the full collection after
    # each load and unload walks every inherited object, writing to each one's header, so a
    # forked worker also copies every page of them
    gc.freeze()
    keep_torch_quiet(spec.log_level)
    if not spec.reuse_freed_memory:
        _fix_mmap_threshold()
    if spec.cpu_cache:
        cpu_cache.install(spec.cpu_cache)
    torch.set_num_threads(max(1, spec.threads))
    try:
        device = _device(spec)
        groups: dict[tuple[int, ...], str] = {}
        if spec.distributed:
            timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
            meeting: dict = {"init_method": f"tcp://{spec.master_addr}:{spec.master_port}"}
            if spec.store_at_head:
                meeting = {
                    "store": dist.TCPStore(
                        spec.master_addr, spec.master_port, is_master=False, timeout=timeout
                    )
                }
            dist.init_process_group(
                spec.backend,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timeout,
                **meeting,
            )
        loaded = _load(spec, spec.package, device, groups, spec.resume)
        conn.send(("ready", spec.rank, None))
        _serve(spec, conn, device, groups, loaded)
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


def _keepalive_s(spec: WorkerSpec) -> float:
    """How long rank 0 waits for the session before it broadcasts `_IDLE`.

    The other ranks wait for rank 0's word inside a broadcast, which fails after the group's
    timeout; an idle word well within it keeps an idle model (or an idle pool) alive for good.
    """
    return max(0.05, min(60.0, spec.collective_timeout_s / 8))


def _next_command(
    spec: WorkerSpec, conn: Connection, device: torch.device, leader: bool
) -> tuple[int, tuple]:
    """The next command and its message: the leader reads the session's pipe, the others hear
    rank 0's broadcast word (and a loaded package's path) when the model is partitioned."""
    while True:
        message: tuple = ()
        command = _IDLE
        if leader:
            if not spec.distributed or conn.poll(_keepalive_s(spec)):
                message = conn.recv()
                command = _COMMANDS.get(message[0], _STOP)
        if not spec.distributed:
            return command, message
        word = torch.tensor([command], device=device)
        dist.broadcast(word, src=0)
        command = int(word.item())
        if command == _IDLE:
            continue
        if command == _GENERATE:  # the request's shape and options; its tensors follow
            text = json.dumps(message[1]) if leader else ""  # the request, beside its tensors
            request = json.loads(_broadcast_text(text, device))
            return command, ("generate", request, *(message[2:4] if leader else ()))
        if command in (_LOAD, _SAVE):
            # a package's path and the checkpoint to resume from; a checkpoint's directory
            words = "\n".join(message[1:3]) if leader else ""
            message = (
                "load" if command == _LOAD else "save",
                *_broadcast_text(words, device).split("\n"),
            )
        return command, message


_COMMANDS = {
    "run": _RUN,
    "load": _LOAD,
    "unload": _UNLOAD,
    "stop": _STOP,
    "save": _SAVE,
    "stats": _STATS,
    "generate": _GENERATE,
    "serve": _SERVE,
}


_FIRST_BYTES = 1024  # what one broadcast carries of a text: its length, then its first bytes


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's `text` on every rank (a package path, a serving step's header: the other ranks
    may have no pipe). A short text takes one broadcast, a longer one a second for the rest."""
    data = text.encode()
    first = torch.zeros(_FIRST_BYTES, dtype=torch.uint8)
    head = len(data).to_bytes(8, "little") + data[: _FIRST_BYTES - 8]
    first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    first = first.to(device)
    dist.broadcast(first, src=0)
    received = first.cpu().numpy().tobytes()
    size = int.from_bytes(received[:8], "little")
    if size <= _FIRST_BYTES - 8:
        return received[8 : 8 + size].decode()
    rest = torch.zeros(size - (_FIRST_BYTES - 8), dtype=torch.uint8)
    if data:
        rest.copy_(torch.frombuffer(bytearray(data[_FIRST_BYTES - 8 :]), dtype=torch.uint8))
    rest = rest.to(device)
    dist.broadcast(rest, src=0)
    return (received[8:] + rest.cpu().numpy().tobytes()).decode()


def _serve(
    spec: WorkerSpec,
    conn: Connection,
    device: torch.device,
    groups: dict[tuple[int, ...], str],
    loaded: _Loaded | None,
) -> None:
    """Serve commands until stopped: run the loaded model, unload it, load another package.

    Every rank answers `load` with `ready` and `unload` with `idle`; only the leader answers runs.
    """
    leader = spec.rank == 0 or not spec.distributed
    while True:
        command, message = _next_command(spec, conn, device, leader)
        if command == _STOP:
            if spec.distributed:
                dist.barrier()
            return
        if command == _UNLOAD:
            loaded = None
            _release_memory(device)
            conn.send(("idle", spec.rank, None))
            continue
        if command == _LOAD:
            loaded = None
            _release_memory(device)
            loaded = _load(spec, message[1], device, groups, message[2] if len(message) > 2 else "")
            conn.send(("ready", spec.rank, None))
            continue
        if command == _SAVE:
            if loaded is None or loaded.step is None:
                raise RuntimeError("asked to save a checkpoint with no training model loaded")
            _save_checkpoint(spec, loaded, message[1], json.loads(message[2]))
            if leader:
                conn.send(("saved", spec.rank, None))
            continue
        if command == _STATS:
            if loaded is None or loaded.step is None:
                raise RuntimeError("asked for step statistics with no training model loaded")
            stats = {**loaded.step.stats(), **cpu_cache.counts()}
            stats = _largest_over_ranks(spec, stats, device)
            if leader:
                conn.send(("stats", spec.rank, stats))
            continue
        if loaded is None:
            raise RuntimeError("asked to run with no model loaded")
        if command == _GENERATE:
            if loaded.gears is None:
                raise RuntimeError("asked to generate with a package built without generation")
            generate_on_rank(
                loaded.gears, message, conn if leader else None, spec.distributed, device
            )
            continue
        if command == _SERVE:
            if loaded.gears is None:
                raise RuntimeError("asked to serve a package built without generation")
            shapes = loaded.gears.shapes
            suppressed = shapes.defaults.get("suppress_tokens") or []
            serve_on_rank(
                loaded.gears,
                conn if leader else None,
                (lambda text: _broadcast_text(text, device)) if spec.distributed else None,
                _keepalive_s(spec),
                shapes.eos_token_id,
                tuple(int(t) for t in suppressed),  # type: ignore[union-attr]
            )
            continue
        inputs: list[torch.Tensor] = []
        if leader:
            inputs = [x.to(device) for x in message[1]]
        if spec.distributed:
            # the session checked the inputs against the manifest, so only rank 0's travel
            if not leader:
                inputs = [
                    torch.empty(x.shape, dtype=torch_dtype(x.dtype), device=device)
                    for x in loaded.inputs
                ]
            for x in inputs:
                dist.broadcast(x, src=0)
        if loaded.step is not None:
            lr = torch.tensor([math.nan], dtype=torch.float64, device=device)
            if leader and len(message) > 2 and message[2] is not None:
                lr.fill_(float(message[2]))
            if spec.distributed:
                dist.broadcast(lr, src=0)
            if not math.isnan(lr.item()):
                loaded.step.set_learning_rate(lr.item())
            with torch.no_grad():
                outputs = [loaded.step.run(inputs)]
        else:
            with torch.inference_mode():
                outputs = loaded.program(*loaded.weights, *inputs)
        if leader:
            conn.send(("result", spec.rank, [o.cpu() for o in outputs]))
