"""mindspore.parallel.nn: the wrappers that run a network on micro-batches or in pipeline
stages, and the pipeline's gradient reducer."""

from tessel.parallel.micro_batches import GradAccumulation, MicroBatchInterleaved
from tessel.parallel.pipeline import Pipeline, PipelineCell, PipelineGradReducer

__all__ = [
    "GradAccumulation",
    "MicroBatchInterleaved",
    "Pipeline",
    "PipelineCell",
    "PipelineGradReducer",
]
