"""Pre-sliced models: the relation config and the slices it deploys, read and checked."""
