"""A causal LM captured for generation: a program per gear over one KV cache it writes in place.

Every gear is one call of `GenerationStep`, the model wrapped with explicit inputs and nothing
hidden between calls:

- `input_ids [B, T]`: the tokens of this call (a left-padded prompt, or one new token per row);
- `position_ids [B, T]`: each token's position in its own row (padding not counted);
- `cache_position [T]`: the cache slots the call's keys and values are written to, the same
  for every row (a row's padding takes slots too, masked out);
- `attention_mask [B, L]`: which of the cache's `L` slots hold a row's tokens.

It returns the logits of the call's last token `[B, vocab]`. The cache is a buffer per layer's
keys and values, `[B, kv heads, L, head dim]` (`cache_0`, `cache_1`, ...), written with
`index_put_` at `cache_position`; the model builds its own masks (causal, sliding window,
ALiBi) from the padding mask and the slots, as it does for `transformers`' static cache. A
recurrent model (Mamba) keeps per layer a convolution state `[B, channels, kernel]` and a
recurrent state `[B, channels, state size]` instead (`conv_state_0`, `recurrent_state_0`, ...),
each overwritten whole by every call: a prefill gear starts them from its prompt, the decode
gear carries them on; such a model reads the padding mask of the call's own tokens. Prefill
gears (one per prompt length) and the decode gear (T = 1) share the buffers by name.

An encoder-decoder (T5) takes the same inputs. A prefill gear's tokens are the encoder's
prompt: the encoder runs once, its keys and values for cross-attention are written per decoder
layer into `cross_0`, `cross_1`, ... (slots for the longest prompt) at the prompt's slots, and
the decoder's start token runs at the prompt's last slot. The gear keeps the prompt's padding
mask (`encoder_mask`) and that slot (`decoder_start`) as state: the decode gear reads
cross-attention through the one and lets the decoder attend from the other on, so the decoder's
tokens sit in the slots the loop gives them.
The decoder's keys and values are `cache_0`, `cache_1`, ... as above.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from tessel._torch import OpOverload
from tessel.capture.export import CapturedModel, capture
from tessel.capture.training import mark_state
from tessel.config.errors import ConfigError
from tessel.config.generation import Generation
from tessel.errors import TesselError

_CALL = ("input_ids", "attention_mask", "cache", "use_cache")  # and position_ids, if taken


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
        slots = self.cache.slots
        self.keys[:, :, slots] = key_states
        self.values[:, :, slots] = value_states
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> Any:
        return self.cache.slots[0]  # the first query's slot: the mask's query offset

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _RecurrentLayer(LinearAttentionLayer):
    """One recurrent layer's convolution and recurrent states, given: a call of more than one
    token (a prefill gear) starts them from its own tokens, a one-token call carries them on."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, carried: bool) -> None:
        super().__init__()
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.conv_kernel_size[0] = conv.shape[-1]
        self.has_previous_state[0] = carried
        self.dtype, self.device = conv.dtype, conv.device


KV, CONV, RECURRENT, CROSS = "cache_", "conv_state_", "recurrent_state_", "cross_"
ENCODER_MASK, DECODER_START = "encoder_mask", "decoder_start"


