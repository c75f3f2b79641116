"""Training packages: steps run by a Session give the losses single-process torch training gives.

Each case builds a training step for a transformers model (small config, random weights) with
an optimizer, runs five steps on batches the build never saw, and compares every step's loss
with the same model trained by torch in this process from the same weights and data. A loss
depends on every earlier update of every weight, so equal losses over five steps check the
gradients, their exchange between replicas and the optimizer's update together.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file as save_file_st

import tessel
from tessel.capture import capture_training
from tessel.config.cluster import cluster_from_dict, local_cluster_dict
from tessel.config.errors import ConfigError
from tessel.plan import has_rule
from tessel.report import format_plan
from tessel.runtime.session import WorkerError

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 5
FACTOR = 0.75  # tight devices hold this share of replicated weights, gradients and moments
# the solver stops here with the best plan found: any plan it returns is run and checked, and
# these tests judge correctness, not the plan's speed (a tight joint graph takes ~10 s to prove)
TIME_LIMIT = 2.0


def _llama(layers: int = 2, hidden: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def _gpt2() -> torch.nn.Module:  # tied embeddings, Conv1D, GELU, LayerNorm
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def _mixtral() -> torch.nn.Module:  # mixture of experts, top-2 routing
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return MixtralForCausalLM(cfg)


MODELS = {"llama": _llama, "gpt2": _gpt2, "mixtral": _mixtral}
# A router's top-k choice is discrete: where the k-th and (k+1)-th experts' probabilities of a
# token are closer than float32 rounding, any reassociated sum (a tensor-parallel partial sum, a
# gathered matmul) may pick the other expert, and the losses part by ~1e-4 with no wrong
# gradient. The Mixtral's seed gives the reference no such near-tie in five steps (smallest
# margin 1.3e-4; seed 0 has 2.1e-6 at step 3); _torch_losses checks it stays so.
SEEDS = {"mixtral": 11}
ROUTER_MARGIN = 5e-5  # 25x the margin a tp-4 plan's partial sums were seen to flip


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(SEEDS.get(name, 0))
    return MODELS[name]()


def _batches(n: int = STEPS, batch: int = BATCH, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _policy(tmp_path, dp: int, tp: int, sharding: tuple[str, ...] = (), pp: int = 1) -> str:
    g: dict = {"auto": False, "tensor_parallel_option": {"tensor_parallel_size": tp}}
    if dp > 1:
        g["data_parallel_option"] = {"data_parallel_size": dp}
    if pp > 1:
        g["pipeline_parallel_option"] = {"pipe_stage_num": pp}
    if sharding:
        g["tensor_sharding"] = {k: True for k in sharding}
    path = tmp_path / "parallel_option.json"
    path.write_text(json.dumps({"graph_parallel_option": g}))
    return str(path)


def _tight(model: torch.nn.Module, devices: int) -> dict:
    """Devices that hold a model's weights, gradients and Adam states only when sharded."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    data = local_cluster_dict(devices)
    data["item_def"][0]["memory"] = f"[DDR:{int(4 * weights * FACTOR)}B]"
    return data


