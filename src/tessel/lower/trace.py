"""Lower a plan to one local program per rank.

Each rank's program is traced with `make_fx` while the captured graph runs on DTensors laid out
as the plan says, under a fake process group of the cluster's size. DTensor's own dispatch works
out every local shape and the redistributions become explicit `_c10d_functional` collectives in
the traced graph: the program each device runs, with the communication inserted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from tessel._torch import (
    C10D_FUNCTIONAL,
    MaskPartial,
    OpOverload,
    clear_dtensor_caches,
    fake_process_group,
    local_tensor,
    merged_moves,
    redistribute,
    traced_graph_length,
    traced_nodes_since,
    tree_leaves,
    tree_map,
)
from tessel.capture import CapturedModel
from tessel.capture.grouped_queries import fold_grouped_queries
from tessel.capture.portable import fresh_scalars, portable_attention, zero_fill_allocations
from tessel.capture.training import placed_like, state_outputs
from tessel.errors import TesselError
from tessel.lower.outputs import output_layout, shards_only
from tessel.lower.program import OutputLayout, RankProgram, encode, node_shapes
from tessel.lower.stitch import Stitcher, StitchError
from tessel.plan import Plan
from tessel.plan.candidates import DROPPED
from tessel.plan.memory import is_view, program_peak_bytes
from tessel.plan.planner import writes_into
from tessel.plan.strategies import LOCAL_RULES
from tessel.sharding.placements import local_shard

log = logging.getLogger(__name__)


class LoweringError(TesselError, RuntimeError):
    pass


@contextlib.contextmanager
def fake_world(
    rank: int, mesh_shape: tuple[int, ...], names: tuple[str, ...] | None = None
) -> Iterator[DeviceMesh]:
    """A fake process group over a mesh of `mesh_shape` seen from `rank`, and the mesh, whose
    moves over several axes are one collective where that is exact (`merged_moves`).

    DTensor's caches are cleared on the way in and out: what it decided while tracing one rank
    must not reach the next rank's program (see `clear_dtensor_caches`).
    """
    if dist.is_initialized():
        raise LoweringError(
            "tessel.build must run in a process without an initialised torch.distributed "
            "process group (it traces each rank under a fake one)"
        )
    clear_dtensor_caches()
    try:
        with fake_process_group(rank, math.prod(mesh_shape)):
            mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
            with merged_moves(mesh):
                yield mesh
    finally:
        clear_dtensor_caches()


def weight_inputs(captured: CapturedModel, plan: Plan) -> list[tuple[str, str]]:
    """(placeholder name, FQN) of every weight, buffer and constant, in graph order."""
    sig = captured.program.graph_signature
    return [
        (s.arg.name, s.target)
        for s in sig.input_specs
        if s.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
    ]


def lower_rank(captured: CapturedModel, plan: Plan, rank: int, stitch: bool = True) -> RankProgram:
    """The local program of `rank`: inputs are its weight shards, then the user inputs.

    With `stitch`, runs of identical layers are traced once and copied (`tessel.lower.stitch`);
    where the copies cannot be shown right, or without it, every layer is traced.
    """
    if not stitch:
        return _trace(captured, plan, rank, None)
    try:
        return _trace(captured, plan, rank, Stitcher.for_plan(captured.program.graph, plan))
    except StitchError as exc:
        log.info("rank %d: tracing every layer (%s)", rank, exc)
        return _trace(captured, plan, rank, None)


class _Values(dict):
    """Captured node -> its value while tracing.

    A weight becomes a DTensor where it is first read, so a skipped layer's weights are never
    wrapped; a skipped layer's value is stood in for.
    """

    def __init__(self, lazy: dict[fx.Node, Callable[[], Any]], stitcher: Stitcher | None) -> None:
        super().__init__()
        self.lazy = lazy
        self.stitcher = stitcher
        self.reduced: dict[fx.Node, DTensor] = {}  # masked partial values, once reduced

    def __missing__(self, n: fx.Node) -> Any:
        if n in self.lazy:
            value = self[n] = self.lazy.pop(n)()
        elif self.stitcher is not None and self.stitcher.skips(n):
            value = self[n] = self.stitcher.stand_in(n)
        else:
            raise KeyError(n)
        return value


def _trace(
    captured: CapturedModel, plan: Plan, rank: int, stitcher: Stitcher | None
) -> RankProgram:
    ep = captured.program
    graph = ep.graph_module.graph
    state = {**ep.state_dict, **ep.constants}
    weights = weight_inputs(captured, plan)
    constants = {
        s.arg.name: s.arg.value
        for s in ep.graph_signature.input_specs
        if s.kind.name == "USER_INPUT"
        and not hasattr(s.arg, "as_tensor")
        and hasattr(s.arg, "value")
    }
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    like = placed_like(graph, plan.param_targets)
    checked = _Checked()
    layouts: list[OutputLayout | None] = []
    with fake_world(rank, plan.mesh_shape, plan.mesh_names) as mesh:

        def run(*flat: torch.Tensor) -> list[torch.Tensor]:
            it = iter(flat)
            raw = {placeholders[name]: next(it) for name, _fqn in weights}
            env = _Values(
                {
                    n: partial(_wrap, t, mesh, plan.out_placements(n), n.meta["val"])
                    for n, t in raw.items()
                },
                stitcher,
            )
            if stitcher is not None:
                stitcher.start(env, raw)
            for name in captured.input_names:
                env[placeholders[name]] = DTensor.from_local(
                    next(it), mesh, [Replicate()] * mesh.ndim, run_check=False
                )
            for name, value in constants.items():
                if name in placeholders:
                    env[placeholders[name]] = value
            for n in graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    values = tree_leaves(_lookup(n.args[0], env, None, mesh))
                    if not like:  # a forward: each output as its shards, gathered to rank 0
                        values = [shards_only(v) if isinstance(v, DTensor) else v for v in values]
                        layouts[:] = [output_layout(v) for v in values]
                        if stitcher is not None:
                            stitcher.record(env)
                        return [v.to_local() if isinstance(v, DTensor) else v for v in values]
                    outputs = [
                        _placed_like(v, mesh, plan.out_placements(like[i]))
                        if i in like
                        else _whole(v, mesh)
                        for i, v in enumerate(values)
                    ]
                    if stitcher is not None:
                        stitcher.record(env)
                    return outputs
                if stitcher is None:
                    env[n] = _run_node(n, env, plan, mesh, checked)
                elif not stitcher.skips(n):
                    stitcher.before(n)
                    env[n] = _run_node(n, env, plan, mesh, checked)
                    stitcher.after(n)
            raise LoweringError("graph has no output node")

        example = []
        for name, fqn in weights:
            node = placeholders[name]
            full = state[fqn]
            shard = local_shard(full, plan.out_placements(node), plan.mesh_shape, rank)
            example.append(torch.empty(shard.shape, dtype=shard.dtype))
        example += [torch.zeros_like(x) for x in captured.example_inputs]
        gm = make_fx(run, tracing_mode="fake")(*example)
        checked.raise_if_any()
        if stitcher is not None:
            stitcher.stitch(gm.graph)
        gm.graph.eliminate_dead_code()
        _drop_identity_views(gm.graph)
        portable_attention(gm, recompile=False)  # the program is read, never run, here
        fold_grouped_queries(gm.graph)
        zero_fill_allocations(gm)
        fresh_scalars(gm)
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        written = state_outputs(graph)
        writable = [name for name, (_, fqn) in zip(inputs, weights) if fqn in written]
        _check_written_in_place(gm, written, {fqn: name for name, (_, fqn) in zip(inputs, weights)})
        # resolves collective groups while the world exists
        program, constants = encode(gm, state=writable)
    # a weight under a second name (tied) loads as the first name's tensor: held once
    first: dict[int, str] = {}
    aliases = {
        name
        for name, (_, fqn) in zip(inputs, weights)
        if first.setdefault(id(state[fqn]), name) != name
    }
    held, peak = program_peak_bytes(gm.graph, set(inputs[: len(weights)]) - aliases, aliases)
    return RankProgram(program, constants, node_shapes(gm), held, peak, layouts or None)


def _check_written_in_place(
    gm: fx.GraphModule, written: tuple[str, ...], local: dict[str, str]
) -> None:
    """Every state the graph writes (output `i` is state `written[i]`) is returned as the
    in-place write into the rank's own input: a write into a copy would be lost."""
    if not written:
        return
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for value, fqn in zip(out.args[0], written):
        while isinstance(value, fx.Node) and is_view(value) and not writes_into(value, 0):
            value = value.args[0]  # a view of the written tensor is that tensor
        target = value.args[0] if isinstance(value, fx.Node) and value.args else None
        if not (
            isinstance(target, fx.Node) and target.name == local[fqn] and writes_into(value, 0)
        ):
            raise LoweringError(
                f"the plan moves the state {fqn} before its in-place write ({value}): the "
                "write would land in a copy"
            )


