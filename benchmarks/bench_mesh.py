"""Bytes crossing between nodes per run, tessel's mesh choice against the hand plan.

A Llama (4 layers, width 256, 8 heads, vocab 8192, batch 8 x 128, fp32) on 2 nodes of 4
devices (HCCS 392Gb within a node, RDMA 25Gb between nodes), for
  (a) devices of 16 GB, which hold the replicated model, and
  (b) devices that hold a quarter of the weights plus the activations;
tessel with `auto` and no sizes (it weighs every pp x dp x tp shape the nodes allow) against the
hand plans "TP over the 4 devices of a node, DP across the nodes" (dp 2 x tp 4) and "TP over the
4 devices of a node, 2 pipeline stages across the nodes" (pp 2 x tp 4, 4 micro-batches), given
in the policy, and the shape `auto` chose given by hand (auto's build time over its, which
should be at most 2: weighing the shapes costs at most one more build), after a small model's
build has paid the process's one-time costs. Figures per run: bytes the collectives and the
stages' sends move between nodes (all ranks), the planner's estimated time, and the build time.

    python benchmarks/bench_mesh.py
"""

from __future__ import annotations

import time

import torch

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 8192, 128, 8


def cluster_dict(memory: str, nodes: int = 2, devices: int = 4) -> dict:
    """`nodes` nodes of `devices` devices, HCCS 392Gb within a node and RDMA 25Gb between."""
    node = lambda i: {  # noqa: E731
        "node_id": i,
        "node_type": "NODE",
        "ipaddr": f"10.0.0.{i + 1}",
        "port": 29500,
        "is_local": i == 0,
        "item_list": [{"item_id": d, "device_id": d} for d in range(devices)],
    }
    return {
        "cluster": [
            {
                "cluster_nodes": [node(i) for i in range(nodes)],
                "nodes_topology": {
                    "type": "star",
                    "protocol": "RDMA:25Gb",
                    "topos": [{"plane_id": 0, "devices": list(range(devices))}],
                },
            }
        ],
        "item_def": [{"item_type": "cpu", "memory": memory}],
        "node_def": [{"node_type": "NODE", "item_topology": [{"links_mode": "HCCS:392Gb"}]}],
    }


def _sizes_of(data: dict) -> dict:
    """The policy that gives a built package's mesh shape by hand."""
    shape = dict(zip(data["mesh"]["dim_names"], data["mesh"]["shape"]))
    tp = shape.get("tp", 1) * shape.get("tp_node", 1)
    option: dict = {"tensor_parallel_option": {"tensor_parallel_size": tp}}
    if shape.get("dp", 1) > 1:
        option["data_parallel_option"] = {"data_parallel_size": shape["dp"]}
    if shape.get("pp", 1) > 1:
        micro = data.get("micro_batches") or 1
        option["pipeline_parallel_option"] = {
            "pipe_stage_num": shape["pp"],
            "micro_batch_num": micro,
        }
    return {"graph_parallel_option": option}


def main() -> None:
    from transformers import LlamaForCausalLM

    import tessel
    from tessel.capture import capture
    from tessel.config.cluster import cluster_from_dict
    from tessel.config.parallel_option import parallel_option_from_dict
    from tessel.demo import llama_config, tight_cluster
    from tessel.errors import TesselError
    from tessel.plan import has_rule
    from tessel.report import inspect_json

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(LAYERS, HIDDEN, HEADS, vocab=VOCAB)).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    kwargs = {"input_ids": ids, "use_cache": False}
    quarter = tight_cluster(capture(model, kwargs, keep=has_rule), 4, share=1.0)
    memories = {"(a) 16 GB": "[DDR:16GB]", "(b) a quarter": quarter["item_def"][0]["memory"]}
    hand = {
        "graph_parallel_option": {
            "tensor_parallel_option": {"tensor_parallel_size": 4},
            "data_parallel_option": {"data_parallel_size": 2},
        }
    }
    stages = {
        "graph_parallel_option": {
            "tensor_parallel_option": {"tensor_parallel_size": 4},
            "pipeline_parallel_option": {"pipe_stage_num": 2, "micro_batch_num": 4},
        }
    }
    plans = {
        "tessel auto": {"graph_parallel_option": {"auto": True}},
        "hand dp 2 x tp 4": hand,
        "hand pp 2 x tp 4": stages,
    }
    rows = []
    # the first build in a process pays torch's one-time costs (imports, caches of sharding
    # rules and traces), which belong to no plan: a small model's build pays them first
    small = LlamaForCausalLM(llama_config(2, 64, 4, vocab=512)).eval()
    warm = {"input_ids": torch.randint(0, 512, (2, 16)), "use_cache": False}
    tessel.build(small, warm, cluster=cluster_from_dict(cluster_dict("[DDR:16GB]"), "w"))
    for memory_label, memory in memories.items():
        cluster = cluster_from_dict(cluster_dict(memory), "2x4.json")
        todo = dict(plans)
        while todo:
            plan_label, policy = next(iter(todo.items()))
            del todo[plan_label]
            t = time.perf_counter()
            try:
                built = tessel.build(
                    model,
                    kwargs,
                    cluster=cluster,
                    policy=parallel_option_from_dict(policy, plan_label),
                    verify=False,
                )
            except TesselError as exc:  # a hand plan the devices cannot hold
                print(f"{memory_label}, {plan_label}: {exc}", flush=True)
                rows.append((memory_label, plan_label, "does not fit", None, None, None))
                continue
            seconds = time.perf_counter() - t
            data = inspect_json(built.manifest)
            between = sum(r["bytes_between_nodes"] for r in data["ranks"])
            mesh = " x ".join(
                f"{n} {s}" for n, s in zip(data["mesh"]["dim_names"], data["mesh"]["shape"])
            )
            rows.append(
                (memory_label, plan_label, mesh, between, data["estimated_time_s"], seconds)
            )
            print(rows[-1], flush=True)
            if plan_label == "tessel auto":  # next, the same shape given by hand
                todo = {"hand, auto's shape": _sizes_of(data), **todo}
            if plan_label == "hand, auto's shape":
                print(f"{memory_label}: auto's build / hand's {rows[-2][5] / seconds:.2f}")
    print()
    print(
        f"{'memory':<14} {'plan':<18} {'mesh':<20} {'MiB between nodes':>18} "
        f"{'est. ms':>8} {'build s':>8}"
    )
    for memory_label, plan_label, mesh, between, estimate, seconds in rows:
        if between is None:
            print(f"{memory_label:<14} {plan_label:<18} {mesh:<20}")
            continue
        print(
            f"{memory_label:<14} {plan_label:<18} {mesh:<20} {between / 2**20:>18.2f} "
            f"{1e3 * estimate:>8.2f} {seconds:>8.1f}"
        )


if __name__ == "__main__":
    main()
