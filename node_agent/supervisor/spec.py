"""What the supervisor is given and gives back: a worker's spec, its exit, the group's result,
and the errors of a start (the types the runner and ``worker_env`` share with the supervisor)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from node_agent.config import Std
from protocol.records import record

_logger = logging.getLogger(__name__)
# In stop(), once every process of the group is dead: how long a pipe may stay open (a process
# that left the worker's group holds it) before we stop reading it.
DRAIN_TIMEOUT = 1.0
# After SIGKILL: how long to wait for the kernel to let a process go.  Only a process stuck in
# uninterruptible sleep (a wedged GPU or NFS call) takes longer; we report it and move on.
REAP_TIMEOUT = 10.0


class SupervisorError(Exception):
    """Base of the supervisor's errors."""


class WorkerSpawnError(SupervisorError):
    """A worker could not be started (missing executable, bad cwd, ...); none is left running."""

    def __init__(self, local_rank: int, argv0: str, error: OSError) -> None:
        self.local_rank = local_rank
        self.argv0 = argv0
        self.errno = error.errno
        self.strerror = error.strerror or str(error)
        super().__init__(f"cannot start local_rank {local_rank}: {argv0}: {self.strerror}")


@record(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything needed to start one worker; ``env`` is its whole environment."""

    local_rank: int
    rank: int  # the global rank, for reports
    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None
    redirect: Std = Std.NONE  # streams written only to their files
    tee: Std = Std.NONE  # streams written to their files and, prefixed, to the console
    stdout_path: str | None = None
    stderr_path: str | None = None
    console: bool = True  # False: the console copy is dropped (--local-ranks-filter)
    prefix: str = ""  # put before each tee'd console line, e.g. "[default0]:"
    error_file: str | None = None  # TORCHELASTIC_ERROR_FILE, read when the worker fails
    # --duplicate-stdout-filters/--duplicate-stderr-filters: lines of a tee'd stream (of a rank
    # shown on the console) that contain any of these strings are copied, with ``prefix``, to
    # the filtered file; torchrun's <attempt dir>/filtered_stdout.log and filtered_stderr.log,
    # shared by every rank of the attempt.  The file is created whenever filters are given.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    filtered_stdout_path: str | None = None
    filtered_stderr_path: str | None = None
    # --numa-binding: the CPUs the worker runs on, set before it runs anything (None: unbound)
    cpus: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"local_rank {self.local_rank}: empty argv")
        object.__setattr__(self, "redirect", Std(int(self.redirect)))
        object.__setattr__(self, "tee", Std(int(self.tee)))
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"local_rank {self.local_rank}: {name} must be a sequence of strings")
            object.__setattr__(self, name, tuple(value))
        if self.duplicate_stdout_filters and not self.filtered_stdout_path:
            raise ValueError(
                f"local_rank {self.local_rank}: duplicate_stdout_filters without filtered_stdout_path"
            )
        if self.duplicate_stderr_filters and not self.filtered_stderr_path:
            raise ValueError(
                f"local_rank {self.local_rank}: duplicate_stderr_filters without filtered_stderr_path"
            )
        to_file = self.redirect | self.tee
        if to_file & Std.OUT and not self.stdout_path:
            raise ValueError(f"local_rank {self.local_rank}: stdout is redirected but stdout_path is not set")
        if to_file & Std.ERR and not self.stderr_path:
            raise ValueError(f"local_rank {self.local_rank}: stderr is redirected but stderr_path is not set")


@record(frozen=True, kw_only=True)
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    exitcode: int  # as Popen.returncode: negative means killed by that signal
    signal_name: str  # "SIGKILL" etc.; "" for a normal exit
    timestamp: float  # time.time() when reaped (for reports only)
    error_message: str  # error file's message and traceback, else the stderr tail, else ""
    error_record: Mapping[str, Any] | None  # the error file's JSON, if there was one
    error_file: str = ""  # its path, when the worker wrote one

    @property
    def failed(self) -> bool:
        return self.exitcode != 0


@record(frozen=True)
class GroupResult:
    state: Literal["succeeded", "failed"]
    exits: tuple[WorkerExit, ...]  # every worker reaped so far, by local rank
    first_failure: WorkerExit | None  # the earliest failure: torchrun's root cause


class WorkerGroupLike(Protocol):
    """What the runner asks of a node's workers: ``group.WorkerGroup`` (real processes), or
    ``fake.FakeWorkerGroup`` (a test drives the exits), as the rendezvous has ``rdzv/fake.py``."""

    @property
    def pids(self) -> dict[int, int]: ...

    async def start(self, specs: Sequence[WorkerSpec]) -> None: ...

    async def wait(self) -> GroupResult: ...

    async def stop(
        self,
        *,
        grace: float,
        sig: int = ...,
        reap_timeout: float = ...,
        keep_watchdog: bool = ...,
        park: bool = ...,
    ) -> GroupResult: ...

    def fresh_line(self) -> None: ...

    async def delivered(self, sig: int) -> bool: ...

    def send_signal(self, sig: int) -> None: ...
