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
from collections.abc import Callable
from typing import Any

import torch

from tessel.capture import CapturedModel
from tessel.config.sampling import sampling_for
from tessel.config.soc import SocProfile, soc_profile
from tessel.decoding import choosing, decode, new_tokens_room
from tessel.errors import TesselError
from tessel.package.manifest import Gears
from tessel.package.plan_report import Verified
from tessel.plan.candidates import node_seconds
from tessel.runtime.inprocess import InProcessModel, run_in_process
from tessel.runtime.loader import row_gear

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


# a generation package is checked over a prefill and at least this many decode steps
DECODE_STEPS = 8


def check_generation(package: Any, model: torch.nn.Module, prompt: torch.Tensor | None) -> Verified:
    """A generation package's gears, every rank run in this process, against `transformers`'
    own `generate` of each prompt alone and unpadded, with its own cache (the model as the user
    gave it, greedy, with its own `generation_config`): the gears run the prompts as one
    left-padded batch, a prefill and `DECODE_STEPS` decode steps where the cache holds them.

    The prompts are `prompt`'s rows where given, else random ids: one prompt shorter than the
    shortest gear and, where the batch holds two, a second of another length. Each step's
    logits must agree with `transformers`' within the model dtype's tolerance, and so must the
    tokens, unless `transformers`' two likeliest (after its processors) are closer than that (a
    tie either may break: that row is compared no further). Raises `VerifyError` naming the row
    and the first token that differs."""
    gears = package.manifest.generation
    if not callable(getattr(model, "generate", None)):
        return Verified(
            skipped=f"{type(model).__name__} has no generate of transformers' to check against"
        )
    t = time.perf_counter()
    ids, mask = _prompts(gears, prompt)
    gear = next(n for n in gears.prefill_lengths if n >= ids.shape[1])
    new = min(1 + DECODE_STEPS, new_tokens_room(gears, gear))
    built = InProcessModel(package)
    logits_rank = package.manifest.mesh.logits_rank
    seen: list[torch.Tensor] = []

    def built_run(length: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        seen.append(built.run(list(inputs), length, logits_rank)[-1])
        return seen[-1]

    sampling = sampling_for({"do_sample": False}, gears.defaults)
    pad = gears.pad_for(gears.eos_token_id)
    steps = decode(
        choosing(built_run), gears, ids, mask, new, sampling, gears.eos_token_id, pad_token_id=pad
    )
    tokens = torch.stack(list(steps), dim=1)
    dtype = next(model.parameters()).dtype
    worst = 0.0

    def compare(expected: torch.Tensor, got: torch.Tensor, where: str) -> float:
        """`got`'s logits against `transformers`' `expected`, as a share of their scale."""
        e, b = expected.float(), got.float()
        scale = max(1.0, e.abs().max().item())
        allowed = tolerance(dtype) * scale
        diff = (b - e).abs().max().item()
        if not diff <= allowed:  # also refuses NaN
            raise VerifyError(
                f"the built generation package disagrees with transformers' generate at "
                f"{where}: the logits differ by up to {diff:.3g} (allowed {allowed:.3g} for "
                f"{dtype}); the package was not written. Please report this with the model "
                "and cluster"
            )
        return diff / scale

    wanted = []
    for row in range(len(ids)):
        alone = ids[row, mask[row].bool()][None]
        want = _transformers_generate(model, alone, new, pad)
        wanted.append(want)
        made = want.sequences[0, -len(want.logits) :]
        for step, (expected, scores) in enumerate(zip(want.logits, want.scores)):
            e = expected[0].float()
            allowed = tolerance(dtype) * max(1.0, e.abs().max().item())
            where = (
                f"row {row} (a prompt of {alone.shape[1]} tokens, alone in transformers' "
                f"generate), new token {step}"
            )
            worst = max(worst, compare(e, seen[step][row], where))
            if int(tokens[row, step]) != int(made[step]):
                top = scores[0].float().topk(2).values
                if (top[0] - top[1]).item() > allowed:
                    raise VerifyError(
                        f"the built generation package chooses another token than "
                        f"transformers' generate at {where}: {int(tokens[row, step])} against "
                        f"{int(made[step])}; the package was not written. Please report this "
                        "with the model and cluster"
                    )
                break  # a tie broken the other way: later steps see other tokens
    if gears.row_prefill:
        row_check = _check_row_gear(
            built, logits_rank, gears, ids[0], mask[0], gear, wanted[0], compare
        )
        worst = max(worst, row_check)
    return Verified(max_relative_diff=worst, seconds=round(time.perf_counter() - t, 3))


def _check_row_gear(
    built: InProcessModel,
    logits_rank: int,
    gears: Gears,
    ids: torch.Tensor,
    mask: torch.Tensor,
    gear: int,
    want: Any,  # transformers' GenerateDecoderOnlyOutput of the prompt alone
    compare: Callable[[torch.Tensor, torch.Tensor, str], float],
) -> float:
    """The one-row prefill gear of `gear` tokens admitting the prompt `ids` (one row, left
    padded by `mask`) into the cache's last row at slots 0 to `gear`, then a decode step of
    every row, against `transformers`' first two steps of the prompt alone: the gear wrote
    that row's keys and values where the decode gear reads them."""
    last, prompt = gears.max_batch_size - 1, int(mask.sum())
    slots = torch.zeros(1, gears.max_seq_len, dtype=torch.long)
    slots[0, gear - prompt : gear] = 1
    positions = torch.zeros(1, gear, dtype=torch.long)
    positions[0, gear - prompt :] = torch.arange(prompt)
    row_ids = torch.full((1, gear), gears.pad_for(gears.eos_token_id), dtype=torch.long)
    row_ids[0, gear - prompt :] = ids[mask.bool()]
    inputs = [row_ids, positions, torch.arange(gear), slots, torch.tensor([last])]
    where = f"the one-row prefill gear's row {last} (a prompt of {prompt} tokens)"
    first = built.run(inputs, row_gear(gear), logits_rank)[-1][0]
    worst = compare(want.logits[0][0], first, f"{where}, new token 0")
    if len(want.logits) < 2:
        return worst
    token = want.sequences[0, -len(want.logits)]
    rows = gears.max_batch_size
    step_ids = torch.full((rows, 1), gears.pad_for(gears.eos_token_id), dtype=torch.long)
    step_ids[last, 0] = token
    step_positions = torch.zeros(rows, 1, dtype=torch.long)
    step_positions[last, 0] = prompt
    step_mask = torch.zeros(rows, gears.max_seq_len, dtype=torch.long)
    step_mask[:, gear] = 1
    step_mask[last] = slots[0]
    step_mask[last, gear] = 1
    step = [step_ids, step_positions, torch.tensor([gear]), step_mask]
    logits = built.run(step, 1, logits_rank)[-1][last]
    return max(worst, compare(want.logits[1][0], logits, f"{where}, new token 1"))


def _prompts(gears: Any, prompt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts a generation package is checked on, left padded, and their mask: `prompt`'s
    rows as given, else random ids of two lengths (see `check_generation`)."""
    if prompt is not None:
        return prompt.long(), torch.ones_like(prompt, dtype=torch.long)
    shortest = gears.prefill_lengths[0]
    lengths = [max(1, shortest - 1)]
    if gears.max_batch_size > 1:
        other = max(1, lengths[0] // 2)
        lengths.append(other if other != lengths[0] else shortest)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, gears.vocab_size, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, ids.shape[1] - length :] = 1
    return ids * mask, mask


def _transformers_generate(model: torch.nn.Module, ids: torch.Tensor, new: int, pad: int) -> Any:
    """`transformers`' greedy generation of `new` tokens for the prompt `ids` (one row, no
    padding), with the model's own cache and settings, and each step's logits and scores."""
    with torch.no_grad():
        return model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
