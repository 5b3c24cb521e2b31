"""``node-agent``: torchrun's command line, our launcher behind it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .config import ConfigError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    from .agent_log import for_cli, install
    from .args import parse_config

    install(for_cli(os.environ.get("LOGLEVEL")))  # the command line's warnings are agent lines
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from .runner import run_agent

    return run_agent(config)


if __name__ == "__main__":
    sys.exit(main())
