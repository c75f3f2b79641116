"""Generation packages end to end: built for a cluster, loaded by a Session, `generate` against
`transformers`' own `generate` of each prompt alone, token for token."""

from __future__ import annotations

import json
import math
import re
import zipfile
from dataclasses import replace

import psutil
import pytest
import torch
from tests.conftest import is_multiprocessing_helper
from tests.differential.zoo import DECODER, FAMILIES
from tests.generation_families import (
    GENERATION,
    MAKERS,
    NEW,
    alone_tokens,
    build_family,
    family_prompts,
    generate_both_ways,
    session_tokens,
    transformers_tokens,
)
from tests.training import conftest as training_conftest

import tessel
from tessel.capture.generation import capture_gear
from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.config.parallel_option import ParallelOption
from tessel.demo import tight_cluster
from tessel.package import Package
from tessel.plan import PlanError, has_rule
from tessel.report import inspect_json, state_bytes

# the module's Sessions, one per device count, their workers checked gone when they close
sessions = training_conftest.sessions
no_leftover_workers = training_conftest.no_leftover_workers


@pytest.mark.parametrize("rows", [2, 1])
def test_eager_attention_decodes_over_the_cache_as_it_is(rows, sessions, tmp_path) -> None:
    """Gemma-2's eager attention (soft-capped products over grouped KV heads) reads its cache
    without repeating it into a copy, in the decode step and the prompt alike (one prompt's
    token-major queries copied instead), the planner counts what the programs hold, and the
    tokens are transformers'."""
    generation = Generation(
        max_batch_size=rows, max_seq_len=GENERATION.max_seq_len, prefill_lengths=(8,)
    )
    model, built = build_family("gemma2", 1, "default", generation)
    predicted = built.manifest.plan.memory.rank_peak_bytes
    lowered = [rank.peak_bytes for rank in built.manifest.plan.ranks]
    assert all(abs(p - q) <= 0.05 * q for p, q in zip(predicted, lowered)), (predicted, lowered)
    path = tessel.save(built, tmp_path / "gemma2")
    with zipfile.ZipFile(path) as z:
        programs = [name for name in z.namelist() if name.startswith("programs/")]
        assert len(programs) == 2  # the decode gear's and the prompt's (8 tokens)
        for name in programs:
            _attends_to_the_cache_as_it_is(json.loads(z.read(name)))
    if rows == 2:
        want, got, _ = generate_both_ways(
            "gemma2", built, path, sessions.setdefault(1, tessel.Session())
        )
        assert torch.equal(got, want)
        return
    ids = family_prompts()[0][:1]
    gears = built.manifest.generation
    want = transformers_tokens(MAKERS["gemma2"](), ids, None, gears.pad_for(gears.eos_token_id))
    session = sessions.setdefault(1, tessel.Session())
    session.load_graph(0, {}, path)
    try:
        assert torch.equal(session.generate(0, ids, max_new_tokens=NEW), want)
    finally:
        session.remove_graph(0)


# a model's own decoding settings (its generation_config), which transformers' generate applies
# unasked: it stops at any of several tokens (as Llama 3's instruct models do), one of them
# outside the vocabulary, which it can never make; it samples, penalises repeats, bans repeated
# bigrams, and makes 9 tokens, at least 3 of them before an eos token
MODEL_SETTINGS = {
    "eos_token_id": [3, 250, 4096, 3],
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 20,
    "repetition_penalty": 1.2,
    "no_repeat_ngram_size": 2,
    "min_new_tokens": 3,
    "max_new_tokens": 9,
}


@pytest.fixture(scope="module")
def llama_with_settings():
    """A cache of 4 rows x 256 slots, which outweighs the model, over 2 devices whose memory
    forbids replicated weights; the model carries `MODEL_SETTINGS`."""
    generation = Generation(max_batch_size=4, max_seq_len=256, prefill_lengths=(8,))
    return build_family("llama", 2, "tight", generation, MODEL_SETTINGS)


