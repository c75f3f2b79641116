"""Every architectural family, partitioned and run in a Session, computes what eager computes.

Each family meets 2, 3 and 4 devices (3: shards that do not divide), devices with the default
memory and devices too small for replicated weights, and a batch equal to the device count and
a batch of 1: a covering set of these settings, not their full product. Each run builds with the
in-process check against eager, then runs the package through a Session on inputs the build
never saw.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tests.conftest import record_memory_model

import tessel
from tessel.builder.verify import tolerance
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict
from tessel.demo import tight_cluster, weight_bytes
from tessel.plan import has_rule
from tessel.plan.planner import least_memory_plan

from .zoo import FAMILIES

# (devices, memory, batch): each family takes one of these two rotations, so every family meets
# 2, 3 and 4 devices, both memories and both batches, and 3 devices (shards that do not divide)
# with memory that forbids replicated weights
ROTATIONS = (
    ((2, "tight", "devices"), (3, "tight", "one"), (4, "default", "devices")),
    ((2, "default", "one"), (3, "tight", "devices"), (4, "tight", "one")),
)
# the families whose tight-memory builds cost a minute or more (large graphs, many re-plans)
# meet tight memory once, on 2 devices, still meeting every device count and both batches
HEAVY = ("deepseek_v3", "mamba", "t5")
HEAVY_ROTATION = ((2, "tight", "one"), (3, "default", "devices"), (4, "default", "one"))
RUNS = sorted(
    (
        (family, devices, memory, devices if batch == "devices" else 1)
        for i, family in enumerate(FAMILIES)
        for devices, memory, batch in (HEAVY_ROTATION if family in HEAVY else ROTATIONS[i % 2])
    ),
    key=lambda run: run[1],  # by device count, so each Session's workers are reused
)


@pytest.fixture(scope="module")
def sessions() -> Iterator[dict[int, tessel.Session]]:
    """One Session per device count for the whole module: runs reuse its workers."""
    tessel.initialize()
    opened: dict[int, tessel.Session] = {}
    yield opened
    for session in opened.values():
        session.close()
    tessel.finalize()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = max(1.0, want.abs().max().item())
    return (got - want).abs().max().item() <= tolerance(want.dtype) * scale


@pytest.mark.parametrize(
    "family,devices,memory,batch", RUNS, ids=[f"{f}-{d}dev-{m}-b{b}" for f, d, m, b in RUNS]
)
def test_partitioned_model_equals_eager(
    family, devices, memory, batch, sessions, tmp_path, record_property
):
    spec = FAMILIES[family]
    model = spec.make()
    captured = capture(model, spec.inputs(batch), keep=has_rule)
    if memory == "tight":
        cluster = cluster_from_dict(tight_cluster(captured, devices), "tight.json")
        replicated = weight_bytes(captured)
        one_device, _ = least_memory_plan(captured, 1)
        assert cluster.devices[0].memory_bytes < one_device  # a replicated model cannot fit
    else:
        cluster = devices
    built = tessel.build(captured, cluster=cluster)

    plan = built.manifest.plan
    assert plan.verify.max_relative_diff <= tolerance(torch.float32)
    device_bytes = plan.memory.device_bytes
    record_memory_model(record_property, plan)
    for rank in plan.ranks:
        assert rank.peak_bytes <= device_bytes, rank.rank  # the program fits its device
        if memory == "tight":
            assert rank.weight_bytes < replicated

    path = tessel.save(built, tmp_path / family)
    session = sessions.setdefault(devices, tessel.Session())
    session.load_graph(0, {}, path)
    try:
        fresh = spec.inputs(batch, seed=1)  # inputs the build never saw
        with torch.no_grad():
            want = model(*fresh)
        (got,) = session.run_graph(0, list(fresh))
    finally:
        session.remove_graph(0)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _close(got, want), (got - want).abs().max().item()
