"""Generation's capture and loop: a prefill gear per prompt length and a decode gear over one
cache written in place, run by `tessel.decoding`, against `transformers`' own `generate`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.differential.zoo import FAMILIES
from torch import fx

from tessel.capture.generation import capture_gears
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.config.sampling import Sampling, sampling_for
from tessel.decoding import (
    Choice,
    choose,
    choosing,
    decode,
    new_tokens_for,
    penalize,
    processed,
    warped,
)
from tessel.package.fields import Field, PackageError
from tessel.package.manifest import Gears


def _hf_model(family: str) -> torch.nn.Module:
    return FAMILIES[family].make().model


def _gears(model: torch.nn.Module, generation: Generation) -> Gears:
    vocab = model.config.get_text_config().vocab_size
    return Gears(
        generation.max_batch_size, generation.max_seq_len, generation.prefill_lengths, vocab, ()
    )


def _tokens(captured, gears: Gears, ids, mask=None, new=12, **options) -> torch.Tensor:
    return torch.stack(
        list(decode(choosing(captured.run), gears, ids, mask, new, **options)), dim=1
    )


@pytest.fixture(scope="module")
def llama():
    model = _hf_model("llama")
    generation = Generation(max_batch_size=4, max_seq_len=24, prefill_lengths=(4, 8))
    return model, capture_gears(model, generation), _gears(model, generation)


def test_captured_gears_equal_transformers_generate(llama) -> None:
    """Left-padded rows, a cache longer than the prompt gear: the captured gears, run in this
    process before any partitioning, give `generate`'s greedy tokens with its static cache
    (every family, partitioned, in tests/test_generate.py)."""
    model, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :8]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours = _tokens(captured, gears, ids, mask, new=12)
    theirs = (
        FAMILIES["llama"]
        .make()
        .model.generate(  # a fresh copy: capture changes nothing
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )[:, 8:]
    )
    assert torch.equal(ours, theirs)


def test_a_one_row_prefill_gear_writes_its_row_alone() -> None:
    """`row_prefill`: the one-row gear given row 2 computes what the gear of every row computes
    for row 2, writes row 2's keys and values at the call's slots, and no other row's."""
    model = _hf_model("llama")
    generation = Generation(
        max_batch_size=4, max_seq_len=24, prefill_lengths=(8,), row_prefill=True
    )
    captured = capture_gears(model, generation)
    assert captured.rows[8].input_names[-1] == "row"
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 200, (4, 8), generator=g)
    positions = torch.arange(8).expand(4, 8).contiguous()
    mask = torch.zeros(4, 24, dtype=torch.long)
    mask[:, :8] = 1
    every = captured.run(8, (ids, positions, torch.arange(8), mask))
    written = {n: getattr(captured.step, n).clone() for n in captured.cache_names}
    for name in captured.cache_names:
        getattr(captured.step, name).fill_(7.0)
    one = captured.run(
        8, (ids[2:3], positions[2:3], torch.arange(8), mask[2:3], torch.tensor([2])), row=True
    )
    torch.testing.assert_close(one[0], every[2])
    for name in captured.cache_names:
        held = getattr(captured.step, name)
        torch.testing.assert_close(held[2, :, :8], written[name][2, :, :8])
        assert (held[2, :, 8:] == 7).all() and (held[[0, 1, 3]] == 7).all(), name
    # every gear writes the cache by row index as the one-row gear does, so no plan of any
    # gear splits the cache by rows (DTensor never splits an indexed dim), where a one-row
    # gear could not write its row
    for gear in (captured.decode, *captured.prefill.values(), *captured.rows.values()):
        writes = gear.program.graph.find_nodes(
            op="call_function", target=torch.ops.aten.index_put_.default
        )
        assert writes and all(w.args[1][0] is not None for w in writes)


def test_programs_write_the_cache_and_return_one_token_of_logits(llama) -> None:
    model, captured, _ = llama
    ep = captured.decode.program
    written = [s.target for s in ep.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    assert written == captured.cache_names  # every layer's keys and values, nothing else
    assert len(written) == 2 * model.config.num_hidden_layers
    buffer = captured.step.cache_0
    assert tuple(buffer.shape) == (4, model.config.num_key_value_heads, 24, 16)


def test_a_batch_of_prompts_equals_each_prompt_alone(llama) -> None:
    _, captured, gears = llama
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 8, 5, 1)]
    ids = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.zeros(4, 8, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 8 - len(p) :], mask[row, 8 - len(p) :] = p, 1
    together = _tokens(captured, gears, ids, mask, new=10)
    for row, p in enumerate(prompts):  # each alone, in the shortest gear that holds it
        assert torch.equal(_tokens(captured, gears, p[None], new=10)[0], together[row])


