"""A training script's network, planned by tessel and run as each rank's partitioned program.

Inside a running torchrun job the first call plans: rank 0 builds a training package of the
network for the job's ranks in a forked child process (lowering traces every rank under a fake
process group, which a process already in the job cannot open; forked, the child needs nothing
pickled), and broadcasts it; every rank
then loads its own program and weight shards from it, so all ranks run one plan, on rank 0's
weights. The network's trained parameters become DTensors placed as the plan places them
(`dp` first where the plan has data-parallel replicas, each running the program on its rows);
the old parameter objects retire (`tessel.parallel.replaced`).

Each call runs the rank's program: the joint forward and backward graph, which returns the
loss and every trained weight's gradient placed like the weight. The loss comes back through a
custom autograd function whose backward hands those gradients to the DTensor parameters, so
`loss.backward()`, `torch.optim` and gradient clipping work on them unchanged. With
data-parallel replicas, the program hands over each bucket of gradients as soon as the backward
pass has made it, and the bucket's all-reduce over the replicas starts while the pass goes on;
the loss's backward scales the sums by its incoming gradient once every replica is found to
scale its loss alike (replicas that scale theirs differently get their scaled gradients summed
again, as the weighted sum that is then the gradient).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tessel._torch import forget_process_groups, tree_map
from tessel.forked import Child, ended_how
from tessel.package.format import Package
from tessel.parallel.errors import ParallelError
from tessel.parallel.replaced import replace_parameters
from tessel.progress import phase
from tessel.runtime.exchange import DEFAULT_FUSION, InFlight, all_reduce_in_buckets, fusion_buckets
from tessel.runtime.loader import load_rank
from tessel.runtime.step_program import gather_weights, hand_over_gradients, made_order
from tessel.runtime.worker import make_groups
from tessel.sharding.geometry import piece
from tessel.sharding.placements import placement_from_str

log = logging.getLogger(__name__)

_TIME_LIMIT = 60.0  # seconds the solver may take for one plan
_UNUSED = torch.empty(0)  # given for a program input the program no longer reads


def _build(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    cluster: Any,
    soc: str,
    fixed: tuple[tuple[str, tuple[str, ...]], ...],
    replicas: int | None,
    path: str,
) -> str:
    """In the child process: choose the data-parallel size (unless `replicas` gives it),
    build the training package and write it to `path`. `soc` names the devices of a cluster
    given as a device count; `fixed` gives weights their placements on the tensor-parallel
    mesh dim."""
    from tessel.builder.mesh_choice import choose_data_parallel
    from tessel.builder.pipeline import build, cluster_config
    from tessel.capture.export import training_capture_reused
    from tessel.config.parallel_option import ParallelOption
    from tessel.plan import has_rule

    config = cluster_config(cluster, soc)
    trained = [p for p in model.parameters() if p.requires_grad]
    # the plan's memory model counts AdamW's two states per weight: the script's optimizer is
    # made after planning, and AdamW is what such scripts most often make
    optimizer = torch.optim.AdamW(trained)
    dp = replicas
    captures: dict = {}
    if dp is None:
        dp, _ = choose_data_parallel(
            model, args, kwargs, config, ParallelOption(), _TIME_LIMIT, 3.0, captures
        )
    # the build captures the chosen size's replica step again: it takes the one weighed (the
    # others are let go)
    a, k, captured = captures.pop(dp, ((), {}, None))
    captures.clear()
    with training_capture_reused(model, has_rule, a, k, captured):
        built = build(
            model,
            args,
            example_kwargs=kwargs,
            cluster=config,
            policy=ParallelOption(
                data_parallel_size=dp,
                tensor_parallel_size=config.world_size // dp,
                fixed_placements=fixed,
            ),
            soc_version=soc,
            optimizer=optimizer,
            time_limit=_TIME_LIMIT,
            verify=False,
        )
    return str(built.save(path))


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def planned_package(
    network: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    cluster: Any = None,
    fixed: tuple[tuple[str, tuple[str, ...]], ...] = (),
    replicas: int | None = None,
) -> Iterator[Package]:
    """Every rank's copy of the package rank 0 built for this job (see the module docstring),
    open while the context lasts. `fixed`: weights' placements on the tensor-parallel dim,
    given, not planned; `replicas`: the data-parallel size, given (None: chosen)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = b""
    failure = ""
    with _whole_parameters(network):
        if rank == 0:
            data, failure = _plan_on_rank0(
                network, args, kwargs, device, cluster, fixed, replicas, world
            )
    failure = broadcast_bytes(failure.encode(), device).decode()
    if failure:
        raise ParallelError(failure)
    data = broadcast_bytes(data, device)
    handle, path = tempfile.mkstemp(prefix="tessel-plan-", suffix=".tessel")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        package = Package.open(path)
        package.verify()
        yield package
    finally:
        os.unlink(path)


