"""``rdzv-server``: the long-lived rendezvous daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from protocol.auth import TokenTable

from .service import RendezvousService

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
DEFAULT_PORT = 29500


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdzv-server", description="Rendezvous server for node-agent jobs.")
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
    return p


def load_tokens(path: str | None, environ: Mapping[str, str]) -> TokenTable | None:
    """The server's tokens: --token-file, else RDZV_TOKEN_FILE, else RDZV_TOKEN; None: open."""
    path = path or environ.get("RDZV_TOKEN_FILE") or None
    if path is None:
        token = environ.get("RDZV_TOKEN")
        return TokenTable(default=token) if token else None
    try:
        return TokenTable.parse(Path(path).read_text(), origin=f"token file {path!r}")
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from None


async def serve(
    host: str, port: int, *, tokens: TokenTable | None = None, ready: asyncio.Event | None = None
) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
