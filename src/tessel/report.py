"""Human-readable plan reports for `tessel inspect` and the demo; they need no torch."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from tessel.errors import TesselError
from tessel.package.manifest import Manifest
from tessel.units import human_bytes


def _cluster(manifest: Manifest) -> Any:
    """The model's cluster config, parsed (None if it cannot be)."""
    from tessel.config.cluster import cluster_from_dict

    try:
        return cluster_from_dict(manifest.cluster, "the model's cluster", manifest.soc_version)
    except TesselError:
        return None


def _device_memory(manifest: Manifest) -> dict[str, int]:
    """Each logical device's memory, from the model's cluster config (empty if it cannot say)."""
    cluster = _cluster(manifest)
    return {} if cluster is None else {d.logical_id: d.memory_bytes for d in cluster.devices}


def _axes(manifest: Manifest) -> list[dict]:
    """Each mesh axis with its size and the link its groups cross: within a node, or between
    nodes (with the bandwidth the cluster config gives that link, where it parses)."""
    from tessel.config.mesh import axis_groups

    shape = tuple(manifest.mesh.shape)
    node_of = {s.rank: s.node_id for s in manifest.submodels}
    cluster = _cluster(manifest)
    axes = []
    for i, (name, size) in enumerate(zip(manifest.mesh.dim_names, shape)):
        crosses = any(len({node_of.get(r) for r in g}) > 1 for g in axis_groups(shape, i))
        axis: dict[str, Any] = {
            "name": name,
            "size": size,
            "link": "between nodes" if crosses else "within a node",
        }
        if cluster is not None:
            axis["bandwidth_bytes_per_s"] = (
                cluster.network_bandwidth if crosses else cluster.link_bandwidth
            )
        axes.append(axis)
    return axes


def _axis_of(group: list[int], shape: list[int], names: list[str]) -> str:
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


def _ranks(manifest: Manifest, memory: dict) -> list[dict]:
    """The plan's ranks, each with its device's memory where the cluster config gives it, the
    mesh axis of each collective, and the bytes its collectives move between nodes per run."""
    devices = _device_memory(manifest)
    node_of = {s.rank: s.node_id for s in manifest.submodels}
    shape, names = list(manifest.mesh.shape), list(manifest.mesh.dim_names)
    ranks = []
    for r in manifest.plan.get("ranks") or []:
        r = dict(r)
        device_bytes = devices.get(r.get("logical_device"), memory.get("device_bytes"))
        if device_bytes is not None:
            r["device_bytes"] = device_bytes
        collectives = [dict(c) for c in r.get("collectives") or []]
        between = 0
        for c in collectives:
            group = c.get("group") or []
            c["axis"] = _axis_of(group, shape, names)
            if len({node_of.get(g) for g in group}) > 1:
                between += c.get("bytes") or 0
        r["collectives"] = collectives
        r["bytes_between_nodes"] = between
        r["node_id"] = node_of.get(r.get("rank"))
        ranks.append(r)
    return ranks


def inspect_json(manifest: Manifest) -> dict:
    """The plan as JSON: ranks with their weights, predicted peak memory, device memory and
    collectives; layers, solver, the planner's memory estimate, re-planned strategies, why
    weights are replicated on tensor-parallel axes, the build's check against eager, timings.

    Layers map each weight's full name to its placements, so no two weights share a name.
    """
    plan = manifest.plan
    memory = dict(plan.get("memory") or {})
    return {
        "mode": manifest.mode,
        "world_size": manifest.world_size,
        "mesh": {**manifest.mesh.to_json(), "axes": _axes(manifest)},
        "soc_version": manifest.soc_version,
        "inputs": [i.to_json() for i in manifest.inputs],
        "outputs": [o.to_json() for o in manifest.outputs or ()],
        "estimated_time_s": plan.get("estimated_time_s"),
        "lowered_time_s": plan.get("lowered_time_s"),
        "solver": plan.get("solver"),
        "timings": dict(manifest.timings),
        "layers": plan.get("layers") or {},
        "fallbacks": plan.get("fallbacks") or [],
        "memory": memory,
        "replanned": plan.get("replanned") or [],
        "replicated": plan.get("replicated") or {},
        "mesh_choices": plan.get("mesh_choices") or [],
        "stages": plan.get("stages") or [],
        "micro_batches": plan.get("micro_batches") or 1,
        "verify": plan.get("verify"),
        "source": plan.get("source", "planned"),
        "training": plan.get("training"),
        "ranks": _ranks(manifest, memory),
    }


