"""`tessel run` and `tessel serve`: a Session driven from the command line."""

from __future__ import annotations

import argparse
import math
import signal
import time
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tessel.atomic import replace_atomically
from tessel.config.errors import ConfigError
from tessel.config.sampling import Sampling
from tessel.dtypes import dtype_name, torch_dtype
from tessel.package import Package
from tessel.package.manifest import Manifest
from tessel.runtime.session import Session, finalize, initialize


def random_inputs(manifest: Manifest) -> list[torch.Tensor]:
    """Inputs of the recorded shapes: integers below the example's bound, floats from N(0, 1);
    refused by name, before any is made, where they would not fit the available memory."""
    import psutil

    available = psutil.virtual_memory().available
    need = sum(math.prod(s.shape) * torch_dtype(s.dtype).itemsize for s in manifest.inputs)
    if need > available:
        raise ConfigError(
            "--inputs",
            None,
            f"random inputs of the recorded shapes {[list(s.shape) for s in manifest.inputs]} "
            f"take {need:,} bytes; this machine has {available:,} available",
        )
    out = []
    for spec in manifest.inputs:
        dtype = torch_dtype(spec.dtype)
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.ones(spec.shape, dtype=dtype))
        else:
            out.append(torch.randint(0, spec.high or 2, spec.shape, dtype=dtype))
    return out


def read_inputs(path: str, manifest: Manifest) -> list[torch.Tensor]:
    """`input_0, input_1, ...` from a safetensors file, each of the shape and dtype the model
    was built for; anything else is a `ConfigError` naming the file (and the tensor)."""
    tensors = _read_safetensors(path)
    names = [f"input_{i}" for i in range(len(manifest.inputs))]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(path, None, f"missing tensors {missing}; expected {names}")
    extra = sorted(set(tensors) - set(names))
    if extra:
        raise ConfigError(path, None, f"unexpected tensors {extra}; expected {names}")
    for name, spec in zip(names, manifest.inputs):
        x = tensors[name]
        dtype = dtype_name(x.dtype)
        if tuple(x.shape) != spec.shape or dtype != spec.dtype:
            raise ConfigError(
                path,
                name,
                f"expected shape {list(spec.shape)} {spec.dtype} (the model's input "
                f"{spec.name!r}), found {list(x.shape)} {dtype}",
            )
    return [tensors[n] for n in names]


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file") from None
    except OSError as exc:  # a directory, a file that cannot be read
        raise ConfigError(path, None, f"cannot read it: {exc.strerror or exc}") from None
    except SafetensorError as exc:
        raise ConfigError(path, None, f"not a safetensors file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def write_outputs(path: str, outputs: list[torch.Tensor]) -> None:
    """Write `output_0, output_1, ...` to a safetensors file (`_write_tensors`)."""
    _write_tensors(path, {f"output_{i}": o for i, o in enumerate(outputs)})


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file atomically: to a temporary name beside it, synced, then renamed
    over it; a failure leaves no temporary behind."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with replace_atomically(target) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    except OSError as exc:
        raise ConfigError(path, None, f"cannot write it: {exc.strerror or exc}") from None


def run_command(args: argparse.Namespace) -> int:
    manifest = Package.open(args.model).manifest
    inputs = read_inputs(args.inputs, manifest) if args.inputs else random_inputs(manifest)
    options = {} if args.node_id is None else {"tessel.node_id": args.node_id}
    initialize()
    try:
        session = Session()
        t = time.perf_counter()
        session.load_graph(0, options, args.model)
        print(f"loaded on {manifest.world_size} devices in {time.perf_counter() - t:.2f} s")
        times = []
        for _ in range(max(1, args.repeat)):
            t = time.perf_counter()
            outputs = session.run_graph(0, inputs)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"run_graph: {1e3 * times[len(times) // 2]:.1f} ms (median of {len(times)})")
        for i, o in enumerate(outputs):
            print(f"output_{i}: {list(o.shape)} {dtype_name(o.dtype)}")
        if args.output:
            write_outputs(args.output, outputs)
            print(f"wrote {args.output}")
    finally:
        finalize()
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Run this node's workers until the head node's session stops them."""
    initialize()
    try:
        session = Session()
        session.load_graph(0, {"tessel.node_id": args.node_id}, args.model)
        print(f"node {args.node_id}: workers joined; serving", flush=True)
        graph = session._graphs[0]
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        while not stop["now"] and all(p.is_alive() for p in graph.procs):
            time.sleep(0.2)
        for p in graph.procs:
            p.join(0)
    finally:
        finalize()
    return 0


def read_prompt(path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`input_ids` `[rows, tokens]` and, where present, `attention_mask` from a safetensors
    file; anything else is a `ConfigError` naming the file and the tensor."""
    tensors = _read_safetensors(path)
    if "input_ids" not in tensors:
        raise ConfigError(
            path, "input_ids", f"is missing; the file holds {sorted(tensors) or 'nothing'}"
        )
    extra = sorted(set(tensors) - {"input_ids", "attention_mask"})
    if extra:
        raise ConfigError(
            path, None, f"unexpected tensors {extra}; expected input_ids and attention_mask"
        )
    for name, x in tensors.items():
        if x.dtype not in (torch.int64, torch.int32) or x.dim() not in (1, 2):
            raise ConfigError(
                path,
                name,
                f"expected int64 token ids [rows, tokens], found {list(x.shape)} "
                f"{dtype_name(x.dtype)}",
            )
    ids = tensors["input_ids"].long()
    mask = tensors.get("attention_mask")
    ids = ids[None] if ids.dim() == 1 else ids
    if mask is not None:
        mask = mask.long()
        mask = mask[None] if mask.dim() == 1 else mask
    return ids, mask


