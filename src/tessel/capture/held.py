"""A model as users hold it: a `transformers` model called with its cache on, returning a
`ModelOutput`, and the names of the outputs a forward build keeps."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.export import ExportedProgram

from tessel._torch import tree_flatten_with_path, tree_unflatten
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name


def without_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[dict, bool]:
    """`kwargs` with `use_cache=False` where the model would otherwise return a cache.

    A forward build runs a fixed program with no state between runs, so a cache it returned
    would be thrown away after costing memory, and torch.export cannot return `transformers`'
    cache objects at all. A caller who passed `use_cache` keeps their choice. Returns the
    keyword arguments and whether the cache was turned off.
    """
    if "use_cache" in kwargs or not getattr(getattr(model, "config", None), "use_cache", False):
        return kwargs, False
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs, False
    if "use_cache" not in names or names.index("use_cache") < len(args):
        return kwargs, False
    return {**kwargs, "use_cache": False}, True


def check_weights_present(model: torch.nn.Module) -> None:
    """Refuse a model whose parameters are on the meta device when no checkpoint is given."""
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise ConfigError(
            "weights",
            None,
            f"{len(on_meta)} of the model's parameters are on the meta device "
            f"({on_meta[0]}, ...): pass the checkpoint to read them from (weights=DIR, "
            "--weights DIR on the command line)",
        )


def output_names(program: ExportedProgram) -> list[str]:
    """A name per output of `program`, from the structure its forward returned: `logits` for
    a `ModelOutput`'s field, `0.1` for a nested tuple's element, `output` for a lone tensor."""
    spec = program.call_spec.out_spec
    if spec is None:
        return []
    count = spec.num_leaves
    try:
        paths, _ = tree_flatten_with_path(tree_unflatten(list(range(count)), spec))
    except (TypeError, ValueError, NotImplementedError):  # a node type without key paths
        return [f"output_{i}" for i in range(count)]
    if count == 1 and not paths[0][0]:
        return ["output"]
    return [".".join(_key_name(k) for k in path) for path, _ in paths]


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def describe_outputs(names: list[str], values: list[torch.Tensor], cache_off: bool) -> str:
    """One line: what the build took as the model's outputs, and the cache it turned off."""
    shown = ", ".join(f"{n} {dtype_name(v.dtype)}{list(v.shape)}" for n, v in zip(names, values))
    line = f"outputs: {shown or 'none'}"
    if cache_off:
        line += " (use_cache=False: a forward build keeps no cache between runs)"
    return line