def test_seeded_sampling_follows_its_seed(llama) -> None:
    _, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :6]
    one = Sampling(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, seed=1)
    first = _tokens(captured, gears, ids, sampling=one)
    assert torch.equal(first, _tokens(captured, gears, ids, sampling=one))
    other = _tokens(captured, gears, ids, sampling=Sampling(do_sample=True, seed=2))
    assert not torch.equal(first, other)
    # keeping only the likeliest token is greedy decoding, whatever the seed draws
    narrow = Sampling(do_sample=True, top_k=1, seed=5)
    assert torch.equal(
        _tokens(captured, gears, ids, sampling=narrow), _tokens(captured, gears, ids)
    )


def _noise(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.empty(shape).exponential_(generator=g)


def test_choose_keeps_to_top_k_and_top_p() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    top3 = logits.topk(3).indices
    top_k = Sampling(do_sample=True, top_k=3)
    drawn = [choose(logits, top_k, _noise(g, 3, 50)) for _ in range(200)]
    for row in range(3):
        assert {int(d[row]) for d in drawn} <= set(top3[row].tolist())
    # a nucleus smaller than the likeliest token's probability keeps that token alone
    assert torch.equal(
        choose(logits, Sampling(do_sample=True, top_p=1e-6), _noise(g, 3, 50)),
        logits.argmax(dim=-1),
    )


def test_a_drawn_token_follows_the_probabilities() -> None:
    """Racing the probabilities against exponential noise draws each token as often as its
    probability says: 20,000 draws of one row, every count within 4 standard deviations."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, float("-inf")]])
    probs = logits.softmax(dim=-1)[0]
    draws = 20_000
    sampling = Sampling(do_sample=True, top_k=0)
    made = choose(logits.expand(draws, -1), sampling, _noise(g, draws, 6))
    counts = torch.bincount(made, minlength=6).double()
    spread = (draws * probs * (1 - probs)).double().sqrt()
    assert counts[5] == 0  # a token of probability 0 is never drawn
    assert ((counts - draws * probs).abs() <= 4 * spread + 1).all(), counts.tolist()


def test_finished_rows_give_the_pad_token_and_the_loop_stops(llama) -> None:
    _, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :6]
    free = _tokens(captured, gears, ids, new=10)
    eos = int(free[0, 2])  # row 0 ends at its third token
    stops = _tokens(captured, gears, ids, new=10, eos_token_id=eos, pad_token_id=7)
    row1_end = [i for i in range(10) if int(free[1, i]) == eos]
    last = max(2, row1_end[0] if row1_end else 9)
    assert stops.shape[1] == last + 1  # until every row has finished, or the last token
    assert torch.equal(stops[0, :3], free[0, :3]) and (stops[0, 3:] == 7).all()
    n = row1_end[0] + 1 if row1_end else stops.shape[1]
    assert torch.equal(stops[1, :n], free[1, :n])


def test_the_repetition_penalty_equals_transformers(llama) -> None:
    """Greedy under a repetition penalty gives `generate`'s tokens: its processor runs over
    each row's prompt (its left padding left out) and the row's new tokens."""
    model, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :8]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours = _tokens(captured, gears, ids, mask, new=12, sampling=Sampling(repetition_penalty=3.0))
    assert not torch.equal(ours, _tokens(captured, gears, ids, mask, new=12))
    theirs = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=3.0,
        cache_implementation="static",
        pad_token_id=0,
    )[:, 8:]
    assert torch.equal(ours, theirs)


def test_the_penalty_divides_positive_scores_and_multiplies_negative_ones() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0]])
    seen = torch.tensor([[0, 1, 0, 2]])  # a token held twice is penalised once
    counted = torch.tensor([[True, True, True, False]])  # the last is left padding
    assert penalize(logits, seen, counted, 2.0).tolist() == [[1.0, -4.0, 4.0, 1.0]]
    assert penalize(logits, seen, counted, 1.0).tolist() == logits.tolist()


def test_a_row_stops_at_any_of_several_eos_tokens(llama) -> None:
    _, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :6]
    free = _tokens(captured, gears, ids, new=10)
    ends = [int(free[0, 2]), int(free[1, 4])]  # row 0's third token, row 1's fifth
    got = _tokens(captured, gears, ids, new=10, eos_token_id=ends, pad_token_id=7)
    for row in range(2):
        first = next(i for i, t in enumerate(free[row].tolist()) if t in ends)
        assert torch.equal(got[row, : first + 1], free[row, : first + 1])
        assert (got[row, first + 1 :] == 7).all()
    assert got.shape[1] == 1 + max(
        next(i for i, t in enumerate(free[row].tolist()) if t in ends) for row in range(2)
    )


@pytest.mark.parametrize("eos", [256, -1, True, [3, 256], "2", [[3]]])
def test_an_eos_token_outside_the_vocabulary_is_refused(llama, eos) -> None:
    _, captured, gears = llama
    with pytest.raises(ConfigError) as err:
        _tokens(captured, gears, torch.zeros(1, 4, dtype=torch.long), eos_token_id=eos)
    assert err.value.key == "eos_token_id"


def test_the_manifest_reads_one_eos_token_or_several() -> None:
    model = {
        "repetition_penalty": 1.1,
        "do_sample": True,
        "top_k": 20,
        "max_length": 30,
        "min_p": 0.05,
        "suppress_tokens": [4, 7],
    }
    gears = Gears(1, 16, (8,), 100, (), pad_token_id=0, eos_token_id=(2, 9), defaults=model)
    assert gears.to_json()["eos_token_id"] == [2, 9]
    assert Gears.read(Field(gears.to_json(), "generation", "m.json")) == gears
    single = Gears.read(Field({**gears.to_json(), "eos_token_id": 2}, "generation", "m.json"))
    assert single.eos_token_id == (2,)
    none = dict(gears.to_json())
    del none["eos_token_id"]
    assert Gears.read(Field(none, "generation", "m.json")).eos_token_id == ()
    # where the model sets no pad, rows are padded with the first eos token, as in transformers
    unpadded = {k: v for k, v in gears.to_json().items() if k != "pad_token_id"}
    unpadded = Gears.read(Field(unpadded, "generation", "m.json"))
    assert unpadded.pad_token_id is None and "pad_token_id" not in unpadded.to_json()
    assert (unpadded.pad_for((9, 2)), unpadded.pad_for(()), gears.pad_for((9,))) == (9, 0, 0)
    assert Gears.read(Field(none, "generation", "m.json")) == replace(gears, eos_token_id=())
    for bad, message in [
        ({"repetition_penalty": 0}, r"defaults.repetition_penalty: must be a number above 0"),
        ({"top_k": 2.5}, r"defaults.top_k: must be an int"),
        ({"do_sample": 1}, r"defaults\['do_sample'\]: expected true or false"),
        ({"max_length": 0}, r"defaults.max_length: must be an int of at least 1, found 0"),
        (
            {"max_new_tokens": 2.0},
            r"defaults.max_new_tokens: must be an int of at least 1, found 2.0",
        ),
        ({"num_beams": 2}, r"unknown key 'num_beams'"),
        ({"suppress_tokens": [4, 100]}, r"suppress_tokens'\]\[1\]: found 100"),
        ({"typical_p": 0}, r"defaults.typical_p: must be a number in \(0, 1\]"),
    ]:
        with pytest.raises(PackageError, match=message):
            Gears.read(Field({**gears.to_json(), "defaults": bad}, "generation", "m.json"))
    with pytest.raises(PackageError, match=r"eos_token_id\[1\]: found 100"):
        Gears.read(Field({**gears.to_json(), "eos_token_id": [2, 100]}, "generation", "m.json"))


@pytest.mark.parametrize(
    "call, key",
    [
        (dict(ids=torch.zeros(5, 4, dtype=torch.long)), "input_ids"),  # rows > max_batch_size
        (dict(ids=torch.zeros(1, 9, dtype=torch.long)), "input_ids"),  # longer than any gear
        (dict(ids=torch.full((1, 4), 256)), "input_ids"),  # outside the vocabulary
        (dict(ids=torch.zeros(1, 4)), "input_ids"),  # not ids
        (dict(ids=torch.zeros(4, dtype=torch.long)), "input_ids"),  # not [batch, tokens]
        (dict(ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids"),  # no token
        (dict(new=18), "max_new_tokens"),  # 8-token gear: 17 new tokens fill the 24 slots
        (dict(new=0), "max_new_tokens"),
        (dict(mask=torch.tensor([[1, 1, 0, 0]])), "attention_mask"),  # padded on the right
        (dict(mask=torch.tensor([[0, 0, 0, 0]])), "attention_mask"),
        (dict(mask=torch.ones(1, 3, dtype=torch.long)), "attention_mask"),
    ],
)
def test_bad_requests_are_refused_naming_the_argument(llama, call: dict, key: str) -> None:
    _, captured, gears = llama
    ids = call.get("ids", torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ConfigError) as err:
        _tokens(captured, gears, ids, call.get("mask"), new=call.get("new", 12))
    assert err.value.key == key


def test_the_cache_holds_exactly_the_promised_new_tokens(llama) -> None:
    _, captured, gears = llama
    ids = torch.zeros(1, 5, dtype=torch.long)  # the 8-token gear: slots 0-7, then 16 more
    assert _tokens(captured, gears, ids, new=17).shape == (1, 17)


@pytest.mark.parametrize(
    "options, key",
    [
        (dict(do_sample=True, temperature=0), "temperature"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(do_sample=True, top_p=0), "top_p"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, seed=-1), "seed"),
        (dict(do_sample="yes"), "do_sample"),
        (dict(temperature=0.7), "temperature"),  # greedy: a sampling setting would be ignored
        (dict(top_k=5), "top_k"),
        (dict(seed=3), "seed"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
        (dict(min_length=2.0), "min_length"),
        (dict(min_new_tokens=None), "min_new_tokens"),
        (dict(do_sample=True, min_p=1.5), "min_p"),
        (dict(do_sample=True, typical_p=0), "typical_p"),
        (dict(do_sample=True, epsilon_cutoff=1), "epsilon_cutoff"),
        (dict(do_sample=True, eta_cutoff=-0.1), "eta_cutoff"),
        (dict(min_p=0.1), "min_p"),  # greedy: a sampling cutoff would be ignored
        (dict(typical_p=0.9), "typical_p"),
        (dict(suppress_tokens=[-1]), "suppress_tokens"),
        (dict(suppress_tokens="3"), "suppress_tokens"),
        (dict(suppress_tokens=[True]), "suppress_tokens"),
    ],
)
def test_sampling_arguments_out_of_range_are_refused(options: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        Sampling(**options)
    assert err.value.key == key


def test_the_scores_equal_transformers_logits_processors() -> None:
    """The penalty, the n-gram ban and the minimum lengths equal `transformers`' processors in
    its order, score for score, on random logits, prompts (left-padded) and settings."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    g = torch.Generator().manual_seed(0)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=g))

    eos = torch.tensor([1, 3])
    for _ in range(200):
        rows, vocab, prompt, new = draw(1, 4), draw(5, 30), draw(1, 8), draw(0, 8)
        seen = torch.randint(0, 6, (rows, prompt + new), generator=g)  # few ids: repeats
        padding = torch.randint(0, prompt, (rows,), generator=g)
        mask = (torch.arange(prompt)[None] >= padding[:, None]).long()
        logits = torch.randn(rows, vocab, generator=g) * 3
        sampling = Sampling(
            repetition_penalty=float(torch.rand(1, generator=g)) * 2 + 0.5,
            no_repeat_ngram_size=draw(0, 4),
            min_length=draw(0, 15),
            min_new_tokens=draw(0, 6),
        )
        theirs = LogitsProcessorList(
            [RepetitionPenaltyLogitsProcessor(
                sampling.repetition_penalty, prompt_ignore_length=mask.argmax(dim=1)
            )]
            + [NoRepeatNGramLogitsProcessor(n) for n in [sampling.no_repeat_ngram_size] if n]
            + [MinLengthLogitsProcessor(n, eos) for n in [sampling.min_length] if n]
            + [MinNewTokensLengthLogitsProcessor(prompt, n, eos)
               for n in [sampling.min_new_tokens] if n]
        )(seen, logits.clone())  # fmt: skip
        # the choice's fixed-shaped history: the tokens from column `begin`, other ids around
        begin = draw(0, 4)
        slots = begin + prompt + new + draw(0, 4)
        history = torch.randint(0, 6, (rows, slots), generator=g)
        history[:, begin : begin + prompt + new] = seen
        counted = torch.zeros(rows, slots, dtype=torch.bool)
        counted[:, begin : begin + prompt] = mask.bool()
        counted[:, begin + prompt : begin + prompt + new] = True
        span = torch.tensor([begin, begin + prompt + new, new])
        ours = processed(logits, history, counted, span, sampling, tuple(eos.tolist()))
        assert torch.equal(ours, theirs), sampling


def test_the_sampling_cutoffs_equal_transformers_warpers() -> None:
    """Temperature, top-k, top-p, min-p, typical-p and the epsilon and eta cutoffs leave the
    scores `transformers`' warpers leave, in its order, on random logits and settings."""
    from transformers.generation.logits_process import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)

    def some(neutral: float, low: float, high: float) -> float:  # half the time, no cutoff
        if torch.rand(1, generator=g) < 0.5:
            return neutral
        return low + float(torch.rand(1, generator=g)) * (high - low)

    cut = 0
    for _ in range(300):
        rows, vocab = int(torch.randint(1, 4, (1,), generator=g)), 40
        logits = torch.randn(rows, vocab, generator=g) * 3
        sampling = Sampling(
            do_sample=True,
            temperature=some(1.0, 0.3, 2.0),
            top_k=int(torch.randint(0, 45, (1,), generator=g)),
            top_p=some(1.0, 0.2, 1.0),
            min_p=some(0.0, 0.0, 0.5),
            typical_p=some(1.0, 0.1, 0.99),
            epsilon_cutoff=some(0.0, 1e-4, 0.05),
            eta_cutoff=some(0.0, 1e-4, 0.05),
        )
        s = sampling
        warpers = [
            (TemperatureLogitsWarper, s.temperature, s.temperature != 1),
            (TopKLogitsWarper, s.top_k, s.top_k != 0),
            (TopPLogitsWarper, s.top_p, s.top_p < 1),
            (MinPLogitsWarper, s.min_p, s.min_p > 0),
            (TypicalLogitsWarper, s.typical_p, s.typical_p < 1),
            (EpsilonLogitsWarper, s.epsilon_cutoff, s.epsilon_cutoff > 0),
            (EtaLogitsWarper, s.eta_cutoff, s.eta_cutoff > 0),
        ]
        theirs = LogitsProcessorList([warper(value) for warper, value, on in warpers if on])(
            torch.zeros(rows, 1, dtype=torch.long), logits.clone()
        )
        ours = warped(logits, sampling)
        assert torch.equal(ours, theirs), sampling
        cut += int((ours == float("-inf")).any())
    assert cut > 100  # the cutoffs removed tokens, not only passed them through


