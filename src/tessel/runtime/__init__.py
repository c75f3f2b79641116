"""The runtime: initialize/finalize, Session with load_graph/run_graph, one worker per device."""

from tessel.runtime.rendezvous import NodeError
from tessel.runtime.session import Session, SessionError, WorkerError, finalize, initialize
from tessel.runtime.single import load_model

__all__ = [
    "NodeError",
    "Session",
    "SessionError",
    "WorkerError",
    "finalize",
    "initialize",
    "load_model",
]
