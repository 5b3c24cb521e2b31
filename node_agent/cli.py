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
    from .error_file import exception_record, launcher_error_file, outcome_record, write

    log = for_cli(os.environ.get("LOGLEVEL"))
    install(log)  # the command line's warnings are agent lines
    # As torchrun's @record main: the launcher's own error file, named in its environment now
    # (the workers get theirs), receives the root cause of a failed launch.
    error_file = launcher_error_file(os.environ)
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        if error_file:
            write(error_file, exception_record(exc), log)
        return EXIT_USAGE
    from edge.loop import run_loop

    from .runner import Agent

    try:
        agent = Agent(config)
        install(agent.log)
        outcome = run_loop(agent.run())
    except Exception as exc:  # on purpose: recorded as torchrun's @record would, then raised
        if error_file:
            write(error_file, exception_record(exc), log)
        raise
    if error_file:
        record = outcome_record(outcome.code, outcome.reason, outcome.failure, outcome.local_failures)
        if record is not None:
            write(error_file, record, agent.log)
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
