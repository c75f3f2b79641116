"""mindspore.parallel-style API for PyTorch: Layout, strategy files, checkpoint conversion."""

from tessel.parallel.api import (
    build_searched_strategy,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    load_distributed_checkpoint,
    load_segmented_checkpoints,
    merge_pipeline_strategys,
    rank_list_for_convert,
    restore_group_info_list,
    shard_checkpoint,
    unified_safetensors,
)
from tessel.parallel.dtensor import layout_from_dtensor, layout_to_dtensor, layout_to_placements
from tessel.parallel.errors import (
    CheckpointError,
    LayoutError,
    LayoutTypeError,
    NotExpressibleError,
    StrategyError,
)
from tessel.parallel.layout import Layout
from tessel.parallel.strategy import ParamLayout, Strategy, load_strategy, save_strategy_file

__all__ = [
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
    "rank_list_for_convert",
    "restore_group_info_list",
    "save_strategy_file",
    "shard_checkpoint",
    "unified_safetensors",
]
