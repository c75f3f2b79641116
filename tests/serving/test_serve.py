"""`tessel serve` as a user starts it (a subprocess on a free port) and queries it with the
official `openai` client: completions and chat, streamed and not, `models.list()`, the
server-sent events on the wire, requests at once each equal to `transformers` alone, bad input
with the server still right after it, disconnects, metrics, overload, SIGTERM's drain and a
worker's death. One package and two servers for the module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tests.conftest import hf_llama, subprocess_env

import tessel
from tessel.cli import main
from tessel.config.errors import ConfigError
from tessel.serving.server import check_port

from .words import VOCAB, word_tokenizer

openai = pytest.importorskip("openai")

TESSEL = [sys.executable, "-m", "tessel.cli"]
GENERATION = tessel.Generation(max_batch_size=4, max_seq_len=48, prefill_lengths=(8, 16))
EOS = 2  # the small Llama's own (transformers' Llama default)
KEY = "sesame"
READY = re.compile(r"at http://127\.0\.0\.1:(\d+) ")


def _model() -> torch.nn.Module:
    return hf_llama(2, 64, 4, 2, VOCAB)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The small Llama's generation package on one device, and the word-level tokenizer with
    its chat template, saved as a user gives them."""
    d = tmp_path_factory.mktemp("serve")
    tessel.save(tessel.build(_model(), cluster=1, generation=GENERATION), d / "tiny")
    word_tokenizer().save_pretrained(d / "tok")
    return d


@dataclass
class Server:
    """A `tessel serve` process: its pid, port, and the files its output and exit code go to."""

    pid: int
    port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exit_code(self, timeout: float) -> int | None:
        """Its exit code once it exited (within `timeout` s), else None."""
        end = time.monotonic() + timeout
        rc = self.folder / "rc"
        while not (rc.exists() and rc.read_text().strip()):
            if time.monotonic() > end:
                return None
            time.sleep(0.05)
        return int(rc.read_text())

    def err(self) -> str:
        return (self.folder / "err.txt").read_text()


def _start(files: Path, name: str, *flags: str) -> Server:
    """Start `tessel serve` on a free port as a job the shell leaves running (not a child of
    this process, so each test's check for leftover processes lets it live across tests); its
    exit code is written to `rc`. Waits for its ready line."""
    folder = files / name
    folder.mkdir()
    argv = [*TESSEL, "serve", str(files / "tiny.tessel"), "--port", "0", *flags]
    job = 'cd "$1"; shift; { "$@" >out.txt 2>err.txt </dev/null & echo $! >pid; wait $!; echo $? >rc; } &'
    subprocess.run(["sh", "-c", job, "sh", str(folder), *argv], env=subprocess_env(), check=True)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        found = (
            READY.search((folder / "out.txt").read_text())
            if (folder / "out.txt").exists()
            else None
        )
        if found:
            server = Server(int((folder / "pid").read_text()), int(found[1]), folder)
            return server
        if (folder / "rc").exists() and (folder / "rc").read_text().strip():
            raise AssertionError(f"tessel serve exited: {(folder / 'err.txt').read_text()}")
        time.sleep(0.1)
    raise AssertionError("tessel serve did not become ready in 300 s")


