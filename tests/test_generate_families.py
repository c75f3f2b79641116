"""Generation on every family tessel builds it for, end to end: built for a cluster, loaded by a
Session, `generate` against `transformers`' own `generate` of each prompt alone, token for token
(the families: `tests/generation_families.py`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tests.differential.zoo import DECODER, FAMILIES
from tests.generation_families import (
    ENCODER_DECODERS,
    GENERATION,
    HYBRIDS,
    MAKERS,
    NAMES,
    ZOO,
    build_family,
    family_prompts,
    generate_both_ways,
    maker,
    session_tokens,
    transformers_tokens,
)
from tests.training import conftest as training_conftest

import tessel
from tessel.capture.generation import capture_gear
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.report import inspect_json, state_bytes

# Every decoder-only family of the zoo: on 3 devices whose memory forbids replicated weights
# (shards that do not divide) where its generation reads something of its own (experts,
# latent attention, a sliding window, recurrent states, rotary tables), on 1 device where it
# is a dense decoder the differential suite already shards at 2 and 3 devices (1, 2, 4
# devices and stages are met in test_generate.py too). The families built for generation
# alone on 1 device, 2 whose memory forbids replicated weights, and 3; the rest of them once.
# Runs go by device count, so each Session's workers are reused.
DECODERS = ZOO
SHARDED = ("llama", "mistral", "gemma2", "phi3", "mixtral", "deepseek_v3", "mamba")
BESIDE = ("mpt", "granitemoe", "jamba", "bamba", "bart")
ONCE = (
    ("falcon_alibi", 3, "tight"), ("granitemoehybrid", 1, "default"), ("falcon_h1", 1, "default"),
    ("mbart", 2, "tight"), ("pegasus", 1, "default"), ("marian", 1, "default"),
)  # fmt: skip
RUNS = sorted(
    [(f, 3, "tight") if f in SHARDED else (f, 1, "default") for f in DECODERS]
    + [(f, *run) for f in BESIDE for run in ((1, "default"), (2, "tight"), (3, "default"))]
    + list(ONCE),
    key=lambda run: run[1],
)


# the module's Sessions, one per device count, their workers checked gone when they close
sessions = training_conftest.sessions
no_leftover_workers = training_conftest.no_leftover_workers


@pytest.mark.parametrize("family,devices,memory", RUNS, ids=[f"{f}-{d}dev-{m}" for f, d, m in RUNS])
def test_generate_equals_transformers_generate(
    family: str, devices: int, memory: str, sessions, tmp_path
) -> None:
    """A left-padded batch of two prompts of different lengths: each row's tokens are those
    transformers' generate makes of its prompt alone, unpadded, with its own cache."""
    model, built = build_family(family, devices, memory)
    gears = built.manifest.generation
    assert gears is not None and gears.prefill_lengths == (8,)
    if memory == "tight":  # less than the weights and the cache, replicated
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        whole += sum(math.prod(s.shape) * 4 for s in gears.state)  # fp32
        for rank in built.manifest.plan.ranks:
            assert rank.weight_bytes < whole
    path = tessel.save(built, tmp_path / family)
    want, got, streamed = generate_both_ways(
        family, built, path, sessions.setdefault(devices, tessel.Session()), stream=True
    )
    assert torch.equal(got, want)
    prompt = 1 if family in ENCODER_DECODERS else family_prompts()[0].shape[1]
    assert torch.equal(torch.stack(streamed, dim=1), want[:, prompt:])
    if family in HYBRIDS:
        _shows_each_state_by_kind(built)


def _shows_each_state_by_kind(built) -> dict[str, dict]:
    """A hybrid package's keys and values and its recurrent states, each counted and shown by
    kind with its bytes per rank (`tessel inspect`'s JSON and text)."""
    inspected = inspect_json(built.manifest)["generation"]["state_kinds"]
    kinds = {k["kind"]: k for k in inspected}
    assert {"keys and values", "convolution states", "recurrent states"} <= kinds.keys()
    shown = str(built)
    for kind in kinds.values():
        assert sum(kind["bytes_per_rank"]) >= kind["bytes"] > 0, kind
        assert f"cache, {kind['kind']}: {kind['tensors']} tensors" in shown, shown
    assert sum(sum(k["bytes_per_rank"]) for k in inspected) == sum(state_bytes(built.manifest))
    return kinds