_VIEWS = (
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
)


def _drop_identity_views(graph: fx.Graph) -> int:
    """Read the tensor itself where a program views it as it already is (DTensor views each
    local shard it wraps or unwraps to its own shape): each such call costs a dispatch at run
    time and computes nothing. Views an output returns stay; returns how many were dropped."""
    dropped = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _VIEWS:
            continue
        source = n.args[0]
        out, val = n.meta.get("val"), getattr(source, "meta", {}).get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        if (out.shape, out.stride(), out.dtype) != (val.shape, val.stride(), val.dtype):
            continue
        if any(u.op == "output" for u in n.users):
            continue
        n.replace_all_uses_with(source)
        graph.erase_node(n)
        dropped += 1
    return dropped


def _wrap(local: torch.Tensor, mesh: DeviceMesh, placements: tuple, whole: torch.Tensor) -> DTensor:
    """A rank's shard as a DTensor of the whole tensor's shape (shards may be uneven)."""
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=whole.shape, stride=whole.stride()
    )


def _placed_like(value: Any, mesh: DeviceMesh, placements: tuple) -> Any:
    """A gradient as the rank holding its weight's shard needs it: that shard's gradient."""
    if isinstance(value, DTensor):
        return value.redistribute(mesh, list(placements)).to_local()
    return value


