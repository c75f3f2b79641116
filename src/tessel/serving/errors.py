"""What a served request can meet besides its tokens, each an error the HTTP layer answers
with its own status (OpenAI's error shape): a bad request (400), a full queue (429), a wait
past the queue's timeout or an engine that stopped (503)."""

from __future__ import annotations

from tessel.errors import TesselError


class ServingError(TesselError, RuntimeError):
    """A request the engine could not serve; `status` is the HTTP answer, `param` the field
    at fault where one is."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequest(ServingError, ValueError):
    """A request the package cannot take (its prompt too long, a setting out of range)."""

    status = 400
    kind = "invalid_request_error"


class QueueFull(ServingError):
    """Every slot is taken and the queue holds `max_queued_requests` already."""

    status = 429
    kind = "rate_limit_error"


class QueueTimeout(ServingError):
    """The request waited for a slot past the engine's `queue_timeout`."""

    status = 503
    kind = "timeout"


class EngineStopped(ServingError):
    """The engine is draining, closed, or lost a worker: it takes no more requests."""

    status = 503
    kind = "engine_stopped"