def mesh_choice_lines(choices: list[dict]) -> list[str]:
    """The mesh shapes `auto` weighed: each one's estimated time (and as lowered, where its
    programs were priced), its bytes between nodes or why it was set aside, and why the chosen
    one was preferred where the fastest was not chosen."""
    lines = [
        "mesh shapes weighed (estimated time per run, outputs gathered included; bytes a "
        "run moves between nodes)"
    ]
    for c in choices:
        shape = " x ".join(f"{n} {s}" for n, s in zip(c.get("dim_names", ()), c["shape"]))
        if "estimated_time_s" in c and not c.get("set_aside"):
            what = f"{1e3 * c['estimated_time_s']:.3f} ms"
            if c.get("lowered_time_s") is not None:
                what += f" ({1e3 * c['lowered_time_s']:.3f} ms as lowered)"
            if "internode_bytes" in c:
                what += f", {human_bytes(c['internode_bytes'])} between nodes"
        else:
            what = f"set aside: {c.get('set_aside', '?')}"
        lines.append(f"  {shape}: {what}" + (" (chosen)" if c.get("chosen") else ""))
        if c.get("preferred"):
            lines.append(f"    chosen because it {c['preferred']}")
    return lines


def _rate(bytes_per_s: float) -> str:
    """A link's bandwidth as a cluster config writes it (`392Gb` per second)."""
    return f"{bytes_per_s * 8 / 1e9:g}Gb/s"


def _within(layer: str, name: str) -> str:
    """A weight's name relative to its layer (`attn.c_proj.weight`), or in full outside one."""
    return name.removeprefix(layer + ".") if layer and name.startswith(layer + ".") else name


def format_plan(manifest: Manifest) -> str:
    """The plan as text: placements per layer (identical layers grouped), then per device."""
    data = inspect_json(manifest)
    lines = [
        f"offline model: {data['mode']}, {data['world_size']} devices, mesh "
        + " x ".join(f"{a['name']} {a['size']}" for a in data["mesh"]["axes"])
        + f", soc {data['soc_version']}",
        "mesh axes: "
        + "; ".join(
            f"{a['name']} {a['link']}"
            + (f" ({_rate(a['bandwidth_bytes_per_s'])})" if "bandwidth_bytes_per_s" in a else "")
            for a in data["mesh"]["axes"]
        ),
        "inputs: " + ", ".join(f"{i['name']} {i['shape']} {i['dtype']}" for i in data["inputs"]),
    ]
    if data["source"] == "slices":
        lines.append(
            f"built from pre-sliced models ({manifest.plan.get('relation_config')}): "
            + ", ".join(f"rank {r.get('rank')} {r.get('slice')}" for r in data["ranks"])
        )
    else:
        line = f"estimated time per run: {1e3 * (data['estimated_time_s'] or 0):.2f} ms"
        if data["lowered_time_s"] is not None:
            line += f" ({1e3 * data['lowered_time_s']:.2f} ms as its programs were lowered)"
        lines.append(line)
    training = data.get("training")
    if training:
        lines.append(
            f"training step: {training['optimizer']} ({training['param_groups']} parameter "
            f"groups); sharding: {'; '.join(training['sharding'])}; optimizer offload: "
            f"{training['optimizer_offload']}; precision: {training.get('precision', 'float32')}"
        )
        if training.get("pipeline", "none") != "none":
            lines.append(f"  pipeline: {training['pipeline']}")
        for line in training.get("levels_weighed", []):
            lines.append(f"  sharding level weighed (auto): {line}")
    solver = data.get("solver") or {}
    if solver:
        lines.append(
            f"solver {solver.get('opt_level')}: {solver.get('decisions')} decisions, "
            f"{solver.get('variables')} variables, repeated layers {solver.get('repeated_layers')}"
        )
        if solver.get("method"):
            lines.append(f"  method: {solver['method']}")
        if solver.get("fallback"):
            lines.append(f"  fallback: {solver['fallback']}")
    if data["layers"]:
        lines.append("")
        lines.append("placements per layer (weight: placement on the mesh)")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for layer, params in data["layers"].items():
        key = tuple(sorted((_within(layer, name), "/".join(p)) for name, p in params.items()))
        groups[key].append(layer)
    for key, layers in groups.items():
        lines.append(f"  {_layers_title(layers)}")
        for name, placement in key:
            lines.append(f"    {name:<40} {placement}")
    lines.extend(_replicated_lines(data))
    if data["stages"]:
        lines.append("")
        lines.append(
            f"pipeline stages ({data['micro_batches']} micro-batches per run, activations sent "
            "rank to rank between stages)"
        )
        for st in data["stages"]:
            ranks = st.get("ranks") or []
            lines.append(
                f"  stage {st.get('stage')}: {st.get('layers')} on ranks "
                f"{', '.join(map(str, ranks))}, weights {human_bytes(st.get('weight_bytes') or 0)}"
                f" per device, {1e3 * (st.get('estimated_time_s') or 0):.2f} ms per micro-batch"
            )
    lines.append("")
    lines.append("per device (peak: weights plus the most activation bytes alive at once)")
    # the planner's count of each rank (one tensor-parallel group, no replicas or stages)
    predicted = data["memory"].get("rank_peak_bytes") or []
    if len(predicted) != len(data["ranks"]):
        predicted = []
    for r in data["ranks"]:
        collectives = r.get("collectives") or []
        counts = Counter(f"{c.get('kind', '?')} over {c.get('axis', '?')}" for c in collectives)
        volume = sum(c.get("bytes") or 0 for c in collectives)
        colls = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        memory = f"weights {human_bytes(r.get('weight_bytes') or 0)}"
        if r.get("peak_bytes") is not None:
            memory += f", peak {human_bytes(r['peak_bytes'])}"
        if r.get("device_bytes"):
            memory += f" of {human_bytes(r['device_bytes'])}"
        if predicted and isinstance(r.get("rank"), int):
            memory += f" (planner's estimate {human_bytes(predicted[r['rank']])})"
        lines.append(
            f"  rank {r.get('rank', '?')} ({r.get('logical_device', '?')}): {memory}, "
            f"collectives {colls}, {human_bytes(volume)} per run"
            + (
                f" ({human_bytes(r['bytes_between_nodes'])} between nodes)"
                if r.get("bytes_between_nodes")
                else ""
            )
        )
    lines.extend(_memory_lines(data["memory"]))
    if data["mesh_choices"]:
        lines.append("")
        lines.extend(mesh_choice_lines(data["mesh_choices"]))
    lines.extend(_verify_lines(data["verify"]))
    if data["replanned"]:
        lines.append("")
        lines.append("re-planned (strategies the lowering could not run, dropped)")
        for rp in data["replanned"]:
            lines.append(
                f"  {rp.get('node', '?')} ({rp.get('op', '?')}): {rp.get('strategy', '?')}: "
                f"{rp.get('reason', '?')}"
            )
    if data["fallbacks"]:
        ops = Counter(f.get("op", "?") for f in data["fallbacks"])
        lines.append("")
        lines.append(
            "replicated for lack of a sharding rule: "
            + ", ".join(f"{k} x{v}" for k, v in ops.items())
        )
    if data["timings"]:
        lines.append("")
        lines.append(
            "build time: " + ", ".join(f"{k} {v:.2f} s" for k, v in data["timings"].items())
        )
    return "\n".join(lines)


