"""A built model in one screen: what `tessel build` prints and what `repr` of a build shows.

The full plan (placements per layer, each rank's collectives) is `tessel inspect`'s; this is
what a user checks after every build: the mesh, the inputs and outputs, memory per device
against the device's, the collectives a run makes, the time per phase and the check against
the eager model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from tessel.package.manifest import Manifest, TensorSpec
from tessel.package.plan_report import Verified
from tessel.report import RankView, generation_lines, inspect
from tessel.units import human_bytes


def build_summary(manifest: Manifest, path: str | None = None) -> str:
    """A few lines describing the built model `manifest` (saved at `path`, where it is)."""
    seen = inspect(manifest)
    plan = seen.plan
    axes = " x ".join(f"{a.name} {a.size}" for a in seen.axes) or "one device"
    kind = "training step" if manifest.training else manifest.mode
    lines = [f"built {kind} for {manifest.world_size} {manifest.soc_version} devices, mesh {axes}"]
    lines.append("  inputs: " + _tensors(manifest.inputs))
    if manifest.outputs:
        lines.append("  outputs: " + _tensors(manifest.outputs))
    lines.extend("  " + line for line in generation_lines(manifest))
    lines.append("  per device: " + _memory(seen.ranks))
    lines.append("  collectives per run: " + _collectives(seen.ranks))
    if plan.estimated_time_s:
        lines.append(f"  estimated time per run: {1e3 * plan.estimated_time_s:.2f} ms")
    if manifest.timings:
        total = sum(manifest.timings.values())
        lines.append(
            f"  build time {total:.1f} s: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in _in_order(manifest.timings) if v >= 0.05)
        )
    lines.append("  " + _verified(plan.verify))
    shown = path or "the saved .tessel file"
    lines.append(f"  placements per layer and per rank: tessel inspect {shown}")
    return "\n".join(lines)


PHASES = ("capture", "strategies", "solve", "lower", "stages", "pack", "verify", "save")


def _in_order(timings: Mapping[str, float]) -> list[tuple[str, float]]:
    """The build's phases in the order they ran."""
    rank = {name: i for i, name in enumerate(PHASES)}
    return sorted(timings.items(), key=lambda kv: rank.get(kv[0], len(PHASES)))


def _tensors(specs: Iterable[TensorSpec]) -> str:
    return ", ".join(f"{s.name + ' ' if s.name else ''}{s.dtype}{list(s.shape)}" for s in specs)


def _memory(ranks: tuple[RankView, ...]) -> str:
    """Weights and peak over the ranks (the range where they differ), beside device memory."""

    def spread(values: list[int]) -> str:
        if not values:
            return "?"
        low, high = min(values), max(values)
        return human_bytes(high) if low == high else f"{human_bytes(low)} to {human_bytes(high)}"

    weights = spread([r.line.weight_bytes for r in ranks])
    peaks = spread([r.line.peak_bytes for r in ranks if r.line.peak_bytes is not None])
    device = [r.device_bytes for r in ranks if r.device_bytes]
    return f"weights {weights}, peak {peaks}" + (
        f" of {human_bytes(min(device))}" if device else ""
    )


def _collectives(ranks: tuple[RankView, ...]) -> str:
    """The collectives of the rank that moves the most bytes, by kind and mesh axis."""
    if not ranks:
        return "none"
    busiest = max(ranks, key=lambda r: sum(c.bytes for c in r.line.collectives))
    if not busiest.line.collectives:
        return "none"
    counts = Counter(
        f"{c.kind} over {axis}" for c, axis in zip(busiest.line.collectives, busiest.axes)
    )
    moved = human_bytes(sum(c.bytes for c in busiest.line.collectives))
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return f"{kinds}, {moved} (rank {busiest.line.rank}, the most of any rank)"


def _verified(verify: Verified | None) -> str:
    if verify is None:
        return "checked against eager: no"
    if verify.skipped:
        return f"checked against eager: no ({verify.skipped})"
    diff = verify.max_relative_diff
    return "checked against eager: " + ("yes" if diff is None else f"max relative diff {diff:.2g}")
