"""``ServerConfig``: everything ``rdzv-server`` serves with, built and checked in one place.

``build_config`` turns the parsed flags (and the environment: ``RDZV_TOKEN_FILE``,
``RDZV_TOKEN``) into one frozen value, loading the token and TLS files through ``edge/`` so
that a bad file or a bad combination of flags is a ``ConfigError`` (exit 2) before anything
listens. The daemon hands its parts to ``RendezvousService`` at construction; nothing is set
on the service afterwards.

Light on purpose (no asyncio, no aiohttp): ``cli.py`` imports ``load_server_tls`` from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from edge.tls import TLSConfigError, server_context
from edge.tokens import TokenFileError, load_read_token, load_tokens
from protocol.records import record

if TYPE_CHECKING:
    import ssl

    from protocol.auth import TokenTable

MAX_STAGE_TIMEOUT = 3600.0  # --hello-timeout / --auth-timeout, seconds
MAX_METRICS_JOBS = 10_000  # --metrics-jobs: series a scrape may carry per gauge


class ConfigError(ValueError):
    """A flag, a combination of flags or a file the server cannot serve with; for the operator."""


@record(frozen=True, kw_only=True)
class ServerConfig:
    """One standalone server's settings, resolved (files loaded, defaults filled in)."""

    host: str
    port: int
    log_level: str
    tokens: TokenTable | None  # None: any agent may join any job
    read_token: str | None  # reads every job's detail over HTTP; only with tokens
    http_hosts: tuple[str, ...]  # names the HTTP API answers to, besides IPs and this machine
    metrics_jobs: int  # running jobs /metrics gives per-job training gauges (0: none)
    tls: ssl.SSLContext | None  # None: plain TCP; else the port speaks only TLS
    hello_timeout: float
    auth_timeout: float
    state_dir: str | None  # None: state in memory only
    state_min_free: int  # bytes; with less free on the state dir's disk, joins are refused


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    """The serving flags of ``parser.build_parser()``, checked in the order an operator fixes them."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    try:
        tokens = load_tokens(args.token_file, environ)
        read = load_read_token(args.read_token_file) if args.read_token_file else None
    except TokenFileError as exc:
        raise ConfigError(str(exc)) from None
    if read is not None and tokens is None:
        raise ConfigError("--read-token-file needs tokens (--token-file): without them reads are open")
    if not 0 <= args.metrics_jobs <= MAX_METRICS_JOBS:
        raise ConfigError(f"--metrics-jobs must be in 0..{MAX_METRICS_JOBS}, got {args.metrics_jobs}")
    if args.state_min_free_mib < 0:
        raise ConfigError(f"--state-min-free-mib must be >= 0, got {args.state_min_free_mib}")
    for flag, value in (("--hello-timeout", args.hello_timeout), ("--auth-timeout", args.auth_timeout)):
        if value is not None and not 0 < value <= MAX_STAGE_TIMEOUT:  # also refuses nan
            raise ConfigError(f"{flag} must be in (0, {MAX_STAGE_TIMEOUT:g}] seconds, got {value}")
    tls = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    # Only a server being configured pays for the service's import (aiohttp), not `status`.
    from .service import AUTH_TIMEOUT, HELLO_TIMEOUT

    return ServerConfig(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        tokens=tokens,
        read_token=read,
        http_hosts=tuple(args.http_host),
        metrics_jobs=args.metrics_jobs,
        tls=tls,
        hello_timeout=HELLO_TIMEOUT if args.hello_timeout is None else args.hello_timeout,
        auth_timeout=AUTH_TIMEOUT if args.auth_timeout is None else args.auth_timeout,
        state_dir=args.state_dir,
        state_min_free=args.state_min_free_mib << 20,
    )


def load_server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The listening port's TLS context from --tls-cert/--tls-key/--tls-client-ca; None: plain.

    No environment variables here: RDZV_TLS_CERT is an agent's client certificate.
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (the server's own certificate)")
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise ConfigError(f"{given} needs {missing}: give both or neither")
    try:
        return server_context(cert, key, client_ca)
    except TLSConfigError as exc:  # names the file
        raise ConfigError(str(exc)) from None
