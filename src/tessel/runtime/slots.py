"""The serving loop on the devices: continuous batching over a generation package's cache rows.

Each row of the cache is a slot one request owns from its admission to its end. Every row
writes its next token at one slot, the pointer `t` the decode gear's `cache_position` gives, so
a row's tokens sit side by side and slot distance is token distance in it (causal, sliding
window and ALiBi masks stay right); its positions are its own, given per row. Between decode
steps:

- rows whose requests ended (a stop token, `max_tokens`, a cancel) are freed;
- waiting requests are admitted first come, first served, each into a free row: its prompt
  goes through the prefill gear of its length, ending at `t` (slots `t - gear` to `t`). Where
  the package has one-row prefill gears (`Gears.row_prefill`), each admission runs its own,
  which writes that row alone. Otherwise one gear of every row admits the step's requests of
  its length, so each rank first keeps the other rows' state it would write (their keys and
  values at those slots, their recurrent states whole) and puts it back after. Either way an
  admission changes no other row's tokens;
- where a request needs more room than the slots after `t` leave, every row's slots move left
  by as many as the earliest still in use allows (a compaction), and `t` with them;
- one decode step runs every row; a free row's token is dropped.

Rank 0 decides (it reads the requests from the engine's pipe) and broadcasts each iteration's
decisions, a small header, to the other ranks; every rank then applies the same header to the
same slot table and runs the same gears, and every rank holding the logits chooses the same
tokens (`RowChoice`: per-row settings and per-request seeded noise). Rank 0 reports each
step's tokens to the engine.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tessel.config.generation import KV
from tessel.decoding import draws
from tessel.runtime.generating import LoadedGears
from tessel.runtime.row_choice import RowChoice, row_settings


@dataclass
class _Row:
    """A request holding a row: where its prompt starts, its next position, its tokens."""

    rid: int
    request: dict
    start: int  # the slot of its prompt's first token
    position: int  # the position of the token it feeds next
    new: int = 0  # tokens made
    last: int = 0  # its latest token, fed at the next decode step
    generator: torch.Generator | None = None
    early: int = 0  # its stop tokens are held back while it has made fewer tokens than this
    penalized: bool = False  # its repetition penalty is not 1

    @classmethod
    def admitted(cls, rid: int, request: dict, start: int) -> _Row:
        prompt = len(request["prompt"])
        seed = int(request["seed"])
        return cls(
            rid,
            request,
            start,
            prompt,
            generator=torch.Generator().manual_seed(seed) if request["do_sample"] else None,
            early=max(int(request["min_length"]) - prompt, int(request["min_new_tokens"])),
            penalized=float(request["repetition_penalty"]) != 1,
        )


class Slots:
    """The cache's rows, each free or one request's, the pointer they share, and each row's
    mask and tokens by slot: the same on every rank, changed only by the headers."""

    def __init__(self, gears: LoadedGears, stops: tuple[int, ...], suppressed: tuple[int, ...]):
        shapes = gears.shapes
        self.gears = gears
        self.size, self.length, self.vocab = (
            shapes.max_batch_size,
            shapes.max_seq_len,
            shapes.vocab_size,
        )
        self.lengths = shapes.prefill_lengths
        self.pad = shapes.pad_for(shapes.eos_token_id)
        self.stops = stops
        self.suppressed = suppressed
        self.rows: list[_Row | None] = [None] * self.size
        self.pointer = 0
        # each row's choice settings and whether it draws: its request's while it holds the
        # row, a free row's neutral ones otherwise
        self.neutral = torch.tensor(row_settings(None), dtype=torch.float32)
        self.settings = self.neutral.repeat(self.size, 1)
        self.sample = torch.zeros(self.size, dtype=torch.bool)
        self.valid = torch.zeros(self.size, self.length, dtype=torch.long)
        self.history = torch.full((self.size, self.length), self.pad, dtype=torch.long)
        self.counts = dict.fromkeys(
            ("admissions", "prefills", "decode_steps", "compactions", "gears_us", "scheduler_us"),
            0,
        )
        self.gear_seconds = 0.0  # the gears' time so far, which the scheduler's leaves out

    # -- rank 0's decisions ---------------------------------------------------------------

    def gear(self, prompt: int) -> int:
        return next(n for n in self.lengths if n >= prompt)

    def plan(self, waiting: deque, cancelled: set[int]) -> dict:
        """This iteration's header: the rows to free, the compaction, the pointer where the
        batch starts anew, and the admissions, first come first served (a request that does
        not fit waits, and those after it too)."""
        freed = [r for r, row in enumerate(self.rows) if row is not None and row.rid in cancelled]
        kept = [row for r, row in enumerate(self.rows) if row is not None and r not in freed]
        free = [r for r, row in enumerate(self.rows) if row is None or r in freed]
        admit: list[list] = []
        pointer, shift = self.pointer, 0
        empty = not kept
        if empty:
            pointer, low, high = 0, 0, self.length
        earliest = min((row.start for row in kept), default=0)
        for rid, request in waiting:
            if len(admit) == len(free):
                break
            prompt, wanted = len(request["prompt"]), int(request["max_tokens"])
            gear = self.gear(prompt)
            if empty:  # the pointer starts as far on as every admitted request leaves room
                low2, high2 = max(low, gear), min(high, self.length - wanted + 1)
                if low2 > high2:
                    break
                low, high = low2, high2
                pointer = max(low, min(self.lengths[-1], high))
            else:
                at = pointer - shift
                if gear > at:
                    break
                if at + wanted - 1 > self.length:  # move every row left, as far as allowed
                    most = min(earliest, pointer - max([gear] + [a[3] for a in admit]))
                    if pointer - most + wanted - 1 > self.length:
                        break
                    shift = most
            admit.append([free[len(admit)], rid, request, gear])
        for _ in admit:
            waiting.popleft()
        return {
            "free": freed,
            "shift": shift,
            "pointer": pointer if empty else None,
            "admit": admit,
        }

    # -- every rank -----------------------------------------------------------------------

    def apply(self, header: dict) -> list[tuple[int, int | None, str | None]]:
        """Carry out `header` and run this iteration's gears; the events for the engine:
        `(request, None, None)` for an admission, `(request, token, reason)` for a token
        (`reason` "stop" or "length" on a request's last)."""
        for r in header["free"]:
            self._free(r)
        if header["shift"]:
            self._compact(int(header["shift"]))
        if header["pointer"] is not None:
            self.pointer = int(header["pointer"])
        events: list[tuple[int, int | None, str | None]] = []
        by_gear: dict[int, list[list]] = {}
        for admission in header["admit"]:
            by_gear.setdefault(int(admission[3]), []).append(admission)
        for gear, admissions in sorted(by_gear.items()):
            events += self._prefill(gear, admissions)
        if any(row is not None for row in self.rows):
            events += self._decode()
        return events

    def stats(self, waiting: int) -> dict[str, int]:
        used = sum(row is not None for row in self.rows)
        return {"running": used, "waiting": waiting, "slots_used": used, **self.counts}

    def _free(self, r: int) -> None:
        self.rows[r] = None
        self.valid[r] = 0
        self.settings[r] = self.neutral
        self.sample[r] = False

    def _compact(self, shift: int) -> None:
        """Move every row's slots `shift` to the left: the keys and values on this rank, the
        masks and tokens everywhere."""
        keep = self.length - shift
        for tensor, _ in self.gears.states(KV):
            tensor[:, :, :keep] = tensor[:, :, shift:].clone()
        for table in (self.valid, self.history):
            table[:, :keep] = table[:, shift:].clone()
            table[:, keep:] = 0 if table is self.valid else self.pad
        for row in self.rows:
            if row is not None:
                row.start -= shift
        self.pointer -= shift
        self.counts["compactions"] += 1

    def _prefill(self, gear: int, admissions: list[list]) -> list:
        """Admit `admissions` (row, request id, request, gear) through the prefill gear of
        `gear` tokens: its one-row gear once per request where the package has one, else its
        gear of every row once, the other rows' state kept and put back."""
        if gear in self.gears.rows:
            return [event for a in admissions for event in self._prefill_row(gear, *a[:3])]
        t, size = self.pointer, self.size
        ids = torch.full((size, gear), self.pad, dtype=torch.long)
        positions = torch.zeros(size, gear, dtype=torch.long)
        admitted = {
            r: self._admitted(r, rid, request, gear, ids[r], positions[r])
            for r, rid, request, _ in admissions
        }
        mask = self.valid.clone()
        for r in range(size):  # a free row attends to its own padding
            if self.rows[r] is None and r not in admitted:
                mask[r, t - gear : t] = 1
        inputs = (ids, positions, torch.arange(t - gear, t), mask)
        others = [r for r in range(size) if self.rows[r] is not None]
        kept = self.gears.keep(others, t - gear, t)
        for r, row in admitted.items():
            self._hold(r, row)
        tokens = self._run(gear, inputs, set(admitted))
        self.gears.restore(kept)
        self.counts["prefills"] += 1
        self.counts["admissions"] += len(admitted)
        events: list = []
        for r, row in admitted.items():
            events.append((row.rid, None, None))
            events.append(self._made(r, row, int(tokens[r])))
        return events

    def _prefill_row(self, gear: int, r: int, rid: int, request: dict) -> list:
        """Admit one request into row `r` through the one-row prefill gear of `gear` tokens,
        which writes that row of the cache and no other."""
        t = self.pointer
        ids = torch.full((1, gear), self.pad, dtype=torch.long)
        positions = torch.zeros(1, gear, dtype=torch.long)
        row = self._admitted(r, rid, request, gear, ids[0], positions[0])
        self._hold(r, row)
        inputs = (ids, positions, torch.arange(t - gear, t), self.valid[r : r + 1].clone())
        token = self._run(gear, (*inputs, torch.tensor([r])), {r}, one=r)
        self.counts["prefills"] += 1
        self.counts["admissions"] += 1
        return [(rid, None, None), self._made(r, row, int(token[0]))]

    def _admitted(
        self,
        r: int,
        rid: int,
        request: dict,
        gear: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> _Row:
        """Row `r` made the request's: its prompt written into `ids` and `positions` (the row's
        own of a gear's inputs, left padded) and into the row's mask and tokens, ending at the
        pointer."""
        t = self.pointer
        prompt = torch.tensor(request["prompt"], dtype=torch.long)
        p = len(prompt)
        ids[gear - p :] = prompt
        positions[gear - p :] = torch.arange(p)
        self.valid[r] = 0
        self.valid[r, t - p : t] = 1
        self.history[r] = self.pad
        self.history[r, t - p : t] = prompt
        return _Row.admitted(rid, request, t - p)

    def _hold(self, r: int, row: _Row) -> None:
        """Row `r` is `row`'s request's, with its choice settings."""
        self.rows[r] = row
        self.settings[r] = torch.tensor(row_settings(row.request), dtype=torch.float32)
        self.sample[r] = row.generator is not None

    def _decode(self) -> list:
        t = self.pointer
        active = {r: row for r, row in enumerate(self.rows) if row is not None}
        ids = torch.tensor([[self.pad if row is None else row.last] for row in self.rows])
        positions = torch.tensor([[0 if row is None else row.position] for row in self.rows])
        held = torch.tensor(list(active))
        self.valid[held, t] = 1
        self.history[held, t] = ids[held, 0]
        mask = self.valid.clone()
        mask[:, t] = 1  # a free row attends to its own padding
        tokens = self._run(1, (ids, positions, torch.tensor([t]), mask), set(active))
        self.pointer += 1
        self.counts["decode_steps"] += 1
        events = []
        for r, row in active.items():
            row.position += 1
            events.append(self._made(r, row, int(tokens[r])))
        return events

    def _made(self, r: int, row: _Row, token: int) -> tuple[int, int, str | None]:
        """Row `r`'s new token, and the row freed where it was its request's last."""
        row.new += 1
        row.last = token
        reason = None
        if token in self.stops and not row.request["ignore_eos"]:
            reason = "stop"
        elif row.new >= int(row.request["max_tokens"]):
            reason = "length"
        if reason is not None:
            self._free(r)
        return (row.rid, token, reason)

    def _run(
        self,
        length: int,
        inputs: tuple[torch.Tensor, ...],
        rows: set[int],
        one: int | None = None,
    ) -> torch.Tensor:
        """The gear of `length` on `inputs`, each row in `rows` choosing its token by its own
        request's settings (the others' tokens are dropped); with `one`, the one-row gear of
        that row, whose token alone comes back."""
        if one is None:
            chosen = [self.rows[r] if r in rows else None for r in range(self.size)]
            settings, sample = self.settings, self.sample
            history, counted = self.history, self.valid
            if len(rows) < sum(row is not None for row in self.rows):  # a prefill's rows
                choosing = torch.tensor([row is not None for row in chosen])
                settings = torch.where(choosing[:, None], settings, self.neutral)
                sample = sample & choosing
        else:
            chosen = [self.rows[one]]
            settings, sample = self.settings[one : one + 1], self.sample[one : one + 1]
            history, counted = self.history[one : one + 1], self.valid[one : one + 1]
        size = len(chosen)
        early = torch.tensor([row is not None and row.new < row.early for row in chosen])
        penalized = any(row is not None and row.penalized for row in chosen)
        noise_rows = {
            r: draws(self.vocab, row.generator)
            for r, row in enumerate(chosen)
            if row is not None and row.generator is not None
        }
        choice = RowChoice(
            size,
            self.length,
            self.vocab,
            sampled=bool(noise_rows),
            penalized=penalized,
            stops=self.stops,
            suppressed=self.suppressed,
        )
        noise = torch.ones((size, self.vocab) if noise_rows else (0,))
        for r, drawn in noise_rows.items():
            noise[r] = drawn
        nothing = torch.empty(0, dtype=torch.long)
        history, counted = (history, counted.bool()) if penalized else (nothing, nothing.bool())
        extra = (settings, sample, early, history, counted, noise)
        began = time.perf_counter()
        token = self.gears.run(length, inputs, choice, extra, row=one is not None)  # type: ignore[arg-type]
        if self.gears.logits_rank:
            token = self.gears.share(token, size)
        spent = time.perf_counter() - began
        self.gear_seconds += spent
        self.counts["gears_us"] += int(spent * 1e6)
        assert token is not None
        return token.cpu()


def serve_on_rank(
    gears: LoadedGears,
    conn: Connection | None,
    broadcast: Callable[[str], str] | None,
    keepalive: float,
    stops: tuple[int, ...],
    suppressed: tuple[int, ...],
) -> None:
    """Serve until the engine says stop: rank 0 (`conn`, the engine's pipe) reads requests
    and cancels, plans each iteration and reports its tokens; `broadcast` hands rank 0's
    header to every rank (None on one device)."""
    slots = Slots(gears, stops, suppressed)
    waiting: deque = deque()
    cancelled: set[int] = set()
    stopping = False
    while True:
        header: dict = {}
        if conn is not None:
            busy = bool(waiting) or any(row is not None for row in slots.rows)
            if busy or conn.poll(keepalive if broadcast is not None else None):
                while conn.poll():
                    message = conn.recv()
                    if message[0] == "admit":
                        waiting.append((message[1], message[2]))
                    elif message[0] == "cancel":
                        cancelled.add(message[1])
                        waiting = deque(w for w in waiting if w[0] != message[1])
                    else:  # stop serving
                        stopping = True
                started = time.perf_counter() - slots.gear_seconds
                header = {"stop": True} if stopping else slots.plan(waiting, cancelled)
                cancelled &= {row.rid for row in slots.rows if row is not None}
        if broadcast is not None:
            header = json.loads(broadcast(json.dumps(header) if conn is not None else ""))
        if header.get("stop"):
            if conn is not None:
                conn.send(("serving-stopped",))
            return
        if not header:  # rank 0 idle: its word only keeps the others' broadcast alive
            continue
        with torch.inference_mode():
            events = slots.apply(header)
        if conn is not None and (events or header["free"]):
            conn.send(("step", events, slots.stats(len(waiting))))
        if conn is not None:  # the iteration's time outside the gears: the scheduler's own
            own = time.perf_counter() - started - slots.gear_seconds
            slots.counts["scheduler_us"] += int(own * 1e6)
