"""The bodies of OpenAI's completions and chat completions requests as tessel serve takes them:
each field checked by type (pydantic, strict: `"5"` is not 5, `true` is not 1), a field that
would change the output and is not built refused with a 400 naming it (tessel's rule: refused,
never ignored), a field that cannot change it accepted, an unknown field refused by name.

No torch and no engine here: what a body asks, in the engine's terms (`Asked`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tessel.serving.errors import BadRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding OpenAI may add to chunks: none here


class _Body(_Strict):
    """The fields both routes take."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None
    # vLLM's extra sampling fields, in the body as vLLM takes them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # cannot change the output: accepted
    user: str | None = None
    metadata: dict[str, str] | None = None
    # refused unless at a value that changes nothing (`refuse_unbuilt`)
    n: int | None = None
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionBody(_Body):
    """`POST /v1/completions`."""

    prompt: Any
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatBody(_Body):
    """`POST /v1/chat/completions`."""

    messages: Any
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None


# the engine's fields (`tessel.serving.settings.request_for`) a body may set
ENGINE_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "ignore_eos",
)


@dataclass(frozen=True)
class Asked:
    """What a body asks: its prompts (each a text or token ids; a chat's messages), the engine's
    fields for each, its stop strings, and how it is answered."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict[str, Any], ...] | None
    fields: Mapping[str, Any]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _where(loc: tuple) -> str:
    """A field's path as a client writes it: `messages[0].content`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_json(raw: bytes) -> Any:
    """The body's JSON, or a 400 saying where it is not JSON."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


def _validated(kind: type[_Body], body: Any) -> Any:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, found {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _where(first["loc"])
        if first["type"] == "extra_forbidden":
            raise BadRequest(
                f"{where} is not a field tessel serve takes (OpenAI's and vLLM's fields it "
                "builds, and user and metadata)",
                where,
            ) from None
        if first["type"] == "missing":
            raise BadRequest(f"{where} is required", where) from None
        given = first.get("input")
        raise BadRequest(f"{where}: {first['msg'].lower()}, found {given!r}", where) from None


def refuse_unbuilt(body: _Body) -> None:
    """A 400 naming the first field that would change the output and is not built."""
    checks: list[tuple[str, bool, str]] = [
        ("n", body.n not in (None, 1), "one choice per prompt (n: 1)"),
        ("logprobs", body.logprobs not in (None, False), "no log probabilities"),
        ("logit_bias", body.logit_bias not in (None, {}), "no logit biases"),
        ("presence_penalty", body.presence_penalty not in (None, 0), "no presence penalty"),
        ("frequency_penalty", body.frequency_penalty not in (None, 0), "no frequency penalty"),
    ]
    if isinstance(body, CompletionBody):
        checks += [
            ("echo", bool(body.echo), "no echo of the prompt"),
            ("suffix", body.suffix not in (None, ""), "no suffix"),
            ("best_of", body.best_of not in (None, 1), "one candidate per prompt (best_of: 1)"),
        ]
    if isinstance(body, ChatBody):
        checks += [
            ("top_logprobs", body.top_logprobs not in (None, 0), "no log probabilities"),
            ("tools", body.tools not in (None, []), "no tools"),
            ("tool_choice", body.tool_choice not in (None, "none"), "no tools"),
            (
                "response_format",
                body.response_format not in (None, {"type": "text"}),
                "free text only",
            ),
        ]
    for name, unbuilt, what in checks:
        if unbuilt:
            value = getattr(body, name)
            raise BadRequest(f"{name} is {value!r}: tessel serve builds {what}; leave it out", name)


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if value is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(
            f"stop must be a string or a list of strings, none empty, found {value!r}", "stop"
        )
    return tuple(stops)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A completions prompt: a text, token ids, or a list of either (each a request)."""
    if isinstance(value, str):
        return (value,)
    if _is_ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(_is_ids(p) for p in value):
            return tuple(tuple(p) for p in value)
    raise BadRequest(
        "prompt must be a string, a list of token ids, or a non-empty list of either "
        f"(each its own request), found {value!r:.200}",
        "prompt",
    )


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    """A chat's messages as a chat template takes them: role and text content (OpenAI's text
    parts joined by new lines, as vLLM joins them), and `name` where given."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"messages must be a non-empty list, found {value!r:.200}", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object, found {message!r:.200}", where)
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise BadRequest(
                f"{where}.{unknown[0]} is not built: messages take role, content and name",
                f"{where}.{unknown[0]}",
            )
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise BadRequest(
                f"{where}.role must be system, developer, user or assistant, found {role!r}",
                f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise BadRequest(
                        f"{where}.content[{j}] must be a text part "
                        f'({{"type": "text", "text": ...}}), found {part!r:.200}',
                        f"{where}.content[{j}]",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str) and not (content is None and role == "assistant"):
            raise BadRequest(
                f"{where}.content must be a string or a list of text parts, found {content!r:.200}",
                f"{where}.content",
            )
        kept = {"role": role, "content": content or ""}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise BadRequest(f"{where}.name must be a string", f"{where}.name")
            kept["name"] = message["name"]
        out.append(kept)
    return tuple(out)


def _asked(body: _Body, prompts: tuple, messages: tuple | None, max_tokens: int | None) -> Asked:
    refuse_unbuilt(body)
    stream = bool(body.stream)
    options = body.stream_options
    if options is not None and options.include_usage is not None and not stream:
        raise BadRequest("stream_options is taken only with stream: true", "stream_options")
    fields = {name: getattr(body, name) for name in ENGINE_FIELDS}
    fields["max_tokens"] = max_tokens
    return Asked(
        model=body.model,
        prompts=prompts,
        messages=messages,
        fields={k: v for k, v in fields.items() if v is not None},
        stop=_stops(body.stop),
        stream=stream,
        include_usage=bool(options and options.include_usage),
    )


def completion_asked(body: Any) -> Asked:
    """A completions body checked; 400 (`BadRequest` naming the field) otherwise."""
    parsed = _validated(CompletionBody, body)
    return _asked(parsed, _prompts(parsed.prompt), None, parsed.max_tokens)


def chat_asked(body: Any) -> Asked:
    """A chat completions body checked (`max_completion_tokens`, else `max_tokens`)."""
    parsed = _validated(ChatBody, body)
    wanted = parsed.max_completion_tokens
    if wanted is None:
        wanted = parsed.max_tokens
    elif parsed.max_tokens is not None and parsed.max_tokens != wanted:
        raise BadRequest(
            f"max_completion_tokens is {wanted} and max_tokens {parsed.max_tokens}; send one",
            "max_completion_tokens",
        )
    messages = _messages(parsed.messages)
    return _asked(parsed, (), messages, wanted)