def test_suppressed_tokens_are_never_made_as_in_transformers(llama) -> None:
    """Greedy with the tokens it would make first suppressed equals `generate`'s with
    `suppress_tokens`, and makes none of them."""
    model, captured, gears = llama
    ids = FAMILIES["llama"].inputs(2)[0][:, :8]
    free = _tokens(captured, gears, ids, new=12)
    banned = sorted(set(free[:, :3].flatten().tolist()))
    ours = _tokens(captured, gears, ids, new=12, sampling=Sampling(suppress_tokens=banned))
    assert not set(ours.flatten().tolist()) & set(banned)
    theirs = model.generate(
        ids,
        max_new_tokens=12,
        do_sample=False,
        suppress_tokens=banned,
        cache_implementation="static",
        pad_token_id=0,
    )[:, 8:]
    assert torch.equal(ours, theirs)


def test_a_models_suppressed_tokens_past_its_vocabulary_are_left_out() -> None:
    """No row can make them, and `transformers` passes them by, as it does such eos tokens;
    a call that names one is refused (`test_generate.py`)."""
    from transformers import GenerationConfig

    from tessel.builder.generation import model_settings

    config = GenerationConfig(suppress_tokens=[3, 300, 255])
    assert model_settings(config, vocab=256) == {"suppress_tokens": [3, 255]}
    with pytest.raises(ConfigError) as err:
        model_settings(GenerationConfig(suppress_tokens=[3, -2]), vocab=256)
    assert (err.value.source, err.value.key) == ("model.generation_config", "suppress_tokens")