def _stopped(server: Server, how: int, timeout: float) -> int | None:
    """Signal the server and return its exit code (None: still running after `timeout`), with
    every process it started gone."""
    try:
        family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    if how and family:
        os.kill(server.pid, how)
    code = server.exit_code(timeout)
    _, alive = psutil.wait_procs(family, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"processes left: {[(p.pid, p.name()) for p in alive]}"
    return code


@pytest.fixture(scope="module")
def server(files):
    """The server most tests share: a tokenizer and an API key."""
    started = _start(files, "main", "--tokenizer", str(files / "tok"), "--api-key", KEY)
    yield started
    if started.exit_code(0) is None:
        _stopped(started, signal.SIGKILL, 10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(prompt: list[int], new: int) -> list[int]:
    """`transformers`' greedy tokens for the prompt alone (to its stop token, included)."""
    ids = torch.tensor([prompt])
    out = _model().generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _text(prompt: list[int], tokens: list[int]) -> str:
    """The text of `tokens` after `prompt`, its stop token unwritten."""
    tokenizer = word_tokenizer()
    if tokens and tokens[-1] == EOS:
        tokens = tokens[:-1]
    return tokenizer.decode(prompt + tokens)[len(tokenizer.decode(prompt)) :]


def _metrics(server: Server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_openai_client_sync(server, client) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny"
    assert (model.max_model_len, model.max_prompt_tokens) == (48, 16)  # vLLM's and tessel's

    prompt = [5, 9, 14, 30, 7]
    want = _greedy(prompt, 10)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    (choice,) = done.choices
    assert choice.model_extra["token_ids"] == want
    assert choice.text == _text(prompt, want)
    assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == len(want)

    text = " ".join(f"w{i}" for i in prompt)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=text,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(prompt, want)
    assert chunks[-1].usage.completion_tokens == len(want)

    # a stop string across two tokens: the text before it, the request ended there
    whole = _text(prompt, want)
    stop = _text(prompt + want[:2], want[2:4]).strip()
    cut = client.completions.create(model="tiny", prompt=text, max_tokens=10, stop=[stop])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (
        whole[: whole.find(stop)],
        "stop",
    )
    assert (
        want[: len(cut.choices[0].model_extra["token_ids"])]
        == cut.choices[0].model_extra["token_ids"]
    )

    messages = [{"role": "user", "content": "w7 w8"}]
    chat_prompt = word_tokenizer().encode("w1 w7 w8 w20", add_special_tokens=False)
    want = _greedy(chat_prompt, 6)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert reply.choices[0].message.content == _text(chat_prompt, want)
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == _text(chat_prompt, want)


def test_requests_at_once_each_equal_to_itself_alone(server) -> None:
    g = torch.Generator().manual_seed(7)
    work = []
    for _ in range(8):
        length = int(torch.randint(2, 17, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        work.append((prompt, int(torch.randint(2, 13, (1,), generator=g))))
    sampled = dict(temperature=0.8, top_p=0.9, seed=11, extra_body={"top_k": 20})

    async def run() -> tuple[list, list]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300
        )
        greedy = [client.completions.create(model="tiny", prompt=p, max_tokens=n) for p, n in work]
        seeded = [
            client.completions.create(model="tiny", prompt=work[0][0], max_tokens=8, **sampled)
            for _ in range(2)
        ]
        done = await asyncio.gather(*greedy, *seeded)
        await client.close()
        return done[: len(work)], done[len(work) :]

    greedy, seeded = asyncio.run(run())
    for (prompt, new), done in zip(work, greedy):
        assert done.choices[0].model_extra["token_ids"] == _greedy(prompt, new), prompt
    first, second = (s.choices[0].model_extra["token_ids"] for s in seeded)
    assert first == second  # a seed's tokens, whatever ran beside them


def test_the_stream_on_the_wire(server) -> None:
    body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 3, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: {") and "\n" not in event
        assert json.loads(event[6:])["object"] == "text_completion"


def _post(server: Server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url + path, headers=headers, timeout=120, **kwargs)


GOOD = {"model": "tiny", "prompt": [9, 8, 7], "max_tokens": 4}


@pytest.mark.parametrize(
    "body, key, status, param",
    [
        (b"{oops", KEY, 400, None),
        ({"model": "tiny", "max_tokens": 4}, KEY, 400, "prompt"),
        ({**GOOD, "max_tokens": "4"}, KEY, 400, "max_tokens"),
        ({**GOOD, "model": "other"}, KEY, 404, "model"),
        ({**GOOD, "prompt": list(range(3, 20))}, KEY, 400, "prompt"),
        ({**GOOD, "max_tokens": 46}, KEY, 400, "max_tokens"),
        ({**GOOD, "prompt": [VOCAB]}, KEY, 400, "prompt"),
        ({**GOOD, "logprobs": 2}, KEY, 400, "logprobs"),
        ({**GOOD, "n": 2}, KEY, 400, "n"),
        (GOOD, None, 401, None),
        (GOOD, "wrong", 401, None),
    ],
)
def test_bad_input_leaves_the_server_right(server, body, key, status, param) -> None:
    r = _post(server, "/v1/completions", body, key)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    after = _post(server, "/v1/completions", GOOD).json()
    assert after["choices"][0]["token_ids"] == _greedy([9, 8, 7], 4)
    assert httpx.get(server.url + "/health").status_code == 200


def test_clients_gone_free_their_slots(server) -> None:
    before = _metrics(server)[("tessel_requests_aborted_total", ())]
    body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 40, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def leave(http: httpx.AsyncClient) -> None:
        """Two events read, then the connection closed."""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data:")
                if events == 2:
                    break

    async def twenty() -> None:
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.url, headers=headers, timeout=120, limits=limits
        ) as http:
            await asyncio.gather(*(leave(http) for _ in range(20)))

    asyncio.run(twenty())
    end = time.monotonic() + 10
    while time.monotonic() < end:
        seen = _metrics(server)
        if seen[("tessel_requests_running", ())] == 0 and seen[("tessel_slots_used", ())] == 0:
            break
        time.sleep(0.1)
    assert seen[("tessel_requests_running", ())] == 0
    assert seen[("tessel_slots_used", ())] == 0
    assert seen[("tessel_requests_aborted_total", ())] - before == 20
    after = _post(server, "/v1/completions", GOOD).json()
    assert after["choices"][0]["token_ids"] == _greedy([9, 8, 7], 4)


def test_metrics_count_what_was_sent(server) -> None:
    before = _metrics(server)
    prompts = [[5, 6], [7, 8, 9]]
    for prompt in prompts:
        assert _post(server, "/v1/completions", {**GOOD, "prompt": prompt}).status_code == 200
    after = _metrics(server)

    def grew(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before[(name, labels)]

    made = sum(len(_greedy(p, 4)) for p in prompts)
    finished = sum(
        grew("tessel_request_success_total", (("finished_reason", r),)) for r in ("stop", "length")
    )
    assert finished == 2
    assert grew("tessel_prompt_tokens_total") == 5
    assert grew("tessel_generation_tokens_total") == made
    assert grew("tessel_prefill_calls_total") == 2
    assert grew("tessel_time_to_first_token_seconds_count") == 2
    assert after[("tessel_slots_total", ())] == 4


def _status(call) -> int | None:
    """A call's status, None where nothing listens any more."""
    try:
        return call().status_code
    except httpx.TransportError:
        return None


def test_sigterm_drains_then_exits_0(server) -> None:
    body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 40, "stream": True}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        os.kill(server.pid, signal.SIGTERM)
        time.sleep(0.05)
        # while the stream runs on, nothing new is taken (None: the drain already ended)
        assert _status(lambda: httpx.get(server.url + "/health")) in (503, None)
        assert _status(lambda: _post(server, "/v1/completions", GOOD)) in (503, None)
        rest = [first, *(line for line in lines if line.startswith("data:"))]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in rest[:-1]) == 40
    assert _stopped(server, 0, 30) == 0, server.err()


def test_overload_and_a_dead_worker(files) -> None:
    """Four slots and no queue: of eight requests at once, four run and four get 429. Then a
    worker killed mid-stream: an error event, /health 503, exit 1, no process left."""
    server = _start(files, "overload", "--max-queued-requests", "0")
    try:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(8))
                )

        answers = asyncio.run(burst())
        assert sorted(r.status_code for r in answers) == [200] * 4 + [429] * 4
        for r in answers:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"

        body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            workers = [
                p
                for p in psutil.Process(server.pid).children(recursive=True)
                if p.ppid() != server.pid  # forked from the fork server, the server's child
            ]
            assert len(workers) == 1
            killed = time.monotonic()
            workers[0].kill()
            rest = [line for line in lines if line.startswith("data:")]
        error = next(json.loads(e[6:]) for e in rest if '"error"' in e)
        assert "worker" in error["error"]["message"]
        health = None
        try:
            health = httpx.get(server.url + "/health").status_code
        except httpx.TransportError:  # already gone
            pass
        assert health in (None, 503)
        code = _stopped(server, 0, 10)
        assert code not in (0, None), server.err()
        assert time.monotonic() - killed < 10
    finally:
        if server.exit_code(0) is None:
            _stopped(server, signal.SIGKILL, 10)


def test_http_flags_on_another_node_and_the_clusters_port(files, capsys) -> None:
    package = str(files / "tiny.tessel")
    assert main(["serve", package, "--node-id", "1", "--port", "9000"]) == 2
    assert "--port: is the head's" in capsys.readouterr().err

    # a cluster of two nodes: its head's store listens at the nodes' port
    from types import SimpleNamespace

    from tessel.config.cluster import local_cluster_dict

    cluster = local_cluster_dict(1, port=29600)
    node = cluster["cluster"][0]["cluster_nodes"][0]
    second = {**node, "node_id": 1, "ipaddr": "127.0.0.2", "is_local": False}
    cluster["cluster"][0]["cluster_nodes"].append(second)
    two = SimpleNamespace(
        path="two.tessel", manifest=SimpleNamespace(cluster=cluster, soc_version="cpu")
    )
    with pytest.raises(ConfigError, match="--port.*29600, the cluster's own port"):
        check_port(two, 29600)
    check_port(two, 8000)