def test_the_model_settings_are_generates_defaults(llama_with_settings, sessions, tmp_path):
    """The package keeps the model's settings, and `generate` applies them where a call does
    not set them, as transformers' `generate` does: greedy with the model's penalty, bigram
    ban, minimum and length equals transformers; left to the model, it samples with the
    model's temperature and top-k."""
    model, built = llama_with_settings
    gears = built.manifest.generation
    assert gears.eos_token_id == (3, 250)
    assert gears.defaults == {k: v for k, v in MODEL_SETTINGS.items() if k != "eos_token_id"}
    assert "decoding: the model's do_sample=True, temperature=0.7" in str(built)
    ids, mask = family_prompts()
    model = FAMILIES["llama"].make().model
    for key, value in MODEL_SETTINGS.items():
        setattr(model.generation_config, key, value)
    want = alone_tokens(model, ids, mask, 9, gears.pad_for(gears.eos_token_id))
    session = sessions.setdefault(2, tessel.Session())
    session.load_graph(0, {}, tessel.save(built, tmp_path / "llama"))
    try:
        greedy = session.generate(0, ids, attention_mask=mask, do_sample=False)
        sampled = [session.generate(0, ids, attention_mask=mask, seed=s) for s in (1, 2)]
        asked = session.generate(
            0, ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=20, seed=1
        )
        plain = session.generate(
            0, ids, attention_mask=mask, do_sample=False, repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_new_tokens=0, max_new_tokens=9,
        )  # fmt: skip
    finally:
        session.remove_graph(0)
    assert want.shape[1] == 8 + 9 and torch.equal(greedy, want)
    assert torch.equal(sampled[0], asked) and not torch.equal(sampled[0], sampled[1])
    assert not torch.equal(plain, greedy)  # the settings changed the tokens


