"""Planning: candidate shardings per node, a cost model, a solver and the resulting plan."""

from tessel.plan.planner import Plan, PlanError, make_plan, mesh_for

__all__ = ["Plan", "PlanError", "make_plan", "mesh_for"]
