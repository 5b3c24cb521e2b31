"""The HTTP side of the server's port: health, status API, metrics, dashboard, drain.

Connections arrive already accepted (``service.py`` routes them by their first bytes), so we
use aiohttp's server protocol without a site of its own.

| route | what |
|---|---|
| ``GET /`` | the dashboard: one static page that polls ``/v1/jobs`` and the jobs it shows |
| ``GET /healthz`` | liveness, with job and connection counts, and the state log's alarm |
| ``GET /v1/jobs`` | a bounded summary of the jobs: numbers only, no node ids or addresses |
| ``GET /v1/jobs/{id}`` | one job in detail (``status.py``; ``docs/openapi.yaml``) |
| ``POST /v1/jobs/{id}/nodes/{node}/drain`` | ask a node to leave cleanly (202; 404 names what is missing) |
| ``GET /metrics`` | Prometheus (``metrics.py``) |

Handlers only read the machine and format it; the one write, drain, goes through the service
like any other event. Errors under ``/v1/`` are JSON: ``{"error": code, "message": text}``.

A full state disk (the state log read-only: ``journal.py``, "A full disk") shows as etcd's
alarm does: ``/healthz`` says ``"status": "read_only"`` with ``"alarms": ["NOSPACE"]`` and why,
since when, and what waits. Still with 200: the process is alive and serves its running jobs
from memory, and a probe that restarted it (or took it out of its Service) for that would end
every job's rendezvous while the disk stays full. ``/metrics`` has ``rdzv_state_log_read_only``,
and a drain is refused with 503 ``read_only`` (it would change state).

Who may do what (``Access``):

- Host. Every request but ``/healthz`` and ``/metrics`` (counts only; probes and scrapers
  use IPs and service names) must name this server in its ``Host`` header: an IP literal,
  ``localhost``, the machine's host name or FQDN, or a name given with ``--http-host``.
  Anything else is 421: a web page that rebinds its own DNS name to this server's address
  (DNS rebinding) cannot read or drain through the visitor's browser.
- Drain (every state-changing request). With tokens: ``Authorization: Bearer TOKEN``
  holding the job's token (401 without one, 403 with a wrong one). Without tokens: the
  request must be one a web page cannot send cross-site without the server's consent (a
  CORS preflight, which this server never grants): ``Content-Type: application/json`` or an
  ``X-Rdzv-Request`` header; a "simple" form POST is refused (403).
- Reads. ``/``, ``/healthz``, ``/metrics`` and the ``/v1/jobs`` summary are open. With
  tokens, a job's detail (members, addresses, the master's address and port, failures with
  workers' stderr tails, history) needs a bearer token: the read token
  (``--read-token-file``) or that job's own token.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from protocol import Drain, ProtocolError
from protocol.records import record

from . import metrics, status
from .status import to_json

if TYPE_CHECKING:
    from protocol.auth import TokenTable

    from .journal import LogHealth
    from .machine.state import Rendezvous


class Served(Protocol):
    """What the HTTP side reads and asks of the server (``service.RendezvousService`` is one):
    the machine and its clock, the tokens, the access settings, and the drain it may ask for.
    The HTTP side never imports the service; the service builds it (``make_http_runner``)."""

    machine: Rendezvous
    clock: Callable[[], float]
    tokens: TokenTable | None
    http_access: Access | None

    def drain(self, job_id: str, node_id: str, reason: str = "") -> None: ...

    def state_log_health(self) -> LogHealth | None:
        """Whether the state log is written (None: the server has none)."""
        ...


SERVICE: web.AppKey[Served] = web.AppKey("service")

# Checks that the request may perform ``action`` ("drain"); raises an HTTPException if not.
Authorizer = Callable[[web.Request, str], Awaitable[None]]

_NO_STORE = {"Cache-Control": "no-store"}


class _PeerMistakes(logging.Filter):
    """aiohttp logs most malformed requests as an ERROR with a traceback. They are the peer's
    mistake, not ours, and anyone who reaches the port could fill the log with them: keep one
    WARNING line each. Errors in our own handlers keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = (
                "bad HTTP request from %s: %s",
                (peer, " ".join(exc.message.split())[:200]),
            )
            record.exc_info, record.exc_text = None, None
        return True


_http_log = logging.getLogger("rdzv_server.http")
_http_log.addFilter(_PeerMistakes())


# The header a non-browser client may send instead of a JSON content type (``rdzv-server drain``
# sends both): a page cannot add it cross-site without a CORS preflight we never grant.
REQUEST_HEADER = "X-Rdzv-Request"