def test_the_cache_is_declared_per_rank_and_never_stored(llama_with_settings, tmp_path) -> None:
    """A cache of 4 rows x 256 slots outweighs the model: the plan splits it, each
    rank declares its part, and no member of the package holds any of it."""
    model, built = llama_with_settings
    manifest = built.manifest
    state = {s.name: s for s in manifest.generation.state}
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(state) == 2 * layers
    assert all(s.shape == (4, kv_heads, 256, 16) for s in state.values())
    for sub in manifest.submodels:
        assert sub.state.keys() == state.keys()
        # each rank holds half of every layer's keys and values, split where the in-place
        # write can take it (rows, heads or head size; never the slots it writes)
        for name, shape in sub.state_shapes().items():
            assert math.prod(shape) * 2 == math.prod(state[name].shape), (name, shape)
            assert shape[2] == 256, (name, shape)
    for name, spec in state.items():  # the two ranks' boxes tile the whole tensor
        boxes = [sub.state[name] for sub in manifest.submodels]
        split = [d for d in range(4) if boxes[0][d] != boxes[1][d]]
        assert len(split) == 1, boxes
        d = split[0]
        assert boxes[0][d][0] == 0 and boxes[0][d][1] == boxes[1][d][0], boxes
        assert boxes[1][d][1] == spec.shape[d], boxes
    # the planner counts what each rank's decode program holds: no repeated copy of the cache
    predicted = manifest.plan.memory.rank_peak_bytes
    lowered = [rank.peak_bytes for rank in manifest.plan.ranks]
    assert all(abs(p - q) <= 0.05 * q for p, q in zip(predicted, lowered)), (predicted, lowered)
    held = state_bytes(manifest)
    total = sum(math.prod(s.shape) * 4 for s in state.values())
    assert held == [total // 2, total // 2]
    assert "per rank 256.00 KiB (total / 2: 256.00 KiB)" in str(built)
    path = tessel.save(built, tmp_path / "llama")
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.endswith(".safetensors"):
                header = z.read(name)[8 : 8 + int.from_bytes(z.read(name)[:8], "little")]
                assert not set(json.loads(header)) & state.keys(), name
            if name.startswith("programs/"):  # written in place, never copied
                program = json.loads(z.read(name))
                written = set(program["state"])
                assert len(written) == 2 * layers
                for node in program["nodes"]:
                    reads = json.dumps([node.get("args"), node.get("kwargs")])
                    if any(f'"$node": "{w}"' in reads for w in written):
                        assert node["target"] == "aten.index_put_.default", node
                _attends_to_the_cache_as_it_is(program)  # the decode gear's and the prompts'


def _attends_to_the_cache_as_it_is(program: dict) -> None:
    """A gear (a decode step or a prompt) reads each written cache, or views of it, in
    attention (an attention call or a batched product), or returns a view of it: nothing
    repeats the grouped keys and values into a copy of the cache (`capture.grouped_queries`)."""
    calls = [n for n in program["nodes"] if n["op"] == "call"]
    readers: dict[str, list[dict]] = {n["name"]: [] for n in calls}
    returned = json.dumps(program["nodes"][-1]["args"])
    for n in calls:
        for read in re.findall(r'"\$node": "([^"]+)"', json.dumps([n["args"], n["kwargs"]])):
            readers.setdefault(read, []).append(n)
    caches = [n["name"] for n in calls if n["target"] == "aten.index_put_.default"]
    assert caches
    views = ("aten.view.default", "aten.permute.default")
    reads = ("aten.scaled_dot_product_attention.default", "aten.bmm.default")
    for name in caches:
        seen, todo, attended = set(), [name], False
        while todo:  # the cache and its views: read by attention, viewed, or returned
            node = todo.pop()
            seen.add(node)
            if not readers[node]:
                assert node != name and f'"{node}"' in returned, node
            for reader in readers[node]:
                assert reader["target"] in views + reads, (node, reader["target"])
                attended |= reader["target"] in reads
                if reader["target"] in views and reader["name"] not in seen:
                    todo.append(reader["name"])
        assert attended, name


@pytest.fixture(scope="module")
def llama_packages(tmp_path_factory) -> dict[int | str, str]:
    """Packages by device count, tensor parallel over them all; "2x2": two data-parallel
    replicas of two tensor-parallel ranks, each replica holding one row of the cache."""
    root = tmp_path_factory.mktemp("llama_gen")
    generation = Generation(max_batch_size=2, max_seq_len=24, prefill_lengths=(4, 8))
    packages: dict[int | str, str] = {
        n: str(tessel.save(build_family("llama", n, "default", generation)[1], root / f"llama{n}"))
        for n in (1, 2, 4)
    }
    model = FAMILIES["llama"].make().model
    replicas = ParallelOption(data_parallel_size=2, tensor_parallel_size=2)
    built = tessel.build(model, cluster=4, policy=replicas, generation=generation, verify=False)
    packages["2x2"] = str(tessel.save(built, root / "llama2x2"))
    return packages


def test_replicas_hold_their_rows_of_the_cache(llama_packages) -> None:
    """Each data-parallel replica's ranks hold its row of every layer's cache, between them
    the whole row; the manifest declares the whole cache and the whole batch's inputs."""
    manifest = Package.open(llama_packages["2x2"]).manifest
    assert manifest.mesh.shape == (2, 2) and manifest.mesh.dim_names == ("dp", "tp")
    assert manifest.generation.max_batch_size == 2
    assert dict(zip([s.name for s in manifest.inputs], [s.shape[0] for s in manifest.inputs])) == {
        "input_ids": 2, "position_ids": 2, "cache_position": 1, "attention_mask": 2,
    }  # fmt: skip
    for spec in manifest.generation.state:
        assert spec.shape[0] == 2
        for d in range(2):
            boxes = [manifest.submodels[2 * d + t].state[spec.name] for t in range(2)]
            assert all(box[0] == (d, d + 1) for box in boxes), boxes
            held = sum(math.prod(b - a for a, b in box) for box in boxes)
            assert held >= math.prod(spec.shape) // 2  # the row whole, split or replicated


def test_seeded_sampling_gives_the_same_tokens_at_any_device_count(
    llama_packages, sessions
) -> None:
    ids, mask = family_prompts()
    gears = Package.open(llama_packages[1]).manifest.generation
    want = alone_tokens(MAKERS["llama"](), ids, mask, 12, gears.pad_for(gears.eos_token_id))
    drawn = {}
    for n, path in llama_packages.items():
        session = sessions.setdefault(4 if n == "2x2" else n, tessel.Session())
        session.load_graph(0, {}, path)
        try:
            drawn[n] = session.generate(
                0, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                temperature=0.8, top_k=40, top_p=0.9, seed=7,
            )  # fmt: skip
            again = session.generate(
                0, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                temperature=0.8, top_k=40, top_p=0.9, seed=7,
            )  # fmt: skip
            greedy = session.generate(0, ids, attention_mask=mask, max_new_tokens=12)
            assert torch.equal(greedy, want), n  # every device count: transformers' tokens
            other = session.generate(
                0, ids, attention_mask=mask, max_new_tokens=12, do_sample=True, seed=8
            )
        finally:
            session.remove_graph(0)
        assert torch.equal(drawn[n], again)
        assert not torch.equal(drawn[n], other)
    assert all(torch.equal(drawn[1], tokens) for tokens in drawn.values())


def test_bad_requests_get_tessels_errors(llama_packages, sessions, tmp_path) -> None:
    session = sessions.setdefault(2, tessel.Session())
    session.load_graph(0, {}, llama_packages[2])
    try:
        for call, key in [
            (dict(input_ids=torch.zeros(3, 4, dtype=torch.long)), "input_ids"),  # > 2 rows
            (dict(input_ids=torch.zeros(1, 9, dtype=torch.long)), "input_ids"),  # > the gears
            (dict(input_ids=torch.full((1, 4), 256)), "input_ids"),  # outside the vocabulary
            (dict(max_new_tokens=22), "max_new_tokens"),  # the 4-token gear leaves room for 21
            (dict(do_sample=True, temperature=-1.0), "temperature"),
            (dict(top_p=2.0), "top_p"),
            (dict(eos_token_id=-1), "eos_token_id"),
            (dict(eos_token_id=[2, 256]), "eos_token_id"),  # outside the vocabulary
            (dict(pad_token_id=256), "pad_token_id"),
            (dict(num_beams=4), "num_beams"),  # transformers' beam search: not taken
            (dict(repetition_penalty=-1.0), "repetition_penalty"),
            (dict(max_length=30), "max_length"),
            (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
            (dict(min_new_tokens=1.5), "min_new_tokens"),
            (dict(min_length=True), "min_length"),
            (dict(suppress_tokens=[3, 256]), "suppress_tokens"),  # outside the vocabulary
            (dict(do_sample=True, typical_p=1.5), "typical_p"),
            (dict(stream="yes"), "stream"),
        ]:
            args = dict(input_ids=torch.zeros(1, 4, dtype=torch.long)) | call
            with pytest.raises(ConfigError) as err:
                session.generate(0, **args)
            assert err.value.key == key, call
        with pytest.raises(ConfigError, match="generation package: call Session.generate"):
            session.run_graph(0, [torch.zeros(2, 1, dtype=torch.long)])
        # the session still serves the package after every refusal
        assert session.generate(0, torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2).shape == (
            1,
            6,
        )
        # a row stops at the first of several eos tokens it makes, and finished rows are
        # padded with the model's pad or else the first eos token, as transformers does
        ids = FAMILIES["llama"].inputs(2)[0][:, :4]
        free = session.generate(0, ids, max_new_tokens=8, eos_token_id=[])[:, 4:]
        ends = [int(free[0, 1]), int(free[1, 3])]
        firsts = [next(i for i, t in enumerate(row) if t in ends) for row in free.tolist()]
        got = session.generate(0, ids, max_new_tokens=8, eos_token_id=ends)
        assert got.shape == (2, 4 + 1 + max(firsts))
        gears = Package.open(llama_packages[2]).manifest.generation
        want = alone_tokens(
            MAKERS["llama"](), ids, None, 8, gears.pad_for(tuple(ends)), eos_token_id=ends
        )
        assert torch.equal(got, want)
    finally:
        session.remove_graph(0)
    plain = tessel.build(FAMILIES["gpt2"].make(), FAMILIES["gpt2"].inputs(1), cluster=2)
    session.load_graph(1, {}, tessel.save(plain, tmp_path / "plain"))
    try:
        with pytest.raises(ConfigError, match="built without generation"):
            session.generate(1, torch.zeros(1, 4, dtype=torch.long))
    finally:
        session.remove_graph(1)


def test_generation_builds_refuse_what_they_cannot_take() -> None:
    model = FAMILIES["llama"].make().model
    with pytest.raises(ConfigError, match="tessel.Generation"):
        tessel.build(model, cluster=1, generation={"max_batch_size": 1})
    with pytest.raises(ConfigError, match="more than the model's 2 layers") as err:
        tessel.build(
            model, cluster=3, policy=ParallelOption(pipe_stage_num=3), generation=GENERATION
        )
    assert err.value.key.endswith("pipe_stage_num")
    with pytest.raises(ConfigError, match="an encoder-decoder: its prefill gears") as err:
        tessel.build(MAKERS["t5"](), cluster=1, generation=Generation(1, 16, (1, 8)))
    assert err.value.key == "prefill_lengths"
    # an encoder-decoder's stages cut the chain of its encoder's layers, then its decoder's
    layers = r"more than the model's 4 layers \(model.encoder.block.\*, model.decoder.block.\*\)"
    with pytest.raises(ConfigError, match=layers) as err:
        tessel.build(
            MAKERS["t5"](),
            cluster=5,
            policy=ParallelOption(pipe_stage_num=5),
            generation=GENERATION,
        )
    assert err.value.key.endswith("pipe_stage_num")
    with pytest.raises(ConfigError, match="cannot share evenly") as err:
        tessel.build(
            model, cluster=2, policy=ParallelOption(data_parallel_size=2),
            generation=Generation(max_batch_size=3, max_seq_len=24, prefill_lengths=(8,)),
        )  # fmt: skip
    assert err.value.key == "max_batch_size"
    with pytest.raises(ConfigError, match="not taken with generation"):
        tessel.build(
            model, cluster=1, generation=GENERATION, optimizer=torch.optim.SGD(model.parameters())
        )
    # one-row prefill gears write keys and values, on one replica of one stage
    rows = replace(GENERATION, row_prefill=True)
    for family, cluster, policy, said in [
        ("mamba", 1, None, "keeps recurrent states"),
        ("t5", 1, None, "is an encoder-decoder"),
        ("llama", 2, ParallelOption(data_parallel_size=2), "2 data-parallel replicas"),
        ("llama", 2, ParallelOption(pipe_stage_num=2), "2 pipeline stages"),
    ]:
        with pytest.raises(ConfigError, match=said) as err:
            tessel.build(MAKERS[family](), cluster=cluster, policy=policy, generation=rows)
        assert err.value.key == "row_prefill", family
    with pytest.raises(ConfigError, match="must be True or False"):
        Generation(4, 24, (8,), row_prefill=1)  # type: ignore[arg-type]
    # what the model's generation_config sets that transformers' generate would apply and
    # tessel's cannot, or out of range: refused naming the setting, never generated without
    for key, value in [
        ("num_beams", 4), ("bad_words_ids", [[5]]), ("typical_p", 1.5), ("temperature", 0.0),
        ("suppress_tokens", [2, -1]), ("min_p", -0.5),
        ("top_k", -1), ("no_repeat_ngram_size", 1.5), ("max_new_tokens", 0),
    ]:  # fmt: skip
        model = FAMILIES["llama"].make().model
        setattr(model.generation_config, key, value)
        with pytest.raises(ConfigError) as err:
            tessel.build(model, cluster=1, generation=GENERATION)
        assert (err.value.source, err.value.key) == ("model.generation_config", key), err.value


def test_a_cache_that_does_not_fit_names_the_largest_that_would() -> None:
    """Devices sized for one row of the cache: the refusal names the largest batch at this
    length (and, where one fits, the longest cache at this batch), and it builds."""
    model = FAMILIES["llama"].make().model
    one_row = Generation(max_batch_size=1, max_seq_len=256, prefill_lengths=(8,))
    gear = capture_gear(model, one_row, 8, keep=has_rule)
    cluster = cluster_from_dict(tight_cluster(gear, 2), "tight.json")
    asked = Generation(max_batch_size=4, max_seq_len=256, prefill_lengths=(8,))
    with pytest.raises(PlanError) as caught:
        tessel.build(model, cluster=cluster, generation=asked, verify=False)
    found = re.search(
        r"max_batch_size=(\d+)(?: or max_seq_len=(\d+))? would fit", str(caught.value)
    )
    assert found, str(caught.value)
    assert 1 <= int(found[1]) < 4
    fits = [Generation(int(found[1]), 256, (8,))]
    if found[2]:
        fits.append(Generation(4, int(found[2]), (8,)))
    for generation in fits:
        built = tessel.build(model, cluster=cluster, generation=generation, verify=False)
        # the memory model counted what the programs hold: none was planned again to fit
        memory = [r for r in built.manifest.plan.replanned if r.node == "(memory)"]
        assert not memory, memory


def test_what_would_fit_scales_the_cache_by_rows_and_slots_and_activations_by_rows() -> None:
    from tessel.builder.generation import _what_would_fit
    from tessel.plan.errors import LeastMemory

    g = Generation(max_batch_size=4, max_seq_len=1000, prefill_lengths=(10,))
    # weights 100, cache 400 (100 a row), activations 40 (10 a row): 540 on devices of 300
    said = _what_would_fit(g, LeastMemory(540, 500, 400, 300))
    # rows: 100 + 110 r <= 300 -> 1; slots at 4 rows: 100 + 40 + 400 s / 1000 <= 300 -> 400
    assert said.endswith("max_batch_size=1 or max_seq_len=400 would fit"), said
    assert "Even one row" in _what_would_fit(g, LeastMemory(540, 500, 400, 200))
    assert _what_would_fit(g, LeastMemory(540, 500, 0, 300)) == ""  # no cache: not the cause
    # recurrent states (Mamba) do not grow with the cache's length: only fewer rows would fit
    recurrent = _what_would_fit(g, LeastMemory(540, 500, 400, 300), by_slots=False)
    assert recurrent.endswith("max_batch_size=1 would fit"), recurrent


def _qwen2() -> torch.nn.Module:
    """Qwen2's attention shape, small: 28 query heads over 4 KV heads (7 to a group)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=224,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("devices", [3, 8])
def test_28_query_heads_over_4_kv_heads_generate_at_3_and_8_devices(
    devices: int, sessions, tmp_path
) -> None:
    """Head counts no tensor-parallel size here divides (vLLM refuses both): on devices that
    forbid replicated weights, the tokens are transformers' own."""
    model = _qwen2()
    gear = capture_gear(model, GENERATION, 8, keep=has_rule)
    cluster = cluster_from_dict(tight_cluster(gear, devices), "tight.json")
    # the test compares the tokens with transformers' itself: the build's check is left out
    built = tessel.build(model, cluster=cluster, generation=GENERATION, verify=False)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(rank.weight_bytes < whole for rank in built.manifest.plan.ranks)
    path = tessel.save(built, tmp_path / "qwen2")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    gears = built.manifest.generation
    want = transformers_tokens(_qwen2(), ids, mask, gears.pad_for(gears.eos_token_id))
    session = sessions.setdefault(devices, tessel.Session())
    assert torch.equal(session_tokens(session, path, ids, mask), want)


def test_worker_memory_stays_flat_over_256_decode_steps(sessions, tmp_path) -> None:
    """256 new tokens leave each worker holding what 16 did: no step keeps a copy of the
    cache (8 MiB a rank here) or anything else, and every write lands in the cache itself."""
    generation = Generation(max_batch_size=8, max_seq_len=2048, prefill_lengths=(8,))
    model, built = build_family("llama", 2, "default", generation)
    held = state_bytes(built.manifest)
    assert min(held) >= 4 * 2**20, held
    session = sessions.setdefault(2, tessel.Session())
    session.load_graph(0, {}, tessel.save(built, tmp_path / "llama"))
    try:
        workers = [
            p for p in psutil.Process().children(recursive=True) if not is_multiprocessing_helper(p)
        ]
        assert len(workers) >= 2, workers
        ids = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(2))
        session.generate(0, ids, max_new_tokens=16)
        before = [p.memory_info().rss for p in workers]
        out = session.generate(0, ids, max_new_tokens=256)
        after = [p.memory_info().rss for p in workers]
    finally:
        session.remove_graph(0)
    assert out.shape == (8, 8 + 256)
    grown = [b - a for a, b in zip(before, after)]
    assert max(grown) < min(held) // 4, (grown, held)


def _llama(layers: int) -> torch.nn.Module:
    """The suite's Llama with `layers` layers: more than pipeline stages, cut unevenly."""
    from tests.differential.zoo import lm

    sizes = {**DECODER, "num_hidden_layers": layers}
    return lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **sizes)().model


