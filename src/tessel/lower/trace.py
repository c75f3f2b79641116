"""Lower a plan to one local program per rank.

Each rank's program is traced with `make_fx` while the captured graph runs on DTensors laid out
as the plan says, under a fake process group of the cluster's size. DTensor's own dispatch works
out every local shape and the redistributions become explicit `_c10d_functional` collectives in
the traced graph: the program each device runs, with the communication inserted.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_leaves, tree_map

from tessel.capture import CapturedModel
from tessel.capture.portable import portable_attention
from tessel.errors import TesselError
from tessel.lower.program import encode, node_shapes
from tessel.lower.stitch import Stitcher, StitchError
from tessel.lower.weights import local_shard
from tessel.plan import Plan
from tessel.plan.candidates import DROPPED
from tessel.plan.strategies import LOCAL_RULES

log = logging.getLogger(__name__)


class LoweringError(TesselError, RuntimeError):
    pass


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[DeviceMesh]:
    """A fake process group of `world_size` seen from `rank`, and a 1-D mesh over it."""
    if dist.is_initialized():
        raise LoweringError(
            "tessel.build must run in a process without an initialised torch.distributed "
            "process group (it traces each rank under a fake one)"
        )
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # init_process_group wraps sys.excepthook to put "[rank0]:" before every line of an uncaught
    # error, and never unwraps it; a build is one process, so its errors keep their own form
    sys.excepthook = hook
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def weight_inputs(captured: CapturedModel, plan: Plan) -> list[tuple[str, str]]:
    """(placeholder name, FQN) of every weight, buffer and constant, in graph order."""
    sig = captured.program.graph_signature
    return [
        (s.arg.name, s.target)
        for s in sig.input_specs
        if s.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
    ]


@dataclass
class RankProgram:
    """One rank's lowered program (JSON), the constants it uses and its local tensor shapes."""

    program: dict
    constants: dict[str, torch.Tensor]
    shapes: dict[str, tuple[list[int], str]]


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
    world = plan.mesh_shape[0]
    with fake_world(rank, world) as mesh:

        def run(*flat: torch.Tensor) -> list[torch.Tensor]:
            it = iter(flat)
            raw = {placeholders[name]: next(it) for name, _fqn in weights}
            env = _Values(
                {n: partial(_wrap, t, mesh, plan.out_placements(n)) for n, t in raw.items()},
                stitcher,
            )
            if stitcher is not None:
                stitcher.start(env, raw)
            for name in captured.input_names:
                env[placeholders[name]] = DTensor.from_local(
                    next(it), mesh, [Replicate()], run_check=False
                )
            for name, value in constants.items():
                if name in placeholders:
                    env[placeholders[name]] = value
            for n in graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = [
                        _whole(v, mesh) for v in tree_leaves(_lookup(n.args[0], env, None, mesh))
                    ]
                    if stitcher is not None:
                        stitcher.record(env)
                    return outputs
                if stitcher is None:
                    env[n] = _run_node(n, env, plan, mesh)
                elif not stitcher.skips(n):
                    stitcher.before(n)
                    env[n] = _run_node(n, env, plan, mesh)
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
        if stitcher is not None:
            stitcher.stitch(gm.graph)
        gm.graph.eliminate_dead_code()
        portable_attention(gm, recompile=False)  # the program is read, never run, here
        program, constants = encode(gm)  # resolves collective groups while the world exists
    return RankProgram(program, constants, node_shapes(gm))


def _wrap(local: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    return DTensor.from_local(local, mesh, placements, run_check=False)


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
            want = tuple(targets[j].placements)
            if tuple(value.placements) != want:
                try:
                    value = value.redistribute(mesh, want)
                except Exception:  # noqa: BLE001 - e.g. MaskPartial: let the op's dispatch decide
                    log.debug("redistribute of %s to %s left to DTensor", a.name, want)
        return value

    return tree_map(sub, args, is_leaf=lambda x: isinstance(x, fx.Node))


def _run_node(n: fx.Node, env: dict, plan: Plan, mesh: DeviceMesh) -> Any:
    if n.target in DROPPED:
        return None
    if n.target is operator.getitem:
        return env[n.args[0]][n.args[1]]
    choice = plan.choices[n]
    if choice.kind in ("op",):
        targets = list(plan.strategy(n).inputs)
        args = _lookup(n.args, env, targets, mesh)
        kwargs = _lookup(n.kwargs, env, targets[_count_nodes(n.args) :], mesh)
        try:
            if n.target in LOCAL_RULES:
                return _run_local(n, args, kwargs, plan, mesh)
            return n.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - fall back to a replicated run of this node
            log.debug("%s (%s) replicated at lowering: %s", n.name, n.target, exc)
    return _replicated(n, env, mesh)


def _run_local(n: fx.Node, args: Any, kwargs: Any, plan: Plan, mesh: DeviceMesh) -> Any:
    """An op whose planned layout makes it shard-local: run it on the local tensors."""

    def local(a: Any) -> Any:
        return a.to_local() if isinstance(a, DTensor) else a

    out = n.target(*tree_map(local, args), **tree_map(local, kwargs))
    placements = plan.out_placements(n)
    return DTensor.from_local(out, mesh, placements, run_check=False)


def _count_nodes(args: Any) -> int:
    return sum(
        isinstance(a, fx.Node) for a in tree_leaves(args, is_leaf=lambda x: isinstance(x, fx.Node))
    )


def _replicated(n: fx.Node, env: dict, mesh: DeviceMesh) -> Any:
    """Run a node on whole tensors and hand its result on as replicated DTensors."""

    def local(a: Any) -> Any:
        if isinstance(a, fx.Node):
            a = env[a]
        return _whole(a, mesh)

    leaf = lambda x: isinstance(x, fx.Node)  # noqa: E731
    args = tree_map(local, n.args, is_leaf=leaf)
    kwargs = tree_map(local, n.kwargs, is_leaf=leaf)
    out = n.target(*args, **kwargs)

    def wrap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return DTensor.from_local(v, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return v

    return tree_map(wrap, out)
