"""The vocabulary every stage shares about how a tensor is spread over devices.

`geometry` cuts dimensions (torch.chunk's cut) and places ranks on a mesh, without torch;
`placements` answers, for DTensor placements on a mesh, which box of a tensor a rank holds.
"""

from tessel.sharding.geometry import chunk_range, mesh_coordinate, piece

__all__ = ["chunk_range", "mesh_coordinate", "piece"]