# (model, devices, memory, policy): an odd count of stages over an uneven cut of the layers,
# stages of tensor-parallel ranks (over tied embeddings; on devices that hold 1.15/4 of the
# weights), and stages of data-parallel replicas
STAGED = [
    ("llama4", 3, "default", dict(pipe_stage_num=3)),
    ("gpt2", 4, "default", dict(pipe_stage_num=2, tensor_parallel_size=2)),
    ("llama4", 4, "tight", dict(pipe_stage_num=2, tensor_parallel_size=2)),
    ("gemma2", 4, "default", dict(pipe_stage_num=2, data_parallel_size=2)),
]


@pytest.mark.parametrize(
    "family,devices,memory,policy",
    STAGED,
    ids=[f"{f}-{d}dev-{m}-pp{p['pipe_stage_num']}" for f, d, m, p in STAGED],
)
def test_pipeline_stages_generate_transformers_tokens(
    family: str, devices: int, memory: str, policy: dict, sessions, tmp_path
) -> None:
    """Each stage holds its own layers' weights and cache, no rank the whole model; only the
    last stage's ranks end a call with the logits (the token chosen there is what crosses the
    stages, not a vocabulary's row of logits), and the tokens are transformers' own."""
    make = (lambda: _llama(4)) if family == "llama4" else (lambda: FAMILIES[family].make().model)
    model = make()
    cluster: object = devices
    if memory == "tight":
        gear = capture_gear(model, GENERATION, GENERATION.prefill_lengths[-1], keep=has_rule)
        cluster = cluster_from_dict(tight_cluster(gear, devices), "tight.json")
    built = tessel.build(
        model, cluster=cluster, policy=ParallelOption(**policy), generation=GENERATION
    )
    manifest = built.manifest
    pp = policy["pipe_stage_num"]
    assert manifest.mesh.dim_names[0] == "pp" and manifest.mesh.shape[0] == pp
    per_stage = devices // pp
    held_by_stage = [
        {
            name
            for r in range(s * per_stage, (s + 1) * per_stage)
            for name in manifest.submodels[r].state
        }
        for s in range(pp)
    ]
    caches = [spec.name for spec in manifest.generation.state]
    assert sorted(c for held in held_by_stage for c in held) == sorted(caches)  # each on one stage
    assert all(held_by_stage), held_by_stage
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(rank.weight_bytes < whole for rank in manifest.plan.ranks)
    assert manifest.plan.verify.max_relative_diff is not None  # checked in process at build
    assert "every rank of its layer's pipeline stage" in str(built)  # how the cache is held
    stages = manifest.plan.stages
    assert [st.ranks for st in stages] == [
        tuple(range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)
    ]
    for sub in manifest.submodels:
        returned = json.loads(built.members[sub.program])["nodes"][-1]["args"]
        assert bool(returned) == (sub.rank >= (pp - 1) * per_stage), sub.rank
    rows = GENERATION.max_batch_size // manifest.mesh.size("dp")
    logits = rows * manifest.generation.vocab_size * 2  # at 2 bytes an element, the least
    ranks = inspect_json(manifest)["ranks"]
    sent = [c["bytes"] for r in ranks for c in r["collectives"] if c["axis"] == "pp"]
    assert sent and max(sent) < logits, (max(sent), logits)  # between stages
    path = tessel.save(built, tmp_path / family)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    gears = manifest.generation
    want = transformers_tokens(make(), ids, mask, gears.pad_for(gears.eos_token_id))
    session = sessions.setdefault(devices, tessel.Session())
    assert torch.equal(session_tokens(session, path, ids, mask), want)


