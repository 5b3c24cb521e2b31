"""``rdzv-server``: the long-lived rendezvous daemon, and two commands for its operators.

``rdzv-server [--host H] [--port P]`` serves (agents and HTTP on one port). The subcommands
talk to a running server over its HTTP API:

- ``rdzv-server status --endpoint H:P [--job ID] [--json]``: its jobs, or one job's members and
  recent history, as tables (or the API's JSON).
- ``rdzv-server drain --endpoint H:P --job ID --node NODE [--reason TEXT]``: ask a node to leave
  its job cleanly.

The subcommands use only the standard library (urllib) and never import the server, so they
start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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

EXIT_OK = 0
EXIT_ERROR = 1  # could not serve; the endpoint is unreachable or did not answer as we expect
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3  # the server has no such job or node
DEFAULT_PORT = 29500
DEFAULT_ENDPOINT = f"127.0.0.1:{DEFAULT_PORT}"
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
        return c

    st = client("status", "show a running server's jobs, or one job in detail")
    st.add_argument("--job", help="show this job: its members, failures and recent history")
    st.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
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


async def serve(host: str, port: int, *, tokens: TokenTable | None = None, ready: Any = None) -> int:
    import asyncio
    import signal

    from .service import RendezvousService

    service = RendezvousService(http=True, tokens=tokens)
    try:
        bound = await service.start(host, port)
    except OSError as exc:
        logging.getLogger("rdzv_server").error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return EXIT_ERROR
    log = logging.getLogger("rdzv_server")
    log.info(
        "listening on %s:%d (agents and HTTP on the same port); state is kept in memory only", host, bound
    )
    if tokens is None:
        log.warning("no token: any agent that reaches this port may join any job (see --token-file)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await service.close()
    log.info("stopped")
    return EXIT_OK


# --- talking to a running server ----------------------------------------------------------


class CommandError(Exception):
    """What went wrong, for the operator, and the exit code that says so."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def base_url(endpoint: str) -> str:
    """``host:port``, ``[v6]:port``, ``host`` or ``http://host:port`` -> ``http://host:port``."""
    text = endpoint.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme != "http" or not parts.hostname:
        raise CommandError(f"--endpoint must be host:port, got {endpoint!r}", EXIT_USAGE)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise CommandError(f"--endpoint has a bad port: {endpoint!r}", EXIT_USAGE) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


def call(
    endpoint: str,
    method: str,
    path: str,
    timeout: float,
    body: dict[str, Any] | None = None,
    token: str | None = None,
) -> tuple[int, Any]:
    """One request; (status, decoded JSON). Unreachable or not our API -> CommandError."""
    url = base_url(endpoint) + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Accept": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or exc.reason
        raise CommandError(f"cannot reach the rendezvous server at {url}: {reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a peer that is not HTTP
        raise CommandError(
            f"cannot reach the rendezvous server at {url}: {exc or type(exc).__name__}"
        ) from None
    try:
        return status, json.loads(raw)
    except ValueError:
        raise CommandError(
            f"{url} answered HTTP {status} with something that is not the status API's JSON; "
            "is this a rdzv-server?"
        ) from None


def _message(doc: Any, fallback: str) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return doc["message"]
    return fallback


def cmd_status(args: argparse.Namespace) -> int:
    quoted = urllib.parse.quote(args.job, safe="") if args.job is not None else None
    path = "/v1/jobs" if quoted is None else f"/v1/jobs/{quoted}"
    status, doc = call(args.endpoint, "GET", path, args.timeout)
    if status == 404:
        raise CommandError(f"{_message(doc, f'no job {args.job!r}')} on {args.endpoint}", EXIT_NOT_FOUND)
    if status != 200:
        raise CommandError(f"{args.endpoint} answered HTTP {status}: {_message(doc, '')}")
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
    status, doc = call(args.endpoint, "POST", path, args.timeout, body, token)
    if status in (401, 403):
        raise CommandError(f"cannot drain: {_message(doc, 'not allowed')} (see --token-file)")
    if status == 404:
        raise CommandError(f"cannot drain: {_message(doc, 'not found')}", EXIT_NOT_FOUND)
    if status != 202:
        raise CommandError(f"cannot drain: the server answered HTTP {status}: {_message(doc, '')}")
    why = f" ({args.reason})" if args.reason else ""
    print(
        f"asked node {args.node} of job {args.job} to drain{why}: "
        "its agent stops its workers and leaves the job"
    )
    return EXIT_OK


# --- formatting ---------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *([("" if c is None else str(c)) for c in r] for r in rows)]
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
                j["outcome"],
            )
        )
    return head + "\n\n" + table(("JOB", "PHASE", "NODES", "ROUND", "RESTARTS", "AGE", "OUTCOME"), rows)


def format_job(job: dict[str, Any]) -> str:
    s = job["settings"]
    lines = [
        f"job {job['id']}: {job['phase']}"
        + (" (forgotten: every node has left)" if job["forgotten"] else ""),
        f"  round {job['round']} ({job['rounds_completed']} completed), "
        f"restarts {job['restart_count']}/{job['max_restarts']}, nodes {_nodes(job)}"
        + (f", world size {job['world_size']}" if job["world_size"] is not None else "")
        + (f", master {job['master']['addr']}:{job['master']['port']}" if job["master"] else ""),
        f"  entrypoint {s['entrypoint']}; created {_clock(job['created_at'], True)} ({_age(job['age'])} ago)",
    ]
    if job["outcome"]:
        lines.append(f"  outcome: {job['outcome']}")
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
            lines.append(f"  {where}{f['description']}" + (f": {f['message']}" if f["message"] else ""))
    if job["excluded"]:
        lines += ["", "excluded:"] + [f"  {x['node_id']}: {x['reason']}" for x in job["excluded"]]
    recent = job["history"][-HISTORY_SHOWN:]
    if recent:
        shown = f"last {len(recent)} of {len(job['history'])}" if len(job["history"]) > len(recent) else ""
        lines += ["", f"history{' (' + shown + ')' if shown else ''}:"]
        width = max(len(e["kind"]) for e in recent)
        lines += [f"  {_clock(e['time'])}  {e['kind'].ljust(width)}  {e['text']}" for e in recent]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------


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
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        tokens = load_tokens(args.token_file, os.environ)
    except ValueError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from .loop import run_loop  # uvloop where installed

    return run_loop(serve(args.host, args.port, tokens=tokens))


if __name__ == "__main__":
    sys.exit(main())
