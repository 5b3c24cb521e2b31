"""Serving: ``rdzv-server``'s life from a ``ServerConfig`` to its exit code.

Open the state dir (restoring the jobs it holds), listen, say what this server is and is not
protected by, serve until SIGTERM/SIGINT, then drain: no more connections or joins, flush the
state log, ``GoingAway`` to every agent (they keep their workers and come back to a restarted
server), exit 0. A state log that cannot be written stops the server at once with exit 1 and
no ``GoingAway``: its agents must not be told that what they did next was recorded. Not for
want of room (ENOSPC, EDQUOT: another process filled the disk): the server then goes
read-only and waits for room, serving its running jobs (``service.py``, "A full disk").

Also the daemon's logging (peers' texts escaped) and its garbage-collector tuning.
"""

from __future__ import annotations

import enum
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .parser import DEFAULT_MIN_FREE_MIB, EXIT_ERROR, EXIT_OK
from .tables import shown

if TYPE_CHECKING:
    import asyncio

    from protocol.auth import TokenTable

    from .config import ServerConfig
    from .journal import StateLog

log = logging.getLogger("rdzv_server")


class Stop(enum.Enum):
    """Why serving ends, which decides how."""

    SIGNAL = "signal"  # the operator's SIGTERM/SIGINT: drain, GoingAway, exit 0
    FATAL = "fatal"  # the state log failed: close at once, exit 1


class SafeFormatter(logging.Formatter):
    """The server's log lines, with control characters in the message escaped: a node id or a
    reason holding a newline or a terminal escape cannot forge a line. Our own tracebacks
    (``exc_info``) keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = shown(record.message)
        return super().formatMessage(record)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


async def serve(config: ServerConfig, *, ready: asyncio.Event | None = None) -> int:
    """Serve until a signal (exit 0) or a failed state log (exit 1); ``ready`` is set once listening."""
    import asyncio
    import signal
    import ssl

    from .admission import kernel_accept_cap, listeners_for
    from .http_app import Access
    from .service import RendezvousService

    stop = asyncio.Event()
    why: list[tuple[Stop, str]] = []  # the first reason wins

    def stop_for(kind: Stop, text: str) -> None:
        why.append((kind, text))
        stop.set()

    state_log = None
    if config.state_dir is not None:
        state_log = open_state_dir(
            config.state_dir,
            config.tokens,
            config.state_min_free,
            hello_timeout=config.hello_timeout,
            auth_timeout=config.auth_timeout,
        )
        if state_log is None:
            return EXIT_ERROR
    cap = kernel_accept_cap()
    service = RendezvousService(
        http=True,
        tokens=config.tokens,
        tls=config.tls,
        listeners=listeners_for(cap=cap),
        hello_timeout=config.hello_timeout,
        auth_timeout=config.auth_timeout,
        http_access=Access(
            read_token=config.read_token, hosts=config.http_hosts, metrics_jobs=config.metrics_jobs
        ),
        state_log=state_log,  # serve the machine it restored, and log every change to it
        on_fatal=lambda text: stop_for(Stop.FATAL, text),
    )
    host, port = config.host, config.port
    try:
        bound = await service.start(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        if state_log is not None:
            state_log.close()
        return EXIT_ERROR
    tune_gc()
    where = "kept in memory only" if state_log is None else f"logged to {config.state_dir}"
    log.info("listening on %s:%d (agents and HTTP on the same port); state is %s", host, bound, where)
    if service.gate.listeners > 1:
        log.info(
            "accept queue: %d sockets on the port, %d connections each (net.core.somaxconn)",
            service.gate.listeners,
            cap,
        )
    if state_log is None:
        log.warning("no --state-dir: if this server dies, it rebuilds jobs from their agents at best")
    else:
        service.arm_timer()
    if config.tokens is None:
        log.warning("no token: any agent that reaches this port may join any job (see --token-file)")
    if config.tls is None:
        log.info("TLS off: agents' frames and HTTP travel in plain text (see --tls-cert)")
    else:
        clients = "required" if config.tls.verify_mode != ssl.CERT_NONE else "not asked for"
        log.info("TLS on: agents and HTTPS on this port, TLS only; client certificates %s", clients)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_for, Stop.SIGNAL, f"received {sig.name}")
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        kind, text = why[0]
        if kind is Stop.SIGNAL:
            await service.go_away(text)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await service.close()
        if state_log is not None:
            state_log.close()
    log.info("stopped")
    return EXIT_ERROR if why and why[0][0] is Stop.FATAL else EXIT_OK


def open_state_dir(
    state_dir: str,
    tokens: TokenTable | None,
    min_free: int = DEFAULT_MIN_FREE_MIB << 20,
    *,
    hello_timeout: float,
    auth_timeout: float,
) -> StateLog | None:
    """Restore the machine from --state-dir, saying what was found; None (logged) if unusable.
    It is built with the server's handshake timeouts (the service is given the same ones)."""
    from .journal import StateLog, StateLogError
    from .machine.state import Log

    try:
        state_log, found, effects = StateLog.open(
            Path(state_dir),
            tokens=tokens,
            min_free=min_free,
            hello_timeout=hello_timeout,
            auth_timeout=auth_timeout,
        )
    except (StateLogError, OSError) as exc:
        log.error("cannot use --state-dir %s: %s", state_dir, exc)
        return None
    log.info(
        "state dir %s: snapshot at record %d, %d record(s) replayed, %d active job(s)",
        state_dir,
        found.snapshot_seq,
        found.replayed,
        found.jobs,
    )
    for eff in effects:
        if isinstance(eff, Log):
            log.info("%s", eff.text)
    return state_log


def tune_gc() -> None:
    """Collect garbage the way a daemon holding many connections needs.

    With 10,000 agents the collector tracks some 400,000 objects; at Python's default
    thresholds one benchmark trial (two join storms, heartbeats, a re-rendezvous) ran 4 full
    collections of 50-120 ms and spent 0.5 s in the collector, while it found 1,500 objects of
    cyclic garbage in all. So: the young generation is collected every 20,000 allocations (not
    700; the same objects are examined, fewer survive into the middle one), which makes full
    collections rare, and what start-up made (modules, the HTTP app) is left out of them.
    """
    import gc

    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