@contextlib.contextmanager
def _whole_parameters(network: torch.nn.Module) -> Iterator[None]:
    """The network with each DTensor parameter (a `shard` annotation's) replaced by its whole
    tensor while the context lasts, for planning: every rank takes part in the gathers."""
    swapped: dict[int, torch.nn.Parameter] = {}
    owners = []
    for name, p in network.named_parameters(remove_duplicate=False):
        if isinstance(p, DTensor):
            if id(p) not in swapped:
                swapped[id(p)] = torch.nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
            owner, _, leaf = name.rpartition(".")
            owners.append((network.get_submodule(owner), leaf, p))
    for module, leaf, p in owners:
        setattr(module, leaf, swapped[id(p)])
    try:
        yield
    finally:
        for module, leaf, p in owners:
            setattr(module, leaf, p)


def _plan_on_rank0(
    network: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    cluster: Any,
    fixed: tuple,
    replicas: int | None,
    world: int,
) -> tuple[bytes, str]:
    """The package's bytes, or why planning failed (one line).

    The build runs in a forked child (`tessel.forked`): it traces ranks under a fake process
    group, which this process, already in the job, cannot open; forked, it sees the network as
    it is here, whatever defines its classes, and nothing is pickled or imported again."""
    model = network if _on_cpu(network) else copy.deepcopy(network).cpu()
    args, kwargs = tree_map(_cpu, args), tree_map(_cpu, kwargs)
    with tempfile.TemporaryDirectory(prefix="tessel-plan-") as folder:
        path = os.path.join(folder, "plan.tessel")
        failure = os.path.join(folder, "failure.txt")

        def plan() -> None:
            forget_process_groups()
            try:
                _build(model, args, kwargs, world if cluster is None else cluster,
                       device.type,  # "cuda": tessel's profile of a GPU
                       fixed, replicas, path)  # fmt: skip
            except BaseException as exc:
                log.debug("planning failed", exc_info=True)
                with open(failure, "w") as f:  # one line, whatever the error's own form
                    f.write(" ".join(f"{type(exc).__name__}: {exc}".split()))
                raise

        with phase("planning the network (rank 0)"), Child(plan) as child:
            exit_code = child.wait()
        if exit_code == 0:
            with open(path, "rb") as f:
                return f.read(), ""
        if os.path.exists(failure):
            with open(failure) as f:
                reason = f.read()
        else:
            reason = f"the planning process {ended_how(exit_code)}"
        return b"", f"planning failed on rank 0: {reason}"


def _on_cpu(network: torch.nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in (*network.parameters(), *network.buffers()))


def broadcast_bytes(data: bytes, device: torch.device) -> bytes:
    """Rank 0's `data` on every rank."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    n = int(size.item())
    if n == 0:
        return b""
    if dist.get_rank() == 0:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, 0)
    return bytes(buffer.cpu().numpy())


@dataclass(frozen=True)
class _Trained:
    """A trained weight: its parameter, and its placements in the plan and as stored (hsdp
    shards the dims the plan replicates)."""

    name: str
    parameter: torch.nn.Parameter
    planned: tuple[Placement, ...]
    stored: tuple[Placement, ...]


class _Step(torch.autograd.Function):
    """The loss of a step whose gradients the program has already computed: backward hands
    them (scaled by the incoming gradient) to the parameters."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, give: Any, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.give = give
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return (None, None, *ctx.give(grad))


