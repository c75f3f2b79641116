"""The training tests keep one Session per device count open across the module, so their
workers outlive each test by design (each load reuses them); the check that no worker outlives
its owner runs once, when the module's sessions are closed."""

from __future__ import annotations

import psutil
import pytest
from tests.conftest import is_multiprocessing_helper

import tessel


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Replaces the per-test check: workers belong to the module's sessions here."""
    yield


@pytest.fixture(scope="module")
def sessions():
    """device count -> the module's Session for it (made on first use)."""
    tessel.initialize()
    opened: dict[int, tessel.Session] = {}
    yield opened
    for session in opened.values():
        session.close()
    tessel.finalize()
    children = [
        p for p in psutil.Process().children(recursive=True) if not is_multiprocessing_helper(p)
    ]
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
