"""The single-device load path (aclmdlLoadFromFile's counterpart), for models built without
distributed deployment. A model built for distributed deployment is refused here: it needs a
Session, which starts a worker per device and joins them in process groups."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tessel.package.format import Package, PackageError
from tessel.runtime.loader import load_rank


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> Callable[..., list[torch.Tensor]]:
    """Load a single-device offline model in this process (AscendCL's aclmdlLoadFromFile).

    Args:
        path: A `.tessel` package built for one device, without `--distributed_cluster_build`.
        device: The torch device to run it on.

    Returns:
        `run(*inputs) -> outputs`.

    Raises:
        PackageError: The package was built for distributed deployment: load it in a Session.
    """
    package = Package.open(path)
    if package.manifest.mode != "replicated" or package.world_size != 1:
        raise PackageError(
            path,
            "this offline model was built for distributed deployment (--distributed_cluster_build=1) "
            "and cannot be loaded by the single-device path; load it in a session: "
            "tessel.initialize(), Session().load_graph(graph_id, {}, path), then run_graph",
        )
    device = torch.device(device)
    program, weights = load_rank(package, 0, device, {})

    def run(*inputs: torch.Tensor) -> list[torch.Tensor]:
        with torch.inference_mode():
            return list(program(*weights, *(x.to(device) for x in inputs)))

    return run
