"""tessel serve's HTTP routes, OpenAI's as its clients expect them, over a serving `Engine`:
`POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events, or whole),
`GET /v1/models`, `GET /health`, `GET /metrics`.

The process only parses, tokenizes, queues and relays: the engine's tokens become text here
(`tessel.serving.text`), one request's at a time as they come. Every error is OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, never a traceback; a streamed answer sends
its 200 only once the engine gave its first token, so a full queue is a real 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessel.serving.engine import StopStringMatched
from tessel.serving.errors import BadRequest, EngineStopped, ServingError
from tessel.serving.metrics import Metrics
from tessel.serving.protocol import Asked, chat_asked, completion_asked, parse_json
from tessel.serving.text import TextStream

log = logging.getLogger("tessel.serving")

T = TypeVar("T")

MAX_BODY_BYTES = 1 << 20


class BodyTooLarge(ServingError):
    """A body past `max_body_bytes` (`--max-body-bytes`)."""

    status = 413
    kind = "invalid_request_error"


class NotFound(ServingError):
    """A model this server does not serve."""

    status = 404
    kind = "invalid_request_error"
    code = "model_not_found"


class _ClientGone(Exception):
    """The client closed its connection before its answer."""


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(exc: ServingError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    code = getattr(exc, "code", None)
    return JSONResponse(
        error_body(str(exc), exc.kind, exc.param, code), status_code=exc.status, headers=headers
    )


def _event(data: dict | str) -> str:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


class _Guard:
    """Before any route: the bearer key on `/v1/` where one is set (401), and the body's size
    (413: from its Content-Length at once, else as it is read)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            scheme, _, key = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), self.api_key.encode()
            ):
                body = error_body(
                    "a wrong or missing API key: send Authorization: Bearer KEY with the key "
                    "the server was started with (--api-key)",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            exc = BodyTooLarge(self._too_large(int(length)))
            await _error_response(exc)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self._too_large(seen))
            return message

        await self.app(scope, counted, send)

    def _too_large(self, size: int) -> str:
        return (
            f"the body has {size} bytes or more; this server takes at most "
            f"{self.max_body_bytes} (--max-body-bytes)"
        )


