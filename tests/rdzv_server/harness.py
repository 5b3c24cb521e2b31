"""A fake clock and scripted agents around the pure rendezvous machine."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import SUPPORTED_VERSIONS, Failure, Hello, Join, Message
from rdzv_server.machine.state import (
    Close,
    Connected,
    Disconnected,
    Effect,
    MemberState,
    Received,
    Rendezvous,
    Send,
    Tick,
)


@dataclass
class Harness:
    machine: Rendezvous = field(default_factory=Rendezvous)
    now: float = 0.0
    inbox: dict[int, list[Message]] = field(default_factory=dict)
    closed: dict[int, str] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    _next: int = 0

    def _apply(self, effects: list[Effect]) -> None:
        for job in self.machine.jobs.values():
            # The machine keeps this set by hand for speed; after every event it must be exact.
            unready = {nid for nid, m in job.members.items() if m.state is not MemberState.READY}
            assert job.not_ready == unready, f"job {job.id}: not_ready {job.not_ready} != {unready}"
        for e in effects:
            if isinstance(e, Send):
                self.inbox.setdefault(e.conn, []).append(e.msg)
            elif isinstance(e, Close):
                self.closed[e.conn] = e.reason
            else:
                self.logs.append(e.text)

    def connect(self) -> int:
        self._next += 1
        c = self._next
        self._apply(self.machine.handle(Connected(c, f"127.0.0.1:{1000 + c}"), self.now))
        self._apply(
            self.machine.handle(Received(c, Hello(versions=SUPPORTED_VERSIONS, software="t")), self.now)
        )
        self.take(c)  # the welcome
        return c

    def send(self, conn: int, msg: Message) -> None:
        self._apply(self.machine.handle(Received(conn, msg), self.now))

    def join(
        self, conn: int | None = None, *, node: str | None = None, job: str = "job", **kw: object
    ) -> int:
        c = self.connect() if conn is None else conn
        fields: dict[str, object] = dict(
            job_id=job,
            node_id=node or f"node{c}",
            addr=f"10.0.0.{c}",
            nproc=2,
            min_nodes=2,
            max_nodes=2,
            entrypoint="train.py",
            master_port=20000 + c,
            max_restarts=0,
            last_call_timeout=5.0,
            heartbeat_interval=1.0,
            heartbeat_timeout=5.0,
        )
        fields.update(kw)
        self.send(c, Join(**fields))  # type: ignore[arg-type]
        return c

    def drop(self, conn: int) -> None:
        self._apply(self.machine.handle(Disconnected(conn), self.now))

    def advance(self, dt: float) -> None:
        """Move the clock, delivering every tick the machine asked for on the way."""
        end = self.now + dt
        while True:
            due = self.machine.next_deadline()
            if due is None or due > end:
                break
            self.now = max(self.now, due)
            self._apply(self.machine.handle(Tick(), self.now))
        self.now = end

    def take(self, conn: int) -> list[Message]:
        return self.inbox.pop(conn, [])

    def last(self, conn: int, kind: type) -> Message | None:
        found = [m for m in self.inbox.get(conn, []) if isinstance(m, kind)]
        return found[-1] if found else None


def failure(rank: int = 0, node: str = "n", exitcode: int = 1) -> Failure:
    return Failure(node_id=node, addr="10.0.0.9", rank=rank, local_rank=0, exitcode=exitcode, timestamp=1.0)
