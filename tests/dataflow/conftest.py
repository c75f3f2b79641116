"""Fixtures: a DataFlow session per test, cluster-config files, and a check that no worker
process outlives its test."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.conftest import is_multiprocessing_helper

import tessel.dataflow as df

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _children(forked_only: bool) -> set[int]:
    """Child processes: all of them, or only those forked from this process (its workers)."""
    me = psutil.Process()
    out = set()
    for c in me.children(recursive=True):
        try:
            if is_multiprocessing_helper(c):
                continue  # they live as long as the test process
            if not forked_only or c.cmdline() == me.cmdline():
                out.add(c.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Every process this test started is gone once it has finalized. While the module's Ray
    session runs, Ray's own processes are exempt; the test's forked workers are not."""
    before = _children(False)
    yield
    df.finalize()
    forked_only = _ray_running()
    deadline = time.monotonic() + 10
    left = _children(forked_only) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _children(forked_only) - before
    assert not left, f"processes outlived the test: {sorted(left)}"


def write_cluster(
    path: Path, nodes: list[int], soc_type: str = "cpu", node_ids: list[int] | None = None
) -> Path:
    """A numa_config with one entry per node, `nodes[i]` devices each, node_ids 0..n-1 (or
    `node_ids`)."""
    cluster_nodes = []
    ids = node_ids or list(range(len(nodes)))
    for k, (nid, count) in enumerate(zip(ids, nodes, strict=True)):
        cluster_nodes.append(
            {
                "node_id": nid,
                "node_type": "T",
                "ipaddr": f"127.0.0.{nid + 1}",
                "port": 2509,
                "is_local": k == 0,
                "item_list": [{"item_id": i, "device_id": i} for i in range(count)],
            }
        )
    data = {
        "cluster": [{"cluster_nodes": cluster_nodes}],
        "node_def": [{"node_type": "T", "resource_type": "X86", "item_type": soc_type}],
        "item_def": [{"item_type": soc_type, "memory": "[DDR:16GB]"}],
    }
    path.write_text(json.dumps(data))
    return path


def write_json(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def cluster4(tmp_path):
    """df.init on a one-node cluster of 4 CPU devices."""
    df.init({"ge.resourceConfigPath": str(write_cluster(tmp_path / "numa_config.json", [4]))})
    yield
    df.finalize()


class _Affine(__import__("torch").nn.Module):
    """y = x @ W + 1 with a fixed W, so tests can check the model really ran."""

    def __init__(self) -> None:
        import torch

        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(16, dtype=torch.float32).reshape(4, 4) / 10)

    def forward(self, x):
        return x @ self.w + 1


@pytest.fixture(scope="session")
def pt2_model(tmp_path_factory) -> Path:
    """A small .pt2 ExportedProgram (CPU): (2, 4) float -> (2, 4)."""
    import torch

    path = tmp_path_factory.mktemp("models") / "affine.pt2"
    ep = torch.export.export(_Affine(), (torch.ones(2, 4),))
    torch.export.save(ep, str(path))
    return path


@pytest.fixture(scope="session")
def tessel_model(tmp_path_factory) -> Path:
    """The same model built as a single-device tessel offline model (CPU)."""
    import torch

    import tessel

    path = tmp_path_factory.mktemp("models") / "affine"
    return tessel.save(
        tessel.build(_Affine(), (torch.ones(2, 4),), cluster=1, graph_parallel=False), path
    )


def affine_reference(x):
    import torch

    w = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 10
    return x @ w + 1