@record(frozen=True, slots=True)
class Access:
    """What the HTTP side lets through, beyond tokens: ``rdzv-server`` gives it to the
    service at construction (``RendezvousService(http_access=...)``)."""

    read_token: str | None = None  # --read-token-file: may read every job's detail, nothing else
    hosts: tuple[str, ...] = ()  # --http-host: more names of this server, for the Host check
    metrics_jobs: int = 0  # --metrics-jobs: running jobs whose training gauges /metrics labels by id


async def allow_all(request: web.Request, action: str) -> None:
    """A server without tokens: anyone who reaches the port may act, with a request a web
    page cannot forge cross-site (a JSON body or our header: both need a CORS preflight)."""
    media = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if media != "application/json" and REQUEST_HEADER not in request.headers:
        raise web.HTTPForbidden(
            text=f"{action} needs Content-Type: application/json or a {REQUEST_HEADER}: 1 header "
            "(a plain form POST, which any web page can make a browser send, is refused)"
        )


def _bearer(request: web.Request, what: str) -> str:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise web.HTTPUnauthorized(
            text=f"{what}: Authorization: Bearer TOKEN",
            headers={"WWW-Authenticate": 'Bearer realm="rdzv-server"'},
        )
    return given.strip()


def _same(expected: str | None, given: str) -> bool:
    return expected is not None and hmac.compare_digest(expected.encode(), given.encode())


def token_authorizer(tokens: TokenTable) -> Authorizer:
    """Require the bearer token of the job named in the path."""

    async def authorize(request: web.Request, action: str) -> None:
        given = _bearer(request, f"{action} needs the job's token")
        if not _same(tokens.for_job(request.match_info.get("job_id", "")), given):
            raise web.HTTPForbidden(text=f"{action}: the token is not this job's token")

    return authorize


def read_authorizer(tokens: TokenTable | None, read_token: str | None) -> Callable[[web.Request, str], None]:
    """With tokens, a job's detail needs the read token or that job's own token."""

    def check(request: web.Request, job_id: str) -> None:
        if tokens is None:
            return
        given = _bearer(request, "a job's detail needs a token (the read token or the job's own)")
        if not (_same(read_token, given) or _same(tokens.for_job(job_id), given)):
            raise web.HTTPForbidden(
                text="a job's detail: the token is neither the read token nor this job's token"
            )

    return check


def own_names(extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The names a Host header may give for this server (IP literals are always fine)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn(), *extra}
    return frozenset(n.lower().rstrip(".") for n in names if n)


def host_names_server(host: str | None, names: frozenset[str]) -> bool:
    """Whether a Host header (``name``, ``name:port``, ``[v6]:port``) names this server."""
    if host is None:
        return True  # no Host at all: HTTP/1.0, never a browser
    text = host.strip().lower()
    if text.startswith("["):
        name = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        name = text.partition(":")[0]
    else:
        name = text  # a bare IPv6 literal, or a name
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name.rstrip(".") in names


