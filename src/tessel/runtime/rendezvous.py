"""Where the nodes of a cluster of several nodes meet: a store at the head's `ipaddr:port`.

The head's session hosts torch's TCPStore there for as long as its graph is loaded, and every
node's session, the head's included, claims its node id in that store before it starts a
worker; the workers then make their process groups through the same store. A claim is one
compare-and-set of the key `tessel/node/<id>` from empty to the claimant (its host, process
and package), so the first node to claim an id holds it and every later claimant is refused
at once, naming the holder. A second head cannot listen on the head's address, and is refused
the same way. A node gives its id back when its workers stop; a node killed outright cannot,
and its claim is taken over by the next claimant on the same host (and pid namespace) once
its process is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tessel.config.cluster import ClusterConfig
from tessel.errors import TesselError

# how long a head whose address is taken waits for an answer from what holds it, and how long
# a node waits for the head's own claim once the head's store answers (the head claims its id
# in the moment after it starts listening): a head's store answers within milliseconds
PROBE_S = 2.0


class NodeError(TesselError, RuntimeError):
    """A node of a cluster of several nodes cannot take its place: its id is another running
    node's, the head's address is taken, or no head answered in time."""


def claim_key(node_id: int) -> str:
    """The store key that says which process is node `node_id`."""
    return f"tessel/node/{node_id}"


@dataclass
class Meeting:
    """This node's place in the head's store: the store it claimed its id in (on the head, the
    store it hosts) and its claim, given back by `leave`."""

    store: Any  # dist.TCPStore; None once left
    key: str
    claim: str

    def leave(self) -> None:
        """Give the id back, so the node can be started again while the head runs; then let the
        store go (on the head, its server closes). A head already gone is no error."""
        store, self.store = self.store, None
        if store is None:
            return
        with contextlib.suppress(Exception):
            store.set_timeout(datetime.timedelta(seconds=PROBE_S))
            store.compare_set(self.key, self.claim, "")


def meet(
    cluster: ClusterConfig, node_id: int, addr: str, port: int, timeout_s: float, package: str
) -> Meeting:
    """Take node `node_id`'s place at the head's store at `addr:port`: host the store there
    where this is the head, else wait up to `timeout_s` for the head's; then claim the id.

    Raises `NodeError` naming the id and its holder where another process holds it, where the
    head's address is taken, and where no head answers in time."""
    head = cluster.head.node_id
    where = f"{addr}:{port}"
    if node_id == head:
        try:
            store = _connect(addr, port, True, timeout_s)
        except TimeoutError:
            raise NodeError(
                f"node {head} (the head) could not reach its own store at {where} within "
                f"{timeout_s:g} s: check that {addr} is this host's address"
            ) from None
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise NodeError(
                    f"node {head} (the head) cannot listen at {where}: {_first_line(exc)}"
                ) from None
            raise _address_taken(cluster, addr, port) from None
    else:
        try:
            store = _connect(addr, port, False, timeout_s)
        except (TimeoutError, dist.DistError):
            raise NodeError(
                f"node {node_id}: no tessel head answered at {where} (node {head}'s ipaddr and "
                f"port in the cluster config) within {timeout_s:g} s (tessel.load_timeout_s): "
                "start the head's session there, and check that this host can reach it"
            ) from None
        try:
            # the head claims its id the moment after it listens: a store that never shows
            # that claim is not a tessel head's
            store.wait([claim_key(head)], datetime.timedelta(seconds=PROBE_S))
        except dist.DistError:
            raise NodeError(
                f"node {node_id}: what answers at {where} (node {head}'s ipaddr and port in the "
                "cluster config) is not a tessel head: it holds no claim of the head's id"
            ) from None
    # the token tells two sessions of one process apart
    mine = json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pids": _pid_space(),
            "package": package,
            "token": uuid.uuid4().hex,
        },
        sort_keys=True,
    )
    key = claim_key(node_id)
    try:
        holder = _claim(store, key, mine)
    except dist.DistError as exc:
        raise NodeError(
            f"node {node_id}: the head's store at {where} failed as this node claimed its id: "
            f"{_first_line(exc)}"
        ) from None
    if holder is None:
        return Meeting(store, key, mine)
    if node_id == head:
        raise _head_running(cluster, addr, port, holder)
    raise NodeError(
        f"node {node_id} is already running: {_who(holder)}, which joined the head at {where}. "
        f"Each node runs once: stop that one first, or start this host with another node's id "
        f"({_nodes(cluster)}) as --node-id or the option tessel.node_id. If that process is "
        "gone, start the head again: it keeps the ids while its graph is loaded"
    )