class _EventStream(StreamingResponse):
    """Server-sent events whose requests are closed however the response ends (a client gone
    mid-send included, or before the first event), so the engine frees their slots at once."""

    def __init__(self, events: AsyncIterator[str], closing: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._closing()


@dataclass
class _Piece:
    """New text of one choice, the tokens it came from, and its end where it ended."""

    index: int
    text: str
    tokens: list[int]
    finish_reason: str | None = None


_END = object()


@dataclass
class _Choices:
    """A call's requests (a completions call's prompts; a chat's one) run side by side: their
    first pieces awaited together (an error then is the call's status), the rest merged as they
    come. `close` ends every request still running (its slot freed at the next step)."""

    runs: list[AsyncIterator[_Piece]]
    _pumps: list[asyncio.Task] = field(default_factory=list)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def first(self) -> list[_Piece]:
        tasks = [asyncio.ensure_future(anext(run)) for run in self.runs]  # type: ignore[arg-type]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            exc = task.exception() if not task.cancelled() else None
            if exc is not None:
                raise exc
        return [task.result() for task in tasks]

    async def rest(self) -> AsyncIterator[_Piece | BaseException]:
        """The pieces after the first ones; an error ends the iteration as its last item."""

        async def pump(run: AsyncIterator[_Piece]) -> None:
            try:
                async for piece in run:
                    self._queue.put_nowait(piece)
            except Exception as exc:  # an engine's error, handed to the answer
                self._queue.put_nowait(exc)
            finally:
                self._queue.put_nowait(_END)

        self._pumps = [asyncio.ensure_future(pump(run)) for run in self.runs]
        ended = 0
        while ended < len(self.runs):
            item = await self._queue.get()
            if item is _END:
                ended += 1
                continue
            yield item
            if isinstance(item, BaseException):
                return

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for run in self.runs:
            with contextlib.suppress(RuntimeError):
                await run.aclose()  # type: ignore[attr-defined]


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `_ClientGone` (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


class _Routes:
    """The state the routes share: the engine (None while it loads), the tokenizer, names."""

    def __init__(
        self,
        app: FastAPI,
        tokenizer: Any,
        served_model_name: str,
        metrics: Metrics | None,
        system_fingerprint: str | None,
    ) -> None:
        self.app = app
        self.tokenizer = tokenizer
        self.name = served_model_name
        self.metrics = metrics
        self.fingerprint = system_fingerprint
        self.created = int(time.time())

    @property
    def engine(self) -> Any:
        engine = self.app.state.engine
        if engine is None:
            raise EngineStopped("the model is still loading; try again when /health answers 200")
        return engine

    # -- turning a body into the engine's requests ----------------------------------------

    def _check_model(self, body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != self.name:
            exc = NotFound(
                f"the model {model!r} is not served here; this server serves {self.name!r} "
                "(GET /v1/models)",
                "model",
            )
            raise exc

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                "this server takes token ids (a list of ints as the prompt); start it with "
                "--tokenizer DIR to send text",
                "prompt",
            )
        return list(self.tokenizer.encode(text))

    def _chat_ids(self, messages: tuple[dict[str, Any], ...]) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                "chat needs a tokenizer with a chat template: start the server with "
                "--tokenizer DIR, or send token ids to /v1/completions",
                "messages",
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(
                "the tokenizer (--tokenizer) has no chat template (chat_template in its "
                "tokenizer_config.json); give one that has, or send the prompt to "
                "/v1/completions",
                "messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own refusal (jinja2's raise_exception)
            raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from None
        # the template wrote the BOS where the model wants one: none added a second time
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _requests(self, asked: Asked) -> list[Any]:
        if asked.stop and self.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer: start with --tokenizer DIR", "stop")
        if asked.messages is not None:
            prompts: list[list[int]] = [self._chat_ids(asked.messages)]
        else:
            prompts = [list(p) if isinstance(p, tuple) else self._encode(p) for p in asked.prompts]
        engine = self.engine
        out = []
        for ids in prompts:
            try:
                out.append(engine.request(ids, **asked.fields))
            except BadRequest as exc:
                limits = engine.limits
                wanted = asked.fields.get("max_tokens")
                if len(ids) > limits.longest_prompt or (
                    isinstance(wanted, int) and wanted > limits.room(len(ids))
                ):
                    exc.rejected = "too_long"  # type: ignore[attr-defined]
                raise
        return out

    # -- running them -----------------------------------------------------------------------

    async def _pieces(
        self, request: Any, index: int, stop: tuple[str, ...]
    ) -> AsyncIterator[_Piece]:
        """One request's pieces: its tokens through a `TextStream` (none without a
        tokenizer); a stop string matched ends the request there, `finish_reason` "stop"."""
        engine = self.engine
        texts = None if self.tokenizer is None else TextStream(self.tokenizer, request.prompt, stop)
        outputs = engine.submit(request)
        try:
            async for out in outputs:
                text = ""
                reason = out.finish_reason
                if texts is not None:
                    if reason != "stop":  # a stop token's own text is not the answer's
                        text = texts.push(out.token)
                    if reason is not None:
                        text += texts.finish()
                    if texts.stopped is not None:
                        if reason is None:  # the request ends here, by the stop string
                            with contextlib.suppress(StopAsyncIteration):
                                await outputs.athrow(StopStringMatched())  # type: ignore[attr-defined]
                        reason = "stop"
                yield _Piece(index, text, [out.token], reason)
                if texts is not None and texts.stopped is not None:
                    return
                # at the engine's own end its iteration ends too (it reports the end then)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]

    def _choices(self, asked: Asked, requests: list[Any]) -> _Choices:
        return _Choices([self._pieces(r, i, asked.stop) for i, r in enumerate(requests)])

    async def answer(
        self, request: Request, asked: Asked, requests: list[Any], chat: bool
    ) -> Response:
        """The whole answer, or the stream of it, once every request gave its first token."""
        choices = self._choices(asked, requests)
        handed = False
        try:
            try:
                firsts = await _unless_gone(request, choices.first())
            except _ClientGone:
                return Response(status_code=499)
            if asked.stream:
                handed = True
                events = self._events(asked, requests, choices, firsts, chat)
                return _EventStream(events, choices.close)
            try:
                pieces = await _unless_gone(request, self._gathered(choices, firsts))
            except _ClientGone:
                return Response(status_code=499)
            return JSONResponse(self._whole(asked, requests, pieces, chat))
        finally:
            if not handed:
                await choices.close()

    @staticmethod
    async def _gathered(choices: _Choices, firsts: list[_Piece]) -> list[_Piece]:
        pieces = list(firsts)
        async for item in choices.rest():
            if isinstance(item, BaseException):
                raise item
            pieces.append(item)
        return pieces

    def _usage(self, requests: list[Any], made: int) -> dict[str, int]:
        prompt = sum(len(r.prompt) for r in requests)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def _head(self, kind: str, ident: str, created: int) -> dict[str, Any]:
        head: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": self.name}
        if self.fingerprint is not None:
            head["system_fingerprint"] = self.fingerprint
        return head

    def _whole(self, asked: Asked, requests: list[Any], pieces: list[_Piece], chat: bool) -> dict:
        texts = [""] * len(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * len(requests)
        for piece in pieces:
            texts[piece.index] += piece.text
            tokens[piece.index] += piece.tokens
            reasons[piece.index] = piece.finish_reason or reasons[piece.index]
        made = sum(len(t) for t in tokens)
        created = int(time.time())
        if chat:
            body = self._head("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", created)
            body["choices"] = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": texts[0]},
                    "logprobs": None,
                    "finish_reason": reasons[0],
                    "token_ids": tokens[0],
                }
            ]
        else:
            body = self._head("text_completion", f"cmpl-{uuid.uuid4().hex}", created)
            body["choices"] = [
                {
                    "index": i,
                    "text": texts[i],
                    "logprobs": None,
                    "finish_reason": reasons[i],
                    "token_ids": tokens[i],
                }
                for i in range(len(requests))
            ]
        body["usage"] = self._usage(requests, made)
        return body

    async def _events(
        self,
        asked: Asked,
        requests: list[Any],
        choices: _Choices,
        firsts: list[_Piece],
        chat: bool,
    ) -> AsyncIterator[str]:
        """The stream: a chunk per piece of text (per token without a tokenizer), a usage
        chunk where asked, `data: [DONE]` last; an engine's error (a worker gone) as an error
        event before it."""
        created = int(time.time())
        if chat:
            head = self._head("chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}", created)
        else:
            head = self._head("text_completion", f"cmpl-{uuid.uuid4().hex}", created)
        if asked.include_usage:
            head["usage"] = None
        held: dict[int, list[int]] = {}  # tokens of text not sent yet, by choice
        made = 0

        def chunk(piece: _Piece) -> str | None:
            nonlocal made
            made += len(piece.tokens)
            tokens = held.setdefault(piece.index, [])
            tokens += piece.tokens
            if not piece.text and piece.finish_reason is None and self.tokenizer is not None:
                return None  # text held back: nothing to send yet
            held[piece.index] = []
            if chat:
                delta = {"content": piece.text} if piece.text else {}
                choice: dict[str, Any] = {"index": piece.index, "delta": delta}
            else:
                choice = {"index": piece.index, "text": piece.text}
            choice.update(logprobs=None, finish_reason=piece.finish_reason, token_ids=tokens)
            return _event({**head, "choices": [choice]})

        try:
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                role.update(logprobs=None, finish_reason=None)
                yield _event({**head, "choices": [role]})
            for piece in firsts:
                if (sent := chunk(piece)) is not None:
                    yield sent
            async for item in choices.rest():
                if isinstance(item, BaseException):
                    yield _event(self._stream_error(item))
                    break
                if (sent := chunk(item)) is not None:
                    yield sent
            else:
                if asked.include_usage:
                    usage = {**head, "choices": [], "usage": self._usage(requests, made)}
                    yield _event(usage)
            yield _event("[DONE]")
        finally:
            await choices.close()

    @staticmethod
    def _stream_error(exc: BaseException) -> dict:
        if isinstance(exc, ServingError):
            return error_body(str(exc), exc.kind, exc.param, exc.status)
        log.error("a stream ended by an error", exc_info=exc)
        return error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, 500)


def app_for(
    engine: Any,
    *,
    tokenizer: Any = None,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    metrics: Metrics | None = None,
    system_fingerprint: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (a `tessel.serving.Engine`; None while it loads: set
    `app.state.engine` once loaded, /health answers 503 till then) under `served_model_name`.
    `tokenizer` (a `transformers` tokenizer) turns text prompts and chat messages into token
    ids and tokens into text; without one, prompts are token ids. `metrics` (the engine's
    listener) is rendered at /metrics."""
    app = FastAPI(title="tessel serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    routes = _Routes(app, tokenizer, served_model_name, metrics, system_fingerprint)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    if metrics is not None and engine is not None:
        metrics.slots_total.set(engine.limits.slots)

    def rejected(reason: str) -> None:
        if metrics is not None:
            metrics.rejected(reason)

    @app.exception_handler(ServingError)
    async def serving_error(request: Request, exc: ServingError) -> Response:
        if exc.status in (400, 404, 413):  # the engine counts its own (queue_full, timeout)
            rejected(getattr(exc, "rejected", "bad_request"))
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        rejected("bad_request")
        message = f"{param or 'the body'}: {first.get('msg', 'is not valid')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, "server_error", None, 500), status_code=500)

    async def _body(request: Request) -> Any:
        body = parse_json(await request.body())
        routes._check_model(body)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        asked = completion_asked(await _body(request))
        return await routes.answer(request, asked, routes._requests(asked), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        asked = chat_asked(await _body(request))
        return await routes.answer(request, asked, routes._requests(asked), chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        limits = routes.engine.limits
        model = {
            "id": served_model_name,
            "object": "model",
            "created": routes.created,
            "owned_by": "tessel",
            "root": served_model_name,
            "max_model_len": limits.max_seq_len,
            "max_prompt_tokens": limits.longest_prompt,
            "slots": limits.slots,
        }
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/health")
    async def health() -> Response:
        engine = app.state.engine
        if engine is None:
            why = "the model is still loading"
        elif not engine.healthy:
            why = "the engine takes no requests: it is draining, closed, or a worker stopped"
        else:
            return JSONResponse({"status": "ok"})
        body = error_body(why, "engine_stopped", None, 503)
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise StarletteHTTPException(404, "this server keeps no metrics")
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    return app
