"""Which layer of a stack of layers a captured node is in, read from the module path that
torch.export records for it (`nn_module_stack`): the capture labels a training step's backward
nodes by it, and the planner finds identical layers by it."""

from __future__ import annotations

import re

from torch import fx

_INDEXED = re.compile(r"^(.*)\.(\d+)$")

# the fewest identical layers a stack needs before a trace is shared: capture traces layer 0 and
# copies it for the rest (stamp.py), lowering traces two and copies the second (stitch.py, for
# which three is the least that saves a trace); a shorter stack is traced layer by layer
MIN_LAYERS = 3


def layer_of(node: fx.Node) -> tuple[str, int] | None:
    """(`model.layers.*`, 3) for a node inside `model.layers.3`, else None."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in stack.values():
        m = _INDEXED.match(path or "")
        if m:
            return m.group(1) + ".*", int(m.group(2))
    return None
