"""Process helpers for the worker supervisor: signal names, process-group kills, and the two
mechanisms that keep workers from outliving the agent.

Why two mechanisms.  Every worker runs in its own session (so a kill of its process group reaches
the DataLoader workers and shell pipelines it starts).  That also means nothing ties it to the
agent any more: torchrun's workers survive a SIGKILL of their agent.  We close that hole twice:

* ``PR_SET_PDEATHSIG=SIGKILL`` in each worker (set between fork and exec).  The kernel kills the
  worker the moment the agent's spawning thread dies, however it dies.  It does not reach the
  worker's own children, and it is tied to the *thread* that forked, so the event loop that
  spawns workers must live as long as the agent (the main thread, in practice).
* A watchdog process (this file run as a script, one per worker group, kept across restarts).  It holds the
  read end of a pipe whose only write end is in the agent, learns the workers' process-group
  ids through it, and on EOF -- which the kernel delivers when the agent dies, even by SIGKILL --
  SIGKILLs those groups, grandchildren included.  A clean stop sends ``q`` instead and the
  watchdog exits without killing anything.  Messages written before the watchdog has even
  started sit in the pipe buffer, so the agent never waits for it to be ready.

What neither covers: a grandchild that leaves its process group (``setsid``, a daemon) and a
process forked (not exec'd) by the agent itself, which would inherit the pipe's write end and keep
the watchdog waiting.  Only cgroups catch the former.

The watchdog runs this file with ``python -I -S``, so the module imports only ``os`` and ``sys``
at the top: ``signal`` alone would add 5 ms (enum) to every watchdog start.  ``ctypes`` (5 ms) is
imported on the first worker start, not at agent start-up.  The watchdog is in its own session,
so terminal and process-group signals meant for the agent do not reach it.

Signals sent to every process.  Slurm (proctrack/cgroup and linuxproc: ``scancel``,
``--signal=USR1@N``) and systemd (``KillMode=control-group``) signal every process of a job
step, not only the agent.  The agent's helpers (this watchdog, the store process, warm
interpreters while they wait) must outlive such a signal and end only by the agent's word or
its pipe closing: they ignore :data:`STEP_SIGNALS`.  The watchdog also *witnesses* them: it
sits where the workers sit (a session of its own, the agent's child), so a signal that reaches
it reached the workers too, from the same sender.  It writes each one's number on a second
pipe, and the agent does not forward a signal its workers already have (``signal_witness``).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see above)
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable

__all__ = [
    "STEP_SIGNALS",
    "WATCHDOG_QUIT",
    "encode_forget",
    "encode_guard",
    "group_exists",
    "ignore_step_signals",
    "killpg",
    "live_group_members",
    "pdeathsig_preexec",
    "signal_name",
    "watchdog_argv",
    "watchdog_main",
    "worker_preexec",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGKILL = 9  # fixed on Linux; spelled out so that the watchdog need not import signal
# SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGTERM: what schedulers and terminals send. The
# same numbers on every Linux architecture we run on (x86-64, arm64, ppc64le).
STEP_SIGNALS = (1, 2, 3, 10, 12, 15)


def signal_name(exitcode: int) -> str:
    """Name of the signal behind a negative returncode ("SIGTERM" for -15); "" for a normal exit."""
    import signal  # already loaded in the agent (asyncio imports it); see the header

    if exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:  # a real-time or otherwise unnamed signal
        return f"signal {-exitcode}"


def killpg(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if the group no longer exists.

    EPERM means a member we may not signal (a setuid helper); the group exists, so True.
    """
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_exists(pgid: int) -> bool:
    """Whether any process, zombies included, still has this process-group id."""
    return killpg(pgid, 0)


def live_group_members(pgids: Collection[int]) -> dict[int, list[int]]:
    """Pids of the non-zombie processes in each of these process groups, from one /proc scan.

    Zombies are left out on purpose: an orphan's zombie lingers until init reaps it (some
    container inits never do), and it holds no memory, pipes or devices.
    """
    wanted = set(pgids)
    members: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 3 or fields[0] in (b"Z", b"X"):
            continue
        pgrp = int(fields[2])
        if pgrp in wanted:
            members.setdefault(pgrp, []).append(int(name))
    return members


_prctl: Callable[..., int] | None = None


def worker_preexec(
    cpus: Collection[int] | None, then: Callable[[], None] | None = None, *, keep: Collection[int] = ()
) -> Callable[[], None]:
    """A worker's (or warm interpreter's) ``preexec_fn``: no descriptor above 2 but ``keep``
    survives its exec, it is bound to ``cpus`` (``--numa-binding``; None: not bound), then
    ``then`` runs.

    The descriptors: uvloop, the agent's loop, implements no ``close_fds``, so without this a
    worker inherited whatever inheritable descriptors the agent was started with (a
    scheduler's pipes) and uvloop's copies of the worker's own stdio, where torchrun's worker
    has 0, 1 and 2 only.  They are marked close-on-exec, not closed: libuv's and uvloop's error
    pipes, already close-on-exec, must stay open until the exec succeeds.

    The binding is set between fork and exec, so the worker's first instruction and every
    thread it starts run there, as under torch's ``numactl --physcpubind``.  A failure (the CPUs
    left the agent's cpuset meanwhile) fails the spawn: a worker silently unbound is a slow job
    nobody can explain."""
    mask = frozenset(cpus) if cpus else None
    kept = frozenset(keep)

    def preexec() -> None:
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            names = []
        for name in names:
            fd = int(name)
            if fd > 2 and fd not in kept:
                try:
                    os.set_inheritable(fd, False)
                except OSError:
                    pass  # the listing's own descriptor, closed by now
        if mask is not None:
            os.sched_setaffinity(0, mask)
        if then is not None:
            then()

    return preexec


