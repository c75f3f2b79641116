"""Models larger than the build machine: parameters on the meta device, weights streamed from
the checkpoint into the package.

`empty_weights()` builds a model's parameters on the meta device (buffers stay real, since a
checkpoint does not hold the ones computed at construction, such as rotary tables).
`streamed_weights` matches the model's names to a checkpoint directory's and turns every meta
tensor into a fake CPU tensor, so capture, planning and lowering see shapes only; the package
then reads each rank's box of each weight from the checkpoint as it is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tessel._torch import fake_tensor_mode
from tessel.checkpoint.stored import StoredWeights
from tessel.config.errors import ConfigError
from tessel.dtypes import dtype_name


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Create every parameter of the modules built in this block on the meta device."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def streamed_weights(model: torch.nn.Module, path: str | Path, option: str = "weights") -> dict:
    """The value of each of `model`'s parameters and buffers: a `StoredTensor` of the
    checkpoint at `path`, or the module's own tensor where it is real and not in the
    checkpoint. Afterwards `model` holds fake tensors only (no memory). Names, shapes and
    dtypes that do not match are refused by name."""
    stored = StoredWeights(path)
    owned = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    prefix = _prefix(owned, stored)
    values: dict[str, Any] = {}
    by_tensor: dict[int, Any] = {}
    for name, t in owned.items():  # names the checkpoint holds first, so ties find them
        key = name.removeprefix(prefix)
        if key in stored:
            values[name] = stored.tensor(key)
            by_tensor.setdefault(id(t), values[name])
    missing = []
    for name, t in owned.items():
        if name in values:
            continue
        if id(t) in by_tensor:  # tied to a weight the checkpoint holds
            values[name] = by_tensor[id(t)]
        elif t.device.type != "meta":
            values[name] = t.detach()
        else:
            missing.append(name)
    source = str(path)
    if missing:
        raise ConfigError(
            source,
            None,
            f"lacks {_some(missing)}, which the model holds on the meta device (names are "
            f"matched {'after removing ' + repr(prefix) if prefix else 'as they are'})",
        )
    used = {v.name for v in values.values() if hasattr(v, "loc")}
    extra = sorted(set(stored.locs) - used)
    if extra:
        raise ConfigError(source, None, f"holds {_some(extra)}, which the model does not have")
    for name, t in owned.items():
        v = values[name]
        if tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
            raise ConfigError(
                source,
                getattr(v, "name", name),
                f"is {dtype_name(v.dtype)}{list(v.shape)}, but the model's "
                f"{name} is {dtype_name(t.dtype)}{list(t.shape)}",
            )
    with fake_tensor_mode():
        model.to_empty(device="cpu")
    return values


def _prefix(owned: dict[str, torch.Tensor], stored: StoredWeights) -> str:
    """What the model puts before the checkpoint's names: "" where they agree, or the leading
    module names of a wrapper (`lm.` around a Hugging Face model)."""
    if any(name in stored for name in owned):
        return ""
    for name in owned:
        parts = name.split(".")
        for k in range(1, len(parts)):
            if ".".join(parts[k:]) in stored:
                return ".".join(parts[:k]) + "."
    return ""


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return f"{shown} (and {len(names) - 6} more)" if len(names) > 6 else shown
