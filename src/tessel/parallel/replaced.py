"""Parameters replaced when a network is placed, and the optimizers that still hold them.

Placing a network gives it new parameter objects: DTensors on a mesh (`shard`, AutoParallel's
first call), or, in pipeline stages, only the parameters of this rank's stages. A script may
have handed the old objects to an optimizer, a gradient clipper or a `PipelineGradReducer`
before that, as torch's and MindSpore's examples do when they build the optimizer before the
loop. Each old object stays behind as a *retired* parameter:

- its `.grad` is its successor's (None where this rank holds no successor), so zeroing,
  clipping and scaling gradients through it act on the gradients that train;
- any other use (its values, an operator on it) raises ParallelError naming it;
- where its successor's local value is its whole storage (a weight every rank holds whole),
  the two stay one tensor, so a `state_dict` taken before reads the trained values; any other
  successor holds storage of its own, and such a `state_dict` keeps the values the weight had
  when it was placed (a snapshot, never partly updated).

Before every optimizer step (torch's global step pre-hook), retired parameters in the
optimizer's groups are replaced by their successors, and any state the optimizer holds for
them (a checkpoint loaded before the first call) is placed like the successor; retired
parameters with no successor on this rank (another pipeline stage's) leave the groups. One
INFO line says so per optimizer. State that cannot be placed fails the step by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from tessel._torch import tree_leaves
from tessel.parallel.errors import ParallelError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Succession:
    successor: torch.Tensor | None  # None: this rank holds no successor
    name: str
    cause: str  # what replaced it, as the sentence's subject: "AutoParallel's first call"


_RETIRED: Any = WeakIdKeyDictionary()  # retired parameter -> _Succession
_CLASSES: dict[type, type] = {}
_hook: Any = None

# what may still be asked of a retired parameter: its metadata, not its values
_METADATA = {
    "dim",
    "element_size",
    "is_complex",
    "is_contiguous",
    "is_floating_point",
    "nelement",
    "numel",
    "size",
    "stride",
}


class _Retired:
    """Mixed into a retired parameter's class (see the module docstring)."""

    __slots__ = ()

    @property
    def grad(self) -> torch.Tensor | None:
        successor = _RETIRED[self].successor
        return None if successor is None else successor.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        succession = _RETIRED[self]
        if succession.successor is not None:
            succession.successor.grad = value
        elif value is not None:
            raise _misused(succession, "given a gradient")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: metadata, but for `.data`
            name = getattr(getattr(func, "__self__", None), "__name__", name)
            allowed = name != "data"
        else:
            allowed = name in _METADATA
        if not allowed:
            raise _misused(_succession_in(args), f"used ({name})")
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[misc]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise _misused(_succession_in(args), f"used ({func})")

    def __repr__(self) -> str:
        succession = _RETIRED.get(self)
        name = succession.name if succession is not None else "?"
        return f"<retired parameter {name}: see its network's parameters>"


def _succession_in(args: Any) -> _Succession | None:
    for value in tree_leaves(args):
        if isinstance(value, torch.Tensor) and value in _RETIRED:
            return _RETIRED[value]
    return None


def _misused(succession: _Succession | None, what: str) -> ParallelError:
    if succession is None:
        return ParallelError(f"a retired parameter was {what}")
    if succession.successor is None:
        return ParallelError(
            f"{succession.name} was {what}, but this rank no longer holds it: "
            f"{succession.cause} gave it to another pipeline stage's ranks. This rank trains "
            "its own stages' parameters (the wrapped network's parameters())"
        )
    return ParallelError(
        f"{succession.name} was {what} after {succession.cause} replaced it with a DTensor "
        "placed over the ranks. Read the network's own parameters() and state_dict() from "
        "then on (an optimizer built before is re-bound at its next step)"
    )


def _retired_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Retired{cls.__name__}", (_Retired, cls), {"__slots__": ()})
    return _CLASSES[cls]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _owning(new: torch.nn.Parameter, old: torch.Tensor) -> torch.nn.Parameter:
    """`new`, made not to hold a part of `old`'s storage (views of `old` taken before keep its
    values at the time): a local value that is a piece of it is copied. Holding all of it is
    kept (the views then read the trained values)."""
    local, whole = _local(new.detach()), _local(old.detach())
    if not _same_storage(local, whole) or _is_all_of(local, whole):
        return new
    assert isinstance(new, DTensor)
    value = DTensor.from_local(
        local.clone(),
        new.device_mesh,
        new.placements,
        run_check=False,
        shape=new.shape,
        stride=new.stride(),
    )
    return torch.nn.Parameter(value, requires_grad=new.requires_grad)