def loss_with_gradients(
    loss: torch.Tensor, parameters: Sequence[torch.Tensor], give: Any
) -> torch.Tensor:
    """`loss`, whose backward gives `parameters` the gradients `give(incoming gradient)`
    returns: for steps whose gradients are computed before the loss is returned."""
    return _Step.apply(loss, give, *parameters)


def shard_dims(planned: tuple, mesh: DeviceMesh, shard_size: int, name: str) -> set[int]:
    """The mesh dims a weight placed `planned` is stored sharded over (hsdp): of the dims that
    replicate it, all (shard_size -1, or at least as many ranks as they hold), else the ones
    whose ranks number `shard_size`, innermost (neighbouring ranks) first."""
    replicated = [d for d, p in enumerate(planned) if isinstance(p, Replicate)]
    if shard_size == -1 or shard_size >= math.prod(mesh.shape[d] for d in replicated):
        return set(replicated)
    subsets = [
        set(c)
        for k in range(len(replicated) + 1)
        for c in itertools.combinations(replicated, k)
        if math.prod(mesh.shape[d] for d in c) == shard_size
    ]
    if not subsets:
        sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
        raise ParallelError(
            f"hsdp: shard_size {shard_size} is no product of the sizes of the mesh dims that "
            f"replicate {name!r} (mesh {sizes}, replicated on dims {replicated}); groups that "
            "split a mesh dim are not built"
        )
    return max(subsets, key=lambda c: sorted(c, reverse=True))


