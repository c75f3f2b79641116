"""A build checks itself: the built model, run on the example inputs, must give the eager
model's outputs.

Every rank's program is decoded from the package's members, as a worker decodes it, and run in
this process (`tessel.runtime.inprocess`); rank 0's outputs are compared with the model's own.
It costs one forward pass of the model plus one of every device's share, on the build machine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tessel.errors import TesselError
from tessel.runtime.inprocess import run_in_process

# largest difference allowed, relative to the largest magnitude of the eager output (at least 1)
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


class VerifyError(TesselError, RuntimeError):
    """The built model disagrees with the eager model on the example inputs."""


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for outputs of `dtype` (0: exact, for integers and booleans)."""
    return TOLERANCE.get(dtype, 0.0)


def check_against_eager(
    package: Any, inputs: list[torch.Tensor], expected: list[torch.Tensor]
) -> dict:
    """Run `package` on `inputs` and compare with `expected`; raise `VerifyError` on any output
    beyond its tolerance. Returns the figures for the manifest."""
    t = time.perf_counter()
    got = run_in_process(package, inputs)
    seconds = time.perf_counter() - t
    if len(got) != len(expected):
        raise VerifyError(
            f"the built model returns {len(got)} tensors where the model returns {len(expected)}"
        )
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.shape != e.shape or g.dtype != e.dtype:
            raise VerifyError(
                f"output {i}: the built model gives {list(g.shape)} {g.dtype}, the model "
                f"{list(e.shape)} {e.dtype}"
            )
        if e.numel() == 0:
            continue
        diff = (g.double() - e.double()).abs().max().item()
        scale = max(1.0, e.double().abs().max().item())
        allowed = tolerance(e.dtype) * scale
        if not diff <= allowed:  # also refuses NaN
            raise VerifyError(
                f"the built model disagrees with the model on the example inputs: output {i} "
                f"differs by up to {diff:.3g} (allowed {allowed:.3g} for {e.dtype}); the package "
                "was not written. Please report this with the model and cluster"
            )
        worst = max(worst, diff / scale)
    return {"max_relative_diff": worst, "seconds": round(seconds, 3)}
