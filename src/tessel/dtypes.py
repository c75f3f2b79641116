"""Dtype names as tessel writes them ("float32", "bfloat16": torch's own name without "torch."),
and the torch dtype a written name stands for. Packages, programs, manifests and strategy files
carry dtypes by these names; this module is the one place that spells the conversion."""

from __future__ import annotations

import torch

from tessel.errors import TesselError

# every dtype torch names, aliases included ("float" and "half" as torch itself reads them)
_BY_NAME: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}


class DtypeError(TesselError):
    """A dtype name that torch has no dtype for."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`: the name tessel writes for a dtype."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """`"float32"` (or `"torch.float32"`) -> `torch.float32`; a name that is no torch dtype is a
    DtypeError naming `where` (the field or file it came from), never an AttributeError or a
    torch attribute that is not a dtype."""
    dtype = _BY_NAME.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise DtypeError(
            f"{where}: {name!r} is not a torch dtype; allowed: {', '.join(sorted(_BY_NAME))}"
        )
    return dtype
