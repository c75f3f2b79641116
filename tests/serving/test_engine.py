"""The serving engine: requests at once, each equal to itself alone (greedy: `transformers`'
own `generate` of its prompt; sampled: `Session.generate` of it alone with its seed), at 1 and
2 devices and with data-parallel replicas; iteration-level scheduling; cancels; the queue."""

from __future__ import annotations

import asyncio
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests.generation_families import MAKERS

import tessel
from tessel.capture.generation import capture_gear
from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.config.parallel_option import ParallelOption
from tessel.demo import tight_cluster
from tessel.package import Package
from tessel.package.fields import PackageError
from tessel.plan import has_rule
from tessel.serving.engine import Engine
from tessel.serving.errors import BadRequest, QueueFull
from tessel.serving.settings import Limits, request_for

GENERATION = tessel.Generation(max_batch_size=4, max_seq_len=32, prefill_lengths=(8, 16))
ROW_PREFILL = replace(GENERATION, row_prefill=True)
SAMPLED = [
    dict(temperature=0.8, top_k=20, top_p=0.9),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.7, repetition_penalty=1.3),
    dict(temperature=1.0, top_p=0.8, top_k=0),
]


def _model() -> torch.nn.Module:
    return MAKERS["llama"]()


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, str]:
    """The small Llama's generation package on 1 device; on 2 tensor-parallel devices too
    small for replicated weights, with one-row prefill gears (each request admitted through
    its own, the cache split); and on two data-parallel replicas of one device each (each
    holding two rows of the cache)."""
    root = tmp_path_factory.mktemp("serve")
    model = _model()
    gear = capture_gear(model, ROW_PREFILL, ROW_PREFILL.prefill_lengths[-1], keep=has_rule)
    tight = cluster_from_dict(tight_cluster(gear, 2), "tight.json")
    # the tests compare each request's tokens with transformers' and Session.generate's:
    # the build's own check is left out
    built = {
        "1": tessel.build(model, cluster=1, generation=GENERATION, verify=False),
        "2": tessel.build(model, cluster=tight, generation=ROW_PREFILL, verify=False),
        "dp2": tessel.build(
            model,
            cluster=2,
            policy=ParallelOption(data_parallel_size=2, tensor_parallel_size=1),
            generation=GENERATION,
            verify=False,
        ),
    }
    return {name: str(tessel.save(b, root / f"llama_{name}")) for name, b in built.items()}


