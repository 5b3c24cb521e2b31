"""A real node-agent against a hostile rendezvous server (issue 17, the agent's side).

Each test runs the real ``node-agent`` command as a subprocess and points it at a server the
test scripts itself (``FakeServer``: asyncio and our protocol codec, nothing else), or at a
real ``rdzv-server``. The server says what a buggy or hostile one could: a second assignment,
another job's id, restart counters past the agent's budget, texts with ANSI escapes and forged
lines, 65,536-character reasons, or nothing at all after a failure report. What is asserted is
what a person sees: the agent's exit code, its terminal, its workers stopped (never SIGKILLed
over a text), and what the agent sent on the wire.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from protocol import (
    CLIENT_MESSAGES,
    MAGIC,
    MAX_TEXT_LEN,
    SERVER_MESSAGES,
    Assignment,
    Drain,
    Error,
    Failure,
    FrameDecoder,
    Heartbeat,
    Hello,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Left,
    Message,
    Restart,
    Resume,
    Resumed,
    Waiting,
    Welcome,
    WorkersFailed,
    WorkersSucceeded,
    encode,
)

from .procs import WORKERS, Proc, agent_cmd, free_port, start_server

SLEEPER = str(WORKERS / "sleeper.py")
JOB = "attack-agent"
WAIT = 30.0  # the longest any single step may take on a loaded 2-core machine


class FakeConn:
    """One agent's connection to the fake server: every frame it sent, and a way to answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(allowed=CLIENT_MESSAGES, expect_magic=True)
        self.received: list[Message] = []  # everything but heartbeats, in order
        self._pending: list[Message] = []
        self.hello: Hello | None = None

    def send(self, *msgs: Message) -> None:
        for msg in msgs:
            self.writer.write(encode(msg))

    async def recv(self, timeout: float = WAIT) -> Message | None:
        """The agent's next message (heartbeats skipped), or None once it closed."""
        while not self._pending:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            except ConnectionError:
                return None
            if not data:
                return None
            self._pending += [m for m in self.decoder.feed(data) if not isinstance(m, Heartbeat)]
        msg = self._pending.pop(0)
        self.received.append(msg)
        return msg

    async def expect(self, cls: type, timeout: float = WAIT) -> Message:
        msg = await self.recv(timeout)
        assert isinstance(msg, cls), f"expected {cls.__name__} from the agent, got {msg!r}"
        return msg

    async def closed(self, timeout: float = WAIT) -> list[Message]:
        """What the agent still sent until it closed the connection."""
        rest = []
        while (msg := await self.recv(timeout)) is not None:
            rest.append(msg)
        return rest

    def close(self) -> None:
        self.writer.transport.abort()


class FakeServer:
    """Speaks the hello like a rdzv-server (with a challenge, as one that asks for tokens, or
    without), then hands each agent connection to the test."""

    def __init__(self, *, challenge: str = "") -> None:
        self.challenge = challenge
        self.conns: asyncio.Queue[FakeConn] = asyncio.Queue()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = FakeConn(reader, writer)
        while True:
            data = await reader.read(1 << 16)
            if not data:
                writer.close()
                return
            msgs = conn.decoder.feed(data)
            if msgs:
                break
        hello = msgs[0]
        assert isinstance(hello, Hello), hello
        conn.hello = hello
        conn._pending += [m for m in msgs[1:] if not isinstance(m, Heartbeat)]
        writer.write(MAGIC + encode(Welcome(version=1, software="fake/1", challenge=self.challenge)))
        await self.conns.put(conn)

    async def accept(self, timeout: float = WAIT) -> FakeConn:
        return await asyncio.wait_for(self.conns.get(), timeout)


def assignment(**changes: object) -> Assignment:
    """A one-node round of JOB, as our server would send it (fields overridden by changes)."""
    fields: dict[str, object] = {
        "job_id": JOB,
        "round": 0,
        "group_rank": 0,
        "group_world_size": 1,
        "rank_offset": 0,
        "world_size": 1,
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "restart_count": 0,
        "max_restarts": 3,
    }
    fields.update(changes)
    return Assignment(**fields)  # type: ignore[arg-type]


