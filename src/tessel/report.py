"""Human-readable plan reports for `tessel inspect` and the demo; they need no torch."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tessel.config.generation import state_kind
from tessel.config.mesh import axis_groups
from tessel.errors import TesselError
from tessel.package.manifest import Manifest, dtype_bytes
from tessel.package.plan_report import (
    MemoryLine,
    PlanReport,
    RankLine,
    ShapeWeighed,
    Verified,
)
from tessel.units import human_bytes


def _cluster(manifest: Manifest) -> Any:
    """The model's cluster config, parsed (None if it cannot be)."""
    from tessel.config.cluster import cluster_from_dict

    try:
        return cluster_from_dict(manifest.cluster, "the model's cluster", manifest.soc_version)
    except TesselError:
        return None


@dataclass(frozen=True)
class AxisView:
    """A mesh axis, its size, and the link its groups cross: within a node, or between nodes
    (with the bandwidth the cluster config gives that link, where it parses)."""

    name: str
    size: int
    link: str
    bandwidth_bytes_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "size": self.size, "link": self.link}
        if self.bandwidth_bytes_per_s is not None:
            out["bandwidth_bytes_per_s"] = self.bandwidth_bytes_per_s
        return out


@dataclass(frozen=True)
class RankView:
    """A rank of the plan's report as `inspect` shows it: where it runs, its device's memory,
    the mesh axes each of its collectives runs over, and the bytes they move between nodes."""

    line: RankLine
    node_id: int | None
    device_bytes: int | None
    axes: tuple[str, ...]  # one per collective of `line`
    bytes_between_nodes: int

    def to_json(self) -> dict[str, Any]:
        out = self.line.to_json()
        out["collectives"] = [
            {**c.to_json(), "axis": axis} for c, axis in zip(self.line.collectives, self.axes)
        ]
        if self.device_bytes is not None:
            out["device_bytes"] = self.device_bytes
        out["bytes_between_nodes"] = self.bytes_between_nodes
        out["node_id"] = self.node_id
        return out


@dataclass(frozen=True)
class Inspected:
    """What `tessel inspect` shows of a package: its manifest, the plan's report, and what
    the cluster config adds to them (links and device memory)."""

    manifest: Manifest
    axes: tuple[AxisView, ...]
    ranks: tuple[RankView, ...]

    @property
    def plan(self) -> PlanReport:
        return self.manifest.plan

    def to_json(self) -> dict[str, Any]:
        """The figures as `tessel inspect --json` gives them."""
        m, plan = self.manifest, self.manifest.plan
        report = plan.to_json()
        return {
            "mode": m.mode,
            "world_size": m.world_size,
            "mesh": {**m.mesh.to_json(), "axes": [a.to_json() for a in self.axes]},
            "soc_version": m.soc_version,
            "inputs": [i.to_json() for i in m.inputs],
            "outputs": [o.to_json() for o in m.outputs or ()],
            "estimated_time_s": plan.estimated_time_s,
            "lowered_time_s": plan.lowered_time_s,
            "solver": report.get("solver"),
            "timings": dict(m.timings),
            "layers": report["layers"],
            "fallbacks": report["fallbacks"],
            "memory": report["memory"],
            "replanned": report["replanned"],
            "replicated": report["replicated"],
            "mesh_choices": report["mesh_choices"],
            "stages": report["stages"],
            "micro_batches": plan.micro_batches,
            "verify": report.get("verify"),
            "source": plan.source,
            "training": report.get("training"),
            "generation": (
                {
                    **m.generation.to_json(),
                    "state_bytes_per_rank": state_bytes(m),
                    "state_kinds": state_kinds(m),
                    "serving": serving_limits(m),
                }
                if m.generation is not None
                else None
            ),
            "ranks": [r.to_json() for r in self.ranks],
        }