def _workload() -> list[tuple[list[int], int, dict]]:
    """Sixteen requests of mixed prompt lengths and new-token counts, every other one greedy,
    the others sampled with their own seeds and settings."""
    g = torch.Generator().manual_seed(5)
    work = []
    for i in range(16):
        length = int(torch.randint(2, 17, (1,), generator=g))
        prompt = torch.randint(3, 60, (length,), generator=g).tolist()
        room = GENERATION.max_seq_len - next(n for n in (8, 16) if n >= length) + 1
        new = int(torch.randint(2, min(room, 20) + 1, (1,), generator=g))
        fields = {} if i % 2 == 0 else {**SAMPLED[(i // 2) % len(SAMPLED)], "seed": i}
        work.append((prompt, new, fields))
    return work


async def _serve(engine: Engine, work) -> list[list[int]]:
    async def one(prompt, new, fields) -> list[int]:
        return [
            o.token async for o in engine.submit(engine.request(prompt, max_tokens=new, **fields))
        ]

    return await asyncio.gather(*(one(*w) for w in work))


def _greedy_alone(model, prompt: list[int], new: int, eos: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _sampled_alone(session, prompt: list[int], new: int, fields: dict) -> list[int]:
    settings = {k: v for k, v in fields.items()}
    settings["do_sample"] = True
    out = session.generate(0, torch.tensor([prompt]), max_new_tokens=new, **settings)
    return out[0, len(prompt) :].tolist()


def _cut(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """A reference's tokens up to and with its first stop token (a served request ends there)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("layout", ["1", "2", "dp2"])
def test_sixteen_requests_at_once_each_equal_itself_alone(packages, layout) -> None:
    work = _workload()
    with Engine(packages[layout]) as engine:
        eos = engine.limits.eos_token_id
        first = asyncio.run(_serve(engine, work))
        again = asyncio.run(_serve(engine, work))
        stats = engine.stats
    assert first == again
    assert stats["admissions"] == 32 and stats["slots_used"] == 0
    if layout == "2":  # one-row prefill gears: a call per admission, writing its row alone
        assert stats["prefills"] == 32
        boxes = [s.state["cache_0"] for s in Package.open(packages["2"]).manifest.submodels]
        assert boxes[0][1] != boxes[1][1], boxes  # each rank holds its heads of the cache
    assert stats["compactions"] > 0 or layout != "1"
    model = _model()
    session = tessel.Session()
    session.load_graph(0, {}, packages[layout])
    try:
        for i, ((prompt, new, fields), got) in enumerate(zip(work, first)):
            if fields:
                want = _sampled_alone(session, prompt, new, fields)
            else:
                want = _greedy_alone(model, prompt, new, eos)
            assert got == _cut(want, eos), (i, fields)
    finally:
        session.close()


def test_short_requests_join_a_long_one_and_finish_first(packages) -> None:
    """Iteration-level scheduling: requests sent after a long one's first token share its
    decode steps and end before it."""

    async def run(engine: Engine) -> list[str]:
        ended: list[str] = []
        started = asyncio.Event()

        async def long() -> None:
            request = engine.request([5, 6, 7], max_tokens=24, ignore_eos=True)
            async for _ in engine.submit(request):
                started.set()
            ended.append("long")

        async def short(i: int) -> None:
            await started.wait()
            request = engine.request([8 + i, 9, 10], max_tokens=3, ignore_eos=True)
            async for _ in engine.submit(request):
                pass
            ended.append(f"short{i}")

        await asyncio.gather(long(), *(short(i) for i in range(3)))
        return ended

    with Engine(packages["1"]) as engine:
        ended = asyncio.run(run(engine))
        stats = engine.stats
    assert ended[-1] == "long" and len(ended) == 4
    assert stats["admissions"] == 4 and stats["prefills"] <= 4  # a call may admit several
    # one request after another would need 24 + 3 x 3 decode steps
    assert stats["decode_steps"] <= 24 + 2


def test_a_request_left_early_frees_its_slot(packages) -> None:
    async def run(engine: Engine) -> list[int]:
        for i in range(6):
            stream = engine.submit(engine.request([3 + i, 4], max_tokens=20, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
        return [o.token async for o in engine.submit(engine.request([11, 12, 13], max_tokens=6))]

    with Engine(packages["1"]) as engine:
        eos = engine.limits.eos_token_id
        got = asyncio.run(run(engine))
        stats = engine.stats
    assert stats["slots_used"] == 0 and stats["running"] == 0
    assert got == _cut(_greedy_alone(_model(), [11, 12, 13], 6, eos), eos)


def test_a_full_queue_refuses_what_exceeds_it(packages) -> None:
    async def run(engine: Engine) -> list[object]:
        async def one(i: int) -> object:
            try:
                return [o.token async for o in engine.submit(engine.request([3 + i], max_tokens=2))]
            except QueueFull as exc:
                return exc

        return await asyncio.gather(*(one(i) for i in range(7)))

    with Engine(packages["1"], max_queued_requests=1) as engine:
        results = asyncio.run(run(engine))
    refused = [r for r in results if isinstance(r, QueueFull)]
    assert len(refused) == 2  # four slots and one place in the queue
    assert "max-queued-requests" in str(refused[0])


def test_a_package_without_gears_is_refused(tmp_path) -> None:
    model = _model()
    built = tessel.build(model, (torch.randint(0, 60, (1, 8)),), cluster=1)
    path = tessel.save(built, tmp_path / "plain")
    with pytest.raises(ConfigError, match="without generation gears"):
        Engine(path)


LIMITS = Limits(4, (8, 16), 32, 64, (2,), {})


@pytest.mark.parametrize(
    ("prompt", "fields", "param", "words"),
    [
        ([], {}, "prompt", "no token"),
        ([1] * 17, {}, "prompt", "at most 16"),
        ([70], {}, "prompt", "0 to 63"),
        ([1, 2], {"max_tokens": 26}, "max_tokens", "holds 25"),
        ([1, 2], {"max_tokens": 0}, "max_tokens", "at least 1"),
        ([1, 2], {"temperature": -1}, "temperature", "0 or more"),
        ([1, 2], {"temperature": 0.5, "top_p": 0}, "top_p", "(0, 1]"),
        ([1, 2], {"temperature": 0, "top_p": 0.5}, "top_p", "do_sample"),
        ([1, 2], {"min_tokens": -1}, "min_tokens", "at least 0"),
    ],
)
def test_a_bad_request_is_refused_naming_its_field(prompt, fields, param, words) -> None:
    with pytest.raises(BadRequest) as caught:
        request_for(LIMITS, prompt, **fields)
    assert caught.value.param == param and words in str(caught.value)


def test_greedy_with_neutral_sampling_fields_is_taken() -> None:
    request = request_for(LIMITS, [1, 2], temperature=0, top_p=1, top_k=-1, seed=3)
    assert not request.sampling.do_sample
    assert request_for(LIMITS, [1, 2]).max_tokens == 25  # what the cache leaves


def test_inspect_says_how_many_requests_and_how_long(packages) -> None:
    from tessel.report import generation_lines, inspect_json

    manifest = Package.open(packages["2"]).manifest
    assert inspect_json(manifest)["generation"]["serving"] == {
        "slots": 4,
        "longest_prompt": 16,
        "longest_output": 32 - 8 + 1,
        "admission_rows": 1,  # built with one-row prefill gears
    }
    line = next(x for x in generation_lines(manifest) if x.startswith("serving"))
    assert "4 requests at once" in line and "up to 16 tokens" in line and "up to 25 new" in line
    assert "computes its own row" in line
    every_row = Package.open(packages["1"]).manifest
    assert inspect_json(every_row)["generation"]["serving"]["admission_rows"] == 4
    assert "computes all 4 rows" in next(
        x for x in generation_lines(every_row) if x.startswith("serving")
    )


def test_a_hybrid_model_in_pipeline_stages_serves_each_request_as_alone(tmp_path) -> None:
    """Jamba (attention beside Mamba layers) over two pipeline stages: an admission keeps the
    other rows' keys, values, convolution and recurrent states, and the last stage's tokens
    reach every rank."""
    model = MAKERS["jamba"]()
    policy = ParallelOption(pipe_stage_num=2)
    built = tessel.build(model, cluster=2, policy=policy, generation=GENERATION, verify=False)
    path = tessel.save(built, tmp_path / "jamba_pp")
    work = [(prompt, new, {}) for prompt, new, _ in _workload()[:8]]
    with Engine(path) as engine:
        eos = engine.limits.eos_token_id
        got = asyncio.run(_serve(engine, work))
        stats = engine.stats
    assert stats["admissions"] == 8 and stats["prefills"] < 8  # rows admitted together
    for i, ((prompt, new, _), tokens) in enumerate(zip(work, got)):
        assert tokens == _cut(_greedy_alone(model, prompt, new, eos), eos), i


def test_every_sampling_setting_is_served_or_refused_by_name() -> None:
    """The served fields are `Sampling`'s own: each of its settings is one a request sets by
    name, one the model sets, or one a package setting it is refused for."""
    import dataclasses

    from tessel.config.sampling import Sampling
    from tessel.serving.settings import FROM_THE_MODEL, NOT_SERVED, SERVED

    placed = SERVED + FROM_THE_MODEL + NOT_SERVED
    assert sorted(placed) == sorted(f.name for f in dataclasses.fields(Sampling))


def test_max_tokens_defaults_to_the_models_lengths_as_generate_counts_them() -> None:
    """Left out, `max_tokens` is the model's `max_new_tokens`, else what its `max_length`
    leaves after the prompt, at most what the cache leaves."""
    with_new = Limits(4, (8, 16), 32, 64, (2,), {"max_new_tokens": 5})
    assert request_for(with_new, [1, 2]).max_tokens == 5
    with_length = Limits(4, (8, 16), 32, 64, (2,), {"max_length": 12})
    assert request_for(with_length, [1, 2, 3]).max_tokens == 9
    assert request_for(Limits(4, (8, 16), 32, 64, (2,), {"max_length": 99}), [1]).max_tokens == 25
    with pytest.raises(BadRequest, match="leaves no new token") as caught:
        request_for(with_length, [1] * 12)
    assert caught.value.param == "max_tokens"


def test_a_manifest_whose_one_row_gears_differ_from_its_generation_section_is_refused(
    packages, tmp_path
) -> None:
    """A package's `row_prefill` and every rank's `row_gears` agree, or it is not opened."""

    def rewritten(edit) -> Path:
        path = tmp_path / "edited.tessel"
        with zipfile.ZipFile(packages["2"]) as zin, zipfile.ZipFile(path, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item.filename)
                if item.filename == "manifest.json":
                    manifest = json.loads(data)
                    edit(manifest)
                    data = json.dumps(manifest).encode()
                zout.writestr(item.filename, data)
        return path

    assert Package.open(packages["2"]).manifest.generation.row_prefill
    unasked = rewritten(lambda m: m["generation"].pop("row_prefill"))
    with pytest.raises(PackageError, match=r"one-row prefill gears for prompt lengths \[8, 16\]"):
        Package.open(unasked)
    missing = rewritten(lambda m: m["submodels"][1]["row_gears"].pop("16"))
    with pytest.raises(PackageError, match=r"row_prefill asks for \[8, 16\]"):
        Package.open(missing)
