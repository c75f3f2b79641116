"""`Pipeline`: a network cut into stages by `stage_config`, run by tessel's pipeline runner.

The ranks are (pipeline rank, data-parallel replica), pipeline rank outermost: rank = pp_rank *
dp + replica. There are as many pipeline ranks as stages, or, interleaved, a divisor of the
stage count: pipeline rank r then holds stages r, r + pp, r + 2 pp, ... (the looped placement
torch's interleaved schedules run). On the first call the network is traced once
(`torch.distributed.pipelining.pipeline`), cut before the first module of each stage, and each
rank keeps its stages' modules; every call then runs the batch through the stages as
`micro_size` micro-batches in tessel's schedule order (`tessel.schedules`, the order a training
package's stage programs follow too: 1F1B or GPipe; interleaved, 1F1B or looped breadth-first)
on `runtime.pipeline_runner`, which sends and receives between the stages; each stage's passes
run eagerly, autograd making the backward pass's gradients. As MindSpore's does, the returned
loss is the sum of the micro-batches' losses (the mean over the data-parallel replicas, each
calling with its own batch); `loss.backward()` hands the stage's parameters the gradients the
schedule computed. The stages hold the network's own
parameter objects; those of stages other ranks hold retire on this rank (`replaced`), and an
optimizer made over the whole network before the first call drops them at its step. Each
stage's replicas start from its first replica's weights. Parameters several stages hold (tied
embeddings) get the sum of their copies' gradients, so the copies stay equal.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import SplitPoint, pipeline

from tessel._torch import tree_flatten, tree_map
from tessel.parallel.errors import ParallelError
from tessel.parallel.micro_batches import _count, _tensor_output
from tessel.parallel.planned import loss_with_gradients
from tessel.parallel.replaced import retire
from tessel.runtime.exchange import DEFAULT_FUSION, InFlight, fusion_buckets
from tessel.runtime.pipeline_runner import Boundary, PipelineRunner, handoffs_between
from tessel.schedules import pipeline_order


def _loss_forward(forward: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The network's loss as a 1-element tensor (torch's schedule concatenates the
    micro-batches' outputs). Every input is copied first, inside the first stage, so that an
    input only the last stage reads (labels) travels there with the activations."""
    args, kwargs = tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    return _tensor_output(forward(*args, **kwargs), "Pipeline").reshape(1)


