"""Model runners: load a model file onto a device and return a callable `(*tensors) -> list`.

One adapter per model format: `.pt2` ExportedPrograms (loaded with torch.export.load only) and
tessel offline models (through tessel.runtime's Session, once that exists).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tessel.dataflow.process_points import Framework, GraphProcessPoint

Runner = Callable[..., list[Any]]


def _as_list(out: Any) -> list[Any]:
    if isinstance(out, tuple | list):
        return list(out)
    return [out]


def _pt2_target_kind(path: str) -> str | None:
    ep = torch.export.load(path)
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
    ep = torch.export.load(path)
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


def _tessel_session_class() -> Any:
    try:
        from tessel.runtime import Session  # type: ignore[attr-defined]
    except ImportError:
        return None
    return Session


def _load_tessel(path: str, device: str, load_params: dict[str, str]) -> Runner:
    session_cls = _tessel_session_class()
    if session_cls is None:
        raise NotImplementedError(
            f"tessel offline model {path}: not wired yet; tessel.runtime.Session is not available "
            "in this build. Use a .pt2 ExportedProgram (Framework.PYTORCH) for now."
        )
    session = session_cls(dict(load_params))
    session.load_graph(0, {"device": device, **load_params}, path)

    def run(*inputs: Any) -> list[Any]:
        return list(session.run_graph(0, list(inputs)))

    return run


def _tessel_target_kind(path: str) -> str | None:
    """The manifest's soc_version mapped to a device kind, when the package has one."""
    import json
    from pathlib import Path

    from tessel.config.soc import soc_profile

    p = Path(path)
    for cand in (p / "manifest.json", p.with_suffix(".json")):
        if cand.is_file():
            try:
                soc = json.loads(cand.read_text()).get("soc_version")
                return soc_profile(soc).device_type if soc else None
            except (ValueError, OSError):
                return None
    return None


def model_target_kind(pp: GraphProcessPoint) -> str | None:
    """The device kind (cpu/cuda/npu) a model was built for; None when the file does not say."""
    if pp.framework is Framework.PYTORCH:
        return _pt2_target_kind(pp.graph_file)
    return _tessel_target_kind(pp.graph_file)


def load_model(pp: GraphProcessPoint, device: str) -> Runner:
    """Load the model of `pp` onto `device` ("cpu", "cuda:0", ...)."""
    if pp.framework is Framework.PYTORCH:
        return _load_pt2(pp.graph_file, device)
    return _load_tessel(pp.graph_file, device, pp.load_params)