def _whole(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, DTensor):
        return value.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    return value


def _lookup(args: Any, env: dict, targets: list | None, mesh: DeviceMesh) -> Any:
    """Replace graph nodes by their values, redistributed to `targets` in order of appearance."""
    counter = iter(range(10**9))

    def sub(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        value = env[a]
        j = next(counter)
        if targets is None or j >= len(targets) or targets[j] is None:
            return value
        if isinstance(value, DTensor):
            moved = _move(env, a, value, tuple(targets[j].placements))
            # the shard itself, not `to_local`'s view of it: that view is traced into the
            # program (and dropped again) for every input
            local = remade = local_tensor(moved)
            if all(isinstance(p, Replicate) for p in moved.placements):
                remade = _laid_out(local, a.meta.get("val"))
            elif moved is not value:
                remade = _without_gaps(local)
            if remade is not local:
                moved = DTensor.from_local(
                    remade,
                    mesh,
                    moved.placements,
                    run_check=False,
                    shape=moved.shape,
                    stride=moved.stride(),
                )
            value = moved
        return value

    return tree_map(sub, args, is_leaf=lambda x: isinstance(x, fx.Node))


def _move(env: dict, n: fx.Node, value: DTensor, want: tuple) -> DTensor:
    """`value` (node `n`'s) moved for an op that takes it in `want`.

    A masked partial value (a vocabulary-sharded embedding's output) keeps the mask it must be
    reduced with only until its first reduction, so it is reduced once, for its first
    consumer, and later consumers move that result.
    """
    reduced = getattr(env, "reduced", None)
    if reduced is not None and n in reduced:
        return _moved_for_op(reduced[n], want)
    moved = _moved_for_op(value, want)
    if reduced is not None and moved is not value and _masked(value) and not _masked(moved):
        reduced[n] = moved
    return moved


def _masked(value: DTensor) -> bool:
    return any(isinstance(p, MaskPartial) for p in value.placements)


def _moved_for_op(value: DTensor, want: tuple) -> DTensor:
    """`value` moved to the placements an op takes it in, except that a replicated tensor the
    op takes as masked partial is handed over replicated: the embedding lookup's own dispatch
    makes that local move and keeps the mask it needs. Any other partial input is made here:
    given a replicated input, DTensor's dispatch would keep the output replicated, not the
    partial output the plan counts on."""
    have = tuple(value.placements)
    if all(a == b or (a.is_replicate() and isinstance(b, MaskPartial)) for a, b in zip(have, want)):
        return value
    return redistribute(value, want)


# a failure of an operator whose inputs were placed as planned: DTensor's rule for it placed
# the output otherwise (a property of the operator and its inputs' placements)
PLACED_OTHERWISE = "DTensor placed the output"


class NotAsPlanned(LoweringError):
    """DTensor cannot run some nodes the way the plan places them; the planner drops those
    strategies. `failures` holds (node, strategy, reason) for each."""

    def __init__(self, failures: list[tuple[fx.Node, Any, str]]) -> None:
        self.failures = failures
        node, _, reason = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(f"node {node.name} ({node.target}) cannot run as planned: {reason}{more}")


class _Checked:
    """Nodes whose lowering departed from the plan while one rank was traced."""

    def __init__(self) -> None:
        self.failures: list[tuple[fx.Node, Any, str]] = []

    def fail(self, n: fx.Node, strategy: Any, reason: str) -> None:
        self.failures.append((n, strategy, reason))

    def raise_if_any(self) -> None:
        if self.failures:
            raise NotAsPlanned(self.failures)


def _run_node(n: fx.Node, env: dict, plan: Plan, mesh: DeviceMesh, checked: _Checked) -> Any:
    """Run one captured node on DTensors exactly as the plan places it.

    Inputs are moved to the strategy's input placements; DTensor must then run the op without
    moving anything itself (no collective inside the op) and give the planned output placements.
    A departure is recorded in `checked` and the trace goes on as the plan says, so one trace
    finds every node the plan must drop a strategy for.
    """
    if n.target in DROPPED:
        return None
    if n.target is operator.getitem:
        return env[n.args[0]][n.args[1]]
    choice = plan.choices[n]
    if choice.kind != "op":
        return _replicated(n, env, mesh)  # the plan runs it on whole tensors
    strategy = plan.strategy(n)
    targets = list(strategy.inputs)
    try:
        args = _lookup(n.args, env, targets, mesh)
        kwargs = _lookup(n.kwargs, env, targets[_count_nodes(n.args) :], mesh)
    except StitchError:
        raise
    except Exception as exc:  # noqa: BLE001 - a move DTensor cannot make
        checked.fail(n, strategy, f"cannot move an input: {_first_line(exc)}")
        return _replicated(n, env, mesh)
    if n.target in LOCAL_RULES:
        return _run_local(n, args, kwargs, plan, mesh)
    before = traced_graph_length() or 0
    try:
        out = _operator(n)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - DTensor cannot run the op on these placements
        checked.fail(n, strategy, _first_line(exc))
        return _replicated(n, env, mesh)
    moved = sorted({str(t.target) for t in traced_nodes_since(before) if _is_collective(t)})
    if moved:
        checked.fail(n, strategy, f"DTensor moved its inputs itself ({', '.join(moved)})")
    return _as_planned(out, strategy, n, checked)


def _text(placements: Any) -> tuple[str, ...]:
    """Placements as text: a masked-partial placement compares by its layout, not its mask."""
    return tuple(str(p) for p in placements)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == C10D_FUNCTIONAL


def _as_planned(out: Any, strategy: Any, n: fx.Node, checked: _Checked) -> Any:
    """`out` with every DTensor output at the placements the strategy promises."""
    specs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)

    def planned(value: Any, spec: Any) -> Any:
        if spec is None or not isinstance(value, DTensor):
            return value
        want = tuple(spec.placements)
        if _text(value.placements) != _text(want):
            checked.fail(n, strategy, f"{PLACED_OTHERWISE} {tuple(value.placements)}")
            try:
                value = redistribute(value, want)
            except Exception:  # noqa: BLE001 - the trace cannot go on as planned: stop it here
                checked.raise_if_any()
        return value

    if isinstance(out, DTensor):
        return planned(out, specs[0])
    if isinstance(out, (tuple, list)):
        moved = [planned(v, specs[i] if i < len(specs) else None) for i, v in enumerate(out)]
        return type(out)(moved)
    return out