class Pipeline(torch.nn.Module):
    """`network` in pipeline stages (see the module docstring). The modules of a stage come
    before those of the next one.

    Args:
        network: The network to cut, returning its loss.
        micro_size: The micro-batches each call's rows are cut into.
        stage_config: ``{module name: stage index}``, each stage's modules before the
            next stage's. Default: one stage, the whole network.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        micro_size: int,
        stage_config: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                f"{owner}: network must be a torch.nn.Module, found {type(network).__name__}"
            )
        self.micro_size = _count(owner, "micro_size", micro_size)
        stage_config = dict(stage_config or {})
        modules = [name for name, _ in network.named_modules() if name]
        unmatched = sorted(set(stage_config) - set(modules))
        if unmatched:
            raise KeyError(
                f"{owner}: stage_config names {unmatched}, which the network does not have; "
                f"its modules are {modules}"
            )
        for name, stage in stage_config.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                raise ValueError(
                    f"{owner}: stage_config[{name!r}] must be an int >= 0, found {stage!r}"
                )
        order = sorted(stage_config, key=modules.index)
        stages = [stage_config[n] for n in order]
        if stages != sorted(stages):
            raise ValueError(
                f"{owner}: stage_config must put the modules of each stage before the next "
                f"stage's, in the network's module order; found {[(n, stage_config[n]) for n in order]}"
            )
        self.stages = max(stages, default=0) + 1
        missing = sorted(set(range(self.stages)) - set(stages))
        if missing:
            raise ValueError(f"{owner}: stage_config gives no module to stages {missing}")
        # each stage after the first starts at its first module
        self.cuts = {s: n for n, s in reversed(list(zip(order, stages))) if s > 0}
        self.scheduler = "1f1b"
        self.pipeline_ranks = self.stages  # fewer where interleaved (AutoParallel.pipeline)
        # the replicas' gradient buckets (AutoParallel's comm_fusion)
        self.fusion: tuple[str, Any] = DEFAULT_FUSION
        self.parameter_index = {n: i for i, (n, _) in enumerate(network.named_parameters())}
        self.network = network
        self._stages: dict[int, torch.nn.Module] | None = None  # this rank's, by index
        self._bucketed: tuple[tuple[str, Any], list[list[int]]] | None = None
        self._flight: InFlight | None = None  # the step's replicas' all-reduce
        self._accumulated: list[int] = []  # passes of the step's backward per parameter

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors:
            raise TypeError("Pipeline: the network needs tensor inputs to cut into micro-batches")
        for x in tensors:
            if x.dim() == 0 or x.shape[0] % self.micro_size:
                raise ValueError(
                    f"Pipeline: an input of shape {tuple(x.shape)} does not cut into "
                    f"{self.micro_size} micro-batches along dim 0"
                )
        # the traced stages hold what the first call passed besides tensors (flags such as
        # use_cache=False) and take the tensors in order: later calls pass the same form
        form = (spec, [x for x in leaves if not isinstance(x, torch.Tensor)])
        shapes = [tuple(x.shape) for x in tensors]
        if self._stages is None:
            self._build(args, kwargs, tensors[0].device)
            self._form, self._shapes = form, shapes
        if form != self._form:
            raise ParallelError(
                f"Pipeline: the stages were traced for a call of the form {self._form}; this "
                f"call is {form}"
            )
        if shapes != self._shapes:  # the traced stages hold the first call's shapes
            raise ParallelError(
                f"Pipeline: the stages were traced for inputs of shapes {self._shapes}; this "
                f"call passes {shapes}"
            )
        return self._step(tensors)

    def _build(self, args: tuple, kwargs: dict, device: torch.device) -> None:
        world = dist.get_world_size()
        pp = self.pipeline_ranks
        if world % pp:
            raise ParallelError(f"Pipeline: {pp} pipeline ranks do not divide the job's {world}")
        if self.micro_size < pp:
            raise ValueError(
                f"Pipeline: micro_size ({self.micro_size}) must be >= the stage count ({pp})"
            )
        dp = world // pp
        self.mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        self.pp_rank = dist.get_rank() // dp
        self.stage_indices = list(range(self.pp_rank, self.stages, pp))
        network = self.network
        shared = _shared_names(network)
        originals = dict(network.named_parameters(remove_duplicate=False))
        micro_args, micro_kwargs = tree_map(
            lambda x: x.chunk(self.micro_size)[0] if isinstance(x, torch.Tensor) else x,
            (args, kwargs),
        )
        network.forward = functools.partial(_loss_forward, network.forward)
        try:
            pipe = pipeline(
                network,
                mb_args=tuple(micro_args),
                mb_kwargs=micro_kwargs,
                split_spec={name: SplitPoint.BEGINNING for name in self.cuts.values()},
            )
        finally:
            del network.forward
        _adjacent_only(pipe, self.stages)
        _contiguous_boundaries(pipe, self.stages)
        # the stage modules stay torch's (its tracer cuts the network); tessel's runner runs them
        modules = [pipe.get_stage_module(i) for i in range(self.stages)]
        self._reads = _reads(pipe, self.stages)
        self.runner = PipelineRunner(
            pipeline_order(self.scheduler, pp, self.stages, self.micro_size)[self.pp_rank],
            self.stages,
            self.micro_size,
            handoffs_between([Boundary(_made(m)) for m in modules[:-1]], self.stages),
            lambda stage: stage % pp,
            self.mesh["pp"].get_group(),
            device,
        )
        # this rank trains its stages' modules: the whole network is no longer held here
        del self.network
        self.stage_modules = torch.nn.ModuleList([modules[i] for i in self.stage_indices])
        self._keep_parameters(originals)
        self._same_on_replicas()
        self._stages = dict(zip(self.stage_indices, self.stage_modules))
        self.shared = shared
        self.shared_shapes = _gather_shapes(self, self._named_parameters())
        sync_pipeline_shared_parameters(self)

    def _keep_parameters(self, originals: dict[str, torch.Tensor]) -> None:
        """The stages hold the network's own parameter objects, tied ones included (torch's
        tracing copies a weight several stages read), so references a script holds stay live;
        the parameters of stages other ranks hold retire here (`replaced`)."""
        for module in self.stage_modules:
            for name, p in list(module.named_parameters(remove_duplicate=False)):
                if name not in originals:
                    raise ParallelError(
                        f"Pipeline: a stage holds a parameter {name!r} the network does not have"
                    )
                if p is not originals[name]:
                    owner, _, leaf = name.rpartition(".")
                    setattr(module.get_submodule(owner), leaf, originals[name])
        held = {id(p) for p in self.stage_modules.parameters()}
        for name, p in originals.items():
            if id(p) not in held:
                retire(p, None, name, f"Pipeline (this rank holds stages {self.stage_indices})")

    def _same_on_replicas(self) -> None:
        """Each stage's weights and buffers, on every replica, its first replica's (as DDP
        starts): replicas whose networks were made unalike would train different models."""
        group = self.mesh["dp"].get_group()
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            return
        with torch.no_grad():
            for t in (*self.stage_modules.parameters(), *self.stage_modules.buffers()):
                value = t.detach().contiguous()  # gloo sends contiguous tensors
                dist.broadcast(value, src=ranks[0], group=group)
                t.copy_(value)

    def _named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters under the network's names."""
        return {
            name: p
            for module in self.stage_modules
            for name, p in module.named_parameters(remove_duplicate=False)
        }

    def _step(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        pp, dp = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        replicas = self.mesh["dp"].size()
        last = self.stages - 1 in self.stage_indices
        named = {n: p for n, p in self._named_parameters().items() if p.requires_grad}
        unique = {id(p): n for n, p in named.items()}
        names = list(unique.values())
        parameters = [named[n] for n in names]
        flight = None
        if replicas > 1:  # the replicas' sums start as the last micro-batch makes gradients
            flight = self._flight = InFlight(self._buckets(names, parameters), dp)
            self._accumulated = [0] * len(parameters)
        micro_batches = [list(xs) for xs in zip(*(x.chunk(self.micro_size) for x in inputs))]
        work = _EagerStages(self._stages, self._reads, self.stages - 1, micro_batches)
        try:
            self.runner.step(work)
        finally:
            self._flight = None
        device = inputs[0].device
        loss = torch.stack(work.losses).sum() if last else torch.zeros((), device=device)
        loss = loss.to(torch.float32)
        # the last stage's loss on every stage, then the mean over the replicas
        dist.all_reduce(loss, group=pp)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        if flight is not None:
            summed = flight.sums(grads.__getitem__)
            grads = [summed[i].div_(replicas) for i in range(len(grads))]
            dist.all_reduce(loss, group=dp)
            loss /= replicas
        self._sum_shared(dict(zip(names, grads)))
        for p in parameters:
            p.grad = None
        return loss_with_gradients(loss, parameters, lambda scale: [g * scale for g in grads])

    def _buckets(self, names: list[str], parameters: list[torch.Tensor]) -> list[list[int]]:
        """The replicas' all-reduce buckets of this rank's trained parameters: `fusion`'s
        ("size": consecutive from the last parameter back, about the order the backward pass
        makes them in; "index": starting at the network's parameter indices given). Hooks
        hand each parameter's gradient to the step's all-reduce once the last micro-batch's
        backward pass has accumulated it."""
        fusion = self.fusion
        if self._bucketed is not None and self._bucketed[0] == fusion:
            return self._bucketed[1]
        order = list(range(len(parameters)))
        if fusion[0] == "size":
            order.reverse()
        if fusion[0] == "index":  # buckets start at the network's parameter indices
            fusion = (
                "index",
                {j for j, n in enumerate(names) if self.parameter_index.get(n) in fusion[1]},
            )
        buckets = fusion_buckets(fusion, order, parameters)
        if self._bucketed is None:
            # a parameter several of this rank's stages hold accumulates once for each
            holders = [
                sum(any(q is p for q in m.parameters()) for m in self.stage_modules)
                for p in parameters
            ]
            for i, (p, held) in enumerate(zip(parameters, holders)):
                p.register_post_accumulate_grad_hook(
                    functools.partial(self._accumulate, i, held * self.micro_size)
                )
        self._bucketed = (self.fusion, buckets)
        return buckets

    def _accumulate(self, index: int, passes: int, parameter: torch.Tensor) -> None:
        if self._flight is None:
            return
        self._accumulated[index] += 1
        if self._accumulated[index] == passes:
            self._flight.give(index, parameter.grad)

    def _sum_shared(self, grads: dict[str, torch.Tensor]) -> None:
        """Give every copy of a shared parameter the sum of all copies' gradients."""
        pp = self.mesh["pp"].get_group()
        for names in self.shared:
            mine = [n for n in names if n in grads]
            shape = self.shared_shapes[names[0]]
            total = torch.zeros(shape, device=self.mesh.device_type)
            for n in mine:
                total += grads[n]
            dist.all_reduce(total, group=pp)
            for n in mine:
                grads[n].copy_(total)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's stages' state under the network's names (the whole network's before
        the first call)."""
        if self._stages is None:
            return self.network.state_dict(*args, **kwargs)
        state: dict[str, Any] = {}
        for module in self.stage_modules:
            state.update(module.state_dict(*args, **kwargs))
        return state


class PipelineCell(Pipeline):
    """MindSpore's other name for `Pipeline`."""


