"""Plan, then lower every rank exactly as planned: the step the inference build and the
training build both take."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tessel.capture import CapturedModel
from tessel.config.cluster import ClusterConfig
from tessel.config.parallel_option import ParallelOption
from tessel.lower.ranks import lower_every_rank
from tessel.lower.trace import PLACED_OTHERWISE, LoweringError, NotAsPlanned, RankProgram
from tessel.plan import Plan, PlanError, make_plan
from tessel.plan.stages import StageAssignment
from tessel.plan.strategies import describe_strategy, strategy_key
from tessel.progress import phase

log = logging.getLogger(__name__)


MAX_REPLANS = 25


def plan_and_lower(
    captured: CapturedModel,
    cluster: ClusterConfig,
    policy: ParallelOption | None = None,
    *,
    time_limit: float = 60.0,
    reuse_layers: bool = True,
    timings: dict[str, float] | None = None,
    reserve: int = 0,
    first: Plan | None = None,
    lowered: list[RankProgram] | None = None,
    stages: Callable[[Plan], StageAssignment] | None = None,
    explain: bool = True,
) -> tuple[Plan, list[RankProgram]]:
    """Plan for `cluster`, then lower every rank exactly as planned.

    With `stages`, each plan's layers are divided among the pipeline stages by it (`plan.stages`)
    before the plan is lowered, so a cut that cannot hold its weights is refused first.

    Where DTensor cannot run a node the way the plan places it, that strategy is dropped from
    the node's candidates and the model is planned again, so the program always is the plan;
    each such re-plan is recorded in the plan for `tessel inspect`. Where a lowered program
    would hold more than its device's memory (buffers the memory model does not see), the
    model is planned again with that much kept free; `reserve` bytes are kept free from the
    start (what the caller adds to the programs afterwards). `first` is a plan already made
    for this cluster, policy and reserve (the one `auto` weighed): it is lowered as it is, or,
    with `lowered`, its programs are those (the ones this function returned with it).
    Without `explain`, a model that does not fit is refused without saying by how much
    (`make_plan`'s), for a caller that tries other memory where none fits.
    """
    policy = policy or ParallelOption()
    timings = {} if timings is None else timings
    world = cluster.world_size
    if lowered is not None and (first is None or len(lowered) != world):
        raise ValueError(
            f"plan_and_lower: {len(lowered)} lowered programs were given for "
            f"{'no plan' if first is None else 'a plan'} of {world} ranks"
        )
    banned: dict[str, set] = {}
    replanned: list[dict[str, str]] = list(first.replanned) if lowered and first else []
    device_bytes = min(d.memory_bytes for d in cluster.devices)
    # bytes to keep free: `fits_below` too few (a program overflowed), `too_many` leaves no plan
    fits_below, too_many = 0, None
    for _ in range(MAX_REPLANS + 1):
        try:
            if first is not None:
                plan, first = first, None
            else:
                with phase(
                    f"planning {len(captured.program.graph.nodes)} nodes on {world} devices"
                ):
                    # where no plan fits, a smaller reserve is tried: why none fits is only
                    # said where none will be
                    plan = make_plan(
                        captured, cluster, policy, time_limit, banned=banned, reserve=reserve,
                        explain=explain and reserve <= fits_below + 1,
                    )  # fmt: skip
        except PlanError:
            if reserve <= fits_below + 1:
                raise
            too_many = reserve
            reserve = (fits_below + too_many) // 2
            continue
        for step in ("strategies", "solve"):
            timings[step] = timings.get(step, 0.0) + plan.timings.get(step, 0.0)
        if stages is not None and plan.stages is None:
            plan.stages = stages(plan)
        t = time.perf_counter()
        try:
            if lowered is not None:
                programs, lowered = lowered, None
            else:
                with phase(f"lowering the program of each of {world} ranks"):
                    programs = lower_every_rank(captured, plan, world, reuse_layers)
        except NotAsPlanned as exc:
            before = {owner: set(keys) for owner, keys in banned.items()}
            for node, strategy, reason in exc.failures:
                owner = (plan.choices[node].owner or node).name
                key = strategy_key(strategy)
                if key in before.get(owner, set()):
                    raise LoweringError(f"{exc} (that strategy was dropped already)") from exc
                if key in banned.get(owner, set()):
                    continue
                banned.setdefault(owner, set()).add(key)
                replanned.append(
                    {
                        "node": node.name,
                        "op": str(node.target),
                        "strategy": describe_strategy(strategy),
                        "reason": reason,
                    }
                )
                log.info("re-planning %s without %s: %s", owner, key, reason)
                if reason.startswith(PLACED_OTHERWISE):
                    # DTensor places an output by its operator and its inputs' placements:
                    # every node of that operator would be placed otherwise too
                    for other, c in plan.choices.items():
                        if other.target == node.target:
                            banned.setdefault((c.owner or other).name, set()).add(key)
            continue
        finally:
            timings["lower"] = timings.get("lower", 0.0) + time.perf_counter() - t
        worst = max(p.peak_bytes for p in programs)
        if worst > device_bytes:
            # keep free what the programs hold beyond what the memory model counted, and plan
            # again. The next plan's programs may hold a different excess, so the reserve goes
            # halfway there (at least past the overflow), and back down where it leaves no plan
            fits_below = reserve
            excess = worst - plan.memory["peak_bytes"]
            reserve += max(worst - device_bytes, (excess - reserve) // 2)
            if too_many is not None:
                reserve = min(reserve, (fits_below + too_many) // 2)
            if reserve <= fits_below:
                reserve = fits_below + 1
            replanned.append(
                {
                    "node": "(memory)",
                    "op": "",
                    "strategy": f"keep {reserve} bytes free",
                    "reason": f"a lowered program holds {worst} bytes at its peak, more than "
                    f"the {device_bytes} bytes of its device",
                }
            )
            log.info("re-planning with %d bytes kept free: a program needs %d", reserve, worst)
            continue
        plan.replanned = replanned
        return plan, programs
    raise LoweringError(
        f"the plan still cannot be lowered after {MAX_REPLANS} re-plans; last: {replanned[-1]}"
    )
