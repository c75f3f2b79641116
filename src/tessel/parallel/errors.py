"""The error of `tessel.parallel`'s training-script API."""

from __future__ import annotations

from tessel.errors import TesselError


class ParallelError(TesselError, RuntimeError):
    """The network could not be planned or run as asked."""
