"""Which instance of a consumer node takes a transaction; shared by the local and Ray executors.

Round-robin by transaction id: instance `(tid - 1) % n`. When that instance is dead and the
consumer has one input (no join waits for the transaction on that instance), the next live one
takes it. After a balance-scatter node, or everywhere with the deploy file's
`dynamic_schedule_enable`, a one-input consumer takes its least-loaded live instance instead;
ties go round the instances by transaction id. A consumer with several inputs always routes
round-robin, so every input of one transaction meets on the same instance.
"""

from __future__ import annotations

from collections.abc import Callable


def round_robin(n: int, tid: int, live: Callable[[int], bool], single_input: bool) -> int | None:
    """Instance `(tid - 1) % n`, or (one-input consumers only) the next live one; None if none."""
    idx = (tid - 1) % n
    if live(idx):
        return idx
    if single_input:
        for k in range(1, n):
            j = (idx + k) % n
            if live(j):
                return j
    return None


def least_loaded(
    n: int, tid: int, live: Callable[[int], bool], load: Callable[[int], float]
) -> int | None:
    """The live instance with the smallest `load(i)`; ties by distance from `tid % n`."""
    candidates = [i for i in range(n) if live(i)]
    if not candidates:
        return None
    return min(candidates, key=lambda i: (load(i), (i - tid) % n))


def pick(
    n: int,
    tid: int,
    live: Callable[[int], bool],
    single_input: bool,
    balanced: bool,
    load: Callable[[int], float],
) -> int | None:
    """The instance for `tid`: least-loaded when `balanced` and the consumer has one input."""
    if balanced and single_input and n > 1:
        return least_loaded(n, tid, live, load)
    return round_robin(n, tid, live, single_input)
