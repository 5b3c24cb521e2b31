"""The worker supervisor against real processes and real signals.

Readiness is an event, never a sleep: workers print "ready <pid>" once set up, and the console
stand-in below wakes the test when it sees it.  Only the agent-SIGKILL test polls, because
nothing signals the death of a process that is not our child.  After every test no process
carrying this module's environment marker, and no child of the test process, may be alive.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from node_agent.config import Std
from node_agent.supervisor import procutil
from node_agent.supervisor.console import Console, ConsoleFramer, LineFilter
from node_agent.supervisor.group import WorkerGroup
from node_agent.supervisor.spec import DRAIN_TIMEOUT, GroupResult, WorkerSpawnError, WorkerSpec

WORKERS = Path(__file__).parent.parent / "workers"
MARK_VAR = "NODE_AGENT_SUPERVISOR_TEST"
MARK = uuid.uuid4().hex


# --- helpers --------------------------------------------------------------------------------------


def py(script: str, *args: str) -> list[str]:
    return [sys.executable, "-u", str(WORKERS / script), *args]


def spec(local_rank: int, argv: list[str], **kw: object) -> WorkerSpec:
    env = {**os.environ, "LOCAL_RANK": str(local_rank), MARK_VAR: MARK}
    env.update(kw.pop("extra_env", {}))  # type: ignore[arg-type]
    return WorkerSpec(local_rank=local_rank, rank=local_rank + 10, argv=argv, env=env, **kw)  # type: ignore[arg-type]


class Capture:
    """A console that records bytes and lets a test await a pattern."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._changed = asyncio.Event()

    def write(self, data: bytes) -> int:
        self.data += data
        self._changed.set()
        return len(data)

    def flush(self) -> None:
        pass

    async def wait_for(self, needle: bytes, count: int = 1, timeout: float = 20.0) -> None:
        async def seen() -> None:
            while self.data.count(needle) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(seen(), timeout)

    def lines(self) -> list[str]:
        return bytes(self.data).decode().splitlines()


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie counts as dead (this container's init never reaps orphans)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


async def kill_and_wait(pid: int, timeout: float = 5.0) -> None:
    """SIGKILL a process that is not our child and wait for it to die: its pidfd turns readable."""
    fd = os.pidfd_open(pid)
    loop = asyncio.get_running_loop()
    dead = loop.create_future()
    loop.add_reader(fd, lambda: dead.done() or dead.set_result(None))
    try:
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(dead, timeout)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def marked_processes() -> list[int]:
    found = []
    needle = f"{MARK_VAR}={MARK}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and alive(int(name)):
            found.append(int(name))
    return found


def live_children() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def pids_in(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def by_rank(result: GroupResult) -> dict:
    return {e.local_rank: e for e in result.exits}


# A worker for the console tests: it reports what its stdout/stderr are, leaves a partial line on
# each, and waits at a gate (a FIFO it holds open for reading and writing, so the test's write
# never races its open) before finishing the lines and exiting with argv[2].
CONSOLE_WORKER = r"""
import json, os, sys
gate = os.open(sys.argv[1], os.O_RDWR)
info = {"out_tty": sys.stdout.isatty(), "err_tty": sys.stderr.isatty()}
for name, fd in (("out", 1), ("err", 2)):
    try:
        info[name + "_size"] = list(os.get_terminal_size(fd))
    except OSError:
        info[name + "_size"] = None
print("info " + json.dumps(info, sort_keys=True), flush=True)
sys.stdout.write("prompt> ")
sys.stdout.flush()
sys.stderr.write("progress 1/3\r")
sys.stderr.flush()
os.read(gate, 1)
sys.stdout.write("answered\n")
sys.stdout.flush()
sys.stderr.write("progress 3/3\nfatal: boom\n")
sys.exit(int(sys.argv[2]))
"""


def console_worker(gate: Path, exitcode: int = 0) -> list[str]:
    return [sys.executable, "-c", CONSOLE_WORKER, str(gate), str(exitcode)]


def make_gate(tmp_path: Path) -> Path:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    return gate


def open_gate(gate: Path) -> None:
    fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)  # the worker holds it open: never ENXIO
    try:
        os.write(fd, b"g")
    finally:
        os.close(fd)


def worker_info(screen: bytes) -> dict:
    line = next(line for line in screen.splitlines() if line.startswith(b"info "))
    return json.loads(line[5:])


class Terminal:
    """A pty standing in for the agent's terminal.  ``stream`` (the slave, a real file) is what
    the group writes to and hands to workers; what reaches the screen collects in ``screen``.
    The pty keeps its output processing, so the screen shows "\r\n" for each "\n"."""

    def __init__(self, cols: int = 123, rows: int = 33) -> None:
        import fcntl
        import struct
        import termios

        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.stream = os.fdopen(slave, "wb")
        self.tty = os.ttyname(slave)
        self.screen = Capture()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.master, self._readable)
        self._reading = True

    def _readable(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: no process holds the terminal any more
            data = b""
        if data:
            self.screen.write(data.replace(b"\r\n", b"\n"))
        else:
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.master)
            self._reading = False

    def close(self) -> None:
        self._stop_reading()
        self.stream.close()
        os.close(self.master)