def _router_margins(model: torch.nn.Module) -> list[float]:
    """Watches the model's top-k routers: each forward appends the smallest gap, over its
    tokens, between the k-th and (k+1)-th expert probabilities (the choice's distance from a
    tie) to the returned list."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    margins: list[float] = []

    def hook(router, args, out) -> None:
        probs = torch.softmax(out[0].detach().float(), dim=-1).sort(dim=-1, descending=True)[0]
        margins.append(float((probs[:, router.top_k - 1] - probs[:, router.top_k]).min()))

    for module in model.modules():
        if isinstance(module, MixtralTopKRouter):
            module.register_forward_hook(hook)
    return margins


def _torch_losses(model, make_optimizer, batches, schedule=None) -> list[float]:
    opt = make_optimizer(model)
    margins = _router_margins(model)
    losses = []
    for i, b in enumerate(batches):
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule(i)
        opt.zero_grad()
        loss = model(**b).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        # a near-tie would make the comparison test float rounding, not the build
        assert not margins or min(margins) >= ROUTER_MARGIN, (
            f"the reference's routing is a near-tie at step {i} (top-k probability margin "
            f"{min(margins):.2e} < {ROUTER_MARGIN}): choose a seed without one (SEEDS)"
        )
    return losses


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _session(sessions: dict, devices: int) -> tessel.Session:
    if devices not in sessions:
        sessions[devices] = tessel.Session()
    return sessions[devices]


def _run(sessions, path, batches, options=None, schedule=None, stats=None) -> list[float]:
    """Load a training package on the module's session for its device count (its workers
    reused), run a step per batch, unload it; returns the losses (and fills `stats` with the
    steps' statistics)."""
    from tessel.package.format import Package

    session = _session(sessions, Package.open(path).world_size)
    session.load_graph(0, {"ge.graphRunMode": "1", **(options or {})}, path)
    try:
        losses = []
        for i, b in enumerate(batches):
            if schedule is not None and i > 0:
                session.set_learning_rate(0, schedule(i))
            (loss,) = session.run_graph(0, b)
            assert loss.dim() == 0
            losses.append(loss.item())
        if stats is not None:
            stats.update(session.training_stats(0))
        return losses
    finally:
        session.remove_graph(0)


# (model, devices, pp, dp, tp, tensor sharding, tight memory), beside the product of models,
# meshes and levels in test_product.py: devices too small for replicated weights, 3 devices
# (shards that do not divide) and pipeline stages of tensor-parallel ranks
CASES = [
    ("llama", 2, 1, 1, 2, (), True),
    ("llama", 4, 1, 2, 2, ("optimizer_state_sharding", "gradient_sharding"), True),
    ("llama", 3, 1, 3, 1, ("optimizer_state_sharding",), False),
    ("llama", 4, 2, 1, 2, (), False),
    ("gpt2", 2, 1, 1, 2, (), True),
    ("gpt2", 4, 2, 1, 2, (), False),
]


def case_id(name, devices, pp, dp, tp, sharding, tight) -> str:
    mesh = f"{f'pp{pp}x' if pp > 1 else ''}dp{dp}xtp{tp}"
    return f"{name}-{devices}dev-{mesh}-{'+'.join(sharding) or 'none'}{'-tight' if tight else ''}"


@pytest.mark.parametrize(
    "name,devices,pp,dp,tp,sharding,tight", CASES, ids=[case_id(*c) for c in CASES]
)
def test_steps_equal_torch_training(name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path):
    check_steps(name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path)


def check_steps(name, devices, pp, dp, tp, sharding, tight, sessions, tmp_path) -> None:
    """Five AdamW steps of a package built for the mesh and levels give torch's losses."""
    model = _model(name)
    reference = copy.deepcopy(model)
    batches = _batches(batch=BATCH if devices != 3 else 3)
    cluster = _tight(model, devices) if tight else devices
    built = tessel.build(
        model,
        _batches(1, batches[0]["input_ids"].shape[0], seed=9)[0],
        cluster=cluster,
        policy=_policy(tmp_path, dp, tp, sharding, pp),
        optimizer=_adamw(model),
        time_limit=TIME_LIMIT,
    )
    training, mesh = built.manifest.training, built.manifest.mesh  # the step reads the mesh
    assert (mesh.size("pp"), mesh.size("dp"), mesh.tensor_parallel) == (pp, dp, tp)
    # the stages run micro-batches: as many as the stages, where the replica's rows allow
    assert training.micro_batches == (pp if pp > 1 else 1)
    if pp > 1:
        text = format_plan(built.manifest)
        assert f"pipeline: {pp} stages, {pp} micro-batches in a 1F1B schedule" in text, text
        assert all(f"  stage {s}: " in text for s in range(pp)), text
    assert training.optimizer_state_sharding == (dp > 1 and bool(sharding))
    zero3 = dp > 1 and "model_weight_sharding" in sharding
    assert training.gradient_sharding == (dp > 1 and "gradient_sharding" in sharding or zero3)
    assert training.weight_sharding == zero3
    # with prefetch, the buffer holds the largest gathered layer (the policy names no size)
    assert (training.weight_prefetch_bytes > 0) == ("model_weight_prefetch" in sharding)
    placements = [p for layout in built.manifest.plan.layers.values() for p in layout.values()]
    if tight:  # the weights had to be sharded to fit
        assert any(any(s.startswith("S") for s in p) for p in placements), placements
    # the planner offers only what DTensor's dispatch runs (partial gradients over replicas
    # and shards are made by the lowering; of a rule's outputs for one input placement, only
    # the one dispatch picks): every op runs as planned and nothing is planned again
    dropped = [r for r in built.manifest.plan.replanned if r.node != "(memory)"]
    assert not dropped, dropped
    stats: dict = {}
    got = _run(sessions, built.save(tmp_path / "train"), batches, stats=stats)
    want = _torch_losses(reference, _adamw, batches)
    assert got == pytest.approx(want, abs=1e-4), (got, want)
    # layers were fetched ahead, never more than the buffer at once
    assert stats["prefetch_bytes"] == training.weight_prefetch_bytes
    fetched_ahead = 0 < stats["prefetch_peak_bytes"] <= stats["prefetch_bytes"]
    assert fetched_ahead == (training.weight_prefetch_bytes > 0)


def test_optimizer_offload_updates_host_copies_as_torch_does(tmp_path):
    # the path an accelerator rank takes (its states in host memory), run here in this
    # process with the host standing for both: the optimizer updates copies, not the weights
    from tessel.package.format import Package
    from tessel.runtime.loader import load_rank
    from tessel.runtime.step import TrainingStep

    model = _model("llama")
    reference = copy.deepcopy(model)
    batches = _batches(3)
    policy = tmp_path / "p.json"
    policy.write_text(
        json.dumps({"graph_parallel_option": {"optimizer_offload_option": {"offload": "cpu"}}})
    )
    built = _build(model, tmp_path, cluster=1, policy=str(policy))
    assert "nothing moves" in format_plan(built.manifest)
    package = Package.open(built.save(tmp_path / "train"))
    program, weights = load_rank(package, 0, torch.device("cpu"), {})
    step = TrainingStep(package.manifest, 0, weights, None, program, offload=torch.device("cpu"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert step.updated[name][0].data_ptr() != step.on_device[name].data_ptr()
    got = [step.run([b["input_ids"], b["labels"]]).item() for b in batches]
    opt = _adamw(reference)
    assert got == pytest.approx(_torch_losses(reference, lambda m: opt, batches), abs=1e-4)
    state = step.state_dict([name, f"optimizer.exp_avg.{name}"])
    param = dict(reference.named_parameters())[name]
    assert torch.allclose(state[name], param.detach(), atol=1e-5)
    assert torch.allclose(
        state[f"optimizer.exp_avg.{name}"], opt.state[param]["exp_avg"], atol=1e-5
    )


def test_a_deep_model_lowered_from_copies_of_one_layer_trains_as_torch(
    sessions, tmp_path, monkeypatch
):
    # six layers: the forward and the backward pass of the identical ones are each traced
    # twice and copied for the rest (lowering's stitching), on two tensor-parallel ranks
    from tessel.capture.layers import MIN_LAYERS
    from tessel.lower.stitch import Stitcher

    stitched: list[int] = []  # per stitched rank, how many runs of layers were copied
    stitch = Stitcher.stitch

    def recorded(self, graph):
        stitch(self, graph)
        stitched.append(sum(len(run.layers) >= MIN_LAYERS for run in self.runs))

    monkeypatch.setattr(Stitcher, "stitch", recorded)
    torch.manual_seed(0)
    model = _llama(layers=6, hidden=32)
    reference = copy.deepcopy(model)
    batches = _batches()
    built = _build(model, tmp_path, batch=batches[0], policy=_policy(tmp_path, 1, 2))
    assert stitched and min(stitched) >= 2, stitched  # the forward and the backward
    got = _run(sessions, built.save(tmp_path / "train"), batches)
    assert got == pytest.approx(_torch_losses(reference, _adamw, batches), abs=1e-4)


def test_a_global_batch_larger_than_the_example_is_what_a_step_takes(sessions, tmp_path):
    # the policy's global_batch_size: each of 2 replicas runs 2 micro-batches of 2 rows
    model = _model("llama")
    reference = copy.deepcopy(model)
    policy = tmp_path / "p.json"
    policy.write_text(
        json.dumps(
            {
                "graph_parallel_option": {
                    "auto": False,
                    "global_batch_size": 8,
                    "data_parallel_option": {"data_parallel_size": 2},
                    "pipeline_parallel_option": {"pipe_stage_num": 2},
                }
            }
        )
    )
    built = _build(model, tmp_path, policy=str(policy), cluster=4)  # an example of 4 rows
    assert [spec.shape[0] for spec in built.manifest.inputs] == [8, 8]
    batches = _batches(2, batch=8)
    got = _run(sessions, built.save(tmp_path / "train"), batches)
    assert got == pytest.approx(_torch_losses(reference, _adamw, batches), abs=1e-4)


def test_three_pipeline_stages_on_three_devices(sessions, tmp_path):
    # a middle stage receives activations and sends gradients both ways; 3 micro-batches
    torch.manual_seed(0)
    model = _llama(layers=3, hidden=32)
    reference = copy.deepcopy(model)
    batches = _batches(batch=3)
    built = tessel.build(
        model,
        _batches(1, 3, seed=9)[0],
        cluster=3,
        policy=_policy(tmp_path, 1, 1, pp=3),
        optimizer=_adamw(model),
        time_limit=TIME_LIMIT,
    )
    assert (built.manifest.mesh.size("pp"), built.manifest.training.micro_batches) == (3, 3)
    got = _run(sessions, built.save(tmp_path / "train"), batches)
    assert got == pytest.approx(_torch_losses(reference, _adamw, batches), abs=1e-4)


def test_sgd_with_momentum_param_groups_and_a_schedule(sessions, tmp_path):
    # data parallel without sharding; the first step's rate from the load option, the others
    # set between steps
    model = _model("llama")
    reference = copy.deepcopy(model)

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in m.named_parameters() if n.endswith("proj.weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("proj.weight")]
        return torch.optim.SGD(
            [{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 0.2}],
            lr=0.1,
            momentum=0.9,
            nesterov=True,
        )

    def schedule(step: int) -> float:
        return 0.1 * (0.5**step)

    batches = _batches()
    built = tessel.build(
        model,
        batches[0],
        cluster=2,
        policy=_policy(tmp_path, 2, 1),
        optimizer=sgd(model),
        time_limit=TIME_LIMIT,
    )
    groups = built.manifest.training.optimizer["param_groups"]
    assert [g["lr"] for g in groups] == [0.1, 0.2] and groups[0]["nesterov"] is True
    got = _run(
        sessions,
        built.save(tmp_path / "sgd"),
        batches,
        {"tessel.learning_rate": schedule(0)},
        schedule,
    )
    assert got == pytest.approx(_torch_losses(reference, sgd, batches, schedule), abs=1e-4)


def test_gradients_are_placed_like_their_weights():
    model = _model("llama")
    captured = capture_training(model, _batches(1)[0], keep=has_rule)
    out = next(n for n in captured.program.graph.nodes if n.op == "output")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(out.args[0]) == 1 + len(names)
    for node, name in zip(out.args[0][1:], names):
        assert tuple(node.meta["val"].shape) == tuple(model.get_parameter(name).shape)


class _SquaredLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean()


def test_a_capture_offered_for_reuse_is_taken_only_for_that_model_on_equal_inputs():
    """Planning a job weighs each data-parallel size on its captured replica step; the build
    then takes the chosen size's capture instead of exporting it again (the packages are the
    same), but only for the same model object on equal inputs, and only within the context."""
    from tessel.capture.export import training_capture_reused
    from tessel.capture.training import gradient_outputs

    torch.manual_seed(0)
    model, x = _SquaredLoss(), torch.randn(4, 4)
    first = capture_training(model, (x,), keep=has_rule, held_factor=3.0)
    with training_capture_reused(model, has_rule, (x,), {}, first):
        again = capture_training(model, (x.clone(),), keep=has_rule, held_factor=2.0)
        assert again is first
        # what the memory model holds per weight byte is the later caller's
        assert gradient_outputs(first.program.graph_module.graph).held_factor == 2.0
        for other, inputs, keep in (
            (model, (x + 1,), has_rule),  # other values
            (model, (x[:2],), has_rule),  # other rows
            (model, (x,), None),  # other ops kept whole
            (_SquaredLoss(), (x,), has_rule),  # another model
        ):
            assert capture_training(other, inputs, keep=keep) is not first
    assert capture_training(model, (x,), keep=has_rule) is not first


# ---- bad input: each refused with tessel's own error naming what is wrong


def _build(model, tmp_path, optimizer=None, batch=None, policy=None, cluster=2, **kw):
    batch = batch if batch is not None else _batches(1)[0]
    return tessel.build(
        model,
        batch,
        cluster=cluster,
        policy=policy,
        optimizer=optimizer if optimizer is not None else _adamw(model),
        **{"time_limit": TIME_LIMIT, **kw},
    )


def test_a_forward_without_a_scalar_loss_is_refused(tmp_path):
    model = _model("llama")
    with pytest.raises(ConfigError, match=r"needs the forward to return a scalar loss.*found"):
        _build(model, tmp_path, batch={"input_ids": _batches(1)[0]["input_ids"]})


def test_an_optimizer_tessel_does_not_take_is_refused_with_the_list(tmp_path):
    model = _model("llama")
    with pytest.raises(
        ConfigError,
        match=r"RMSprop; tessel takes torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW",
    ):
        _build(model, tmp_path, optimizer=torch.optim.RMSprop(model.parameters()))


def test_an_optimizer_missing_weights_is_refused(tmp_path):
    model = _model("llama")
    some = list(model.parameters())[:3]
    with pytest.raises(ConfigError, match=r"leaves \d+ trainable weights out"):
        _build(model, tmp_path, optimizer=torch.optim.Adam(some))


def test_weight_dtypes_a_step_does_not_take_are_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.embed_tokens.weight: is float16: a training step takes float32 or bfloat16",
    ):
        _build(_model("llama").half(), tmp_path)
    mixed = _model("llama")
    mixed.lm_head.to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"trains weights of several dtypes \(bfloat16, float32"):
        _build(mixed, tmp_path)
    with pytest.raises(ConfigError, match=r"param_dtype: is 'float16'; a training step computes"):
        _build(_model("llama"), tmp_path, param_dtype="float16")
    with pytest.raises(ConfigError, match=r"param_dtype: is taken with optimizer="):
        tessel.build(_model("llama"), _batches(1)[0], cluster=2, param_dtype=torch.bfloat16)


def _mixed_precision_losses(model: torch.nn.Module, batches) -> list[float]:
    """torch's mixed precision: bf16 forward and backward on a copy of the fp32 master
    weights, fp32 gradients into AdamW over the master, the copy refreshed after each step."""
    work = copy.deepcopy(model).to(torch.bfloat16)
    opt = _adamw(model)
    losses = []
    for b in batches:
        loss = work(**b).loss
        loss.backward()
        for master, p in zip(model.parameters(), work.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for master, p in zip(model.parameters(), work.parameters()):
                p.copy_(master)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "name,dp,tp,sharding,given",
    [
        ("gpt2", 1, 2, (), "param_dtype"),  # tied, tensor parallel, fp32 model built as bf16
        ("llama", 2, 1, ("model_weight_sharding",), "bf16 model"),  # gathered in bf16
    ],
)
def test_bf16_steps_over_fp32_master_weights_equal_torch_mixed_precision(
    name, dp, tp, sharding, given, sessions, tmp_path
):
    model = _model(name)
    reference = copy.deepcopy(model)
    batches = _batches()
    batches = [batches[0]] * 2 + batches[1:4]  # a batch seen twice: its loss must fall
    built = tessel.build(
        model.to(torch.bfloat16) if given == "bf16 model" else model,
        _batches(1, seed=9)[0],
        cluster=dp * tp,
        policy=_policy(tmp_path, dp, tp, sharding),
        optimizer=_adamw(model),
        param_dtype=torch.bfloat16 if given == "param_dtype" else None,
        time_limit=TIME_LIMIT,
    )
    assert built.manifest.training.compute_dtype == "bfloat16"
    got = _run(sessions, built.save(tmp_path / "bf16"), batches)
    if given == "bf16 model":  # the master weights start from the bf16 ones
        reference.to(torch.bfloat16).float()
    want = _mixed_precision_losses(reference, batches)
    assert want[1] < want[0] - 0.05  # sensitive to the update
    # bf16 products summed in other orders: the losses agree to bf16's precision
    assert got == pytest.approx(want, abs=2e-2), (got, want)


def test_random_dropout_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match=r"Dropout with p=0.1 in training mode"):
        _build(model, tmp_path)


@pytest.mark.parametrize(
    "inner, words",
    [
        (
            {"tensor_sharding": {"model_weight_prefetch": True}},
            "tensor_sharding.model_weight_prefetch: fetches sharded weights ahead, but "
            "model_weight_sharding is off",
        ),
        (
            {"pipeline_parallel_option": {"pipe_stage_num": 2, "micro_batch_num": 3}},
            "micro_batch_num: is 3, but the example inputs' first dimensions are ['4']",
        ),
        (
            {"data_parallel_option": {"data_parallel_size": 2}, "global_batch_size": 12},
            "global_batch_size: is 12: it must split into 2 equal parts (data_parallel_size 2 x "
            "micro_batch_num 1) and the example batch, of 4 rows, must hold one of them (6 rows)",
        ),
    ],
)
def test_training_settings_refused(inner, words, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"graph_parallel_option": inner}))
    with pytest.raises(ConfigError) as err:
        _build(_model("llama"), tmp_path, policy=str(path))
    assert str(path) in str(err.value) and words in str(err.value)