def state_bytes(manifest: Manifest) -> list[int]:
    """The bytes of state (a generation package's cache) each rank holds, in rank order."""
    gears = manifest.generation
    if gears is None:
        return [0] * manifest.world_size
    size = {s.name: dtype_bytes(s.dtype) for s in gears.state}
    return [
        sum(math.prod(shape) * size[name] for name, shape in sub.state_shapes().items())
        for sub in manifest.submodels
    ]


def state_kinds(manifest: Manifest) -> list[dict]:
    """A generation package's state by kind (keys and values, recurrent states, ...): its
    tensors, their bytes in all and per rank, and how the first of them is held (the dim it is
    split on over the ranks, or none)."""
    gears = manifest.generation
    if gears is None:
        return []
    by_kind: dict[str, list] = defaultdict(list)
    for spec in gears.state:
        by_kind[state_kind(spec.name)].append(spec)
    kinds = []
    for kind, specs in by_kind.items():
        size = {s.name: dtype_bytes(s.dtype) for s in specs}
        per_rank = [
            sum(
                math.prod(shape) * size[name]
                for name, shape in sub.state_shapes().items()
                if name in size
            )
            for sub in manifest.submodels
        ]
        first = specs[0]
        local = manifest.submodels[0].state_shapes().get(first.name, first.shape)
        split = [d for d, (n, m) in enumerate(zip(first.shape, local)) if n != m]
        kinds.append(
            {
                "kind": kind,
                "tensors": len(specs),
                "shape": list(first.shape),
                "rank_0_shape": list(local),
                "split_dim": split[0] if split else None,
                "bytes": sum(math.prod(s.shape) * size[s.name] for s in specs),
                "bytes_per_rank": per_rank,
            }
        )
    return kinds


def generation_lines(manifest: Manifest) -> list[str]:
    """A generation package's gears, and its state by kind: shape, placement, bytes per rank."""
    gears = manifest.generation
    if gears is None:
        return []
    lines = [
        f"generation: up to {gears.max_batch_size} rows of {gears.max_seq_len} tokens; prefill "
        f"gears of {', '.join(map(str, gears.prefill_lengths))} tokens, then the decode gear",
    ]
    stages = dict(zip(manifest.mesh.dim_names, manifest.mesh.shape)).get("pp", 1)
    ranks = "every rank" if stages == 1 else "every rank of its layer's pipeline stage"
    for kind in state_kinds(manifest):
        how = (
            f"split on dim {kind['split_dim']} over {ranks} (rank 0 holds "
            f"{kind['rank_0_shape']} of {kind['shape']})"
            if kind["split_dim"] is not None
            else f"whole on {ranks} ({kind['shape']})"
        )
        held = kind["bytes_per_rank"]
        lines.append(
            f"cache, {kind['kind']}: {kind['tensors']} tensors, {human_bytes(kind['bytes'])} "
            f"in all, each {how}; per rank {human_bytes(min(held))}"
            + (f" to {human_bytes(max(held))}" if min(held) != max(held) else "")
            + f" (total / {manifest.world_size}: "
            f"{human_bytes(kind['bytes'] / manifest.world_size)})"
        )
    if gears.defaults:
        settings = ", ".join(f"{k}={v}" for k, v in gears.defaults.items())
        lines.append(f"decoding: the model's {settings} unless a call sets them")
    serving = serving_limits(manifest)
    if serving is not None:
        lines.append(
            f"serving (tessel serve): {serving['slots']} requests at once, one per cache row; "
            f"prompts of up to {serving['longest_prompt']} tokens; up to "
            f"{serving['longest_output']} new tokens after a prompt of "
            f"{gears.prefill_lengths[0]} or fewer, the cache's {gears.max_seq_len} slots less "
            "the prompt's prefill gear after a longer one; "
            + (
                "each admission's prefill computes its own row (one-row prefill gears)"
                if serving["admission_rows"] == 1
                else f"each admission's prefill computes all {serving['slots']} rows (build "
                "with row_prefill for one-row prefill gears)"
            )
        )
    return lines


