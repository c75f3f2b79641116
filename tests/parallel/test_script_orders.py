"""Training scripts written in the orders torch's and MindSpore's documents teach, on four gloo
ranks, against one process training the same weights.

Every mode runs one script with six optimizers over a tied-embedding GPT-2: an SGD (no
momentum: a gradient of the wrong scale shows) and an AdamW made before the network is wrapped,
two made between wrapping and the first call, two made after it; step k is taken by optimizer
k. The first AdamW resumes a state loaded before the first call, the first SGD has a scheduler
made then, and every step clips the gradients through a list of the parameters taken before
wrapping (MODES names the exceptions). One process runs the same
script on the whole batch: the losses and the final weights must agree within 1e-5.

MODES is a covering set: each way a wrapped network holds, places and trains its parameters
runs once. semi_auto (annotated, data parallel, a Pipeline, the micro-batch wrappers,
full_batch); the planner (recursive_programming on a network nothing of which pickles, in
GradAccumulation; sharding_propagation; its stages); and hsdp's weights stored sharded: level1
gathers them once per step and slices their gradients once reduced whole over any replicas;
level3 reduce-scatters the gradients over the replicas and the program gathers the weights.
level2 is level1's gathering with level3's gradients (PlannedNetwork's `gather_in_program` and
`shard_gradients` act apart), so both of its paths run here; test_training_api trains
level2 itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tests.conftest import start_ranks

from tessel.parallel import (
    AutoParallel,
    Layout,
    ParallelError,
    shard,
    sync_pipeline_shared_parameters,
)
from tessel.parallel.nn import GradAccumulation, MicroBatchInterleaved, Pipeline

WORLD, ROWS, SEQ, VOCAB = 4, 8, 8, 32
ORDERS = ("before", "between", "after")
KINDS = ("sgd", "adamw")
STEPS = len(ORDERS) * len(KINDS)
CLIP = 0.5
TOLERANCE = 1e-5


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids, and labels with some tokens ignored (-100), unevenly over the rows."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, ROWS, SEQ), generator=g)
    labels = ids.clone()
    for row in range(ROWS):
        labels[:, row, : row % 5] = -100
    return ids, labels


def _optimizer(kind: str, parameters) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=0.1)
    return torch.optim.AdamW(parameters, lr=1e-3)


def _resumed_state() -> dict:
    """An AdamW state to resume from: one step of one process on a batch of its own."""
    model = _gpt2()
    optimizer = _optimizer("adamw", model.parameters())
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    return optimizer.state_dict()


def _made(order: str, parameters, optimizers: list) -> None:
    """The optimizers of `order`, the first SGD with a scheduler, the first AdamW resumed."""
    parameters = list(parameters)
    for kind in KINDS:
        optimizer = _optimizer(kind, parameters)
        if order == "before" and kind == "sgd":
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
        if order == "before" and kind == "adamw":
            optimizer.load_state_dict(_resumed_state())
        optimizers[KINDS.index(kind) * len(ORDERS) + ORDERS.index(order)] = optimizer


def _step(loss: torch.Tensor, optimizer, clipped: list | None) -> float | None:
    loss.backward()
    norm = None if clipped is None else torch.nn.utils.clip_grad_norm_(clipped, CLIP)
    optimizer.step()
    optimizer.zero_grad()
    return (
        None
        if norm is None
        else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    )


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


# -- the modes: how each wraps the model, what each rank passes, what one process computes ---


def _whole(model, ids, labels) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def _two_slices(model, ids, labels) -> torch.Tensor:
    return sum(_whole(model, x, y) for x, y in zip(ids.chunk(2), labels.chunk(2)))


def _replicas_of_two_slices(model, ids, labels) -> torch.Tensor:
    """Two replicas, each summing its two micro-batches' losses; the replicas' mean."""
    pieces = [
        (x, y) for r in zip(ids.chunk(2), labels.chunk(2)) for x, y in zip(*(t.chunk(2) for t in r))
    ]
    return sum(_whole(model, x, y) for x, y in pieces) / 2


def _rows(rank: int, parts: int = WORLD) -> Callable:
    return lambda t: t.chunk(parts)[rank % parts]


def _all_rows(rank: int) -> Callable:
    return lambda t: t


def _megatron_mlps(model) -> None:
    layout = Layout((2, WORLD // 2), ("dp", "tp"))
    for block in model.transformer.h:
        shard(block.mlp, in_strategy=(layout("dp", "None", "None"),), parameter_plan={
            "c_fc.weight": layout("None", "tp"), "c_fc.bias": layout("tp"),
            "c_proj.weight": layout("tp", "None"),
        })  # fmt: skip


def _local_network(model) -> torch.nn.Module:
    """A network whose class is defined in a function and which holds a lambda: nothing of it
    pickles."""

    class WithLoss(torch.nn.Module):
        def __init__(self, lm) -> None:
            super().__init__()
            self.lm = lm
            self.loss_of = lambda out: out.loss

        def forward(self, input_ids, labels):
            return self.loss_of(self.lm(input_ids=input_ids, labels=labels, use_cache=False))

    return WithLoss(model)


def _semi_auto(model):
    _megatron_mlps(model)
    return AutoParallel(model, "semi_auto")


def _propagation(model):
    _megatron_mlps(model)
    return AutoParallel(model, "sharding_propagation")


def _pipeline(model):
    # the second replica's ranks made their network unalike: the run starts from the first's
    if dist.get_rank() % 2:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    net = AutoParallel(
        Pipeline(model, 2, {"transformer.wte": 0, "transformer.h.1": 1}), "semi_auto"
    )
    net.pipeline(stages=2)
    return net


def _hsdp(level: str):
    def wrap(model):
        net = AutoParallel(model, "recursive_programming")
        net.hsdp(threshold=0, optimizer_level=level)
        return net

    return wrap


def _planner_stages(model):
    net = AutoParallel(model, "recursive_programming")
    net.pipeline(stages=2)
    return net


def _full_batch_accumulation(model):
    net = AutoParallel(GradAccumulation(model, 2), "semi_auto")
    net.dataset_strategy("full_batch")
    return net


# name: (wrap, this rank's part of a batch, one process's loss, labels with -100, clipped).
# Not clipped: pipeline stages (each stage's norm is its own), and semi_auto's annotated MLPs,
# whose gradients live on their layout's mesh beside the rest's data-parallel one: torch's
# clip_grad_norm_ stacks the norms and refuses DTensors of two meshes.
MODES: dict[str, tuple] = {
    "semi_auto": (_semi_auto, _rows, _whole, False, False),
    "GradAccumulation": (
        lambda m: AutoParallel(GradAccumulation(m, 2), "semi_auto"), _rows, _two_slices, False, True,
    ),
    "MicroBatchInterleaved": (
        lambda m: AutoParallel(MicroBatchInterleaved(m, 2), "semi_auto"), _rows, _two_slices,
        False, True,
    ),
    "Pipeline": (_pipeline, lambda r: _rows(r, 2), _replicas_of_two_slices, False, False),
    "full_batch_GradAccumulation": (_full_batch_accumulation, _all_rows, _two_slices, True, True),
    "sharding_propagation": (_propagation, _rows, _whole, False, True),
    "hsdp_level1": (_hsdp("level1"), _rows, _whole, False, True),
    "hsdp_level3": (_hsdp("level3"), _rows, _whole, False, True),
    "planner_stages": (_planner_stages, _rows, _whole, False, False),
    # the planner's own mode: a network nothing of which pickles, in GradAccumulation (one
    # plan for both; the micro-batches change no parameter's placement or update)
    "planned_GradAccumulation": (
        lambda m: AutoParallel(GradAccumulation(_local_network(m), 2), "recursive_programming"),
        _rows, _two_slices, False, True,
    ),
}  # fmt: skip


def _script(mode: str, rank: int, folder: str) -> dict:
    """One mode's script on this rank: losses, and this rank's view of the final weights
    written to a file."""
    wrap, part_of, _, ignored, clipping = MODES[mode]
    ids, labels = _batches()
    if not ignored:
        labels = ids
    part = part_of(rank)
    model = _gpt2()
    optimizers: list = [None] * STEPS
    _made("before", model.parameters(), optimizers)
    clipped = list(model.parameters())
    early_state = model.state_dict()
    initial = {name: value.clone() for name, value in early_state.items()}
    net = wrap(model)
    _made("between", net.parameters(), optimizers)
    losses, norms = [], []
    for k in range(STEPS):
        loss = _loss(net(input_ids=part(ids[k]), labels=part(labels[k])))
        if k == 0:
            _made("after", net.parameters(), optimizers)
        norms.append(_step(loss, optimizers[k], clipped if clipping else None))
        losses.append(loss.item())
    out: dict = {"losses": losses, "norms": norms}
    # the copies of the tied embedding were trained alike: copying the first over the others
    # keeps the trained values
    sync_pipeline_shared_parameters(net)
    state = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        try:
            state[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
        except ParallelError:  # retired here: another pipeline stage's
            continue
    save_file(state, f"{folder}/{mode}_{rank}.safetensors")
    if mode == "semi_auto":
        out["early_state"] = _early_state(early_state, initial, state)
        try:
            clipped[0] + 1
            out["retired_use"] = "accepted"
        except ParallelError as exc:
            out["retired_use"] = str(exc)
    if mode == "Pipeline":
        held = list(net.parameters())
        mine = list(model.parameters())
        out["user_objects"] = all(any(p is q for q in mine) for p in held)
    return out


def _early_state(early: dict, initial: dict, final: dict) -> dict[str, str]:
    """What each value of a state_dict taken before wrapping reads as after training: the
    trained value, the initial one, or (never) something else."""
    seen = {}
    for name, value in early.items():
        if name in final and torch.equal(value, final[name]):
            seen[name] = "trained"
        else:
            seen[name] = "initial" if torch.equal(value, initial[name]) else "other"
    return seen


def _ranks(rank: int, world: int, folder: str) -> None:
    # one thread per rank, as torchrun gives several ranks of a node (OMP_NUM_THREADS=1): four
    # ranks of two OpenMP threads on two cores spin waiting for threads that have no core
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world
    )
    results = {mode: _script(mode, rank, folder) for mode in MODES}
    # a network the planner cannot build (it returns logits, not a loss): every rank hears
    # why, on one line
    try:
        x = torch.zeros(2, 4)
        AutoParallel(torch.nn.Linear(4, 4), "recursive_programming")(x)
        results["unplanned"] = "accepted"
    except ParallelError as exc:
        results["unplanned"] = str(exc)
    Path(folder, f"results_{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("script_orders")
    start_ranks(_ranks, (WORLD, str(folder)), WORLD)
    return folder, [json.loads((folder / f"results_{r}.json").read_text()) for r in range(WORLD)]


def _one_process(mode: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    _, _, loss_of, ignored, clipping = MODES[mode]
    ids, labels = _batches()
    if not ignored:
        labels = ids
    model = _gpt2()
    optimizers: list = [None] * STEPS
    for order in ORDERS:
        _made(order, model.parameters(), optimizers)
    clipped = list(model.parameters()) if clipping else None
    losses, norms = [], []
    for k in range(STEPS):
        loss = loss_of(model, ids[k], labels[k])
        norms.append(_step(loss, optimizers[k], clipped))
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_order_of_optimizer_trains_as_one_process(scripts, mode):
    folder, results = scripts
    want_losses, want_norms, want = _one_process(mode)
    assert results[0][mode]["losses"] == pytest.approx(want_losses, abs=TOLERANCE)
    if MODES[mode][4]:  # the early list clips the gradients that train, and clipping bites
        assert results[0][mode]["norms"] == pytest.approx(want_norms, rel=TOLERANCE)
        assert max(want_norms) > CLIP
    copies: dict[str, list[torch.Tensor]] = {}
    for rank in range(WORLD):
        for name, value in load_file(str(folder / f"{mode}_{rank}.safetensors")).items():
            copies.setdefault(name, []).append(value)
    assert set(copies) == set(want)  # every weight is held by some rank
    for name, values in copies.items():
        for value in values:  # every copy: replicas and stages
            torch.testing.assert_close(value, want[name], atol=TOLERANCE, rtol=0, msg=name)


def test_a_state_dict_taken_before_wrapping_reads_trained_values_or_the_initial_ones(scripts):
    seen = scripts[1][0]["semi_auto"]["early_state"]
    assert "other" not in seen.values()
    # the weights every rank holds whole share their storage; the sharded MLPs' do not
    assert seen["transformer.wte.weight"] == "trained"
    assert seen["transformer.h.0.mlp.c_fc.weight"] == "initial"
    assert seen["transformer.h.0.mlp.c_proj.weight"] == "initial"  # its rows a copy, not a view


def test_a_retired_parameter_used_names_itself(scripts):
    message = scripts[1][0]["semi_auto"]["retired_use"]
    assert message.startswith("transformer.wte.weight was used (add) after AutoParallel's first")


def test_pipeline_stages_hold_the_users_parameter_objects(scripts):
    assert all(results["Pipeline"]["user_objects"] for results in scripts[1])


def test_a_planning_failure_reaches_every_rank_as_one_line(scripts):
    messages = [results["unplanned"] for results in scripts[1]]
    assert len(set(messages)) == 1
    assert messages[0].startswith("planning failed on rank 0: ")
    assert "\n" not in messages[0]


# -- a network defined in `__main__` of `python -c`, planned by two ranks -----------------

IN_MAIN = """
import sys
import torch
import torch.distributed as dist
from tessel.parallel import AutoParallel

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.act = lambda x: x.tanh()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.act(self.lin(x)), y)

def train(net, x, y):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        loss = net(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses

rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
x, y = torch.randn(8, 4), torch.randn(8, 2)
torch.manual_seed(1)
print("one process", train(Net(), x, y))
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
torch.manual_seed(1)
net = AutoParallel(Net(), "recursive_programming")
print("parallel", train(net, x.chunk(world)[rank], y.chunk(world)[rank]))
dist.destroy_process_group()
"""


def test_a_network_defined_in_main_of_python_c_is_planned(tmp_path):
    """Its class cannot be unpickled anywhere else: planning must not need to."""
    from tests.conftest import subprocess_env

    init = f"file://{tmp_path}/init"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", IN_MAIN, str(rank), "2", init],
            env=subprocess_env(OMP_NUM_THREADS="1"),  # as torchrun starts several ranks
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    try:
        outputs = [rank.communicate(timeout=240) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        lines = dict(line.split(" [", 1) for line in out.splitlines() if " [" in line)
        assert lines["parallel"] == lines["one process"]
