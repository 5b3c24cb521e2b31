"""``node-agent``: torchrun's command line, our launcher behind it."""

from __future__ import annotations

import gc
import os
import sys

from .. import step_notices

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing anything before main's first act
if TYPE_CHECKING:
    from collections.abc import Sequence

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    # First and last: a scheduler's notice to every process of the job step (SIGUSR1, SIGUSR2)
    # never ends the agent, whenever it comes (step_notices.py). Before anything slow: this
    # package imports nothing else at its top (node_agent.config alone is 90 ms).
    step_notices.hold()
    try:
        return _collected(argv)
    finally:
        step_notices.ignore()


def _collected(argv: Sequence[str] | None) -> int:
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
    from ..config import ConfigError
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
    # A notice --signals-to-handle names stops the job, as SIGTERM does: not held (see there).
    step_notices.release(signal_numbers(config.signals_to_handle))
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
    if config.outcome_dir:
        from ..outcome_file import write_outcome

        problem = write_outcome(config.outcome_dir, outcome.code, outcome.job_done)
        if problem:
            agent.log(problem, "warning")
    return outcome.code


def signal_numbers(names: Sequence[str]) -> list[int]:
    """``--signals-to-handle``'s names as numbers (names parse_config checked already)."""
    import signal

    return [int(signal.Signals[name]) for name in names]
