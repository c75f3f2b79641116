"""The optimizer of a training package, recorded as data: a class from an allow-list, its
parameter groups by weight name, and each group's hyperparameters. Workers rebuild it with
torch's own implementation over the weights they hold; nothing is pickled."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessel.config.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where an optimizer is made: a manifest reads without it
    import torch

# class name -> the hyperparameters recorded (each group's value, or torch's default)
_ADAM = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "Adam": _ADAM,
    "AdamW": _ADAM,
}
# implementation switches: any value computes the same update; not recorded
_IGNORED = ("foreach", "fused", "params", "initial_lr")
_MUST_BE_OFF = ("differentiable", "capturable")


@dataclass(frozen=True)
class ParamGroup:
    params: tuple[str, ...]  # weight FQNs
    options: Mapping[str, Any]  # hyperparameters, JSON values


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    groups: tuple[ParamGroup, ...]

    @property
    def state_per_weight(self) -> float:
        """The state torch keeps per weight element, in weights (what the memory model holds)."""
        return float(max(len(state_keys(self.name, g.options)) for g in self.groups))

    def to_json(self) -> dict:
        return {
            "type": self.name,
            "param_groups": [{"params": list(g.params), **g.options} for g in self.groups],
        }


def state_keys(name: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-weight state torch's `name` keeps for a group with `options` (besides Adam's
    step count): what a checkpoint stores as `optimizer.<key>.<weight>`."""
    if name == "SGD":
        return ("momentum_buffer",) if options.get("momentum", 0) else ()
    return ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if options.get("amsgrad") else ()))


def state_name(key: str, weight: str) -> str:
    """A weight's optimizer state as a checkpoint names it: `optimizer.exp_avg.<weight>`."""
    return f"optimizer.{key}.{weight}"


STEP_NAME = "optimizer.step"  # Adam's step count, one scalar for every weight


def _accepted() -> str:
    return ", ".join(f"torch.optim.{n}" for n in HYPERPARAMETERS)


def optimizer_spec(
    optimizer: Any, names: Mapping[int, str], trainable: tuple[str, ...]
) -> OptimizerSpec:
    """`optimizer` (a torch.optim optimizer over the model's parameters) as data.

    `names` maps `id(parameter)` to its FQN; every trainable weight must be in one group.
    """
    import torch

    kind = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer) or kind not in HYPERPARAMETERS:
        raise ConfigError(
            "optimizer",
            None,
            f"found {type(optimizer).__module__}.{kind}; tessel takes {_accepted()} "
            "(with their hyperparameters and parameter groups)",
        )
    groups = []
    seen: set[str] = set()
    for i, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ConfigError(
                    "optimizer",
                    f"param_groups[{i}]",
                    f"holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model",
                )
            if name in seen:
                raise ConfigError("optimizer", f"param_groups[{i}]", f"holds {name} twice")
            seen.add(name)
            params.append(name)
        groups.append(ParamGroup(tuple(params), _options(kind, group, f"param_groups[{i}]")))
    missing = [n for n in trainable if n not in seen]
    if missing:
        raise ConfigError(
            "optimizer",
            "param_groups",
            f"leaves {len(missing)} trainable weights out, e.g. {missing[0]}; give every "
            "parameter with requires_grad=True to the optimizer, or set requires_grad=False",
        )
    return OptimizerSpec(kind, tuple(groups))


