"""What a training package records of its model so that a checkpoint of it becomes the model's
own files: which checkpoint tensors are the model's `state_dict()` (and under which keys), and,
for a `transformers` model, its config and generation config as JSON.

A training checkpoint holds more than the model's weights: the optimizer's states, the
program's constants (`lifted_tensor_N`) and non-persistent buffers (`rotary_emb.inv_freq`).
`tessel ckpt unify` writes only the recorded keys, so `from_pretrained` finds exactly what the
model's class expects.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from tessel.dtypes import dtype_name

log = logging.getLogger(__name__)

# package members holding a transformers model's config files, as `save_pretrained` writes them
CONFIG_MEMBER = "model/config.json"
GENERATION_CONFIG_MEMBER = "model/generation_config.json"


@dataclass(frozen=True)
class ModelRecord:
    """`state_dict`: each key a model's `state_dict()` gives that a checkpoint holds, mapped to
    the checkpoint name of its value; `config`, `generation_config`: the JSON files
    `save_pretrained` writes (None for a model that is not a transformers PreTrainedModel, or
    that does not generate)."""

    state_dict: dict[str, str]
    config: bytes | None = None
    generation_config: bytes | None = None


def _pretrained(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers PreTrainedModel (transformers is not imported for it:
    a model of that class has imported it already)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _tied_targets(model: torch.nn.Module) -> set[str]:
    """The keys transformers leaves out of a saved checkpoint because they are tied to another
    (`lm_head.weight` tied to the embedding): `from_pretrained` ties them again on load."""
    targets = getattr(model, "all_tied_weights_keys", None)
    if isinstance(targets, Mapping):
        return set(targets)
    found: set[str] = set()
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        for key in tied.keys() if isinstance(tied, Mapping) else tied:
            found.add(f"{prefix}.{key}" if prefix else str(key))
    return found


def state_dict_names(model: torch.nn.Module, held: Iterable[str]) -> dict[str, str]:
    """`{state_dict key: checkpoint name}` over the names `held` (what a checkpoint of the
    package holds). A tensor under several keys (tied weights) is kept under every key, except
    that for a transformers model the tied keys it does not save are left out, as
    `save_pretrained` leaves them; a key the checkpoint lacks takes another name of its tensor."""
    held = set(held)
    state = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for key, value in state.items():
        names_of.setdefault(id(value), []).append(key)
    skip: set[str] = set()
    if _pretrained(model):
        skip.update(getattr(model, "_keys_to_ignore_on_save", None) or ())
        targets = _tied_targets(model)
        for names in names_of.values():
            if len(names) > 1:
                kept = [n for n in names if n not in targets] or names[:1]
                skip.update(n for n in names if n not in kept)
    out: dict[str, str] = {}
    absent = []
    for key, value in state.items():
        if key in skip:
            continue
        source = key if key in held else next((n for n in names_of[id(value)] if n in held), None)
        if source is None:
            absent.append(key)
            continue
        out[key] = source
    if absent:
        log.warning(
            "a checkpoint of this training step will not hold these keys of the model's "
            "state_dict (the step does not read them), so `tessel ckpt unify` cannot write "
            "them: %s",
            ", ".join(absent[:10]) + (f" and {len(absent) - 10} more" if len(absent) > 10 else ""),
        )
    return out


def _config_json(model: torch.nn.Module) -> bytes:
    """The model's config as `save_pretrained` writes it: the class as `architectures`, the
    weights' dtype as `dtype`, only what differs from the defaults."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype_name(model.dtype)
    return config.to_json_string(use_diff=True).encode()


def model_record(model: torch.nn.Module, held: Iterable[str]) -> ModelRecord:
    """What a training package records of `model` (see the module docstring)."""
    state = state_dict_names(model, held)
    if not _pretrained(model):
        return ModelRecord(state)
    generation = None
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and model.generation_config is not None:
        generation = model.generation_config.to_json_string(use_diff=True).encode()
    return ModelRecord(state, _config_json(model), generation)
