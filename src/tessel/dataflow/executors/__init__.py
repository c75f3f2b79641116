"""Executors: run a placed flow graph locally (forked workers) or on Ray (several hosts)."""