class PlannedNetwork:
    """One rank's program and the network's parameters as DTensors on the plan's mesh."""

    def __init__(
        self,
        network: torch.nn.Module,
        package: Package,
        device: torch.device,
        shard_replicated: int | None = None,
        shard_size: int = -1,
        shard_gradients: bool = False,
        gather_in_program: bool = False,
        fusion: tuple[str, Any] = DEFAULT_FUSION,
    ) -> None:
        """`shard_replicated`: store weights of at least this many bytes sharded on dim 0
        over the mesh dims the plan replicates them on (hsdp); None keeps them as planned.
        `shard_size`: how many ranks share one weight's shards (-1: all that replicate it).
        `shard_gradients`: their gradients are reduce-scattered over the replicas, not reduced
        whole and sliced. `gather_in_program`: the program gathers each of them just before the
        nodes that read it, in the forward pass and again in the backward, and frees it after
        (hsdp level3), instead of once for the whole step. `fusion`: the gradient all-reduce
        over the replicas in buckets of ("size", MB), or starting at ("index", [parameter
        indices]), or ("each", None): one per gradient."""
        self.fusion = fusion
        manifest = package.manifest
        rank = dist.get_rank()
        if manifest.world_size != dist.get_world_size():
            raise ParallelError(
                f"the plan is for {manifest.world_size} ranks; this job has {dist.get_world_size()}"
            )
        groups: dict[tuple[int, ...], str] = {}
        make_groups(manifest, manifest.world_size, groups)
        self.program, weights = load_rank(package, rank, device, groups)
        self.inputs = manifest.inputs
        # ranks are (replica, tensor-parallel rank): each replica's program takes its rows
        self.dp = manifest.mesh.size("dp")
        self.replica = rank // manifest.mesh.tensor_parallel % self.dp
        sub = manifest.submodel(rank)
        self.order = list(sub.weight_order)
        self.tied = dict(sub.tied)
        layouts = package.json(manifest.layouts)
        self.mesh: DeviceMesh = init_device_mesh(
            device.type, tuple(manifest.mesh.shape), mesh_dim_names=tuple(manifest.mesh.dim_names)
        )
        trained = manifest.training.gradients
        position = {n: i for i, n in enumerate(self.order)}
        by_name = dict(network.named_parameters(remove_duplicate=False))
        placements: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]] = {}
        values: dict[str, torch.nn.Parameter] = {}
        for name in trained:
            old = by_name[name]
            planned = tuple(placement_from_str(p) for p in layouts[name]["placements"])
            stored = planned
            if (
                shard_replicated is not None
                and old.numel() * old.element_size() >= shard_replicated
            ):
                over = shard_dims(planned, self.mesh, shard_size, name)
                stored = tuple(Shard(0) if d in over else p for d, p in enumerate(planned))
            local = weights[position[name]].to(old.dtype)
            value = DTensor.from_local(
                local, self.mesh, planned, run_check=False, shape=old.shape, stride=old.stride()
            )
            if stored != planned:
                value = value.redistribute(self.mesh, stored)
            values[name] = torch.nn.Parameter(value, requires_grad=True)
            placements[name] = (planned, stored)
        # every name of a parameter (tied ones have several) now holds its DTensor
        values = replace_parameters(network, values, "AutoParallel's first call")
        self.trained = [_Trained(n, values[n], *placements[n]) for n in trained]
        # weights the program reads but nobody trains (buffers, frozen parameters) stay local
        trained_names = {t.name for t in self.trained}
        self.fixed = {
            i: w
            for i, (n, w) in enumerate(zip(self.order, weights))
            if n not in trained_names and n not in self.tied
        }
        self.replicas = self.mesh["dp"].get_group() if self.dp > 1 else None
        # gradients reduced whole over the replicas: those of weights stored replicated over
        # them, and (unless gradients are sharded) the others too; their all-reduce starts in
        # `fusion`'s buckets as the backward pass makes them ("size": consecutive in the order
        # they are made, as DDP forms them)
        self.whole = [
            i
            for i, t in enumerate(self.trained)
            if t.stored[:1] == t.planned[:1] or not shard_gradients
        ]
        self.units: list[list[int]] = []
        self.buckets = 0
        # the call running: the gradients its program has handed over, and their all-reduce
        self._handed: tuple[dict[int, torch.Tensor], InFlight] | None = None
        if self.dp > 1:
            grads = [
                torch.empty(weights[position[t.name]].shape, dtype=t.parameter.dtype, device="meta")
                for t in self.trained
            ]
            whole = set(self.whole)
            made = made_order(self.program)
            when = {i: k for k, i in enumerate(made)}
            given = [i for i in made if i in whole] if fusion[0] == "size" else self.whole
            # buckets in the order the program completes them, so each starts when made
            self.units = sorted(
                fusion_buckets(fusion, given, grads), key=lambda b: max(when[i] for i in b)
            )
            self.buckets = len(self.units)
            self.units += [[i] for i in range(len(self.trained)) if i not in whole]
            hand_over_gradients(self.program, self.units, self._take)
        self.comm_groups = sorted({g for s in manifest.submodels for g in s.comm_groups})
        # level3: the program's reads of a sharded weight (or a tied alias of one) gather it
        self.gathered_in_program: set[str] = set()
        if gather_in_program:
            unit = {t.name: u for u, t in enumerate(self.trained) if t.stored != t.planned}
            inputs = {
                i: (unit[self.tied[n].source if n in self.tied else n], n)
                for i, n in enumerate(self.order)
                if (self.tied[n].source if n in self.tied else n) in unit
            }
            self.gathers = gather_weights(self.program, inputs, self._gather, self._view)
            self.gathered_in_program = {n for _, n in inputs.values()}

    def _take(self, unit: int, *grads: torch.Tensor) -> None:
        """A unit's gradients, as the program makes them: kept, and a bucket's all-reduce
        over the replicas started (unscaled: see `_same_on_replicas`)."""
        assert self._handed is not None
        handed, flight = self._handed
        for i, g in zip(self.units[unit], grads):
            handed[i] = g
            if unit < self.buckets:
                flight.give(i, g)

    def _same_on_replicas(self, scale: torch.Tensor) -> bool:
        """Whether every replica's loss has this incoming gradient `scale`."""
        probe = torch.stack([scale, -scale]).reshape(2).to(torch.float32)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=self.replicas)
        return bool(probe[0] == -probe[1])

    def _gather(self, index: int) -> torch.Tensor:
        """The weight of the program's `index`-th gather, placed as planned."""
        t = self.trained[self.gathers[index]]
        return t.parameter.detach().redistribute(self.mesh, t.planned).to_local()

    def _view(self, gathered: torch.Tensor, name: str) -> torch.Tensor:
        """Weight `name` from its gathered unit: itself, or a tied alias's chunk of it."""
        if name not in self.tied:
            return gathered
        for dim, count, index in self.tied[name].chunks:
            gathered = piece(gathered, dim, count, index)
        return gathered.contiguous()

    def _locals(self) -> dict[str, torch.Tensor]:
        """Each trained weight's local shard as the plan places it (hsdp: gathered), but those
        the program gathers itself."""
        out = {}
        for t in self.trained:
            if t.name in self.gathered_in_program:
                out[t.name] = _UNUSED
                continue
            value = t.parameter.detach()
            if t.stored != t.planned:
                value = value.redistribute(self.mesh, t.planned)
            out[t.name] = value.to_local()
        return out

    def __call__(self, flat_inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        locals_ = self._locals()
        arguments = []
        for i, name in enumerate(self.order):
            if name in locals_:
                arguments.append(locals_[name])
            elif name in self.gathered_in_program:
                arguments.append(_UNUSED)
            elif name in self.tied:
                arguments.append(self._view(locals_[self.tied[name].source], name))
            else:
                arguments.append(self.fixed[i])
        trained = self.trained
        if self.dp > 1:
            flat_inputs = [x.chunk(self.dp)[self.replica] for x in flat_inputs]
            handed: dict[int, torch.Tensor] = {}
            flight = InFlight(self.units[: self.buckets], self.replicas)
            self._handed = (handed, flight)
            try:
                with torch.no_grad():
                    (loss,) = self.program(*arguments, *flat_inputs)
            finally:
                self._handed = None
            grads = [handed[i] for i in range(len(trained))]
            # the replicas' losses are partial sums of the whole batch's mean
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.replicas)
            loss /= self.dp
        else:
            with torch.no_grad():
                loss, *grads = self.program(*arguments, *flat_inputs)

        backwards: list[None] = []  # the loss's backward passes so far

        def give(scale: torch.Tensor) -> list[torch.Tensor]:
            factor = scale / self.dp
            local: dict[int, torch.Tensor] = {}
            if self.dp > 1 and not backwards:
                summed = flight.sums(grads.__getitem__)
                # the sums made in flight, scaled in place (so only in the first backward)
                if self._same_on_replicas(scale):
                    for i, g in summed.items():
                        local[i] = g.mul_(factor).to(trained[i].parameter.dtype)
            # the other gradients scaled here; where the replicas scaled their losses unlike,
            # the whole ones are summed over the replicas again, scaled
            unsummed = [i for i in self.whole if i not in local]
            for i, (t, g) in enumerate(zip(trained, grads)):
                if i not in local:
                    local[i] = (g * factor).to(t.parameter.dtype)
            backwards.append(None)
            if self.dp > 1 and unsummed:
                summed = [local[i] for i in range(len(trained))]
                all_reduce_in_buckets(self.fusion, summed, unsummed, self.replicas)
                local.update((i, summed[i]) for i in unsummed)
            out = []
            for i, t in enumerate(trained):
                # the rest reach their stored placement (sharded over dp) by reduce-scatter
                reduced = self.dp == 1 or i in self.whole
                placements = t.planned if reduced else (Partial(), *t.planned[1:])
                value = DTensor.from_local(
                    local[i],
                    self.mesh,
                    placements,
                    run_check=False,
                    shape=t.parameter.shape,
                    stride=t.parameter.stride(),
                )
                if t.stored != t.planned:
                    value = value.redistribute(self.mesh, t.stored)
                out.append(value)
            return out

        return loss_with_gradients(loss, [t.parameter for t in trained], give)