def test_a_call_takes_the_models_settings_where_it_sets_none() -> None:
    model = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert sampling_for({}, model) == Sampling(
        do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1
    )
    # greedy by the call: the model's sampling settings are not read (as in transformers), the
    # call's own are refused, and the penalty holds either way
    greedy = sampling_for({"do_sample": False, "top_k": None}, model)
    assert greedy == Sampling(repetition_penalty=1.1)
    with pytest.raises(ConfigError) as err:
        sampling_for({"do_sample": False, "temperature": 0.5}, model)
    assert err.value.key == "temperature"
    assert sampling_for({}, {}) == Sampling() and Sampling().top_k == 50  # transformers' own
    # min_new_tokens, where set, overrules min_length (transformers counts it from the prompt)
    assert sampling_for({"min_new_tokens": 2}, {"min_length": 9}).min_length == 0
    assert sampling_for({}, {"min_length": 9}).min_length == 9


def test_a_call_makes_the_models_count_of_tokens_where_it_gives_none() -> None:
    gears = Gears(1, 24, (4, 8), 100, ())
    assert new_tokens_for(5, {"max_new_tokens": 9}, gears, 3) == 5
    assert new_tokens_for(None, {"max_new_tokens": 9, "max_length": 4}, gears, 3) == 9
    assert new_tokens_for(None, {"max_length": 10}, gears, 3) == 7  # the prompt counts
    assert new_tokens_for(None, {}, gears, 3) == 20
    assert new_tokens_for(None, {}, gears, 6) == 17  # the 8-token gear leaves room for 17
    with pytest.raises(ConfigError, match="max_length \\(3, its generation_config\\)") as err:
        new_tokens_for(None, {"max_length": 3}, gears, 3)
    assert err.value.key == "max_new_tokens"


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(max_seq_len=True), "max_seq_len"),
        (dict(prefill_lengths=()), "prefill_lengths"),
        (dict(prefill_lengths=(16,)), "prefill_lengths"),  # no room for a new token
        (dict(prefill_lengths=(4, 4)), "prefill_lengths"),
    ],
)
def test_bad_generation_settings_are_refused(fields: dict, key: str) -> None:
    given = dict(max_batch_size=1, max_seq_len=16, prefill_lengths=(8,)) | fields
    with pytest.raises(ConfigError) as err:
        Generation(**given)
    assert err.value.key == key


