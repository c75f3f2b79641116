"""The serving engine: a generation package loaded on its devices, taking requests at any time.

Requests join the running batch at the next step and leave it the step they end (continuous
batching over the cache's rows, each row a slot one request owns from its admission to its
end). The per-token loop runs on the devices (`tessel.runtime.slots`, rank 0's worker
scheduling); this process only checks requests, queues them with rank 0 and hands each its
tokens as rank 0 reports them. The HTTP server is a thin layer over it; tests, notebooks and
the benchmark use it directly:

    engine = Engine("out/llama_gen.tessel")
    async for out in engine.submit(engine.request([1, 2, 3], max_tokens=8)):
        print(out.token, out.finish_reason)
    engine.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from tessel.config.errors import ConfigError
from tessel.serving.errors import EngineStopped, QueueFull, QueueTimeout
from tessel.serving.settings import NOT_SERVED, Limits, Request, request_for

_log = logging.getLogger(__name__)


class StopStringMatched(Exception):
    """Thrown into `Engine.submit`'s iteration (`athrow`) by a caller that matched a stop
    string: the request ends there, finished with reason "stop", its slot freed at the next
    step (leaving the iteration otherwise counts it aborted)."""


@dataclass(frozen=True)
class Output:
    """One new token of a request; `finish_reason` is set on its last: "stop" (a stop token),
    "length" (its `max_tokens`)."""

    token: int
    finish_reason: str | None = None


class Listener(Protocol):
    """What the engine reports as it runs (the server's metrics)."""

    def rejected(self, reason: str) -> None: ...
    def admitted(self, queue_seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def finished(
        self, reason: str, seconds: float, prompt_tokens: int, generated_tokens: int
    ) -> None: ...
    def aborted(self) -> None: ...
    def loop(self, stats: dict[str, int]) -> None: ...


@dataclass
class _Open:
    """A request the engine holds: its outputs as they come, and when it came."""

    request: Request
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent_at: float
    admitted: bool = False
    ended: bool = False


@dataclass
class _Counts:
    running: int = 0
    waiting: int = 0
    stats: dict[str, int] = field(default_factory=dict)


class Engine:
    """A generation package served: `request` checks a request, `submit` queues it and yields
    its tokens. Each row of the package's cache is a slot, held by one request from its
    admission to its last token; the serving loop runs on the workers, off this process.

    Args:
        package: A `.tessel` generation package.
        max_queued_requests: The requests that may wait beyond the free slots; more are
            refused with `QueueFull`.
        queue_timeout: Seconds a request may wait for a slot before it ends in
            `QueueTimeout`. Default: no limit.
        options: The Session's load options (`tessel.*`, `ge.*`).
        listener: What the engine reports to as it runs (the server's metrics).

    Raises:
        ConfigError: A package without generation gears, an encoder-decoder, a replicated
            package, or a model default that served requests do not build.
    """

    def __init__(
        self,
        package: str | Path,
        *,
        max_queued_requests: int = 64,
        queue_timeout: float | None = None,
        options: dict[str, Any] | None = None,
        listener: Listener | None = None,
    ) -> None:
        from tessel.package import Package
        from tessel.runtime.session import Session, initialize, is_initialized

        self.path = Path(package)
        manifest = Package.open(self.path).manifest
        gears = manifest.generation
        if gears is None:
            raise ConfigError(
                self.path,
                None,
                "was built without generation gears; serving needs a generation package "
                "(tessel.build(..., generation=tessel.Generation(...)))",
            )
        if gears.decoder_start_token_id is not None:
            raise ConfigError(
                self.path,
                "generation.decoder_start_token_id",
                "is set: this is an encoder-decoder, which tessel serve does not build yet "
                "(its decoder's positions follow the cache's length); use Session.generate",
            )
        for key in NOT_SERVED:
            value = gears.defaults.get(key)
            if value not in (None, 0, 0.0, 1, 1.0, []):
                raise ConfigError(
                    self.path,
                    f"generation.defaults.{key}",
                    f"is {value!r}: the model sets it, and served requests do not build it "
                    "(Session.generate does)",
                )
        if manifest.mode == "replicated" and manifest.mesh.size > 1:
            raise ConfigError(
                self.path,
                "mode",
                "is replicated: serve a package partitioned over its devices (data-parallel "
                "replicas as a mesh axis)",
            )
        if not isinstance(max_queued_requests, int) or max_queued_requests < 0:
            raise ConfigError(
                "Engine()",
                "max_queued_requests",
                f"must be 0 or more, found {max_queued_requests!r}",
            )
        if queue_timeout is not None and not queue_timeout > 0:
            raise ConfigError(
                "Engine()", "queue_timeout", f"must be above 0 seconds, found {queue_timeout!r}"
            )
        self.limits = Limits(
            slots=gears.max_batch_size,
            prefill_lengths=gears.prefill_lengths,
            max_seq_len=gears.max_seq_len,
            vocab_size=gears.vocab_size,
            eos_token_id=gears.eos_token_id,
            defaults=dict(gears.defaults),
        )
        self.max_queued_requests = max_queued_requests
        self.queue_timeout = queue_timeout
        self.listener = listener
        self._ids = itertools.count()
        self._open: dict[int, _Open] = {}
        self._counts = _Counts()
        self._lock = threading.Lock()
        self._idle = threading.Event()  # set while no request is open
        self._idle.set()
        self._stopped: str | None = None  # why the engine takes no more requests
        self._dead = False  # a worker stopped: nothing more is sent to rank 0
        self.healthy = False
        if not is_initialized():  # an engine is a runtime of its own where none was started
            initialize()
        self._session = Session(options)
        try:
            self._session.load_graph(0, options, self.path)
            graph = self._session._graph(0)
            self._workers = graph.workers
            self._conn: Connection = self._workers.conns[0]
            self._conn.send(("serve", {}))
        except BaseException:
            self._session.close()
            raise
        self.healthy = True
        self._reader = threading.Thread(target=self._read, name="tessel-engine", daemon=True)
        self._reader.start()

    # -- requests -------------------------------------------------------------------------

    def request(self, prompt: Sequence[int], **fields: Any) -> Request:
        """A checked request.

        Args:
            prompt: The prompt's token ids.

        Returns:
            The request, for `submit`. Its fields (`max_tokens`, `temperature`, `top_p`,
            `top_k`, `min_p`, `repetition_penalty`, `seed`, `min_tokens`, `ignore_eos`) are
            what `tessel.serving.settings.request_for` takes.

        Raises:
            BadRequest: A field out of range or a prompt too long, naming the field.
        """
        return request_for(self.limits, prompt, **fields)

    async def submit(self, request: Request) -> AsyncIterator[Output]:
        """Queue `request` and yield its tokens as they are made.

        Leaving the iteration early (a client gone) frees its slot at the next step, the
        request counted aborted. A caller that matched a stop string throws
        `StopStringMatched` into it instead.

        Args:
            request: What `request` returned.

        Returns:
            An async iterator of the request's outputs: one per new token, the last with
            its `finish_reason` ("stop" or "length").

        Raises:
            QueueFull: Every slot is taken and the queue is full.
            QueueTimeout: The request waited past `queue_timeout`.
            EngineStopped: The engine is draining, closed, or lost a worker.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._stopped is not None:
                raise EngineStopped(self._stopped)
            free = self.limits.slots - self._counts.running
            if self._counts.waiting >= self.max_queued_requests + max(0, free):
                self._report("rejected", "queue_full")
                raise QueueFull(
                    f"{self._counts.waiting} requests wait for the {self.limits.slots} slots; "
                    f"the queue holds {self.max_queued_requests} (--max-queued-requests)"
                )
            rid = next(self._ids)
            held = _Open(request, asyncio.Queue(), loop, time.monotonic())
            self._open[rid] = held
            self._idle.clear()
            self._counts.waiting += 1
            self._conn.send(("admit", rid, request.to_json()))
        last = held.sent_at
        count = 0
        stopped = False  # ended by the caller's stop string
        try:
            while True:
                timeout = None
                if not held.admitted and self.queue_timeout is not None:
                    timeout = max(0.0, held.sent_at + self.queue_timeout - time.monotonic())
                try:
                    item = await asyncio.wait_for(held.outputs.get(), timeout)
                except asyncio.TimeoutError:
                    self._report("rejected", "timeout")
                    raise QueueTimeout(
                        f"the request waited {self.queue_timeout} s for a slot (--queue-timeout)"
                    ) from None
                if isinstance(item, BaseException):
                    raise item
                if item is None:  # admitted
                    continue
                now = time.monotonic()
                self._report("first_token" if count == 0 else "token_gap", now - last)
                last = now
                count += 1
                if item.finish_reason is not None:  # reported before a caller may stop reading
                    self._report(
                        "finished",
                        item.finish_reason,
                        now - held.sent_at,
                        len(request.prompt),
                        count,
                    )
                try:
                    yield item
                except StopStringMatched:
                    stopped = True
                    self._report("finished", "stop", now - held.sent_at, len(request.prompt), count)
                    return
                if item.finish_reason is not None:
                    return
        finally:
            self._forget(rid, cancel=not held.ended, aborted=not stopped)

    def _forget(self, rid: int, cancel: bool, aborted: bool = True) -> None:
        with self._lock:
            held = self._open.pop(rid, None)
            if not self._open:
                self._idle.set()
            if held is None:
                return
            if held.admitted and not held.ended:
                self._counts.running -= 1
            elif not held.admitted:
                self._counts.waiting -= 1
            if cancel and not self._dead:
                if held.admitted and aborted:
                    self._report("aborted")
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(("cancel", rid))

    # -- rank 0's reports -----------------------------------------------------------------

    def _read(self) -> None:
        """Hand each request its outputs as rank 0 reports them; on a worker's death end
        every open request."""
        conns = list(self._workers.conns)
        sentinels = [p.sentinel for p in self._workers.procs if hasattr(p, "sentinel")]
        try:
            while True:
                ready = wait(conns + sentinels)
                if any(s in ready for s in sentinels) and not self._conn.poll():
                    raise EOFError
                for conn in (c for c in ready if isinstance(c, Connection)):
                    message = conn.recv()
                    if message[0] == "error":
                        _log.error("rank %s failed:\n%s", message[1], message[2][2])
                        raise RuntimeError(f"rank {message[1]}: {message[2][0]}: {message[2][1]}")
                    if message[0] == "serving-stopped":
                        return
                    if message[0] == "step":
                        self._step(message[1], message[2])
        except (EOFError, OSError, RuntimeError) as exc:
            self._die(f"a worker stopped: {exc}" if str(exc) else "a worker stopped")

    def _step(self, events: list, stats: dict[str, int]) -> None:
        with self._lock:
            self._counts.stats = stats
            for rid, token, reason in events:
                held = self._open.get(rid)
                if held is None:
                    continue
                if token is None:  # admitted, or (with a reason) ended unserved
                    if reason is None and not held.admitted:
                        held.admitted = True
                        self._counts.waiting -= 1
                        self._counts.running += 1
                        self._report("admitted", time.monotonic() - held.sent_at)
                        held.loop.call_soon_threadsafe(held.outputs.put_nowait, None)
                    continue
                if reason is not None:
                    held.ended = True
                    self._counts.running -= 1
                held.loop.call_soon_threadsafe(held.outputs.put_nowait, Output(token, reason))
            self._report("loop", {**stats, "slots_total": self.limits.slots})

    def _die(self, why: str) -> None:
        with self._lock:
            self.healthy = False
            self._dead = True
            self._stopped = "a worker stopped"
            for held in self._open.values():
                error = EngineStopped(f"the engine stopped: {why}")
                with contextlib.suppress(RuntimeError):  # a loop already closed
                    held.loop.call_soon_threadsafe(held.outputs.put_nowait, error)

    def _report(self, event: str, *args: Any) -> None:
        if self.listener is not None:
            getattr(self.listener, event)(*args)

    # -- state and end --------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self._counts.running

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return self._counts.waiting

    @property
    def stats(self) -> dict[str, int]:
        """Rank 0's latest counts: `running`, `waiting`, `slots_used`, `admissions`, `prefills`,
        `decode_steps`, `compactions`, and the microseconds spent in the gears (`gears_us`)
        and in the scheduler around them (`scheduler_us`)."""
        return dict(self._counts.stats)

    def stop_admitting(self, why: str = "the engine is draining") -> None:
        """Refuse new requests with `EngineStopped`; those open run on.

        Args:
            why: What the refusal says.
        """
        with self._lock:
            if self._stopped is None:
                self._stopped = why
                self.healthy = False

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, then wait for the open requests to end.

        Args:
            timeout: Seconds to wait.

        Returns:
            True if every open request ended in time.
        """
        self.stop_admitting()
        return await asyncio.to_thread(self._idle.wait, timeout)

    def close(self) -> None:
        """End every open request, stop the serving loop and the workers."""
        self.stop_admitting("the engine is closed")
        with self._lock:
            for held in self._open.values():
                error = EngineStopped("the engine was closed")
                with contextlib.suppress(RuntimeError):
                    held.loop.call_soon_threadsafe(held.outputs.put_nowait, error)
        if self._reader.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("stop-serving",))
            self._reader.join(10)
        self._session.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
