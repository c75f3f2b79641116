"""tessel.dtypes: the one conversion between torch dtypes and the names tessel writes."""

from __future__ import annotations

import pytest
import torch

from tessel.dtypes import DtypeError, dtype_name, torch_dtype
from tessel.errors import TesselError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_name_round_trips(dtype: torch.dtype) -> None:
    assert dtype_name(dtype) == str(dtype).removeprefix("torch.")
    assert torch_dtype(dtype_name(dtype)) is dtype
    assert torch_dtype(str(dtype)) is dtype


def test_aliases_read_as_torch_reads_them() -> None:
    assert torch_dtype("float") is torch.float32
    assert torch_dtype("half") is torch.float16


@pytest.mark.parametrize("name", ["nn", "float33", "", "Tensor"])
def test_unknown_name_is_tessel_error_naming_where(name: str) -> None:
    with pytest.raises(DtypeError, match=r"inputs\[0\]\.dtype: .* is not a torch dtype") as e:
        torch_dtype(name, "inputs[0].dtype")
    assert isinstance(e.value, TesselError)
    assert "float32" in str(e.value)