def test_a_prefetch_buffer_smaller_than_a_layer_is_refused_with_both_sizes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # one layer of 256 x 1024: 4 MiB of weights and its norms, gathered whole by each replica
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    mb = -(-layer // 2**20)
    sharding = {"model_weight_sharding": True, "model_weight_prefetch": True}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"graph_parallel_option": {
        "data_parallel_option": {"data_parallel_size": 2},
        "tensor_sharding": {**sharding, "model_weight_prefetch_buffer_size": 2},
    }}))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        _build(model, tmp_path, policy=str(path))
    message = str(err.value)
    assert str(path) in message and "model_weight_prefetch_buffer_size: is 2 MB" in message
    assert f"largest layer's gathered weights on one device ({layer} bytes, {mb} MB)" in message
    path.write_text(json.dumps({"graph_parallel_option": {
        "data_parallel_option": {"data_parallel_size": 2},
        "tensor_sharding": {**sharding, "model_weight_prefetch_buffer_size": mb},
    }}))  # fmt: skip
    built = _build(model, tmp_path, policy=str(path))
    assert built.manifest.training.weight_prefetch_bytes == mb * 2**20
    assert f"the next fetched ahead within {mb * 2**20} bytes" in format_plan(built.manifest)


def test_an_inference_build_refuses_training_settings(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({"graph_parallel_option": {"tensor_sharding": {"gradient_sharding": True}}})
    )
    model = _model("llama")
    with pytest.raises(ConfigError, match=r"gradient_sharding: is a training setting"):
        tessel.build(model, _batches(1)[0], cluster=2, policy=str(path))


