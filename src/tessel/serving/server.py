"""`tessel serve` on the head: a generation package loaded on this host's devices (the serving
`Engine`) behind its HTTP routes (`tessel.serving.http`), run until SIGTERM or a worker's death.

The HTTP server (uvicorn, one process, one event loop) runs on a thread of its own from before
the load, so /health answers 503 while the model loads; the main thread loads the engine, then
watches: SIGTERM (or Ctrl-C) stops admitting, lets the open requests finish up to the drain
timeout, closes the engine and exits 0; a worker's death (the engine turns unhealthy on its
own) has the engine end every open request with an error, and the process exits 1 within
seconds, its workers stopped, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUED_REQUESTS = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_DRAIN_TIMEOUT = 30.0

# how long open streams have to send their error events after a worker's death, and the HTTP
# server to close its connections at the end, before the process goes on regardless
_ERRORS_SENT_S = 2.0
_HTTP_CLOSED_S = 3.0


class _Terminated(BaseException):
    """SIGTERM while the model loads."""


@dataclass(frozen=True)
class HttpSettings:
    """How the head serves: where it listens and what it takes (the flags of `tessel serve`)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    tokenizer: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    queue_timeout: float | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT


# tessel serve's flags that only the head (the HTTP server) takes, by their dest
HTTP_FLAGS = tuple(f.name for f in fields(HttpSettings))


def serve_command(args: argparse.Namespace) -> int:
    """`tessel serve`: the head serves the package over HTTP, without --node-id, or with the
    head's id and an HTTP flag. A node's id alone (the head's too, as before) runs that node's
    workers until the head's session stops them; a node not the head refuses the HTTP flags."""
    from tessel.config.cluster import cluster_from_dict
    from tessel.package import Package
    from tessel.runtime.cli_run import serve_command as serve_node
    from tessel.runtime.session import finalize, initialize

    given = {k: getattr(args, k) for k in HTTP_FLAGS if getattr(args, k, None) is not None}
    manifest = Package.open(args.model).manifest
    cluster = cluster_from_dict(manifest.cluster, f"{args.model} (cluster)", manifest.soc_version)
    head = cluster.head.node_id
    if args.node_id is not None and not (args.node_id == head and given):
        if given:
            raise ConfigError(
                "--" + next(iter(given)).replace("_", "-"),
                None,
                f"is the head's: node {args.node_id} only starts its workers, and node {head} "
                "(the head) serves HTTP; give the HTTP flags there",
            )
        return serve_node(args)
    options = {} if args.node_id is None else {"tessel.node_id": args.node_id}
    initialize()
    try:
        return serve_http(args.model, HttpSettings(**given), options)
    finally:
        finalize()


def _need_serve_extra() -> None:
    """The web dependencies are the `serve` extra's: say so where they are missing."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "tessel serve",
            None,
            f"needs the serve extra ({exc.name} is not installed): pip install 'tessel[serve]'",
        ) from None


def check_port(package: Any, port: int) -> None:
    """The HTTP port must not be the cluster's own: the head's store listens at its node's
    port where the model spans several nodes (its cluster config, in the package)."""
    from tessel.config.cluster import cluster_from_dict

    manifest = package.manifest
    cluster = cluster_from_dict(manifest.cluster, f"{package.path} (cluster)", manifest.soc_version)
    if len(cluster.nodes) < 2:
        return  # one node: its workers meet at a free port of their own choosing
    for node in cluster.nodes:
        if port == node.port:
            raise ConfigError(
                "--port",
                None,
                f"is {port}, the cluster's own port (node {node.node_id}'s port in the "
                f"model's cluster config, where the head's store listens for the other "
                "nodes); give the HTTP server another",
            )


def _listening(host: str, port: int) -> socket.socket:
    """A socket bound at `host:port` (port 0: a free one), or `ConfigError` naming them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(
            "--host", None, f"{host!r} is not an address to listen at: {exc}"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            "--port", None, f"cannot listen at {host}:{port}: {exc.strerror or exc}"
        ) from None
    sock.set_inheritable(False)
    return sock


