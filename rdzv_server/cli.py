"""``rdzv-server``: the long-lived rendezvous daemon, and two commands for its operators.

``rdzv-server [--host H] [--port P]`` serves (agents and HTTP on one port; with ``--tls-cert``
and ``--tls-key``, TLS only, and the subcommands need ``--tls-ca``). The subcommands talk to a
running server over its HTTP API:

- ``rdzv-server status --endpoint H:P [--job ID] [--json]``: its jobs, or one job's members and
  recent history, as tables (or the API's JSON). A server with tokens shows a job's detail
  only for a token (``--token-file``: the job's; ``--read-token-file``: the read token).
- ``rdzv-server drain --endpoint H:P --job ID --node NODE [--reason TEXT]``: ask a node to leave
  its job cleanly.

The subcommands use only the standard library (urllib) and never import the server, so they
start fast.

Texts that came from peers (node and job ids, reasons, failure messages, history) are shown
with control characters escaped (``shown``): in the server's log (``SafeFormatter``) and in
the tables, so a newline or a terminal escape in a peer's text cannot forge a line or
rewrite the operator's terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.auth import TokenTable

    from .journal import StateLog

EXIT_OK = 0
EXIT_ERROR = 1  # could not serve; the endpoint is unreachable or did not answer as we expect
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3  # the server has no such job or node
DEFAULT_PORT = 29500
DEFAULT_ENDPOINT = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_MIN_FREE_MIB = 128
HISTORY_SHOWN = 15


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-server",
        description="Rendezvous server for node-agent jobs. With no command, it serves.",
        usage="%(prog)s [--host HOST] [--port PORT] [--log-level LEVEL]\n"
        "       %(prog)s {status,drain} [--endpoint HOST:PORT] ...",
        epilog=f"exit codes: {EXIT_OK} ok, {EXIT_ERROR} error or endpoint unreachable, "
        f"{EXIT_USAGE} usage, {EXIT_NOT_FOUND} no such job or node",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all IPv4 interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="require tokens: a file of TOKEN or 'JOB_ID TOKEN' lines (also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="FILE",
        help="speak only TLS (agents and HTTPS on the same port) with this PEM certificate chain",
    )
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's unencrypted PEM key")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="FILE",
        help="also require every peer (agents and HTTPS) to present a certificate signed by this CA",
    )
    p.add_argument(
        "--hello-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a connection that has not said hello by then (default 10)",
    )
    p.add_argument(
        "--auth-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a connection that said hello but has not joined its job by then (default 90)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="log every change of job state to DIR and restore it on start (default: memory only)",
    )
    p.add_argument(
        "--state-min-free-mib",
        type=int,
        default=DEFAULT_MIN_FREE_MIB,
        metavar="MIB",
        help="with --state-dir: below this much free space on its disk, refuse new nodes (running jobs "
        f"are still served) until space is freed (default {DEFAULT_MIN_FREE_MIB})",
    )
    p.add_argument(
        "--read-token-file",
        default=None,
        metavar="PATH",
        help="with tokens: a file holding a token that may read every job's detail over HTTP "
        "(and nothing else); a job's own token reads that job",
    )
    p.add_argument(
        "--http-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name this server is reached by over HTTP (repeatable); requests whose Host header names "
        "anything else but an IP, localhost or this machine's name are refused (DNS rebinding)",
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def client(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument(
            "--endpoint",
            default=DEFAULT_ENDPOINT,
            help=f"the server's host:port (default {DEFAULT_ENDPOINT})",
        )
        c.add_argument(
            "--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)"
        )
        # Own dests: the server's --tls-cert (above) is a different certificate.
        c.add_argument(
            "--tls-ca",
            dest="client_tls_ca",
            metavar="FILE",
            help="use HTTPS and verify the server against this CA (also RDZV_TLS_CA)",
        )
        c.add_argument(
            "--tls-cert",
            dest="client_tls_cert",
            metavar="FILE",
            help="client certificate, for a server with --tls-client-ca (also RDZV_TLS_CERT)",
        )
        c.add_argument("--tls-key", dest="client_tls_key", metavar="FILE", help="its key (also RDZV_TLS_KEY)")
        return c

    st = client("status", "show a running server's jobs, or one job in detail")
    st.add_argument("--job", help="show this job: its members, failures and recent history")
    st.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
    st.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="for a server with tokens: the job's token, to see its detail "
        "(also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    st.add_argument(
        "--read-token-file",
        default=None,
        metavar="PATH",
        help="the server's read token, which shows every job's detail (also RDZV_READ_TOKEN)",
    )
    dr = client("drain", "ask a node to leave its job cleanly (its workers get SIGTERM first)")
    dr.add_argument("--job", required=True, help="the job's rdzv id")
    dr.add_argument("--node", required=True, help="the node's id")
    dr.add_argument("--reason", default="", help="why; shown to the agent and kept in the job's history")
    dr.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="the job's token, for a server that requires one (also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    return p


# --- serve --------------------------------------------------------------------------------


def load_server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The listening port's TLS context from --tls-cert/--tls-key/--tls-client-ca; None: plain.

    No environment variables here: RDZV_TLS_CERT is an agent's client certificate.
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (the server's own certificate)")
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise ValueError(f"{given} needs {missing}: give both or neither")
    from protocol.tls import server_context

    return server_context(cert, key, client_ca)  # TLSConfigError (a ValueError) names the file


def client_tls(args: argparse.Namespace, environ: Mapping[str, str]) -> ssl.SSLContext | None:
    """status/drain: --tls-ca (else RDZV_TLS_CA) means HTTPS; a client certificate is optional."""
    ca = args.client_tls_ca or environ.get("RDZV_TLS_CA") or None
    cert = args.client_tls_cert or environ.get("RDZV_TLS_CERT") or None
    key = args.client_tls_key or environ.get("RDZV_TLS_KEY") or None
    if ca is None:
        if cert is not None or key is not None:
            raise CommandError("--tls-cert/--tls-key need --tls-ca (the CA of the server)", EXIT_USAGE)
        return None
    from protocol.tls import TLSConfigError, client_context

    try:
        return client_context(ca, cert, key)
    except TLSConfigError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None


def load_tokens(path: str | None, environ: Mapping[str, str]) -> TokenTable | None:
    """The server's tokens: --token-file, else RDZV_TOKEN_FILE, else RDZV_TOKEN; None: open."""
    from protocol.auth import TokenTable

    path = path or environ.get("RDZV_TOKEN_FILE") or None
    if path is None:
        token = environ.get("RDZV_TOKEN")
        return TokenTable(default=token) if token else None
    try:
        return TokenTable.parse(Path(path).read_text(), origin=f"token file {path!r}")
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from None