def test_run_mode_and_training_calls_must_match_the_package(sessions, tmp_path):
    model = _model("llama")
    batch = _batches(1)[0]
    training = _build(model, tmp_path, cluster=1).save(tmp_path / "t")
    inference = tessel.build(
        _model("llama"),
        {"input_ids": batch["input_ids"], "use_cache": False},
        cluster=1,
        verify=False,
    ).save(tmp_path / "i")
    session = _session(sessions, 1)
    tessel.initialize({"ge.graphRunMode": "0"})  # GEInitialize's config, as a user gives it
    try:
        with pytest.raises(
            ConfigError,
            match=r"ge.graphRunMode: is 0 \(inference\), but .* holds a training model",
        ):
            session.load_graph(0, {}, training)
    finally:
        tessel.initialize()
    with pytest.raises(ConfigError, match=r"is 1 \(training\), but .* holds an inference model"):
        session.load_graph(0, {"ge.graphRunMode": 1}, inference)
    with pytest.raises(ConfigError, match=r"allowed: 0 \(inference\), 1 \(training\)"):
        session.load_graph(0, {"ge.graphRunMode": "train"}, training)
    with pytest.raises(ConfigError, match=r"tessel.learning_rate: found -1"):
        session.load_graph(0, {"ge.graphRunMode": 1, "tessel.learning_rate": -1}, training)
    with pytest.raises(ConfigError, match=r"is not a training package"):
        session.load_graph(0, {"tessel.learning_rate": 0.1}, inference)
    with pytest.raises(ConfigError, match=r"checkpoint: .* is not a training package"):
        session.load_graph(0, {"checkpoint": str(tmp_path)}, inference)
    session.load_graph(0, {}, inference)
    try:
        with pytest.raises(ConfigError, match=r"graph 0 is not a training package"):
            session.save_checkpoint(0, tmp_path / "ckpt")
        with pytest.raises(ConfigError, match=r"graph 0 is not a training package"):
            session.set_learning_rate(0, 0.1)
    finally:
        session.remove_graph(0)


