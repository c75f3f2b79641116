"""Lowering: a plan becomes per-rank local programs with explicit collectives and weight shards."""
