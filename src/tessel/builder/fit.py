"""Plan and lower until every rank's program fits its device: the one fitting loop of every
build (inference and training alike), its policies given as data.

A build offers `Level`s, tried in order until one fits: an inference build has one, a training
step one per sharding level it may take (`builder/training.py`), each saying what the memory
model counts per weight and what the build keeps free beside the programs. Within a level:

- the model is planned and lowered (`plan_and_lower`, which re-plans a program that overflows
  its device);
- with stages, each plan's layers are divided among the stages (`stages`) before it is lowered;
- with replicas or stages, `cut` makes every rank's program from one replica's; a stage holds
  about 1/pp of the weights, so the model is planned on its devices with pp times their
  memory, then with less where a stage's weights or program overflow (bisecting between the
  most memory that overflows and the least that leaves no plan); with replicas and no
  stages, what a cut program overflows by is kept free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tessel.builder.lowering import plan_and_lower
from tessel.builder.mesh_choice import first_devices
from tessel.builder.stages import more_memory
from tessel.capture import CapturedModel
from tessel.config.cluster import ClusterConfig
from tessel.config.mesh import ParallelDims
from tessel.config.parallel_option import ParallelOption
from tessel.lower.trace import RankProgram
from tessel.plan import Plan, PlanError
from tessel.plan.stages import StageAssignment, StageMemoryError
from tessel.progress import phase
from tessel.units import human_bytes, two_sizes

log = logging.getLogger(__name__)

# a cut of one replica's programs into every rank's: what it returns is the build's to read
Cut = Callable[[Plan, list[RankProgram]], Any]


@dataclass(frozen=True)
class Level:
    """One way to hold the model, tried in order: its name in the plan's report, what to do
    before planning with it (a training step marks the bytes each weight holds), and the
    bytes kept free beside the programs."""

    name: str = ""
    reserve: int = 0
    prepare: Callable[[], None] | None = None


@dataclass
class Fitted:
    """The plan that fits and its programs, what `cut` made of them, the level that fits and
    why each level before it did not."""

    plan: Plan
    programs: list[RankProgram]
    level: Level
    cut: Any = None  # what `cut` returned, where the build has one
    weighed: list[str] = field(default_factory=list)


def fit(
    captured: CapturedModel,
    cluster: ClusterConfig,
    policy: ParallelOption,
    dims: ParallelDims,
    levels: Sequence[Level],
    *,
    stages: Callable[[Plan], StageAssignment] | None = None,
    cut: Cut | None = None,
    time_limit: float,
    reuse_layers: bool,
    timings: dict[str, float],
    first: Plan | None = None,
    lowered: list[RankProgram] | None = None,
    explain: bool = True,
) -> Fitted:
    """The first of `levels` whose plan fits `cluster` (planned on one replica's devices
    where `dims` has replicas or stages), each plan's layers divided among the stages by `stages`
    before it is lowered, and every rank's program cut from the lowered ones where `cut` is
    given. `first` (and its `lowered` programs) is a plan already made for the first level.
    Without `explain`, where no level fits, the error does not say by how much (for a caller
    that then tries another way)."""
    weighed: list[str] = []
    for i, level in enumerate(levels):
        if level.prepare is not None:
            level.prepare()
        try:
            fitted = _fit_level(
                captured, cluster, policy, dims, level, stages, cut, time_limit, reuse_layers,
                timings, first, lowered, explain,
            )  # fmt: skip
        except PlanError as exc:
            if i == len(levels) - 1:
                raise
            weighed.append(f"{level.name}: does not fit ({exc})")
            log.info("%s does not fit; trying the next level", level.name)
            continue
        finally:
            first, lowered = None, None  # a later level plans anew
        fitted.weighed = weighed
        return fitted
    raise ValueError("fit: no level to try")


def _fit_level(
    captured: CapturedModel,
    cluster: ClusterConfig,
    policy: ParallelOption,
    dims: ParallelDims,
    level: Level,
    stages: Callable[[Plan], StageAssignment] | None,
    cut: Cut | None,
    time_limit: float,
    reuse_layers: bool,
    timings: dict[str, float],
    first: Plan | None,
    lowered: list[RankProgram] | None,
    explain: bool,
) -> Fitted:
    dp, pp = dims.size("dp"), dims.size("pp")
    plan_cluster = first_devices(cluster, dims.size("tp")) if dp * pp > 1 else cluster
    reserve = level.reserve
    scale, overflows, no_plan, tries = float(pp), None, 1.0, 0
    device_bytes = min(d.memory_bytes for d in plan_cluster.devices)
    overflowed: StageMemoryError | None = None  # the stage overflow at the most memory tried
    while True:
        try:
            plan, programs = plan_and_lower(
                captured,
                more_memory(plan_cluster, scale) if pp > 1 else plan_cluster,
                policy,
                time_limit=time_limit,
                reuse_layers=reuse_layers,
                timings=timings,
                reserve=reserve,
                first=first,
                lowered=lowered,
                stages=stages,
                # bisecting, a scale with no plan is only a bound: why is never said
                explain=explain and overflows is None,
            )
            if cut is None:
                return Fitted(plan, programs, level)
            t = time.perf_counter()
            try:
                with phase("making every rank's stage program"):
                    made = cut(plan, programs)
            finally:
                timings["stages"] = timings.get("stages", 0.0) + time.perf_counter() - t
            return Fitted(plan, programs, level, made)
        except StageMemoryError as exc:  # the stage cut's weights, or a stage's program
            if pp == 1:
                tries += 1
                if tries > 3:
                    raise
                reserve += exc.needed - exc.limit
                continue
            if scale - no_plan < 0.02:
                raise
            overflows, overflowed = scale, overflowed or exc
            if exc.planned is None:
                scale = max((scale + no_plan) / 2, min(scale * 0.9, scale * exc.limit / exc.needed))
            else:
                # the plan held `planned` of the memory it was given: its weights change only
                # below that, where the stages' weights shrink about as the memory does
                used = min(scale, exc.planned / device_bytes)
                scale = max(no_plan + 0.02, min(scale * 0.9, used * exc.limit / exc.needed))
            log.info(
                "a stage needs %d bytes of its device's %d: planning with %.2fx their memory",
                exc.needed, exc.limit, scale,
            )  # fmt: skip
        except PlanError as exc:
            if overflows is None and pp > 1 and type(exc) is PlanError and exc.least:
                raise _over_stages(exc, pp, plan_cluster) from None
            if overflows is None:
                raise
            if overflows - scale < 0.02:
                # planned with less memory no plan fits, with more a stage overflows: the
                # overflow is what the devices lack
                raise overflowed from None
            no_plan, scale = scale, (scale + overflows) / 2
        finally:
            first, lowered = None, None  # a second try plans anew


def _over_stages(exc: PlanError, pp: int, cluster: ClusterConfig) -> PlanError:
    """`exc`, raised for the whole model planned on one stage's devices with `pp` times their
    memory, said for the devices themselves: about 1/pp of its least plan per device."""
    least = exc.least
    assert least is not None
    per_stage = -(-least.peak_bytes // pp)
    device = min(d.memory_bytes for d in cluster.devices)
    needs, has = two_sizes(per_stage, device)
    return PlanError(
        f"the model does not fit {pp} pipeline stages: a plan of the whole model needs at "
        f"least {human_bytes(least.peak_bytes)} per device at its peak "
        f"({human_bytes(least.weight_bytes)} of weights), about {needs} per device for each "
        f"of {pp} stages, but the smallest device in {cluster.source} has {has}; use more "
        f"stages or more tensor parallelism, or devices of at least about {needs}",
        replace(least, device_bytes=device),
    )