def test_generation_sorts_its_gears_and_takes_one_length() -> None:
    assert Generation(2, 64, (32, 8)).prefill_lengths == (8, 32)
    assert Generation(2, 64, 16).prefill_lengths == (16,)


def test_a_model_that_returns_no_logits_is_refused_in_one_line() -> None:
    model = FAMILIES["bert"].make().model
    with pytest.raises(ConfigError) as err:
        capture_gears(model, Generation(1, 16, (8,)))
    assert "returns no logits" in str(err.value) and "\n" not in str(err.value)


def test_a_model_whose_code_cannot_be_traced_over_the_cache_is_refused_naming_the_layer(
    monkeypatch,
):
    # an attention layer that branches on the values of its input: the trace fails inside it,
    # eager runs do not, and the refusal names the layer in one line
    from transformers.models.llama import modeling_llama

    attend = modeling_llama.LlamaAttention.forward

    def branching(self, hidden_states, *args, **kwargs):
        if hidden_states.sum() > 0:
            hidden_states = hidden_states * 1.0
        return attend(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", branching)
    with pytest.raises(ConfigError) as err:
        capture_gears(_hf_model("llama"), Generation(1, 16, (8,)))
    message = str(err.value)
    assert "LlamaForCausalLM cannot be captured for generation" in message
    assert "model.layers.0.self_attn (LlamaAttention)" in message and "\n" not in message


def test_a_program_writes_in_place_only_into_the_state_it_declares() -> None:
    from tessel.lower.program import FORMAT, ProgramError, check

    nodes = [
        {"op": "input", "name": "cache"},
        {"op": "input", "name": "slot"},
        {"op": "input", "name": "key"},
        {
            "op": "call",
            "name": "written",
            "target": "aten.index_put_.default",
            "args": [{"$node": "cache"}, [None, None, {"$node": "slot"}], {"$node": "key"}],
            "kwargs": {},
        },
        {"op": "output", "args": [{"$node": "written"}]},
    ]
    check({"format": FORMAT, "nodes": nodes, "state": ["cache"]})
    with pytest.raises(ProgramError, match="writes into its argument 'self'"):
        check({"format": FORMAT, "nodes": nodes})  # an input it does not declare: read-only
    with pytest.raises(ProgramError, match="not its inputs"):
        check({"format": FORMAT, "nodes": nodes, "state": ["cache", "written"]})
    with pytest.raises(ProgramError, match="not a list of input names"):
        check({"format": FORMAT, "nodes": nodes, "state": "cache"})


# greedy and drawn, under every processor and cutoff
_CHOICE_SETTINGS = (
    Sampling(),
    Sampling(repetition_penalty=2.0, no_repeat_ngram_size=2, min_length=9),
    Sampling(min_new_tokens=5, suppress_tokens=(0, 4)),
    Sampling(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3),
    Sampling(do_sample=True, min_p=0.1, typical_p=0.8, epsilon_cutoff=0.01, eta_cutoff=0.01),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gear_program_ends_in_the_requests_choice(dtype) -> None:
    """A worker's gear returns each row's token: the request's choice traced onto the end of
    the program makes the tokens the choice makes of the program's logits, for greedy and
    drawn tokens under every processor and cutoff, whatever the logits' dtype."""
    from tessel.runtime.generating import ending_in

    rows, slots, vocab = 3, 10, 40
    program = fx.symbolic_trace(_Head())
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8, vocab, generator=g).to(dtype)
    hidden = torch.randn(rows, 8, generator=g).to(dtype)
    history = torch.randint(0, 6, (rows, slots), generator=g)
    counted = torch.rand(rows, slots, generator=g) < 0.7
    span = torch.tensor([1, 8, 3])
    made = set()
    for sampling in _CHOICE_SETTINGS:
        choice = Choice(sampling, (1, 2), rows, slots, vocab)
        noise = torch.empty(choice.noise_shape).exponential_(generator=g)
        extra = (history, counted, span, noise)
        ended = ending_in(program, choice.traced(torch.device("cpu")))
        first, token = ended(weight, hidden, *extra)
        assert torch.equal(first, hidden * 2)  # the program's other outputs stay
        assert token.dtype == torch.long and token.shape == (rows,)
        assert torch.equal(token, choice(hidden @ weight, *extra)), sampling
        made.add(tuple(token.tolist()))
    assert len(made) > 2  # the settings chose differently: each ran its own processors


def test_the_choice_traces_on_the_device_of_its_gear() -> None:
    """Every tensor the traced choice makes for itself is made on the device it is traced
    for (a CUDA worker's gear): traced on meta, nothing on the CPU is met."""
    for sampling in _CHOICE_SETTINGS:
        traced = Choice(sampling, (1, 2), 3, 10, 40).traced(torch.device("meta"))
        for node in traced.graph.find_nodes(op="get_attr"):
            assert getattr(traced, node.target).device.type == "meta", (sampling, node)


def test_a_choice_is_given_the_history_only_where_a_processor_reads_it() -> None:
    """A device is sent each row's tokens so far every step only for the penalty and the
    n-gram ban; the tokens then equal those made with the history always given."""
    g = torch.Generator().manual_seed(0)
    logits, noise = torch.randn(3, 40, generator=g), _noise(g, 3, 40)
    history = torch.randint(0, 6, (3, 10), generator=g)
    span, nothing = torch.tensor([1, 8, 3]), torch.empty(0, dtype=torch.long)
    reads = []
    for sampling in _CHOICE_SETTINGS:
        choice = Choice(sampling, (1, 2), 3, 10, 40)
        drawn = noise if sampling.do_sample else nothing.float()
        reads.append(choice.history_shape != (0,))
        if not reads[-1]:
            given = choice(logits, history, history > 2, span, drawn)
            assert torch.equal(choice(logits, nothing, nothing.bool(), span, drawn), given)
    assert reads == [False, True, False, False, False]


class _Head(torch.nn.Module):
    def forward(self, weight: torch.Tensor, hidden: torch.Tensor):
        return hidden * 2, hidden @ weight


def test_a_one_token_prefill_gear_is_refused_for_recurrent_states() -> None:
    """A recurrent model's one-token call carries its states on: a one-token prefill gear
    would be the decode program and start a prompt from the last request's states."""
    with pytest.raises(ConfigError, match="a 1-token prompt is padded") as err:
        capture_gears(_hf_model("mamba"), Generation(1, 16, (1, 8)))
    assert (err.value.source, err.value.key) == ("Generation", "prefill_lengths")
