"""The step's notices (SIGUSR1, SIGUSR2) never end the ``node-agent`` command, at any moment.

Slurm (``--signal=USR1@90``, ``scancel --signal=USR1``; proctrack/cgroup and linuxproc) and
systemd (``KillMode=control-group``) send a notice to every process of the job step, the agent
included, whenever it comes: 4 s into a job with a short ``--time``, the agent may still be
importing, parsing its command line, connecting or rendezvousing, or already shutting down.
The default action of both signals is to terminate, and the agent's loop handles them only
while it runs (``runner.py``): before this module, a notice that came outside that window killed
the agent (Slurm: ``FAILED 138:0``).

So the command's ``main`` calls :func:`hold` as its first act and :func:`ignore` as its last
(``cli/__init__.py``); in between, a notice is

* *held* (recorded, at most :data:`MAX_HELD`) while the agent cannot act on it: before its loop
  handles signals and again once it stopped handling them;
* *delivered* to the agent's loop while it runs (:func:`deliver_to`): held ones first, as if
  they came then. The loop's machine decides as for any notice: passed on to running workers
  (unless they have it from its sender), else said and dropped. A notice that came before the
  workers were started never reached them (the sender signalled the processes there were): it
  is not passed on to the workers that start later, as it is not when it comes between rounds.

The disposition is a handler, not ``SIG_IGN``: a handled signal is back at its default in every
program the agent starts (across ``exec``), so workers, helpers and health checks start with
the dispositions a cold start has. At the very end, :func:`ignore` sets ``SIG_IGN``: Python's
finalization puts every signal with a Python handler back to its default, which would reopen
the window for the last milliseconds of the agent's life.

What no code of the agent can close: the interpreter's own start-up before ``main`` (some
20 ms; a disposition that survives ``exec`` is its parent's to give). And a notice that
``--signals-to-handle`` names is a signal that stops the job, like SIGTERM: it is not held
(:func:`release`) and ends an agent whose loop does not run yet with its default action, as
SIGTERM does.

Only the ``node-agent`` command holds notices: ``node_agent.launch()`` runs in the user's
process, whose dispositions are the user's (``api.py`` saves and restores them).

Imports ``_signal`` alone (the C module: no enum), so holding costs nothing measurable at
start-up.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found, unused-ignore]

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see above)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["MAX_HELD", "NOTICES", "deliver_to", "held_signals", "hold", "hold_again", "ignore", "release"]

# SIGUSR1, SIGUSR2: the same numbers on every Linux architecture we run on (procutil.STEP_SIGNALS).
NOTICES = (10, 12)
# Notices kept while none can be acted on; past this many, more are dropped (each is logged
# once delivered: a flood must not grow the agent).
MAX_HELD = 16

_holding: set[int] = set()  # the notices this process holds now
_held: list[int] = []  # held, not delivered yet
_target: Callable[[int], None] | None = None


def _on_notice(signum: int, _frame: object) -> None:
    target = _target
    if target is not None:
        target(signum)
    elif len(_held) < MAX_HELD:
        _held.append(signum)


def hold() -> None:
    """From now on a notice never ends this process: held until :func:`deliver_to`."""
    global _target
    _target = None
    for signum in NOTICES:
        _signal.signal(signum, _on_notice)
        # SA_RESTART, as the loop's own handlers have: a notice does not interrupt a blocking
        # call of C code that does not expect EINTR.
        _signal.siginterrupt(signum, False)
        _holding.add(signum)


def held_signals() -> frozenset[int]:
    """The notices held now (none unless :func:`hold` was called: ``launch()``)."""
    return frozenset(_holding)


def release(signums: Iterable[int]) -> None:
    """Stop holding these (``--signals-to-handle`` names them: they stop the job, as SIGTERM
    does): back to their default action, and one held meanwhile is acted on at once, as it
    would have been without the hold."""
    raised = []
    for signum in signums:
        if signum in _holding:
            _holding.discard(signum)
            _signal.signal(signum, _signal.SIG_DFL)
            if signum in _held:
                raised.append(signum)
    _held[:] = [s for s in _held if s in _holding]
    for signum in raised:
        _signal.raise_signal(signum)


def deliver_to(target: Callable[[int], None]) -> None:
    """Every held notice, then each one as it comes, goes to ``target`` (in the main thread,
    from a signal handler: ``target`` must only schedule work, e.g. ``call_soon_threadsafe``)."""
    global _target
    _target = target
    pending = _held[:]
    del _held[:]
    for signum in pending:
        target(signum)


def hold_again() -> None:
    """Hold notices again (the loop stops acting on them)."""
    global _target
    _target = None


def ignore() -> None:
    """The agent's last act: the notices it holds are ignored from now to its exit (Python's
    finalization would put them back to their default action: see the header)."""
    global _target
    _target = None
    for signum in _holding:
        _signal.signal(signum, _signal.SIG_IGN)
    del _held[:]