class SlotCache(Cache):
    """`transformers`' cache interface over given buffers, by name (see the module docstring),
    written at `slots` (no counters)."""

    def __init__(self, buffers: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        self.slots = slots
        values = list(buffers.values())
        pairs = zip(values[0::2], values[1::2])
        if not is_recurrent(list(buffers)):
            super().__init__(layers=[_SlotLayer(self, k, v) for k, v in pairs])
            return
        carried = slots.shape[0] == 1
        super().__init__(layers=[_RecurrentLayer(c, r, carried) for c, r in pairs])


class _SlotPair(EncoderDecoderCache):
    """A decoder's cache and its cross-attention's, the latter already `written` (a decode
    gear) or written by this call (a prefill gear): no counters read from the buffers."""

    def __init__(self, decoder: SlotCache, cross: SlotCache, written: bool) -> None:
        self.self_attention_cache, self.cross_attention_cache = decoder, cross
        self.is_updated = dict.fromkeys(range(len(cross.layers)), written)


def is_recurrent(cache_names: list[str]) -> bool:
    """Whether a step's cache is recurrent states (read with the mask of the call's tokens)."""
    return any(name.startswith(CONV) for name in cache_names)


def cache_shapes(
    model: torch.nn.Module, batch: int, length: int, prompt: int | None = None
) -> dict[str, torch.Tensor]:
    """Every layer's buffers by name (see the module docstring) for `batch` rows of `length`
    tokens (an encoder-decoder's cross-attention: of the longest `prompt`), zero, on the meta
    device: their shapes are what the model writes into a cache on a one-token call. A model
    whose cache is neither keys and values per layer nor recurrent states per layer is
    refused, naming the layer."""
    name = type(model).__name__
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [p for p in _CALL if p not in params]
    if missing or not hasattr(model, "config"):
        raise ConfigError(
            "model",
            None,
            f"{name} is not a transformers causal LM taking {', '.join(_CALL)}"
            f" (it lacks {', '.join(missing) or 'a config'}); generation captures such a model",
        )
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    cache: Cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    one = torch.zeros(batch, 1, dtype=torch.long, device=device)
    call: dict[str, Any] = {}
    if encoder_decoder:
        if "decoder_input_ids" not in params or "encoder_outputs" not in params:
            raise ConfigError(
                "model",
                None,
                f"{name} is an encoder-decoder without decoder_input_ids and encoder_outputs; "
                "generation captures a transformers *ForConditionalGeneration model",
            )
        cache = EncoderDecoderCache(cache, DynamicCache(config=model.config))
        call["decoder_input_ids"] = one
    try:
        with torch.no_grad():
            out = model(input_ids=one, cache=cache, use_cache=True, **call)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, named in one line
        raise ConfigError(
            "model",
            None,
            f"{name} fails a one-token call with a cache ({type(exc).__name__}: {exc}); "
            "generation captures a causal LM that writes keys and values into one",
        ) from exc
    if getattr(out, "logits", None) is None:
        raise ConfigError(
            "model",
            None,
            f"{name} returns no logits: generation takes a causal LM (its *ForCausalLM class)",
        )
    if isinstance(cache, EncoderDecoderCache):
        return _encoder_decoder_buffers(cache, name, batch, length, prompt or length)
    buffers: dict[str, torch.Tensor] = {}
    kinds = set()
    for i, layer in enumerate(cache.layers):
        if _recurrent_states(layer):
            kinds.add("recurrent")
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            buffers[f"{CONV}{i}"] = torch.zeros(
                (batch, *conv.shape[1:]), dtype=conv.dtype, device="meta"
            )
            buffers[f"{RECURRENT}{i}"] = torch.zeros(
                (batch, *recurrent.shape[1:]), dtype=recurrent.dtype, device="meta"
            )
            continue
        if not isinstance(layer, DynamicLayer) or getattr(layer, "keys", None) is None:
            raise ConfigError(
                "model",
                None,
                f"{name}'s layer {i} keeps a {type(layer).__name__} cache; tessel captures "
                "caches of keys and values per layer, or of one convolution and one recurrent "
                "state per layer (Mamba)",
            )
        kinds.add("keys and values")
        for t in (layer.keys, layer.values):
            shape = (batch, t.shape[1], length, *t.shape[3:])
            buffers[f"{KV}{len(buffers)}"] = torch.zeros(shape, dtype=t.dtype, device="meta")
    if not buffers:
        raise ConfigError("model", None, f"{name} wrote no keys or values into a cache")
    if len(kinds) > 1:
        raise ConfigError(
            "model",
            None,
            f"{name} keeps keys and values in some layers and recurrent states in others; "
            "generation over such a hybrid cache is not built yet",
        )
    return buffers


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
    # per row, as all state is (data-parallel replicas each hold their rows)
    buffers[DECODER_START] = torch.zeros(batch, dtype=torch.long, device="meta")
    return buffers


def _recurrent_states(layer: CacheLayerMixin) -> bool:
    """Whether `layer` holds one convolution and one recurrent state and nothing else."""
    return (
        isinstance(layer, LinearAttentionLayer)
        and not isinstance(layer, LinearAttentionAndFullAttentionLayer)
        and layer.number_of_states == 1
        and layer.conv_states.get(0) is not None
        and layer.recurrent_states.get(0) is not None
    )


class GenerationStep(torch.nn.Module):
    """One gear's call of a causal LM over its cache buffers, by name (`cache_shapes`). See the
    module docstring for its inputs."""

    def __init__(self, model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.takes_positions = "position_ids" in params  # ALiBi models count from the mask
        # the head over the last token alone, as transformers' generate asks: a prompt's
        # other tokens need no logits, and the head is the widest matmul of the model
        self.last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache_names = list(buffers)
        self.recurrent = is_recurrent(self.cache_names)
        self.encoder_decoder = ENCODER_MASK in buffers
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        if self.encoder_decoder:
            return self._encoder_decoder(input_ids, cache_position, attention_mask)
        cache = SlotCache({n: getattr(self, n) for n in self.cache_names}, cache_position)
        positions = {"position_ids": position_ids} if self.takes_positions else {}
        if self.recurrent:  # the padding of this call's own tokens
            attention_mask = attention_mask.index_select(1, cache_position)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            **positions,
            **self.last_logits,
        )
        return out.logits[:, -1]

    def _encoder_decoder(
        self, input_ids: torch.Tensor, slots: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """An encoder-decoder's call (see the module docstring): a prompt of more than one
        token is encoded and the decoder's start token run; one token is decoded."""
        rows, length = input_ids.shape
        decoder = {n: getattr(self, n) for n in self.cache_names if n.startswith(KV)}
        cross = {n: getattr(self, n) for n in self.cache_names if n.startswith(CROSS)}
        every_slot = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        config = self.model.config
        prompt_slots = self.encoder_mask.shape[1]  # a prompt is written from slot 0
        if length > 1:  # a prompt: encoded once, its cross-attention written at its slots
            encoded = self.model.get_encoder()(
                input_ids=input_ids, attention_mask=attention_mask.index_select(1, slots)
            )
            start = slots[-1:]
            ids = torch.full_like(input_ids[:, :1], config.decoder_start_token_id)
            cache = _SlotPair(SlotCache(decoder, start), SlotCache(cross, slots), written=False)
            encoder_mask = attention_mask[:, :prompt_slots]
            decoder_mask = attention_mask * (every_slot == start)
            self.encoder_mask.copy_(encoder_mask)
            self.decoder_start.copy_(start.expand(rows))
            hidden = encoded[0]
        else:  # a new token: the decoder alone, from its start on, over the prompt's cache
            ids = input_ids
            cache = _SlotPair(SlotCache(decoder, slots), SlotCache(cross, slots), written=True)
            encoder_mask = self.encoder_mask
            decoder_mask = attention_mask * (every_slot >= self.decoder_start[:, None])
            # cross-attention reads the cache: the encoder's output only gives rows and dtype
            hidden = torch.zeros(1, 1, 1, dtype=self.model.dtype).expand(rows, 1, 1)
        out = self.model(
            encoder_outputs=(hidden,),
            attention_mask=encoder_mask,
            decoder_input_ids=ids,
            decoder_attention_mask=decoder_mask,
            cache=cache,
            use_cache=True,
        )
        return out.logits[:, -1]


# a gear's inputs, in order, and those with the batch's rows first (a replica reads its rows)
GEAR_INPUTS = ("input_ids", "position_ids", "cache_position", "attention_mask")
BATCH_INPUTS = (0, 1, 3)


def gear_inputs(batch: int, length: int, max_seq_len: int) -> tuple[torch.Tensor, ...]:
    """Example inputs of a gear of `length` tokens: a full prompt written from slot 0."""
    return (
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


@dataclass
class CapturedGears:
    """The gears of a generation build: a prefill program per prompt length, the decode program,
    and the cache buffers they share (the programs' buffers of these names)."""

    step: GenerationStep
    prefill: dict[int, CapturedModel]
    decode: CapturedModel
    generation: Generation

    @property
    def cache_names(self) -> list[str]:
        return self.step.cache_names

    def run(self, length: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The captured gear of `length` tokens called in this process on `inputs`, writing
        the step's cache buffers: the programs as captured, before any partitioning."""
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
    prefill = {
        t: _gear(step, model, generation, t, reuse_layers, keep) for t in generation.prefill_lengths
    }
    decode = _gear(step, model, generation, 1, reuse_layers, keep)
    return CapturedGears(step, prefill, decode, generation)


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
    buffers = {
        name: torch.zeros(t.shape, dtype=t.dtype, device=device)
        for name, t in cache_shapes(model, b, n, max(generation.prefill_lengths)).items()
    }
    return GenerationStep(model, buffers).eval()


def _gear(
    step: GenerationStep,
    model: torch.nn.Module,
    generation: Generation,
    length: int,
    reuse_layers: bool,
    keep: Callable[[Any], bool] | None,
) -> CapturedModel:
    b, n = generation.max_batch_size, generation.max_seq_len
    with _entered_modules(step) as entered:
        try:
            captured = capture(
                step, gear_inputs(b, length, n), keep=keep, reuse_layers=reuse_layers
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