def _run_local(n: fx.Node, args: Any, kwargs: Any, plan: Plan, mesh: DeviceMesh) -> Any:
    """An op whose planned layout makes it shard-local: run it on the local tensors."""

    def local(a: Any) -> Any:
        return local_tensor(a) if isinstance(a, DTensor) else a

    out = _operator(n)(*tree_map(local, args), **tree_map(local, kwargs))
    return _wrap(out, mesh, plan.out_placements(n), n.meta["val"])


def _count_nodes(args: Any) -> int:
    return sum(
        isinstance(a, fx.Node) for a in tree_leaves(args, is_leaf=lambda x: isinstance(x, fx.Node))
    )


def _laid_out(t: torch.Tensor, captured: Any, viewed: bool = False) -> torch.Tensor:
    """`t` with the strides the captured graph gave its value, where they differ.

    A gathered tensor comes back contiguous in its own order, which need not be the layout the
    captured graph had (a transposed value stays transposed there), and a `view` taken of it
    may then be impossible. Dense layouts are remade with a permute, a copy and the inverse
    permute; anything else is left as it is. For the input of a view (`viewed`), the strides
    of size-1 dims, which no view reads, need not match: there a copy whose other dims nest as
    captured serves.
    """
    if not isinstance(captured, torch.Tensor) or tuple(t.shape) != tuple(captured.shape):
        return t
    want = tuple(captured.stride())

    def laid_as_wanted(x: torch.Tensor) -> bool:
        return all(a == b for a, b, n in zip(x.stride(), want, x.shape) if n != 1 or not viewed)

    if laid_as_wanted(t) or t.dim() == 0:
        return t
    remade = _dense_copy(t, want)
    return remade if laid_as_wanted(remade) else t