def _is_all_of(local: torch.Tensor, whole: torch.Tensor) -> bool:
    return (
        local.shape == whole.shape
        and local.stride() == whole.stride()
        and local.storage_offset() == whole.storage_offset()
    )


def retire(old: torch.Tensor, successor: torch.Tensor | None, name: str, cause: str) -> None:
    """Make `old` a retired parameter whose successor is `successor` (None: this rank holds
    none)."""
    if old in _RETIRED or old is successor:
        return
    _RETIRED[old] = _Succession(successor, name, cause)
    old.__class__ = _retired_class(type(old))
    _watch_optimizers()


def replace_parameters(
    module: torch.nn.Module, new: Mapping[str, torch.nn.Parameter], cause: str
) -> dict[str, torch.nn.Parameter]:
    """Give `module` the parameters `new` (by name; a parameter several names share, tied
    weights, is replaced under all of them), retiring each old one. Returns the parameters
    given, by the names in `new` (see `_owning`)."""
    names = dict(module.named_parameters(remove_duplicate=False))
    successors: dict[int, tuple[torch.Tensor, torch.nn.Parameter, str]] = {}
    for name, value in new.items():
        old = names[name]
        successors.setdefault(id(old), (old, _owning(value, old), name))
    for name, old in names.items():
        if id(old) in successors:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, successors[id(old)][1])
    for old, value, name in successors.values():
        retire(old, value, name, cause)
    return {name: successors[id(names[name])][1] for name in new}


def _watch_optimizers() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_rebind)


def _rebind(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before `optimizer` steps: its retired parameters replaced by their successors (see the
    module docstring)."""
    if not _RETIRED:
        return
    rebound = dropped = 0
    for group in optimizer.param_groups:
        params = group["params"]
        if not any(p in _RETIRED for p in params):
            continue
        kept = []
        for p in params:
            succession = _RETIRED.get(p)
            if succession is None:
                kept.append(p)
                continue
            state = optimizer.state.pop(p, None)
            successor = _last_successor(succession)
            if successor is None:
                dropped += 1
                continue
            if state:
                optimizer.state[successor] = _placed_state(state, p, succession, successor)
            kept.append(successor)
            rebound += 1
        params[:] = kept
    if not rebound and not dropped:
        return
    seen: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    twice = sorted(
        {
            succession.name
            for succession in list(_RETIRED.values())
            if seen.get(id(_last_successor(succession)), 0) > 1
        }
    )
    if twice:
        raise ParallelError(
            f"{type(optimizer).__name__} holds {twice[:5]} twice: as the parameters first "
            "given to it and as the network's placed ones. Build it over the network's "
            "parameters() alone, before or after the first call"
        )
    done = [f"{rebound} re-bound to the parameters placed over the ranks"] if rebound else []
    if dropped:
        done.append(f"{dropped} of pipeline stages other ranks hold dropped")
    log.info("%s: of the parameters it was given, %s", type(optimizer).__name__, "; ".join(done))


def _last_successor(succession: _Succession) -> torch.Tensor | None:
    """The parameter that stands for a retired one now: its successor, or that one's where it
    retired too (annotated by `shard`, then planned)."""
    successor = succession.successor
    while successor is not None and successor in _RETIRED:
        successor = _RETIRED[successor].successor
    return successor


def _placed_state(
    state: dict, old: torch.Tensor, succession: _Succession, successor: torch.Tensor
) -> dict:
    """An optimizer's state for `old` (whole, as a checkpoint loaded before the first call
    holds it), placed like `successor`."""
    placed = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            placed[key] = value  # a step count, or a setting
        elif (
            value.shape == old.shape
            and isinstance(successor, DTensor)
            and not isinstance(value, DTensor)
        ):
            placed[key] = distribute_tensor(
                value.detach().to(successor.device),
                successor.device_mesh,
                successor.placements,
                src_data_rank=None,  # every rank loaded the whole state: each takes its part
            )
        else:
            raise ParallelError(
                f"the optimizer's state {key!r} of {succession.name} ({type(value).__name__} of "
                f"shape {tuple(value.shape)}) cannot be placed like the weight {tuple(old.shape)} "
                f"that {succession.cause} placed; load the optimizer's state after the first "
                "call (torch.distributed.checkpoint), or give it whole weights' states"
            )
    return placed