def agent(
    port: int, tmp_path: Path, *extra: str, env: dict[str, str] | None = None, script: str = SLEEPER
) -> Proc:
    args = ("--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "3")
    args += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", JOB, *extra, script)
    return Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "120", **(env or {})})


async def wait_line(proc: Proc, pattern: str, *, stream: str = "err", timeout: float = WAIT) -> re.Match[str]:
    return await asyncio.to_thread(proc.wait_for_line, pattern, stream=stream, timeout=timeout)


async def exit_code(proc: Proc, timeout: float = 60.0) -> int:
    return await asyncio.to_thread(proc.wait, timeout)


def worker_pids(tmp_path: Path) -> list[int]:
    started = tmp_path / "started.txt"
    return [int(line.split()[2]) for line in started.read_text().splitlines()] if started.exists() else []


def sigterm_seen(tmp_path: Path, pid: int) -> bool:
    """The worker got SIGTERM (sleeper.py writes this file from its handler): a graceful stop."""
    return (tmp_path / f"sigterm-{pid}").exists()


def no_traceback(proc: Proc) -> None:
    text = proc.stderr + proc.stdout
    assert "Traceback" not in text, text


def run(tmp_path: Path, scenario: Callable[[FakeServer], Awaitable[None]], *, challenge: str = "") -> None:
    async def main() -> None:
        async with FakeServer(challenge=challenge) as server:
            await scenario(server)

    asyncio.run(main())


# --- 14: out-of-order messages -----------------------------------------------------------


