"""tessel serve's HTTP layer (`tessel.serving.http`) over a scripted engine: OpenAI's shapes,
the server-sent events, the refused fields and every error's status, disconnects, metrics.
The same routes over the real engine, as a user starts them, are in test_serve.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tessel.serving.engine import Output, StopStringMatched
from tessel.serving.errors import EngineStopped, QueueFull, QueueTimeout
from tessel.serving.http import app_for
from tessel.serving.metrics import Metrics
from tessel.serving.settings import Limits, Request, request_for

from .words import word_tokenizer as _words

EOS = 63


class ScriptedEngine:
    """The serving engine's surface with a script for its tokens: each is the one after the
    last (`w61`, `w62`, then `w63`, the stop token), one per loop turn. It reports to its
    listener as the engine does, and counts the requests still open."""

    def __init__(self, listener: Metrics | None = None) -> None:
        self.limits = Limits(
            slots=2,
            prefill_lengths=(8, 16),
            max_seq_len=32,
            vocab_size=64,
            eos_token_id=(EOS,),
            defaults={},
        )
        self.listener = listener
        self.healthy = True
        self.refuse: Exception | None = None  # raised by submit
        self.fail_after: int | None = None  # tokens, then a worker's death
        self.wait_forever = False  # never admitted
        self.submitted: list[Request] = []
        self.open = 0
        self.aborted = 0

    def request(self, prompt, **fields) -> Request:
        return request_for(self.limits, prompt, **fields)

    async def submit(self, request: Request) -> AsyncIterator[Output]:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(request)
        self.open += 1
        ended = False
        try:
            if self.wait_forever:
                await asyncio.Event().wait()
            token = request.prompt[-1]
            for i in range(request.max_tokens):
                await asyncio.sleep(0)
                if i == self.fail_after:
                    raise EngineStopped("the engine stopped: a worker stopped")
                token = token + 1 if token < EOS else 1
                made = i + 1
                reason = None
                if token == EOS and not request.ignore_eos and made > request.min_tokens:
                    reason = "stop"
                elif made == request.max_tokens:
                    reason = "length"
                ended = reason is not None  # as the engine's reader marks it, before
                try:
                    yield Output(token, reason)
                except StopStringMatched:  # the caller's stop string: finished, not aborted
                    ended = True
                    if self.listener is not None:
                        self.listener.finished("stop", 0.01, len(request.prompt), made)
                    return
                if reason is not None:
                    if self.listener is not None:
                        self.listener.finished(reason, 0.01, len(request.prompt), made)
                    return
        finally:
            self.open -= 1
            if not ended:
                self.aborted += 1
                if self.listener is not None:
                    self.listener.aborted()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def engine(metrics) -> ScriptedEngine:
    return ScriptedEngine(metrics)


def _client(engine, metrics=None, **kwargs) -> TestClient:
    kwargs.setdefault("tokenizer", _words())
    app = app_for(engine, served_model_name="tiny", metrics=metrics, **kwargs)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def client(engine, metrics) -> TestClient:
    return _client(engine, metrics, system_fingerprint="fp_test")


def _events(response) -> list:
    """The events of a server-sent stream, each checked to be `data: ...` and a blank line."""
    raw = response.text
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    return [e[len("data: ") :] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def _counters(metrics: Metrics) -> dict:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_text_completion_whole(client, engine) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w9", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["system_fingerprint"] == "fp_test"
    assert body["choices"] == [
        {
            "index": 0,
            "text": " w10 w11 w12",
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [10, 11, 12],
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert engine.open == 0 and engine.aborted == 0


def test_a_stop_token_ends_the_text_unwritten(client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "w60", "max_tokens": 9})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" w61 w62", "stop")
    assert choice["token_ids"] == [61, 62, EOS]  # counted in usage, as vLLM counts it
    assert r.json()["usage"]["completion_tokens"] == 3


def test_several_prompts_each_a_choice(client, engine) -> None:
    body = {"model": "tiny", "prompt": [[5], [20, 21], [60]], "max_tokens": 2}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["token_ids"] for c in choices] == [[6, 7], [22, 23], [61, 62]]
    assert [r.prompt for r in engine.submitted] == [(5,), (20, 21), (60,)]
    texts = client.post("/v1/completions", json={**body, "prompt": ["w1", "w2"]}).json()
    assert [c["text"] for c in texts["choices"]] == [" w2 w3", " w3 w4"]


def test_token_ids_without_a_tokenizer(engine) -> None:
    client = _client(engine, tokenizer=None)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [7], "max_tokens": 2})
    assert r.json()["choices"][0]["token_ids"] == [8, 9]
    assert r.json()["choices"][0]["text"] == ""
    for body, param in [
        ({"prompt": "w7"}, "prompt"),
        ({"prompt": [7], "stop": "w9"}, "stop"),
    ]:
        r = client.post("/v1/completions", json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "--tokenizer" in r.json()["error"]["message"]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "w1"}]},
    )
    assert r.status_code == 400 and "--tokenizer" in r.json()["error"]["message"]


def test_the_stream_is_server_sent_events(client) -> None:
    body = {
        "model": "tiny",
        "prompt": "w5",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " w6 w7 w8"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    # without include_usage, no usage chunk and no usage field
    events = _events(client.post("/v1/completions", json={**body, "stream_options": None}))
    assert len(events) == 4 and "usage" not in events[0]


def test_a_chat_through_the_template_with_one_bos(engine) -> None:
    client = _client(engine, tokenizer=_words(bos=True))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    # "w3" (the BOS, written by the template) "w1 w9" "w20" (the generation prompt)
    assert engine.submitted[-1].prompt == (3, 1, 9, 20)
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w21 w22"}
    assert r.json()["object"] == "chat.completion"
    body["messages"][0]["content"] = [{"type": "text", "text": "w9"}]  # OpenAI's parts
    body.update(stream=True, max_completion_tokens=2)
    del body["max_tokens"]
    events = _events(client.post("/v1/chat/completions", json=body))
    assert engine.submitted[-1].prompt == (3, 1, 9, 20)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == " w21 w22"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_chat_without_a_template_is_refused(engine) -> None:
    client = _client(engine, tokenizer=_words(template=None))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w9"}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
    assert "chat template" in r.json()["error"]["message"]


def test_a_stop_string_ends_the_request_there(client, engine, metrics) -> None:
    body = {"model": "tiny", "prompt": "w5", "max_tokens": 9, "stop": ["w8 w9", "w40"]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" w6 w7 ", "stop")
    assert choice["token_ids"] == [6, 7, 8, 9]  # the engine's request closed at the match
    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " w6 w7 "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert engine.open == 0
    counts = _counters(metrics)
    assert counts[("tessel_request_success_total", (("finished_reason", "stop"),))] == 2
    assert counts[("tessel_requests_aborted_total", ())] == 0


ONE = {"model": "tiny", "prompt": "w5", "max_tokens": 2}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "w5"}, "model"),
        ({"model": "tiny"}, "prompt"),
        ({**ONE, "max_tokens": "2"}, "max_tokens"),
        ({**ONE, "max_tokens": True}, "max_tokens"),
        ({**ONE, "max_tokens": 0}, "max_tokens"),
        ({**ONE, "temperature": -1}, "temperature"),
        ({**ONE, "stream": "yes"}, "stream"),
        ({**ONE, "prompt": []}, "prompt"),
        ({**ONE, "prompt": [1, "w2"]}, "prompt"),
        ({**ONE, "prompt": [64]}, "prompt"),
        ({**ONE, "stop": [""]}, "stop"),
        ({**ONE, "max_token": 3}, "max_token"),
        ({**ONE, "n": 2}, "n"),
        ({**ONE, "best_of": 2}, "best_of"),
        ({**ONE, "logprobs": 1}, "logprobs"),
        ({**ONE, "logit_bias": {"5": 10}}, "logit_bias"),
        ({**ONE, "presence_penalty": 0.5}, "presence_penalty"),
        ({**ONE, "frequency_penalty": -1}, "frequency_penalty"),
        ({**ONE, "echo": True}, "echo"),
        ({**ONE, "suffix": "w9"}, "suffix"),
        ({**ONE, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**ONE, "stream": True, "stream_options": {"every": 1}}, "stream_options.every"),
    ],
)
def test_a_bad_completion_is_a_400_naming_its_field(client, engine, body, param) -> None:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert param.split(".")[0] in error["message"]
    assert client.post("/v1/completions", json=ONE).json()["choices"][0]["text"] == " w6 w7"
    assert engine.open == 0


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "w1"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**CHAT, "logprobs": True}, "logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "max_completion_tokens": 3}, "max_completion_tokens"),
    ],
)
def test_a_bad_chat_is_a_400_naming_its_field(client, body, param) -> None:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_fields_that_change_nothing_are_taken(client, engine) -> None:
    body = {
        **ONE,
        "user": "someone",
        "metadata": {"team": "x"},
        "n": 1,
        "best_of": 1,
        "logprobs": None,
        "presence_penalty": 0,
        "temperature": 0,
        "top_p": 1,
        "seed": 3,
    }
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == " w6 w7"
    assert not engine.submitted[-1].sampling.do_sample
    chat = {**CHAT, "logprobs": False, "tool_choice": "none", "response_format": {"type": "text"}}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    stream = {**ONE, "stream": True, "stream_options": {"include_usage": False}}
    assert _events(client.post("/v1/completions", json=stream))[-1] == "[DONE]"
    # vLLM's sampling extras reach the request
    extras = {**ONE, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1}
    extras.update(ignore_eos=True, temperature=0.5, seed=7)
    assert client.post("/v1/completions", json=extras).status_code == 200
    request = engine.submitted[-1]
    assert (request.sampling.top_k, request.sampling.min_p, request.sampling.seed) == (5, 0.1, 7)
    assert (request.min_tokens, request.ignore_eos) == (1, True)


def test_errors_of_the_body_itself(client, metrics) -> None:
    for raw, status in [(b"{not json", 400), (b"[1, 2]", 400), (b"\xff", 400)]:
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={**ONE, "model": "other"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    counts = _counters(metrics)
    assert counts[("tessel_requests_rejected_total", (("reason", "bad_request"),))] == 4


def test_a_body_past_the_limit_is_a_413(engine) -> None:
    client = _client(engine, max_body_bytes=100)
    r = client.post("/v1/completions", json={**ONE, "prompt": "w1 " * 50})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it is read
        yield json.dumps({**ONE, "prompt": "w1 " * 50}).encode()

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert client.post("/v1/completions", json=ONE).status_code == 200


def test_a_key_where_one_is_set(engine) -> None:
    client = _client(engine, api_key="sesame")
    assert client.post("/v1/completions", json=ONE).status_code == 401
    wrong = {"Authorization": "Bearer open"}
    r = client.post("/v1/completions", json=ONE, headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    right = {"Authorization": "Bearer sesame"}
    assert client.post("/v1/completions", json=ONE, headers=right).status_code == 200
    assert client.get("/v1/models", headers=right).status_code == 200
    assert client.get("/health").status_code == 200  # probes need no key


def test_a_prompt_past_the_package_is_refused_with_the_numbers(client, metrics) -> None:
    r = client.post("/v1/completions", json={**ONE, "prompt": "w1 " * 17})
    assert r.status_code == 400
    assert "17 tokens" in r.json()["error"]["message"] and "16" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**ONE, "max_tokens": 30})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    counts = _counters(metrics)
    assert counts[("tessel_requests_rejected_total", (("reason", "too_long"),))] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_the_engines_refusals_are_real_statuses(client, engine, stream) -> None:
    engine.refuse = QueueFull("the queue is full")
    r = client.post("/v1/completions", json={**ONE, "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    engine.refuse = EngineStopped("the engine is draining")
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_stopped"
    engine.refuse = QueueTimeout("the request waited 0.5 s for a slot (--queue-timeout)")
    r = client.post("/v1/completions", json={**ONE, "stream": stream})
    assert r.status_code == 503 and r.json()["error"]["type"] == "timeout"
    engine.refuse = None
    assert client.post("/v1/completions", json=ONE).status_code == 200


def test_a_worker_gone_mid_stream_ends_it_with_an_error_event(client, engine) -> None:
    engine.fail_after = 2
    events = _events(client.post("/v1/completions", json={**ONE, "max_tokens": 5, "stream": True}))
    assert [e["choices"][0]["text"] for e in events[:2]] == [" w6", " w7"]
    assert events[2]["error"]["type"] == "engine_stopped" and events[3] == "[DONE]"
    r = client.post("/v1/completions", json={**ONE, "max_tokens": 5})
    assert r.status_code == 503 and "worker" in r.json()["error"]["message"]
    assert engine.open == 0


def test_models_health_and_loading(client, engine) -> None:
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "tiny" and model["object"] == "model"
    assert (model["max_model_len"], model["max_prompt_tokens"], model["slots"]) == (32, 16, 2)
    assert client.get("/health").status_code == 200
    engine.healthy = False
    assert client.get("/health").status_code == 503
    loading = _client(None)
    assert loading.get("/health").status_code == 503
    r = loading.post("/v1/completions", json=ONE)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    loading.app.state.engine = engine
    engine.healthy = True
    assert loading.get("/health").status_code == 200


def test_metrics_count_what_was_sent(client, metrics) -> None:
    for prompt in ("w5", "w61"):  # to its length; to the stop token
        assert client.post("/v1/completions", json={**ONE, "prompt": prompt}).status_code == 200
    metrics.loop({"running": 1, "waiting": 2, "slots_used": 1, "prefills": 2, "decode_steps": 5})
    metrics.loop({"running": 0, "waiting": 0, "slots_used": 0, "prefills": 3, "decode_steps": 9})
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    counts = _counters(metrics)
    assert counts[("tessel_request_success_total", (("finished_reason", "length"),))] == 1
    assert counts[("tessel_request_success_total", (("finished_reason", "stop"),))] == 1
    assert counts[("tessel_prompt_tokens_total", ())] == 2
    assert counts[("tessel_generation_tokens_total", ())] == 4
    assert counts[("tessel_prefill_calls_total", ())] == 3
    assert counts[("tessel_decode_steps_total", ())] == 9
    assert counts[("tessel_slots_total", ())] == 2
    assert counts[("tessel_requests_waiting", ())] == 0


async def _asgi(app, body: dict, disconnect_after: int) -> list[dict]:
    """Call `app` as a server would, the client leaving after `disconnect_after` body chunks
    (0: before any answer)."""
    sent: list[dict] = []
    bodies = asyncio.Event()
    raw = json.dumps(body).encode()
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after:
            await bodies.wait()
        else:
            await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body"]
        if len(chunks) >= disconnect_after:
            bodies.set()
        await asyncio.sleep(0.01)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


def test_a_client_gone_closes_its_request(engine, metrics) -> None:
    app = app_for(engine, tokenizer=_words(), served_model_name="tiny", metrics=metrics)
    body = {**ONE, "max_tokens": 25, "stream": True}
    for _ in range(3):
        asyncio.run(_asgi(app, body, disconnect_after=2))
    assert engine.open == 0 and engine.aborted == 3
    engine.wait_forever = True  # gone while queued, streamed or not
    asyncio.run(_asgi(app, body, disconnect_after=0))
    asyncio.run(_asgi(app, {**body, "stream": False}, disconnect_after=0))
    assert engine.open == 0 and engine.aborted == 5
    assert _counters(metrics)[("tessel_requests_aborted_total", ())] == 5
