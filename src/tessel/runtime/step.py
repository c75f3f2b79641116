"""One training step on a worker: its rank's program, then the data-parallel exchange of
gradients, then torch's optimizer over the part of the weights this rank updates.

A rank's trained weights live in one flat buffer (the weights its program reads are views of
it). With `dp` data-parallel replicas the flat gradients are averaged over the replicas
(all-reduce), or reduce-scattered so each rank keeps 1/dp of them (gradient sharding). With
optimizer state sharding each replica's rank updates its 1/dp segment of the buffer, holding
optimizer state for that segment alone, and the segments are all-gathered afterwards; the
pieces of a segment are views of the buffer, one per weight it crosses, so torch's optimizers
see ordinary tensors in the package's parameter groups.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tessel.config.optimizer import (
    STEP_NAME,
    make_optimizer,
    spec_from_json,
    state_keys,
    state_name,
)
from tessel.package.manifest import Manifest, Submodel
from tessel.sharding.geometry import piece


class StepError(RuntimeError):
    """A training step could not run on this rank."""


def data_parallel_groups(manifest: Manifest) -> dict[int, dist.ProcessGroup | None]:
    """One group per tensor-parallel rank holding its data-parallel replicas (tp rank -> group),
    made on every rank in one order; None stands for the whole world."""
    t = manifest.training
    dp, tp = t.data_parallel, t.tensor_parallel
    if dp == 1 or not dist.is_initialized():
        return {}
    if tp == 1:
        return {0: None}
    return {i: dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)}


class TrainingStep:
    """A rank's weights, gradients and optimizer for the steps of one loaded package."""

    def __init__(
        self,
        manifest: Manifest,
        rank: int,
        weights: list[torch.Tensor],
        group: dist.ProcessGroup | None,
    ) -> None:
        t = manifest.training
        sub: Submodel = manifest.submodel(rank)
        self.dp, self.tp = t.data_parallel, t.tensor_parallel
        self.replica = rank // self.tp
        self.group = group
        self.shard_states = t.optimizer_state_sharding and self.dp > 1
        self.shard_gradients = t.gradient_sharding and self.dp > 1
        self.names = t.gradients
        position = {name: i for i, name in enumerate(sub.weight_order)}
        missing = [n for n in self.names if n not in position]
        if missing:
            raise StepError(f"rank {rank} holds no weight {missing[0]!r} to train")
        dtypes = {weights[position[n]].dtype for n in self.names}
        if len(dtypes) > 1:
            raise StepError(f"trained weights of several dtypes: {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        device = weights[0].device if weights else torch.device("cpu")

        # the trained weights, copied into one flat buffer (padded to a multiple of dp)
        sizes = [weights[position[n]].numel() for n in self.names]
        self.offsets = [0, *itertools.accumulate(sizes)]
        total = self.offsets[-1]
        self.segment = math.ceil(total / self.dp) if self.dp > 1 else total
        self.flat = torch.zeros(self.segment * max(self.dp, 1), dtype=dtype, device=device)
        self.params: list[torch.Tensor] = []
        for n, start, size in zip(self.names, self.offsets, sizes):
            w = weights[position[n]]
            view = self.flat[start : start + size].view(w.shape)
            view.copy_(w)
            self.params.append(view)
            weights[position[n]] = view
        # a second name of a trained weight: the same tensor, or this rank's chunk of it,
        # copied again after every update where the chunk is not a view
        self.refresh: list[Callable[[], None]] = []
        for name, tie in sub.tied.items():
            if tie.source not in self.names:
                continue
            source = weights[position[tie.source]]
            chunk = source
            for dim, count, index in tie.chunks:
                chunk = piece(chunk, dim, count, index)
            if chunk.is_contiguous():
                weights[position[name]] = chunk
            else:
                target = weights[position[name]] = chunk.contiguous()

                def copy(target: torch.Tensor = target, tie=tie, source=source) -> None:
                    chunk = source
                    for dim, count, index in tie.chunks:
                        chunk = piece(chunk, dim, count, index)
                    target.copy_(chunk)

                self.refresh.append(copy)
        self.weights = weights

        # what this rank's optimizer updates: whole weights, or their pieces in its segment
        self.lo, self.hi = (
            (self.replica * self.segment, (self.replica + 1) * self.segment)
            if self.shard_states
            else (0, total)
        )
        self.pieces: dict[str, tuple[int, int]] = {}  # name -> (start, end) in the flat buffer
        self.updated: dict[str, list[torch.Tensor]] = {}
        for n, start, size, param in zip(self.names, self.offsets, sizes, self.params):
            a, b = max(start, self.lo), min(start + size, self.hi)
            if a < b:
                self.pieces[n] = (a, b)
                self.updated[n] = [self.flat[a:b] if self.shard_states else param]
        self.spec = spec = spec_from_json(t.optimizer, "the package")
        self.optimizer = make_optimizer(spec, self.updated)
        self.state_keys = sorted({k for g in spec.groups for k in state_keys(spec.name, g.options)})
        self.order = list(sub.weight_order)
        self.steps = 0
        # gradients kept between steps: the whole buffer, or this rank's segment of it with
        # gradient sharding (the whole one is then made for each step's reduce-scatter)
        self.grad = torch.zeros(
            self.segment if self.shard_gradients else self.flat.numel(), dtype=dtype, device=device
        )
        self.grad_start = self.lo if self.shard_gradients else 0  # where self.grad starts

    def run(
        self, program: Callable[..., Sequence[torch.Tensor]], inputs: list[torch.Tensor]
    ) -> torch.Tensor:
        """One step on the whole batch `inputs`; returns the loss averaged over the replicas."""
        mine = [x.chunk(self.dp)[self.replica] if self.dp > 1 else x for x in inputs]
        outputs = program(*self.weights, *mine)
        loss, grads = outputs[0], outputs[1:]
        if len(grads) != len(self.names):
            raise StepError(
                f"the program returned {len(grads)} gradients for {len(self.names)} weights"
            )
        whole = self.grad if not self.shard_gradients else torch.zeros_like(self.flat)
        outputs = list(outputs)
        del grads
        for i, (start, p) in enumerate(zip(self.offsets, self.params), start=1):
            whole[start : start + p.numel()].copy_(outputs[i].reshape(-1))
            outputs[i] = None  # each gradient freed once copied
        del outputs
        loss = loss.detach().clone()
        if self.dp > 1:
            self._exchange(loss, whole)
        del whole
        self._step()
        return loss

    def _exchange(self, loss: torch.Tensor, whole: torch.Tensor) -> None:
        """Average the loss and the gradients over the replicas (only this rank's segment of
        the gradients, with gradient sharding)."""
        dist.all_reduce(loss, group=self.group)
        loss.div_(self.dp)
        if self.shard_gradients:
            dist.reduce_scatter_tensor(self.grad, whole, group=self.group)
            self.grad.div_(self.dp)
        else:
            dist.all_reduce(self.grad, group=self.group)
            self.grad[self.lo : self.hi].div_(self.dp)

    def _step(self) -> None:
        for n, tensors in self.updated.items():
            a, b = self.pieces[n]
            g = self.grad[a - self.grad_start : b - self.grad_start]
            tensors[0].grad = g.view(tensors[0].shape)
        self.optimizer.step()
        self.steps += 1
        for tensors in self.updated.values():
            tensors[0].grad = None
        if self.shard_states:
            mine = self.flat[self.lo : self.hi].clone()
            dist.all_gather_into_tensor(self.flat, mine, group=self.group)
        for copy in self.refresh:
            copy()

    def state_dict(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """This rank's weights among `names` and the optimizer's states, each in its weight's
        layout (`optimizer.<key>.<weight>`), plus Adam's step count (`optimizer.step`): the
        tensors a checkpoint holds for this rank. Sharded states are all-gathered first."""
        held = dict(zip(self.order, self.weights))
        out = {n: held[n] for n in names if n in held}
        for key in self.state_keys:
            flat = torch.zeros_like(self.flat)
            for n, (a, b) in self.pieces.items():
                value = self.optimizer.state.get(self.updated[n][0], {}).get(key)
                if value is not None:
                    flat[a:b].copy_(value.reshape(-1))
            if self.shard_states:
                mine = flat[self.lo : self.hi].clone()
                dist.all_gather_into_tensor(flat, mine, group=self.group)
            for n, start, p in zip(self.names, self.offsets, self.params):
                name = state_name(key, n)
                if name in names:
                    out[name] = flat[start : start + p.numel()].view(p.shape)
        if STEP_NAME in names:
            out[STEP_NAME] = torch.tensor(float(self.steps), dtype=torch.float32)
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take weights and optimizer states (as `state_dict` gives them) from a checkpoint."""
        for i, n in enumerate(self.order):
            if n in tensors:
                self.weights[i].copy_(tensors[n].reshape(self.weights[i].shape))
        for copy in self.refresh:
            copy()
        self.steps = int(tensors[STEP_NAME].item()) if STEP_NAME in tensors else self.steps
        starts = dict(zip(self.names, self.offsets))
        for n, (a, b) in self.pieces.items():
            start = starts[n]
            state = {}
            for key in self.state_keys:
                name = state_name(key, n)
                if name in tensors:
                    whole = tensors[name].reshape(-1)
                    state[key] = whole[a - start : b - start].clone().view(self.updated[n][0].shape)
            if state:
                if self.spec.name != "SGD":
                    state["step"] = torch.tensor(float(self.steps))
                self.optimizer.state[self.updated[n][0]] = state

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