def test_training_cluster_helper_is_too_small_for_replicated_states():
    model = _model("llama")
    cluster = cluster_from_dict(_tight(model, 2), "tight.json")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert cluster.devices[0].memory_bytes < 4 * weights  # weights, gradients, two moments


def _adamw_slow(model: torch.nn.Module) -> torch.optim.Optimizer:
    # a small rate: Adam moves a weight whose gradient is rounding noise by the whole rate, so
    # the weights' agreement is bounded by it
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def test_checkpoint_saved_resumed_in_another_layout_and_unified(sessions, tmp_path):
    model = _model("llama")
    reference = copy.deepcopy(model)
    batches = _batches()
    for d in "abc":
        (tmp_path / d).mkdir()
    zero2 = tessel.build(
        model,
        batches[0],
        cluster=4,
        policy=_policy(tmp_path / "a", 2, 2, ("gradient_sharding",)),
        optimizer=_adamw_slow(model),
        time_limit=TIME_LIMIT,
    ).save(tmp_path / "zero2")
    zero3 = tessel.build(
        model,
        batches[0],
        cluster=2,
        policy=_policy(tmp_path / "b", 2, 1, ("model_weight_sharding", "model_weight_prefetch")),
        optimizer=_adamw_slow(model),
        time_limit=TIME_LIMIT,
    ).save(tmp_path / "zero3")
    stages = tessel.build(
        model,
        batches[0],
        cluster=2,
        policy=_policy(tmp_path / "c", 1, 1, pp=2),
        optimizer=_adamw_slow(model),
        time_limit=TIME_LIMIT,
    ).save(tmp_path / "stages")
    four, two = _session(sessions, 4), _session(sessions, 2)
    four.load_graph(0, {}, zero2)
    try:
        got = [four.run_graph(0, b)[0].item() for b in batches[:3]]
        four.save_checkpoint(0, tmp_path / "step_3")
    finally:
        four.remove_graph(0)
    # on into pipeline stages for a step, and out of them for the last
    two.load_graph(0, {"checkpoint": str(tmp_path / "step_3")}, stages)
    try:
        got.append(two.run_graph(0, batches[3])[0].item())
        two.save_checkpoint(0, tmp_path / "step_4")
    finally:
        two.remove_graph(0)
    two.load_graph(0, {"checkpoint": str(tmp_path / "step_4")}, zero3)
    try:
        got += [two.run_graph(0, b)[0].item() for b in batches[4:]]
        two.save_checkpoint(0, tmp_path / "ckpt" / "step_5")  # its parent is made
        with pytest.raises(ConfigError, match=r"is not a training checkpoint"):
            two.load_graph(1, {"checkpoint": str(tmp_path / "nowhere")}, zero3)
    finally:
        two.remove_graph(0)
    opt = _adamw_slow(reference)
    want = _torch_losses(reference, lambda m: opt, batches)
    assert got == pytest.approx(want, abs=1e-4)

    saved = tmp_path / "ckpt" / "step_5"
    assert sorted(p.name for p in saved.iterdir()) == [
        "config.json", "generation_config.json", "model_state_dict.json", "rank_0", "rank_1",
        "strategy.json",
    ]  # fmt: skip
    check_unified_checkpoint(saved, tmp_path / "out" / "hf", model, reference, opt)