async def serve(
    host: str,
    port: int,
    *,
    tokens: TokenTable | None = None,
    ready: Any = None,
    hello_timeout: float | None = None,
    auth_timeout: float | None = None,
    tls: ssl.SSLContext | None = None,
    state_dir: str | None = None,
    state_min_free: int = DEFAULT_MIN_FREE_MIB << 20,
    read_token: str | None = None,
    http_hosts: Sequence[str] = (),
) -> int:
    import asyncio
    import signal

    from .http_app import Access
    from .listeners import kernel_accept_cap, listeners_for
    from .service import RendezvousService

    cap = kernel_accept_cap()
    service = RendezvousService(http=True, tokens=tokens, tls=tls, listeners=listeners_for(cap=cap))
    if hello_timeout is not None:
        service.hello_timeout = hello_timeout
    if auth_timeout is not None:
        service.auth_timeout = auth_timeout
    service.http_access = Access(read_token=read_token, hosts=tuple(http_hosts))
    state_log = open_state_dir(state_dir, tokens, state_min_free) if state_dir is not None else None
    if state_dir is not None and state_log is None:
        return EXIT_ERROR
    if state_log is not None:
        service.use_state_log(state_log)
    try:
        bound = await service.start(host, port)
    except OSError as exc:
        logging.getLogger("rdzv_server").error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        if state_log is not None:
            state_log.close()
        return EXIT_ERROR
    tune_gc()
    log = logging.getLogger("rdzv_server")
    where = "kept in memory only" if state_log is None else f"logged to {state_dir}"
    log.info("listening on %s:%d (agents and HTTP on the same port); state is %s", host, bound, where)
    if service.listeners > 1:
        log.info(
            "accept queue: %d sockets on the port, %d connections each (net.core.somaxconn)",
            service.listeners,
            cap,
        )
    if state_log is None:
        log.warning("no --state-dir: if this server dies, it rebuilds jobs from their agents at best")
    else:
        service.arm_timer()
    if tokens is None:
        log.warning("no token: any agent that reaches this port may join any job (see --token-file)")
    if tls is None:
        log.info("TLS off: agents' frames and HTTP travel in plain text (see --tls-cert)")
    else:
        clients = "required" if tls.verify_mode != ssl.CERT_NONE else "not asked for"
        log.info("TLS on: agents and HTTPS on this port, TLS only; client certificates %s", clients)
    stop = asyncio.Event()
    why: list[str] = []  # the signal's name, or why the state log failed

    def stop_for(reason: str) -> None:
        why.append(reason)
        stop.set()

    service.on_fatal = lambda text: stop_for("fatal: " + text)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_for, f"received {sig.name}")
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        if not why[0].startswith("fatal: "):
            await service.go_away(why[0])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await service.close()
        if state_log is not None:
            state_log.close()
    log.info("stopped")
    return EXIT_ERROR if why and why[0].startswith("fatal: ") else EXIT_OK