def _dense_copy(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A dense copy of `t` whose dims nest in the order `strides` gives them (the largest
    stride outermost), by a permute, a copy and the inverse permute."""
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))  # outermost first
    inverse = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def _without_gaps(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it in the same dim order where its elements leave gaps in memory.

    A collective over uneven shards pads them and cuts the padding off its result with a
    view, which leaves gaps between rows; an op that views the shard across such a gap (a
    `view` joining the dims on either side) cannot run on it. The moved value is made dense
    instead, and the padded buffer freed (`tessel.plan.memory` counts the copy)."""
    strides = t.stride()
    if t.dim() == 0 or any(st == 0 and n > 1 for st, n in zip(strides, t.shape)):
        return t  # a broadcast (overlapping) view: a copy would make it larger, not dense
    step = 1
    for d in sorted(range(t.dim()), key=lambda d: (strides[d], -d)):  # innermost first
        if t.shape[d] != 1 and strides[d] != step:
            return _dense_copy(t, strides)
        step *= t.shape[d]
    return t


def _replicated(n: fx.Node, env: dict, mesh: DeviceMesh) -> Any:
    """Run a node on whole tensors and hand its result on as replicated DTensors."""

    whole = tuple(Replicate() for _ in range(mesh.ndim))
    viewed = isinstance(n.target, OpOverload) and n.target.is_view

    def local(a: Any) -> Any:
        if isinstance(a, fx.Node):
            value = env[a]
            if isinstance(value, DTensor):
                moved = local_tensor(_move(env, a, value, whole))
                return _laid_out(moved, a.meta.get("val"), viewed)
            return value
        return _whole(a, mesh)

    leaf = lambda x: isinstance(x, fx.Node)  # noqa: E731
    args = tree_map(local, n.args, is_leaf=leaf)
    kwargs = tree_map(local, n.kwargs, is_leaf=leaf)
    out = _operator(n)(*args, **kwargs)

    def wrap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return DTensor.from_local(v, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return v

    return tree_map(wrap, out)


def _operator(n: fx.Node) -> Callable[..., Any]:
    """The function a `call_function` node calls."""
    if not callable(n.target):
        raise TesselError(f"node {n.name} calls {n.target!r}, which is not a function")
    return n.target