def _shown(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_http(
    package_path: str | Path, settings: HttpSettings, options: dict[str, Any] | None = None
) -> int:
    """Serve the package over HTTP until SIGTERM (0) or a worker's death (1); `options` are the
    Session's. Prints one line with the address once it serves."""
    _need_serve_extra()
    import uvicorn

    from tessel.package import Package
    from tessel.serving.engine import Engine
    from tessel.serving.http import app_for
    from tessel.serving.metrics import Metrics

    path = Path(package_path)
    package = Package.open(path)
    check_port(package, settings.port)
    tokenizer = None
    if settings.tokenizer is not None:
        from tessel.runtime.cli_run import _tokenizer

        tokenizer = _tokenizer(settings.tokenizer)
    name = settings.served_model_name or path.stem
    sock = _listening(settings.host, settings.port)
    port = sock.getsockname()[1]
    metrics = Metrics()
    app = app_for(
        None,
        tokenizer=tokenizer,
        served_model_name=name,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        system_fingerprint=f"fp_{package.digest[:12]}",
    )
    config = uvicorn.Config(
        app,
        log_config=None,  # tessel's logging, as the command configured it
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(_HTTP_CLOSED_S),
    )
    server = uvicorn.Server(config)
    # off the main thread, uvicorn leaves the signals to this one
    http = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="tessel-http", daemon=True
    )
    stop = threading.Event()

    def terminated(*_: Any) -> None:
        raise _Terminated

    # while the model loads, SIGTERM ends the load (Ctrl-C too, as KeyboardInterrupt); once it
    # serves, either one drains
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, terminated)
    http.start()
    engine = None
    try:
        engine = Engine(
            path,
            max_queued_requests=settings.max_queued_requests,
            queue_timeout=settings.queue_timeout,
            options=options,
            listener=metrics,
        )
        metrics.slots_total.set(engine.limits.slots)
        app.state.engine = engine
        limits = engine.limits
        print(
            f"tessel serve: {name} at {_shown(settings.host, port)} ({limits.slots} slots; "
            f"prompts of up to {limits.longest_prompt} tokens, {limits.max_seq_len} with "
            "the new ones)",
            flush=True,
        )
        for s in previous:
            signal.signal(s, lambda *_: stop.set())
        return _watch(engine, http, stop, settings.drain_timeout)
    except _Terminated:
        print("tessel serve: terminated while loading", file=sys.stderr)
        return 0
    finally:
        if engine is not None:
            engine.close()
        server.should_exit = True
        http.join(_HTTP_CLOSED_S + 2)
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(engine: Any, http: threading.Thread, stop: threading.Event, drain_timeout: float) -> int:
    """Wait for SIGTERM (drain: 0), a worker's death (1) or the HTTP server's end (1)."""
    while not stop.is_set():
        if not engine.healthy:  # unhealthy on its own: a worker stopped
            print("tessel serve: a worker stopped; ending every request", file=sys.stderr)
            _wait_open(engine, _ERRORS_SENT_S)
            return 1
        if not http.is_alive():
            print("tessel serve: the HTTP server stopped", file=sys.stderr)
            return 1
        stop.wait(0.1)
    engine.stop_admitting()
    print(
        f"tessel serve: draining {engine.running + engine.waiting} open requests "
        f"(up to {drain_timeout:g} s)",
        file=sys.stderr,
        flush=True,
    )
    if not _wait_open(engine, drain_timeout):
        left = engine.running + engine.waiting
        print(f"tessel serve: ending {left} requests still open", file=sys.stderr)
    return 0


def _wait_open(engine: Any, timeout: float) -> bool:
    """Wait up to `timeout` s for the engine's open requests to end; True if they did."""
    end = time.monotonic() + timeout
    while engine.running + engine.waiting > 0 and time.monotonic() < end:
        time.sleep(0.02)
    return engine.running + engine.waiting == 0