def check_unified_checkpoint(saved, hf, model, reference, opt) -> None:
    """`tessel ckpt unify SRC DST`, with no other argument, writes what `from_pretrained` loads
    whole: the model's weights as the checkpoint's rank files hold them, its config; the
    optimizer states only with --optimizer-states."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tessel.cli import main as cli
    from tessel.parallel import load_distributed_checkpoint

    assert cli(["ckpt", "unify", str(saved), str(hf)]) == 0
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]  # fmt: skip
    loaded, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert type(loaded) is type(model)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    assert set(load_file(hf / "model-00001-of-00001.safetensors")) == set(model.state_dict())
    # the weights as the rank files hold them, read by the checkpoint tools, not by unify
    stored = copy.deepcopy(model)
    load_distributed_checkpoint(stored, str(saved), strict_load=True)
    for name, value in stored.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = _batches(1, seed=7)[0]["input_ids"]
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.allclose(logits, stored(ids).logits, rtol=0, atol=1e-5)
        assert torch.allclose(logits, reference(ids).logits, rtol=0, atol=1e-3)

    states = hf.parent / "optimizer"
    code = cli(["ckpt", "unify", str(saved), str(hf), "--optimizer-states", str(states),
                "--overwrite", "--no-progress"])  # fmt: skip
    assert code == 0
    unified = {}
    for f in states.glob("*.safetensors"):
        unified.update(load_file(f))
    assert unified["optimizer.step"].item() == STEPS
    for name, p in reference.named_parameters():
        state = opt.state[p]
        assert torch.allclose(loaded.get_parameter(name), p.detach(), atol=1e-4), name
        assert torch.allclose(unified[f"optimizer.exp_avg.{name}"], state["exp_avg"], atol=1e-4)
        assert torch.allclose(
            unified[f"optimizer.exp_avg_sq.{name}"], state["exp_avg_sq"], atol=1e-4
        )
    assert len(unified) == 1 + 2 * len(list(reference.parameters()))


def test_unify_without_a_strategy_names_the_flag(tmp_path, capsys):
    """A checkpoint directory without strategy.json needs the flag, and the error says which."""
    from tessel.cli import main as cli

    src = tmp_path / "ckpt"
    for r in (0, 1):
        (src / f"rank_{r}").mkdir(parents=True)
        save_file_st({"w": torch.zeros(2, 2)}, src / f"rank_{r}" / f"checkpoint_{r}.safetensors")
    assert cli(["ckpt", "unify", str(src), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--strategy: is needed" in err and "no strategy.json" in err, err
    assert "src_strategy_file" not in err
    assert cli(["ckpt", "convert", str(src), str(tmp_path / "c")]) == 2
    assert "--src-strategy: is needed" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "c").exists()


def test_cli_builds_a_training_step_from_a_model_function(tmp_path, capsys):
    from tessel.cli import main as cli

    (tmp_path / "train.py").write_text(
        "import torch\n"
        "from tests.training.test_training import _model, _batches, _adamw\n"
        "def step():\n"
        "    model = _model('llama')\n"
        "    return model, _batches(1)[0], _adamw(model)\n"
    )
    (tmp_path / "policy").mkdir()
    policy = _policy(tmp_path / "policy", 2, 1, ("optimizer_state_sharding",))
    (tmp_path / "numa.json").write_text(json.dumps(local_cluster_dict(2)))
    out = tmp_path / "out" / "llama_train"
    code = cli(
        ["build", f"--model={tmp_path / 'train.py'}:step", "--distributed_cluster_build=1",
         f"--cluster_config={tmp_path / 'numa.json'}", "--enable_graph_parallel=1",
         f"--graph_parallel_option_path={policy}", "--soc_version=cpu", f"--output={out}",
         "--param_dtype=bfloat16"]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    assert cli(["inspect", f"{out}.tessel"]) == 0
    text = capsys.readouterr().out
    assert "offline model: training, 2 devices" in text
    assert (
        "training step: AdamW (1 parameter groups); sharding: optimizer states sharded over dp 2"
        in text
    )
    assert "precision: bfloat16 compute over fp32 master weights" in text


def test_auto_chooses_the_least_sharding_that_fits(sessions, tmp_path):
    # devices hold 3/4 of replicated weights, gradients and moments: the policy names no
    # tensor_sharding, so the planner weighs the levels from none up and takes one that fits
    model = _model("llama")
    reference = copy.deepcopy(model)
    batches = _batches()
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"graph_parallel_option": {
        "auto": True, "data_parallel_option": {"data_parallel_size": 2}}}))  # fmt: skip
    built = _build(model, tmp_path, policy=str(policy), cluster=_tight(model, 2))
    weighed = built.manifest.plan.training.levels_weighed
    assert weighed[0].startswith("no sharding: does not fit"), weighed
    assert weighed[-1].endswith("chosen, the least sharding that fits"), weighed
    assert built.manifest.training.optimizer_state_sharding
    assert "sharding level weighed (auto): no sharding: does not fit" in format_plan(built.manifest)
    got = _run(sessions, built.save(tmp_path / "auto"), batches)
    assert got == pytest.approx(_torch_losses(reference, _adamw, batches), abs=1e-4)


def test_a_dead_or_hung_worker_fails_the_step_saying_the_state_is_lost(sessions, tmp_path):
    import os
    import signal

    model = _model("llama")
    path = tessel.build(
        model,
        _batches(1)[0],
        cluster=2,
        policy=_policy(tmp_path, 2, 1, ("model_weight_sharding", "model_weight_prefetch")),
        optimizer=_adamw(model),
        time_limit=TIME_LIMIT,
    ).save(tmp_path / "zero3")
    batch = _batches(1)[0]
    lost = "the training step failed, so the weights and optimizer states on the devices are lost"
    deadline = 3.0
    with tessel.Session() as session:
        session.load_graph(0, {"ge.graphRunMode": "1"}, path)
        session.run_graph(0, batch)
        procs = list(session._graphs[0].procs)
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(
            tessel.WorkerError, match=rf"rank 1 died of SIGKILL \(exit code -9\); {lost}"
        ):
            session.run_graph(0, batch)
        assert not any(p.is_alive() for p in procs)
        session.remove_graph(0)

        session.load_graph(0, {"ge.graphRunMode": "1", "tessel.run_timeout_s": deadline}, path)
        session.run_graph(0, batch)
        procs = list(session._graphs[0].procs)
        os.kill(procs[1].pid, signal.SIGSTOP)  # stopped between steps: rank 0 waits on it
        with pytest.raises(
            tessel.WorkerError, match=rf"no answer from ranks \[0\] in time; {lost}"
        ):
            session.run_graph(0, batch)
        assert not any(p.is_alive() for p in procs)


def _tampered(source, target, rank: int, edit) -> str:
    """A copy of checkpoint `source` whose rank `rank` file `edit` rewrote (`edit` takes the
    file's tensors and returns new ones, kept with the file's metadata, the checkpoint's id
    among it; or bytes for the whole file)."""
    from safetensors.torch import load_file, save_file

    from tessel.checkpoint.st_io import read_header

    shutil.copytree(source, target)
    path = target / f"rank_{rank}" / f"checkpoint_{rank}.safetensors"
    edited = edit(load_file(path))
    if isinstance(edited, bytes):
        path.write_bytes(edited)
    else:
        save_file(edited, path, read_header(path)[1])
    return str(target)


def test_a_checkpoint_that_does_not_match_the_step_is_refused_naming_file_and_tensor(
    sessions, tmp_path
):
    """Resuming takes every tensor the step needs with its shape and dtype, or fails before a
    step naming the file and the tensor; nothing is taken as near enough."""
    model = _model("llama")
    path = _build(model, tmp_path).save(tmp_path / "step")
    session = _session(sessions, 2)
    session.load_graph(0, {}, path)
    try:
        session.run_graph(0, _batches(1)[0])
        session.save_checkpoint(0, tmp_path / "saved")
    finally:
        session.remove_graph(0)
    saved = tmp_path / "saved"
    weight = "model.layers.0.mlp.up_proj.weight"

    def dropped(t):
        return {k: v for k, v in t.items() if k != weight}

    def halved(t):
        return {**t, weight: t[weight].to(torch.bfloat16)}

    def reshaped(t):
        return {**t, weight: t[weight].reshape(t[weight].shape[1], t[weight].shape[0])}

    def no_state(t):
        return {k: v for k, v in t.items() if k != f"optimizer.exp_avg.{weight}"}

    def truncated(t):
        return (saved / "rank_1" / "checkpoint_1.safetensors").read_bytes()[:100]

    cases = {
        "missing": (dropped, f"{weight}: missing"),
        "dtype": (halved, f"{weight}: is bfloat16"),
        "shape": (reshaped, f"{weight}: is float32["),
        "state": (no_state, f"optimizer.exp_avg.{weight}: missing"),
        "truncated": (truncated, "checkpoint_1.safetensors: not a readable safetensors file"),
    }
    # every case as the worker's check reads it, against what rank 1 saved (every tensor it
    # holds, with its shape and dtype)
    from safetensors.torch import load_file

    from tessel.checkpoint.errors import CheckpointError
    from tessel.runtime.worker import _checkpoint_tensors

    layout = {
        k: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for k, t in load_file(saved / "rank_1" / "checkpoint_1.safetensors").items()
    }
    for case, (edit, words) in cases.items():
        target = _tampered(saved, tmp_path / case, 1, edit)
        with pytest.raises(CheckpointError) as refused:
            _checkpoint_tensors(target, 1, torch.device("cpu"), layout)
        message = str(refused.value)
        assert "\n" not in message and "rank_1/checkpoint_1.safetensors" in message, message
        assert words in message, (case, message)
    # and through a session, where each refusal stops the workers (a new pair starts for the
    # next load): a weight's dtype, an optimizer state missing (the step's own list of what it
    # resumes holds the states too). A missing weight and a shape take the dtype's path through
    # the worker (the one comparison above)
    for case in ("dtype", "state"):
        with pytest.raises(WorkerError) as failure:
            session.load_graph(0, {"checkpoint": str(tmp_path / case)}, path)
        message = str(failure.value)
        assert "\n" not in message and "rank_1/checkpoint_1.safetensors" in message, message
        assert cases[case][1] in message, (case, message)
    # a file that is no safetensors, or one of another checkpoint (here one that records none),
    # is refused before any worker reads it
    with pytest.raises(CheckpointError, match=r"rank_1/checkpoint_1.safetensors: .*truncated"):
        session.load_graph(0, {"checkpoint": str(tmp_path / "truncated")}, path)
    mixed = tmp_path / "mixed"
    shutil.copytree(saved, mixed)
    rank_1 = mixed / "rank_1" / "checkpoint_1.safetensors"
    save_file_st(load_file(rank_1), rank_1)
    with pytest.raises(CheckpointError, match=r"rank_1/checkpoint_1.safetensors: records no "
                       r"checkpoint id, but .*rank_0/checkpoint_0.safetensors belongs to "
                       r"checkpoint [0-9a-f]{32}: these files are parts of two checkpoints"):  # fmt: skip
        session.load_graph(0, {"checkpoint": str(mixed)}, path)
    garbage = tmp_path / "garbage"
    shutil.copytree(saved, garbage)
    (garbage / "strategy.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"strategy.json: is not a strategy file's JSON"):
        session.load_graph(0, {"checkpoint": str(garbage)}, path)


def test_a_step_is_estimated_with_its_update_and_its_gradient_exchange(tmp_path, monkeypatch):
    """Beside its program, a step's estimate counts the optimizer's update (AdamW's more than
    SGD's, by the update's own cost) and, over replicas, each unit's gradient all-reduce and
    the loss's."""
    from tessel.config.cluster import local_cluster
    from tessel.plan import cost
    from tessel.plan.planner import device_rates

    x = torch.randn(4, 4)

    def estimate(make, dp: int) -> float:
        torch.manual_seed(0)
        model = _SquaredLoss()
        built = tessel.build(
            model,
            (x,),
            cluster=dp,
            policy=_policy(tmp_path, dp, 1),
            optimizer=make(model.parameters(), lr=0.1),
        )
        return built.manifest.plan.estimated_time_s

    _, bandwidth, dispatch = device_rates(local_cluster(1))
    weights = (2 * 4 + 2) * 4  # lin.weight and lin.bias, fp32
    update = cost.update_time("AdamW", 2, 2, weights, bandwidth, dispatch) - cost.update_time(
        "SGD", 0, 2, weights, bandwidth, dispatch
    )
    assert estimate(torch.optim.AdamW, 1) - estimate(torch.optim.SGD, 1) == pytest.approx(update)
    replicas = local_cluster(2)
    link = cost.Links(replicas.link_bandwidth, replicas.soc.link_latency)
    exchange = cost.all_reduce_time(weights, 2, link) + cost.all_reduce_time(4, 2, link)
    with_exchange = estimate(torch.optim.SGD, 2)
    monkeypatch.setattr(cost, "all_reduce_time", lambda *a: 0.0)
    assert with_exchange - estimate(torch.optim.SGD, 2) == pytest.approx(exchange)