def test_a_stage_that_overflows_at_every_memory_is_named_with_its_layers() -> None:
    """Four stages of a 4-layer Llama on devices holding 1.15/4 of its weights: the first
    stage holds the embedding beside its layer, and no plan fits it whatever memory the
    pipeline is planned with. The refusal names that stage, its layers and its device's own
    bytes, not the planner's multiplied figure."""
    model = _llama(4)
    generation = Generation(max_batch_size=2, max_seq_len=24, prefill_lengths=(8,))
    gear = capture_gear(model, generation, 8, keep=has_rule)
    # no slack: the least a device of 4 tensor-parallel ranks holds, less than a stage needs
    data = tight_cluster(gear, 4, slack=0.0)
    with pytest.raises(PlanError) as err:
        tessel.build(
            model,
            cluster=cluster_from_dict(data, "tight.json"),
            policy=ParallelOption(pipe_stage_num=4),
            generation=generation,
        )
    message = str(err.value)
    device = int(re.search(r"DDR:(\d+)B", data["item_def"][0]["memory"]).group(1))
    said = re.search(r"more than the device's ([\d.]+) KiB", message)
    assert message.startswith("pipeline stage 0 (layers 0-0) on rank 0 holds"), message
    assert "micro-batches" not in message  # a gear runs its whole batch at once
    assert said and float(said.group(1)) * 1024 == pytest.approx(device, rel=1e-3), message