def _claim(store: Any, key: str, mine: str) -> dict[str, Any] | None:
    """Claim `key` for `mine`: None where this process now holds it, else the holder's claim.

    An empty value is a claim given back. A holder whose process ids are this process's (the
    same host, and pid namespace: containers on one host may share its name) and whose
    process is gone (killed before it could give its id back) is replaced, by a
    compare-and-set of its own claim, so two claimants racing to replace it cannot both win."""
    held = store.compare_set(key, "", mine).decode()
    if held == mine:
        return None
    holder = _parsed(held)
    ours = json.loads(mine)
    here = ours["pids"] is not None and holder.get("pids") == ours["pids"]
    if here and holder.get("host") == ours["host"] and not _alive(holder.get("pid")):
        held = store.compare_set(key, held, mine).decode()
        if held == mine:
            return None
        holder = _parsed(held)
    return holder


def _connect(addr: str, port: int, master: bool, timeout_s: float, retries: bool = True) -> Any:
    """A TCPStore at `addr:port`, listening there too where `master`.

    Made on a thread of its own: torch's constructor holds its caller until it connects or
    times out, where Ctrl-C would wait for it, and a server that is no store (one that never
    answers the store's greeting) holds it for ever. Raises TimeoutError once `timeout_s` has
    passed (and, where `retries`, the last retry torch makes after it), else what torch raised.
    """
    timeout_s = min(max(0.0, timeout_s), _LONGEST_S)
    done = threading.Event()
    out: dict[str, Any] = {}

    def connect() -> None:
        try:
            out["store"] = dist.TCPStore(
                addr,
                port,
                is_master=master,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            out["error"] = exc
        finally:
            done.set()

    threading.Thread(target=connect, name="tessel-meet", daemon=True).start()
    # a thread still in torch's constructor when the interpreter exits may abort it as it
    # returns: the wait outlasts torch's own timeout, so only a server that never answers
    # (where the thread cannot return) or Ctrl-C leaves it running
    if not done.wait(timeout_s + (_RETRY_S if retries else 0.0)):
        raise TimeoutError(f"no store answered at {addr}:{port}")
    if "error" in out:
        raise out["error"]
    return out["store"]


# torch's store client tries to connect until its timeout, then once more after a backoff of
# up to a few seconds
_RETRY_S = 5.0
# the longest wait a store is given (a week: torch's timeout is a count of milliseconds)
_LONGEST_S = 7 * 24 * 3600.0


def _address_taken(cluster: ClusterConfig, addr: str, port: int) -> NodeError:
    """The head cannot listen at `addr:port`: what holds it, asked as a store (a running head
    answers with its claim), else another program."""
    head = cluster.head.node_id
    holder = None
    with contextlib.suppress(Exception):  # anything but a tessel head's store: no holder
        store = _connect(addr, port, False, PROBE_S, retries=False)
        if store.check([claim_key(head)]):
            holder = _parsed(store.get(claim_key(head)).decode())
    if holder:
        return _head_running(cluster, addr, port, holder)
    return NodeError(
        f"node {head} (the head) cannot listen at {addr}:{port} (node {head}'s ipaddr and port "
        "in the cluster config, or the option tessel.master_port): another program, not a "
        "tessel head, holds that port; stop it, or give the cluster another port"
    )


def _head_running(
    cluster: ClusterConfig, addr: str, port: int, holder: dict[str, Any]
) -> NodeError:
    head = cluster.head.node_id
    return NodeError(
        f"node {head} (the head) is already running at {addr}:{port}: {_who(holder)}. Each "
        f"node runs once: stop that head first, or start this host with another node's id "
        f"({_nodes(cluster)}) as --node-id or the option tessel.node_id"
    )


def _nodes(cluster: ClusterConfig) -> str:
    """The cluster's node ids in words, the head's marked."""
    head, *rest = [str(n.node_id) for n in cluster.nodes]
    others = ", ".join(rest[:-1]) + (" and " if len(rest) > 1 else "and ") + rest[-1]
    return f"the cluster config's nodes are {head}, the head, {others}"


def _who(holder: dict[str, Any]) -> str:
    """A claim in words: the process, its host and its package."""
    said = f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if holder.get("package"):
        said += f", loading {holder['package']}"
    return said


def _parsed(text: str) -> dict[str, Any]:
    """A claim read back: the JSON a claimant wrote, or what is there in its place."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    return {"host": "?", "pid": "?", "package": text[:200]}


def _pid_space() -> str | None:
    """Which pid namespace this process's ids belong to (Linux), None where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: Any) -> bool:
    """Whether process `pid` of this host runs (an unreadable pid counts as running)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it runs, as another user
        return True
    return True


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
