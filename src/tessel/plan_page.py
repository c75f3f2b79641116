"""`tessel inspect --html`: the plan as one self-contained page a person can look at.

The page draws the mesh as nodes of devices, tabulates each layer's placements, shows a rank x
rank heat map of the bytes collectives move per run (so traffic between nodes shows at a glance),
each device's memory against its limit, and the pipeline stages. It embeds the figures of
`tessel inspect --json` as they are, so what it shows can be checked against them. No script,
style sheet or font is fetched from anywhere.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from tessel.atomic import replace_atomically
from tessel.package.manifest import Manifest
from tessel.package.plan_report import PlanReport
from tessel.report import Inspected, inspect
from tessel.units import human_bytes

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
th { background: #f4f4f4; text-align: left; }
.node { display: inline-block; border: 2px solid #555; border-radius: 6px; margin: 4px;
        padding: 6px; vertical-align: top; }
.device { display: inline-block; border: 1px solid #888; border-radius: 4px; margin: 3px;
          padding: 4px 8px; text-align: center; min-width: 4em; }
.heat td { width: 2.2em; height: 2.2em; text-align: center; font-size: 10px; border: 0; }
.bar { background: #eee; width: 20em; height: 1em; position: relative; }
.bar span { position: absolute; left: 0; top: 0; bottom: 0; background: #4a8; }
.bar span.over { background: #c44; }
"""
_STAGE_COLOURS = ("#dbe9f6", "#fde2c8", "#d9f0d3", "#efd9f2", "#fff3b0", "#d0ecec")


def traffic(seen: Inspected) -> list[list[int]]:
    """Bytes each pair of ranks exchanges per run: every collective's bytes on a rank, split
    evenly over the other ranks of its group."""
    world = seen.manifest.world_size
    cells = [[0] * world for _ in range(world)]
    for r in seen.plan.ranks:
        for c in r.collectives:
            others = [q for q in c.group if q != r.rank]
            for q in others:
                cells[r.rank][q] += c.bytes // len(others)
    return cells


def render(manifest: Manifest) -> str:
    """The page for `manifest`."""
    seen = inspect(manifest)
    esc = html.escape
    mesh = " x ".join(f"{a.name} {a.size}" for a in seen.axes)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>tessel plan</title>',
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>tessel plan: {manifest.world_size} devices, mesh {esc(mesh)}</h1>",
        f"<p>estimated time per run: {1e3 * (seen.plan.estimated_time_s or 0):.3f} ms; "
        f"soc {esc(str(manifest.soc_version))}</p>",
    ]
    parts += _mesh(seen)
    parts += _stages(seen.plan)
    parts += _memory(seen)
    parts += _heat(seen)
    parts += _layers(seen.plan)
    # the figures as `tessel inspect --json` gives them; `</` cannot end the script early
    payload = json.dumps(seen.to_json()).replace("</", "<\\/")
    parts.append(f'<script type="application/json" id="plan-data">{payload}</script>')
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(manifest: Manifest, path: str | Path) -> Path:
    """Write the page to `path` in one step (a temporary name, then renamed)."""
    path = Path(path)
    with replace_atomically(path) as tmp:
        tmp.write_text(render(manifest), encoding="utf-8")
    return path


def _mesh(seen: Inspected) -> list[str]:
    names, shape = seen.manifest.mesh.dim_names, seen.manifest.mesh.shape
    stage_of = {r: st.stage for st in seen.plan.stages for r in st.ranks}
    by_node: dict[Any, list[int]] = defaultdict(list)
    for r in seen.ranks:
        by_node[r.node_id].append(r.line.rank)
    out = ["<h2>Mesh</h2>", '<div id="mesh">']
    for node, ranks in sorted(by_node.items(), key=lambda kv: str(kv[0])):
        out.append(f'<div class="node"><b>node {html.escape(str(node))}</b><br>')
        for rank in ranks:
            coord, rest = [], rank
            for size in reversed(shape):
                rest, c = divmod(rest, size)
                coord.append(c)
            where = ", ".join(f"{n} {c}" for n, c in zip(names, coord[::-1]))
            colour = _STAGE_COLOURS[stage_of.get(rank, 0) % len(_STAGE_COLOURS)]
            out.append(
                f'<div class="device" style="background:{colour}" data-rank="{rank}">'
                f"rank {rank}<br><small>{html.escape(where)}</small></div>"
            )
        out.append("</div>")
    out.append("</div>")
    return out


