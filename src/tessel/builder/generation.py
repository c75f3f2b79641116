"""A generation package: the build's recipe (check, capture, fit, pack) for a causal LM's gears.

All gears share one set of weights and one cache on every rank, so one gear's plan places
them and the others are planned with those placements given, only their activations placed
for their own shapes. Where the devices hold the whole model beside the longest prompt's
activations, the decode gear places them (it runs once per new token); where memory binds,
the longest prefill gear does, since it needs the most room beside them. The package stores
the decode gear as each rank's program and the prefill gears beside it; the cache is
declared, never stored. Data-parallel replicas each hold their rows of the cache: the gears
are captured and planned for one replica's share of the batch, and every rank's programs made
from that replica's (`lower/replicas.py`). Pipeline stages each hold their layers' weights and
cache: the gear that places the weights also divides the layers among the stages, the other
gears are cut the same way, and the last stage's ranks end a call with the logits
(`lower/stages.py`), from which its first rank chooses the token every rank feeds next. The
gear that divides the layers must read every weight it divides: an encoder-decoder's decode
gear never reads the encoder, so its longest prefill gear leads there.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace

import torch

from tessel.builder.fit import Fitted, Level, fit
from tessel.builder.packing import input_spec, pack
from tessel.builder.stages import build_gear_stages, stage_lines, stage_planner
from tessel.capture import CapturedModel
from tessel.capture.generation import (
    BATCH_INPUTS,
    GEAR_INPUTS,
    CapturedGears,
    capture_gears,
    is_recurrent,
)
from tessel.config.cluster import ClusterConfig
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.config.mesh import POLICY_KEYS, parallel_dims
from tessel.config.parallel_option import ParallelOption
from tessel.config.sampling import (
    MODEL_SETTINGS,
    SAMPLING_SETTINGS,
    UNSUPPORTED_SETTINGS,
    Setting,
    check_settings_in_range,
)
from tessel.lower.program import RankProgram, groups_in
from tessel.lower.replicas import replica_programs
from tessel.package.format import Manifest
from tessel.package.manifest import Gears, TensorSpec
from tessel.plan import Plan, PlanError, has_rule
from tessel.plan.errors import LeastMemory
from tessel.plan.planner import least_memory_plan
from tessel.progress import phase
from tessel.sharding.placements import placement_str
from tessel.units import human_bytes

log = logging.getLogger(__name__)


def build_generation(
    model: torch.nn.Module,
    generation: Generation,
    cluster: ClusterConfig,
    policy: ParallelOption,
    soc_version: str,
    time_limit: float,
    reuse_layers: bool = True,
) -> tuple[Manifest, dict, dict[str, float]]:
    """The manifest, members and timings of a generation package for `model` (`reuse_layers`
    as `build` takes it: identical layers traced once, in capture and in lowering)."""
    if not isinstance(generation, Generation):
        raise ConfigError(
            "build()",
            "generation",
            f"takes a tessel.Generation, found {type(generation).__name__}",
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            "build()", "model", f"generation captures an nn.Module, found {type(model).__name__}"
        )
    check_model_settings(model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        if 1 in generation.prefill_lengths:
            raise ConfigError(
                "Generation",
                "prefill_lengths",
                f"holds 1 for {type(model).__name__}, an encoder-decoder: its prefill gears "
                "encode a prompt of at least 2 tokens (a 1-token prompt is padded into one)",
            )
        start = getattr(model.config, "decoder_start_token_id", None)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ConfigError(
                "model.config",
                "decoder_start_token_id",
                f"must be a token id for an encoder-decoder's generation, found {start!r}",
            )
    dims = parallel_dims(cluster, policy)
    dp, pp = dims.size("dp"), dims.size("pp")
    if generation.max_batch_size % dp:
        raise ConfigError(
            "Generation",
            "max_batch_size",
            f"is {generation.max_batch_size}, which {dp} data-parallel replicas "
            f"({policy.source}: graph_parallel_option.{POLICY_KEYS['dp']}) cannot share "
            f"evenly; give a multiple of {dp}",
        )
    if generation.row_prefill and (dp > 1 or pp > 1):
        axis = "data-parallel replicas" if dp > 1 else "pipeline stages"
        raise ConfigError(
            "Generation",
            "row_prefill",
            f"is set for {dp if dp > 1 else pp} {axis} ({policy.source}); one-row prefill "
            "gears are built for one replica of one stage; build without row_prefill (a server "
            "then admits requests with the prefill gears of every row)",
        )
    timings: dict[str, float] = {}
    t = time.perf_counter()
    # each replica holds its rows of the cache: the gears are captured at its share
    share = replace(generation, max_batch_size=generation.max_batch_size // dp)
    with phase("capturing the gears"):
        gears = capture_gears(model, share, reuse_layers, keep=has_rule)
    timings["capture"] = time.perf_counter() - t
    options = dict(time_limit=time_limit, reuse_layers=reuse_layers, timings=timings)
    longest = max(gears.prefill)
    ep = gears.decode.program
    whole = sum(
        t.numel() * t.element_size() for t in {id(t): t for t in ep.state_dict.values()}.values()
    )
    smallest = min(d.memory_bytes for d in cluster.devices)
    # the gear that cuts the stages sees every weight it places: an encoder-decoder's decode
    # gear never reads the encoder, so its longest prefill gear cuts them (encoder layers
    # first, then decoder layers), and the decode gear follows
    decode_first = whole / pp <= smallest and (
        pp == 1 or _weights_read(gears.decode) >= _weights_read(gears.prefill[longest])
    )
    reserve = 0
    if decode_first:
        # every gear holds the weights and the cache beside its own activations: the longest
        # prompt's (no shorter prompt's are more), at the least, bound what the weights may
        # take. Where the weights alone overflow a device, memory binds without asking.
        peak, weights = least_memory_plan(
            gears.prefill[longest], dims.size("tp"), enough=smallest - math.ceil(whole / pp)
        )
        reserve = peak - weights
        decode_first = whole / pp + reserve <= smallest

    def fit_gear(
        captured: CapturedModel,
        placed: ParallelOption,
        level: Level,
        leader: Fitted | None,
        explain: bool = True,
    ) -> Fitted:
        """`captured` fitted with `placed`'s placements; with stages, its layers divided among
        them as the `leader` gear's are (the gear that placed the weights), or by the planner
        where it leads. Without `explain`, a gear that does not fit is not told by how much."""
        if pp == 1:
            return fit(captured, cluster, placed, dims, [level], explain=explain, **options)

        def cut(plan: Plan, programs: list[RankProgram]) -> tuple:
            return build_gear_stages(captured, plan, programs, cluster, dims, BATCH_INPUTS)

        stages = (
            stage_planner(captured, cluster, dims, policy.source)
            if leader is None
            else lambda plan: leader.plan.stages
        )
        return fit(
            captured, cluster, placed, dims, [level], stages=stages, cut=cut, explain=explain,
            **options,
        )  # fmt: skip

    prefill: dict[int, Fitted] = {}
    rows: dict[int, Fitted] = {}
    if decode_first:  # memory does not bind: the gear that runs most places the weights
        try:
            level = Level(reserve=reserve + _replicas_bytes(gears.decode, dp))
            # where this fails the longest prompt's gear leads instead: why is not asked
            decode = fit_gear(gears.decode, policy, level, None, explain=False)
            given = _placed_as(decode, policy)
            for n, captured in gears.prefill.items():
                prefill[n] = fit_gear(captured, given, _kept(captured, dp), decode, explain=False)
            for n, captured in gears.rows.items():
                rows[n] = fit_gear(captured, given, _kept(captured, dp), decode, explain=False)
        except PlanError as exc:
            log.info("the decode gear's placements leave a prefill gear no room (%s)", exc)
            decode_first = False
    if not decode_first:
        # memory binds: the longest prompt's gear places the weights and the cache, so the
        # gear that needs the most room fits, and the others follow it
        try:
            first = fit_gear(
                gears.prefill[longest], policy, _kept(gears.prefill[longest], dp), None
            )
        except PlanError as exc:
            fits = _what_would_fit(share, exc.least, dp, not is_recurrent(gears.cache_names))
            raise PlanError(f"{exc}{fits}", exc.least) from None
        given = _placed_as(first, policy)
        decode = fit_gear(gears.decode, given, _kept(gears.decode, dp), first)
        prefill = {
            n: first if n == longest else fit_gear(captured, given, _kept(captured, dp), first)
            for n, captured in gears.prefill.items()
        }
        rows = {
            n: fit_gear(captured, given, _kept(captured, dp), first)
            for n, captured in gears.rows.items()
        }
    t = time.perf_counter()
    with phase("packing"):
        manifest, members = _pack(gears, decode, prefill, rows, model, cluster, soc_version, dp, pp)
    timings["pack"] = time.perf_counter() - t
    return manifest, members, timings


def _decoder_start(model: torch.nn.Module, gears: CapturedGears) -> int | None:
    """An encoder-decoder's decoder start token (None for a decoder-only model)."""
    if not gears.step.encoder_decoder:
        return None
    return int(model.config.decoder_start_token_id)


