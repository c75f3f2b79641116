"""Shared-memory channels between processes of one host.

A Channel joins one producer process to one consumer process. Its data lives in an anonymous
shared mapping (mmap(-1)) made before the workers fork, so both sides see the same pages: the
producer copies a tensor's bytes into a free slot and sends a small header down a pipe; the
consumer maps the slot as a tensor (a view, or one copy for UDFs) and frees the slot once it has
forwarded the transaction. A counting semaphore of free slots bounds the queue (backpressure).

Each slot's header holds (state, transaction id). A used slot is the record that a transaction is
inside the consumer, so when a consumer dies the transactions it held can be named and failed.
Values larger than a slot fall back to torch's own shared-memory tensors (torch.multiprocessing),
other Python objects are pickled into the slot.
"""

from __future__ import annotations

import mmap
import pickle
import time
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers shared-memory tensor pickling)

_ALIGN = 64
FREE, USED = 0, 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Channel:
    """One-way, bounded, shared-memory queue from one producer to one consumer."""

    def __init__(self, ctx: Any, slots: int, slot_bytes: int, label: str) -> None:
        self.label = label
        self.slots = slots
        self.slot_bytes = _align(slot_bytes)
        header = _align(slots * 16)
        self._mm = mmap.mmap(-1, header + slots * self.slot_bytes)
        self.header = np.frombuffer(self._mm, dtype=np.int64, count=slots * 2).reshape(slots, 2)
        self._data_off = header
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.free = ctx.BoundedSemaphore(slots)
        self.lock = ctx.Lock()
        self._cursor = 0

    # ---- producer side -------------------------------------------------------------------
    def acquire(self, deadline: float | None, alive: Any = None) -> bool:
        """Wait for a free slot; False on timeout or when `alive()` turns false."""
        while True:
            wait = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if wait <= 0:
                return self.free.acquire(False)
            if self.free.acquire(True, wait):
                return True
            if alive is not None and not alive():
                return False

    def put(self, tid: int, dst_input: int, value: Any, info: tuple) -> int:
        """Write `value` into a slot (one already acquired) and send its header. Returns the slot."""
        slot = self._cursor
        for _ in range(self.slots):
            if self.header[slot, 0] == FREE:
                break
            slot = (slot + 1) % self.slots
        else:  # cannot happen while the semaphore counts right
            raise RuntimeError(f"channel {self.label}: no free slot although one was acquired")
        self._cursor = (slot + 1) % self.slots
        meta = self._write(slot, value)
        self.header[slot, 1] = tid
        self.header[slot, 0] = USED
        self.writer.send((tid, dst_input, slot, meta, info))
        return slot

    def _write(self, slot: int, value: Any) -> tuple:
        off = self._data_off + slot * self.slot_bytes
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            nbytes = t.numel() * t.element_size()
            if nbytes > self.slot_bytes:
                return ("T", t.contiguous().share_memory_())
            dst = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=off)
            if nbytes:
                dst.copy_(t.contiguous().reshape(-1).view(torch.uint8))
            return ("t", t.dtype, tuple(t.shape), nbytes)
        if isinstance(value, np.ndarray) and value.dtype != object:
            a = np.ascontiguousarray(value)
            if a.nbytes <= self.slot_bytes:
                np.frombuffer(self._mm, np.uint8, a.nbytes, off)[:] = a.reshape(-1).view(np.uint8)
                return ("n", a.dtype.str, a.shape, a.nbytes)
        raw = pickle.dumps(value, protocol=5)
        if len(raw) > self.slot_bytes:
            return ("P", raw)
        self._mm[off : off + len(raw)] = raw
        return ("p", len(raw))

    # ---- consumer side -------------------------------------------------------------------
    def read(self, slot: int, meta: tuple, copy: bool) -> Any:
        """The value in `slot`: a view of the shared pages, or a private copy."""
        off = self._data_off + slot * self.slot_bytes
        kind = meta[0]
        if kind == "t":
            _, dtype, shape, nbytes = meta
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=off)
            t = raw.view(dtype).reshape(shape)
            return t.clone() if copy else t
        if kind == "n":
            _, dtype, shape, nbytes = meta
            a = np.frombuffer(
                self._mm,
                dtype=np.dtype(dtype),
                count=nbytes // np.dtype(dtype).itemsize,
                offset=off,
            ).reshape(shape)
            return a.copy() if copy else a
        if kind == "p":
            return pickle.loads(self._mm[off : off + meta[1]])
        if kind == "P":
            return pickle.loads(meta[1])
        if kind == "T":
            return meta[1]
        raise ValueError(f"channel {self.label}: unknown payload kind {kind!r}")

    def release(self, slot: int) -> None:
        """Free a slot the consumer is done with."""
        self.header[slot, 0] = FREE
        self.free.release()

    def reclaim(self) -> list[int]:
        """After the consumer died: free every used slot; returns their transaction ids."""
        tids = []
        with self.lock:
            for s in range(self.slots):
                if self.header[s, 0] == USED:
                    tids.append(int(self.header[s, 1]))
                    self.header[s, 0] = FREE
                    try:
                        self.free.release()
                    except ValueError:
                        pass
        return tids

    def unsend(self, slot: int) -> bool:
        """Producer side: take back a slot whose consumer died after the send (if still used)."""
        with self.lock:
            if self.header[slot, 0] != USED:
                return False
            self.header[slot, 0] = FREE
            try:
                self.free.release()
            except ValueError:
                pass
            return True