def open_state_dir(
    state_dir: str, tokens: TokenTable | None, min_free: int = DEFAULT_MIN_FREE_MIB << 20
) -> StateLog | None:
    """Restore the machine from --state-dir, saying what was found; None (logged) if unusable."""
    from .journal import StateLog, StateLogError
    from .state import Log

    log = logging.getLogger("rdzv_server")
    try:
        state_log, found, effects = StateLog.open(Path(state_dir), tokens=tokens, min_free=min_free)
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


# --- talking to a running server ----------------------------------------------------------


class CommandError(Exception):
    """What went wrong, for the operator, and the exit code that says so."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def base_url(endpoint: str, *, tls: bool = False) -> str:
    """``host:port``, ``[v6]:port``, ``host`` or ``http://host:port`` -> ``http://host:port``.

    With ``tls`` the scheme is https (and ``https://host:port`` is accepted).
    """
    scheme = "https" if tls else "http"
    text = endpoint.strip()
    if "://" not in text:
        text = f"{scheme}://{text}"
    parts = urllib.parse.urlsplit(text)
    if parts.scheme == "https" and not tls:
        raise CommandError(f"--endpoint {endpoint!r} is https: give --tls-ca (the server's CA)", EXIT_USAGE)
    if parts.scheme != scheme or not parts.hostname:
        raise CommandError(f"--endpoint must be host:port, got {endpoint!r}", EXIT_USAGE)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise CommandError(f"--endpoint has a bad port: {endpoint!r}", EXIT_USAGE) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}:{port}"


def call(
    endpoint: str,
    method: str,
    path: str,
    timeout: float,
    body: dict[str, Any] | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, Any]:
    """One request; (status, decoded JSON). Unreachable or not our API -> CommandError."""
    url = base_url(endpoint, tls=tls is not None) + path
    data = None if body is None else json.dumps(body).encode()
    # X-Rdzv-Request: what a server without tokens wants of a state-changing request (http_app.py).
    headers = {"Accept": "application/json", "X-Rdzv-Request": "1"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=tls) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except urllib.error.URLError as exc:
        reason = _tls_reason(exc.reason, tls) or getattr(exc.reason, "strerror", None) or exc.reason
        raise CommandError(f"cannot reach the rendezvous server at {url}: {reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a peer that is not HTTP
        reason = _tls_reason(exc, tls) or exc or type(exc).__name__
        raise CommandError(f"cannot reach the rendezvous server at {url}: {reason}") from None
    try:
        return status, json.loads(raw)
    except ValueError:
        raise CommandError(
            f"{url} answered HTTP {status} with something that is not the status API's JSON; "
            "is this a rdzv-server?"
        ) from None


def _tls_reason(exc: object, tls: ssl.SSLContext | None) -> str | None:
    """What a failed request says about TLS on one side only; None: nothing TLS about it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason
        return f"{why} (check --tls-ca; the certificate must name the --endpoint host)"
    if isinstance(exc, ssl.SSLError | ConnectionError):
        # The other side hung up without an HTTP answer: the usual sign of TLS on one end only.
        text = str(getattr(exc, "reason", None) or exc or type(exc).__name__)
        if tls is None:
            return f"{text} (if the server uses TLS, give --tls-ca)"
        return f"{text} (does the server use TLS, and does it want a client certificate?)"
    return None


def _message(doc: Any, fallback: str) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return doc["message"]
    return fallback


def read_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """status: the read token (--read-token-file, RDZV_READ_TOKEN), else the job's token."""
    if args.read_token_file:
        try:
            return load_read_token(args.read_token_file)
        except ValueError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
    if environ.get("RDZV_READ_TOKEN"):
        return environ["RDZV_READ_TOKEN"].strip()
    if args.job is None:
        return None  # the summary is open
    try:
        tokens = load_tokens(args.token_file, environ)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    return None if tokens is None else tokens.for_job(args.job)


def load_read_token(path: str) -> str:
    """--read-token-file: one token, alone on its line (comments and blank lines aside)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the read-token file {path!r}: {exc.strerror or exc}") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise ValueError(f"read-token file {path!r}: want one token on one line")
    return lines[0]


def cmd_status(args: argparse.Namespace) -> int:
    quoted = urllib.parse.quote(args.job, safe="") if args.job is not None else None
    path = "/v1/jobs" if quoted is None else f"/v1/jobs/{quoted}"
    token = read_token(args, os.environ)
    status, doc = call(
        args.endpoint, "GET", path, args.timeout, token=token, tls=client_tls(args, os.environ)
    )
    if status in (401, 403):
        hint = "" if token else " (see --token-file or --read-token-file)"
        raise CommandError(f"{args.endpoint} answered HTTP {status}: {shown(_message(doc, ''))}{hint}")
    if status == 404:
        raise CommandError(
            f"{shown(_message(doc, f'no job {args.job!r}'))} on {args.endpoint}", EXIT_NOT_FOUND
        )
    if status != 200:
        raise CommandError(f"{args.endpoint} answered HTTP {status}: {shown(_message(doc, ''))}")
    if args.json:
        print(json.dumps(doc, indent=2))
    elif args.job is None:
        print(format_jobs(doc))
    else:
        print(format_job(doc))
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    job, node = (urllib.parse.quote(x, safe="") for x in (args.job, args.node))
    body = {"reason": args.reason} if args.reason else None
    try:
        tokens = load_tokens(args.token_file, os.environ)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    token = None if tokens is None else tokens.for_job(args.job)
    path = f"/v1/jobs/{job}/nodes/{node}/drain"
    status, doc = call(args.endpoint, "POST", path, args.timeout, body, token, client_tls(args, os.environ))
    if status in (401, 403):
        no_cert = isinstance(doc, dict) and doc.get("error") == "client_certificate_required"
        hint = "" if no_cert else " (see --token-file)"  # the message already names the TLS flags
        raise CommandError(f"cannot drain: {shown(_message(doc, 'not allowed'))}{hint}")
    if status == 404:
        raise CommandError(f"cannot drain: {shown(_message(doc, 'not found'))}", EXIT_NOT_FOUND)
    if status != 202:
        raise CommandError(f"cannot drain: the server answered HTTP {status}: {shown(_message(doc, ''))}")
    why = f" ({args.reason})" if args.reason else ""
    print(
        f"asked node {shown(args.node)} of job {shown(args.job)} to drain{shown(why)}: "
        "its agent stops its workers and leaves the job"
    )
    return EXIT_OK


# --- formatting ---------------------------------------------------------------------------


# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: object) -> str:
    """A peer's text, safe to print on one line: control characters become visible escapes."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], str(text))


class SafeFormatter(logging.Formatter):
    """The server's log lines, with control characters in the message escaped: a node id or a
    reason holding a newline or a terminal escape cannot forge a line. Our own tracebacks
    (``exc_info``) keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = shown(record.message)
        return super().formatMessage(record)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *([("" if c is None else shown(c)) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _clock(t: float | None, with_date: bool = False) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S", time.localtime(t))


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _range(settings: dict[str, Any]) -> str:
    lo, hi = settings["min_nodes"], settings["max_nodes"]
    return str(lo) if lo == hi else f"{lo}:{hi}"


def _nodes(job: dict[str, Any]) -> str:
    text = f"{job['nodes']}/{_range(job['settings'])}"
    return text + (f" +{job['spares']} spare" if job["spares"] else "")


def format_jobs(doc: dict[str, Any]) -> str:
    srv = doc["server"]
    head = (
        f"{srv['software']}: {_n(srv['active_jobs'], 'active job')}, {_n(srv['agents'], 'agent')}, "
        f"{_n(srv['connections'], 'connection')}"
    )
    if not doc["jobs"]:
        return head + "\nno jobs"
    rows = []
    for j in doc["jobs"]:
        phase = j["phase"] + (" (forgotten)" if j["forgotten"] else "")
        rows.append(
            (
                j["id"],
                phase,
                _nodes(j),
                j["round"],
                f"{j['restart_count']}/{j['max_restarts']}",
                _age(j["age"]),
            )
        )
    out = head + "\n\n" + table(("JOB", "PHASE", "NODES", "ROUND", "RESTARTS", "AGE"), rows)
    if doc.get("truncated"):
        out += (
            f"\n({len(doc['jobs'])} of {doc['jobs_total']} jobs shown: the active ones first, newest first)"
        )
    return out


def format_job(job: dict[str, Any]) -> str:
    s = job["settings"]
    lines = [
        f"job {shown(job['id'])}: {job['phase']}"
        + (" (forgotten: every node has left)" if job["forgotten"] else ""),
        f"  round {job['round']} ({job['rounds_completed']} completed), "
        f"restarts {job['restart_count']}/{job['max_restarts']}, nodes {_nodes(job)}"
        + (f", world size {job['world_size']}" if job["world_size"] is not None else "")
        + (f", master {shown(job['master']['addr'])}:{job['master']['port']}" if job["master"] else ""),
        f"  entrypoint {shown(s['entrypoint'])}; "
        f"created {_clock(job['created_at'], True)} ({_age(job['age'])} ago)",
    ]
    if job["outcome"]:
        lines.append(f"  outcome: {shown(job['outcome'])}")
    rows = []
    for m in job["members"]:
        departed = m["role"] == "departed"
        state = m["state"].upper() if m["state"] in ("lost", "excluded") else m["state"]
        if m["role"] == "spare":
            state += " (spare)"
        ranks = "-"
        if m["rank_offset"] is not None and m["nproc"]:
            first, last = m["rank_offset"], m["rank_offset"] + m["nproc"] - 1
            ranks = str(first) if first == last else f"{first}-{last}"
        beat = "-" if m["last_heartbeat_ago"] is None else _age(m["last_heartbeat_ago"]) + " ago"
        rows.append(
            (
                m["node_id"],
                state,
                m["addr"] or "-",
                "-" if m["nproc"] is None else m["nproc"],
                "-" if m["group_rank"] is None else m["group_rank"],
                ranks,
                beat,
                m["failures"],
                m["reason"] if departed else "",
            )
        )
    lines.append("")
    if rows:
        headers = ("NODE", "STATE", "ADDRESS", "NPROC", "RANK", "RANKS", "HEARTBEAT", "FAILURES", "NOTE")
        lines.append(table(headers, rows))
    else:
        lines.append("no nodes")
    if job["failures"]:
        lines += ["", "failures (the root cause of each restart):"]
        for f in job["failures"]:
            where = "" if f["round"] is None else f"round {f['round']}: "
            text = f["description"] + (f": {f['message']}" if f["message"] else "")
            lines.append(f"  {where}{shown(text)}")
    if job["excluded"]:
        lines += ["", "excluded:"] + [
            f"  {shown(x['node_id'])}: {shown(x['reason'])}" for x in job["excluded"]
        ]
    recent = job["history"][-HISTORY_SHOWN:]
    if recent:
        part = f"last {len(recent)} of {len(job['history'])}" if len(job["history"]) > len(recent) else ""
        lines += ["", f"history{' (' + part + ')' if part else ''}:"]
        width = max(len(e["kind"]) for e in recent)
        lines += [
            f"  {_clock(e['time'])}  {shown(e['kind']).ljust(width)}  {shown(e['text'])}" for e in recent
        ]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is not None:
        try:
            return {"status": cmd_status, "drain": cmd_drain}[args.command](args)
        except CommandError as exc:
            print(f"rdzv-server {args.command}: error: {exc}", file=sys.stderr)
            return exc.code
    if not 0 <= args.port <= 65535:
        print(f"rdzv-server: error: --port must be 0..65535, got {args.port}", file=sys.stderr)
        return EXIT_USAGE
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    try:
        tokens = load_tokens(args.token_file, os.environ)
        read = load_read_token(args.read_token_file) if args.read_token_file else None
    except ValueError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if read is not None and tokens is None:
        print(
            "rdzv-server: error: --read-token-file needs tokens (--token-file): without them reads are open",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.state_min_free_mib < 0:
        print(
            f"rdzv-server: error: --state-min-free-mib must be >= 0, got {args.state_min_free_mib}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    for flag, value in (("--hello-timeout", args.hello_timeout), ("--auth-timeout", args.auth_timeout)):
        if value is not None and not 0 < value <= 3600:
            print(f"rdzv-server: error: {flag} must be in (0, 3600] seconds, got {value}", file=sys.stderr)
            return EXIT_USAGE
    try:
        tls = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    except ValueError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from .loop import run_loop  # uvloop where installed

    return run_loop(
        serve(
            args.host,
            args.port,
            tokens=tokens,
            tls=tls,
            state_dir=args.state_dir,
            state_min_free=args.state_min_free_mib << 20,
            hello_timeout=args.hello_timeout,
            auth_timeout=args.auth_timeout,
            read_token=read,
            http_hosts=tuple(args.http_host),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
