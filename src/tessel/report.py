"""Human-readable plan reports for `tessel inspect` and the demo; they need no torch."""

from __future__ import annotations

from collections import Counter, defaultdict

from tessel.package.manifest import Manifest


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def inspect_json(manifest: Manifest) -> dict:
    """The plan as JSON: ranks with their weights and collectives, layers, solver, timings.

    Layers map each weight's full name to its placements, so no two weights share a name.
    """
    plan = manifest.plan
    return {
        "mode": manifest.mode,
        "world_size": manifest.world_size,
        "mesh": manifest.mesh.to_json(),
        "soc_version": manifest.soc_version,
        "inputs": [i.to_json() for i in manifest.inputs],
        "outputs": [o.to_json() for o in manifest.outputs or ()],
        "estimated_time_s": plan.get("estimated_time_s"),
        "solver": plan.get("solver"),
        "timings": dict(manifest.timings),
        "layers": plan.get("layers") or {},
        "fallbacks": plan.get("fallbacks") or [],
        "ranks": plan.get("ranks") or [],
    }


def _within(layer: str, name: str) -> str:
    """A weight's name relative to its layer (`attn.c_proj.weight`), or in full outside one."""
    return name.removeprefix(layer + ".") if layer and name.startswith(layer + ".") else name


def format_plan(manifest: Manifest) -> str:
    """The plan as text: placements per layer (identical layers grouped), then per device."""
    data = inspect_json(manifest)
    lines = [
        f"offline model: {data['mode']}, {data['world_size']} devices, mesh {data['mesh']['shape']}, "
        f"soc {data['soc_version']}",
        "inputs: " + ", ".join(f"{i['name']} {i['shape']} {i['dtype']}" for i in data["inputs"]),
        f"estimated time per run: {1e3 * (data['estimated_time_s'] or 0):.2f} ms",
    ]
    solver = data.get("solver") or {}
    if solver:
        lines.append(
            f"solver {solver.get('opt_level')}: {solver.get('decisions')} decisions, "
            f"{solver.get('variables')} variables, repeated layers {solver.get('repeated_layers')}"
        )
    lines.append("")
    lines.append("placements per layer (weight: placement on the mesh)")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for layer, params in data["layers"].items():
        key = tuple(sorted((_within(layer, name), "/".join(p)) for name, p in params.items()))
        groups[key].append(layer)
    for key, layers in groups.items():
        title = (
            layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"
        )
        lines.append(f"  {title}")
        for name, placement in key:
            lines.append(f"    {name:<40} {placement}")
    lines.append("")
    lines.append("per device")
    for r in data["ranks"]:
        collectives = r.get("collectives") or []
        counts = Counter(c.get("kind", "?") for c in collectives)
        volume = sum(c.get("bytes") or 0 for c in collectives)
        colls = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        lines.append(
            f"  rank {r.get('rank', '?')} ({r.get('logical_device', '?')}): "
            f"weights {_mib(r.get('weight_bytes') or 0)}, collectives {colls}, "
            f"{_mib(volume)} per run"
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
