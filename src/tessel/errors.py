"""The base of every error tessel raises on purpose: bad input, a model that cannot be placed,
a package that cannot be used, a worker that failed. The CLI prints any of them as one line."""

from __future__ import annotations


class TesselError(Exception):
    """An error tessel raises with a message meant for the user; never a bug in tessel."""
