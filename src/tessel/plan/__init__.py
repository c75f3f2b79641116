"""Planning: candidate shardings per node, a cost model, a solver and the resulting plan."""

from tessel.plan.errors import PlanOutOfTime, PlanSlower
from tessel.plan.planner import Plan, PlanError, make_plan, mesh_for
from tessel.plan.strategies import has_rule

__all__ = ["Plan", "PlanError", "PlanOutOfTime", "PlanSlower", "has_rule", "make_plan", "mesh_for"]
