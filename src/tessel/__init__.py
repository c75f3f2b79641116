"""tessel: build, partition and deploy PyTorch foundation models across many devices.

Names are imported on first use, so a worker process that needs only the runtime stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from tessel._version import __version__ as __version__

_EXPORTS = {
    "build": "tessel.builder",
    "save": "tessel.builder",
    "BuiltModel": "tessel.builder",
    "empty_weights": "tessel.builder.weights",
    "build_from_slices": "tessel.builder.slices",
    "export_slice": "tessel.slices.export",
    "load_onnx": "tessel.capture.onnx",
    "build_initialize": "tessel.builder.seed_api",
    "build_model": "tessel.builder.seed_api",
    "save_model": "tessel.builder.seed_api",
    "build_finalize": "tessel.builder.seed_api",
    "CLUSTER_CONFIG": "tessel.builder.seed_api",
    "DISTRIBUTED_CLUSTER_BUILD": "tessel.builder.seed_api",
    "ENABLE_GRAPH_PARALLEL": "tessel.builder.seed_api",
    "GRAPH_PARALLEL_OPTION_PATH": "tessel.builder.seed_api",
    "ConfigError": "tessel.config",
    "Generation": "tessel.config.generation",
    "TesselError": "tessel.errors",
    "NodeError": "tessel.runtime",
    "Session": "tessel.runtime",
    "SessionError": "tessel.runtime",
    "WorkerError": "tessel.runtime",
    "initialize": "tessel.runtime",
    "finalize": "tessel.runtime",
    "load_model": "tessel.runtime",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tessel' has no attribute {name!r}")