def test_a_stage_cut_reading_state_off_its_stage_is_refused(monkeypatch) -> None:
    """Each stage's ranks hold their own state, and every gear reads it there: a cut that would
    read a layer's cache on a stage other than the one holding it is refused, not built with
    a copy that no gear keeps up to date."""
    from tessel.builder import stages as built_stages
    from tessel.lower.stages import StageError

    planned = built_stages.plan_stages

    def cache_moved(*args, **kwargs):
        assignment = planned(*args, **kwargs)
        assert assignment.weight_stage["cache_2"] == 1  # the second decoder layer's keys
        assignment.weight_stage["cache_2"] = 0
        return assignment

    monkeypatch.setattr(built_stages, "plan_stages", cache_moved)
    with pytest.raises(StageError, match="reads the state cache_2, which stage 0 holds"):
        tessel.build(
            MAKERS["t5"](),
            cluster=2,
            policy=ParallelOption(pipe_stage_num=2),
            generation=Generation(max_batch_size=2, max_seq_len=24, prefill_lengths=(8,)),
        )


@pytest.mark.parametrize(
    "devices,replicas,stages,memory",
    [(1, 1, 1, None), (3, 1, 1, 1.15), (2, 2, 1, None), (3, 1, 3, None), (4, 1, 2, 1.6)],
)
def test_an_encoder_decoder_generates_transformers_tokens(
    devices: int, replicas: int, stages: int, memory: float | None, sessions, tmp_path
):
    """T5: the prompt encoded once by a prefill gear, which writes every decoder layer's
    cross-attention cache; then one decoder token a step. On 1 device, on 3 devices that forbid
    replicated weights, on 2 data-parallel replicas (a row each), on 3 pipeline stages (the
    encoder's 2 layers and the decoder's 2, an uneven cut) and on 2 stages of 2 tensor-parallel
    devices each holding less than half of the weights, the tokens (the decoder's start token
    first) are transformers' own, for prompts of different lengths in one batch and through
    either prefill gear."""
    model = MAKERS["t5"]()
    generation = Generation(
        max_batch_size=2, max_seq_len=GENERATION.max_seq_len, prefill_lengths=(4, 8)
    )
    cluster: object = devices
    if memory is not None:  # devices holding `memory` / N of the weights and the activations
        gear = capture_gear(model, generation, 8, keep=has_rule)
        cluster = cluster_from_dict(tight_cluster(gear, devices, memory), "tight.json")
    policy = None
    if replicas > 1:
        policy = ParallelOption(data_parallel_size=replicas)
    elif stages > 1:
        policy = ParallelOption(pipe_stage_num=stages)
    # the test compares the tokens with transformers' itself: the build's check is left out
    built = tessel.build(model, cluster=cluster, policy=policy, generation=generation, verify=False)
    gears = built.manifest.generation
    assert gears.decoder_start_token_id == 0
    shapes = {s.name: s.shape for s in gears.state}
    assert {"cross_0", "encoder_mask"} <= set(shapes)
    # the decoder's cache holds every slot; cross-attention only the longest prompt's
    assert (
        shapes["cache_0"][2] == GENERATION.max_seq_len
        and shapes["cross_0"][2] == shapes["encoder_mask"][1] == 8
    )
    if memory is not None or stages > 1:
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        assert all(rank.weight_bytes < whole for rank in built.manifest.plan.ranks)
    if stages > 1:  # the encoder's layers run on the stages before the decoder's
        cut = [line.layers for line in built.manifest.plan.stages]
        assert len(cut) == stages and "encoder" in cut[0] and "decoder" in cut[-1], cut
        assert "decoder" not in cut[0] and "encoder" not in cut[-1], cut
    path = tessel.save(built, tmp_path / "t5")
    session = sessions.setdefault(devices, tessel.Session())
    session.load_graph(0, {}, path)
    kinds = set()
    try:
        for length in (8, 3):
            ids = torch.randint(2, 256, (2, length), generator=torch.Generator().manual_seed(3))
            mask = torch.ones_like(ids)
            mask[1, : length // 3 + 1] = 0
            want = transformers_tokens(MAKERS["t5"](), ids, mask, gears.pad_for(()))
            got = session.generate(0, ids, attention_mask=mask, max_new_tokens=NEW)
            assert torch.equal(got, want), length
            kinds |= {len(set(row)) for row in want.tolist()}
        # a repetition penalty counts the decoder's tokens, not the encoder's prompt
        want = transformers_tokens(
            MAKERS["t5"](), ids, mask, gears.pad_for(()), repetition_penalty=1.5
        )
        got = session.generate(
            0, ids, attention_mask=mask, max_new_tokens=NEW, repetition_penalty=1.5
        )
        assert torch.equal(got, want)
    finally:
        session.remove_graph(0)
    assert max(kinds) > 3  # tokens that vary: the comparison can tell a wrong cache
