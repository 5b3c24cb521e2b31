"""``node-agent``: torchrun's command line, our launcher behind it."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence

from ..config import ConfigError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    # The collector would scan the 35,000 objects the imports below create some fifty times
    # (7 ms of a launch) to find almost nothing: off until they are done, then frozen (never
    # scanned again, nor freed: some 0.3 MB of the imports' own cycles, the classes @record
    # replaces by their slotted copies and argparse's, stay). Not in launch(): a user's
    # process is not ours to tune.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _main(argv, collecting)
    finally:
        if collecting:
            gc.enable()


def _main(argv: Sequence[str] | None, collecting: bool) -> int:
    from ..agent_log import for_cli, install
    from .parse import parse_config

    log = for_cli(os.environ.get("LOGLEVEL"))
    install(log)  # the command line's warnings are agent lines
    # As torchrun's @record main: the launcher's own error file, named in its environment now
    # (the workers get theirs), receives the root cause of a failed launch.
    # error_file (json, 1 ms) is imported only when there is one to write.
    error_file = None
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from .. import error_file as ef

        error_file = ef.launcher_error_file(os.environ)
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        if error_file:
            ef.write(error_file, ef.exception_record(exc), log)
        return EXIT_USAGE
    from ..runner import run_agent

    gc.freeze()
    if collecting:
        gc.enable()
    try:
        agent, outcome = run_agent(config)
    except Exception as exc:  # on purpose: recorded as torchrun's @record would, then raised
        if error_file:
            ef.write(error_file, ef.exception_record(exc), log)
        raise
    if error_file:
        record = ef.outcome_record(outcome.code, outcome.reason, outcome.failure, outcome.local_failures)
        if record is not None:
            ef.write(error_file, record, agent.log)
    return outcome.code
