"""Why a plan replicates a weight over a tensor-parallel mesh axis, from the planner's own model.

For each weight decision the plan replicates on an axis of more than one device, the reason is
the first that holds of:

- `buffer`: it is a buffer or constant, not a parameter: the planner's candidates for those
  are whole tensors only;
- `fixed`: the policy gives its placement (tessel.parallel's annotations);
- `unsplittable`: no candidate shards it on that axis (each dimension of one row);
- `no_rule`: every operator that reads it has no sharding rule and runs replicated;
- otherwise the estimate: the best plan found that shards it on that axis (at least one of
  them), against the chosen plan, by the same costs and memory rows the solver used. That plan
  is found by re-solving the weight's neighbourhood, not the whole model: the decisions of its
  layer (or, outside layers, of the rest of the graph), at most `REGION_DECISIONS` of them
  nearest to it, each other decision kept as chosen, exactly by O1's variable elimination. So
  the estimate is what sharding this weight costs with the rest of the plan as it is: an upper
  bound on what the best plan sharding it costs. Then the reason is `faster` (the chosen plan
  is the faster, and it fits), `memory` (the sharded plan is no slower but does not fit the
  devices), or `tolerance` (it is no slower and fits: the solver stopped within its gap).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np
from torch import fx
from torch.distributed.tensor import Replicate, Shard

from tessel.capture.layers import layer_of
from tessel.plan import dp
from tessel.plan.ilp import MIP_GAP, cpu_seconds
from tessel.plan.memory import MemoryModel
from tessel.plan.planner import Plan
from tessel.plan.problem import Problem
from tessel.sharding.placements import placement_str
from tessel.units import human_bytes

REASONS = ("buffer", "fixed", "unsplittable", "no_rule", "faster", "memory", "tolerance", "skipped")
# decisions re-solved per weight: a transformer layer has fewer (a Llama layer 82); past it,
# the nearest (on a 4-layer Llama planned without layers, 64 gave the estimates 256 did)
REGION_DECISIONS = 128
# CPU seconds spent on the estimates of one plan; weights past it are reported as not estimated
TIME_BUDGET = 5.0
_FORBIDDEN = 1e9  # seconds: a cost no chosen strategy has, to keep a weight off replicas


@dataclass(frozen=True)
class Replicated:
    """Why one weight is replicated on the tensor-parallel axes `axes`."""

    reason: str  # one of REASONS
    axes: tuple[str, ...]
    text: str
    slower_s: float | None = None  # the sharded plan's estimated time minus the chosen's
    sharded: tuple[str, ...] | None = None  # the weight's placements in that plan
    saves_bytes: int | None = None  # weight bytes per device the sharded plan holds fewer
    sharded_fits: bool | None = None  # whether that plan fits the devices' memory


def replicated_weights(plan: Plan, time_budget: float = TIME_BUDGET) -> dict[str, Replicated]:
    """Why, by weight FQN, each weight the plan replicates on a tensor-parallel axis of more
    than one device is replicated. Identical layers' weights share one decision and one
    reason. Empty where the plan kept no problem (it was not solved by `make_plan`)."""
    problem, held = plan.problem, plan.memory_model
    if problem is None or held is None:
        return {}
    placeholders = {n.name: n for n in plan.choices if n.op == "placeholder"}
    by_owner: dict[fx.Node, list[str]] = defaultdict(list)
    for name, fqn in plan.param_targets.items():
        n = placeholders.get(name)
        if n is None or plan.choices[n].kind not in ("param", "input"):
            continue
        by_owner[plan.choices[n].owner or n].append(fqn)
    solver = _Resolver(plan, problem, held)
    start = cpu_seconds()
    out: dict[str, Replicated] = {}
    for owner, fqns in by_owner.items():
        axes = _replicated_axes(plan, plan.out_placements(owner))
        if not axes:
            continue
        if cpu_seconds() - start > time_budget:
            why = Replicated(
                "skipped",
                axes,
                f"replicated over {'+'.join(axes)}: not estimated (the {time_budget:g} s the "
                "build spends on these estimates ran out)",
            )
        else:
            why = _why(plan, solver, owner, fqns, axes)
        for fqn in fqns:
            out[fqn] = why
    return out


def summary(plan: Plan, reasons: dict[str, Replicated], total: int) -> str | None:
    """One line for the build log where most of the `total` weights are replicated on the
    tensor-parallel axes; None otherwise."""
    size = int(np.prod(plan.mesh_shape)) if plan.mesh_shape else 1
    if size <= 1 or total == 0 or 2 * len(reasons) <= total:
        return None
    parts = []
    timed = [r for r in reasons.values() if r.reason == "faster"]
    if timed:
        low = min(r.slower_s or 0.0 for r in timed)
        high = max(r.slower_s or 0.0 for r in timed)
        span = _ms(high) if abs(high - low) < 5e-6 else f"{_ms(low)} to {_ms(high)}"
        parts.append(
            f"{len(timed)}: sharding any one of them is estimated {span} slower per run and "
            "memory allows the replicas"
        )
    counts: dict[str, int] = defaultdict(int)
    for r in reasons.values():
        if r.reason != "faster":
            counts[r.reason] += 1
    words = {
        "buffer": "buffers or constants (held whole)",
        "fixed": "placed by the policy",
        "unsplittable": "with no dimension that splits",
        "no_rule": "read by operators without a sharding rule",
        "memory": "whose sharded plans do not fit memory",
        "tolerance": "within the solver's tolerance of a sharded plan",
        "skipped": "not estimated (time)",
    }
    parts += [f"{k} {words[reason]}" for reason, k in counts.items()]
    return (
        f"tensor parallel over {size} devices: {len(reasons)} of {total} weights replicated; "
        + "; ".join(parts)
        + " (tessel inspect shows each)"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _replicated_axes(plan: Plan, placements: tuple) -> tuple[str, ...]:
    return tuple(
        name
        for name, size, p in zip(plan.mesh_names, plan.mesh_shape, placements)
        if size > 1 and isinstance(p, Replicate)
    )


def _why(
    plan: Plan, solver: _Resolver, owner: fx.Node, fqns: list[str], axes: tuple[str, ...]
) -> Replicated:
    over = "+".join(axes)
    c = plan.choices[owner]
    if c.kind == "input":
        return Replicated(
            "buffer",
            axes,
            f"replicated over {over}: a buffer or constant, not a parameter; the planner "
            "holds those whole",
        )
    if plan.fixed & set(fqns):
        return Replicated("fixed", axes, f"replicated over {over}: the policy places it so")
    index = [plan.mesh_names.index(a) for a in axes]
    allowed = [
        k
        for k, s in enumerate(c.strategies)
        if any(isinstance(s.single_output().placements[i], Shard) for i in index)
    ]
    if not allowed:
        shape = list(owner.meta["val"].shape)
        return Replicated(
            "unsplittable",
            axes,
            f"replicated over {over}: no candidate shards it there (shape {shape}: a "
            "dimension of one row stays whole)",
        )
    readers = [u for u in owner.users if u in plan.choices]
    if readers and all(plan.choices[u].kind == "fallback" for u in readers):
        ops = sorted({str(u.target) for u in readers})
        return Replicated(
            "no_rule",
            axes,
            f"replicated over {over}: {', '.join(ops)} reading it has no sharding rule and "
            "runs replicated",
        )
    alt = solver.best_with(owner, allowed)
    slower = solver.cost(alt) - solver.chosen_cost
    fits = solver.fits(alt)
    sharded = tuple(placement_str(p) for p in c.strategies[alt[owner]].single_output().placements)
    saves = solver.memory.held(plan.choice).weight_bytes - solver.memory.held(alt).weight_bytes
    shown = "/".join(sharded)
    tail = f" (sharding saves {human_bytes(saves)} per device)" if saves > 0 else ""
    if len(fqns) > 1:  # identical layers and tied weights share one placement
        others = f"{len(fqns) - 1} other weight" + ("s" if len(fqns) > 2 else "")
        tail += f"; it shares its placement with {others} (identical layers or tied weights)"
    if slower > 0:  # the chosen plan fits: the solver kept every memory row in budget
        reason = "faster"
        text = (
            f"replicated over {over}: estimated {_ms(slower)} per run faster than the best plan "
            f"found that shards it ({shown}); memory allows the replicas{tail}"
            + ("" if fits else "; that sharded plan would not fit the devices' memory")
        )
    elif not fits:
        reason = "memory"
        text = (
            f"replicated over {over}: the best plan found sharding it ({shown}) is estimated "
            f"{_ms(-slower)} per run faster but does not fit the devices' memory{tail}"
        )
    else:
        reason = "tolerance"
        text = (
            f"replicated over {over}: a plan sharding it ({shown}) is estimated no slower "
            f"({_ms(max(0.0, -slower))} per run faster), within the solver's tolerance "
            f"({MIP_GAP:.0%} of the estimate){tail}"
        )
    return Replicated(reason, axes, text, float(slower), sharded, int(saves), bool(fits))


class _Resolver:
    """Re-solves a weight's neighbourhood of the plan's problem with that weight kept off the
    strategies that replicate it, every other decision as chosen."""

    def __init__(self, plan: Plan, problem: Problem, memory: MemoryModel) -> None:
        self.plan, self.problem, self.chosen = plan, problem, plan.choice
        self.memory = memory
        self.pairs_of: dict[object, list[tuple]] = defaultdict(list)
        self.adjacent: dict[object, set] = defaultdict(set)
        for a, b in problem.pairs:
            self.pairs_of[a].append((a, b))
            if b is not a:
                self.pairs_of[b].append((a, b))
                self.adjacent[a].add(b)
                self.adjacent[b].add(a)
        self.region = {v: _region(v) for v in problem.sizes}
        # elimination orders by neighbourhood: the weights of one layer share theirs
        self.orders: dict[frozenset, list] = {}
        self.chosen_cost = self.cost(self.chosen)

    def cost(self, choice: dict) -> float:
        """The estimated time of `choice`, as the solvers count it."""
        return self.problem.cost_of(choice)

    def fits(self, choice: dict) -> bool:
        return self.memory.fits(choice)

    def neighbourhood(self, v: object) -> list[object]:
        """The decisions nearest `v` (breadth first over the costs that join them) in its
        region, at most REGION_DECISIONS."""
        label = self.region[v]
        seen, queue = {v: None}, deque([v])
        while queue and len(seen) < REGION_DECISIONS:
            u = queue.popleft()
            for w in self.adjacent[u]:
                if w not in seen and (self.region[w] == label or self.region[w] is None):
                    seen[w] = None
                    queue.append(w)
                    if len(seen) >= REGION_DECISIONS:
                        break
        return list(seen)

    def best_with(self, v: object, allowed: list[int]) -> dict:
        """The chosen plan with `v`'s neighbourhood re-solved, `v` taking one of `allowed`."""
        p, chosen = self.problem, self.chosen
        free = self.neighbourhood(v)
        inside = set(free)
        sizes = {u: p.sizes[u] for u in free}
        linear = {u: np.zeros(p.sizes[u]) for u in free}
        factors: list[dp._Factor] = []
        seen: set[tuple] = set()
        for u in free:
            if u in p.linear:
                linear[u] += p.linear[u]
            for key in self.pairs_of[u]:
                if key in seen:
                    continue
                seen.add(key)
                a, b = key
                m = p.pairs[key]
                if a is b:
                    linear[a] += np.diag(m)
                elif a in inside and b in inside:
                    factors.append(dp._Factor((a, b), m))
                elif a in inside:
                    linear[a] += m[:, chosen[b]]
                else:
                    linear[b] += m[chosen[a], :]
        off = np.full(p.sizes[v], _FORBIDDEN)
        off[allowed] = 0.0
        linear[v] += off
        factors += [dp._Factor((u,), t) for u, t in linear.items()]
        order = self.orders.setdefault(frozenset(free), [])
        return {**chosen, **dp._eliminate(sizes, factors, order)}


def _region(v: object) -> tuple | None:
    """The layer a decision belongs to ((family, index)), `()` outside layers; a weight's is
    its first reader's. None for a decision that is not a graph node."""
    if not isinstance(v, fx.Node):
        return None
    if v.op == "placeholder":
        for u in v.users:
            key = layer_of(u)
            if key is not None:
                return key
        return ()
    key = layer_of(v)
    return key if key is not None else ()
