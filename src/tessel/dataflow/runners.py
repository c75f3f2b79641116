"""Model runners: load a model file onto a device and return a callable `(*tensors) -> list`.

One adapter per model format: `.pt2` ExportedPrograms (read as data: `tessel.capture.pt2`) and
tessel offline models: one whose rank 0 holds the whole model (built for one device, or
replicated over several) loads in the node's process on its device; a partitioned one runs
through tessel.runtime's Session, its ranks on the devices of the package's cluster config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tessel.capture.pt2 import RefusedArchiveError, load_pt2
from tessel.config.errors import ConfigError
from tessel.dataflow.process_point_base import Framework

if TYPE_CHECKING:
    from tessel.dataflow.process_points import GraphProcessPoint

Runner = Callable[..., list[Any]]


def _as_list(out: Any) -> list[Any]:
    if isinstance(out, tuple | list):
        return list(out)
    return [out]


def _read_pt2(path: str) -> torch.export.ExportedProgram:
    try:
        return load_pt2(path)
    except RefusedArchiveError as exc:
        raise ConfigError(path, None, str(exc)) from None


def _pt2_target_kind(path: str) -> str | None:
    ep = _read_pt2(path)
    kinds = set()
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                kinds.add(val.device.type)
    for t in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(t, torch.Tensor):
            kinds.add(t.device.type)
    kinds.discard("meta")
    if not kinds:
        return None
    if len(kinds) > 1:
        return sorted(kinds - {"cpu"})[0]
    return kinds.pop()


def _load_pt2(path: str, device: str) -> Runner:
    ep = _read_pt2(path)
    target = torch.device(device)
    kind = _pt2_target_kind(path)
    if kind and kind != "cpu" and target.type == kind:
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, target)
    module = ep.module()

    def run(*inputs: Any) -> list[Any]:
        args = [x.to(target) if isinstance(x, torch.Tensor) else x for x in inputs]
        with torch.no_grad():
            return _as_list(module(*args))

    return run


def _load_rank0(path: str, device: str) -> Runner:
    """A package whose rank 0 holds the whole model (one device, or replicas), in this process."""
    from tessel.package.format import Package
    from tessel.runtime.loader import load_rank

    target = torch.device(device)
    program, weights = load_rank(Package.open(path), 0, target, {})

    def run(*inputs: Any) -> list[Any]:
        with torch.inference_mode():
            return list(program(*weights, *(x.to(target) for x in inputs)))

    return run


def _load_partitioned(path: str, device: str, load_params: dict[str, str]) -> Runner:
    """A partitioned package run by a tessel Session that this node instance starts: one
    spawned worker per device of the package's cluster config, joined in its process groups,
    as `tessel run` runs it. `load_params` are the session's load options."""
    import multiprocessing

    from tessel.runtime import session as runtime

    me = multiprocessing.current_process()
    if me.daemon:
        # a local DataFlow worker is a daemon to the graph's process, which stops it; its
        # session's workers are its own children (daemons, ended with it)
        me.daemon = False
    if not runtime._state["initialized"]:
        runtime.initialize()
    sess = runtime.Session()
    sess.load_graph(0, dict(load_params), path)
    target = torch.device(device)

    def run(*inputs: Any) -> list[Any]:
        outs = sess.run_graph(0, list(inputs))
        return [o.to(target) for o in outs]

    return run


def _load_tessel(path: str, device: str, load_params: dict[str, str]) -> Runner:
    """A tessel offline model: on the instance's device where rank 0 is the whole model (one
    device, or replicated over several); a partitioned one through a Session."""
    mode, world = tessel_package_mode(path)
    if mode == "training":  # placement refuses it first; a last check
        raise ConfigError(path, "mode", "a training package cannot run in a DataFlow model node")
    if mode == "replicated" or world == 1:
        return _load_rank0(path, device)
    return _load_partitioned(path, device, load_params)


def tessel_package_mode(path: str) -> tuple[str, int]:
    """(mode, world size) of a tessel package: mode is partitioned, replicated or training."""
    from tessel.package.format import Package

    manifest = Package.open(path).manifest
    return manifest.mode, manifest.world_size


def runs_in_session(pp: GraphProcessPoint) -> int:
    """The device count of `pp`'s model where it runs through a Session (a partitioned tessel
    package on several devices), else 0."""
    if pp.framework is not Framework.TESSEL:
        return 0
    mode, world = tessel_package_mode(pp.graph_file)
    return world if mode == "partitioned" and world > 1 else 0


def _tessel_target_kind(path: str) -> str | None:
    """The device kind the package was built for: manifest `device_type`, else its `soc_version`."""
    from tessel.config.soc import soc_profile
    from tessel.package.format import Package

    manifest = Package.open(path).manifest
    if manifest.device_type:
        return manifest.device_type
    return soc_profile(manifest.soc_version).device_type if manifest.soc_version else None


def _tessel_io_counts(path: str) -> tuple[int, int]:
    from tessel.package.format import Package

    manifest = Package.open(path).manifest
    return len(manifest.inputs), len(manifest.outputs) if manifest.outputs else 1


def model_target_kind(pp: GraphProcessPoint) -> str | None:
    """The device kind (cpu/cuda/npu) a model was built for; None when the file does not say."""
    if pp.framework is Framework.PYTORCH:
        return _pt2_target_kind(pp.graph_file)
    return _tessel_target_kind(pp.graph_file)


def model_io_counts(pp: GraphProcessPoint) -> tuple[int, int]:
    """(inputs, outputs) of the model; (1, 1) when the format does not say."""
    if pp.framework is Framework.PYTORCH:
        sig = _read_pt2(pp.graph_file).graph_signature
        return len(sig.user_inputs), len(sig.user_outputs)
    return _tessel_io_counts(pp.graph_file)


def load_model(pp: GraphProcessPoint, device: str) -> Runner:
    """Load the model of `pp` onto `device` ("cpu", "cuda:0", ...)."""
    if pp.framework is Framework.PYTORCH:
        return _load_pt2(pp.graph_file, device)
    try:
        return _load_tessel(pp.graph_file, device, pp.load_params)
    except Exception as exc:  # the package's own error, with the node's model named
        raise RuntimeError(f"cannot load tessel offline model {pp.graph_file}: {exc}") from exc
