"""tessel.parallel in a training script against the same model composed by hand from torch's
parts, side by side in one run (the model and batch of bench_training.py: Llama, 4 layers,
width 256, vocab 8192, seq 128, global batch 8, fp32, AdamW; gloo, one thread per rank).

  - step time on 4 ranks: torch's compositions as torchtitan makes them, FSDP2 + TP on a
    2 x 2 mesh (the Megatron plan on `tp`, `fully_shard` over `dp`) and pipelining x FSDP2 on
    a pp 2 x dp 2 mesh (the stages cut as below, 1F1B over 2 micro-batches), against
    `AutoParallel(model, "recursive_programming")` (the planner's choice), against the same
    pp 2 x dp 2 composition made with tessel.parallel (`nn.Pipeline` with the same stages and
    micro-batches, `pipeline(stages=2)`, data parallel over the rest), against
    `AutoParallel(model, "recursive_programming")` with `pipeline(stages=2)` (the planner
    cutting the stages), and against a training package of the same mesh (`tessel.build`
    with `pipe_stage_num` 2, `micro_batch_num` 2 and `data_parallel_size` 2, the stages cut by
    the stage planner, run by `Session.run_graph` on the same pipeline runner), the median of
    10 steps after 3 warm-up steps, and the planning time of AutoParallel's first call;
  - the pipeline bubble: `nn.Pipeline` with 2 stages on 2 ranks and m micro-batches under
    1F1B, its step time T against C, one process running the same micro-batches through the
    whole model: the bubble is 1 - C / (p T), against the schedule's (p - 1) / (m + p - 1);
    and interleaved: 4 stages looped over the 2 ranks (v = 2 each) under interleaved 1F1B,
    against (p - 1) / (v m + p - 1).

    python benchmarks/bench_training_api.py [--rounds 2] [--package-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import (  # noqa: E402
    BATCH,
    LAYERS,
    WARMUP,
    _free_port,
    adamw,
    batch,
    build,
    fsdp2_tp,
    llama,
    tessel_step_ms,
)

REPEAT = 10
# the output layer (8192 x 256) costs about 2.6 decoder layers: the last layer and it make the
# second stage, so the stages are near even and the bubble is the schedule's
STAGES = {"model.embed_tokens": 0, f"model.layers.{LAYERS - 1}": 1}
# four stages, two per rank: layers 0-1, 2, 3, and the output layer; the ranks hold about 3
# and 3.6 decoder layers' work
LOOPED = {
    "model.embed_tokens": 0,
    f"model.layers.{LAYERS - 2}": 1,
    f"model.layers.{LAYERS - 1}": 2,
    "model.norm": 3,
}


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _timed(step, barrier) -> list[float]:
    times = []
    for i in range(WARMUP + REPEAT):
        barrier()
        t = time.perf_counter()
        step()
        barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    return times


def _worker(rank: int, kind: str, world: int, port: int, micro: int, out: str) -> None:
    import torch.distributed as dist

    _join(rank, world, port)
    model, data = llama(), batch()
    result: dict = {}
    if kind == "torch":
        mine = fsdp2_tp(model, data, rank)
        optimizer = adamw(model)

        def step() -> None:
            optimizer.zero_grad()
            model(**mine, use_cache=False).loss.backward()
            optimizer.step()

    elif kind == "torch_pp":
        step = _pp_fsdp2(model, data, rank, micro)

    else:
        from tessel.parallel import AutoParallel
        from tessel.parallel.nn import Pipeline

        if kind in ("tessel", "tessel_cut"):
            net = AutoParallel(model, "recursive_programming")
            if kind == "tessel_cut":  # the planner cuts 2 stages
                net.pipeline(stages=2)
            rows = BATCH // world
            mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in data.items()}
        elif kind == "tessel_pp":  # pp 2 x dp 2: the ranks of a replica pass its rows
            net = AutoParallel(Pipeline(model, micro, STAGES), "semi_auto")
            net.pipeline(stages=2)
            dp = world // 2
            mine = {k: v.chunk(dp)[rank % dp] for k, v in data.items()}
        else:  # pipeline: every rank of the one replica passes the whole batch
            looped = kind == "interleaved"
            net = AutoParallel(Pipeline(model, micro, LOOPED if looped else STAGES), "semi_auto")
            net.pipeline(stages=2, interleave=looped)
            mine = data
        t = time.perf_counter()
        loss = net(**mine, use_cache=False)
        result["first_call_s"] = time.perf_counter() - t
        if kind == "tessel":  # the shape the planner chose
            result["mesh"] = dict(zip(net.mesh.mesh_dim_names, net.mesh.shape))
        if kind == "tessel_cut":  # where it cut
            result["cut"] = net.network.cuts
        optimizer = adamw(net)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        def step() -> None:
            optimizer.zero_grad()
            net(**mine, use_cache=False).backward()
            optimizer.step()

    result["times"] = _timed(step, dist.barrier)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


class _Logits(torch.nn.Module):
    """The model's logits: what torchtitan's pipeline stages carry to a loss on the last."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    )


