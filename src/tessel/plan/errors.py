"""The planner's error, in a module of its own: the candidates and the planner both raise it."""

from __future__ import annotations

from tessel.errors import TesselError


class PlanError(TesselError, RuntimeError):
    """The model cannot be placed on the cluster as asked."""