def serving_limits(manifest: Manifest) -> dict | None:
    """How many requests a generation package serves at once (its cache's rows), the longest
    prompt it takes (its longest prefill gear), the most new tokens a request can ask for
    (after a prompt in its shortest gear), and the rows an admission's prefill computes (1
    with one-row prefill gears, else every row); None where it has no gears."""
    gears = manifest.generation
    if gears is None:
        return None
    return {
        "slots": gears.max_batch_size,
        "longest_prompt": gears.prefill_lengths[-1],
        "longest_output": gears.max_seq_len - gears.prefill_lengths[0] + 1,
        "admission_rows": 1 if gears.row_prefill else gears.max_batch_size,
    }


def inspect(manifest: Manifest) -> Inspected:
    """The package as `tessel inspect` shows it."""
    cluster = _cluster(manifest)
    shape, names = tuple(manifest.mesh.shape), tuple(manifest.mesh.dim_names)
    node_of = {s.rank: s.node_id for s in manifest.submodels}
    axes = []
    for i, (name, size) in enumerate(zip(names, shape)):
        crosses = any(len({node_of.get(r) for r in g}) > 1 for g in axis_groups(shape, i))
        bandwidth = None
        if cluster is not None:
            bandwidth = cluster.network_bandwidth if crosses else cluster.link_bandwidth
        axes.append(
            AxisView(name, size, "between nodes" if crosses else "within a node", bandwidth)
        )
    devices = {} if cluster is None else {d.logical_id: d.memory_bytes for d in cluster.devices}
    ranks = []
    for r in manifest.plan.ranks:
        between = sum(c.bytes for c in r.collectives if len({node_of.get(g) for g in c.group}) > 1)
        ranks.append(
            RankView(
                r,
                node_of.get(r.rank),
                devices.get(r.logical_device, manifest.plan.memory.device_bytes),
                tuple(_axis_of(c.group, shape, names) for c in r.collectives),
                between,
            )
        )
    return Inspected(manifest, tuple(axes), tuple(ranks))


