"""The result book: outputs and failures per transaction, handed out in transaction order."""

from __future__ import annotations

import threading
import time
from typing import Any

from tessel.dataflow.errors import FlowTimeout, TransactionFailed


class ResultBook:
    """Thread-safe store of finished transactions; each is completed once (ok or failed)."""

    def __init__(self, num_outputs: int) -> None:
        self.num_outputs = num_outputs
        self.cond = threading.Condition()
        self.expected: set[int] = set()
        self.partial: dict[int, dict[int, Any]] = {}
        self.info: dict[int, tuple] = {}
        self.done: dict[int, tuple[list[Any], tuple] | TransactionFailed] = {}

    def expect(self, tid: int) -> None:
        with self.cond:
            self.expected.add(tid)

    def forget(self, tid: int) -> None:
        with self.cond:
            self.expected.discard(tid)
            self.partial.pop(tid, None)
            self.done.pop(tid, None)

    def add_output(self, tid: int, index: int, value: Any, info: tuple) -> None:
        with self.cond:
            if tid not in self.expected or tid in self.done:
                return
            got = self.partial.setdefault(tid, {})
            got[index] = value
            self.info[tid] = info
            if len(got) == self.num_outputs:
                del self.partial[tid]
                self.done[tid] = ([got[i] for i in range(self.num_outputs)], self.info.pop(tid))
                self.cond.notify_all()

    def fail(self, exc: TransactionFailed) -> bool:
        """Record a failure; False when the transaction was already finished or unknown."""
        tid = exc.transaction_id
        with self.cond:
            if tid not in self.expected or tid in self.done:
                return False
            self.partial.pop(tid, None)
            self.info.pop(tid, None)
            self.done[tid] = exc
            self.cond.notify_all()
            return True

    def outstanding(self) -> list[int]:
        with self.cond:
            return sorted(t for t in self.expected if t not in self.done)

    def take(self, tid: int, timeout_s: float | None, poll: Any = None) -> Any:
        """Wait for `tid`; returns (outputs, info) or the TransactionFailed; FlowTimeout after
        `timeout_s` (None: forever). `poll()` is called while waiting (e.g. to pull results)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while tid not in self.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise FlowTimeout(
                        f"transaction {tid}: no result within {timeout_s * 1000:.0f} ms"
                    )
                if poll is not None:
                    self.cond.release()
                    try:
                        poll(tid, left)
                    finally:
                        self.cond.acquire()
                else:
                    self.cond.wait(0.5 if left is None else min(left, 0.5))
            res = self.done.pop(tid)
            self.expected.discard(tid)
            return res
