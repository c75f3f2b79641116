"""A build checks itself: the built model, run on the example inputs, must give the eager
model's outputs.

Every rank's program is decoded from the package's members, as a worker decodes it, and run in
this process (`tessel.runtime.inprocess`); rank 0's outputs are compared with the model's own.
It costs one forward pass of the model plus one of every device's share, on the build machine,
so a build checks itself by default only where the cost model puts that below what the build
itself took (`worth_checking`); asked for, it always checks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tessel.capture import CapturedModel
from tessel.capture.generation import GenerationStep
from tessel.config.soc import SocProfile, soc_profile
from tessel.decoding import choosing, decode
from tessel.dtypes import torch_dtype
from tessel.errors import TesselError
from tessel.package.plan_report import Verified
from tessel.plan.candidates import node_seconds
from tessel.runtime.inprocess import InProcessModel, run_in_process

# largest difference allowed, relative to the largest magnitude of the eager output (at least 1)
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


class VerifyError(TesselError, RuntimeError):
    """The built model disagrees with the eager model on the example inputs."""


# the check runs the model eagerly, then every rank's share, then compares: about three forwards
FORWARDS_PER_CHECK = 3


def forward_seconds(captured: CapturedModel, soc: SocProfile) -> float:
    """The cost model's time for one forward pass of the whole model on one device of `soc`."""
    return sum(
        node_seconds(n, soc.peak_flops, soc.memory_bandwidth, soc.op_overhead)
        for n in captured.program.graph.nodes
        if n.op == "call_function"
    )


def worth_checking(captured: CapturedModel, build_seconds: float) -> str | None:
    """None where checking should cost less than the build took; otherwise why not.

    The check runs on the build machine's CPU whatever devices the model is built for, so it is
    priced on a CPU device."""
    estimate = FORWARDS_PER_CHECK * forward_seconds(captured, soc_profile("cpu"))
    if estimate <= build_seconds:
        return None
    return (
        f"skipped: checking would take about {estimate:.1f} s (three forward passes on the "
        f"example inputs), more than the build's {build_seconds:.1f} s; ask for it with "
        "verify=True (--verify=1)"
    )


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for outputs of `dtype` (0: exact, for integers and booleans)."""
    return TOLERANCE.get(dtype, 0.0)


def check_against_eager(
    package: Any, inputs: list[torch.Tensor], expected: list[torch.Tensor]
) -> Verified:
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
        if e.is_floating_point():
            wide = torch.float64 if e.dtype == torch.float64 else torch.float32
            diff = torch.sub(g.to(wide), e.to(wide)).abs_().max().item()
            scale = max(1.0, e.abs().max().item())
        else:  # integers and booleans agree exactly or not at all
            diff, scale = (0.0 if torch.equal(g, e) else 1.0), 1.0
        allowed = tolerance(e.dtype) * scale
        if not diff <= allowed:  # also refuses NaN
            raise VerifyError(
                f"the built model disagrees with the model on the example inputs: output {i} "
                f"differs by up to {diff:.3g} (allowed {allowed:.3g} for {e.dtype}); the package "
                "was not written. Please report this with the model and cluster"
            )
        worst = max(worst, diff / scale)
    return Verified(max_relative_diff=worst, seconds=round(seconds, 3))


def check_generation(package: Any, model: torch.nn.Module, prompt: torch.Tensor | None) -> Verified:
    """A generation package's prefill and three decode steps, every rank's gears run in this
    process, against the model run eagerly over a cache of its own (greedy, on `prompt`, or
    on random ids of the shortest gear's length). Each step's logits must agree within the
    tolerance, and so must the tokens, unless the eager model's two likeliest are closer than
    that (a tie either may break); raises `VerifyError` otherwise."""
    gears = package.manifest.generation
    t = time.perf_counter()
    if prompt is None:
        g = torch.Generator().manual_seed(0)
        rows = min(2, gears.max_batch_size)
        prompt = torch.randint(0, gears.vocab_size, (rows, gears.prefill_lengths[0]), generator=g)
    buffers = {s.name: torch.zeros(s.shape, dtype=torch_dtype(s.dtype)) for s in gears.state}
    eager = GenerationStep(model, buffers).eval()
    built = InProcessModel(package)
    logits_rank = package.manifest.mesh.logits_rank
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "built": []}

    def eager_run(length: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            seen["eager"].append(eager(*inputs))
        return seen["eager"][-1]

    def built_run(length: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        seen["built"].append(built.run(list(inputs), length, logits_rank)[-1])
        return seen["built"][-1]

    steps = 4
    pad = gears.pad_for(())  # no row stops: the pad only fills the rows past the prompt's
    want = list(decode(choosing(eager_run), gears, prompt, None, steps, pad_token_id=pad))
    got = list(decode(choosing(built_run), gears, prompt, None, steps, pad_token_id=pad))
    worst = 0.0
    for step, (e, b) in enumerate(zip(seen["eager"], seen["built"])):
        rows = prompt.shape[0]
        e, b = e[:rows].float(), b[:rows].float()
        scale = max(1.0, e.abs().max().item())
        allowed = tolerance(torch.float32) * scale
        diff = (b - e).abs().max().item()
        if not diff <= allowed:
            raise VerifyError(
                f"the built generation package disagrees with the model at step {step} "
                f"({'prefill' if step == 0 else 'decode'}): the logits differ by up to {diff:.3g} "
                f"(allowed {allowed:.3g}); the package was not written. Please report this "
                "with the model and cluster"
            )
        worst = max(worst, diff / scale)
        if not torch.equal(want[step], got[step]):
            top = e.topk(2, dim=-1).values
            if (top[:, 0] - top[:, 1]).min().item() > allowed:
                raise VerifyError(
                    f"the built generation package chooses other tokens than the model at step "
                    f"{step}: {got[step].tolist()} against {want[step].tolist()}"
                )
            break  # a tie broken the other way: later steps see other tokens
    return Verified(max_relative_diff=worst, seconds=round(time.perf_counter() - t, 3))
