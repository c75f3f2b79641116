"""A small DataFlow pipeline: pre-process UDF -> .pt2 model (2 instances) -> post-process UDF.

    .venv/bin/python examples/dataflow/pipeline.py

Places the nodes with pipeline_deploy_info.json on a local cluster of 2 CPU devices; the model
node runs as two instances sharing the transactions round-robin.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import tessel.dataflow as df

HERE = Path(__file__).resolve().parent


@df.pyflow
def normalize(x):
    return (x - x.mean()) / (x.std() + 1e-6)


@df.pyflow(num_returns=2)
def top2(logits):
    values, indexes = logits.topk(2, dim=-1)
    return values, indexes


def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mlp.pt2"
        torch.export.save(torch.export.export(model, (torch.randn(3, 8),)), str(path))

        df.init({"tessel.dataflow.local_devices": "2"})
        x = df.FlowData(name="x")
        mlp = df.GraphProcessPoint(df.Framework.PYTORCH, str(path), name="mlp").fnode()
        values, indexes = top2.fnode(name="top2")(mlp(normalize.fnode(name="normalize")(x)))
        graph = df.FlowGraph(
            [values, indexes],
            {df.DEPLOY_INFO_OPTION: str(HERE / "pipeline_deploy_info.json")},
        )
        batches = [torch.randn(3, 8) for _ in range(8)]
        for b in batches:
            graph.feed_data({x: b})
        for _ in batches:
            (v, i), info, _ = graph.fetch_data()
            print(f"transaction {info.transaction_id}: top-2 classes {i.tolist()}")
        df.finalize()


if __name__ == "__main__":
    main()
