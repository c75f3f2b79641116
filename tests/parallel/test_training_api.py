"""tessel.parallel in a training script: ranks spawned as torchrun starts them (gloo), each
training a small transformers model for five AdamW steps, checked against one process."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from tests.conftest import start_ranks
from tests.test_schedules import torch_order

from tessel.cli import main
from tessel.parallel import AutoParallel, Layout, ParallelError, reshard, shard
from tessel.parallel.nn import (
    GradAccumulation,
    MicroBatchInterleaved,
    Pipeline,
    PipelineGradReducer,
)
from tessel.parallel.runners import Batch, PlannedRunner

STEPS = 5
LR = 1e-3
MICRO = 2


def _gpt2(rows: int = 8, inner: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, n_inner=inner,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), torch.randint(0, 128, (STEPS, rows, 16))


def _llama(rows: int = 4, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config), torch.randint(0, 128, (STEPS, rows, 16))


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _steps(net, batches, rows) -> list[float]:
    """Losses of five AdamW steps, each the sum of the network's losses on `rows(batch)`; the
    optimizer is made after the first call (a planned network's parameters change then)."""
    optimizer = None
    losses = []
    for batch in batches:
        loss = sum(_loss(net(input_ids=x, labels=x, use_cache=False)) for x in rows(batch))
        optimizer = optimizer or torch.optim.AdamW(net.parameters(), lr=LR)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(net, batches, micro: int = 1) -> list[float]:
    """One process: `micro` > 1 sums the loss over that many slices of each batch (what
    GradAccumulation and MicroBatchInterleaved compute), written out by hand."""
    return _steps(net, batches, lambda batch: batch.chunk(micro))


def _train_parallel(net, batches, rank: int, world: int) -> list[float]:
    """The same steps through a wrapped network, each rank calling it on its rows."""
    return _steps(net, batches, lambda batch: [batch.chunk(world)[rank]])


def _spawn(fn, world: int, folder: Path) -> dict:
    start_ranks(fn, (world, str(folder)), world)
    return json.loads((folder / "results.json").read_text())


def _join(world: int, folder: str, rank: int) -> None:
    """Join the job as torchrun starts a rank: one thread per rank (torchrun sets
    OMP_NUM_THREADS=1 for several ranks per node), then the gloo process group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world
    )


def _megatron(model, world: int) -> None:
    """Megatron's attention and MLP split, annotated with `shard`."""
    tp = Layout((world,), ("tp",))
    column, row, whole = tp("tp", "None"), tp("None", "tp"), tp("None", "None", "None")
    for layer in model.model.layers:
        shard(layer.self_attn, in_strategy=(whole,), parameter_plan={
            "q_proj.weight": column, "k_proj.weight": column, "v_proj.weight": column,
            "self.o_proj.weight": row,
        })  # fmt: skip
        shard(layer.mlp, in_strategy=(whole,), parameter_plan={
            "gate_proj.weight": column, "up_proj.weight": column, "down_proj.weight": row,
        })  # fmt: skip


def _megatron_mlps(model, layout) -> None:
    """GPT-2's MLPs annotated on `layout`: split over `tp` as Megatron splits them (Conv1D
    weights are (in, out)), their input rows over `dp`."""
    for block in model.transformer.h:
        shard(block.mlp, in_strategy=(layout("dp", "None", "None"),), parameter_plan={
            "c_fc.weight": layout("None", "tp"), "c_fc.bias": layout("tp"),
            "c_proj.weight": layout("tp", "None"),
        })  # fmt: skip


def _semi_auto_gpt2(
    rank: int, world: int, layout, inner: int | None = None, rows: int = 8, folder=None
):
    """GPT-2 under semi_auto with its MLPs annotated on `layout`: losses, and what ran data
    parallel. The rest (attention on CPU flash attention, norms, the tied embedding) carries
    no annotation. With `folder`, its strategy and group files are saved there."""
    model, batches = _gpt2(rows, inner)
    _megatron_mlps(model, layout)
    seen = []
    model.transformer.ln_f.register_forward_pre_hook(lambda _, a: seen.append(a[0]))
    net = AutoParallel(model, "semi_auto")
    if folder is not None:
        net.save_param_strategy_file(f"{folder}/semi_auto_{rank}.json")
        net.set_group_ckpt_save_file(f"{folder}/semi_auto_groups_{rank}.pb")
    # one backward, to see the gradients' placements before the steps clear them
    x = batches[0].chunk(world)[rank]
    net(input_ids=x, labels=x, use_cache=False).loss.backward()
    grads_placed = all(p.grad.placements == p.placements for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return {
        "losses": _train_parallel(net, batches, rank, world),
        "rest_data_parallel": [str(seen[0].placements), list(seen[0].to_local().shape)],
        "grads_placed": grads_placed,
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "embedding": str(model.transformer.wte.weight.placements),
    }


# -- four ranks: the planner decides ------------------------------------------------------


def _four_ranks(rank: int, world: int, folder: str) -> None:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.tensor import DTensor, Shard

    from tessel.config.cluster import local_cluster_dict

    _join(world, folder, rank)
    model, batches = _gpt2()
    cluster = local_cluster_dict(world)
    # too little memory for every rank to hold every weight with its gradient and AdamW
    # states: the plan must shard
    cluster["item_def"][0]["memory"] = "[DDR:1500000B]"
    net = AutoParallel(model, parallel_mode="recursive_programming", cluster=cluster)
    net.hsdp(threshold=0)  # the weights the plan replicates stored sharded, however small
    # tessel's JSON from rank 0, MindSpore's protobuf from the others
    net.save_param_strategy_file(
        f"{folder}/strategy.json" if rank == 0 else f"{folder}/strategy_{rank}.ckpt"
    )
    net.set_group_ckpt_save_file(f"{folder}/groups_{rank}.pb")
    losses = _train_parallel(net, batches, rank, world)
    try:
        net(input_ids=batches[0][:1], labels=batches[0][:1], use_cache=False)
        wrong_shape = ""
    except ParallelError as exc:
        wrong_shape = str(exc)
    params = dict(net.named_parameters())
    state = net.state_dict()
    pipelined = _pipelines(rank, world, folder)
    semi_auto = _semi_auto_gpt2(rank, world, Layout((2, world // 2), ("dp", "tp")), folder=folder)
    # the inputs placed by Layouts: rows split over dp, the tp ranks of a dp group alike
    model, batches = _gpt2()
    grid = Layout((2, world // 2), ("dp", "tp"))
    laid_out = AutoParallel(model, "semi_auto")
    laid_out.dataset_strategy((grid("dp", "None"), grid("dp", "None")))
    semi_auto["laid_out"] = _steps(laid_out, batches, lambda b: [b.chunk(2)[rank // 2]])
    semi_auto["laid_out_whole"] = torch.equal(
        Batch(laid_out.settings).whole_batch(0, batches[0].chunk(2)[rank // 2]), batches[0]
    )
    # with memory to spare the planner weighs data-parallel replicas too
    model, batches = _gpt2()
    roomy = AutoParallel(model, parallel_mode="recursive_programming")
    # weights of 1 KB and more stored sharded, their gradients reduce-scattered over dp; the
    # others' gradients all-reduced in buckets of 512 bytes
    roomy.hsdp(threshold=1, optimizer_level="level2")
    roomy.comm_fusion({"allreduce": {"mode": "size", "config": 512 / 2**20}})
    roomy_losses = _train_parallel(roomy, batches, rank, world)
    # one more backward, of the loss times each replica's own factor
    rows = batches[0].chunk(world)[rank]
    (
        _loss(roomy(input_ids=rows, labels=rows, use_cache=False)) * (roomy._planned.replica + 1)
    ).backward()
    scaled = {}
    for name, p in roomy.named_parameters():
        grad = p.grad.full_tensor().double()
        scaled[name.removeprefix("network.")] = [grad.sum().item(), grad.norm().item()]
    # one loss's backward twice, scaled by 2 and then by 1: the gradients of 3 times the loss
    for p in roomy.parameters():
        p.grad = None
    again = _loss(roomy(input_ids=rows, labels=rows, use_cache=False))
    (again * 2).backward(retain_graph=True)
    again.backward()
    thrice = {}
    for name, p in roomy.named_parameters():
        grad = p.grad.full_tensor().double()
        thrice[name.removeprefix("network.")] = [grad.sum().item(), grad.norm().item()]
    # hsdp level3: the program gathers each sharded weight where it reads it, forward and back;
    # each weight's shards held by 2 ranks (of the 4 or 2 replicating it)
    model, batches = _gpt2()
    gathering = AutoParallel(model, parallel_mode="recursive_programming")
    gathering.hsdp(shard_size=2, threshold=0, optimizer_level="level3")
    level3_losses = _train_parallel(gathering, batches, rank, world)
    in_program = gathering._planned
    # sharding_propagation around MLPs annotated on a dp x tp layout: the plan keeps 2 replicas
    # and the annotated placements on tp
    model, batches = _gpt2()
    _megatron_mlps(model, Layout((2, world // 2), ("dp", "tp")))
    kept = AutoParallel(model, "sharding_propagation")
    kept.save_param_strategy_file(f"{folder}/kept_{rank}.json")
    kept_losses = _train_parallel(kept, batches, rank, world)
    mlp = model.transformer.h[1].mlp
    kept_placements = [str(mlp.c_fc.weight.placements), str(mlp.c_proj.weight.placements)]
    # planned again from the dp x tp strategy file that run saved: the same mesh and layouts
    model, batches = _gpt2()
    reloaded = AutoParallel(model, "sharding_propagation")
    reloaded.load_param_strategy_file(f"{folder}/kept_{rank}.json")
    reloaded_losses = _train_parallel(reloaded, batches, rank, world)
    reloaded_same = {n: str(p.placements) for n, p in reloaded.named_parameters()} == {
        n: str(p.placements) for n, p in kept.named_parameters()
    }
    dcp_save(state, checkpoint_id=f"{folder}/dcp")
    full = {n: p.full_tensor() for n, p in params.items()}
    planned = net._planned
    if rank == 0:
        save_file(
            {n.removeprefix("network."): t for n, t in full.items()}, f"{folder}/final.safetensors"
        )
        Path(folder, "results.json").write_text(
            json.dumps(
                {
                    "losses": losses,
                    "wrong_shape": wrong_shape,
                    "all_dtensors": all(isinstance(p, DTensor) for p in params.values()),
                    "grad_cleared": all(p.grad is None for p in params.values()),
                    "planned_shards": sum(
                        any(isinstance(x, Shard) for x in t.planned) for t in planned.trained
                    ),
                    "stored_shards": sum(t.stored != t.planned for t in planned.trained),
                    "state_keys": sorted(state),
                    **pipelined,
                    "semi_auto": semi_auto,
                    "roomy_losses": roomy_losses,
                    "roomy_mesh": dict(zip(roomy.mesh.mesh_dim_names, roomy.mesh.shape)),
                    "roomy_scaled_grads": scaled,
                    "roomy_thrice_grads": thrice,
                    "level3_losses": level3_losses,
                    "kept_losses": kept_losses,
                    "kept_mesh": dict(zip(kept.mesh.mesh_dim_names, kept.mesh.shape)),
                    "kept_placements": kept_placements,
                    "reloaded_losses": reloaded_losses,
                    "reloaded_mesh": dict(zip(reloaded.mesh.mesh_dim_names, reloaded.mesh.shape)),
                    "reloaded_same": reloaded_same,
                    "level3_gathers": [in_program.trained[u].name for u in in_program.gathers],
                    "level3_mesh": list(in_program.mesh.shape),
                    "level3_stored": sorted(
                        {(str(t.planned), str(t.stored)) for t in in_program.trained}
                    ),
                    "roomy_sharded_over_dp": sum(
                        isinstance(t.stored[0], Shard) for t in roomy._planned.trained
                    ),
                }
            )
        )
    dist.destroy_process_group()


STAGES = {"transformer.wte": 0, "transformer.h.0": 0, "transformer.h.1": 1, "lm_head": 1}
# four stages on two pipeline ranks: each rank runs two (0 and 2, 1 and 3)
LOOPED = {"transformer.wte": 0, "transformer.h.0": 1, "transformer.h.1": 2, "transformer.ln_f": 3}


def _pipelines(rank: int, world: int, folder: str) -> dict:
    """Two stages x two data-parallel replicas, under each schedule, and under 1F1B with each
    replica's batch accumulated over two calls (GradAccumulation); four stages interleaved on
    the two pipeline ranks under each schedule: losses, and the copies of the tied embedding
    each stage holds."""
    from tessel.parallel import sync_pipeline_shared_parameters

    out = {}
    dp = world // 2
    for run, scheduler, accumulate, interleave in (
        ("1f1b", "1f1b", False, False),
        ("gpipe", "gpipe", False, False),
        ("accumulated", "1f1b", True, False),
        ("interleaved", "1f1b", False, True),
        ("looped", "gpipe", False, True),
    ):
        model, batches = _gpt2()
        stage_config = LOOPED if interleave else STAGES
        pipelined = AutoParallel(Pipeline(model, MICRO, stage_config), "semi_auto")
        pipelined.pipeline(stages=2, scheduler=scheduler, interleave=interleave)
        net = GradAccumulation(pipelined, 2) if accumulate else pipelined
        # the ranks of a replica pass its batch
        losses = _steps(net, batches, lambda batch: [batch.chunk(dp)[rank % dp]])
        sync_pipeline_shared_parameters(net)
        # the passes the pipeline runner ran on this rank, in its last step
        out[f"schedule_{run}"] = [str(a) for a in pipelined.network.runner.ran]
        state = pipelined.state_dict()
        tied = {
            k: state[k].clone() for k in ("transformer.wte.weight", "lm_head.weight") if k in state
        }
        save_file(tied, f"{folder}/tied_{run}_{rank}.safetensors")
        out[f"pipeline_{run}"] = losses
    # recursive_programming in 2 stages: the planner cuts GPT-2 itself, each rank passing its
    # rows of the batch as without stages
    model, batches = _gpt2()
    cut = AutoParallel(model, "recursive_programming")
    cut.pipeline(stages=2)
    out["planner_cut_losses"] = _train_parallel(cut, batches, rank, world)
    out["planner_cut"] = [
        cut.network.cuts,
        cut.network.micro_size,
        cut.get_pipeline_stages(),
        dict(zip(cut.mesh.mesh_dim_names, cut.mesh.shape)),
    ]
    state = cut.state_dict()
    tied = {k: state[k].clone() for k in ("transformer.wte.weight", "lm_head.weight") if k in state}
    save_file(tied, f"{folder}/tied_planner_cut_{rank}.safetensors")
    try:
        model, batches = _gpt2()
        Pipeline(model, 1, STAGES)(input_ids=batches[0], labels=batches[0])
        out["pipeline_micro_size"] = "accepted"
    except ValueError as exc:
        out["pipeline_micro_size"] = str(exc)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("four_ranks")
    return folder, _spawn(_four_ranks, 4, folder)


def test_semi_auto_runs_the_unannotated_rest_data_parallel(four_ranks):
    """MLPs split on a dp x tp layout, the rest (attention, norms, the tied embedding and output
    layer) data parallel over all four ranks: one process's losses, each rank holding its
    rows where nothing is annotated, every gradient reduced to its parameter's placement."""
    got = four_ranks[1]["semi_auto"]
    assert got["losses"] == pytest.approx(_train(*_gpt2()), abs=1e-4)
    assert got["rest_data_parallel"] == ["(Shard(dim=0),)", [2, 16, 64]]
    assert got["grads_placed"] and got["tied"]
    assert got["embedding"] == "(Replicate(),)"
    # and from inputs a dataset_strategy of Layouts places (gathered whole where planned)
    assert got["laid_out"] == pytest.approx(_train(*_gpt2()), abs=1e-4)
    assert got["laid_out_whole"]


def _three_ranks(rank: int, world: int, folder: str) -> None:
    _join(world, folder, rank)
    got = _semi_auto_gpt2(rank, world, Layout((1, world), ("dp", "tp")), inner=192, rows=6)
    # every rank passing the whole batch ("full_batch"): each still runs its rows
    model, batches = _gpt2(6)
    net = AutoParallel(model, "semi_auto")
    net.dataset_strategy("full_batch")
    got["full_batch"] = _train(net, batches)
    # ranks holding different row counts: refused on every rank alike
    try:
        rows = batches[0][: rank + 1]
        AutoParallel(model, "semi_auto")(input_ids=rows, labels=rows)
        got["uneven"] = "accepted"
    except ParallelError as exc:
        got["uneven"] = str(exc)
    # three pipeline stages, one per rank, the batch in three micro-batches (the labels go
    # from the first stage straight to the last)
    model, batches = _gpt2(6)
    stages = {"transformer.wte": 0, "transformer.h.0": 1, "transformer.h.1": 2}
    pipelined = AutoParallel(Pipeline(model, 3, stages), "semi_auto")
    pipelined.pipeline(stages=3)
    got["pipeline"] = _steps(pipelined, batches, lambda batch: [batch])
    # the planner cuts a Llama into three stages, one per rank: the rotary tables and the mask
    # its first stage makes for every layer travel on stage by stage
    model, batches = _llama(6, layers=3)
    cut = AutoParallel(model, "recursive_programming")
    cut.pipeline(stages=3)
    got["planner_cut"] = _train_parallel(cut, batches, rank, world)
    got["planner_cuts"] = cut.network.cuts
    if rank == 0:
        Path(folder, "results.json").write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _spawn(_three_ranks, 3, tmp_path_factory.mktemp("three_ranks"))


def test_pipeline_of_three_stages_on_three_ranks(three_ranks):
    assert three_ranks["pipeline"] == pytest.approx(_train(*_gpt2(6), micro=3), abs=1e-4)


def test_the_planner_cuts_three_stages_on_three_ranks(three_ranks):
    assert three_ranks["planner_cut"] == pytest.approx(_train(*_llama(6, layers=3)), abs=1e-4)
    assert three_ranks["planner_cuts"] == {"1": "model.layers.1", "2": "model.layers.2"}


def test_semi_auto_at_three_ranks(three_ranks):
    """An odd rank count: the MLPs split three ways, the rest data parallel, 6 rows as 3 x 2;
    and the whole batch on every rank, each running its rows."""
    got = three_ranks
    assert got["losses"] == pytest.approx(_train(*_gpt2(6, 192)), abs=1e-4)
    assert got["rest_data_parallel"] == ["(Shard(dim=0),)", [2, 16, 64]]
    assert got["grads_placed"] and got["tied"]
    assert got["full_batch"] == pytest.approx(_train(*_gpt2(6)), abs=1e-4)
    assert got["uneven"] == (
        "AutoParallel: input 0 has [1, 2, 3] rows on the ranks; data_parallel needs as many on "
        "every rank"
    )


def test_recursive_programming_trains_as_one_process(four_ranks):
    _, got = four_ranks
    model, batches = _gpt2()
    want = _train(model, batches)
    assert got["losses"] == pytest.approx(want, abs=1e-4)
    assert got["planned_shards"] > 0  # the plan shards weights: the check is not trivial
    assert got["all_dtensors"] and got["grad_cleared"]
    assert "planned for inputs" in got["wrong_shape"]
    assert got["state_keys"] == sorted(model.state_dict())


def test_recursive_programming_with_replicas_and_hsdp_level2_trains_as_one_process(four_ranks):
    _, got = four_ranks
    model, batches = _gpt2()
    assert got["roomy_losses"] == pytest.approx(_train(model, batches), abs=1e-4)
    assert got["roomy_mesh"].get("dp", 1) > 1  # the replicas' gradients are reduced
    assert got["roomy_sharded_over_dp"] > 0  # hsdp level2: and reduce-scattered


def test_a_loss_scaled_differently_on_each_replica_weighs_its_gradients_so(four_ranks):
    # each replica's gradients are scaled by its own loss's incoming gradient before they are
    # summed over the replicas, as one process's weighted sum of the replicas' losses
    _, got = four_ranks
    model, batches = _gpt2()
    _train(model, batches)  # the five steps the run took before
    dp = got["roomy_mesh"]["dp"]
    rows = batches[0].chunk(dp)
    total = sum(
        (r + 1) * model(input_ids=x, labels=x, use_cache=False).loss for r, x in enumerate(rows)
    )
    (total / dp).backward()
    want = {
        n: [p.grad.double().sum().item(), p.grad.double().norm().item()]
        for n, p in model.named_parameters()
    }
    assert set(got["roomy_scaled_grads"]) == set(want)
    for name, (total_sum, norm) in want.items():
        assert got["roomy_scaled_grads"][name] == pytest.approx(
            [total_sum, norm], rel=1e-3, abs=1e-5
        ), name


def test_a_second_backward_of_one_loss_adds_its_gradients_again(four_ranks):
    # the first backward scales the sums made while the program ran; the second sums again
    _, got = four_ranks
    model, batches = _gpt2()
    _train(model, batches)
    dp = got["roomy_mesh"]["dp"]
    rows = batches[0].chunk(dp)
    loss = sum(model(input_ids=x, labels=x, use_cache=False).loss for x in rows) / dp
    (3 * loss).backward()
    assert set(got["roomy_thrice_grads"]) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        want = [p.grad.double().sum().item(), p.grad.double().norm().item()]
        assert got["roomy_thrice_grads"][name] == pytest.approx(want, rel=1e-3, abs=1e-5), name


def test_hsdp_level3_gathers_weights_in_the_program_and_trains_as_one_process(four_ranks):
    _, got = four_ranks
    model, batches = _gpt2()
    assert got["level3_losses"] == pytest.approx(_train(model, batches), abs=1e-4)
    # a matrix of the first layer is gathered for the forward pass and again for the backward
    # (which reads it after every later layer), not held between
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"):
        assert got["level3_gathers"].count(name) == 2, name
    # shard_size=2 on a 2 x 2 mesh: each weight's shards split over one mesh dim of 2 ranks
    assert got["level3_mesh"] == [2, 2]
    for planned, stored in got["level3_stored"]:
        assert stored.count("Shard(dim=0)") == planned.count("Shard(dim=0)") + 1, stored


def test_hsdp_shard_size_picks_the_mesh_dims_whose_ranks_hold_the_shards():
    from torch.distributed.tensor import Replicate, Shard

    from tessel._torch import detached_mesh
    from tessel.parallel.planned import shard_dims

    mesh = detached_mesh(torch.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
    whole, columns = (Replicate(),) * 3, (Replicate(), Replicate(), Shard(0))
    assert shard_dims(whole, mesh, -1, "w") == {0, 1, 2}
    assert shard_dims(whole, mesh, 8, "w") == {0, 1, 2}
    assert shard_dims(whole, mesh, 2, "w") == {2}  # neighbouring ranks first
    assert shard_dims(whole, mesh, 4, "w") == {1, 2}
    assert shard_dims(columns, mesh, 2, "w") == {1}
    assert shard_dims(columns, mesh, 4, "w") == {0, 1}  # all that replicate it
    assert shard_dims(whole, mesh, 1, "w") == set()
    with pytest.raises(ParallelError, match="shard_size 3 is no product .* 'w'"):
        shard_dims(whole, mesh, 3, "w")


def test_sharding_propagation_keeps_a_dp_x_tp_layout(four_ranks):
    """Annotations on a 2 x 2 (dp, tp) layout: the plan has the layout's 2 replicas and keeps
    the annotated placements on tp; the rest is planned around them."""
    _, got = four_ranks
    assert got["kept_losses"] == pytest.approx(_train(*_gpt2()), abs=1e-4)
    assert got["kept_mesh"] == {"dp": 2, "tp": 2}
    assert got["kept_placements"] == [
        "(Replicate(), Shard(dim=1))",
        "(Replicate(), Shard(dim=0))",
    ]
    # and a plan made from the strategy file that run saved keeps its mesh and every layout
    assert got["reloaded_losses"] == pytest.approx(_train(*_gpt2()), abs=1e-4)
    assert got["reloaded_mesh"] == {"dp": 2, "tp": 2} and got["reloaded_same"]


def test_hsdp_level1_stores_large_weights_sharded(four_ranks):
    _, got = four_ranks
    assert got["stored_shards"] > 0


def test_saved_strategy_drives_checkpoint_conversion(four_ranks, tmp_path):
    folder, _ = four_ranks
    final = load_file(str(folder / "final.safetensors"))
    # the checkpoint torch.distributed.checkpoint saved, cut by the strategy, then unified
    assert main(["ckpt", "convert", str(folder / "dcp"), str(tmp_path / "ranks"),
                 "--dst-strategy", str(folder / "strategy.json"), "--no-progress"]) == 0  # fmt: skip
    assert main(["ckpt", "unify", str(tmp_path / "ranks"), str(tmp_path / "whole"),
                 "--strategy", str(folder / "strategy_1.ckpt"), "--no-progress"]) == 0  # fmt: skip
    whole = load_file(str(tmp_path / "whole" / "model-00001-of-00001.safetensors"))
    assert set(whole) == set(final)
    for name, value in final.items():
        assert torch.equal(whole[name], value), name


@pytest.mark.parametrize(
    "run, schedule, per_rank",
    [
        ("1f1b", "1f1b", 1),
        ("gpipe", "gpipe", 1),
        ("accumulated", "1f1b", 1),
        ("interleaved", "1f1b", 2),  # torch's ScheduleInterleaved1F1B
        ("looped", "gpipe", 2),  # torch's ScheduleLoopedBFS
    ],
)
def test_pipeline_stages_with_data_parallel_train_as_one_process(
    four_ranks, run, schedule, per_rank
):
    folder, got = four_ranks
    # rank 0 ran its passes in the order torch's schedule of that name lays them out
    assert got[f"schedule_{run}"] == torch_order(schedule, 2, per_rank, MICRO, 0)
    model, batches = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    parts = MICRO * (2 if run == "accumulated" else 1)  # each replica's batch cut this many ways
    want = []
    for batch in batches:
        # each of 2 replicas sums its micro-batches' losses; the replicas are averaged
        pieces = [x for replica in batch.chunk(2) for x in replica.chunk(parts)]
        loss = sum(model(input_ids=x, labels=x).loss for x in pieces) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    assert got[f"pipeline_{run}"] == pytest.approx(want, abs=1e-4)
    # every stage's copy of the tied embedding stays equal to the one process's
    embedding = model.transformer.wte.weight.detach()
    copies = [
        t
        for rank in range(4)
        for t in load_file(str(folder / f"tied_{run}_{rank}.safetensors")).values()
    ]
    assert len(copies) >= 4  # both stages of both replicas hold one
    for copy in copies:
        torch.testing.assert_close(copy, embedding, atol=1e-6, rtol=0)


def test_recursive_programming_cuts_pipeline_stages_and_trains_as_one_process(four_ranks):
    folder, got = four_ranks
    model, batches = _gpt2()
    assert got["planner_cut_losses"] == pytest.approx(_train(model, batches), abs=1e-4)
    # GPT-2's two blocks, one per stage; each replica's 4 rows in 2 micro-batches
    assert got["planner_cut"] == [{"1": "transformer.h.1"}, 2, 2, {"pp": 2, "dp": 2}]
    embedding = model.transformer.wte.weight.detach()
    for rank in range(4):
        for copy in load_file(str(folder / f"tied_planner_cut_{rank}.safetensors")).values():
            torch.testing.assert_close(copy, embedding, atol=1e-6, rtol=0)


def test_the_planners_stage_cut_weighs_each_block_and_the_output_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessel.parallel.stage_cuts import _least_largest, balanced_stage_config

    assert _least_largest([1, 1, 1, 1], 2) == [2]
    assert _least_largest([1, 1, 1, 5], 2) == [3]
    assert _least_largest([3, 1, 1, 1, 1, 4], 3) == [1, 5]
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=4096,
    )  # fmt: skip
    ids = torch.randint(0, 4096, (1, 16))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    # the output layer (64 x 4096) outweighs the four layers together: a stage of its own
    got = balanced_stage_config(LlamaForCausalLM(config), (), inputs, 2)
    assert got == {"model.embed_tokens": 0, "model.norm": 1}
    config.vocab_size = 64  # now the layers weigh most: two each
    ids = ids % 64
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    got = balanced_stage_config(LlamaForCausalLM(config), (), inputs, 2)
    assert got == {"model.embed_tokens": 0, "model.layers.2": 1}
    # four layers, the norm and the output layer: six places a stage can start
    with pytest.raises(ParallelError, match="has 6 places to start a stage .* into 7 stages"):
        balanced_stage_config(LlamaForCausalLM(config), (), inputs, 7)
    with pytest.raises(ParallelError, match="runs no repeated blocks"):
        balanced_stage_config(torch.nn.Linear(2, 1), (torch.ones(1, 2),), {}, 2)


def test_pipeline_micro_size_must_cover_the_stages(four_ranks):
    _, got = four_ranks
    assert got["pipeline_micro_size"].startswith("Pipeline: micro_size (1) must be >= the stage")


def test_group_file_lists_the_ranks_that_hold_the_same_shards(four_ranks):
    from tessel.parallel import restore_group_info_list

    folder, _ = four_ranks
    # hsdp shards every large weight over all four ranks: no other rank stands in for one
    for rank in range(4):
        assert restore_group_info_list(str(folder / f"groups_{rank}.pb")) == [rank]


def test_semi_auto_saves_the_layouts_its_parameters_run_with(four_ranks):
    from tessel.checkpoint.strategy import load_strategy
    from tessel.parallel import restore_group_info_list

    folder, _ = four_ranks
    model, _ = _gpt2()
    for rank in range(4):
        strategy = load_strategy(str(folder / f"semi_auto_{rank}.json"))
        # every trained parameter (the tied embedding once), on the (dp, tp) = (2, 2) layout
        # where annotated, replicated over the four ranks elsewhere
        assert set(strategy.params) == {n for n, _ in model.named_parameters()}
        c_fc = strategy.params["transformer.h.0.mlp.c_fc.weight"]
        assert list(c_fc.dev_matrix) == [2, 2]
        assert [list(axes) for axes in c_fc.tensor_map] == [[], [0]]  # columns over tp
        wte = strategy.params["transformer.wte.weight"]
        assert all(not axes for axes in wte.tensor_map)
        # the MLPs split over tp: a rank's dp partner (same tp coordinate) holds its shards
        assert restore_group_info_list(str(folder / f"semi_auto_groups_{rank}.pb")) == sorted(
            {rank, rank ^ 2}
        )


# -- two ranks: shard annotations ---------------------------------------------------------


def _two_ranks(rank: int, world: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _join(world, folder, rank)
    out: dict = {}
    model, batches = _llama()
    _megatron(model, world)
    out["semi_auto"] = _train_parallel(AutoParallel(model, "semi_auto"), batches, rank, world)

    # sharding_propagation: the MLPs annotated, the planner decides the rest around them
    model, batches = _llama()
    tp = Layout((world,), ("tp",))
    for layer in model.model.layers:
        shard(layer.mlp, in_strategy=(tp("None", "None", "None"),), parameter_plan={
            "gate_proj.weight": tp("tp", "None"), "down_proj.weight": tp("None", "tp"),
        })  # fmt: skip
    net = AutoParallel(model, "sharding_propagation")
    net.save_param_strategy_file(f"{folder}/propagation_{rank}.json")
    out["propagation"] = _train_parallel(net, batches, rank, world)
    # a plan made again from the strategy file that run saved: every layout kept
    model, batches = _llama()
    again = AutoParallel(model, "sharding_propagation")
    again.load_param_strategy_file(f"{folder}/propagation_{rank}.json")
    out["loaded"] = _train_parallel(again, batches, rank, world)
    out["loaded_same"] = {n: str(p.placements) for n, p in again.named_parameters()} == {
        n: str(p.placements) for n, p in net.named_parameters()
    }
    out["propagation_kept"] = [
        [str(p) for p in model.model.layers[i].mlp.gate_proj.weight.placements]
        + [str(p) for p in model.model.layers[i].mlp.down_proj.weight.placements]
        for i in range(2)
    ]

    model, _ = _llama()
    mesh = init_device_mesh("cpu", (world,))
    column, row = ColwiseParallel(), RowwiseParallel()
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": column, "self_attn.k_proj": column, "self_attn.v_proj": column,
            "self_attn.o_proj": row, "mlp.gate_proj": column, "mlp.up_proj": column,
            "mlp.down_proj": row,
        })  # fmt: skip
    out["torch_tp"] = _train(model, batches)

    for wrapper in (GradAccumulation, MicroBatchInterleaved):
        model, _ = _llama()
        _megatron(model, world)
        net = AutoParallel(wrapper(model, 2), "semi_auto")
        out[wrapper.__name__] = _train_parallel(net, batches, rank, world)

    # reshard: a whole tensor cut as the layout says, and a DTensor moved to another layout
    tp = Layout((world,), ("tp",))
    whole = torch.arange(24.0).reshape(4, 6)
    rows = reshard(whole, tp("tp", "None"))
    columns = reshard(rows, tp("None", "tp"))
    out["reshard"] = {
        "rows": [isinstance(rows, DTensor), rows.placements == (Shard(0),),
                 torch.equal(rows.to_local(), whole.chunk(world)[rank])],
        "columns": [columns.placements == (Shard(1),),
                    torch.equal(columns.to_local(), whole.chunk(world, dim=1)[rank]),
                    torch.equal(columns.full_tensor(), whole)],
        "replicated": reshard(whole, tp("None", "None")).placements == (Replicate(),),
    }  # fmt: skip
    # parameter_broadcast: a replicated weight takes rank 0's values, sharded ones keep their own
    from tessel.parallel import parameter_broadcast, save_strategy_file

    linear = torch.nn.Linear(4, 4)
    with torch.no_grad():
        linear.weight.fill_(rank + 1)
        linear.bias.fill_(rank + 1)
    if rank == 0:
        save_strategy_file(f"{folder}/broadcast.json", {
            "weight": (tp("tp", "None"), (4, 4), "float32"),
            "bias": (tp("None"), (4,), "float32"),
        })  # fmt: skip
    dist.barrier()
    parameter_broadcast(linear, f"{folder}/broadcast.json", cur_rank=rank)
    seen = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(seen, torch.stack([linear.weight[0, 0], linear.bias[0]]).detach())
    out["broadcast"] = [t.tolist() for t in seen]
    errors = {}
    for key, call in {
        "unknown_parameter": lambda: shard(
            torch.nn.Linear(4, 4), (None,), parameter_plan={"bias2": tp("tp")}
        ),
        "indivisible": lambda: reshard(torch.ones(3, 2), tp("tp", "None")),
        "rank_count": lambda: reshard(torch.ones(4), Layout((4,), ("x",))("x")),
        "dims": lambda: reshard(torch.ones(4), tp("tp", "None")),
        "split_counts": lambda: shard(torch.nn.Linear(4, 4), ((1, 3),))(torch.ones(2, 4)),
        "too_many_inputs": lambda: shard(torch.add, ((2, 1),))(torch.ones(2, 2), torch.ones(2, 2)),
    }.items():
        try:
            call()
            errors[key] = "accepted"
        except (KeyError, ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    # a network the planner cannot cut: every rank hears why from rank 0, none waits
    net = AutoParallel(_Summed(), "recursive_programming")
    net.pipeline(stages=2)
    try:
        net(torch.ones(2, 4))
        out["uncut"] = "accepted"
    except ParallelError as exc:
        out["uncut"] = str(exc)
    if rank == 0:
        Path(folder, "results.json").write_text(json.dumps(out))
    dist.destroy_process_group()


class _Summed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two_ranks")
    return _spawn(_two_ranks, 2, folder)


def test_a_network_the_planner_cannot_cut_is_refused_on_every_rank(two_ranks):
    assert two_ranks["uncut"].startswith("pipeline: the network runs no repeated blocks")


def test_semi_auto_megatron_annotations_train_as_one_process_and_torch_tp(two_ranks):
    model, batches = _llama()
    want = _train(model, batches)
    assert two_ranks["semi_auto"] == pytest.approx(want, abs=1e-4)
    assert two_ranks["semi_auto"] == pytest.approx(two_ranks["torch_tp"], abs=1e-4)


def test_sharding_propagation_keeps_the_annotations_and_trains_as_one_process(two_ranks):
    model, batches = _llama()
    want = _train(model, batches)
    assert two_ranks["propagation"] == pytest.approx(want, abs=1e-4)
    # and a plan from the strategy file it saved places every parameter alike
    assert two_ranks["loaded"] == pytest.approx(want, abs=1e-4)
    assert two_ranks["loaded_same"]
    shard0, shard1 = "S(0)", "S(1)"
    assert two_ranks["propagation_kept"] == [[shard0, shard1], [shard0, shard1]]


@pytest.mark.parametrize("wrapper", ["GradAccumulation", "MicroBatchInterleaved"])
def test_micro_batch_wrappers_sum_the_slices_losses(two_ranks, wrapper):
    model, batches = _llama()
    want = _train(model, batches, micro=2)
    assert two_ranks[wrapper] == pytest.approx(want, abs=1e-4)


def test_parameter_broadcast_gives_each_slice_its_first_holder_s_values(two_ranks):
    # (weight, bias) on each rank: the bias is one slice held by both, the weight two
    assert two_ranks["broadcast"] == [[1.0, 1.0], [2.0, 1.0]]


def test_parameter_broadcast_checks_its_arguments(one_rank, tmp_path):
    from tessel.parallel import StrategyError, parameter_broadcast, save_strategy_file

    path = tmp_path / "s.json"
    save_strategy_file(path, {"other": (Layout((1,), ("tp",))("None"), (2,), "float32")})
    with pytest.raises(TypeError, match="net must be an nn.Module"):
        parameter_broadcast("net", path)
    with pytest.raises(ValueError, match="cur_rank must be an int >= 0"):
        parameter_broadcast(torch.nn.Linear(2, 2), path, cur_rank=-1)
    with pytest.raises(StrategyError, match="does not have"):
        parameter_broadcast(torch.nn.Linear(2, 2), path)


def test_reshard_places_whole_tensors_and_moves_dtensors(two_ranks):
    got = two_ranks["reshard"]
    assert got["rows"] == [True, True, True]
    assert got["columns"] == [True, True, True]
    assert got["replicated"]


@pytest.mark.parametrize(
    "key, message",
    [
        ("unknown_parameter", "KeyError: \"shard: parameter_plan names 'bias2'"),
        ("indivisible", "ValueError: reshard: layout: dim 0 of shape (3, 2)"),
        ("rank_count", "ValueError: reshard: layout: the Layout's device matrix (4,)"),
        ("dims", "ValueError: reshard: layout: the Layout maps 2 dims"),
        ("split_counts", "ValueError: shard: in_strategy[0]: split counts (1, 3)"),
        ("too_many_inputs", "ValueError: shard: in_strategy has 1 entries"),
    ],
)
def test_shard_and_reshard_refuse_bad_strategies(two_ranks, key, message):
    assert two_ranks["errors"][key].startswith(message)


# -- the planning child -------------------------------------------------------------------


def _plan_and_wait(folder: str, planning) -> None:
    """Rank 0 of one, whose planning child says its pid through `planning` and then works
    for ever (it ends only by a signal)."""
    import signal

    from tessel.parallel import planned

    def planning_for_ever(*args, **kwargs) -> None:
        planning.send(os.getpid())
        while True:
            signal.pause()

    planned._build = planning_for_ever
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
    model, batches = _gpt2()
    AutoParallel(model, "recursive_programming")(input_ids=batches[0], labels=batches[0])


def test_the_planning_child_dies_with_its_rank(tmp_path):
    import psutil

    spawn = mp.get_context("spawn")
    said, planning = spawn.Pipe(duplex=False)
    rank = spawn.Process(target=_plan_and_wait, args=(str(tmp_path), planning))
    rank.start()
    child = None
    try:
        assert said.poll(300), "rank 0 never started its planning child"
        child = psutil.Process(said.recv())
        assert child.ppid() == rank.pid
        # the rank is killed while its child plans: the child goes with it, not when it next
        # reads from the rank
        rank.kill()
        rank.join()
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert not alive, "the planning child outlived its rank"
    finally:
        rank.kill()
        rank.join()
        if child is not None:
            with contextlib.suppress(psutil.Error):
                child.kill()


# -- argument checks, in this process -----------------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_parallel_refuses_bad_construction():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parallel_mode must be one of"):
        AutoParallel(net, "auto")
    with pytest.raises(TypeError, match="network must be a torch.nn.Module"):
        AutoParallel(lambda x: x)
    with pytest.raises(ParallelError, match="torch.distributed initialised first"):
        AutoParallel(net, "recursive_programming")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda n: n.hsdp(shard_size="all"), TypeError, "shard_size must be an int"),
        (lambda n: n.hsdp(shard_size=3), ValueError, r"shard_size must be -1 .* in \(0, 1\]"),
        (lambda n: n.hsdp(shard_size=0), ValueError, r"shard_size must be -1 .* in \(0, 1\]"),
        (lambda n: n.hsdp(threshold=-1), ValueError, "threshold must be at least 0"),
        (lambda n: n.hsdp(optimizer_level="level9"), ValueError, "optimizer_level must be one"),
        (lambda n: n.pipeline(stages=0), ValueError, "stages must be at least 1"),
        (lambda n: n.pipeline(stages="2"), TypeError, "stages must be an int"),
        (lambda n: n.pipeline(scheduler="zb"), ValueError, "scheduler must be one of"),
        (lambda n: n.pipeline(stages=2, interleave=True), ParallelError, "planner cuts one"),
        (
            lambda n: (n.save_param_strategy_file("s.json"), n.pipeline(stages=2)),
            ParallelError,
            "not built for pipeline stages",
        ),
        (lambda n: n.dataset_strategy(None), ValueError, "config must not be None"),
        (lambda n: n.dataset_strategy(3), TypeError, "config must be 'data_parallel'"),
        (lambda n: n.dataset_strategy("rows"), ValueError, "must be 'data_parallel' or"),
        (lambda n: n.dataset_strategy(((1, 2),)), ValueError, "splits an input 2 ways"),
        (lambda n: n.dataset_strategy((Layout((1,), ("dp",)),)), ValueError, "needs a tensor map"),
        (
            lambda n: n.dataset_strategy((Layout((2,), ("dp",))("dp"),)),
            ValueError,
            "covers 2 ranks",
        ),
        (
            lambda n: n.dataset_strategy(((1,), Layout((1,), ("dp",))("dp"))),
            TypeError,
            "consistent",
        ),
        (
            lambda n: n.dataset_strategy(("rows",)),
            TypeError,
            "tuple of split counts .* or a Layout",
        ),
        (lambda n: n.save_param_strategy_file(3), TypeError, "file_path must be a str"),
        (lambda n: n.save_param_strategy_file(""), ValueError, "file_path must name a file"),
        (lambda n: n.set_group_ckpt_save_file("."), ValueError, "file_path must name a file"),
        (lambda n: n.dataset_strategy(()), ValueError, "config is an empty tuple"),
        (lambda n: n.set_group_ckpt_save_file(None), TypeError, "file_path must be a str"),
        (lambda n: n.load_param_strategy_file(3), TypeError, "file_path must be a str"),
        (lambda n: n.comm_fusion("on"), TypeError, "config must be a dict"),
        (lambda n: n.comm_fusion({"fuse": True}), KeyError, "unknown keys \\['fuse'\\]"),
        (lambda n: n.comm_fusion({"allgather": {}}), ParallelError, "'allgather' is not built"),
        (lambda n: n.comm_fusion({"openstate": 1}), TypeError, "openstate must be a bool"),
        (lambda n: n.comm_fusion({"allreduce": {"mode": "x"}}), ValueError, "mode is one of"),
        (lambda n: n.comm_fusion({"allreduce": {"mode": "size"}}), ValueError, "MB > 0"),
        (
            lambda n: n.comm_fusion({"allreduce": {"mode": "index", "config": [-1]}}),
            ValueError,
            "list of parameter indices",
        ),  # fmt: skip
        (lambda n: n.disable_loss_repeated_mean(), ParallelError, "not built"),
        (
            lambda n: n.network.to(torch.bfloat16) and n.enable_fp32_communication(),
            ParallelError,
            "not in float32",
        ),  # fmt: skip
    ],
)
def test_auto_parallel_methods_refuse_by_name(one_rank, call, error, match):
    net = AutoParallel(torch.nn.Linear(2, 2), "recursive_programming")
    with pytest.raises(error, match=match):
        call(net)


def test_settings_a_mode_cannot_honour_are_refused_in_it(one_rank):
    """semi_auto keeps unannotated weights whole: hsdp is not taken there; a Pipeline network
    takes its replicas' batches, or the whole batch, not per-input strategies; a Pipeline runs
    as semi_auto's network itself."""
    with pytest.raises(ParallelError, match="hsdp: semi_auto runs the network's `shard`"):
        AutoParallel(torch.nn.Linear(2, 2), "semi_auto").hsdp(threshold=0)
    pipelined = AutoParallel(
        Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1, {"0": 0}), "semi_auto"
    )
    pipelined.dataset_strategy(((1, 1),))
    with pytest.raises(ParallelError, match="a Pipeline network takes 'data_parallel'"):
        pipelined(torch.ones(2, 2))
    pipeline = Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1, {"0": 0})
    with pytest.raises(ParallelError, match="found 'recursive_programming'"):
        AutoParallel(pipeline, "recursive_programming")
    with pytest.raises(ParallelError, match="found one at 'network'"):
        AutoParallel(GradAccumulation(pipeline, 2), "semi_auto")


@pytest.mark.parametrize(
    "call",
    [
        lambda n: n.save_param_strategy_file("strategy.json"),
        lambda n: n.set_group_ckpt_save_file("groups.pb"),
    ],
)
def test_files_of_layouts_are_refused_for_pipeline_stages(one_rank, call):
    net = AutoParallel(
        Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1, {"0": 0}), "semi_auto"
    )
    with pytest.raises(ParallelError, match="not built for pipeline stages"):
        call(net)


def test_stages_of_a_plain_network_are_cut_only_by_the_planner(one_rank):
    for mode in ("semi_auto", "sharding_propagation"):
        net = AutoParallel(torch.nn.Linear(2, 2), mode)
        with pytest.raises(ParallelError, match="run a tessel.parallel.nn.Pipeline"):
            net.pipeline(stages=2)


def test_the_first_call_settles_the_stages_the_network_runs_in(one_rank):
    """The first call hands the network to the runner its settings ask for; stages asked for
    after it would be a setting no runner reads, so they are refused."""
    net = AutoParallel(torch.nn.Linear(2, 2), "semi_auto")
    out = net(torch.ones(3, 2))
    assert out.shape == (3, 2)
    with pytest.raises(ParallelError, match="the first call has chosen how the network runs"):
        net.pipeline(stages=2)
    net.pipeline(stages=1)  # as it runs
    assert net.get_pipeline_stages() == 1
    # what only planning reads is refused once the network runs, never recorded and ignored
    with pytest.raises(ParallelError, match="hsdp: the first call has run the network"):
        net.hsdp()
    with pytest.raises(ParallelError, match="load_param_strategy_file: the first call has"):
        net.load_param_strategy_file("strategy.json")
    net.comm_fusion({"openstate": False})  # semi_auto reads it on every call
    assert net.settings.fusion == ("each", None)


class _SquaredLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).pow(2).mean()


def test_a_planned_network_refuses_the_fusion_its_program_was_planned_without(one_rank):
    net = AutoParallel(_SquaredLoss(), "recursive_programming")
    net(torch.ones(2, 4)).backward()
    with pytest.raises(ParallelError, match="comm_fusion: the first call has run the network"):
        net.comm_fusion({"openstate": False})


@pytest.mark.timeout(120)  # the child, broken so, may hang rather than crash
def test_planning_after_a_destroyed_group_forks_a_child_that_plans(tmp_path):
    """A script that planned and ran a network on a group it then destroyed plans again on a
    new one: the planning child must not free what DTensor's caches kept of the old run (its
    threads are the parent's), which crashed it or hung it."""
    for i, mode in enumerate(("recursive_programming",) * 2):
        init = f"file://{tmp_path}/init{i}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        try:
            net = AutoParallel(_SquaredLoss(), mode)
            net(torch.ones(2, 4)).backward()
        finally:
            dist.destroy_process_group()
    assert isinstance(net._runner, PlannedRunner)


def test_comm_fusion_buckets_the_gradient_all_reduce(one_rank):
    from tessel.runtime.exchange import fusion_buckets

    grads = [torch.zeros(2**18) for _ in range(5)]  # 1 MB each
    net = AutoParallel(torch.nn.Linear(2, 2), "recursive_programming")
    plans = {}
    for name, config in {
        "default": None,
        "size": {"allreduce": {"mode": "size", "config": 2}},
        "index": {"allreduce": {"mode": "index", "config": [0, 3]}},
        "off": {"openstate": False},
    }.items():
        if config is not None:
            net.comm_fusion(config)
        plans[name] = fusion_buckets(net.settings.fusion, [0, 1, 2, 3, 4], grads)
    assert plans["default"] == [[0, 1, 2, 3, 4]]
    assert plans["size"] == [[0, 1], [2, 3], [4]]
    assert plans["index"] == [[0, 1, 2], [3, 4]]
    assert plans["off"] == [[0], [1], [2], [3], [4]]


def test_gradient_buckets_follow_the_order_the_program_makes_gradients():
    from torch import fx

    from tessel.runtime.step_program import made_order

    def program(w0, w1, w2, x):
        h = x * w0
        loss = (h * w1).sum()
        g1 = h * 2  # made first
        g0 = g1 * x
        return loss, g0, g1, w2  # w2's gradient passed through from an input

    assert made_order(fx.symbolic_trace(program)) == [2, 1, 0]


def test_auto_parallel_accepted_settings(one_rank):
    net = AutoParallel(torch.nn.Linear(2, 2), "recursive_programming")
    net.enable_gradients_mean()
    net.disable_gradient_fp32_sync()
    net.no_init_parameters_in_compile()
    net.enable_fp32_communication()
    net.pipeline(stages=1, scheduler="gpipe")
    net.dataset_strategy("full_batch")
    net.dataset_strategy(((1, 1), (1,)))
    assert net.get_pipeline_stages() == 1


def test_annotations_are_refused_where_the_planner_cannot_keep_them(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def annotated(shape: tuple, placements: list) -> torch.nn.Module:
        linear = torch.nn.Linear(2, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b", "c")[: len(shape)])
        value = distribute_tensor(linear.weight.detach(), mesh, placements)
        linear.weight = torch.nn.Parameter(value)
        return linear

    with pytest.raises(ParallelError, match="decides every placement: drop the `shard`"):
        AutoParallel(annotated((1, 1), [Replicate()] * 2), "recursive_programming")(
            torch.ones(2, 2)
        )
    with pytest.raises(ParallelError, match="annotated on a mesh of shape \\(1, 1, 1\\)"):
        net = AutoParallel(annotated((1, 1, 1), [Replicate()] * 3), "sharding_propagation")
        net(torch.ones(2, 2))
    with pytest.raises(ParallelError, match="split over the first dim of its layout \\(S\\(0\\)"):
        net = AutoParallel(annotated((1, 1), [Shard(0), Replicate()]), "sharding_propagation")
        net(torch.ones(2, 2))


def test_load_param_strategy_file_refuses_what_it_cannot_keep(one_rank, tmp_path):
    from tessel.parallel import StrategyError, save_strategy_file

    with pytest.raises(ParallelError, match="semi_auto runs the network's own"):
        AutoParallel(torch.nn.Linear(2, 2), "semi_auto").load_param_strategy_file("s.json")
    for params, match in [
        ({"other": (Layout((1,), ("tp",))("None"), (2,), "float32")}, "does not have"),
        ({"weight": (Layout((2,), ("tp",))("tp", "None"), (2, 2), "float32")}, "not one dim"),
    ]:
        path = tmp_path / "s.json"
        save_strategy_file(path, params)
        net = AutoParallel(torch.nn.Linear(2, 2), "sharding_propagation")
        net.load_param_strategy_file(path)
        with pytest.raises(StrategyError, match=match):
            net(torch.ones(2, 2))


def test_shard_checks_its_arguments_before_anything_runs(one_rank):
    linear = torch.nn.Linear(2, 2)
    tp = Layout((1,), ("tp",))
    with pytest.raises(TypeError, match="in_strategy must be a tuple"):
        shard(linear, [(1, 1)])
    with pytest.raises(TypeError, match="out_strategy must be a tuple or None"):
        shard(linear, ((1, 1),), out_strategy=[(1, 1)])
    with pytest.raises(TypeError, match="consistent type"):
        shard(linear, ((1, 1), tp("None", "None")))
    with pytest.raises(TypeError, match="parameter_plan needs fn to be an nn.Module"):
        shard(torch.add, ((1, 1),), parameter_plan={"w": (1, 1)})
    with pytest.raises(ValueError, match="level must be 0, 1 or 2"):
        shard(linear, ((1, 1),), level=3)
    # one rank: nothing to shard, the module comes back as it was
    assert shard(linear, ((1, 1),)) is linear and not linear._forward_hooks
    with pytest.raises(TypeError, match="reshard: tensor must be a Tensor"):
        reshard([1.0], tp("tp"))
    with pytest.raises(TypeError, match="reshard: layout must be a Layout"):
        reshard(torch.ones(2), (1,))
    assert reshard(torch.ones(2), tp("tp")) is not None


@pytest.mark.parametrize("wrapper", [GradAccumulation, MicroBatchInterleaved])
def test_micro_batch_wrappers_check_their_arguments(wrapper):
    with pytest.raises(TypeError, match="network must be a torch.nn.Module"):
        wrapper(lambda x: x, 2)
    with pytest.raises(TypeError, match="must be an int"):
        wrapper(torch.nn.Linear(2, 2), "2")
    with pytest.raises(ValueError, match="must be > 0"):
        wrapper(torch.nn.Linear(2, 2), 0)
    with pytest.raises(ValueError, match="does not cut into 2 equal slices"):
        wrapper(torch.nn.Linear(2, 2), 2)(torch.ones(3, 2))
    with pytest.raises(TypeError, match="must return a tensor"):
        wrapper(torch.nn.Identity(), 2)({"x": torch.ones(2)})


def test_pipeline_checks_its_arguments():
    model, _ = _gpt2()
    with pytest.raises(TypeError, match="network must be a torch.nn.Module"):
        Pipeline(lambda x: x, 2)
    with pytest.raises(TypeError, match="micro_size must be an int"):
        Pipeline(model, 2.0)
    with pytest.raises(KeyError, match="'transformer.h.9'.*its modules are"):
        Pipeline(model, 2, {"transformer.h.9": 1})
    with pytest.raises(ValueError, match="each stage before the next"):
        Pipeline(model, 2, {"transformer.h.0": 1, "transformer.h.1": 0})
    with pytest.raises(ValueError, match="no module to stages \\[1\\]"):
        Pipeline(model, 2, {"transformer.h.0": 0, "transformer.h.1": 2})
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Pipeline(model, 2, {"transformer.h.0": -1})


def test_pipeline_ranks_must_match_the_stages_or_loop_over_them(one_rank):
    model, _ = _gpt2()
    net = AutoParallel(Pipeline(model, 2, LOOPED), "semi_auto")  # four stages
    with pytest.raises(ValueError, match=r"gives 4 \(several stages per rank need interleave"):
        net.pipeline(stages=2)
    with pytest.raises(ValueError, match="4 is not a multiple of stages=3"):
        net.pipeline(stages=3, interleave=True)
    net.pipeline(stages=2, interleave=True)
    assert net.get_pipeline_stages() == 2 and net.network.pipeline_ranks == 2


def test_stages_one_rank_holds_hand_over_in_memory_and_train_as_the_network(one_rank):
    """Four stages looped on one pipeline rank, each handing the next its tensors in memory:
    the loss and every gradient are the network's own, summed over the micro-batches; a call
    of other shapes than the traced one is refused."""
    model, batches = _gpt2()
    alone, _ = _gpt2()
    net = AutoParallel(Pipeline(model, 2, LOOPED), "semi_auto")
    net.pipeline(stages=1, interleave=True)
    batch = batches[0]
    loss = net(input_ids=batch, labels=batch)
    loss.backward()
    assert [str(a) for a in net.network.runner.ran][:4] == ["0F0", "1F0", "2F0", "3F0"]
    want = sum(alone(input_ids=x, labels=x).loss for x in batch.chunk(2))
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    got = dict(model.named_parameters())
    for name, p in alone.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ParallelError, match=r"traced for inputs of shapes \[\(8, 16\)"):
        net(input_ids=batch[:4], labels=batch[:4])


def test_pipeline_grad_reducer_scales_the_accumulated_gradients():
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 4.0)
    reducer = PipelineGradReducer([weight], scale_sense=2.0)
    assert torch.equal(reducer((torch.full((3,), 6.0),))[0], torch.full((3,), 3.0))
    (grad,) = reducer()
    assert grad is weight.grad and torch.equal(weight.grad, torch.full((3,), 2.0))
    with pytest.raises(TypeError, match="parameters must be an iterable"):
        PipelineGradReducer(weight)
    with pytest.raises(ValueError, match="scale_sense must be > 0"):
        PipelineGradReducer([weight], scale_sense=0)
    with pytest.raises(TypeError, match="opt_shard must be a bool"):
        PipelineGradReducer([weight], opt_shard="yes")
    with pytest.raises(ValueError, match="2 gradients for 1 parameters"):
        reducer([None, None])


def test_micro_batch_wrappers_sum_outputs_of_slices():
    linear = torch.nn.Linear(2, 3)
    x = torch.randn(4, 2)
    got = GradAccumulation(linear, 2)(x)
    assert torch.allclose(got, linear(x[:2]) + linear(x[2:]))