def _same_weights_as_decode(fitted: Fitted, decode: list, length: int) -> None:
    """Every stage program of a prefill gear takes the weights and cache its rank holds for
    the decode gear, in the same order: a rank loads one set for all its gears."""
    for rank, (sp, held) in enumerate(zip(fitted.cut[0], decode, strict=True)):
        if sp.weights != held.weights:
            extra = sorted(set(sp.weights) ^ set(held.weights)) or ["(their order)"]
            raise PlanError(
                f"the gear of {length} tokens and the decode gear differ on rank {rank} in the "
                f"weights its pipeline stage reads ({', '.join(extra[:4])}); generation over "
                "pipeline stages needs every gear to read the same weights on each stage"
            )


def _weights_read(captured: CapturedModel) -> set[str]:
    """The weights, buffers and state a gear's program reads or writes."""
    ep = captured.program
    used = {n.name for n in ep.graph_module.graph.nodes if n.op == "placeholder" and n.users}
    return {
        s.target
        for s in ep.graph_signature.input_specs
        if s.kind.name != "USER_INPUT" and s.arg.name in used and s.target is not None
    }


def _replicas_bytes(captured: CapturedModel, dp: int) -> int:
    """What a rank of one of `dp` replicas holds beside its replica's program: the whole batch
    of the gear's batched inputs, and its logits (a contiguous copy, and the batch's gathered)."""
    if dp == 1:
        return 0
    inputs = sum(
        captured.example_inputs[i].numel() * captured.example_inputs[i].element_size()
        for i in BATCH_INPUTS
    )
    out = captured.program.graph_module.graph.output_node().args[0][-1].meta["val"]
    return (dp - 1) * inputs + (1 + dp) * out.numel() * out.element_size()


