"""A request's text as its tokens come, for streaming: each piece is sent once and never taken
back, so a piece is held while it could still change.

Two things can change what the last tokens read as. A character of several UTF-8 bytes made of
several tokens (byte-level vocabularies, sentencepiece's byte fallback) decodes to U+FFFD until
its last byte comes: `Detokenizer` holds back a tail that ends in U+FFFD (as TGI's and vLLM's
incremental detokenizers do). And a `stop` string can span tokens: `TextStream` matches the
stop strings on the decoded text, leaves the stop text out, and holds back a tail that is the
start of a stop string until it becomes one or cannot.

No model and no torch: any `transformers` tokenizer (its `decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"

# how many of the prompt's last tokens the first new token is decoded after (vLLM's 5): a
# tokenizer's leading-space rule sees the text before it, and each decode stays short
CONTEXT_TOKENS = 5


class Detokenizer:
    """Text deltas for tokens pushed one at a time, decoded after the last few prompt tokens
    (so the first token's leading space is what the whole text would hold). Each delta is the
    text that `tokens[prefix:]` adds over `tokens[prefix:read]`, sent only when it does not end
    in U+FFFD: a character never splits across deltas."""

    def __init__(
        self, tokenizer: Any, prompt: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt[len(prompt) - CONTEXT_TOKENS :] if prompt else [])
        self._prefix = 0  # where the decoded window starts
        self._read = len(self._ids)  # the tokens before this are sent

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _delta(self) -> tuple[str, str]:
        return self._decode(self._ids[self._prefix : self._read]), self._decode(
            self._ids[self._prefix :]
        )

    def push(self, token: int) -> str:
        """The text that `token` completes: "" while it ends in a partial character."""
        self._ids.append(token)
        before, text = self._delta()
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """The text held back at the end: a character whose bytes never all came reads as
        U+FFFD, as a whole decode would show it."""
        before, text = self._delta()
        self._prefix = self._read = len(self._ids)
        return text[len(before) :] if len(text) > len(before) else ""


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many last characters of `text` begin a stop string (the longest such tail)."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0


class TextStream:
    """A request's text piece by piece: `push` each token, `finish` at its last. Where a stop
    string appears, the text before it is the last piece and `stopped` names the stop string
    (the caller ends the request, `finish_reason` "stop"); the stop text is left out. Text that
    could still become a stop string is held until it does or cannot."""

    def __init__(
        self,
        tokenizer: Any,
        prompt: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("a stop string must hold at least one character")
        self._detokenizer = Detokenizer(tokenizer, prompt, skip_special_tokens)
        self._stops = tuple(stop)
        self._pending = ""  # decoded, not sent: it begins a stop string
        self.stopped: str | None = None

    def push(self, token: int) -> str:
        """The text that may be sent after `token` ("" once a stop string matched)."""
        if self.stopped is not None:
            return ""
        return self._release(self._detokenizer.push(token), last=False)

    def finish(self) -> str:
        """The text held back, sent at the request's end (unless a stop string matches in it)."""
        if self.stopped is not None:
            return ""
        return self._release(self._detokenizer.flush(), last=True)

    def _release(self, new: str, last: bool) -> str:
        # a stop string never starts in text already sent: its start would have been held
        text = self._pending + new
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            at, self.stopped = min(found)
            self._pending = ""
            return text[:at]
        keep = 0 if last else _held_back(text, self._stops)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]