def _stages(plan: PlanReport) -> list[str]:
    if not plan.stages:
        return []
    out = [
        "<h2>Pipeline stages</h2>",
        f"<p>{plan.micro_batches} micro-batches per run</p>",
        '<table id="stages"><tr><th>stage</th><th>layers</th><th>ranks</th>'
        "<th>weights per device</th><th>ms per micro-batch</th></tr>",
    ]
    for st in plan.stages:
        out.append(
            f"<tr><td>{st.stage}</td><td>{html.escape(st.layers)}</td>"
            f"<td>{', '.join(map(str, st.ranks))}</td>"
            f"<td>{human_bytes(st.weight_bytes)}</td>"
            f"<td>{1e3 * st.estimated_time_s:.3f}</td></tr>"
        )
    out.append("</table>")
    return out


def _memory(seen: Inspected) -> list[str]:
    out = [
        "<h2>Memory per device</h2>",
        '<table id="memory"><tr><th>rank</th><th>weights</th><th>peak</th><th>device</th>'
        "<th></th></tr>",
    ]
    for r in seen.ranks:
        rank, peak, device = r.line.rank, r.line.peak_bytes or 0, r.device_bytes
        share = min(1.0, peak / device) if device else 0.0
        over = ' class="over"' if device and peak > device else ""
        out.append(
            f'<tr data-rank="{rank}" data-peak="{peak}"><td>{rank}</td>'
            f"<td>{human_bytes(r.line.weight_bytes)}</td><td>{human_bytes(peak)}</td>"
            f"<td>{human_bytes(device) if device else '?'}</td>"
            f'<td><div class="bar"><span{over} style="width:{100 * share:.1f}%"></span></div>'
            "</td></tr>"
        )
    out.append("</table>")
    return out


def _heat(seen: Inspected) -> list[str]:
    cells = traffic(seen)
    top = max((v for row in cells for v in row), default=0) or 1
    node_of = {r.line.rank: r.node_id for r in seen.ranks}
    out = [
        "<h2>Bytes moved per run, rank by rank</h2>",
        "<p>Darker is more; a cell between ranks of different nodes has a red border.</p>",
        '<table class="heat" id="traffic"><tr><th></th>'
        + "".join(f"<th>{q}</th>" for q in range(len(cells)))
        + "</tr>",
    ]
    for r, row in enumerate(cells):
        tds = []
        for q, v in enumerate(row):
            shade = int(255 - 200 * v / top)
            border = "border:2px solid #c44;" if v and node_of.get(r) != node_of.get(q) else ""
            tds.append(
                f'<td data-bytes="{v}" title="{human_bytes(v)}" '
                f'style="background:rgb({shade},{shade},255);{border}">'
                f"{human_bytes(v) if v else ''}</td>"
            )
        out.append(f"<tr><th>{r}</th>{''.join(tds)}</tr>")
    out.append("</table>")
    return out


def _layers(plan: PlanReport) -> list[str]:
    out = [
        "<h2>Placements per layer</h2>",
        '<table id="layers"><tr><th>layer</th><th>weight</th><th>placement</th>'
        "<th>why replicated</th></tr>",
    ]
    for layer, params in plan.layers.items():
        for name, placements in params.items():
            why = plan.replicated.get(name)
            text = why.text if why else ""
            out.append(
                f"<tr><td>{html.escape(layer)}</td><td>{html.escape(name)}</td>"
                f"<td>{html.escape('/'.join(placements))}</td><td>{html.escape(text)}</td></tr>"
            )
    out.append("</table>")
    return out
