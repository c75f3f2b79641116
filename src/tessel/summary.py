"""A built model in one screen: what `tessel build` prints and what `repr` of a build shows.

The full plan (placements per layer, each rank's collectives) is `tessel inspect`'s; this is
what a user checks after every build: the mesh, the inputs and outputs, memory per device
against the device's, the collectives a run makes, the time per phase and the check against
the eager model.
"""

from __future__ import annotations

from collections import Counter

from tessel.package.manifest import Manifest
from tessel.report import inspect_json
from tessel.units import human_bytes


def build_summary(manifest: Manifest, path: str | None = None) -> str:
    """A few lines describing the built model `manifest` (saved at `path`, where it is)."""
    data = inspect_json(manifest)
    axes = " x ".join(f"{a['name']} {a['size']}" for a in data["mesh"]["axes"]) or "one device"
    kind = "training step" if data.get("training") else data["mode"]
    lines = [f"built {kind} for {data['world_size']} {data['soc_version']} devices, mesh {axes}"]
    lines.append("  inputs: " + _tensors(data["inputs"]))
    if data["outputs"]:
        lines.append("  outputs: " + _tensors(data["outputs"]))
    lines.append("  per device: " + _memory(data["ranks"]))
    lines.append("  collectives per run: " + _collectives(data["ranks"]))
    if data["estimated_time_s"]:
        lines.append(f"  estimated time per run: {1e3 * data['estimated_time_s']:.2f} ms")
    if data["timings"]:
        total = sum(data["timings"].values())
        lines.append(
            f"  build time {total:.1f} s: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in _in_order(data["timings"]) if v >= 0.05)
        )
    lines.append("  " + _verified(data["verify"]))
    shown = path or "the saved .tessel file"
    lines.append(f"  placements per layer and per rank: tessel inspect {shown}")
    return "\n".join(lines)


PHASES = ("capture", "strategies", "solve", "lower", "stages", "pack", "verify", "save")


def _in_order(timings: dict[str, float]) -> list[tuple[str, float]]:
    """The build's phases in the order they ran."""
    rank = {name: i for i, name in enumerate(PHASES)}
    return sorted(timings.items(), key=lambda kv: rank.get(kv[0], len(PHASES)))


def _tensors(specs: list[dict]) -> str:
    return ", ".join(
        f"{s['name'] + ' ' if s.get('name') else ''}{s['dtype']}{s['shape']}" for s in specs
    )


def _memory(ranks: list[dict]) -> str:
    """Weights and peak over the ranks (the range where they differ), beside device memory."""

    def spread(key: str) -> str:
        values = [r[key] for r in ranks if r.get(key) is not None]
        if not values:
            return "?"
        low, high = min(values), max(values)
        return human_bytes(high) if low == high else f"{human_bytes(low)} to {human_bytes(high)}"

    text = f"weights {spread('weight_bytes')}, peak {spread('peak_bytes')}"
    device = [r["device_bytes"] for r in ranks if r.get("device_bytes")]
    return text + (f" of {human_bytes(min(device))}" if device else "")


def _collectives(ranks: list[dict]) -> str:
    """The collectives of the rank that moves the most bytes, by kind and mesh axis."""
    if not ranks:
        return "none"
    busiest = max(ranks, key=lambda r: sum(c.get("bytes") or 0 for c in r.get("collectives") or ()))
    colls = busiest.get("collectives") or []
    if not colls:
        return "none"
    counts = Counter(f"{c.get('kind', '?')} over {c.get('axis', '?')}" for c in colls)
    moved = human_bytes(sum(c.get("bytes") or 0 for c in colls))
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return f"{kinds}, {moved} (rank {busiest.get('rank', '?')}, the most of any rank)"


def _verified(verify: object) -> str:
    if not isinstance(verify, dict):
        return "checked against eager: no"
    if verify.get("skipped"):
        return f"checked against eager: no ({verify['skipped']})"
    diff = verify.get("max_relative_diff")
    return "checked against eager: " + ("yes" if diff is None else f"max relative diff {diff:.2g}")
