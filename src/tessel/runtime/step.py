"""One training step on a worker: its rank's program, the data-parallel exchange of gradients,
then torch's optimizer over the part of the weights this rank updates.

The trained weights live in one flat buffer laid out by `FlatLayout`: units of weights, each
cut into one chunk per data-parallel replica. The program hands each unit's gradients over as
soon as the backward pass has made them (`step_program`), and the unit's exchange starts while
the pass goes on. ZeRO's stages over the `dp` replicas:

- none: gradients all-reduced; every rank updates whole weights with whole optimizer state;
- optimizer state sharding: gradients all-reduced; each rank updates its chunks of every unit
  with state for those alone, and the updated chunks are all-gathered;
- gradient sharding: gradients reduce-scattered, each rank keeping its chunks only;
- weight sharding: a rank stores only its chunks of the weights too; the program gathers a
  unit just before the nodes that read it (the next units fetched ahead while it computes,
  within the prefetch buffer) and frees it after them, in the forward and the backward pass.

The pieces a rank updates are views of the flat buffer (or of its segment), one per weight,
so torch's optimizers see ordinary tensors in the package's parameter groups; with optimizer
offload, host copies of them. With pipeline stages a rank trains its stage's weights: the
pipeline runner runs the stage's forward and backward passes over the micro-batches in 1F1B
order with the other stages' ranks (`_Stage`), each backward pass's gradients are summed in
place, and after the last micro-batch's the replicas of the stage exchange them as above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import fx

from tessel._torch import all_gather_single
from tessel.config.optimizer import (
    STEP_NAME,
    make_optimizer,
    spec_from_json,
    state_keys,
    state_name,
)
from tessel.dtypes import dtype_name, torch_dtype
from tessel.package.manifest import Manifest, Passes, Submodel
from tessel.runtime.exchange import Exchange
from tessel.runtime.flat import FlatLayout, Owned
from tessel.runtime.pipeline_runner import PipelineRunner
from tessel.runtime.step_program import gather_weights, hand_over_gradients
from tessel.schedules import pipeline_order
from tessel.sharding.geometry import piece

# exchanges of units' gradients in flight at once: enough to overlap the backward pass, few
# enough that their buffers never add up to the whole gradients. Reduce-scattered buffers in
# flight also stay within the largest unit's size, so the gradient outputs and activations the
# memory model counts are joined by one unit's worth of exchange buffers at most.
_IN_FLIGHT = 2


class StepError(RuntimeError):
    """A training step could not run on this rank."""


def data_parallel_group(manifest: Manifest, rank: int) -> dist.ProcessGroup | None:
    """The group of `rank`'s data-parallel replicas (the ranks of its stage and tensor-parallel
    rank); every group is made on every rank in one order. None: the whole world, or none."""
    mesh = manifest.mesh
    dp, tp, pp = mesh.size("dp"), mesh.tensor_parallel, mesh.size("pp")
    if dp == 1 or not dist.is_initialized():
        return None
    if tp * pp == 1:
        return None
    mine = None
    for s in range(pp):
        for i in range(tp):
            ranks = [(s * dp + d) * tp + i for d in range(dp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


class TrainingStep:
    """A rank's weights, gradients, optimizer and program for the steps of one package."""

    def __init__(
        self,
        manifest: Manifest,
        rank: int,
        weights: list[torch.Tensor],
        group: dist.ProcessGroup | None,
        program: fx.GraphModule,
        offload: torch.device | None = None,
        backward: fx.GraphModule | None = None,
    ) -> None:
        t = manifest.training
        sub: Submodel = manifest.submodel(rank)
        self.dp, self.tp = manifest.mesh.size("dp"), manifest.mesh.tensor_parallel
        self.replica = rank // self.tp % self.dp
        self.group = group
        # the gradients summed over this many micro-batches and replicas make their mean
        self.parts = self.dp * t.micro_batches
        self.shard_states = t.optimizer_state_sharding and self.dp > 1
        self.shard_gradients = t.gradient_sharding and self.dp > 1
        self.shard_weights = t.weight_sharding and self.dp > 1
        self.order = list(sub.weight_order)
        position = {name: i for i, name in enumerate(self.order)}
        # a pipeline stage trains the weights it holds; without stages a rank trains them all
        self.names = t.gradients
        units = t.units
        if manifest.mesh.size("pp") > 1:
            self.names = tuple(n for n in t.gradients if n in position)
            units = [kept for u in t.units if (kept := [n for n in u if n in position])]
        missing = [n for n in self.names if n not in position]
        if missing:
            raise StepError(f"rank {rank} holds no weight {missing[0]!r} to train")
        dtypes = {weights[position[n]].dtype for n in self.names}
        if len(dtypes) > 1:
            raise StepError(f"trained weights of several dtypes: {sorted(map(str, dtypes))}")
        self.master_dtype = dtype = dtypes.pop() if dtypes else torch.float32
        self.device = device = weights[0].device if weights else torch.device("cpu")
        self.shapes = {n: weights[position[n]].shape for n in self.names}
        self.layout = layout = FlatLayout(
            units, {n: weights[position[n]].numel() for n in self.names}, self.dp
        )
        self.ties = {name: tie for name, tie in sub.tied.items() if tie.source in self.names}
        # the program computes in `compute` (bf16: on a copy of the fp32 master weights)
        self.compute = torch_dtype(t.compute_dtype)

        # the weights: whole in the flat buffer, or only this replica's chunks in its segment
        self.flat: torch.Tensor | None = None
        self.work: torch.Tensor | None = None  # the flat buffer in the compute dtype
        self.shard: torch.Tensor | None = None
        self.refresh: list[tuple[torch.Tensor, str]] = []  # tied copies made after updates
        if self.shard_weights:
            self.shard = torch.zeros(layout.segment, dtype=dtype, device=device)
            for n in self.names:
                own = layout.owned(n, self.replica)
                if own is not None:
                    self._in_segment(self.shard, own).copy_(
                        self._owned_part(weights[position[n]], n, own)
                    )
            for n in (*self.names, *self.ties):
                weights[position[n]] = torch.empty(0, dtype=self.compute, device=device)
        else:
            self.flat = torch.zeros(layout.total, dtype=dtype, device=device)
            for n in self.names:
                self._view(self.flat, n).copy_(weights[position[n]])
            self.work = self.flat if self.compute == dtype else self.flat.to(self.compute)
            for n in self.names:
                weights[position[n]] = self._view(self.work, n)
            for name in self.ties:
                chunk = self._tied(weights[position[self.ties[name].source]], name)
                if chunk.is_contiguous():
                    weights[position[name]] = chunk
                else:
                    weights[position[name]] = chunk.contiguous()
                    self.refresh.append((weights[position[name]], name))
        # what still reads the package's buffer (weights not trained, the program's constants)
        # gets its own copy, so that buffer, which holds every weight, is freed
        trained = {*self.names, *self.ties}
        for i, n in enumerate(self.order):
            if n not in trained:
                weights[i] = weights[i].clone()
        for name, buffer in list(program.named_buffers(recurse=False)):
            program.register_buffer(name, buffer.clone())
        self.weights = weights

        # what this rank's optimizer updates: whole weights, or the parts of them it owns
        self.owned: dict[str, Owned] = {}
        self.updated: dict[str, list[torch.Tensor]] = {}
        for n in self.names:
            if not self.shard_states:
                self.updated[n] = [self._view(self.flat, n)]
                continue
            own = layout.owned(n, self.replica)
            if own is not None:
                self.owned[n] = own
                self.updated[n] = [
                    self._in_segment(self.shard, own)
                    if self.shard_weights
                    else self.flat[own.start : own.stop]
                ]
        # optimizer offload: the optimizer updates host copies of those parts, with its states
        # beside them in host memory; each step takes the gradients there and the result back
        self.on_device: dict[str, torch.Tensor] = {}
        if offload is not None:
            for n, tensors in self.updated.items():
                self.on_device[n] = tensors[0]
                tensors[0] = tensors[0].detach().to(offload, copy=True)
        self.spec = spec = spec_from_json(t.optimizer, "the package", t.gradients)
        self.optimizer = make_optimizer(spec, self.updated)
        self.state_keys = sorted({k for g in spec.groups for k in state_keys(spec.name, g.options)})
        self.steps = 0
        # gradients kept between steps: the whole flat buffer, or this replica's segment
        self.grad = torch.zeros(
            layout.segment if self.shard_gradients else layout.total, dtype=dtype, device=device
        )
        # the units' exchanges over the replicas, started as the program hands them over
        self.exchange = Exchange(group)
        self.largest = max(
            (layout.padded(u) * self.grad.element_size() for u in layout.units), default=0
        )

        # the programs, rewritten to hand over gradients and (sharded weights) gather units
        index = {n: i for i, n in enumerate(self.names)}
        members = [[index[n] for n in u.names] for u in layout.units]
        self.stage: _Stage | None = None
        if sub.passes is None:
            hand_over_gradients(program, members, self._take)
        else:
            if backward is None:
                raise StepError(f"rank {rank} was given no backward pass for its stage")
            self.stage = _Stage(manifest, rank, sub.passes, self, program, backward)
            hand_over_gradients(
                backward, members, self._take, self.stage.sent_back, len(self.names)
            )
        self.gathers: list[int] = []  # the running program's
        self.gathers_of: dict[int, list[int]] = {}  # each program's, by its id
        self.prefetch_bytes = t.weight_prefetch_bytes
        self.prefetched: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self.prefetch_peak = 0  # the most gathered bytes fetched ahead and not yet read
        if self.shard_weights:
            inputs = {
                position[n]: (layout.unit_of[self.ties[n].source if n in self.ties else n], n)
                for n in (*self.names, *self.ties)
            }
            for gm in (program, backward) if backward is not None else (program,):
                self.gathers_of[id(gm)] = gather_weights(gm, inputs, self._gather, self._weight)
            self.gathers = self.gathers_of[id(program)]
        self.program = program
        # a pipeline stage sums each micro-batch's gradients into `sums`: the gradient buffer,
        # or (reduce-scattered) a whole one beside it
        self.micro_batch = 0
        self.sums = self.grad
        if self.stage is not None and self.shard_gradients:
            self.sums = torch.zeros(layout.total, dtype=dtype, device=device)

    # -- where things are --------------------------------------------------------------

    def _view(self, flat: torch.Tensor, name: str, unit: bool = False) -> torch.Tensor:
        """Weight `name` in a buffer laid out like the flat one (`unit`: in its gathered unit)."""
        start = self.layout.start[name]
        if unit:
            start -= self.layout.units[self.layout.unit_of[name]].start
        return flat[start : start + self.layout.numel[name]].view(self.shapes[name])

    def _tied(self, source: torch.Tensor, name: str) -> torch.Tensor:
        chunk = source
        for dim, count, index in self.ties[name].chunks:
            chunk = piece(chunk, dim, count, index)
        return chunk

    def _owned_part(self, weight: torch.Tensor, name: str, own: Owned) -> torch.Tensor:
        start = own.start - self.layout.start[name]
        return weight.reshape(-1)[start : start + own.size]

    @staticmethod
    def _in_segment(segment: torch.Tensor, own: Owned) -> torch.Tensor:
        return segment[own.segment_start : own.segment_start + own.size]

    # -- the step ----------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """One step on the whole batch `inputs`; returns the loss averaged over the replicas."""
        mine = [x.chunk(self.dp)[self.replica] if self.dp > 1 else x for x in inputs]
        try:
            if self.stage is not None:
                loss = self.stage.run(mine)
            else:
                (loss,) = self.program(*self.weights, *mine)
            loss = loss.detach().to(torch.float32, copy=True)
            if self.dp > 1:
                dist.all_reduce(loss, group=self.group)
                loss.div_(self.dp)
            self.exchange.wait()
        finally:
            self.exchange.drop()
            self.prefetched.clear()
        if self.parts > 1:
            self.grad.div_(self.parts)
        self._step()
        return loss

    def _take(self, unit: int, *grads: torch.Tensor | None) -> None:
        """A unit's gradients, as the program makes them: into the gradient buffer, and the
        exchange over the replicas started (a pipeline stage's: summed over its micro-batches,
        the exchange started after the last)."""
        u = self.layout.units[unit]
        size = self.layout.padded(u)
        summed = None
        if self.stage is not None:  # the sum in `sums`: the gradient buffer, or a whole one
            summed = self.sums[u.start : u.start + size]
            self._fill(summed, u.names, grads, add=self.micro_batch > 0)
            if self.micro_batch < self.stage.micro_batches - 1:
                return
        # a unit's buffer is freed once it is exchanged
        self.exchange.settle(
            _IN_FLIGHT - 1, room=size * self.grad.element_size(), limit=self.largest
        )
        if not self.shard_gradients:
            target = self.grad[u.start : u.start + size]
            if summed is None:
                self._fill(target, u.names, grads)
            if self.dp > 1:
                self.exchange.all_reduce(target)
            return
        made = grads[0] if len(grads) == 1 else None
        if summed is not None:
            whole = summed
        elif made is not None and made.numel() == size and made.dtype == self.grad.dtype:
            whole = made.reshape(-1)  # one weight, no padding: reduced where the program left it
        else:
            whole = torch.zeros(size, dtype=self.grad.dtype, device=self.device)
            self._fill(whole, u.names, grads)
        self.exchange.reduce_scatter(self.grad[u.segment_start : u.segment_start + u.chunk], whole)

    def _fill(self, target: torch.Tensor, names: Sequence[str], grads, add: bool = False) -> None:
        """`target` holds (or, `add`, adds) the unit's gradients `grads` laid out one after
        another (None: zeros)."""
        offset = 0
        for n, g in zip(names, grads):
            size = self.layout.numel[n]
            part = target[offset : offset + size]
            if g is not None and add:
                part.add_(g.reshape(-1))
            elif g is not None:
                part.copy_(g.reshape(-1))
            elif not add:
                part.zero_()
            offset += size

    def _gather(self, index: int) -> torch.Tensor:
        """The unit of the program's `index`-th gather, whole; later gathers fetched ahead."""
        if index in self.prefetched:
            work, gathered = self.prefetched.pop(index)
            work.wait()
        else:
            gathered = self._all_gather(index, wait=True)[1]
        if self.prefetch_bytes:
            held = sum(b.numel() * b.element_size() for _, b in self.prefetched.values())
            ahead = index + 1
            while ahead < len(self.gathers):
                if ahead not in self.prefetched:
                    unit = self.layout.units[self.gathers[ahead]]
                    size = self.layout.padded(unit) * self.compute.itemsize
                    if held + size > self.prefetch_bytes:
                        break
                    self.prefetched[ahead] = self._all_gather(ahead, wait=False)
                    held += size
                ahead += 1
            self.prefetch_peak = max(self.prefetch_peak, held)
        return gathered

    def _all_gather(self, index: int, wait: bool) -> tuple[dist.Work | None, torch.Tensor]:
        u = self.layout.units[self.gathers[index]]
        whole = torch.empty(self.layout.padded(u), dtype=self.compute, device=self.device)
        mine = self.shard[u.segment_start : u.segment_start + u.chunk].to(self.compute)
        work = all_gather_single(whole, mine, group=self.group, async_op=not wait)
        return work, whole

    def _weight(self, gathered: torch.Tensor, name: str) -> torch.Tensor:
        if name in self.ties:
            return self._tied(self._view(gathered, self.ties[name].source, unit=True), name)
        return self._view(gathered, name, unit=True)

    def _step(self) -> None:
        for n, tensors in self.updated.items():
            if n not in self.owned:
                grad = self._view(self.grad, n)
            elif self.shard_gradients:
                grad = self._in_segment(self.grad, self.owned[n])
            else:
                grad = self.grad[self.owned[n].start : self.owned[n].stop]
            tensors[0].grad = grad.to(tensors[0].device)
        self.optimizer.step()
        self.steps += 1
        for n, tensors in self.updated.items():
            tensors[0].grad = None
            if n in self.on_device:
                self.on_device[n].copy_(tensors[0])
        if self.shard_states and not self.shard_weights:
            for u in self.layout.units:
                lo, hi = self.layout.chunk_range(u, self.replica)
                whole = self.flat[u.start : u.start + self.layout.padded(u)]
                all_gather_single(whole, self.flat[lo:hi].clone(), group=self.group)
        self._refresh()

    def _refresh(self) -> None:
        """The program's copies of updated weights: the compute dtype's, and tied names'."""
        if self.work is not None and self.work is not self.flat:
            self.work.copy_(self.flat)
        for target, name in self.refresh:
            target.copy_(self._tied(self._view(self.work, self.ties[name].source), name))

    # -- checkpoints -------------------------------------------------------------------

    def _unshard(self, segment: torch.Tensor) -> torch.Tensor:
        """The flat buffer whose chunks the replicas hold in their `segment`s."""
        flat = torch.empty(self.layout.total, dtype=segment.dtype, device=segment.device)
        for u in self.layout.units:
            whole = flat[u.start : u.start + self.layout.padded(u)]
            mine = segment[u.segment_start : u.segment_start + u.chunk]
            all_gather_single(whole, mine, group=self.group)
        return flat

    def state_dict(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """This rank's weights among `names` and the optimizer's states, each in its weight's
        layout (`optimizer.<key>.<weight>`), plus Adam's step count (`optimizer.step`): the
        tensors a checkpoint holds for this rank. Sharded ones are all-gathered first."""
        flat = self._unshard(self.shard) if self.shard_weights else self.flat
        held = dict(zip(self.order, self.weights))
        for n in self.names:
            held[n] = self._view(flat, n)
        for n in self.ties:
            held[n] = self._tied(held[self.ties[n].source], n)
        out = {n: held[n] for n in names if n in held}
        for key in self.state_keys:
            values = torch.zeros(
                self.layout.segment if self.shard_states else self.layout.total,
                dtype=flat.dtype,
                device=self.device,
            )
            for n, tensors in self.updated.items():
                value = self.optimizer.state.get(tensors[0], {}).get(key)
                if value is None:
                    continue
                if self.shard_states:
                    self._in_segment(values, self.owned[n]).copy_(value.reshape(-1))
                else:
                    self._view(values, n).copy_(value)
            if self.shard_states:
                values = self._unshard(values)
            for n in self.names:
                name = state_name(key, n)
                if name in names:
                    out[name] = self._view(values, n)
        if STEP_NAME in names:
            out[STEP_NAME] = torch.tensor(float(self.steps), dtype=torch.float32)
        return out

    def checkpoint_layout(self, names: Sequence[str]) -> dict[str, tuple[tuple[int, ...], str]]:
        """The shape and dtype of every tensor `state_dict(names)` gives, without gathering or
        copying: what a checkpoint must hold, exactly so, to resume this rank."""
        dtype = dtype_name(self.master_dtype)
        held = {n: (tuple(w.shape), dtype_name(w.dtype)) for n, w in
                zip(self.order, self.weights)}  # fmt: skip
        for n in self.names:
            held[n] = (tuple(self.shapes[n]), dtype)
        for n, tie in self.ties.items():
            source = torch.empty(self.shapes[tie.source], device="meta")
            held[n] = (tuple(self._tied(source, n).shape), dtype)
        out = {n: held[n] for n in names if n in held}
        for key in self.state_keys:
            for n in self.names:
                if state_name(key, n) in names:
                    out[state_name(key, n)] = (tuple(self.shapes[n]), dtype)
        if STEP_NAME in names:
            out[STEP_NAME] = ((), "float32")
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take weights and optimizer states (as `state_dict` gives them) from a checkpoint,
        checked first against `checkpoint_layout`."""
        trained = set(self.names)
        for i, n in enumerate(self.order):
            if n not in tensors or n in self.ties:
                continue
            if n in trained and self.shard_weights:
                own = self.layout.owned(n, self.replica)
                if own is not None:
                    self._in_segment(self.shard, own).copy_(self._owned_part(tensors[n], n, own))
            elif n in trained:
                self._view(self.flat, n).copy_(tensors[n].reshape(self.shapes[n]))
            else:
                self.weights[i].copy_(tensors[n].reshape(self.weights[i].shape))
        self._refresh()
        for n, part in self.on_device.items():  # the optimizer's host copies
            self.updated[n][0].copy_(part)
        self.steps = int(tensors[STEP_NAME].item()) if STEP_NAME in tensors else self.steps
        for n, updated in self.updated.items():
            state = {}
            for key in self.state_keys:
                name = state_name(key, n)
                if name not in tensors:
                    continue
                value = tensors[name]
                if n in self.owned:
                    value = self._owned_part(value, n, self.owned[n])
                state[key] = value.to(updated[0].device, copy=True).view(updated[0].shape)
            if state:
                if self.spec.name != "SGD":
                    state["step"] = torch.tensor(float(self.steps))
                self.optimizer.state[updated[0]] = state

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def stats(self) -> dict[str, int]:
        """What a step measured: the most bytes of weights gathered ahead at once."""
        return {"prefetch_peak_bytes": self.prefetch_peak, "prefetch_bytes": self.prefetch_bytes}


class _Stage:
    """A pipeline stage's part of a step: its forward and backward passes over each
    micro-batch, run by the pipeline runner in 1F1B order with the other stages' ranks."""

    def __init__(
        self,
        manifest: Manifest,
        rank: int,
        passes: Passes,
        step: TrainingStep,
        forward: fx.GraphModule,
        backward: fx.GraphModule,
    ) -> None:
        mesh = manifest.mesh
        pp, dp, tp = mesh.size("pp"), mesh.size("dp"), mesh.tensor_parallel
        self.micro_batches = manifest.training.micro_batches
        self.stage, d, t = rank // (dp * tp), rank // tp % dp, rank % tp
        self.rank_of = [(s * dp + d) * tp + t for s in range(pp)]
        self.passes, self.step = passes, step
        self.forward_pass, self.backward_pass = forward, backward
        here = {phase: (phase, self.stage) for phase in ("F", "B")}
        self.sent = sum(1 for h in passes.handoffs if h.sender == here["F"])
        self.sent_back = sum(1 for h in passes.handoffs if h.sender == here["B"])
        actions = pipeline_order("1f1b", pp, pp, self.micro_batches)[self.stage]
        self.runner = PipelineRunner(
            actions,
            pp,
            self.micro_batches,
            passes.handoffs,
            self.rank_of.__getitem__,
            None,
            step.device,
            receive_ahead=True,
        )
        self.rows: list[list[torch.Tensor]] = []
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.loss: torch.Tensor | None = None

    def run(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """One step over this replica's rows `inputs`; the loss, the mean over the
        micro-batches, on the first stage and the stage making it (zero on the others)."""
        m = self.micro_batches
        self.rows = [list(parts) for parts in zip(*(x.chunk(m) for x in inputs))] or [[]] * m
        self.loss, self.saved = None, {}
        self.runner.step(self)
        loss = torch.zeros((), dtype=torch.float32, device=self.step.device)
        if self.loss is not None:
            loss = self.loss / m
        where = self.passes.loss[1]  # the stage returning the loss hands it to the first
        if where != 0 and self.stage == where:
            dist.send(loss, dst=self.rank_of[0])
        elif where != 0 and self.stage == 0:
            dist.recv(loss, src=self.rank_of[where])
        self.rows, self.saved = [], {}
        return loss

    def forward(self, stage: int, micro_batch: int, inputs: list[torch.Tensor]) -> list:
        step = self.step
        step.gathers = step.gathers_of.get(id(self.forward_pass), [])
        out = list(self.forward_pass(*step.weights, *self.rows[micro_batch], *inputs))
        if self.passes.loss == ("F", stage):
            self._add_loss(out.pop())
        self.saved[micro_batch] = out[self.sent :]
        return out[: self.sent]

    def backward(self, stage: int, micro_batch: int, inputs: list[torch.Tensor]) -> list:
        step = self.step
        step.gathers = step.gathers_of.get(id(self.backward_pass), [])
        step.micro_batch = micro_batch
        saved = self.saved.pop(micro_batch)
        out = list(self.backward_pass(*step.weights, *self.rows[micro_batch], *inputs, *saved))
        if self.passes.loss == ("B", stage):
            self._add_loss(out.pop())
        return out

    def _add_loss(self, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float32)
        self.loss = value if self.loss is None else self.loss + value
