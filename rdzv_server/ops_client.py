"""``rdzv-server status`` and ``drain``: a small HTTP client of a running server's API.

- ``status --endpoint H:P [--job ID] [--json]``: its jobs, or one job's members and recent
  history, as tables (``tables.py``) or the API's JSON. A server with tokens shows a job's
  detail only for a token (``--token-file``: the job's; ``--read-token-file``: the read token).
- ``drain --endpoint H:P --job ID --node NODE [--reason TEXT]``: ask a node to leave its job
  cleanly.

Only the standard library (urllib), and never the server's modules, so that they start fast.
Each failure is a ``CommandError`` carrying the message and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from edge.tls import TLSConfigError, client_context, client_files
from edge.tokens import TokenFileError, load_read_token, load_tokens

from .parser import DEFAULT_PORT, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from .tables import format_job, format_jobs, shown


def run_command(args: argparse.Namespace) -> int:
    """``status`` or ``drain``; a failure is printed as one line and its exit code returned."""
    try:
        return {"status": cmd_status, "drain": cmd_drain}[args.command](args)
    except CommandError as exc:
        print(f"rdzv-server {args.command}: error: {exc}", file=sys.stderr)
        return exc.code


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
    except TimeoutError:
        # Connected, then silence: a server too busy to answer in time, or a node-agent that is a
        # standby for a rendezvous it does not host (yet): its reserved port accepts, nothing
        # answers until its turn comes (issue 45).
        raise CommandError(
            f"the rendezvous server at {url} took the connection but did not answer within "
            f"{timeout:g} s: a busy server (try --timeout), or a node-agent's standby port, which "
            "answers only once that agent hosts the rendezvous: ask the agent that hosts it (its "
            "log names the port: 'this node hosts the rendezvous now, on port P')"
        ) from None
    except (OSError, ValueError) as exc:  # resets, a peer that is not HTTP
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
        except TokenFileError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
    if environ.get("RDZV_READ_TOKEN"):
        return environ["RDZV_READ_TOKEN"].strip()
    if args.job is None:
        return None  # the summary is open
    try:
        tokens = load_tokens(args.token_file, environ)
    except TokenFileError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    return None if tokens is None else tokens.for_job(args.job)


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
    except TokenFileError as exc:
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


def client_tls(args: argparse.Namespace, environ: Mapping[str, str]) -> ssl.SSLContext | None:
    """--tls-ca (else RDZV_TLS_CA) means HTTPS; a client certificate is optional (as an agent's)."""
    flags = {
        "ca": (args.client_tls_ca, "--tls-ca"),
        "cert": (args.client_tls_cert, "--tls-cert"),
        "key": (args.client_tls_key, "--tls-key"),
    }
    try:
        files = client_files(flags, environ)
        return None if files is None else client_context(files.ca, files.cert, files.key)
    except TLSConfigError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