def _options(kind: str, group: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in _MUST_BE_OFF:
        if group.get(key):
            raise ConfigError("optimizer", f"{where}.{key}", "is on; tessel takes it off only")
    known = set(HYPERPARAMETERS[kind]) | set(_IGNORED) | set(_MUST_BE_OFF)
    unknown = sorted(set(group) - known)
    if unknown:
        raise ConfigError(
            "optimizer",
            f"{where}.{unknown[0]}",
            f"is not a {kind} hyperparameter tessel records; it records "
            f"{', '.join(HYPERPARAMETERS[kind])}",
        )
    options = {
        key: _json_value(group[key], f"{where}.{key}")
        for key in HYPERPARAMETERS[kind]
        if key in group
    }
    _check_options(
        kind, options, lambda key, message: ConfigError("optimizer", f"{where}.{key}", message)
    )
    return options


_FLAGS = ("nesterov", "maximize", "amsgrad", "decoupled_weight_decay")


def _check_options(kind: str, options: Mapping[str, Any], error: Any) -> None:
    """A group's hyperparameters as torch's constructor checks them; `error(key, message)`
    makes the error to raise."""
    for key, value in options.items():
        if key in _FLAGS:
            if not isinstance(value, bool):
                raise error(key, f"found {value!r}; expected true or false")
        elif key == "betas":
            if not (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and all(_number(b) and 0.0 <= b < 1.0 for b in value)
            ):
                raise error(key, f"found {value!r}; expected two numbers in [0, 1)")
        elif not _number(value) or value < 0:
            raise error(key, f"found {value!r}; expected a number >= 0")
    if options.get("nesterov") and (options.get("momentum", 0) <= 0 or options.get("dampening", 0)):
        raise error("nesterov", "needs a momentum > 0 and a dampening of 0")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_value(value: Any, where: str) -> Any:
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError("optimizer", where, f"is a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(v, where) for v in value]
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    raise ConfigError("optimizer", where, f"found {value!r}; expected a finite number or a flag")


def spec_from_json(obj: Any, source: str, trained: tuple[str, ...]) -> OptimizerSpec:
    """The optimizer a package records, checked as `optimizer_spec` checks a live one: its
    groups hold every weight of `trained` once, and nothing else."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("param_groups"), list):
        raise ConfigError(
            source, "training.optimizer", f"expected type and param_groups, found {obj!r}"
        )
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in HYPERPARAMETERS:
        raise ConfigError(
            source, "training.optimizer.type", f"found {kind!r}; tessel takes {_accepted()}"
        )
    groups = []
    known, seen = set(trained), set()
    for i, g in enumerate(obj["param_groups"]):
        where = f"training.optimizer.param_groups[{i}]"
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
            raise ConfigError(source, where, "expected an object with a params list")
        params = g["params"]
        if not all(isinstance(p, str) for p in params):
            raise ConfigError(source, f"{where}.params", "expected weight names")
        for name in params:
            if name not in known:
                raise ConfigError(
                    source, f"{where}.params", f"names {name!r}, which the step does not train"
                )
            if name in seen:
                raise ConfigError(source, f"{where}.params", f"names {name!r} a second time")
            seen.add(name)
        options = {k: v for k, v in g.items() if k != "params"}
        unknown = sorted(set(options) - set(HYPERPARAMETERS[kind]))
        if unknown:
            raise ConfigError(source, f"{where}.{unknown[0]}", f"is not a {kind} hyperparameter")
        try:
            options = {k: _json_value(v, k) for k, v in options.items()}
        except ConfigError as exc:
            raise ConfigError(source, where, str(exc)) from None
        _check_options(
            kind, options, lambda key, message, w=where: ConfigError(source, f"{w}.{key}", message)
        )
        groups.append(ParamGroup(tuple(params), options))
    missing = [n for n in trained if n not in seen]
    if missing:
        raise ConfigError(
            source,
            "training.optimizer.param_groups",
            f"leave {len(missing)} trained weights out, e.g. {missing[0]!r}",
        )
    return OptimizerSpec(kind, tuple(groups))


def make_optimizer(
    spec: OptimizerSpec, params: Mapping[str, list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """torch's optimizer of `spec` over `params` (a weight's name -> the tensors that stand for
    it here: its shard, or pieces of it); groups without a tensor here are left out."""
    groups = []
    for g in spec.groups:
        tensors = [t for name in g.params for t in params.get(name, ())]
        if tensors:
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in g.options.items()}
            groups.append({"params": tensors, **options})
    import torch

    cls = getattr(torch.optim, spec.name)
    if not groups:  # a rank holding no trainable weight still steps with the others
        groups = [{"params": [torch.zeros(0)]}]
    return cls(groups)
