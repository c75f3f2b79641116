"""mindspore.parallel-style API for PyTorch.

Checkpoints: Layout, strategy files and conversion live in tessel.checkpoint; api.py holds the
mindspore.parallel-compatible functions. Training scripts: AutoParallel (auto_parallel.py, over
planned.py: tessel's planner on the job's ranks), shard and reshard (annotate.py) and the
wrappers of tessel.parallel.nn. Names are imported on first use, so the command line can
register `tessel ckpt` (and read a package's manifest) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AutoParallel": "tessel.parallel.auto_parallel",
    "ParallelError": "tessel.parallel.errors",
    "shard": "tessel.parallel.annotate",
    "sync_pipeline_shared_parameters": "tessel.parallel.pipeline",
    "reshard": "tessel.parallel.annotate",
    "build_searched_strategy": "tessel.parallel.api",
    "convert_checkpoint_by_rank": "tessel.parallel.api",
    "convert_checkpoints": "tessel.parallel.api",
    "load_distributed_checkpoint": "tessel.parallel.api",
    "load_segmented_checkpoints": "tessel.parallel.api",
    "merge_pipeline_strategys": "tessel.parallel.api",
    "parameter_broadcast": "tessel.parallel.api",
    "rank_list_for_convert": "tessel.parallel.api",
    "restore_group_info_list": "tessel.parallel.api",
    "shard_checkpoint": "tessel.parallel.api",
    "unified_safetensors": "tessel.parallel.api",
    "layout_from_dtensor": "tessel.checkpoint.dtensor",
    "layout_to_dtensor": "tessel.checkpoint.dtensor",
    "layout_to_placements": "tessel.checkpoint.dtensor",
    "CheckpointError": "tessel.checkpoint.errors",
    "LayoutError": "tessel.checkpoint.errors",
    "LayoutTypeError": "tessel.checkpoint.errors",
    "NotExpressibleError": "tessel.checkpoint.errors",
    "StrategyError": "tessel.checkpoint.errors",
    "Layout": "tessel.checkpoint.layout",
    "ParamLayout": "tessel.checkpoint.strategy",
    "Strategy": "tessel.checkpoint.strategy",
    "load_strategy": "tessel.checkpoint.strategy",
    "save_strategy_file": "tessel.checkpoint.strategy",
}

__all__ = [
    "AutoParallel",
    "ParallelError",
    "shard",
    "reshard",
    "sync_pipeline_shared_parameters",
    "Layout",
    "ParamLayout",
    "Strategy",
    "CheckpointError",
    "LayoutError",
    "LayoutTypeError",
    "NotExpressibleError",
    "StrategyError",
    "build_searched_strategy",
    "convert_checkpoint_by_rank",
    "convert_checkpoints",
    "layout_from_dtensor",
    "layout_to_dtensor",
    "layout_to_placements",
    "load_distributed_checkpoint",
    "load_segmented_checkpoints",
    "load_strategy",
    "merge_pipeline_strategys",
    "parameter_broadcast",
    "rank_list_for_convert",
    "restore_group_info_list",
    "save_strategy_file",
    "shard_checkpoint",
    "unified_safetensors",
]


def __getattr__(name: str) -> Any:
    if name == "nn":  # mindspore.parallel.nn's wrappers
        return importlib.import_module("tessel.parallel.nn")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tessel.parallel' has no attribute {name!r}")