def _replicated_lines(data: dict[str, Any]) -> list[str]:
    """Why each weight replicated on a tensor-parallel axis is, per layer as the placements
    are listed (identical layers grouped)."""
    why = data["replicated"]
    if not why:
        return []
    lines = [
        "",
        "why weights are replicated (estimates of the planner's cost model: this plan against "
        "the best plan found that shards the weight, its layer re-solved, the rest as chosen)",
    ]
    groups: dict[tuple, list[str]] = defaultdict(list)
    for layer, params in data["layers"].items():
        key = tuple(
            sorted((_within(layer, name), why[name]["text"]) for name in params if name in why)
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


def _memory_lines(memory: dict[str, Any]) -> list[str]:
    """The planner's own estimate of one device's memory, beside the device's capacity."""
    shown = [
        f"{label} {human_bytes(memory[key])}"
        for key, label in (
            ("weight_bytes", "weights"),
            ("peak_bytes", "peak"),
            ("other_ranks_peak_bytes", "other ranks' peak (no outputs gathered to them)"),
            ("device_bytes", "device memory"),
        )
        if memory.get(key) is not None
        and (key != "other_ranks_peak_bytes" or memory[key] != memory.get("peak_bytes"))
    ]
    return ["", "planner's estimate per device: " + ", ".join(shown)] if shown else [""]


def _verify_lines(verify: Any) -> list[str]:
    """The build's run of the package against the eager model on the example inputs."""
    if not isinstance(verify, dict):
        return ["checked against eager: no"]
    if verify.get("skipped"):
        return [f"checked against eager: no ({verify['skipped']})"]
    diff, seconds = verify.get("max_relative_diff"), verify.get("seconds")
    text = "checked against eager: "
    text += "yes" if diff is None else f"max relative difference {diff:.3g}"
    if seconds is not None:
        text += f" ({seconds:.2f} s)"
    return [text]
