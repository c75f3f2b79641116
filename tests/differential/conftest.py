"""The differential suite keeps one Session per device count open across its tests, so its
workers outlive each test by design; the check that no worker outlives its owner runs once,
when the module's sessions are closed."""

from __future__ import annotations

import psutil
import pytest
from tests.conftest import _is_resource_tracker

# each build records (the planner's predicted peak, each rank's lowered peak, memory re-plans)
# as the user property MEMORY_MODEL: properties travel to the controller with the reports, so
# the summary below sees every build, with or without pytest-xdist's workers
MEMORY_MODEL = "memory_model"


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Replaces the per-test check: workers belong to the module's sessions here."""
    yield


@pytest.fixture(scope="module", autouse=True)
def no_leftover_workers_after_the_module():
    yield
    children = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def record_memory_model(record_property, plan: dict) -> None:
    """Records a build's predicted peak, each rank's lowered peak and its memory re-plans for
    the summary below."""
    memory = plan["memory"]
    record_property(
        MEMORY_MODEL,
        (
            # rank 0 receives the outputs; the others have a peak of their own
            [
                memory["peak_bytes"] if rank["rank"] == 0 else memory["other_ranks_peak_bytes"]
                for rank in plan["ranks"]
            ],
            [rank["peak_bytes"] for rank in plan["ranks"]],
            sum(r["node"] == "(memory)" for r in plan["replanned"]),
        ),
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """How close the memory model came to the lowered programs, over the suite's builds."""
    builds = [
        (report.nodeid.split("[")[-1].rstrip("]"), value)
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", [])
        if key == MEMORY_MODEL
    ]
    if not builds:
        return
    ratios = [
        (name, peak / predicted)
        for name, (predictions, peaks, _) in builds
        for predicted, peak in zip(predictions, peaks)
    ]
    within = sum(0.95 <= r <= 1.05 for _, r in ratios)
    # the fullest rank is the one the devices' memory is checked against
    fullest = [(name, max(peaks) / max(predictions)) for name, (predictions, peaks, _) in builds]
    fullest_within = sum(0.95 <= r <= 1.05 for _, r in fullest)
    replans = sum(count for _, (*_, count) in builds)
    worst = sorted(ratios, key=lambda x: abs(x[1] - 1))[-3:]
    terminalreporter.write_line(
        f"memory model: every rank's lowered peak within 5% of the planner's for it in {within} "
        f"of {len(ratios)} ranks, the fullest rank's in {fullest_within} of {len(builds)} builds "
        f"({replans} memory re-plans); furthest ranks: "
        + ", ".join(f"{name} {r:.3f}" for name, r in reversed(worst))
    )