def _kept(captured: CapturedModel, dp: int) -> Level:
    return Level(reserve=_replicas_bytes(captured, dp))


def _what_would_fit(
    g: Generation, least: LeastMemory | None, replicas: int = 1, by_slots: bool = True
) -> str:
    """The largest batch at this cache length, and the longest cache at this batch, that the
    least plan of the longest prefill gear puts within the devices: its cache grows with rows
    x slots (with rows alone where not `by_slots`: recurrent states), its activations with
    rows, its weights not at all. `g` is one replica's share of the batch; each of the
    `replicas` holds as many rows."""
    if least is None or not least.state_bytes:
        return ""
    room = least.device_bytes
    cache = least.state_bytes
    weights, activations = least.weight_bytes - cache, least.peak_bytes - least.weight_bytes
    one_row = weights + (cache + activations) / g.max_batch_size
    if one_row > room:
        return (
            f". Even one row does not fit: the weights split as far as they go, a row's cache "
            f"and a prompt's activations take {human_bytes(one_row)} per device of "
            f"{human_bytes(room)}"
        )
    rows = int(g.max_batch_size * (room - weights) // (cache + activations))
    fits = [f"max_batch_size={rows * replicas}"]
    slots = int(g.max_seq_len * (room - weights - activations) // cache)
    if by_slots and slots > max(g.prefill_lengths):
        fits.append(f"max_seq_len={slots}")
    holds = (
        f"{g.max_batch_size} rows x {g.max_seq_len} tokens"
        if by_slots
        else f"the states of {g.max_batch_size} rows"
    )
    return (
        f". Its cache ({human_bytes(cache)} per device) holds {holds}; "
        f"{' or '.join(fits)} would fit"
    )


def _placed_as(fitted: Fitted, policy: ParallelOption) -> ParallelOption:
    """`policy` with every weight and state placed as `fitted`'s plan places it."""
    placed = fitted.plan.param_placements()
    return replace(
        policy,
        fixed_placements=tuple(
            (fqn, tuple(placement_str(p) for p in placements)) for fqn, placements in placed.items()
        ),
    )


def _pack(
    gears: CapturedGears,
    decode: Fitted,
    prefill: dict[int, Fitted],
    row_gears: dict[int, Fitted],
    model: torch.nn.Module,
    cluster: ClusterConfig,
    soc_version: str,
    dp: int,
    pp: int,
) -> tuple[Manifest, dict]:
    """The decode gear packed as the model, its prefill gears' programs (and one-row ones,
    `row_gears`, on one replica of one stage) added beside it; with
    `dp` replicas, every rank's programs made from one replica's (`replica_programs`); with
    `pp` stages, the stage programs the fit cut (`build_gear_stages`)."""
    written = frozenset(gears.cache_names)
    rows = gears.generation.max_batch_size

    def every_rank(fitted: Fitted) -> list[RankProgram]:
        if pp > 1:
            return [sp.program for sp in fitted.cut[0]]
        if dp == 1:
            return fitted.programs
        return replica_programs(fitted.programs, dp, rows, len(GEAR_INPUTS), BATCH_INPUTS)

    staged = decode.cut[0] if pp > 1 else None
    manifest, members = pack(
        gears.decode,
        decode.plan,
        every_rank(decode),
        cluster,
        soc_version,
        True,
        dp=dp,
        staged=staged,
        pp=pp,
        written=written,
    )
    submodels = list(manifest.submodels)
    for kind, fitted_gears in (("prefill", prefill), ("row_prefill", row_gears)):
        for length, fitted in fitted_gears.items():
            seen: dict[bytes, str] = {}
            if staged is not None:
                _same_weights_as_decode(fitted, staged, length)
            for rank, rp in enumerate(every_rank(fitted)):
                data = json.dumps(rp.program).encode()
                if data not in seen:
                    seen[data] = f"programs/{kind}_{length}_{len(seen)}.json"
                    members[seen[data]] = data
                sub = submodels[rank]
                # a prefill gear may talk in groups the decode gear never needs
                groups = [*sub.comm_groups]
                groups += [tuple(g) for g in groups_in(rp.program) if tuple(g) not in groups]
                if kind == "row_prefill":
                    sub = replace(sub, row_gears={**sub.row_gears, length: seen[data]})
                else:
                    sub = replace(sub, gears={**sub.gears, length: seen[data]})
                submodels[rank] = replace(sub, comm_groups=tuple(groups))
    held = dict(gears.step.named_buffers())
    settings = getattr(model, "generation_config", None)
    pad = getattr(settings, "pad_token_id", None)
    eos = getattr(settings, "eos_token_id", None)
    vocab = vocab_size(model)
    # every id the model stops at (Llama 3's instruct models end a turn with any of several)
    stops = [
        e
        for e in (eos if isinstance(eos, (list, tuple)) else [eos])
        if isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab
    ]
    spec = Gears(
        max_batch_size=rows * dp,
        max_seq_len=gears.generation.max_seq_len,
        prefill_lengths=gears.generation.prefill_lengths,
        vocab_size=vocab,
        state=tuple(
            TensorSpec(
                (held[n].shape[0] * dp, *held[n].shape[1:]),
                str(held[n].dtype).removeprefix("torch."),
                n,
            )
            for n in gears.cache_names
        ),
        pad_token_id=pad if isinstance(pad, int) and 0 <= pad < vocab else None,
        eos_token_id=tuple(dict.fromkeys(stops)),
        defaults=model_settings(settings, vocab),
        decoder_start_token_id=_decoder_start(model, gears),
        row_prefill=bool(row_gears),
    )
    outputs = manifest.outputs[-1:]  # a gear's outputs: the state it writes, then the logits
    # the whole batch's inputs: a replica reads its rows of the batched ones
    inputs = tuple(
        input_spec(name, x, dp if i in BATCH_INPUTS else 1)
        for i, (name, x) in enumerate(
            zip(gears.decode.input_names, gears.decode.example_inputs, strict=True)
        )
    )
    plan = manifest.plan
    if staged is not None:  # each stage's layers and ranks, as the decode gear divides them
        plan = replace(plan, stages=stage_lines(decode.plan.stages, staged), micro_batches=1)
    return (
        replace(
            manifest,
            submodels=tuple(submodels),
            generation=spec,
            outputs=outputs,
            inputs=inputs,
            plan=plan,
        ),
        members,
    )


def check_model_settings(model: torch.nn.Module) -> None:
    """Refuse a model whose `generation_config` sets what tessel's `generate` does not apply
    (beam search, a typical-p cutoff, banned words, ...): its tokens would differ from
    `transformers`' `generate`, which applies them unasked."""
    settings = getattr(model, "generation_config", None)
    for key, neutral in UNSUPPORTED_SETTINGS.items():
        value = getattr(settings, key, None)
        if value is not None and value != neutral:
            raise ConfigError(
                "model.generation_config",
                key,
                f"is {value!r}, which transformers' generate applies and tessel's generate "
                f"does not (it decodes greedily or by sampling, with {', '.join(SAMPLING_SETTINGS)}"
                f"); set it to {neutral!r} before building to generate without it",
            )
    model_settings(settings, vocab_size(model) if hasattr(model, "config") else None)


def vocab_size(model: torch.nn.Module) -> int:
    """The vocabulary of a `transformers` model (its text model's, where it has several)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def model_settings(settings: object, vocab: int | None = None) -> dict[str, Setting]:
    """The model's own decoding settings (its `generation_config`), each a default of the
    package's `generate` as in `transformers`' (`MODEL_SETTINGS`; unset ones left out).
    Suppressed tokens past a vocabulary of `vocab`, where given, are left out: no row can make
    them, and `transformers` passes them by too (as it does such eos tokens)."""
    found = {
        key: getattr(settings, key)
        for key in MODEL_SETTINGS
        if getattr(settings, key, None) is not None
    }
    eos = found.get("forced_eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):  # one id or several, as eos_token_id
        found["forced_eos_token_id"] = [eos]
    if isinstance(found.get("suppress_tokens"), (list, tuple)):
        found["suppress_tokens"] = [
            t
            for t in found["suppress_tokens"]
            if vocab is None or not isinstance(t, int) or t < vocab
        ]
    forced = [found.get("forced_bos_token_id"), *(found.get("forced_eos_token_id") or [])]
    for token in forced:
        if vocab is not None and isinstance(token, int) and token >= vocab:
            key = "forced_bos_token_id" if token == forced[0] else "forced_eos_token_id"
            raise ConfigError(
                "model.generation_config",
                key,
                f"holds {token}, past the vocabulary of {vocab}; set it to None before building",
            )
    try:
        check_settings_in_range(found)
    except ConfigError as exc:
        raise ConfigError(
            "model.generation_config",
            exc.key,
            f"{exc.detail}; set it to None before building to generate with transformers' default",
        ) from None
    return found