def _axis_of(group: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """The mesh axes a collective group runs over: those on which its ranks' coordinates differ
    (`dp`, `tp`, or several joined by `+`)."""

    def coordinate(rank: int) -> list[int]:
        out = []
        for size in reversed(shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return out[::-1]

    coords = [coordinate(r) for r in group]
    varying = [n for i, n in enumerate(names) if len({c[i] for c in coords}) > 1]
    return "+".join(varying) or "-"


def inspect_json(manifest: Manifest) -> dict:
    """The plan as JSON: ranks with their weights, predicted peak memory, device memory and
    collectives; layers, solver, the planner's memory estimate, re-planned strategies, why
    weights are replicated on tensor-parallel axes, the build's check against eager, timings.

    Layers map each weight's full name to its placements, so no two weights share a name.
    """
    return inspect(manifest).to_json()


def mesh_choice_lines(choices: Iterable[ShapeWeighed]) -> list[str]:
    """The mesh shapes `auto` weighed: each one's estimated time (and as lowered, where its
    programs were priced), its bytes between nodes or why it was set aside, and why the chosen
    one was preferred where the fastest was not chosen."""
    lines = [
        "mesh shapes weighed (estimated time per run, outputs gathered included; bytes a "
        "run moves between nodes)"
    ]
    for c in choices:
        if c.estimated_time_s is not None and not c.set_aside:
            what = f"{1e3 * c.estimated_time_s:.3f} ms"
            if c.lowered_time_s is not None:
                what += f" ({1e3 * c.lowered_time_s:.3f} ms as lowered)"
            if c.internode_bytes is not None:
                what += f", {human_bytes(c.internode_bytes)} between nodes"
        else:
            what = f"set aside: {c.set_aside or '?'}"
        lines.append(f"  {c.text}: {what}" + (" (chosen)" if c.chosen else ""))
        if c.preferred:
            lines.append(f"    chosen because it {c.preferred}")
    return lines


def _rate(bytes_per_s: float) -> str:
    """A link's bandwidth as a cluster config writes it (`392Gb` per second)."""
    return f"{bytes_per_s * 8 / 1e9:g}Gb/s"


def _within(layer: str, name: str) -> str:
    """A weight's name relative to its layer (`attn.c_proj.weight`), or in full outside one."""
    return name.removeprefix(layer + ".") if layer and name.startswith(layer + ".") else name


def format_plan(manifest: Manifest) -> str:
    """The plan as text: placements per layer (identical layers grouped), then per device."""
    seen = inspect(manifest)
    plan = seen.plan
    lines = [
        f"offline model: {manifest.mode}, {manifest.world_size} devices, mesh "
        + " x ".join(f"{a.name} {a.size}" for a in seen.axes)
        + f", soc {manifest.soc_version}",
        "mesh axes: "
        + "; ".join(
            f"{a.name} {a.link}"
            + (f" ({_rate(a.bandwidth_bytes_per_s)})" if a.bandwidth_bytes_per_s else "")
            for a in seen.axes
        ),
        "inputs: " + ", ".join(f"{i.name} {list(i.shape)} {i.dtype}" for i in manifest.inputs),
    ]
    if plan.source == "slices":
        lines.append(
            f"built from pre-sliced models ({plan.relation_config}): "
            + ", ".join(f"rank {r.rank} {r.slice}" for r in plan.ranks)
        )
    else:
        line = f"estimated time per run: {1e3 * (plan.estimated_time_s or 0):.2f} ms"
        if plan.lowered_time_s is not None:
            line += f" ({1e3 * plan.lowered_time_s:.2f} ms as its programs were lowered)"
        lines.append(line)
    lines.extend(generation_lines(manifest))
    training = plan.training
    if training:
        lines.append(
            f"training step: {training.optimizer} ({training.param_groups} parameter "
            f"groups); sharding: {'; '.join(training.sharding)}; optimizer offload: "
            f"{training.optimizer_offload}; precision: {training.precision}"
        )
        if training.pipeline != "none":
            lines.append(f"  pipeline: {training.pipeline}")
        for line in training.levels_weighed:
            lines.append(f"  sharding level weighed (auto): {line}")
    solver = plan.solver
    if solver:
        lines.append(
            f"solver {solver.opt_level}: {solver.decisions} decisions, "
            f"{solver.variables} variables, repeated layers {dict(solver.repeated_layers)}"
        )
        if solver.method:
            lines.append(f"  method: {solver.method}")
        if solver.fallback:
            lines.append(f"  fallback: {solver.fallback}")
    if plan.layers:
        lines.append("")
        lines.append("placements per layer (weight: placement on the mesh)")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for layer, params in plan.layers.items():
        key = tuple(sorted((_within(layer, name), "/".join(p)) for name, p in params.items()))
        groups[key].append(layer)
    for key, layers in groups.items():
        lines.append(f"  {_layers_title(layers)}")
        for name, placement in key:
            lines.append(f"    {name:<40} {placement}")
    lines.extend(_replicated_lines(plan))
    if plan.stages:
        lines.append("")
        lines.append(
            f"pipeline stages ({plan.micro_batches} micro-batches per run, activations sent "
            "rank to rank between stages)"
        )
        for st in plan.stages:
            lines.append(
                f"  stage {st.stage}: {st.layers} on ranks {', '.join(map(str, st.ranks))}, "
                f"weights {human_bytes(st.weight_bytes)} per device, "
                f"{1e3 * st.estimated_time_s:.2f} ms per micro-batch"
            )
    lines.append("")
    lines.append("per device (peak: weights plus the most activation bytes alive at once)")
    # the planner's count of each rank (one tensor-parallel group, no replicas or stages)
    predicted = plan.memory.rank_peak_bytes
    cache = state_bytes(manifest)
    if len(predicted) != len(seen.ranks):
        predicted = ()
    for r in seen.ranks:
        counts = Counter(f"{c.kind} over {axis}" for c, axis in zip(r.line.collectives, r.axes))
        volume = sum(c.bytes for c in r.line.collectives)
        colls = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        memory = f"weights {human_bytes(r.line.weight_bytes)}"
        if cache[r.line.rank]:
            memory += f" (the cache {human_bytes(cache[r.line.rank])} of them)"
        if r.line.peak_bytes is not None:
            memory += f", peak {human_bytes(r.line.peak_bytes)}"
        if r.device_bytes:
            memory += f" of {human_bytes(r.device_bytes)}"
        if predicted and r.line.rank < len(predicted):
            memory += f" (planner's estimate {human_bytes(predicted[r.line.rank])})"
        lines.append(
            f"  rank {r.line.rank} ({r.line.logical_device}): {memory}, "
            f"collectives {colls}, {human_bytes(volume)} per run"
            + (
                f" ({human_bytes(r.bytes_between_nodes)} between nodes)"
                if r.bytes_between_nodes
                else ""
            )
        )
    lines.extend(_memory_lines(plan.memory))
    if plan.mesh_choices:
        lines.append("")
        lines.extend(mesh_choice_lines(plan.mesh_choices))
    lines.extend(_verify_lines(plan.verify))
    if plan.replanned:
        lines.append("")
        lines.append("re-planned (strategies the lowering could not run, dropped)")
        for rp in plan.replanned:
            lines.append(f"  {rp.node} ({rp.op}): {rp.strategy}: {rp.reason}")
    if plan.fallbacks:
        ops = Counter(f.op for f in plan.fallbacks)
        lines.append("")
        lines.append(
            "replicated for lack of a sharding rule: "
            + ", ".join(f"{k} x{v}" for k, v in ops.items())
        )
    if manifest.timings:
        lines.append("")
        lines.append(
            "build time: " + ", ".join(f"{k} {v:.2f} s" for k, v in manifest.timings.items())
        )
    return "\n".join(lines)


def _replicated_lines(plan: PlanReport) -> list[str]:
    """Why each weight replicated on a tensor-parallel axis is, per layer as the placements
    are listed (identical layers grouped)."""
    why = plan.replicated
    if not why:
        return []
    lines = [
        "",
        "why weights are replicated (estimates of the planner's cost model: this plan against "
        "the best plan found that shards the weight, its layer re-solved, the rest as chosen)",
    ]
    groups: dict[tuple, list[str]] = defaultdict(list)
    for layer, params in plan.layers.items():
        key = tuple(
            sorted((_within(layer, name), why[name].text) for name in params if name in why)
        )
        if key:
            groups[key].append(layer)
    for key, layers in groups.items():
        lines.append(f"  {_layers_title(layers)}")
        for name, text in key:
            lines.append(f"    {name}: {text}")
    return lines


def _layers_title(layers: list[str]) -> str:
    """A group of layers placed alike: the one, or the first and last and how many."""
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"


def _memory_lines(memory: MemoryLine) -> list[str]:
    """The planner's own estimate of one device's memory, beside the device's capacity."""
    shown = [
        f"{label} {human_bytes(value)}"
        for value, label in (
            (memory.weight_bytes, "weights"),
            (memory.peak_bytes, "peak"),
            (
                memory.other_ranks_peak_bytes
                if memory.other_ranks_peak_bytes != memory.peak_bytes
                else None,
                "other ranks' peak (no outputs gathered to them)",
            ),
            (memory.device_bytes, "device memory"),
        )
        if value is not None
    ]
    return ["", "planner's estimate per device: " + ", ".join(shown)] if shown else [""]


def _verify_lines(verify: Verified | None) -> list[str]:
    """The build's run of the package against the eager model on the example inputs."""
    if verify is None:
        return ["checked against eager: no"]
    if verify.skipped:
        return [f"checked against eager: no ({verify.skipped})"]
    text = "checked against eager: "
    diff = verify.max_relative_diff
    text += "yes" if diff is None else f"max relative difference {diff:.3g}"
    if verify.seconds is not None:
        text += f" ({verify.seconds:.2f} s)"
    return [text]