def _pp_fsdp2(model: torch.nn.Module, data: dict, rank: int, micro: int):
    """torchtitan's composition on a pp 2 x dp 2 mesh: the model cut into 2 stages as STAGES
    cuts it (torch.distributed.pipelining's tracer), each stage `fully_shard` over `dp`, the
    replicas' batches through Schedule1F1B in `micro` micro-batches; returns one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, replica, rows = rank // 2, rank % 2, BATCH // 2
    ids = data["input_ids"][replica * rows : (replica + 1) * rows]
    cut = next(name for name, stage in STAGES.items() if stage == 1)
    pipe = pipeline(
        _Logits(model),
        mb_args=(ids.chunk(micro)[0],),
        split_spec={f"model.{cut}": SplitPoint.BEGINNING},
    )
    stage = pipe.build_stage(stage_index, torch.device("cpu"), group=mesh["pp"].get_group())
    fully_shard(stage.submod, mesh=mesh["dp"])
    schedule = Schedule1F1B(stage, micro, loss_fn=_causal_loss)
    optimizer = adamw(stage.submod)

    def step() -> None:
        optimizer.zero_grad()
        if stage_index == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids)
        optimizer.step()

    return step


def _whole_model(micro: int) -> float:
    """C: one process running `micro` micro-batches of the batch through the whole model."""
    torch.set_num_threads(1)
    model, data = llama(), batch()
    optimizer = adamw(model)
    parts = [
        {k: v for k, v in zip(data, values)}
        for values in zip(*(v.chunk(micro) for v in data.values()))
    ]

    def step() -> None:
        optimizer.zero_grad()
        for part in parts:
            model(**part, use_cache=False).loss.backward()
        optimizer.step()

    return statistics.median(_timed(step, lambda: None))


def _run(kind: str, world: int, micro: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        mp.start_processes(
            _worker,
            args=(kind, world, _free_port(), micro, out),
            nprocs=world,
            start_method="spawn",
        )
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--package-only",
        action="store_true",
        help="only torch PP x FSDP2 against the training package on pp 2 x dp 2",
    )
    args = parser.parse_args()
    rows = []
    for r in range(args.rounds):
        torch_pp_step = statistics.median(_run("torch_pp", 4, 2)["times"])
        with tempfile.TemporaryDirectory() as tmp:
            package = build(tmp, 2, 1, (), pp=2, micro=2)
            package_step = tessel_step_ms(package, 1, False)[0] / 1e3
        rows.append(
            f"round {r}: pp 2 x dp 2 on 4 ranks  torch PP x FSDP2 {torch_pp_step * 1e3:7.1f} ms  "
            f"tessel training package {package_step * 1e3:7.1f} ms  ratio "
            f"{package_step / torch_pp_step:.2f}"
        )
        print(rows[-1], flush=True)
        if args.package_only:
            continue
        torch_step = statistics.median(_run("torch", 4)["times"])
        tessel = _run("tessel", 4)
        tessel_step = statistics.median(tessel["times"])
        tessel_pp_step = statistics.median(_run("tessel_pp", 4, 2)["times"])
        cut = _run("tessel_cut", 4)
        cut_step = statistics.median(cut["times"])
        rows.append(
            f"round {r}: step on 4 ranks  torch FSDP2+TP {torch_step * 1e3:7.1f} ms  "
            f"torch PP x FSDP2 {torch_pp_step * 1e3:7.1f} ms  tessel AutoParallel "
            f"{tessel_step * 1e3:7.1f} ms  ratios {tessel_step / torch_step:.2f} and "
            f"{tessel_step / torch_pp_step:.2f}  (planning, first call: "
            f"{tessel['first_call_s']:.1f} s, mesh {tessel['mesh']})"
        )
        print(rows[-1], flush=True)
        rows.append(
            f"round {r}: pp 2 x dp 2 on 4 ranks  torch PP x FSDP2 {torch_pp_step * 1e3:7.1f} ms  "
            f"tessel Pipeline x data parallel {tessel_pp_step * 1e3:7.1f} ms  ratio "
            f"{tessel_pp_step / torch_pp_step:.2f}"
        )
        print(rows[-1], flush=True)
        rows.append(
            f"round {r}: pp 2 x dp 2 on 4 ranks  torch PP x FSDP2 {torch_pp_step * 1e3:7.1f} ms  "
            f"tessel AutoParallel, stages cut by the planner {cut_step * 1e3:7.1f} ms  ratio "
            f"{cut_step / torch_pp_step:.2f}  (cut before {cut['cut']}, first call "
            f"{cut['first_call_s']:.1f} s)"
        )
        print(rows[-1], flush=True)
        for m in args.micro:
            whole = _whole_model(m)
            for kind, label, theory in (
                ("pipeline", "2 stages", f"1F1B's (p-1)/(m+p-1): {1 / (m + 1):.2f}"),
                (
                    "interleaved",
                    "4 stages interleaved on 2 ranks",
                    f"interleaved 1F1B's (p-1)/(vm+p-1): {1 / (2 * m + 1):.2f}",
                ),
            ):
                step = statistics.median(_run(kind, 2, m)["times"])
                rows.append(
                    f"round {r}: pipeline {label}, {m} micro-batches  T {step * 1e3:7.1f} ms  "
                    f"C {whole * 1e3:7.1f} ms  bubble {1 - whole / (2 * step):.2f}  ({theory})"
                )
                print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
