"""A forward's outputs brought to rank 0 once, into their final buffer.

A traced forward program returns each output as the shard its rank holds (partial sums are
reduced to shards first, in the trace: `shards_only`). `gather_outputs` then appends to each
rank's program the collectives that bring those shards to rank 0: for each mesh axis the output
is sharded along, innermost first, one `all_to_all_single` whose split sizes send every rank's
rows to the axis's first rank alone. That rank receives the shards, uneven ones included, into
one buffer with no padding; nobody else receives anything. A shard along a dimension other than
the first is sent with that dimension first (a copy of the shard) and the buffer is returned as
a view with the dimensions back in order, so rank 0 holds the output once and the other ranks
hold their shards only, never the whole output.

The collectives are appended to the JSON programs after every rank's program is made, so the
programs that ranks share (moved along the mesh, or interpolated between the first and last
rank) are shared before rank 0's program departs from the others' at its end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from tessel._torch import C10D_FUNCTIONAL
from tessel.dtypes import dtype_name, torch_dtype
from tessel.lower.nodes import Node, ProgramNodes, call, contiguous_copy, output, ref
from tessel.lower.program import OutputLayout, ProgramError, RankProgram, decode_graph, groups_in
from tessel.plan.memory import program_peak_bytes
from tessel.sharding.gather import gather_steps, partial_to_shards, shard_placements

_PERMUTE = "aten.permute.default"
_GATHER = f"{C10D_FUNCTIONAL}.all_to_all_single.default"
_WAIT = f"{C10D_FUNCTIONAL}.wait_tensor.default"


def shards_only(value: DTensor) -> DTensor:
    """`value` with every partial placement reduced to a shard (`partial_to_shards`): a
    reduce-scatter, so each rank receives its part of the sum, never the whole."""
    if not any(p.is_partial() for p in value.placements):
        return value
    mesh = value.device_mesh
    shards = partial_to_shards(value.shape, value.placements, mesh.shape)
    return value.redistribute(mesh, shard_placements(shards))


def output_layout(value: Any) -> OutputLayout | None:
    """The layout of a forward output (after `shards_only`); None for what is not a DTensor."""
    if not isinstance(value, DTensor):
        return None
    shards = tuple(p.dim if isinstance(p, Shard) else None for p in value.placements)
    return OutputLayout(
        tuple(value.shape),
        dtype_name(value.dtype),
        shards,
        value.to_local().is_contiguous(),
    )


def gather_outputs(rp: RankProgram, rank: int, mesh_shape: tuple[int, ...]) -> RankProgram:
    """`rp` (rank `rank`'s program, returning its outputs' shards) with its outputs gathered:
    rank 0's program returns the whole outputs, each in one buffer; any other rank's returns
    what it is left with (its shard, or an empty tensor once it has sent its rows)."""
    if rp.output_layouts is None:
        return rp
    program = ProgramNodes.read(rp.program)
    args = program.output.args
    if not isinstance(args, list) or len(args) != len(rp.output_layouts):
        raise ProgramError("the program's outputs do not match the layouts recorded for them")
    shapes = dict(rp.shapes)
    gathered: dict[str, str] = {}
    tail: list[Node] = []
    new_args = []
    for i, (arg, layout) in enumerate(zip(args, rp.output_layouts)):
        name = arg.get("$node") if isinstance(arg, dict) else None
        if layout is None or name is None:
            new_args.append(arg)
            continue
        if name not in gathered:
            gathered[name] = _gather(
                name, f"output{i}_to_first", layout, mesh_shape, rank, shapes, tail
            )
        new_args.append(ref(gathered[name]))
    if not tail:
        return replace(rp, output_layouts=None)
    gathering = program.program([*program.nodes, *tail, output(new_args)])
    return replace(rp, program=gathering, shapes=shapes, output_layouts=None)


def _gather(
    name: str,
    prefix: str,
    layout: OutputLayout,
    mesh_shape: tuple[int, ...],
    rank: int,
    shapes: dict,
    tail: list[Node],
) -> str:
    """Append the nodes gathering output `name` to `tail`; the name of what rank returns."""
    contiguous = layout.contiguous
    current = name
    for k, step in enumerate(gather_steps(layout.shape, layout.shards, mesh_shape, rank)):
        shape = list(shapes[current][0])
        dim, ndim = step.dim, len(shape)
        order = [dim, *(d for d in range(ndim) if d != dim)]
        base = f"{prefix}_gather{k}"
        sent = current
        if dim != 0:
            sent = f"{base}_leading"
            shapes[sent] = ([shape[d] for d in order], layout.dtype)
            tail.append(call(sent, _PERMUTE, [ref(current), order]))
            contiguous = False
        if not contiguous:
            copy = f"{base}_send"
            shapes[copy] = shapes[sent]
            tail.append(contiguous_copy(copy, sent))
            sent = copy
        n = len(step.group)
        into = step.sizes if step.me == 0 else [0] * n
        out_from = [step.sizes[step.me] if j == 0 else 0 for j in range(n)]
        rows = sum(into)
        received = [rows, *shapes[sent][0][1:]]
        shapes[f"{base}_recv"] = shapes[f"{base}_buf"] = (received, layout.dtype)
        group = {"$group": step.group}
        tail.append(call(f"{base}_buf", _GATHER, [ref(sent), into, out_from, group]))
        tail.append(call(f"{base}_recv", _WAIT, [ref(f"{base}_buf")]))
        current, contiguous = f"{base}_recv", True
        if dim != 0:
            inverse = sorted(range(ndim), key=order.__getitem__)
            current = f"{base}_whole"
            shapes[current] = ([received[d] for d in inverse], layout.dtype)
            tail.append(call(current, _PERMUTE, [ref(f"{base}_recv"), inverse]))
            contiguous = False
    return current


def measured(rp: RankProgram, weight_inputs: int) -> RankProgram:
    """`rp` with its peak bytes measured on its JSON program (`program_bytes`); its weight
    bytes are kept."""
    held, peak = program_bytes(rp, weight_inputs)
    return replace(rp, peak_bytes=max(rp.peak_bytes, rp.weight_bytes + peak - held))


def program_bytes(rp: RankProgram, weight_inputs: int) -> tuple[int, int]:
    """(weight bytes, peak bytes) of `rp` as a device runs it, from its recorded local shapes:
    its first `weight_inputs` inputs and its constants held throughout, every other value
    freed after its last use (the outputs of a call returning several counted too)."""
    groups = {tuple(g): "" for g in groups_in(rp.program)}
    # decoded, never run: "cpu" admits CPU-only kernels, and constants stay where they are
    _, graph = decode_graph(rp.program, rp.constants, torch.device("cpu"), groups)
    inputs = []
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    by_name = {}
    for spec, n in zip(rp.program["nodes"], graph.nodes):  # one graph node per program node
        by_name[spec.get("name")] = n
        if spec.get("name") in rp.shapes:
            shape, dtype = rp.shapes[spec["name"]]
            n.meta["val"] = torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            if spec.get("target") == "getitem":
                pieces.setdefault(spec["args"][0]["$node"], {})[spec["args"][1]] = n.meta["val"]
        if n.op == "placeholder":
            inputs.append(n.name)
    for tuple_name, parts in pieces.items():  # a tuple-valued node: its pieces' values
        node = by_name[tuple_name]
        if "val" not in node.meta:
            node.meta["val"] = [parts.get(i) for i in range(max(parts) + 1)]
    return program_peak_bytes(graph, set(inputs[:weight_inputs]))