def pdeathsig_preexec(sig: int = _SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the spawning thread dies.

    The libc symbol is resolved here, in the parent: the child runs between fork and exec, where
    taking the dynamic loader's lock (which another thread may have held at fork time) could
    deadlock.  The cost is that subprocess must fork() instead of vfork(): measured 0.27 ms ->
    3.2 ms per spawn for a 35 MB agent, growing with its size.  ``setpriv --pdeathsig KILL`` as
    an exec wrapper would keep vfork (the worker pays ~1 ms, in parallel), but it leaves a window
    between exec and its prctl in which an agent death goes unnoticed, needs util-linux, and
    turns a missing executable into an exit status instead of an OSError; we chose the
    preexec_fn, whose getppid() check closes that window.
    """
    global _prctl
    if _prctl is None:
        import ctypes  # deferred: 5 ms, paid at the first worker start, not at agent start-up

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
        _prctl = fn
    prctl = _prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The agent may have died between fork and prctl; then no signal will ever come.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def ignore_step_signals(then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A helper's ``preexec_fn``: :data:`STEP_SIGNALS` ignored from its first instruction on
    (an ignored disposition survives exec), then ``then``. For the agent's helpers, never for
    a worker (see the header); a warm interpreter restores them when it becomes one.

    Under uvloop (the agent's loop where installed) libuv resets every disposition after the
    preexec_fn, before exec: the store process and warm interpreters therefore ignore them
    again as their first act, which leaves their interpreter's start-up (some 20 ms, once per
    agent) as the only window in which a step-wide signal can end them."""
    import signal

    def preexec() -> None:
        for signum in STEP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if then is not None:
            then()

    return preexec


# --- watchdog -------------------------------------------------------------------------------------
#
# Wire format on the pipe, one ASCII line per message:
#   +<pgid>   guard this process group
#   -<pgid>   forget it (its leader was reaped and no live member is left)
#   q         the group was stopped cleanly: exit without killing
# EOF without "q" means the agent is gone: SIGKILL every guarded group, then exit.
# The other way, on the report pipe (when there is one): "<signum>" for each signal received.

WATCHDOG_QUIT = b"q\n"


def watchdog_argv(read_fd: int, remove_on_death: str = "", report_fd: int = -1) -> list[str]:
    """Command line that runs the watchdog on an inherited pipe read end; ``remove_on_death``:
    the agent's private folder (runtime_dir.py), removed if the agent dies; ``report_fd``: an
    inherited pipe write end for the signals it witnesses (-1: none)."""
    here = os.path.abspath(__file__)
    return [sys.executable, "-I", "-S", here, "--watchdog", str(read_fd), str(report_fd), remove_on_death]


def encode_guard(pgid: int) -> bytes:
    return b"+%d\n" % pgid


def encode_forget(pgid: int) -> bytes:
    return b"-%d\n" % pgid


def _apply(groups: set[int], lines: Iterable[bytes]) -> bool:
    """Apply messages to the guarded set; True once a quit was seen."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line == b"q":
            return True
        op, number = line[:1], line[1:]
        if not number.isdigit():  # not from our agent: ignore rather than die and guard nothing
            continue
        if op == b"+":
            groups.add(int(number))
        elif op == b"-":
            groups.discard(int(number))
    return False


def watchdog_main(read_fd: int, remove_on_death: str = "", report_fd: int = -1) -> None:
    """Guard process groups until the agent quits us (no kill) or dies (SIGKILL them all, then
    remove the agent's private folder ``remove_on_death``). Outlive :data:`STEP_SIGNALS`,
    reporting each on ``report_fd``."""
    _witness(report_fd)
    groups: set[int] = set()
    pending = b""
    while True:
        data = os.read(read_fd, 4096)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        if _apply(groups, lines):
            return
    for pgid in groups:
        try:
            os.killpg(pgid, _SIGKILL)
        except OSError:  # ESRCH: already gone; EPERM: nothing more this process could do
            pass
    if remove_on_death:
        _remove_private(remove_on_death)


def _witness(report_fd: int) -> None:
    import _signal  # type: ignore[import-not-found]  # the C module: no enum, no 5 ms (see the header)

    def report(signum: int, _frame: object) -> None:
        if report_fd < 0:
            return
        try:
            os.write(report_fd, b"%d\n" % signum)
        except OSError:  # the agent is gone or not listening: the pipe's EOF tells us the rest
            pass

    for signum in STEP_SIGNALS:
        _signal.signal(signum, report)


def _remove_private(path: str) -> None:
    """runtime_dir.remove_tree, for a process started with -I -S and this file alone (the
    package is not importable here): the agent's private folder, symlinks never followed.
    runtime_dir.py is in node_agent/, the folder above this one; it goes last on the path, so
    that no module of ours there stands in for one of the standard library."""
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from runtime_dir import remove_tree  # type: ignore[import-not-found]
    except ImportError:
        return
    remove_tree(path)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--watchdog":
    watchdog_main(int(sys.argv[2]), sys.argv[4], int(sys.argv[3]))