def test_a_hybrid_cache_too_large_for_one_device_is_split_as_each_kind_is() -> None:
    """16 rows of Jamba's cache on 2 devices that cannot hold it whole: what is split is split
    as its kind is, keys and values by heads or head size (never the slots they are written
    at), a recurrent layer's convolution and recurrent states by channels (never the
    convolution's window or the state size, which every step would move across ranks), at half
    its bytes per rank; and the gears still give transformers' tokens (the build's check)."""
    generation = Generation(max_batch_size=16, max_seq_len=24, prefill_lengths=(8,))
    _, built = build_family("jamba", 2, "tight", generation, verify=None)
    kinds = _shows_each_state_by_kind(built)
    allowed = {"keys and values": (1, 3), "convolution states": (1,), "recurrent states": (1,)}
    split = [k for k in kinds.values() if k["split_dim"] is not None]
    assert any(k["kind"] != "keys and values" for k in split), kinds  # states split too
    for kind in split:
        assert kind["split_dim"] in allowed[kind["kind"]], kind
        assert kind["bytes_per_rank"] == [kind["bytes"] // 2] * 2, kind
    assert built.manifest.plan.verify.max_relative_diff is not None


def test_every_zoo_family_that_generates_is_checked_against_transformers() -> None:
    """The generation families checked against transformers' generate cover every family of
    the differential suite whose model generates, and every one has the name the Generation
    guide (docs/guides/generation.md) lists it by."""
    for name, family in FAMILIES.items():
        if family.make().model.can_generate():
            assert name in MAKERS, name
    assert set(MAKERS) == set(NAMES)
    guide = Path(__file__).parents[1] / "docs" / "guides" / "generation.md"
    text = " ".join(guide.read_text().split())
    listed = re.search(
        r"of each prompt alone, in the test suite, on these families: ([^.]+)\.", text
    )
    assert listed, "docs/guides/generation.md lists no families generation is checked on"
    assert listed[1].split(", ") == list(NAMES.values()), listed[1]
    tested = {f for f, _, _ in RUNS} | {"t5"}  # T5 has a test of its own, below
    assert tested == set(MAKERS), set(MAKERS) ^ tested


def test_a_model_taking_its_arguments_through_kwargs_is_given_them(sessions, tmp_path) -> None:
    """A causal LM whose call takes `use_cache` and `position_ids` only through `**kwargs`:
    calling it finds it takes them, so it is built and given them, and a left-padded row gets
    the positions it has alone (default positions would count its padding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessel.capture.generation import probe

    class KwargsLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, cache=None, **kwargs):
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, cache=cache, **kwargs
            )

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return KwargsLlama(LlamaConfig(num_key_value_heads=2, **DECODER)).eval()

    model = make()
    assert probe(model, 2, 40, 8).takes == {"use_cache", "position_ids", "logits_to_keep"}
    built = tessel.build(model, cluster=2, generation=GENERATION)
    ids, mask = family_prompts()
    gears = built.manifest.generation
    want = transformers_tokens(make(), ids, mask, gears.pad_for(gears.eos_token_id))
    got = session_tokens(
        sessions.setdefault(2, tessel.Session()), tessel.save(built, tmp_path / "kw"), ids, mask
    )
    assert torch.equal(got, want)


def test_a_cache_answering_the_wrong_length_fails_the_builds_check(monkeypatch) -> None:
    """A fault in tessel's own cache (it answers the slot + 1 as its length, which BART's
    decoder reads its positions from) is caught by the check against transformers' generate,
    which shares none of it: the package is not written, and the error names the row and the
    token."""
    from tessel.builder.verify import VerifyError
    from tessel.capture import generation as captured

    monkeypatch.setattr(captured.SlotCache, "length", lambda cache: cache.slots[0] + 1)
    with pytest.raises(VerifyError) as err:
        tessel.build(MAKERS["bart"](), cluster=1, generation=Generation(2, 24, (8,)))
    assert "row 0 (a prompt of 7 tokens, alone in transformers' generate), new token 0" in str(
        err.value
    ), err.value


def test_rotary_tables_that_change_with_the_length_are_kept_below_the_switch() -> None:
    """Dynamic NTK scaling (Llama) and long factors (Phi-3) change the rotary table past a
    length: below it the gears keep the first table, and the build's check against
    transformers' generate passes; a max_seq_len past it is refused by name."""
    dynamic = maker(
        "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2,
        **{**DECODER, "max_position_embeddings": 24},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    built = tessel.build(dynamic(), cluster=1, generation=Generation(2, 24, (8,)))
    assert built.manifest.plan.verify.max_relative_diff is not None
    longrope = maker(
        "Phi3Config", "Phi3ForCausalLM", pad_token_id=0, original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8, "original_max_position_embeddings": 16,
        },
        **DECODER,
    )  # fmt: skip
    for make, switch in ((dynamic, 24), (longrope, 16)):
        with pytest.raises(ConfigError, match=f"give max_seq_len={switch} or less") as err:
            capture_gear(make(), Generation(1, switch + 1, (8,)), 8)
        assert (err.value.source, err.value.key) == ("Generation", "max_seq_len")


def test_beam_search_is_refused_at_build_and_taken_per_call_where_it_changes_nothing(
    sessions, tmp_path
) -> None:
    """BART as released carries num_beams=4, which tessel does not build: the build refuses
    it by name. Set to 1, it builds; a call may pass num_beams=1 (as to transformers'
    generate), and is refused num_beams=4 by name."""
    model = MAKERS["bart"]()
    model.generation_config.num_beams = 4
    with pytest.raises(ConfigError) as err:
        tessel.build(model, cluster=1, generation=GENERATION)
    assert (err.value.source, err.value.key) == ("model.generation_config", "num_beams")
    model.generation_config.num_beams = 1
    built = tessel.build(model, cluster=1, generation=GENERATION)
    ids, mask = family_prompts()
    session = sessions.setdefault(1, tessel.Session())
    session.load_graph(0, {}, tessel.save(built, tmp_path / "bart"))
    try:
        plain = session.generate(0, ids, attention_mask=mask, max_new_tokens=4)
        asked = session.generate(0, ids, attention_mask=mask, max_new_tokens=4, num_beams=1)
        assert torch.equal(plain, asked)
        with pytest.raises(ConfigError) as err:
            session.generate(0, ids, attention_mask=mask, num_beams=4)
        assert err.value.key == "num_beams"
    finally:
        session.remove_graph(0)
