"""The agent's per-round parts: one seam between :class:`~node_agent.runner.Agent` and what it
runs beside the workers.

Five parts live beside the workers, each in its own room: the torchrun event log
(``torch_events.py``), in-memory snapshots (``snapshots/node.py``), the GPUs (``gpu/node.py``),
the watch on the training (``progress/poll.py``) and the workers' TCPStore (``store/host.py``).
Each implements :class:`RoundPart`; the agent walks them, in :data:`ORDER`, at each step of a
round, and knows none of them by name there. A part that a launch does not use is never made (a
launch without GPU work never imports ``gpu/``), so the agent adds each as it is made, and
:func:`with_part` puts it in its place.

The steps of a round, and which way the agent walks the parts:

- **joining** (:meth:`RoundPart.join_fields`, :meth:`RoundPart.before_join`): what this node's
  ``Join`` says of each part; before each fresh Join (not a ``Resume``) the last round's
  leftovers end, backwards (the store's last round dropped, then the replica key renewed);
- **starting** (:meth:`RoundPart.start_wait`, :meth:`RoundPart.before_start`,
  :meth:`RoundPart.started`): a wait the start must follow (the last workers' GPU memory),
  then each part made ready for the round, forwards, each adding to the workers' environment;
  a part that cannot be ready raises :class:`StartFailed` and no worker starts;
- **ending** (:meth:`RoundPart.stopping`, :meth:`RoundPart.after_exit`): what a stop waits for
  before it signals the workers (a stack dump under way), then what each part reads or starts
  once they are gone, backwards; an event it returns goes to the machine before the exit's;
- **effects** (:meth:`RoundPart.carry_out`): the machine's effects that are a part's own;
- **the run's end** (:meth:`RoundPart.close`), backwards.

Every method has a default that does nothing, so a part writes only the steps it takes part in.
This module imports nothing at run time beyond the standard library's typing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

if TYPE_CHECKING:
    import asyncio

    from protocol import Assignment

    from .logs import Attempt
    from .machine.events import Effect, Event
    from .supervisor.spec import GroupResult

__all__ = ["ORDER", "RoundPart", "RoundStart", "StartFailed", "StartWait", "with_part"]

# The order of the forward walks (joins and starts); ends walk it backwards.
# - "events" first: torchrun's RENDEZVOUS event comes before anything of the round can fail;
# - "snapshots" before the rest: a restore that cannot be had starts nothing else;
# - "gpu", then "watch": the attempt's binding table and the ranks' pages exist before the start;
# - "store" last: its fresh store is served just before the workers connect to it, and its
#   last round's store is dropped first before a Join.
ORDER = ("events", "snapshots", "gpu", "watch", "store")


class StartFailed(Exception):
    """A part cannot be ready for the round: no worker starts, and the server hears why.
    ``restore_failed``: the snapshot step that could not be restored (-1: none)."""

    restore_failed: int = -1


class RoundStart(NamedTuple):
    """What a part is told before a round's workers start."""

    assignment: Assignment
    attempt: Attempt  # this attempt's folders (logs.py)
    nproc: int  # local ranks
    rendezvous_ms: float  # from the Join to the assignment (without a wait for the GPUs)


class StartWait(NamedTuple):
    """A wait the next start follows; ``why`` is said when it lasts longer than a second."""

    task: asyncio.Task[None]
    why: str


class RoundPart(Protocol):
    """One of the agent's parts (see the module's header); subclass it to inherit the defaults."""

    name: ClassVar[str]  # its place in ORDER

    def join_fields(self) -> Mapping[str, Any]:
        """This part's fields of the node's Join (``outbound.join_message``'s keywords)."""
        return {}

    async def connected(self) -> None:
        """The rendezvous is reached; the first Join comes next."""
        return None

    async def before_join(self) -> None:
        """A fresh Join is about to go (a Resume is not one): the last round is over."""
        return None

    def start_wait(self) -> StartWait | None:
        """Something the next start must wait for, if any."""
        return None

    async def before_start(self, r: RoundStart) -> Mapping[int, Mapping[str, str]]:
        """Ready for round ``r`` (no worker of it runs yet): the environment to add, by global
        rank. Raises :class:`StartFailed`."""
        return {}

    def started(self, a: Assignment, pids: Mapping[int, int]) -> None:
        """The round's workers started (``pids``: by local rank)."""
        return None

    def stopping(self) -> asyncio.Task[None] | None:
        """The workers are about to be stopped: a task the stop waits for before it signals them."""
        return None

    def after_exit(self, result: GroupResult, *, stopped: bool) -> Event | None:
        """The workers are gone, by themselves or ``stopped``: an event for the machine, if any."""
        return None

    def carry_out(self, eff: Effect) -> bool:
        """Carry out ``eff`` if it is this part's; False: it is not."""
        return False

    async def close(self, *, succeeded: bool = False) -> None:
        """The run is over (``succeeded``: the job is done)."""
        return None


def with_part(parts: tuple[RoundPart, ...], part: RoundPart) -> tuple[RoundPart, ...]:
    """``parts`` with ``part`` in its place (:data:`ORDER`)."""
    return tuple(sorted((*parts, part), key=lambda p: ORDER.index(p.name)))
