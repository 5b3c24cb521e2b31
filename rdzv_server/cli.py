"""``rdzv-server``: the long-lived rendezvous daemon, and two commands for its operators.

``rdzv-server [--host H] [--port P] ...`` serves (agents and HTTP on one port; with
``--tls-cert`` and ``--tls-key``, TLS only). ``rdzv-server status`` and ``rdzv-server drain``
talk to a running server over its HTTP API. This module only dispatches:

- ``parser.py``: the flags and exit codes;
- ``config.py``: the flags -> a checked, frozen ``ServerConfig`` (usage errors exit 2);
- ``daemon.py``: serving it, signals, the state dir, the drain on SIGTERM;
- ``ops_client.py`` and ``tables.py``: the ``status``/``drain`` client and its tables, which
  never import the server, so they start fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .parser import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, build_parser

# Each path imports only its own modules: `status` never loads the server, nor serving urllib.
__all__ = ["EXIT_ERROR", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is not None:
        from .ops_client import run_command

        return run_command(args)
    from .config import ConfigError, build_config

    try:
        config = build_config(args, os.environ)
    except ConfigError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from edge.loop import run_loop  # uvloop where installed

    from .daemon import configure_logging, serve

    configure_logging(config.log_level)
    return run_loop(serve(config))


if __name__ == "__main__":
    sys.exit(main())
