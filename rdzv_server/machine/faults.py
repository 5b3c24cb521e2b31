"""How the rendezvous machine contains a fault of its own: a rule that raises.

A rule that raises is a bug of ours, but a peer may reach it with values the protocol allows,
and one machine serves every job on the server. So a fault must cost one job, never the
server, and never the state log's agreement with what the agents were told:

- ``Rendezvous.handle`` runs each event as units of work, each for one job or for the server
  (``Rendezvous._unit``): a member's frame, a job's share of a tick, a lost connection, a
  drain. An exception in a job's unit fails that job (``JobFailed(code="internal_error")`` to
  its agents, a reason naming the rule: ``where``); every other unit of the event goes on and
  its effects are kept. An exception in a server unit (a handshake, the routing) refuses the
  peer that sent the frame, as any bad peer is.
- The containment is a fact of its event (``fault``): the event is logged even if it would
  not be, and a replay ends the job with the same words.
- Replay runs the same code on the same logged inputs, so a fault raised from logged state
  raises again at the same place and is contained the same way. A rule computed from
  volatile state (Progress, Stacks: not logged), which replay takes from the event's facts
  instead, is wrapped in ``from_volatile``: when it raises live, where it raised is a fact too
  (``raised``), and replay raises there (``ReplayedFault``). Either way the replayed job is
  the live one, up to the fault and after it.

Pure: ``where`` walks the traceback's frames and reads no source file.
"""

from __future__ import annotations

import functools
import posixpath  # names only: this module opens nothing
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from .jobs import Job

INTERNAL_ERROR = "internal_error"  # JobFailed.code and Error.code of a contained fault
_HERE = posixpath.dirname(__file__)  # absolute: the package is imported from a path
_TRAIL = 6  # frames of the machine's own code a fault's log line names


class ReplayedFault(Exception):
    """Raised by a replay where the live server's rule raised (a ``raised`` fact)."""


class _Deciding(Protocol):
    logged_facts: dict[str, Any] | None

    def _add_fact(self, key: str, item: list[Any]) -> None: ...


S = TypeVar("S", bound=_Deciding)
P = ParamSpec("P")
R = TypeVar("R")


def from_volatile(
    key: str,
) -> Callable[[Callable[Concatenate[S, Job, P], R]], Callable[Concatenate[S, Job, P], R]]:
    """For a rule that decides from volatile state live and from its facts when replaying:
    a live exception in it is recorded as the fact ``raised: [job id, key]``, and a replay of
    that event raises ``ReplayedFault`` once the rule has applied the facts it had logged, so
    the fault is contained at the same point of the job's state."""

    def wrap(rule: Callable[Concatenate[S, Job, P], R]) -> Callable[Concatenate[S, Job, P], R]:
        @functools.wraps(rule)
        def run(self: S, job: Job, /, *args: P.args, **kw: P.kwargs) -> R:
            logged = self.logged_facts
            if logged is None:
                try:
                    return rule(self, job, *args, **kw)
                except Exception:
                    self._add_fact("raised", [job.id, key])
                    raise
            result = rule(self, job, *args, **kw)
            entries = logged.get("raised", [])
            hit = next((e for e in entries if list(e) == [job.id, key]), None)
            if hit is not None:
                logged["raised"] = [e for e in entries if e is not hit]  # used once
                raise ReplayedFault(f"{key} raised here on the live server")
            return result

        return run

    return wrap


def _frames(exc: BaseException) -> list[tuple[str, str, int]]:
    """(function, file, line) of the machine's own frames of ``exc``, innermost first."""
    found = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename
        if posixpath.dirname(path) == _HERE and posixpath.basename(path) != "faults.py":
            found.append((code.co_name, posixpath.basename(path), tb.tb_lineno))
        tb = tb.tb_next
    found.reverse()
    return found


def where(exc: BaseException) -> str:
    """The rule that raised: the innermost frame of the machine's own code."""
    frames = _frames(exc)
    if not frames:
        return "the server"
    name, file, line = frames[0]
    return f"{name} ({file} line {line})"


def trail(exc: BaseException) -> str:
    """The machine's frames that led to ``exc``, innermost first, for the server's log."""
    frames = _frames(exc)[:_TRAIL]
    return " < ".join(f"{file}:{line} {name}" for name, file, line in frames) or "no frame of ours"
