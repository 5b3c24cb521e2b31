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

from node_agent import procutil
from node_agent.config import Std
from node_agent.supervisor import (
    DRAIN_TIMEOUT,
    ConsoleFramer,
    GroupResult,
    WorkerGroup,
    WorkerSpawnError,
    WorkerSpec,
)

WORKERS = Path(__file__).parent / "workers"
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


def test_console_framer_prefixes_whole_lines_across_chunks() -> None:
    f = ConsoleFramer(b"[r0]:")
    assert f.feed(b"ab") == b""
    assert f.feed(b"c\nde") == b"[r0]:abc\n"
    assert f.feed(b"f\n\ng\n") == b"[r0]:def\n[r0]:\n[r0]:g\n"
    assert f.feed(b"tail") == b""
    assert f.finish() == b"[r0]:tail\n"


def test_console_framer_passes_overlong_partial_lines_on_once_prefixed() -> None:
    f = ConsoleFramer(b"[r0]:", max_pending=4)
    assert f.feed(b"abcdef") == b"[r0]:abcdef"
    assert f.feed(b"gh\nij") == b"gh\n"
    assert f.finish() == b"[r0]:ij\n"
    plain = ConsoleFramer(max_pending=4)
    assert plain.feed(b"abcdef") == b"abcdef"
    assert plain.feed(b"x") == b""
    assert plain.finish() == b"x"  # unprefixed output is passed on exactly


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