def open_fds() -> set[tuple[str, str]]:
    """This process's descriptors with what each points at (a pipe's inode, a file's path)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # closed while listed (the listing's own descriptor among them)
            pass
    return found


async def leaked_fds(before: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Descriptors opened since `before` and still open. One closed since is no leak (the event
    loop or a thread may hold one a moment at the first count); one opened a moment at the last
    count gets a bounded settle."""
    for _ in range(50):
        new = open_fds() - before
        if not new:
            break
        await asyncio.sleep(0.02)
    return new


GroupFactory = Callable[..., WorkerGroup]


@pytest.fixture
async def make_group() -> AsyncIterator[GroupFactory]:
    """Groups made here are stopped at teardown; then nothing of ours may still run."""
    groups: list[WorkerGroup] = []

    def factory(**kw: object) -> WorkerGroup:
        kw.setdefault("stdout", Capture())
        kw.setdefault("stderr", Capture())
        group = WorkerGroup(**kw)  # type: ignore[arg-type]
        groups.append(group)
        return group

    try:
        yield factory
    finally:
        for group in groups:
            await group.stop(grace=0.0)
        leaked = marked_processes() + live_children()
        for pid in leaked:
            os.kill(pid, signal.SIGKILL)
        assert not leaked, f"processes left running: {leaked}"


# --- output routing -------------------------------------------------------------------------------


async def test_three_workers_succeed_with_plain_console(make_group: GroupFactory) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    await group.start([spec(r, py("echo_rank.py")) for r in range(3)])
    assert sorted(group.pids) == [0, 1, 2]

    result = await asyncio.wait_for(group.wait(), 20)

    assert result.state == "succeeded" and result.first_failure is None
    assert [(e.local_rank, e.rank, e.exitcode, e.signal_name) for e in result.exits] == [
        (0, 10, 0, ""),
        (1, 11, 0, ""),
        (2, 12, 0, ""),
    ]
    assert [e.pid for e in result.exits] == [group.pids[r] for r in range(3)]
    # torchrun's default look: unprefixed, one whole line per write.
    assert sorted(out.lines()) == [f"out from rank {r}" for r in range(3)]
    assert sorted(err.lines()) == [f"err from rank {r}" for r in range(3)]
    assert (await group.stop(grace=1.0)).state == "succeeded"


async def test_tee_prefixes_console_lines_and_writes_plain_files(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    specs = [
        spec(
            r,
            py("echo_rank.py"),
            tee=Std.ALL,
            stdout_path=str(tmp_path / f"{r}.out"),
            stderr_path=str(tmp_path / f"{r}.err"),
            prefix=f"[default{r}]:",
        )
        for r in range(2)
    ]
    await group.start(specs)
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    await group.stop(grace=1.0)

    assert sorted(out.lines()) == ["[default0]:out from rank 0", "[default1]:out from rank 1"]
    assert sorted(err.lines()) == ["[default0]:err from rank 0", "[default1]:err from rank 1"]
    for r in range(2):
        assert (tmp_path / f"{r}.out").read_text() == f"out from rank {r}\n"
        assert (tmp_path / f"{r}.err").read_text() == f"err from rank {r}\n"


async def test_tee_of_one_stream_leaves_the_other_plain(make_group: GroupFactory, tmp_path: Path) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    await group.start(
        [spec(0, py("echo_rank.py"), tee=Std.ERR, stderr_path=str(tmp_path / "e"), prefix="[default0]:")]
    )
    await asyncio.wait_for(group.wait(), 20)
    await group.stop(grace=1.0)
    assert out.lines() == ["out from rank 0"]
    assert err.lines() == ["[default0]:err from rank 0"]


async def test_redirect_writes_only_files(make_group: GroupFactory, tmp_path: Path) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    await group.start(
        [
            spec(
                0,
                py("echo_rank.py"),
                redirect=Std.ALL,
                stdout_path=str(tmp_path / "out.log"),
                stderr_path=str(tmp_path / "err.log"),
                prefix="[default0]:",
            )
        ]
    )
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    await group.stop(grace=1.0)
    assert out.data == b"" and err.data == b""
    assert (tmp_path / "out.log").read_text() == "out from rank 0\n"
    assert (tmp_path / "err.log").read_text() == "err from rank 0\n"


async def test_console_false_drops_console_but_keeps_files(make_group: GroupFactory, tmp_path: Path) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    await group.start(
        [
            spec(
                0,
                py("echo_rank.py"),
                tee=Std.ALL,
                stdout_path=str(tmp_path / "out.log"),
                stderr_path=str(tmp_path / "err.log"),
                console=False,
                prefix="[default0]:",
            )
        ]
    )
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    await group.stop(grace=1.0)
    assert out.data == b"" and err.data == b""
    assert (tmp_path / "out.log").read_text() == "out from rank 0\n"
    assert (tmp_path / "err.log").read_text() == "err from rank 0\n"


async def test_console_false_without_files_still_keeps_the_stderr_tail(make_group: GroupFactory) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    await group.start([spec(0, py("echo_rank.py", "3"), console=False)])
    result = await asyncio.wait_for(group.wait(), 20)
    await group.stop(grace=1.0)
    assert out.data == b"" and err.data == b""
    assert result.exits[0].error_message == "err from rank 0"


async def test_text_console_gets_bytes_through_its_buffer(make_group: GroupFactory) -> None:
    raw = io.BytesIO()
    text = io.TextIOWrapper(raw, encoding="utf-8")
    text.write("agent line\n")  # unflushed text of the agent's own goes out first
    group = make_group(stdout=text)
    await group.start([spec(0, py("echo_rank.py"))])
    await asyncio.wait_for(group.wait(), 20)
    await group.stop(grace=1.0)
    assert raw.getvalue() == b"agent line\nout from rank 0\n"


async def test_one_mib_line_without_newline_arrives_intact(make_group: GroupFactory, tmp_path: Path) -> None:
    n = 1 << 20
    expected = (b"0123456789abcdef" * (n // 16 + 1))[:n]
    out = Capture()
    teed_out = Capture()
    plain = make_group(stdout=out)
    teed = make_group(stdout=teed_out)
    await plain.start([spec(0, py("long_line.py", str(n)))])
    await teed.start(
        [
            spec(
                0,
                py("long_line.py", str(n)),
                tee=Std.OUT,
                stdout_path=str(tmp_path / "o"),
                prefix="[default0]:",
            )
        ]
    )
    assert (await asyncio.wait_for(plain.wait(), 20)).state == "succeeded"
    assert (await asyncio.wait_for(teed.wait(), 20)).state == "succeeded"
    await plain.stop(grace=1.0)
    await teed.stop(grace=1.0)

    assert bytes(out.data) == expected
    # One prefix for the one line, ended so the next rank's prefix starts a line of its own.
    assert bytes(teed_out.data) == b"[default0]:" + expected + b"\n"
    assert (tmp_path / "o").read_bytes() == expected


@pytest.mark.parametrize("teed", [False, True], ids=["plain", "teed"])
async def test_partial_lines_reach_the_console_while_the_worker_waits(
    make_group: GroupFactory, tmp_path: Path, teed: bool
) -> None:
    out, err = Capture(), Capture()
    group = make_group(stdout=out, stderr=err)
    gate = make_gate(tmp_path)
    kw: dict[str, object] = {}
    if teed:
        kw = dict(
            tee=Std.ALL, stdout_path=str(tmp_path / "o"), stderr_path=str(tmp_path / "e"), prefix="[d0]:"
        )
    p = b"[d0]:" if teed else b""
    await group.start([spec(0, console_worker(gate), **kw)])

    await err.wait_for(p + b"progress 1/3\r")  # while the worker waits for us
    await out.wait_for(p + b"prompt> ")
    open_gate(gate)
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    await group.stop(grace=1.0)

    info = {"err_size": None, "err_tty": False, "out_size": None, "out_tty": False}
    assert (
        bytes(out.data)
        == p + b"info " + json.dumps(info, sort_keys=True).encode() + b"\n" + p + b"prompt> answered\n"
    )
    # Teed: the redrawn line keeps its prefix, the continuation gets none.
    assert bytes(err.data) == p + b"progress 1/3\r" + p + b"progress 3/3\n" + p + b"fatal: boom\n"
    if teed:
        assert (tmp_path / "e").read_bytes() == b"progress 1/3\rprogress 3/3\nfatal: boom\n"


async def _on_a_terminal(group: WorkerGroup, term: Terminal, tmp_path: Path, logs: list[str]) -> None:
    """Workers see the agent's terminal; stderr's tail still makes the failure message."""
    gate = make_gate(tmp_path)
    await group.start([spec(0, console_worker(gate, exitcode=3), error_file=str(tmp_path / "none.json"))])
    pid = group.pids[0]

    await term.screen.wait_for(b"progress 1/3\r")  # through the pty, while the worker waits
    await term.screen.wait_for(b"prompt> ")  # straight to the terminal
    assert worker_info(bytes(term.screen.data)) == {
        "err_size": [123, 33],
        "err_tty": True,
        "out_size": [123, 33],
        "out_tty": True,
    }
    assert os.readlink(f"/proc/{pid}/fd/1") == term.tty  # stdout is the terminal itself
    pty = os.readlink(f"/proc/{pid}/fd/2")
    assert pty.startswith("/dev/pts/") and pty != term.tty
    open_gate(gate)
    result = await asyncio.wait_for(group.wait(), 20)
    stopped = await group.stop(grace=1.0)

    failure = result.first_failure
    assert failure is not None and failure.exitcode == 3
    assert failure.error_message == "progress 1/3\nprogress 3/3\nfatal: boom"
    assert stopped.first_failure == failure
    worker = group._workers[0]  # test-only peek: the bytes as written (no "\r\n" from the pty)
    assert bytes(worker.sinks[2]._tail or b"") == b"progress 1/3\rprogress 3/3\nfatal: boom\n"
    assert worker.ptys == {}  # the master is closed
    await term.screen.wait_for(b"fatal: boom\n")
    screen = bytes(term.screen.data)
    at = screen.index
    assert at(b"prompt> ") < at(b"answered\n") and at(b"progress 1/3\r") < at(b"answered\n")
    assert not [line for line in logs if "still open" in line]  # EOF came when the worker exited


async def test_on_a_terminal_workers_see_one_and_stderr_still_feeds_the_report(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    term = Terminal()
    logs: list[str] = []
    try:
        group = make_group(stdout=term.stream, stderr=term.stream, log=logs.append)
        await _on_a_terminal(group, term, tmp_path, logs)
    finally:
        term.close()


def test_on_a_terminal_under_uvloop(tmp_path: Path) -> None:
    """The agent runs under uvloop: the same through its add_reader and subprocess transport."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        term = Terminal()
        logs: list[str] = []
        group = WorkerGroup(stdout=term.stream, stderr=term.stream, log=logs.append)
        try:
            await _on_a_terminal(group, term, tmp_path, logs)
        finally:
            await group.stop(grace=0.0)
            term.close()

    uvloop.run(main())
    leaked = marked_processes() + live_children()
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert not leaked


async def test_stop_is_bounded_when_an_escaped_process_holds_the_stderr_pty(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    logs: list[str] = []
    term = Terminal()
    group = make_group(stdout=term.stream, stderr=term.stream, log=logs.append)
    pidfile = tmp_path / "pids"
    try:
        await group.start([spec(0, py("block.py", "--child", "escape", "--pidfile", str(pidfile)))])
        await term.screen.wait_for(b"ready ")
        _, escaped = pids_in(pidfile)
        assert os.readlink(f"/proc/{escaped}/fd/2").startswith("/dev/pts/")
        try:
            t0 = time.monotonic()
            await group.stop(grace=5.0)
            assert time.monotonic() - t0 < DRAIN_TIMEOUT + 3
            assert any("still open" in line for line in logs)
            assert group._workers[0].ptys == {}  # closed though a process still holds the slave
        finally:
            await kill_and_wait(escaped)
    finally:
        term.close()


async def test_no_descriptor_is_left_open_across_restarts(make_group: GroupFactory, tmp_path: Path) -> None:
    term = Terminal()
    group = make_group(stdout=term.stream, stderr=term.stream)

    def specs(k: int) -> list[WorkerSpec]:
        d = tmp_path / str(k)
        d.mkdir()
        return [
            spec(0, py("echo_rank.py")),  # stdout: the terminal; stderr: a pty
            spec(
                1,
                py("echo_rank.py"),
                tee=Std.ALL,
                stdout_path=str(d / "1.out"),
                stderr_path=str(d / "1.err"),
                prefix="[d1]:",
                duplicate_stdout_filters=("out",),
                filtered_stdout_path=str(d / "filtered_stdout.log"),
                duplicate_stderr_filters=("err",),
                filtered_stderr_path=str(d / "filtered_stderr.log"),
            ),
            spec(2, py("block.py", "--child", "plain")),  # stopped with a grandchild on the pty
            spec(
                3,
                py("echo_rank.py"),
                redirect=Std.ALL,
                stdout_path=str(d / "3.out"),
                stderr_path=str(d / "3.err"),
            ),
            spec(4, py("echo_rank.py"), console=False),  # stdout: /dev/null; stderr: a pipe
        ]

    try:

        async def cycle(k: int) -> None:
            await group.start(specs(k))
            await term.screen.wait_for(b"ready ", count=k + 1)
            await group.stop(grace=1.0, keep_watchdog=True)

        await cycle(0)  # anything opened once per agent (the watchdog's pipe) is open from here on
        before = open_fds()
        for k in range(1, 4):
            await cycle(k)
        assert await leaked_fds(before) == set()
        assert (tmp_path / "3" / "filtered_stderr.log").exists()
    finally:
        term.close()


async def test_duplicate_filters_copy_the_teed_lines_of_shown_ranks(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    """torchrun's --duplicate-*-filters: matching lines of the tee'd streams of the ranks shown
    on the console, prefixed, in one file per attempt; the file exists whenever filters do."""
    worker = [
        sys.executable,
        "-c",
        "import os, sys; r = os.environ['LOCAL_RANK']; "
        "sys.stdout.write(f'step loss={r}\\nnoise {r}\\nlast loss {r}'); "
        "sys.stderr.write(f'warn {r}\\nquiet\\n')",
    ]
    out_filtered, err_filtered = tmp_path / "filtered_stdout.log", tmp_path / "filtered_stderr.log"
    filters = dict(
        duplicate_stdout_filters=("loss",),
        filtered_stdout_path=str(out_filtered),
        duplicate_stderr_filters=["warn"],
        filtered_stderr_path=str(err_filtered),
    )

    def teed(r: int, which: Std, **kw: object) -> WorkerSpec:
        paths = dict(stdout_path=str(tmp_path / f"{r}.out"), stderr_path=str(tmp_path / f"{r}.err"))
        return spec(r, worker, tee=which, prefix=f"[default{r}]:", **paths, **filters, **kw)  # type: ignore[arg-type]

    out = Capture()
    group = make_group(stdout=out)
    await group.start(
        [
            teed(0, Std.ALL),
            teed(1, Std.OUT, console=False),  # not shown: torchrun leaves it out too
            spec(2, worker, **filters),  # not tee'd
            teed(3, Std.OUT),
        ]
    )
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    await group.stop(grace=1.0)

    text = out_filtered.read_text()
    assert text.endswith("\n")
    assert sorted(text.splitlines()) == [
        "[default0]:last loss 0",
        "[default0]:step loss=0",
        "[default3]:last loss 3",
        "[default3]:step loss=3",
    ]
    assert err_filtered.read_text() == "[default0]:warn 0\n"

    quiet = make_group()
    only = tmp_path / "only"
    only.mkdir()
    await quiet.start(
        [spec(0, worker, duplicate_stdout_filters=("loss",), filtered_stdout_path=str(only / "f.log"))]
    )
    await asyncio.wait_for(quiet.wait(), 20)
    await quiet.stop(grace=1.0)
    assert (only / "f.log").read_text() == ""


# --- failure, stop, signals -----------------------------------------------------------------------


async def test_first_failure_is_reported_at_once_and_stop_terminates_the_rest(
    make_group: GroupFactory,
) -> None:
    out = Capture()
    group = make_group(stdout=out)
    await group.start([spec(0, py("block.py")), spec(1, py("echo_rank.py", "3")), spec(2, py("block.py"))])

    t0 = time.monotonic()
    result = await asyncio.wait_for(group.wait(), 20)
    assert time.monotonic() - t0 < 5
    assert result.state == "failed"
    assert result.first_failure is not None
    assert (result.first_failure.local_rank, result.first_failure.exitcode) == (1, 3)
    assert result.first_failure.error_message == "err from rank 1"
    assert alive(group.pids[0]) and alive(group.pids[2])  # the others keep running until stop()

    stopped = await group.stop(grace=10.0)
    exits = by_rank(stopped)
    assert sorted(exits) == [0, 1, 2]
    assert (exits[0].exitcode, exits[0].signal_name) == (-signal.SIGTERM, "SIGTERM")
    assert (exits[2].exitcode, exits[2].signal_name) == (-signal.SIGTERM, "SIGTERM")
    assert stopped.first_failure is not None and stopped.first_failure.local_rank == 1
    assert await group.wait() is stopped


async def test_trapped_sigterm_is_seen_by_the_worker(make_group: GroupFactory, tmp_path: Path) -> None:
    out = Capture()
    group = make_group(stdout=out)
    seen = tmp_path / "signal"
    await group.start([spec(0, py("block.py", "--trap", str(seen)))])
    await out.wait_for(b"ready ")

    result = await group.stop(grace=10.0)

    assert seen.read_text() == "SIGTERM"
    assert (result.exits[0].exitcode, result.exits[0].signal_name) == (7, "")


async def test_ignored_sigterm_is_followed_by_sigkill_after_grace(make_group: GroupFactory) -> None:
    logs: list[str] = []
    out = Capture()
    group = make_group(stdout=out, log=logs.append)
    await group.start([spec(0, py("block.py", "--ignore-term"))])
    await out.wait_for(b"ready ")

    t0 = time.monotonic()
    result = await group.stop(grace=0.5)
    elapsed = time.monotonic() - t0

    assert 0.5 <= elapsed < 5
    assert (result.exits[0].exitcode, result.exits[0].signal_name) == (-signal.SIGKILL, "SIGKILL")
    assert sum("SIGKILL" in line for line in logs) == 1  # the escalation is logged once


async def test_grandchildren_die_with_their_worker(make_group: GroupFactory, tmp_path: Path) -> None:
    out = Capture()
    group = make_group(stdout=out)
    pidfile = tmp_path / "pids"
    # One grandchild dies of the SIGTERM to the group; the other ignores it and is a leftover.
    await group.start(
        [spec(0, py("block.py", "--child", "plain", "--child", "ignore-term", "--pidfile", str(pidfile)))]
    )
    await out.wait_for(b"ready ")
    worker, *grandchildren = pids_in(pidfile)
    assert worker == group.pids[0] and all(alive(p) for p in grandchildren)

    t0 = time.monotonic()
    result = await group.stop(grace=10.0)

    assert time.monotonic() - t0 < 5  # the worker exited on SIGTERM: no waiting out the grace
    assert result.exits[0].signal_name == "SIGTERM"
    assert [p for p in grandchildren if alive(p)] == []  # gone when stop() returns, no polling


async def test_exit_is_noticed_while_a_grandchild_holds_the_pipes(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    out = Capture()
    group = make_group(stdout=out)
    pidfile = tmp_path / "pids"
    await group.start([spec(0, py("block.py", "--child", "plain", "--pidfile", str(pidfile), "--exit", "3"))])

    result = await asyncio.wait_for(group.wait(), 10)

    assert result.state == "failed" and result.exits[0].exitcode == 3
    _, grandchild = pids_in(pidfile)
    assert alive(grandchild)  # still holding stdout/stderr: exit detection did not wait for EOF
    await group.stop(grace=5.0)
    assert not alive(grandchild)  # a leftover of the worker's process group


async def test_stop_is_bounded_when_an_escaped_process_holds_the_output(
    make_group: GroupFactory, tmp_path: Path
) -> None:
    logs: list[str] = []
    out = Capture()
    group = make_group(stdout=out, log=logs.append)
    pidfile = tmp_path / "pids"
    await group.start([spec(0, py("block.py", "--child", "escape", "--pidfile", str(pidfile)))])
    await out.wait_for(b"ready ")
    _, escaped = pids_in(pidfile)
    try:
        t0 = time.monotonic()
        result = await group.stop(grace=5.0)
        assert time.monotonic() - t0 < DRAIN_TIMEOUT + 3
        assert result.exits[0].signal_name == "SIGTERM"
        assert any("still open" in line for line in logs)
    finally:
        await kill_and_wait(escaped)  # out of our reach by design: it left the group


async def test_send_signal_reaches_every_worker(make_group: GroupFactory) -> None:
    out = Capture()
    group = make_group(stdout=out)
    await group.start([spec(0, py("block.py")), spec(1, py("block.py"))])
    await out.wait_for(b"ready ", count=2)

    group.send_signal(signal.SIGUSR1)
    result = await asyncio.wait_for(group.wait(), 10)

    assert result.state == "failed"
    assert result.first_failure is not None and result.first_failure.signal_name == "SIGUSR1"
    stopped = await group.stop(grace=5.0)
    assert [e.signal_name for e in stopped.exits] == ["SIGUSR1", "SIGUSR1"]


async def test_stop_is_idempotent_and_the_group_restarts(make_group: GroupFactory) -> None:
    group = make_group()
    empty = await group.stop(grace=1.0)  # before any start
    assert (empty.state, empty.exits) == ("succeeded", ())

    await group.start([spec(0, py("echo_rank.py", "5"))])
    first_pid = group.pids[0]
    await asyncio.wait_for(group.wait(), 20)
    first = await group.stop(grace=1.0)
    assert await group.stop(grace=1.0) is first
    assert first.exits[0].exitcode == 5

    await group.start([spec(0, py("echo_rank.py"))])  # the next attempt
    assert group.pids[0] != first_pid
    assert (await asyncio.wait_for(group.wait(), 20)).state == "succeeded"
    # Starting again without stop() is fine once everything exited; over running workers it is not.
    await group.start([spec(0, py("block.py"))])
    with pytest.raises(RuntimeError, match="stop"):
        await group.start([spec(0, py("block.py"))])
    await group.stop(grace=5.0)


async def test_cancelled_stop_kills_at_once_and_a_later_stop_reaps(make_group: GroupFactory) -> None:
    out = Capture()
    group = make_group(stdout=out)
    await group.start([spec(0, py("block.py", "--ignore-term"))])
    await out.wait_for(b"ready ")
    stopping = asyncio.ensure_future(group.stop(grace=60.0))
    await asyncio.sleep(0)  # let it send SIGTERM and start waiting out the grace
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping

    result = await asyncio.wait_for(group.stop(grace=60.0), 10)  # no second grace: already killed
    assert result.exits[0].signal_name == "SIGKILL"


async def test_spawn_failure_stops_the_started_and_names_the_executable(make_group: GroupFactory) -> None:
    group = make_group()
    missing = "/nonexistent/train-binary"
    with pytest.raises(WorkerSpawnError) as info:
        await group.start([spec(0, py("block.py")), spec(1, [missing, "--flag"])])

    assert info.value.errno == errno.ENOENT and info.value.local_rank == 1
    assert missing in str(info.value) and "No such file or directory" in str(info.value)
    started = group.pids[0]
    assert not alive(started)
    assert group._watchdog is not None and group._watchdog.proc.returncode == 0
    assert (await group.wait()).exits[0].signal_name == "SIGKILL"


# --- error messages -------------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_error_file_of_a_torch_record_worker(make_group: GroupFactory, tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": "stale, from an earlier run"}')
    group = make_group()
    await group.start(
        [
            spec(
                0,
                py("record_fail.py"),
                error_file=str(error_file),
                extra_env={"TORCHELASTIC_ERROR_FILE": str(error_file)},
            )
        ]
    )
    result = await asyncio.wait_for(group.wait(), 150)
    await group.stop(grace=1.0)

    failure = result.first_failure
    assert failure is not None and failure.exitcode == 1
    assert failure.error_message.startswith("ValueError: boom 42\nTraceback")
    assert failure.error_record is not None
    assert failure.error_record["message"]["message"] == "ValueError: boom 42"


@pytest.mark.parametrize("redirected", [False, True], ids=["piped", "redirected"])
async def test_stderr_tail_is_the_message_without_an_error_file(
    make_group: GroupFactory, tmp_path: Path, redirected: bool
) -> None:
    group = make_group()
    kw: dict[str, object] = {"error_file": str(tmp_path / "never-written.json")}
    if redirected:  # stderr goes straight to the file: the tail is read back from it
        kw.update(redirect=Std.ERR, stderr_path=str(tmp_path / "err.log"))
    await group.start([spec(0, py("stderr_fail.py"), **kw)])
    result = await asyncio.wait_for(group.wait(), 20)
    await group.stop(grace=1.0)

    failure = result.first_failure
    assert failure is not None and failure.exitcode == 2 and failure.error_record is None
    assert failure.error_message.splitlines() == [f"stderr line {i}" for i in range(10, 30)]


# --- agent death ----------------------------------------------------------------------------------


@pytest.mark.parametrize("restarted", [False, True], ids=["first-attempt", "after-a-restart"])
async def test_sigkill_of_the_agent_leaves_no_process(tmp_path: Path, restarted: bool) -> None:
    out_path = tmp_path / "pids.json"
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKERS / "agent_main.py"),
        str(out_path),
        *(["restarted"] if restarted else []),
        stdout=subprocess.PIPE,
        env={**os.environ, MARK_VAR: MARK},
    )
    try:
        assert agent.stdout is not None
        line = await asyncio.wait_for(agent.stdout.readline(), 60)
        assert line == b"ready\n"
        pids = json.loads(out_path.read_text())
        everyone = [*pids["workers"], *pids["grandchildren"], pids["watchdog"]]
        assert len(pids["grandchildren"]) == 4 and all(alive(p) for p in everyone)
        if restarted:  # the second attempt's workers are guarded by the first one's watchdog
            assert pids["first_watchdog"] == pids["watchdog"]
    finally:
        agent.kill()
        await agent.wait()

    # No event announces another process's death: poll, briefly and with a bound.
    deadline = time.monotonic() + 2.0
    while any(alive(p) for p in everyone) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    survivors = [p for p in everyone if alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    assert marked_processes() == []


# --- the watchdog alone ---------------------------------------------------------------------------


async def _guarded_sleep_and_watchdog() -> tuple[asyncio.subprocess.Process, asyncio.subprocess.Process, int]:
    sleeper = await asyncio.create_subprocess_exec("sleep", "1000", start_new_session=True)
    read_fd, write_fd = os.pipe()
    try:
        watchdog = await asyncio.create_subprocess_exec(
            *procutil.watchdog_argv(read_fd), pass_fds=(read_fd,), start_new_session=True
        )
    finally:
        os.close(read_fd)
    os.write(write_fd, procutil.encode_guard(sleeper.pid))
    return sleeper, watchdog, write_fd


async def test_watchdog_kills_guarded_groups_on_eof() -> None:
    sleeper, watchdog, write_fd = await _guarded_sleep_and_watchdog()
    os.close(write_fd)  # what the agent's death looks like from the other end
    assert await asyncio.wait_for(watchdog.wait(), 10) == 0
    assert await asyncio.wait_for(sleeper.wait(), 10) == -signal.SIGKILL


async def test_watchdog_quits_quietly_after_a_clean_stop() -> None:
    sleeper, watchdog, write_fd = await _guarded_sleep_and_watchdog()
    os.write(write_fd, procutil.WATCHDOG_QUIT)
    os.close(write_fd)
    try:
        assert await asyncio.wait_for(watchdog.wait(), 10) == 0
        assert sleeper.returncode is None and alive(sleeper.pid)
    finally:
        sleeper.kill()
        await sleeper.wait()


# --- pure pieces ----------------------------------------------------------------------------------


def test_console_framer_writes_partial_lines_at_once_prefixed_only_at_line_starts() -> None:
    f = ConsoleFramer()
    r0 = object()
    assert f.write(r0, b"ab", b"[r0]:") == b"[r0]:ab"
    assert f.write(r0, b"c\nde", b"[r0]:") == b"c\n[r0]:de"  # the continuation: no second prefix
    assert f.write(r0, b"f\n\ng\n", b"[r0]:") == b"f\n[r0]:\n[r0]:g\n"
    assert f.write(r0, b"tail", b"[r0]:") == b"[r0]:tail"
    assert f.end(r0) == b"\n"  # so that what follows starts a line of its own
    assert f.end(r0) == b""


def test_console_framer_keeps_the_prefix_of_a_line_redrawn_with_carriage_returns() -> None:
    f = ConsoleFramer()
    r0 = object()
    assert f.write(r0, b" 10%\r 20%\r", b"[r0]:") == b"[r0]: 10%\r[r0]: 20%\r"
    assert f.write(r0, b" 30%", b"[r0]:") == b"[r0]: 30%"
    # "\r\n" is one line end, also when it is cut between two reads.
    assert f.write(r0, b"\r", b"[r0]:") == b"\r"
    assert f.write(r0, b"\nnext\r\n", b"[r0]:") == b"\n[r0]:next\r\n"
    assert f.at_line_start


def test_console_framer_gives_every_prefixed_line_to_one_rank() -> None:
    f = ConsoleFramer()
    r0, r1 = object(), object()
    assert f.write(r0, b"loading", b"[r0]:") == b"[r0]:loading"
    # r1 does not continue r0's partial line: it starts its own, and so does r0's continuation.
    assert f.write(r1, b"hello\n", b"[r1]:") == b"\n[r1]:hello\n"
    assert f.write(r0, b"... done\n", b"[r0]:") == b"[r0]:... done\n"
    assert f.write(r1, b"50%\r", b"[r1]:") == b"[r1]:50%\r"
    assert f.write(r0, b"x", b"[r0]:") == b"\n[r0]:x"  # a redrawn bar is left in place, too
    assert f.end(r1) == b""  # not its line any more


def test_console_framer_resumes_an_interrupted_line_without_an_empty_one() -> None:
    f = ConsoleFramer()
    r0, r1 = object(), object()
    assert f.write(r0, b"\rrank 0 1/3", b"[r0]:") == b"\r[r0]:rank 0 1/3"  # tqdm's leading "\r"
    assert f.write(r1, b"\rrank 1 1/3", b"[r1]:") == b"\n\r[r1]:rank 1 1/3"
    assert f.write(r0, b"\n", b"[r0]:") == b"\n"  # only the break: r0's line was already ended
    assert f.write(r0, b"\n", b"[r0]:") == b"[r0]:\n"  # an empty line of its own is kept
    assert f.write(r1, b"\r\ndone\n", b"[r1]:") == b"[r1]:done\n"
    # The agent's own line: whoever left a partial line, it is ended first.
    assert f.write(r0, b"50%", b"[r0]:") == b"[r0]:50%"
    assert f.break_line() == b"\n"
    assert f.break_line() == b""
    assert f.write(r0, b" 60%", b"[r0]:") == b"[r0]: 60%"
    plain = object()
    assert f.write(plain, b"x") == b"\nx"
    assert f.break_line() == b"\n"
    assert f.write(plain, b"\ny\n") == b"y\n"


def test_fresh_line_ends_partial_worker_lines_before_the_agents_own(tmp_path: Path) -> None:
    out, err = Capture(), Capture()
    group = WorkerGroup(stdout=out, stderr=err)
    group._stderr.write(object(), b"50%")  # what a worker's stderr left, through us
    group._stdout.write(object(), b"prompt> ")
    group.fresh_line()
    group.fresh_line()
    assert bytes(err.data) == b"50%\n" and bytes(out.data) == b"prompt> "  # different streams
    with open(tmp_path / "screen", "wb") as screen:  # one file for both: both are ended
        group = WorkerGroup(stdout=screen, stderr=screen)
        group._stdout.write(object(), b"prompt> ")
        group.fresh_line()
    assert (tmp_path / "screen").read_bytes() == b"prompt> \n"


def test_console_framer_passes_plain_writers_on_exactly() -> None:
    f = ConsoleFramer()
    a, b, teed = object(), object(), object()
    assert f.write(a, b"progress 1/3\r") == b"progress 1/3\r"
    assert f.write(b, b"prompt> ") == b"prompt> "  # plain after plain: torchrun's bytes
    assert f.end(b) == b""
    assert f.write(teed, b"x\n", b"[t]:") == b"\n[t]:x\n"  # a prefixed line starts a line
    assert f.write(teed, b"partial", b"[t]:") == b"[t]:partial"
    assert f.write(a, b"plain\n") == b"\nplain\n"  # and is not continued by a plain writer
    assert f.write(a, b"") == b""


def test_text_only_console_decodes_a_character_cut_between_reads() -> None:
    text = io.StringIO()
    console = Console(text, "stdout", print)
    r0, r1 = object(), object()
    console.write(r0, b"caf\xc3")
    console.write(r1, b"\xe2\x82")  # another writer's cut character does not mix with it
    console.write(r0, b"\xa9 ")
    console.write(r1, b"\xac\n")
    console.write(r0, b"\xff")
    console.end(r0)
    assert text.getvalue() == "café €\n�"
    assert Console(text, "stdout", print).fileno() is None


def test_line_filter_copies_matching_lines_prefixed_as_torchrun_reads_them() -> None:
    f = LineFilter(["loss", "a,b"], b"[r0]:")
    assert f.feed(b"step 1 lo") == b""
    assert f.feed(b"ss=0.5\nother\nhas a,b\n") == b"[r0]:step 1 loss=0.5\n[r0]:has a,b\n"
    # "\r", "\r\n" and "\n" each end a line (a "\r\n" cut between reads is one end).
    assert f.feed(b" 10% loss=1\r 20% loss=2\r") == b"[r0]: 10% loss=1\n[r0]: 20% loss=2\n"
    assert f.feed(b"\nloss at the end") == b""
    assert f.finish() == b"[r0]:loss at the end\n"
    assert f.finish() == b""


def test_line_filter_judges_an_overlong_line_by_its_first_part() -> None:
    f = LineFilter(["loss"], b"[r0]:", max_line=8)
    assert f.feed(b"loss=1 and more") == b"[r0]:loss=1 and more"
    assert f.feed(b" still\nnot this one, long\nshort loss\n") == b" still\n[r0]:short loss\n"
    assert LineFilter([""]).feed(b"x\n") == b""  # an empty string matches nothing


def test_signal_names() -> None:
    assert procutil.signal_name(-15) == "SIGTERM"
    assert procutil.signal_name(-9) == "SIGKILL"
    assert procutil.signal_name(0) == ""
    assert procutil.signal_name(3) == ""


def test_spec_requires_paths_for_redirected_streams() -> None:
    with pytest.raises(ValueError, match="stdout_path"):
        spec(0, ["x"], redirect=Std.OUT)
    with pytest.raises(ValueError, match="stderr_path"):
        spec(0, ["x"], tee=Std.ERR)
    with pytest.raises(ValueError, match="empty argv"):
        spec(0, [])
    with pytest.raises(ValueError, match="filtered_stdout_path"):
        spec(0, ["x"], duplicate_stdout_filters=("loss",))
    with pytest.raises(ValueError, match="filtered_stderr_path"):
        spec(0, ["x"], duplicate_stderr_filters=("loss",))
    with pytest.raises(TypeError, match="sequence of strings"):
        spec(0, ["x"], duplicate_stdout_filters="loss", filtered_stdout_path="f")
    assert spec(
        0, ["x"], duplicate_stdout_filters=["a"], filtered_stdout_path="f"
    ).duplicate_stdout_filters == ("a",)


async def test_a_restart_keeps_the_watchdog_and_the_last_stop_ends_it(make_group: GroupFactory) -> None:
    group = make_group()
    await group.start([spec(0, py("block.py"))])
    watchdog = group._watchdog
    assert watchdog is not None
    await group.stop(grace=1.0, keep_watchdog=True)
    assert watchdog.proc.poll() is None and not watchdog.guarded  # idle, guarding nothing
    await group.start([spec(0, py("block.py")), spec(1, py("block.py"))])
    assert group._watchdog is watchdog and watchdog.guarded == set(group.pids.values())
    await group.stop(grace=1.0)
    assert watchdog.proc.returncode == 0  # released, not fired: it killed nothing
    await group.start([spec(0, py("block.py"))])  # a group stopped for good can still start again
    assert group._watchdog is not watchdog and group._watchdog is not None
