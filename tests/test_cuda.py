"""The CUDA paths: NCCL workers for an offline model, and dataflow nodes bound to a GPU.

Skipped where no GPU is present (CI never has one); run them on a lent GPU machine with
`python -m pytest tests/test_cuda.py`. Only the workers compute on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import small_llama, token_ids

import tessel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# fp32 on a GPU sums in another order than on the CPU; TF32 stays off (torch's default).
GPU_TOLERANCE = 1e-3


def _cuda_cluster(path, devices: int) -> str:
    """A numa_config of one node with `devices` H100s (CUDA ordinals 0..n-1)."""
    path.write_text(
        json.dumps(
            {
                "cluster": [
                    {
                        "cluster_nodes": [
                            {
                                "node_id": 0,
                                "node_type": "DGX",
                                "ipaddr": "127.0.0.1",
                                "port": 29571,
                                "is_local": True,
                                "item_list": [
                                    {"item_id": i, "device_id": i} for i in range(devices)
                                ],
                            }
                        ]
                    }
                ],
                "item_def": [{"item_type": "H100", "memory": "[HBM:80GB]"}],
            }
        )
    )
    return str(path)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("graph_parallel", [True, False], ids=["partitioned", "replicated"])
def test_session_runs_on_cuda_devices_with_nccl(tmp_path, devices, graph_parallel):
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs (NCCL refuses two ranks on one GPU)")
    model = small_llama()
    ids = token_ids()
    with torch.no_grad():
        reference = model(ids)
    cluster = _cuda_cluster(tmp_path / "numa_config.json", devices)
    built = tessel.build(
        model, (ids,), cluster=cluster, soc_version="H100", graph_parallel=graph_parallel
    )
    assert built.manifest.device_type == "cuda" and built.manifest.backend == "nccl"
    path = tessel.save(built, tmp_path / "llama")
    tessel.initialize()
    try:
        sess = tessel.Session()
        sess.load_graph(0, {}, path)
        for _ in range(2):
            (out,) = sess.run_graph(0, [ids])
            assert out.shape == reference.shape
            assert (out.cpu() - reference).abs().max().item() <= GPU_TOLERANCE
    finally:
        tessel.finalize()


def test_dataflow_nodes_run_on_their_gpu(tmp_path):
    """A GPU UDF and a tessel model built for H100, both placed on CUDA device 0.

    Dataflow workers are forked, so their parent must not have initialised CUDA; torch.export
    does so on a machine with a GPU (earlier tests here export models). The model is built and
    the graph run in fresh processes, as `tessel build` and a serving program would.
    """
    model_cluster = _cuda_cluster(tmp_path / "model_cluster.json", 1)
    om_path = tmp_path / "linear.tessel"
    build = (
        "import torch, tessel; torch.manual_seed(0); "
        "tessel.save(tessel.build(torch.nn.Linear(4, 4), (torch.ones(2, 4),), "
        f"cluster={model_cluster!r}, soc_version='H100', graph_parallel=False), {str(om_path)!r})"
    )
    subprocess.run([sys.executable, "-c", build], check=True)
    run = f"from tests.test_cuda import run_gpu_dataflow; run_gpu_dataflow({str(tmp_path)!r})"
    root = Path(__file__).resolve().parents[1]
    # NVML answers is_available() without the CUDA runtime, which would poison the forks
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    subprocess.run([sys.executable, "-c", run], check=True, timeout=300, cwd=root, env=env)


def run_gpu_dataflow(folder: str) -> None:
    """The graph of `test_dataflow_nodes_run_on_their_gpu`, run in a process without CUDA."""
    import tessel.dataflow as df

    tmp_path = Path(folder)
    om_path = tmp_path / "linear.tessel"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    @df.pyflow(resources={"num_gpus": 1})
    def on_gpu(x):
        y = x.to("cuda") * 2  # the worker's default device is its GPU
        assert y.device.index == torch.cuda.current_device()
        return y.cpu()

    cluster = _cuda_cluster(tmp_path / "numa_config.json", 1)
    df.init({"ge.resourceConfigPath": cluster, "ge.socVersion": "H100"})
    try:
        x = df.FlowData()
        om = df.GraphProcessPoint(df.Framework.TESSEL, str(om_path), name="om").fnode()
        out = om(on_gpu.fnode(name="double")(x))
        deploy = tmp_path / "deploy.json"
        deploy.write_text(
            json.dumps(
                {
                    "batch_deploy_info": [
                        {"flow_node_list": ["double", "om"], "logic_device_list": "0:0:0"}
                    ]
                }
            )
        )
        graph = df.FlowGraph([out], {df.DEPLOY_INFO_OPTION: str(deploy)})
        inputs = [torch.randn(2, 4) for _ in range(4)]
        for t in inputs:
            graph.feed_data({x: t})
        for t in inputs:
            outs, _, _ = graph.fetch_data(timeout=120_000)
            with torch.no_grad():
                expected = model(t * 2)
            assert (outs[0].cpu() - expected).abs().max().item() <= GPU_TOLERANCE
    finally:
        df.finalize()
