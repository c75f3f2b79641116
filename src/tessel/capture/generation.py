"""A causal LM captured for generation: a program per gear over one cache it writes in place.

Every gear is one call of `GenerationStep`, the model wrapped with explicit inputs and nothing
hidden between calls:

- `input_ids [B, T]`: the tokens of this call (a left-padded prompt, or one new token per row);
- `position_ids [B, T]`: each token's position in its own row (padding not counted);
- `cache_position [T]`: the cache slots the call's keys and values are written to, the same
  for every row (a row's padding takes slots too, masked out);
- `attention_mask [B, L]`: which of the cache's `L` slots hold a row's tokens.

It returns the logits of the call's last token `[B, vocab]`. What the model's call takes beside
the tokens (`position_ids`, `use_cache`, `logits_to_keep`) is found by calling it, never read
off its signature: a model that takes them through `**kwargs` is given them too.

The cache is a set of buffers per layer, named by the layer's index `i`:

- a layer of attention keeps its keys and values `[B, kv heads, L, head dim]` (`cache_{2i}`,
  `cache_{2i+1}`), written with `index_put_` at `cache_position`; the model builds its own
  masks (causal, sliding window, ALiBi) from the padding mask and the slots, as it does over
  `transformers`' static cache, and reads the slot of the call's first token as the cache's
  length;
- a recurrent layer (Mamba, a gated delta net, a short convolution) keeps a convolution state
  `[B, channels, kernel]` (`conv_state_{i}`) and, where it has one, a recurrent state
  (`recurrent_state_{i}`), each overwritten whole by every call: a prefill gear starts them
  from its prompt, the decode gear carries them on. Such a layer reads the padding mask of
  the call's own tokens: a model with recurrent layers alone is given that mask, a hybrid
  (recurrent layers beside attention) the slots' mask with the call's own appended, whose
  last `T` columns `transformers`' recurrent layers read.

Prefill gears (one per prompt length) and the decode gear (T = 1) share the buffers by name.

An encoder-decoder (T5, BART, Marian, Pegasus) takes the same inputs. A prefill gear's tokens
are the encoder's prompt: each row is moved to the front of the gear (its padding after it),
so an encoder that numbers its tokens without the mask numbers them as it does the prompt
alone; the encoder runs once, its keys and values for cross-attention are written per decoder
layer into `cross_{2i}`, `cross_{2i+1}` (slots for the longest prompt), and the prompt's
padding mask is kept as state (`encoder_mask`), which every later call reads cross-attention
through. The decoder's own tokens sit in its cache from slot 0: the start token at slot 0, the
k-th new token at slot k, so a decoder that takes its positions from the cache's length (BART)
or from relative distances (T5) sees the positions it has alone. Its `attention_mask` is the
decoder's: the slots its tokens hold.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    LinearAttentionLayer,
)

from tessel._torch import OpOverload
from tessel.capture.export import CapturedModel, capture
from tessel.capture.training import mark_state
from tessel.config.errors import ConfigError
from tessel.config.generation import CONV, CROSS, ENCODER_MASK, KV, RECURRENT, Generation
from tessel.errors import TesselError

_LAYER = re.compile(r"(cache|cross|conv_state|recurrent_state)_(\d+)$")
# what a one-token call may be given beside its tokens, the mask and the cache; each is passed
# where the model's call takes it, which calling it finds out
OPTIONAL_ARGUMENTS = ("use_cache", "position_ids", "logits_to_keep")


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values, written at the slots its cache is given."""

    is_compileable = True
    is_sliding = False

    def __init__(self, cache: SlotCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.cache = cache
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The buffers exist before the first call."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # an indexed write, which export keeps as the one op tessel makes in place: no
        # decomposition (a second trace of the model) is needed to reach it
        slots, row = self.cache.slots, self.cache.row
        if row is None and self.cache.by_rows:
            # every row, indexed by row as a one-row gear writes: no gear's plan then splits
            # the cache by rows, where a one-row gear could not write its row
            rows = torch.arange(self.keys.shape[0], device=slots.device)[:, None]
            self.keys[rows, :, slots] = key_states.transpose(1, 2)
            self.values[rows, :, slots] = value_states.transpose(1, 2)
            return self.keys, self.values
        if row is None:
            self.keys[:, :, slots] = key_states
            self.values[:, :, slots] = value_states
            return self.keys, self.values
        # a one-row call: its row of the cache written at the slots, and read whole
        self.keys[row, :, slots] = key_states[0].transpose(0, 1)
        self.values[row, :, slots] = value_states[0].transpose(0, 1)
        return self.keys.index_select(0, row), self.values.index_select(0, row)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> Any:
        return self.cache.length()

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _RecurrentLayer(LinearAttentionLayer):
    """One recurrent layer's convolution state and, where it has one, recurrent state, given:
    a call of more than one token (a prefill gear) starts them from its own tokens, a one-token
    call carries them on."""

    def __init__(
        self,
        cache: SlotCache,
        conv: torch.Tensor,
        recurrent: torch.Tensor | None,
        carried: bool,
    ) -> None:
        super().__init__()
        self.cache = cache
        self.conv_states[0] = conv
        self.is_conv_states_initialized[0] = True
        if recurrent is not None:
            self.recurrent_states[0] = recurrent
            self.is_recurrent_states_initialized[0] = True
        self.conv_kernel_size[0] = conv.shape[-1]
        self.has_previous_state[0] = carried
        self.dtype, self.device = conv.dtype, conv.device

    def get_seq_length(self) -> Any:
        return self.cache.length()


class _SlotAndRecurrentLayer(_RecurrentLayer, CacheLayerMixin):
    """A layer that keeps keys and values beside its recurrent states (Falcon-H1's attention
    and Mamba side by side, Zamba2's shared attention): both, given."""

    is_sliding = False

    def __init__(
        self,
        cache: SlotCache,
        keys: torch.Tensor,
        values: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor | None,
        carried: bool,
    ) -> None:
        _RecurrentLayer.__init__(self, cache, conv, recurrent, carried)
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """The buffers exist before the first call."""

    update = _SlotLayer.update
    get_mask_sizes = _SlotLayer.get_mask_sizes
    get_max_length = _SlotLayer.get_max_length


class SlotCache(Cache):
    """`transformers`' cache interface over given buffers, by name (see the module docstring),
    written at `slots` (no counters): every layer, of attention or recurrent, reports the slot
    of the call's first token as the cache's length."""

    def __init__(
        self,
        buffers: dict[str, torch.Tensor],
        slots: torch.Tensor,
        length: int | None = None,
        row: torch.Tensor | None = None,
        by_rows: bool = False,
    ) -> None:
        self.slots = slots
        self.counted = length
        self.row = row  # a one-row call's row of the cache (`[1]`), else None: every row
        self.by_rows = by_rows  # a call of every row writes by row index too (`row_prefill`)
        carried = slots.shape[0] == 1
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for name, buffer in buffers.items():
            kind, index = _layer_of(name)
            if kind in ("cache", "cross"):  # keys at 2i, values at 2i + 1
                by_layer.setdefault(index // 2, {})["keys" if index % 2 == 0 else "values"] = buffer
            else:
                by_layer.setdefault(index, {})[kind] = buffer
        layers: list[Any] = []
        for i in range(max(by_layer) + 1 if by_layer else 0):
            held = by_layer.get(i)
            if held is None:
                raise ValueError(f"a slot cache holds no buffers for layer {i}")
            if "keys" in held and "conv_state" in held:
                layers.append(
                    _SlotAndRecurrentLayer(
                        self,
                        held["keys"],
                        held["values"],
                        held["conv_state"],
                        held.get("recurrent_state"),
                        carried,
                    )
                )
            elif "keys" in held:
                layers.append(_SlotLayer(self, held["keys"], held["values"]))
            else:
                layers.append(
                    _RecurrentLayer(self, held["conv_state"], held.get("recurrent_state"), carried)
                )
        super().__init__(layers=layers)

    def length(self) -> Any:
        """The cache's length as the model reads it: the slot of the call's first token (the
        position a model that counts them from the cache's length gives it), or the number
        the cache was given where the model reads the length only to size its tensors."""
        return self.slots[0] if self.counted is None else self.counted

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        return self.length()

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        return self.slots[0]  # the mask's: where the call's first token sits


def _layer_of(name: str) -> tuple[str, int]:
    """The kind (`cache`, `cross`, `conv_state`, `recurrent_state`) and index of a layer's
    buffer."""
    found = _LAYER.match(name)
    if found is None:
        raise ValueError(f"{name} is not a layer's cache buffer")
    return found.group(1), int(found.group(2))


class _SlotPair(EncoderDecoderCache):
    """A decoder's cache and its cross-attention's, the latter already `written` (a decode
    gear) or written by this call (a prefill gear): no counters read from the buffers."""

    def __init__(self, decoder: SlotCache, cross: SlotCache, written: bool) -> None:
        self.self_attention_cache, self.cross_attention_cache = decoder, cross
        self.is_updated = dict.fromkeys(range(len(cross.layers)), written)


def is_recurrent(cache_names: Sequence[str]) -> bool:
    """Whether a step's cache holds recurrent states (in some layers or all)."""
    return any(name.startswith(CONV) for name in cache_names)


def is_hybrid(cache_names: Sequence[str]) -> bool:
    """Whether a step's cache holds keys and values in some layers, recurrent states in others."""
    return is_recurrent(cache_names) and any(name.startswith(KV) for name in cache_names)


@dataclass(frozen=True)
class Probe:
    """A model's one-token call with a cache, as it went: the cache's buffers by name (zero,
    on the meta device, for `batch` rows of `length` slots) and which of `OPTIONAL_ARGUMENTS`
    the call took."""

    buffers: dict[str, torch.Tensor]
    takes: frozenset[str]


def cache_shapes(
    model: torch.nn.Module, batch: int, length: int, prompt: int | None = None
) -> dict[str, torch.Tensor]:
    """Every layer's buffers by name (see `probe`)."""
    return probe(model, batch, length, prompt).buffers


def probe(model: torch.nn.Module, batch: int, length: int, prompt: int | None = None) -> Probe:
    """Call `model` on one token with a cache, as `transformers`' generate does, and read off
    what it wrote: every layer's buffers by name (see the module docstring) for `batch` rows of
    `length` slots (an encoder-decoder's cross-attention: of the longest `prompt`), and which of
    `position_ids`, `use_cache` and `logits_to_keep` the call takes (an argument the call
    refuses by name is left out and the call made again). A model whose cache is neither keys
    and values nor recurrent states per layer is refused, naming the layer."""
    name = type(model).__name__
    if not hasattr(model, "config"):
        raise ConfigError(
            "model",
            None,
            f"{name} has no config: generation captures a transformers causal LM "
            "(a *ForCausalLM or *ForConditionalGeneration model)",
        )
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    device = next(model.parameters()).device
    one = torch.zeros(batch, 1, dtype=torch.long, device=device)
    given: dict[str, Any] = {"input_ids": one, "use_cache": True, "logits_to_keep": 1}
    if encoder_decoder:
        given["decoder_input_ids"] = one
    else:
        given["position_ids"] = torch.zeros_like(one)
    out, cache = _called(model, given, encoder_decoder)
    if getattr(out, "logits", None) is None:
        raise ConfigError(
            "model",
            None,
            f"{name} returns no logits: generation takes a causal LM (its *ForCausalLM class)",
        )
    takes = frozenset(k for k in OPTIONAL_ARGUMENTS if k in given)
    if isinstance(cache, EncoderDecoderCache):
        return Probe(_encoder_decoder_buffers(cache, name, batch, length, prompt or length), takes)
    buffers: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        buffers.update(_layer_buffers(layer, i, name, batch, length))
    if not buffers:
        raise ConfigError("model", None, f"{name} wrote no keys or values into a cache")
    return Probe(buffers, takes)


def _called(model: torch.nn.Module, given: dict[str, Any], encoder_decoder: bool) -> tuple:
    """The model's output on `given` over a new cache, and the cache; an optional argument
    (`OPTIONAL_ARGUMENTS`) the call refuses is taken out of `given` and the call made again."""
    name = type(model).__name__
    while True:
        cache: Cache = DynamicCache(config=model.config)
        if encoder_decoder:
            cache = EncoderDecoderCache(cache, DynamicCache(config=model.config))
        try:
            with torch.no_grad():
                return model(**given, cache=cache), cache
        except TypeError as exc:
            refused = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            key = refused.group(1) if refused else None
            if key in OPTIONAL_ARGUMENTS and key in given:
                del given[key]
                continue
            if key is not None:
                raise ConfigError(
                    "model",
                    None,
                    f"{name}'s call takes no {key}: generation captures a transformers "
                    + (
                        "*ForConditionalGeneration model taking decoder_input_ids and a cache"
                        if encoder_decoder
                        else "causal LM taking input_ids and a cache"
                    ),
                ) from exc
            failed = exc
        except Exception as exc:  # noqa: BLE001 - the model's own failure, named in one line
            failed = exc
        first = (str(failed).strip().splitlines() or [""])[0]
        raise ConfigError(
            "model",
            None,
            f"{name} fails a one-token call with a cache ({type(failed).__name__}: {first}); "
            "generation captures a causal LM that writes keys and values, or recurrent "
            "states, into one",
        ) from failed


def _layer_buffers(
    layer: Any, i: int, name: str, batch: int, length: int
) -> dict[str, torch.Tensor]:
    """Layer `i`'s buffers, shaped as its one-token call wrote them, for `batch` rows (and
    `length` slots of keys and values)."""

    def zeros(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=like.dtype, device="meta")

    held: dict[str, torch.Tensor] = {}
    recurrent = isinstance(layer, LinearAttentionLayer)
    if recurrent:
        if layer.number_of_states != 1 or layer.conv_states.get(0) is None:
            raise ConfigError(
                "model",
                None,
                f"{name}'s layer {i} keeps {layer.number_of_states} sets of recurrent states "
                f"({type(layer).__name__}); tessel captures one convolution state and at most "
                "one recurrent state per layer",
            )
        conv, state = layer.conv_states[0], layer.recurrent_states[0]
        held[f"{CONV}{i}"] = zeros((batch, *conv.shape[1:]), conv)
        if state is not None:
            held[f"{RECURRENT}{i}"] = zeros((batch, *state.shape[1:]), state)
    attends = isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None
    if attends:
        for k, t in enumerate((layer.keys, layer.values)):
            held[f"{KV}{2 * i + k}"] = zeros((batch, t.shape[1], length, *t.shape[3:]), t)
    if recurrent and isinstance(layer, DynamicLayer) and not attends:
        raise ConfigError(
            "model",
            None,
            f"{name}'s layer {i} keeps keys and values beside its recurrent states and wrote "
            "none on a one-token call; tessel captures the cache a call writes",
        )
    if not held:
        raise ConfigError(
            "model",
            None,
            f"{name}'s layer {i} keeps a {type(layer).__name__} cache; tessel captures layers "
            "that keep keys and values, recurrent states (a convolution state and a recurrent "
            "state: Mamba, Jamba, Bamba), or both",
        )
    return held


def _encoder_decoder_buffers(
    cache: EncoderDecoderCache, name: str, batch: int, length: int, prompt: int
) -> dict[str, torch.Tensor]:
    """An encoder-decoder's buffers (see the module docstring), shaped as its one-token call
    wrote its decoder's keys and values (`length` slots) and its cross-attention's (`prompt`
    slots: a prompt is written from slot 0, and no prompt is longer than the longest gear)."""
    buffers: dict[str, torch.Tensor] = {}
    caches = (
        (KV, cache.self_attention_cache, length),
        (CROSS, cache.cross_attention_cache, prompt),
    )
    for prefix, layers, slots in caches:
        for i, layer in enumerate(layers.layers):
            if not isinstance(layer, DynamicLayer) or getattr(layer, "keys", None) is None:
                raise ConfigError(
                    "model",
                    None,
                    f"{name}'s decoder layer {i} keeps a {type(layer).__name__} cache; tessel "
                    "captures keys and values per layer",
                )
            for k, t in enumerate((layer.keys, layer.values)):
                shape = (batch, t.shape[1], slots, *t.shape[3:])
                buffers[f"{prefix}{2 * i + k}"] = torch.zeros(shape, dtype=t.dtype, device="meta")
    buffers[ENCODER_MASK] = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
    return buffers


class GenerationStep(torch.nn.Module):
    """One gear's call of a causal LM over its cache buffers, by name (`probe`), given what
    its call `takes` (of `OPTIONAL_ARGUMENTS`). See the module docstring for its inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: dict[str, torch.Tensor],
        takes: frozenset[str] = frozenset(OPTIONAL_ARGUMENTS),
    ) -> None:
        super().__init__()
        self.model = model
        self.takes = takes
        self.cache_names = list(buffers)
        self.recurrent = is_recurrent(self.cache_names)
        self.hybrid = is_hybrid(self.cache_names)
        self.encoder_decoder = ENCODER_MASK in buffers
        # a number to report as the cache's length where the model reads it only to size its
        # tensors (`sized_by_the_length`), so the trace needs no value of the slots
        self.length: int | None = None
        # with one-row prefill gears: every gear writes its keys and values by row index
        self.by_rows = False
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor,
        row: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.encoder_decoder:
            return self._encoder_decoder(input_ids, cache_position, attention_mask)
        cache = SlotCache(
            {n: getattr(self, n) for n in self.cache_names},
            cache_position,
            self.length,
            row,
            self.by_rows,
        )
        own = attention_mask.index_select(1, cache_position)  # the padding of this call's tokens
        if self.hybrid:  # the slots' mask for attention, the call's own last for recurrence
            attention_mask = torch.cat([attention_mask, own], dim=1)
        elif self.recurrent:
            attention_mask = own
        given: dict[str, Any] = {}
        if "position_ids" in self.takes:
            given["position_ids"] = position_ids
        if "use_cache" in self.takes:
            given["use_cache"] = True
        if "logits_to_keep" in self.takes:
            # the head over the last token alone, as transformers' generate asks: a prompt's
            # other tokens need no logits, and the head is the widest matmul of the model
            given["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, **given)
        return out.logits[:, -1]

    def _encoder_decoder(
        self, input_ids: torch.Tensor, slots: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """An encoder-decoder's call (see the module docstring): a prompt of more than one
        token is encoded and the decoder's start token run at slot 0; one token is decoded at
        its slot."""
        rows, length = input_ids.shape
        decoder = {n: getattr(self, n) for n in self.cache_names if n.startswith(KV)}
        cross = {n: getattr(self, n) for n in self.cache_names if n.startswith(CROSS)}
        given = {"use_cache": True} if "use_cache" in self.takes else {}
        if length > 1:  # a prompt: encoded once, its cross-attention written at its slots
            mask = attention_mask.index_select(1, slots)
            # each row to the front, its padding after it: positions 0.. as the prompt alone
            padding = length - mask.sum(dim=1, keepdim=True)
            order = (torch.arange(length, device=mask.device) + padding) % length
            ids, mask = input_ids.gather(1, order), mask.gather(1, order)
            encoded = self.model.get_encoder()(input_ids=ids, attention_mask=mask)
            encoder_mask = torch.zeros_like(self.encoder_mask).index_copy(1, slots, mask)
            self.encoder_mask.copy_(encoder_mask)
            start = torch.zeros(1, dtype=slots.dtype, device=slots.device)
            ids = torch.full_like(input_ids[:, :1], self.model.config.decoder_start_token_id)
            cache = _SlotPair(SlotCache(decoder, start), SlotCache(cross, slots), written=False)
            every_slot = torch.arange(attention_mask.shape[1], device=attention_mask.device)
            decoder_mask = (every_slot == 0).to(attention_mask.dtype).expand(rows, -1)
            hidden = encoded[0]
        else:  # a new token: the decoder alone, over the prompt's cross-attention
            ids = input_ids
            cache = _SlotPair(SlotCache(decoder, slots), SlotCache(cross, slots), written=True)
            encoder_mask = self.encoder_mask
            decoder_mask = attention_mask
            # cross-attention reads the cache: the encoder's output only gives rows and dtype
            hidden = torch.zeros(1, 1, 1, dtype=self.model.dtype).expand(rows, 1, 1)
        out = self.model(
            encoder_outputs=(hidden,),
            attention_mask=encoder_mask,
            decoder_input_ids=ids,
            decoder_attention_mask=decoder_mask,
            cache=cache,
            **given,
        )
        return out.logits[:, -1]


# a gear's inputs, in order, and those with the batch's rows first (a replica reads its rows)
GEAR_INPUTS = ("input_ids", "position_ids", "cache_position", "attention_mask")
BATCH_INPUTS = (0, 1, 3)
ROW_INPUT = "row"  # a one-row prefill gear's fifth input: the cache row it writes, `[1]`


def gear_inputs(
    batch: int, length: int, max_seq_len: int, row: bool = False
) -> tuple[torch.Tensor, ...]:
    """Example inputs of a gear of `length` tokens: a full prompt written from slot 0; a
    one-row gear (`row`, `batch` 1) takes the cache row it writes last (`ROW_INPUT`)."""
    inputs = (
        torch.zeros(batch, length, dtype=torch.long),
        torch.arange(length).expand(batch, length).contiguous(),
        torch.arange(length),
        torch.cat(
            [
                torch.ones(batch, length, dtype=torch.long),
                torch.zeros(batch, max_seq_len - length, dtype=torch.long),
            ],
            dim=1,
        ),
    )
    return (*inputs, torch.zeros(1, dtype=torch.long)) if row else inputs


@dataclass
class CapturedGears:
    """The gears of a generation build: a prefill program per prompt length, the decode program,
    and the cache buffers they share (the programs' buffers of these names)."""

    step: GenerationStep
    prefill: dict[int, CapturedModel]
    decode: CapturedModel
    generation: Generation
    # one-row prefill gears by prompt length (`Generation.row_prefill`), each writing the row
    # it is given
    rows: dict[int, CapturedModel] = field(default_factory=dict)

    @property
    def cache_names(self) -> list[str]:
        return self.step.cache_names

    def run(self, length: int, inputs: tuple[torch.Tensor, ...], row: bool = False) -> torch.Tensor:
        """The captured gear of `length` tokens (`row`: the one-row gear, its row last in
        `inputs`) called in this process on `inputs`, writing the step's cache buffers: the
        programs as captured, before any partitioning."""
        if row:
            ep = self.rows[length].program
        else:
            ep = (self.decode if length == 1 else self.prefill[length]).program
        held = dict(self.step.named_parameters(remove_duplicate=False))
        held.update(self.step.named_buffers(remove_duplicate=False))
        signature = ep.graph_signature
        values = []
        user = iter(inputs)
        for spec in signature.input_specs:
            if spec.kind.name == "USER_INPUT":
                values.append(next(user))
            elif spec.target in held:
                values.append(held[spec.target])
            else:
                values.append(ep.constants[spec.target])
        with torch.no_grad():
            out = ep.graph_module(*values)
        written = [s.target for s in signature.output_specs if s.kind.name == "BUFFER_MUTATION"]
        for target, value in zip(written, out):
            held[target].copy_(value)
        return out[len(written)]


def capture_gears(
    model: torch.nn.Module,
    generation: Generation,
    reuse_layers: bool = True,
    keep: Callable[[Any], bool] | None = None,
) -> CapturedGears:
    """Capture `model` (a `transformers` causal LM) at every gear of `generation`, all over one
    cache; `reuse_layers=False` traces every layer, and ops `keep` holds for stay whole (see
    `capture`)."""
    step = _step(model, generation)
    step.by_rows = generation.row_prefill and generation.max_batch_size > 1
    if step.recurrent and 1 in generation.prefill_lengths:
        raise ConfigError(
            "Generation",
            "prefill_lengths",
            f"holds 1 for {type(model).__name__}, whose recurrent states a one-token call "
            "carries on (the decode gear) and a prefill gear starts afresh: the two cannot be "
            "one program; a 1-token prompt is padded into the shortest gear of 2 tokens or more",
        )
    one_row = generation.row_prefill and generation.max_batch_size > 1
    if one_row and (step.recurrent or step.encoder_decoder):
        kind = "is an encoder-decoder" if step.encoder_decoder else "keeps recurrent states"
        raise ConfigError(
            "Generation",
            "row_prefill",
            f"is set for {type(model).__name__}, which {kind}: one-row prefill gears write "
            "keys and values only; build without row_prefill (a server then admits requests "
            "with the prefill gears of every row)",
        )
    prefill = {
        t: _gear(step, model, generation, t, reuse_layers, keep) for t in generation.prefill_lengths
    }
    decode = _gear(step, model, generation, 1, reuse_layers, keep)
    rows = {}
    if one_row:
        rows = {
            t: _gear(step, model, generation, t, reuse_layers, keep, row=True)
            for t in generation.prefill_lengths
        }
    return CapturedGears(step, prefill, decode, generation, rows)


def capture_gear(
    model: torch.nn.Module,
    generation: Generation,
    length: int,
    reuse_layers: bool = True,
    keep: Callable[[Any], bool] | None = None,
) -> CapturedModel:
    """The one gear of `length` tokens (1: the decode gear) of `generation`, over a cache of
    its own: what a gear needs on its own, without capturing the others."""
    return _gear(_step(model, generation), model, generation, length, reuse_layers, keep)


def _step(model: torch.nn.Module, generation: Generation) -> GenerationStep:
    model = model.eval()
    b, n = generation.max_batch_size, generation.max_seq_len
    device = next(model.parameters()).device
    found = probe(model, b, n, max(generation.prefill_lengths))
    buffers = {
        name: torch.zeros(t.shape, dtype=t.dtype, device=device)
        for name, t in found.buffers.items()
    }
    return GenerationStep(model, buffers, found.takes).eval()


def _gear(
    step: GenerationStep,
    model: torch.nn.Module,
    generation: Generation,
    length: int,
    reuse_layers: bool,
    keep: Callable[[Any], bool] | None,
    row: bool = False,
) -> CapturedModel:
    b, n = (1 if row else generation.max_batch_size), generation.max_seq_len
    with _entered_modules(step) as entered, fixed_rotary_tables(model, n):
        try:
            try:
                captured = capture(
                    step, gear_inputs(b, length, n, row), keep=keep, reuse_layers=reuse_layers
                )
            except TesselError:
                raise
            except Exception:
                # a model that reads the cache's length as a number to size its tensors (MPT's
                # ALiBi table) cannot be traced over a length that is a value of the slots; if
                # the number changes none of its outputs, it is traced over a number instead
                if (
                    step.length is not None
                    or step.encoder_decoder
                    or not sized_by_the_length(step, generation)
                ):
                    raise
                step.length = 0
                captured = capture(
                    step, gear_inputs(b, length, n, row), keep=keep, reuse_layers=reuse_layers
                )
        except TesselError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own code, named in one line
            where = entered[-1] if entered else type(model).__name__
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ConfigError(
                "model",
                None,
                f"{type(model).__name__} cannot be captured for generation: {where} fails "
                f"while the gear of {length} token(s) is traced over tessel's cache "
                f"({type(exc).__name__}: {first})",
            ) from exc
    captured = _writes_in_place(captured, model, step.cache_names)
    for name in step.cache_names:  # the capture ran the model on its example inputs
        getattr(step, name).zero_()
    return captured


# rotary tables that `transformers` recomputes from a call's positions: dynamic NTK scaling
# past the model's length, Phi-3's long factors past its original length
_CHANGING_ROPE = ("dynamic", "longrope")


@contextlib.contextmanager
def fixed_rotary_tables(model: torch.nn.Module, max_seq_len: int) -> Iterator[None]:
    """While it lasts, every rotary embedding of `model` whose table changes with the length
    (`_CHANGING_ROPE`) keeps the table it starts with, which is the one `transformers` uses
    for every position below the switch: a trace then needs no branch on the positions. A
    `max_seq_len` past the switch is refused, naming it: the gears would keep the first table
    where `transformers` changes it."""
    held: list[tuple[torch.nn.Module, Any]] = []
    for name, module in model.named_modules():
        kinds = getattr(module, "rope_type", None)
        types = kinds if isinstance(kinds, dict) else {None: kinds}
        changing = {t: k for t, k in types.items() if isinstance(k, str) and k in _CHANGING_ROPE}
        if not changing:
            continue
        for layer_type, kind in changing.items():
            switch = _rope_switch(module, kind, layer_type)
            if switch is not None and max_seq_len > switch:
                raise ConfigError(
                    "Generation",
                    "max_seq_len",
                    f"is {max_seq_len}, past the {switch} positions where "
                    f"{type(model).__name__}'s rotary table ({name or 'the model'}, {kind} "
                    f"scaling) changes with the length; tessel's gears keep one table: give "
                    f"max_seq_len={switch} or less",
                )
        held.append((module, kinds))
        fixed = {t: ("default" if t in changing else k) for t, k in types.items()}
        module.rope_type = fixed if isinstance(kinds, dict) else fixed[None]
    try:
        yield
    finally:
        for module, kinds in held:
            module.rope_type = kinds


def _rope_switch(module: torch.nn.Module, kind: str, layer_type: str | None) -> int | None:
    """The length past which a rotary embedding of `kind` changes its table."""
    if kind == "longrope":
        parameters = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
        if layer_type is not None:
            parameters = parameters.get(layer_type, {})
        switch = parameters.get("original_max_position_embeddings")
    else:
        switch = getattr(module, "original_max_seq_len", None)
    return switch if isinstance(switch, int) else None


def sized_by_the_length(step: GenerationStep, generation: Generation) -> bool:
    """Whether `step`'s model reads the cache's length only to size its tensors: run eagerly,
    a decode call after a prompt gives the same logits whether the cache reports the call's
    slot as its length or 0. The step's buffers are left as they were."""
    b, n = generation.max_batch_size, generation.max_seq_len
    prompt = generation.prefill_lengths[0]
    saved = {name: getattr(step, name).clone() for name in step.cache_names}
    ones = torch.ones(b, prompt + 1, dtype=torch.long)
    mask = torch.cat([ones, torch.zeros(b, n - prompt - 1, dtype=torch.long)], dim=1)
    new = (
        torch.ones(b, 1, dtype=torch.long),
        torch.full((b, 1), prompt),
        torch.tensor([prompt]),
        mask,
    )
    outs = []
    try:
        with torch.no_grad():
            for length in (None, 0):
                step.length = length
                for name, value in saved.items():
                    getattr(step, name).copy_(value)
                step(*gear_inputs(b, prompt, n))
                outs.append(step(*new))
    except Exception:  # noqa: BLE001 - the model cannot run eagerly over the slots either
        return False
    finally:
        step.length = None
        for name, value in saved.items():
            getattr(step, name).copy_(value)
    return torch.equal(outs[0], outs[1])


@contextlib.contextmanager
def _entered_modules(step: GenerationStep) -> Iterator[list[str]]:
    """While it lasts, the modules of `step`'s model whose forward has begun and not returned,
    outermost first, as `path (class)`: where a trace fails, the last is the layer that failed."""
    names = {id(m): name for name, m in step.model.named_modules()}
    entered: list[str] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        if id(module) in names:
            entered.append(f"{names[id(module)] or 'the model'} ({type(module).__name__})")

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) in names and entered:
            entered.pop()

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        yield entered
    finally:
        for handle in handles:
            handle.remove()


_INDEX_PUT = torch.ops.aten.index_put.default


def _writes_in_place(
    captured: CapturedModel, model: torch.nn.Module, state: Sequence[str]
) -> CapturedModel:
    """The gear's cache writes made in place, and the graph's output marking which state each
    written buffer is (`mark_state`), so the plan places it like the buffer and the program
    writes into the buffer a worker holds:

    - keys and values (a decoder's, a cross-attention's): each buffer's new value, which
      export returns as a functional `index_put` of the buffer, becomes `index_put_` on the
      buffer itself (one write a step at the call's slots, never a copy of the cache);
    - a recurrent state, overwritten whole by every call: its new value is copied into the
      buffer (`copy_`) after every other node, when nothing reads the old one any more."""
    ep = captured.program
    graph = ep.graph_module.graph
    signature = ep.graph_signature
    placeholder = {s.target: s.arg.name for s in signature.input_specs if s.kind.name == "BUFFER"}
    nodes = {n.name: n for n in graph.nodes}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = list(output.args[0])
    names = []
    for i, (spec, value) in enumerate(zip(signature.output_specs, values)):
        if spec.kind.name != "BUFFER_MUTATION":
            break
        buffer = nodes.get(placeholder.get(spec.target, ""))
        if spec.target.startswith((KV, CROSS)) or buffer is None:
            _keys_written_at_slots(value, buffer, spec.target, model)
        else:
            values[i] = _overwritten(graph, output, value, buffer, spec.target, model)
            spec.arg.name = values[i].name
        names.append(spec.target)
    output.args = (tuple(values), *output.args[1:])
    buffers = [s.target for s in signature.input_specs if s.kind.name == "BUFFER"]
    read = tuple(n for n in buffers if n in state and n not in names)
    mark_state(graph, tuple(names), read)
    ep.graph_module.recompile()
    return captured


def _keys_written_at_slots(
    value: Any, buffer: torch.fx.Node | None, name: str, model: torch.nn.Module
) -> None:
    """Make `value`, the functional write into `buffer`, the in-place write it stands for."""
    if (
        not isinstance(value, torch.fx.Node)
        or value.target is not _INDEX_PUT
        or buffer is None
        or value.args[0] is not buffer
        or len(buffer.users) != 1
    ):
        raise ConfigError(
            "model",
            None,
            f"{type(model).__name__} writes its cache buffer {name} other than by one indexed "
            f"write a step (found {getattr(value, 'target', value)}); tessel writes caches in "
            "place that way",
        )
    value.target = torch.ops.aten.index_put_.default


def _overwritten(
    graph: torch.fx.Graph,
    output: torch.fx.Node,
    value: Any,
    buffer: torch.fx.Node,
    name: str,
    model: torch.nn.Module,
) -> torch.fx.Node:
    """The node copying `value` into `buffer`, last before the output."""
    source = value
    while isinstance(source, torch.fx.Node) and source is not buffer:
        target = source.target
        if not (isinstance(target, OpOverload) and target.is_view):
            break
        source = source.args[0]
    if not isinstance(value, torch.fx.Node) or source is buffer:
        raise ConfigError(
            "model",
            None,
            f"{type(model).__name__} writes its state {name} as a view of itself (found "
            f"{getattr(value, 'target', value)}); tessel overwrites a recurrent state with a "
            "new value",
        )
    with graph.inserting_before(output):
        written = graph.call_function(torch.ops.aten.copy_.default, (buffer, value))
    written.meta = dict(value.meta)
    return written
