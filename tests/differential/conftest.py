"""The differential suite keeps one Session per device count open across its tests, so its
workers outlive each test by design; the check that no worker outlives its owner runs once,
when the module's sessions are closed."""

from __future__ import annotations

import psutil
import pytest
from tests.conftest import is_multiprocessing_helper


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Replaces the per-test check: workers belong to the module's sessions here."""
    yield


@pytest.fixture(scope="module", autouse=True)
def no_leftover_workers_after_the_module():
    yield
    children = [
        p for p in psutil.Process().children(recursive=True) if not is_multiprocessing_helper(p)
    ]
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