def _json(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response, never holding NaN or Infinity (``status.to_json``)."""
    return web.json_response(data, status=status, headers=headers, dumps=to_json)


def _error(status_code: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json(
        {"error": code, "message": message}, status=status_code, headers={**_NO_STORE, **(headers or {})}
    )


_ERROR_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found"}
_ERROR_CODES |= {405: "method_not_allowed", 413: "too_large", 421: "misdirected", 503: "stopped"}
_UNCHECKED_HOST = frozenset({"/healthz", "/metrics"})  # counts only: probes and scrapers


STOPPED: web.AppKey[list[bool]] = web.AppKey("stopped")
HOST_NAMES: web.AppKey[frozenset[str]] = web.AppKey("host_names")


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """API clients get JSON errors; the dashboard and the rest keep aiohttp's plain ones."""
    if request.app[STOPPED][0]:
        # A connection accepted before the service closed (a browser's pre-connected socket,
        # say) can still deliver a request afterwards: say we are gone, and hang up.
        resp = _error(503, "stopped", "the rendezvous server has shut down")
        resp.force_close()
        return resp
    host = request.headers.get("Host")
    if request.path not in _UNCHECKED_HOST and not host_names_server(host, request.app[HOST_NAMES]):
        shown = ascii(host[:100]) if host is not None else "?"
        return _error(
            421,
            "misdirected",
            f"Host {shown} does not name this server: use its address, or start it with "
            "--http-host NAME for each name it is reached by (a guard against DNS rebinding)",
        )
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if not request.path.startswith("/v1/") or exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        code = _ERROR_CODES.get(exc.status, "error")
        return _error(exc.status, code, exc.text or exc.reason, headers)


def build_app(
    service: Served, *, authorize: Authorizer = allow_all, access: Access | None = None
) -> web.Application:
    access = access or Access()
    app = web.Application(middlewares=[_json_errors])
    app[SERVICE] = service
    app[STOPPED] = stopped = [False]
    app[HOST_NAMES] = own_names(access.hosts)
    may_read = read_authorizer(service.tokens, access.read_token)

    async def mark_stopped(app: web.Application) -> None:
        stopped[0] = True

    app.on_cleanup.append(mark_stopped)
    registry = metrics.make_registry(
        lambda: service.machine,
        service.clock,
        jobs=access.metrics_jobs if access is not None else 0,
        state_log=service.state_log_health,
    )
    dashboard = resources.files(__package__).joinpath("dashboard.html").read_bytes()

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=dashboard, content_type="text/html", charset="utf-8", headers=_NO_STORE)

    async def healthz(request: web.Request) -> web.Response:
        m = service.machine
        body: dict[str, Any] = {
            "status": "ok",
            "jobs": len(m.jobs),
            "connections": len(m.conns),
            "alarms": [],
        }
        log = service.state_log_health()
        if log is not None and log.read_only:
            body["status"], body["alarms"] = "read_only", ["NOSPACE"]
            body["read_only"] = {
                "reason": log.read_only,
                "since": log.since,
                "held_changes": log.held,
                "refused_connections": log.refused,
            }
        return _json(body, headers=_NO_STORE)

    async def list_jobs(request: web.Request) -> web.Response:
        return _json(
            status.jobs_view(service.machine, mono_now=service.clock(), wall_now=time.time()),
            headers=_NO_STORE,
        )

    async def get_job(request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        may_read(request, job_id)
        view = status.find_job(service.machine, job_id, mono_now=service.clock(), wall_now=time.time())
        if view is None:
            return _error(404, "not_found", f"no job {job_id!r}")
        return _json(view, headers=_NO_STORE)

    async def drain(request: web.Request) -> web.Response:
        await authorize(request, "drain")
        job_id, node_id = request.match_info["job_id"], request.match_info["node_id"]
        reason = await _drain_reason(request)
        if isinstance(reason, web.Response):
            return reason
        log = service.state_log_health()
        if log is not None and log.read_only:
            text = f"the server cannot write its state log ({log.read_only}): no drain until there is room"
            return _error(503, "read_only", text, {"Retry-After": "5"})
        try:
            service.drain(job_id, node_id, reason)
        except KeyError as exc:
            return _error(404, "not_found", str(exc.args[0]) if exc.args else "not found")
        return _json(
            {"status": "draining", "job_id": job_id, "node_id": node_id, "reason": reason},
            status=202,
            headers=_NO_STORE,
        )

    async def metrics_page(request: web.Request) -> web.Response:
        body, content_type = metrics.render(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_post("/v1/jobs/{job_id}/nodes/{node_id}/drain", drain)
    return app


async def _drain_reason(request: web.Request) -> str | web.Response:
    """The optional body ``{"reason": "..."}``; a 400 response saying what is wrong with it."""
    raw = await request.read()
    if not raw.strip():
        return ""
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, "bad_request", f"the body must be JSON: {exc}")
    if not isinstance(body, dict):
        return _error(400, "bad_request", "the body must be a JSON object")
    unknown = sorted(set(body) - {"reason"})
    if unknown:
        return _error(400, "bad_request", f"unknown field(s) in the body: {', '.join(unknown)}")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        return _error(400, "bad_request", "reason must be a string")
    try:
        Drain(reason=reason)  # the agent gets exactly this; refuse here what it would refuse
    except ProtocolError as exc:
        return _error(400, "bad_request", str(exc))
    return reason


async def make_http_runner(service: Served, *, authorize: Authorizer | None = None) -> web.AppRunner:
    """An aiohttp runner whose ``server`` is a protocol factory for handed-over connections."""
    if authorize is None:
        authorize = allow_all if service.tokens is None else token_authorizer(service.tokens)
    access = service.http_access  # given at construction, from rdzv-server's flags
    runner = web.AppRunner(
        build_app(service, authorize=authorize, access=access),
        handle_signals=False,
        access_log=None,
        logger=_http_log,
    )
    await runner.setup()
    return runner