def generate_command(args: argparse.Namespace) -> int:
    """`tessel generate`: token ids (or a tokenizer's prompts) in, generated tokens out."""
    manifest = Package.open(args.model).manifest
    if manifest.generation is None:
        raise ConfigError(
            args.model,
            None,
            "was built without generation gears (tessel build --max_seq_len ... "
            "--input_shape=input_ids:-1,-1 --dynamic_dims ...)",
        )
    tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
    if (args.input_ids is None) == (not args.prompt):
        raise ConfigError(
            "command line",
            "--input-ids",
            "give the prompt one way: --input-ids FILE.safetensors, or --prompt TEXT (repeated "
            "for a batch) with --tokenizer DIR",
        )
    if args.prompt:
        if tokenizer is None:
            raise ConfigError(
                "command line", "--prompt", "needs --tokenizer DIR (a saved Hugging Face tokenizer)"
            )
        try:
            encoded = tokenizer(list(args.prompt), return_tensors="pt", padding=True)
        except ValueError as exc:  # several prompts and no pad token to pad them with
            raise ConfigError(args.tokenizer, None, _first_line(exc)) from None
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
    else:
        ids, mask = read_prompt(args.input_ids)
    # each Sampling field's flag has the field's name as its dest (tessel.cli); None: not asked
    settings = {f.name: getattr(args, f.name) for f in fields(Sampling)}
    settings.update(eos_token_id=args.eos_token_id, pad_token_id=args.pad_token_id)
    options = {} if args.node_id is None else {"tessel.node_id": args.node_id}
    initialize()
    try:
        session = Session()
        session.load_graph(0, options, args.model)
        t = time.perf_counter()
        steps: list[torch.Tensor] = []
        shown = ""
        for step in session.generate(0, ids, mask, args.max_new_tokens, stream=True, **settings):
            if not steps:
                first = time.perf_counter() - t
            steps.append(step)
            if args.stream:  # tokens as they come: the first row's text, or each step's ids
                if tokenizer is not None and len(step) == 1:
                    text = tokenizer.decode(torch.cat(steps), skip_special_tokens=True)
                    print(text[len(shown) :], end="", flush=True)
                    shown = text
                else:
                    print(" ".join(map(str, step.tolist())), flush=True)
        took = time.perf_counter() - t
    finally:
        finalize()
    if shown:
        print()
    new = torch.stack(steps, dim=1)
    rate = ""
    if len(steps) > 1:
        rate = f", then {(len(steps) - 1) * len(new) / (took - first):.1f} tokens/s"
    print(f"{len(steps)} new tokens per row: the first in {1e3 * first:.0f} ms{rate}")
    for row in range(new.shape[0]):
        if tokenizer is not None:
            print(tokenizer.decode(new[row], skip_special_tokens=True))
        else:
            print(" ".join(map(str, new[row].tolist())))
    if args.output:  # as generate returns them: an encoder-decoder's from its start token
        gears = Package.open(args.model).manifest.generation
        start = gears.decoder_start_token_id if gears is not None else None
        head = ids if start is None else torch.full_like(ids[:, :1], start)
        _write_tensors(args.output, {"sequences": torch.cat([head, new], dim=1)})
        print(f"wrote {args.output}")
    return 0


def _tokenizer(directory: str):
    """A saved Hugging Face tokenizer (its files read as data: no remote code), padding on the
    left as generation takes prompts."""
    from transformers import AutoTokenizer

    if not Path(directory).is_dir():
        raise ConfigError("--tokenizer", None, f"expected a directory, found {directory!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            directory, None, f"holds no saved tokenizer ({_first_line(exc)})"
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer
