"""Human-readable plan reports for `tessel inspect` and the demo."""

from __future__ import annotations

from collections import Counter, defaultdict


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def inspect_json(manifest: dict) -> dict:
    """The plan as JSON: ranks with their weights and collectives, layers, solver, timings."""
    plan = manifest.get("plan", {})
    return {
        "mode": manifest["mode"],
        "world_size": manifest["world_size"],
        "mesh": manifest["mesh"],
        "soc_version": manifest["soc_version"],
        "inputs": manifest["inputs"],
        "outputs": manifest["outputs"],
        "estimated_time_s": plan.get("estimated_time_s"),
        "solver": plan.get("solver"),
        "timings": manifest.get("timings", {}),
        "layers": plan.get("layers", {}),
        "fallbacks": plan.get("fallbacks", []),
        "ranks": plan.get("ranks", []),
    }


def format_plan(manifest: dict) -> str:
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
        key = tuple(
            sorted(
                (
                    name.split(".")[-2] + "." + name.split(".")[-1] if "." in name else name,
                    "/".join(p),
                )
                for name, p in params.items()
            )
        )
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
        counts = Counter(c["kind"] for c in r["collectives"])
        volume = sum(c.get("bytes", 0) for c in r["collectives"])
        colls = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        lines.append(
            f"  rank {r['rank']} ({r['logical_device']}): weights {_mib(r['weight_bytes'])}, "
            f"collectives {colls}, {_mib(volume)} per run"
        )
    if data["fallbacks"]:
        ops = Counter(f["op"] for f in data["fallbacks"])
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
