"""The optimizer of a training package, recorded as data: a class from an allow-list, its
parameter groups by weight name, and each group's hyperparameters. Workers rebuild it with
torch's own implementation over the weights they hold; nothing is pickled."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessel.config.errors import ConfigError

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
    return {
        key: _json_value(group[key], f"{where}.{key}")
        for key in HYPERPARAMETERS[kind]
        if key in group
    }


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
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


def spec_from_json(obj: Any, source: str) -> OptimizerSpec:
    """The optimizer a package records, checked as `optimizer_spec` checks a live one."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("param_groups"), list):
        raise ConfigError(
            source, "training.optimizer", f"expected type and param_groups, found {obj!r}"
        )
    kind = obj.get("type")
    if kind not in HYPERPARAMETERS:
        raise ConfigError(
            source, "training.optimizer.type", f"found {kind!r}; tessel takes {_accepted()}"
        )
    groups = []
    for i, g in enumerate(obj["param_groups"]):
        where = f"training.optimizer.param_groups[{i}]"
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
            raise ConfigError(source, where, "expected an object with a params list")
        params = g["params"]
        if not all(isinstance(p, str) for p in params):
            raise ConfigError(source, f"{where}.params", "expected weight names")
        options = {k: v for k, v in g.items() if k != "params"}
        unknown = sorted(set(options) - set(HYPERPARAMETERS[kind]))
        if unknown:
            raise ConfigError(source, f"{where}.{unknown[0]}", f"is not a {kind} hyperparameter")
        try:
            options = {k: _json_value(v, k) for k, v in options.items()}
        except ConfigError as exc:
            raise ConfigError(source, where, str(exc)) from None
        groups.append(ParamGroup(tuple(params), options))
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
    cls = getattr(torch.optim, spec.name)
    if not groups:  # a rank holding no trainable weight still steps with the others
        groups = [{"params": [torch.zeros(0)]}]
    return cls(groups)