def _shared_names(network: torch.nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter the network holds under several names (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in network.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _adjacent_only(pipe: Any, stages: int) -> None:
    """Pass every value a stage reads from a stage more than one before it through the stages
    between, each handing it on unchanged: torch's schedules send only to the next stage, and
    a network's masks, position tables and copied labels are made in the first."""
    graph: fx.Graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    if any(c.kwargs for c in calls):
        raise ParallelError("Pipeline: a traced stage takes keyword inputs; not built")

    def stage_of(value: Any) -> int | None:
        """The stage that makes `value` (a stage's output, or one item of it)."""
        if not isinstance(value, fx.Node):
            return None
        if value.op == "call_function" and value.target is operator.getitem:
            value = value.args[0]
        return calls.index(value) if value in calls else None

    for m in range(1, stages - 1):
        call, later = calls[m], calls[m + 1 :]
        # made before stage m and read after it, each with its value as the stage reading it
        # saw it traced (the shape its receive buffer is made from)
        passing: dict[fx.Node, Any] = {}
        for c in later:
            graph_c = pipe.split_gm.get_submodule(c.target).graph
            reading = [n for n in graph_c.nodes if n.op == "placeholder"]
            for a, placeholder in zip(c.args, reading):
                made = stage_of(a)
                if made is not None and made < m:
                    passing.setdefault(a, placeholder.meta.get("val"))
        if not passing:
            continue
        module = pipe.split_gm.get_submodule(call.target)
        sub: fx.Graph = module.graph
        inputs = [n for n in sub.nodes if n.op == "placeholder"]
        # a value the stage already reads is handed on from its own input; others come in new
        new = [a for a in passing if a not in call.args]
        anchor = inputs[-1]
        for i, value in enumerate(new):
            with sub.inserting_after(anchor):
                anchor = sub.placeholder(f"passed_{i}")
            anchor.meta["val"] = passing[value]
        inputs = [n for n in sub.nodes if n.op == "placeholder"]
        args = (*call.args, *new)
        output = next(n for n in sub.nodes if n.op == "output")
        single = not isinstance(output.args[0], (tuple, list))
        made_here = (output.args[0],) if single else tuple(output.args[0])
        output.args = ((*made_here, *(inputs[args.index(a)] for a in passing)),)
        module.recompile()
        call.args = args
        if "val" in call.meta:
            own = (call.meta["val"],) if single else tuple(call.meta["val"])
            call.meta["val"] = (*own, *passing.values())
        with graph.inserting_before(later[0]):
            if single:
                first = graph.call_function(operator.getitem, (call, 0))
                first.meta = {"val": own[0]} if "val" in call.meta else {}
                call.replace_all_uses_with(first, delete_user_cb=lambda u, f=first: u is not f)
            handed = [
                graph.call_function(operator.getitem, (call, len(made_here) + i))
                for i in range(len(passing))
            ]
        for value, out in zip(passing, handed):
            out.meta = {**value.meta, "val": passing[value]}
            for c in later:
                c.args = tuple(out if a is value else a for a in c.args)
    pipe.split_gm.recompile()


def _made(module: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """What a traced stage returns, as meta tensors of the shapes and dtypes it was traced at."""
    output = next(n for n in module.graph.nodes if n.op == "output")
    made = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    values = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in made]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise ParallelError(
            "Pipeline: a stage hands the next one a value that is not a tensor; stages can "
            "pass only tensors"
        )
    return tuple(torch.empty(v.shape, dtype=v.dtype, device="meta") for v in values)


def _reads(pipe: Any, stages: int) -> dict[int, list[int]]:
    """For each stage after the first, which of the previous stage's outputs each of its inputs
    is, in the order it takes them."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    reads: dict[int, list[int]] = {}
    for s in range(1, stages):
        previous, positions = calls[s - 1], []
        for a in calls[s].args:
            if a is previous:
                positions.append(0)
            elif (
                isinstance(a, fx.Node)
                and a.op == "call_function"
                and a.target is operator.getitem
                and a.args[0] is previous
            ):
                positions.append(int(a.args[1]))
            else:
                raise ParallelError(
                    f"Pipeline: stage {s} reads {a}, which stage {s - 1} does not hand it"
                )
        reads[s] = positions
    return reads


class _EagerStages:
    """A `Pipeline`'s stages on this rank, run eagerly over one step's micro-batches: autograd
    makes each backward pass's gradients, accumulating them in the parameters' `.grad`. The last
    stage's output is the micro-batch's loss; `losses` collects them."""

    def __init__(
        self,
        modules: dict[int, torch.nn.Module],
        reads: dict[int, list[int]],
        last: int,
        micro_batches: list[list[torch.Tensor]],
    ) -> None:
        self.modules, self.reads, self.last = modules, reads, last
        self.micro_batches = micro_batches
        self.losses: list[torch.Tensor] = []
        # (stage, micro-batch) -> the tensors the stage was handed, and what it made from them
        self.held: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def forward(
        self, stage: int, micro_batch: int, inputs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if stage == 0:
            handed, args = [], self.micro_batches[micro_batch]
        else:
            handed = [x.requires_grad_(x.dtype.is_floating_point) for x in inputs]
            args = [handed[j] for j in self.reads[stage]]
        out = self.modules[stage](*args)
        made = list(out) if isinstance(out, (tuple, list)) else [out]
        if stage == self.last:
            loss = made[0].sum()
            self.losses.append(loss.detach())
            self.held[(stage, micro_batch)] = (handed, [loss])
            return []
        self.held[(stage, micro_batch)] = (handed, made)
        return [m.detach() for m in made]

    def backward(
        self, stage: int, micro_batch: int, gradients: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        handed, made = self.held.pop((stage, micro_batch))
        if stage == self.last:
            made[0].backward()
        else:
            floating = [m for m in made if m.dtype.is_floating_point]
            pairs = [(m, g) for m, g in zip(floating, gradients, strict=True) if m.requires_grad]
            if pairs:
                torch.autograd.backward([m for m, _ in pairs], [g for _, g in pairs])
        return [
            x.grad if x.grad is not None else torch.zeros_like(x)
            for x in handed
            if x.dtype.is_floating_point
        ]


def _contiguous_boundaries(pipe: Any, stages: int) -> None:
    """Make what one stage sends the next contiguous, in the stage programs and in the shapes
    the receiving buffers are made from (gloo cannot receive into strided buffers)."""
    for i in range(stages):
        module = pipe.get_stage_module(i)
        graph: fx.Graph = module.graph
        output = next(n for n in graph.nodes if n.op == "output")

        def contiguous(a: Any, graph: fx.Graph = graph, output: fx.Node = output) -> Any:
            if not isinstance(a, fx.Node):
                return a
            with graph.inserting_before(output):
                node = graph.call_method("contiguous", (a,))
            if "val" in a.meta:
                node.meta["val"] = a.meta["val"].contiguous()
            return node

        output.args = (fx.node.map_aggregate(output.args[0], contiguous),)
        module.recompile()
    nodes = [*pipe.split_gm.graph.nodes]
    for i in range(stages):
        nodes += [n for n in pipe.get_stage_module(i).graph.nodes if n.op == "placeholder"]
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            node.meta["val"] = value.contiguous()


def sync_pipeline_shared_parameters(net: torch.nn.Module) -> None:
    """Copy each parameter several pipeline stages hold (tied embeddings) from the first
    stage holding it to the others. A network with fewer than 2 stages is left as it is.

    Args:
        net: The `Pipeline` network, or the `AutoParallel` holding it.
    """
    pipe = _find_pipeline(net)
    if pipe is None or pipe._stages is None or pipe.stages < 2:
        return
    group = pipe.mesh["pp"].get_group()
    ranks = dist.get_process_group_ranks(group)
    params = pipe._named_parameters()
    held_by_stage = [
        (i, dict(m.named_parameters(remove_duplicate=False)))
        for i, m in zip(pipe.stage_indices, pipe.stage_modules)
    ]
    for names in pipe.shared:
        held = [n for n in names if n in params]
        mine = [i for i, named in held_by_stage if any(n in named for n in names)]
        holder = torch.tensor([min(mine, default=pipe.stages)])
        dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=group)
        first = int(holder.item()) % pipe.pipeline_ranks  # the pipeline rank holding it first
        value = (
            params[held[0]].detach().clone() if held else torch.zeros(pipe.shared_shapes[names[0]])
        )
        dist.broadcast(value, src=ranks[first], group=group)
        with torch.no_grad():
            for n in held:
                params[n].copy_(value)


def _gather_shapes(pipe: Pipeline, params: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """The shape of every shared parameter, from whichever stage holds it."""
    group = pipe.mesh["pp"].get_group()
    shapes: dict[str, tuple] = {}
    for names in pipe.shared:
        held = [n for n in names if n in params]
        dims = torch.zeros(8, dtype=torch.int64)
        if held:
            shape = params[held[0]].shape
            dims[0] = len(shape)
            dims[1 : 1 + len(shape)] = torch.tensor(shape)
        dist.all_reduce(dims, op=dist.ReduceOp.MAX, group=group)
        shapes[names[0]] = tuple(int(d) for d in dims[1 : 1 + int(dims[0])])
    return shapes


def _find_pipeline(net: torch.nn.Module) -> Pipeline | None:
    if not isinstance(net, torch.nn.Module):
        raise TypeError(
            f"sync_pipeline_shared_parameters: net must be a torch.nn.Module, found "
            f"{type(net).__name__}"
        )
    for module in net.modules():
        if isinstance(module, Pipeline):
            return module
    return None


class PipelineGradReducer(torch.nn.Module):
    """The accumulated gradients of `parameters`, divided by `scale_sense` (MindSpore v2.6's
    semantics; `Pipeline` has already summed the micro-batches' gradients and reduced them
    over the data-parallel replicas). Called with no gradients, it scales the parameters'
    own `.grad` in place and returns them.

    Args:
        parameters: The parameters whose gradients it returns.
        scale_sense: What the gradients are divided by (> 0).
        opt_shard: MindSpore's switch for its sharded optimizer; the gradients come back
            whole either way.
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        scale_sense: float = 1.0,
        opt_shard: bool | None = None,
    ) -> None:
        super().__init__()
        if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
            raise TypeError(
                "PipelineGradReducer: parameters must be an iterable of tensors, found "
                f"{type(parameters).__name__}"
            )
        self.parameters_ = list(parameters)
        if not all(isinstance(p, torch.Tensor) for p in self.parameters_):
            raise TypeError("PipelineGradReducer: every parameter must be a tensor")
        if isinstance(scale_sense, bool) or not isinstance(scale_sense, (int, float)):
            raise TypeError(
                f"PipelineGradReducer: scale_sense must be a number, found "
                f"{type(scale_sense).__name__}"
            )
        if scale_sense <= 0:
            raise ValueError(f"PipelineGradReducer: scale_sense must be > 0, found {scale_sense}")
        if opt_shard is not None and not isinstance(opt_shard, bool):
            raise TypeError(
                f"PipelineGradReducer: opt_shard must be a bool or None, found "
                f"{type(opt_shard).__name__}"
            )
        self.scale_sense = float(scale_sense)
        self.opt_shard = opt_shard

    def forward(self, grads: Sequence[torch.Tensor | None] | None = None) -> tuple:
        if grads is None:
            with torch.no_grad():
                for p in self.parameters_:
                    if p.grad is not None:
                        p.grad.div_(self.scale_sense)
            return tuple(p.grad for p in self.parameters_)
        if len(grads) != len(self.parameters_):
            raise ValueError(
                f"PipelineGradReducer: {len(grads)} gradients for {len(self.parameters_)} "
                "parameters"
            )
        return tuple(None if g is None else g / self.scale_sense for g in grads)
