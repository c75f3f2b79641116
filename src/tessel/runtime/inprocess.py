"""Run every rank of a partitioned model in this process: one thread per rank, collectives
exchanged in memory.

This is how a build checks its own output: each rank's program, decoded from the package's
members through the same loader the workers use, runs on its own weights, and each collective
meets the other ranks' calls in memory with the semantics of torch's functional collectives.
No process is started and nothing touches the network.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tessel._torch import C10D_FUNCTIONAL
from tessel.errors import TesselError
from tessel.runtime.loader import load_programs


class InProcessError(TesselError, RuntimeError):
    """A rank failed while the model ran in this process."""


class _Exchange:
    """Where the ranks' collective calls meet: the k-th call of each member of a group on that
    group is one collective."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cond = threading.Condition()
        self.posts: dict[tuple, dict[int, Any]] = {}
        self.reads: dict[tuple, int] = defaultdict(int)
        self.failed: BaseException | None = None

    def meet(self, group: tuple[int, ...], seq: int, rank: int, value: Any) -> list[Any]:
        """Post `value` and return every member's, in group order."""
        key = (group, seq)
        with self.cond:
            posted = self.posts.setdefault(key, {})
            posted[rank] = value
            self.cond.notify_all()
            done = self.cond.wait_for(
                lambda: self.failed is not None or len(posted) == len(group), self.timeout
            )
            if self.failed is not None:
                raise InProcessError(f"rank {rank} stopped: another rank failed")
            if not done:
                missing = [r for r in group if r not in posted]
                raise InProcessError(
                    f"rank {rank}: collective {seq} on ranks {list(group)} never met ranks "
                    f"{missing} (their programs call different collectives)"
                )
            values = [posted[r] for r in group]
            self.reads[key] += 1
            if self.reads[key] == len(group):
                del self.posts[key], self.reads[key]
            return values

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.failed = self.failed or exc
            self.cond.notify_all()


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    if op in ("sum", "avg"):
        out = functools.reduce(torch.add, values)
        return out / len(values) if op == "avg" else out
    if op == "product":
        return functools.reduce(torch.mul, values)
    if op == "min":
        return functools.reduce(torch.minimum, values)
    if op == "max":
        return functools.reduce(torch.maximum, values)
    raise InProcessError(f"reduce op {op!r} is not supported in process")


def _split_sizes(x: torch.Tensor, sizes: list[int], n: int) -> list[int]:
    return list(sizes) if sizes else [x.shape[0] // n] * n


class _Rank(fx.Interpreter):
    """One rank's program, its collectives answered through the exchange."""

    def __init__(
        self,
        gm: fx.GraphModule,
        rank: int,
        exchange: _Exchange,
        group_of: dict[str, tuple[int, ...]],
    ) -> None:
        super().__init__(gm)
        self.rank = rank
        self.exchange = exchange
        self.group_of = group_of
        self.seq: dict[tuple[int, ...], int] = defaultdict(int)
        self.impl: dict[str, Callable[..., Any]] = {
            "all_reduce": self._all_reduce,
            "all_reduce_coalesced": self._coalesced(self._all_reduce),
            "all_gather_into_tensor": self._all_gather,
            "all_gather_into_tensor_coalesced": self._coalesced(self._all_gather),
            "reduce_scatter_tensor": self._reduce_scatter,
            "reduce_scatter_tensor_coalesced": self._coalesced(self._reduce_scatter),
            "all_to_all_single": self._all_to_all,
            "broadcast": self._broadcast,
            "wait_tensor": lambda x: x,
        }

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(target, "namespace", None) == C10D_FUNCTIONAL:
            name = target._schema.name.split("::")[1]
            if name not in self.impl:
                raise InProcessError(f"collective {name} is not supported in process")
            return self.impl[name](*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def _meet(self, group_name: str, value: Any) -> tuple[list[Any], int]:
        group = self.group_of[group_name]
        seq = self.seq[group]
        self.seq[group] += 1
        return self.exchange.meet(group, seq, self.rank, value), group.index(self.rank)

    @staticmethod
    def _coalesced(single: Callable[..., torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
        def run(inputs: list[torch.Tensor], *rest: Any) -> list[torch.Tensor]:
            return [single(x, *rest) for x in inputs]

        return run

    def _all_reduce(self, x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
        values, _ = self._meet(group_name, x)
        return _reduce(values, op)

    def _all_gather(self, x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        values, _ = self._meet(group_name, x)
        return torch.cat(values, dim=0)

    def _reduce_scatter(
        self, x: torch.Tensor, op: str, group_size: int, group_name: str
    ) -> torch.Tensor:
        values, me = self._meet(group_name, x)
        return _reduce(values, op).chunk(group_size, dim=0)[me].clone()

    def _all_to_all(
        self, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
    ) -> torch.Tensor:
        group = self.group_of[group_name]
        pieces = list(x.split(_split_sizes(x, input_splits, len(group)), dim=0))
        values, me = self._meet(group_name, pieces)
        return torch.cat([v[me] for v in values], dim=0)

    def _broadcast(self, x: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
        values, _ = self._meet(group_name, x)
        return values[src].clone()  # `src` counts within the group, as torch's does


def run_in_process(
    package: Any, inputs: list[torch.Tensor], timeout: float = 600.0
) -> list[torch.Tensor]:
    """Rank 0's outputs of `package` (a `Package`, or a built model's members) on `inputs`."""
    return InProcessModel(package, timeout).run(inputs)


class InProcessModel:
    """Every rank of `package` loaded in this process, run one thread per rank: its program,
    and a generation package's gears, over weights (and state) each rank keeps between runs."""

    def __init__(self, package: Any, timeout: float = 600.0) -> None:
        manifest = package.manifest
        self.timeout = timeout
        self.single = manifest.mode != "partitioned" or manifest.world_size == 1
        groups = sorted({tuple(g) for s in manifest.submodels for g in s.comm_groups})
        name_of = {g: f"in-process:{','.join(map(str, g))}" for g in groups}
        self.group_of = {name: g for g, name in name_of.items()}
        cpu = torch.device("cpu")
        self.ranks: list[tuple[dict[int | str | None, fx.GraphModule], list[torch.Tensor]]] = []
        for rank in range(1 if self.single else manifest.world_size):
            self.ranks.append(load_programs(package, rank, cpu, {} if self.single else name_of))

    def run(
        self, inputs: list[torch.Tensor], gear: int | str | None = None, rank: int = 0
    ) -> list[torch.Tensor]:
        """`rank`'s outputs of the program (or the gear of `gear` tokens, or the one-row
        prefill gear `row_gear(n)`) on `inputs`."""
        if self.single:
            programs, weights = self.ranks[0]
            with torch.no_grad():
                return list(programs[gear](*weights, *inputs))
        exchange = _Exchange(self.timeout)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def work(rank: int) -> None:
            programs, weights = self.ranks[rank]
            interpreter = _Rank(programs[gear], rank, exchange, self.group_of)
            try:
                with torch.no_grad():
                    results[rank] = interpreter.run(*weights, *inputs)
            except BaseException as exc:  # noqa: BLE001 - reported below, after every rank stops
                errors[rank] = exc
                exchange.fail(exc)

        threads = [
            threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(self.ranks))
        ]
        threads_per_rank = max(1, torch.get_num_threads() // len(self.ranks))
        saved = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            torch.set_num_threads(saved)
        if errors:
            rank = min(errors, key=lambda r: isinstance(errors[r], InProcessError))
            exc = errors[rank]
            raise InProcessError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
        return list(results[rank])
