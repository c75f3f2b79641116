"""The vocabulary every stage shares about how a tensor is spread over devices."""

from tessel.sharding.geometry import chunk_range, piece

__all__ = ["chunk_range", "piece"]
