"""The planner's error, in a module of its own: the candidates and the planner both raise it."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.errors import TesselError


@dataclass(frozen=True)
class LeastMemory:
    """What the plan that needs the least memory holds per device at its peak, and of what:
    weights (state included), state (a generation step's cache), the rest activations."""

    peak_bytes: int
    weight_bytes: int
    state_bytes: int
    device_bytes: int  # the smallest device's


class PlanError(TesselError, RuntimeError):
    """The model cannot be placed on the cluster as asked; `least` says what the least plan
    needs where memory is why."""

    def __init__(self, message: str, least: LeastMemory | None = None) -> None:
        super().__init__(message)
        self.least = least


class PlanOutOfTime(PlanError):
    """The planner's time ran out before it found a plan or showed that none fits: whether
    one fits is not known (a longer time limit may find one)."""


class PlanSlower(PlanError):
    """The fastest plan, memory aside, is no faster than a bound the caller set (a rival's
    time): no plan of this problem beats the rival, so none is searched for."""

    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds
