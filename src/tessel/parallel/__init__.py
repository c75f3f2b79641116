"""mindspore.parallel-style API for PyTorch.

Checkpoints: Layout, strategy files, conversion and the mindspore.parallel-compatible functions
live in tessel.checkpoint (checkpoint/api.py), re-exported here. Training scripts: AutoParallel (auto_parallel.py, over
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
    "build_searched_strategy": "tessel.checkpoint.api",
    "convert_checkpoint_by_rank": "tessel.checkpoint.api",
    "convert_checkpoints": "tessel.checkpoint.api",
    "load_distributed_checkpoint": "tessel.checkpoint.api",
    "load_segmented_checkpoints": "tessel.checkpoint.api",
    "merge_pipeline_strategys": "tessel.checkpoint.api",
    "parameter_broadcast": "tessel.checkpoint.api",
    "rank_list_for_convert": "tessel.checkpoint.api",
    "restore_group_info_list": "tessel.checkpoint.api",
    "shard_checkpoint": "tessel.checkpoint.api",
    "unified_safetensors": "tessel.checkpoint.api",
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