def test_a_second_assignment_while_running_is_a_clear_protocol_error(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        proc = agent(server.port, tmp_path)
        try:
            conn = await server.accept()
            await conn.expect(Join)
            conn.send(assignment())
            await wait_line(proc, r"started 0 1 ", stream="out")
            (pid,) = worker_pids(tmp_path)
            conn.send(assignment(round=1, restart_count=1))
            assert await exit_code(proc) == 1
            assert sigterm_seen(tmp_path, pid)  # stopped gracefully, not SIGKILLed
        finally:
            proc.kill()
        assert "protocol error by the rendezvous server: an assignment for round 1" in proc.stderr
        no_traceback(proc)

    run(tmp_path, scenario)


def test_an_assignment_whose_ranks_do_not_fit_its_world_is_refused(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        # Two workers per node, but a world of one worker: rank 1 would not exist.
        proc = agent(server.port, tmp_path, "--nproc-per-node", "2")
        try:
            conn = await server.accept()
            await conn.expect(Join)
            conn.send(assignment(world_size=1))
            assert await exit_code(proc) == 1
        finally:
            proc.kill()
        assert worker_pids(tmp_path) == []
        assert "world size 1" in proc.stderr, proc.stderr
        no_traceback(proc)

    run(tmp_path, scenario)


# --- 5: every wait on the server ends; no text crashes the agent ---------------------------


# A server that takes a failure report and never gives its verdict: the agent gives up at
# join_timeout. Scripted on a clock the test moves, with a real Agent and real workers, in
# tests/node_agent/test_runner.py (here it waited out a real 3 s join_timeout).


def test_a_drain_with_a_65536_character_reason_drains_gracefully(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        proc = agent(server.port, tmp_path)
        try:
            conn = await server.accept()
            await conn.expect(Join)
            conn.send(assignment())
            await wait_line(proc, r"started 0 1 ", stream="out")
            (pid,) = worker_pids(tmp_path)
            conn.send(Drain(reason="x" * MAX_TEXT_LEN))
            notice = await conn.expect(Leave)
            assert notice.workers_stopping
            leave = await conn.expect(Leave)
            assert not leave.workers_stopping
            conn.send(Left(job_continues=True, reason="y" * MAX_TEXT_LEN))
            assert await exit_code(proc) == 0
            assert sigterm_seen(tmp_path, pid)  # SIGTERM to checkpoint, never SIGKILL
        finally:
            proc.kill()
        no_traceback(proc)
        assert len(proc.stderr) < 4 * MAX_TEXT_LEN  # said, not repeated

    run(tmp_path, scenario)


# --- 15: the agent checks the server's counters ------------------------------------------


def test_restarts_past_the_agents_own_budget_are_refused(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        proc = agent(server.port, tmp_path, env={"FAIL_ALWAYS": "1"})  # --max-restarts 3
        reports = 0
        try:
            conn = await server.accept()
            await conn.expect(Join)
            # A hostile server runs the job through 30 restarts, on a budget of 3.
            for count in range(30):
                conn.send(assignment(round=count, restart_count=count))
                if not isinstance(await conn.recv(), WorkersFailed):
                    break  # the agent refused the assignment (and closed)
                reports += 1
                conn.send(Restart(round=count, reason="worker failure", restart_count=count + 1))
                if not isinstance(await conn.recv(), Join):
                    break  # the agent refused the restart
            assert await exit_code(proc) == 1
        finally:
            proc.kill()
        assert reports == 4, proc.stderr  # restarts 0..3 ran, the budget; not one more
        assert "a restart 4, past this node's budget (--max-restarts 3)" in proc.stderr, proc.stderr
        no_traceback(proc)

    run(tmp_path, scenario)


def test_an_assignment_for_another_job_is_refused(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        proc = agent(server.port, tmp_path)
        try:
            conn = await server.accept()
            await conn.expect(Join)
            conn.send(assignment(job_id="someone-elses-job"))
            assert await exit_code(proc) == 1
        finally:
            proc.kill()
        assert worker_pids(tmp_path) == []  # no worker ever ran for that job
        assert "'someone-elses-job'" in proc.stderr, proc.stderr
        no_traceback(proc)

    run(tmp_path, scenario)


# --- 10: a server's texts reach the terminal escaped ---------------------------------------


FORGED = "\n[node-agent] ERROR: forged line\x1b[2J\x1b]0;owned\x07\r\u2028"


def test_a_servers_texts_cannot_forge_agent_lines_or_drive_the_terminal(tmp_path: Path) -> None:
    async def scenario(server: FakeServer) -> None:
        proc = agent(server.port, tmp_path, "--nnodes", "1:2")
        try:
            conn = await server.accept()
            await conn.expect(Join)
            conn.send(Waiting(job_id=JOB, round=0, joined=1, min_nodes=1, max_nodes=2, reason=FORGED))
            conn.send(Error(code="note", message="heads up" + FORGED, fatal=False))
            conn.send(Restart(round=0, reason="reshaped" + FORGED, restart_count=0))
            cause = Failure(
                node_id="other-node",
                addr="10.0.0.9",
                rank=3,
                local_rank=1,
                exitcode=1,
                timestamp=time.time(),
                message="worker said" + FORGED + "\nsecond line",
                error_file="/tmp/err" + FORGED,
            )
            conn.send(JobFailed(reason="it failed" + FORGED, failure=cause))
            assert await exit_code(proc) == 1
        finally:
            proc.kill()
        text = proc.stderr
        assert "it failed\\n[node-agent] ERROR: forged line\\x1b[2J\\x1b]0;owned\\x07\\r\\u2028" in text, text
        for bad in ("\x1b", "\r", "\x07", "\u2028"):
            assert bad not in text, (bad, text)
        # Every line the agent printed is its own: none starts with the forged text.
        assert not [line for line in proc.err if line.startswith("[node-agent] ERROR: forged")], text
        assert "second line" in text  # a worker's traceback keeps its lines, each with our prefix
        no_traceback(proc)

    run(tmp_path, scenario)


# --- 6 and 12: the node's secret, and what workers never see --------------------------------


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_every_join_carries_one_secret_which_workers_and_logs_never_see(tmp_path: Path) -> None:
    release = tmp_path / "release"

    async def scenario(server: FakeServer) -> None:
        env = {"RDZV_TOKEN": "tok-123", "EXIT_WHEN_FILE": str(release)}
        proc = agent(server.port, tmp_path, env=env)
        try:
            first = await server.accept()
            join = await first.expect(Join)
            assert re.fullmatch("[0-9a-f]{32}", join.node_secret), join.node_secret
            assert join.proof  # the token is proven, never sent
            first.close()  # lost while joining: the agent joins again
            second = await server.accept()
            again = await second.expect(Join)
            second.send(assignment())
            await wait_line(proc, r"started 0 1 ", stream="out")
            (pid,) = worker_pids(tmp_path)
            seen = environ_of(pid)
            second.close()  # lost while running: the agent resumes its round
            third = await server.accept()
            resume = await third.expect(Resume)
            assert again.node_secret == resume.join.node_secret == join.node_secret
            third.send(Resumed(job_id=JOB, round=0))
            release.touch()
            await third.expect(WorkersSucceeded)
            third.send(JobDone())
            assert await exit_code(proc) == 0
        finally:
            proc.kill()
        assert "RDZV_TOKEN" not in seen and "tok-123" not in seen.values()
        assert not [k for k, v in seen.items() if join.node_secret in v]
        assert join.node_secret not in proc.stderr + proc.stdout
        no_traceback(proc)

    run(tmp_path, scenario, challenge="c0ffee")


# --- 4: a token holder never meets an open rendezvous ----------------------------------------


def test_an_agent_with_a_token_refuses_a_real_server_that_asks_for_none(tmp_path: Path) -> None:
    srv, port = start_server()  # no --token-file: anyone may join any job
    try:
        proc = agent(port, tmp_path, env={"RDZV_TOKEN": "tok-123"})
        try:
            assert proc.wait(timeout=60) == 1
        finally:
            proc.kill()
    finally:
        srv.kill()
    assert worker_pids(tmp_path) == []
    assert f"the rendezvous server at 127.0.0.1:{port} does not ask for a token" in proc.stderr, proc.stderr
    assert "joined" not in srv.stderr  # it never joined
    no_traceback(proc)


def test_an_agent_with_a_token_hosts_only_a_rendezvous_that_asks_for_it(tmp_path: Path) -> None:
    port, release = free_port(), tmp_path / "release"

    async def scenario() -> None:
        env = {"RDZV_TOKEN": "tok-123", "EXIT_WHEN_FILE": str(release)}
        proc = agent(port, tmp_path, "--rdzv-backend", "c10d", env=env)
        try:
            await wait_line(proc, r"this agent hosts it")
            await wait_line(proc, r"started 0 1 ", stream="out")  # it joined what it hosts
            # A stranger without the token reaches the port the agent hosts.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(MAGIC + encode(Hello(versions=(1,), software="stranger")))
            decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
            got: list[Message] = []
            while len(got) < 1:
                got += decoder.feed(await asyncio.wait_for(reader.read(1 << 16), WAIT))
            welcome = got.pop(0)
            assert isinstance(welcome, Welcome) and welcome.challenge, welcome  # it asks for a token
            writer.write(encode(stranger_join(port)))
            while not got:
                data = await asyncio.wait_for(reader.read(1 << 16), WAIT)
                assert data, "closed without a word"
                got += decoder.feed(data)
            refusal = got[0]
            assert isinstance(refusal, Error) and "requires a token" in refusal.message, refusal
            writer.transport.abort()
            release.touch()
            assert await exit_code(proc) == 0
        finally:
            proc.kill()
        no_traceback(proc)

    asyncio.run(scenario())


def stranger_join(port: int) -> Join:
    return Join(
        job_id=JOB,
        node_id="stranger",
        addr="127.0.0.1",
        nproc=1,
        min_nodes=1,
        max_nodes=1,
        entrypoint=SLEEPER,
        master_port=free_port(),
        max_restarts=3,
        last_call_timeout=1.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )
