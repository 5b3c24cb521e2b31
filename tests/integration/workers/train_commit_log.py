"""The reader of ``train_commit.py``'s step logs: what each worker process did.

One parser for the commit-restart tests (``tests/integration/test_commit_restart.py``) and the
bench's case 9 (``bench/commit_lost.py``). The format is the worker's (see its docstring): a
file per node and local rank, ``<NODE_TAG>-<LOCAL_RANK>.log``, and a line per event,
``<kind> pid=P key=value ... t=<time.time()>``, each written in one ``O_APPEND`` write.

The bench reads the logs while the workers still write them, so a last line without its
newline is one being written: it is left for the next read. Any other line that is not of
that form is the worker's bug, and says so. No torch here: the readers must not import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"^(\w+) pid=(\d+)((?: \w+=\S*)*)$")


@dataclass
class Attempt:
    """One worker process's attempt (one, unless it restarted in place): what its log says it did."""

    node: str
    pid: int
    world: int = 0
    start_from: int = -1  # the step it loaded (0: none); -1 until its start line
    loaded: str | None = None  # checksum of the state it loaded
    loaded_from: str = ""  # "memory" (an in-memory snapshot) or "checkpoint" (DCP)
    steps: list[int] = field(default_factory=list)
    sums: dict[int, str] = field(default_factory=dict)  # step -> checksum of the state after it
    saves: dict[int, tuple[str, str]] = field(default_factory=dict)  # step -> (checksum, why)
    first_t: float | None = None  # when it finished its first step (time.time())
    stopped: int | None = None  # should_stop() said yes after this step
    done: bool = False

    def __repr__(self) -> str:
        ran = f"{self.steps[0]}..{self.steps[-1]} ({len(self.steps)})" if self.steps else "none"
        return (
            f"<node {self.node} pid {self.pid}: world {self.world}, from {self.start_from}, steps {ran}, "
            f"saves {sorted(self.saves)}, stopped {self.stopped}, done {self.done}>"
        )


def attempts(log_dir: Path) -> list[Attempt]:
    """Every worker process's record, per node in the order they started.

    Raises ValueError for a complete line that is not the worker's format.
    """
    out: list[Attempt] = []
    for path in sorted(log_dir.glob("*.log")):
        node = path.stem.rsplit("-", 1)[0]
        by_pid: dict[int, Attempt] = {}
        lines = path.read_text().split("\n")
        for line in lines[:-1]:  # the last piece: "" after a newline, or a line being written
            m = _LINE.match(line)
            if not m:
                raise ValueError(f"{path}: a malformed line {line!r}")
            kind, pid = m[1], int(m[2])
            f = dict(kv.split("=", 1) for kv in m[3].split())
            a = by_pid.get(pid)
            if a is None or (kind in ("load", "start") and a.start_from >= 0):
                # A second start (or load, before it) of one process: it restarted in place
                a = by_pid[pid] = Attempt(node, pid)
                out.append(a)
            if kind == "start":
                a.world, a.start_from = int(f["world"]), int(f["from"])
            elif kind == "load":
                a.loaded, a.loaded_from = f["sum"], f.get("src", "")
            elif kind == "step":
                a.steps.append(int(f["step"]))
                a.sums[int(f["step"])] = f["sum"]
                if a.first_t is None:
                    a.first_t = float(f["t"])
            elif kind == "save":
                a.saves[int(f["step"])] = (f["sum"], f["why"])
            elif kind == "stop":
                a.stopped = int(f["step"])
            elif kind == "done":
                a.done = True
    return out


def last_step(log_dir: Path, node: str, world: int | None = None) -> int:
    """The highest step any of ``node``'s processes ran (in a world of ``world``, if given); 0: none."""
    runs = attempts(log_dir)
    return max((s for a in runs if a.node == node and world in (None, a.world) for s in a.steps), default=0)
