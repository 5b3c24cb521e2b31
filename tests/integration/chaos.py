"""A seeded chaos campaign against one elastic job, with real processes and real signals.

One ``rdzv-server --state-dir DIR`` on 127.0.0.1 and 5 or 6 ``node-agent``\\ s of one job
(``--nnodes 2:4``, 2 workers each, so there is at least one hot spare) run torch-free workers
(``workers/chaos_worker.py``) that report what they see: their pid and kernel start time, their
agent, RANK, WORLD_SIZE, GROUP_RANK, LOCAL_RANK, the restart count, MASTER_ADDR/PORT, their start
and how they exit, as one JSON file per event in a shared directory (written under a temporary
name, then renamed). They run until the campaign creates the release file.

**The campaign.** A seeded RNG (``CHAOS_SEED``; printed at start) picks faults for
``CHAOS_SECONDS`` (default 60) in *episodes*: one fault, sometimes followed within 0.05-1.5 s by
one or two more before the job has recovered (that is how races such as "the server dies during
a re-rendezvous" are reached), then a bounded wait for recovery, then a short random gap.
Every fault has a precondition on what the campaign knows (the server up or down, how many
agents are healthy, whether an agent is connected), so that each expectation below is exact:

=================  ===========================================================================
``worker_kill``    SIGKILL one worker (the job restarts, using one restart of its budget)
``worker_fail``    SIGUSR2 to one worker: it exits 7 (the same, as a plain failure)
``agent_kill``     SIGKILL one agent (not its session: its workers must die by themselves, by
                   PDEATHSIG and the watchdog); a replacement agent starts 0-1 s later
``drain_sigterm``  SIGTERM to one agent (a drain), with at least two other healthy agents: while
                   the server is up and the agent connected (the server must answer, and the job
                   goes on: exit 0), or while the server is down and the agent has seen it go
                   (exit 1 unless it asks the restarted server, whose answer must be "goes on")
``drain_server``   ``rdzv-server drain --node`` for one connected agent: it must exit 0
``agent_stop``     SIGSTOP one agent until the server declares it silent (heartbeat_timeout),
                   0-1.5 s more, then SIGCONT
``server_kill``    SIGKILL the server; 0-2 s later a new one on the same port and state dir
``server_term``    SIGTERM the server (it must exit 0); 0-2 s later the same restart
``scale_up``       start one more agent (at most 6 alive)
``junk``           a few connections to the server's port: random bytes, our magic then random
                   bytes, half-open and half-closed sockets, HTTP requests good and bad
=================  ===========================================================================

**Invariants**, checked continuously by a monitor thread that reads the reports, the
processes and the agents' and server's log lines (the round lines say which round each
agent's k-th attempt belongs to, and its workers' error-file paths name the attempt):

1. In every round, global ranks 0..W-1 each started exactly once, and every worker's
   environment agrees with its round and with its agent's round line (WORLD_SIZE, GROUP_RANK,
   RANK = GROUP_RANK * nproc + LOCAL_RANK, restart count, master). A round superseded before
   all its ranks started must be explained by a campaign action during its life (a server
   fault only explains rounds completed by the server process it hit).
2. Every round has between MIN and MAX nodes (the server's round lines and the agents').
3. Never two rounds' workers alive at once (the workers of an agent that is SIGSTOPped, and
   for a grace period after SIGCONT, excepted: a frozen node's workers run on by nature).
   Workers take 0-1.5 s (per agent, from the RNG) to stop on SIGTERM, and a drained node's
   ``DRAIN_DELAY`` (2 s, longer than any other's): a round started before they are gone shows.
4. Recovery: after each episode's last action, within ``RECOVERY_BOUND``, the newest round
   has all its ranks alive, min(MAX, healthy agents) nodes, every agent is connected, and no
   worker of another round is alive.
5. No orphans: ``ORPHAN_BOUND`` after an agent exits or is SIGKILLed, none of its workers
   is alive.
6. The server process is alive except when the campaign stopped it, and ``GET /healthz``
   answers 200 while it is up; no traceback in any log; the job never fails.
7. A drained agent exits with exactly the code the rule gives (``node_agent/machine/agent.py``: 0 only
   when the server's ``Left`` says the job goes on without it, else 1, no answer included),
   its last lines say which; the server's answer matches what the campaign knows (enough
   other agents remained), and a server that was up all along does answer. No agent the
   campaign did not stop exits before the end.
8. A live agent that is not frozen is never declared silent by the server.
9. A single server restart on the state dir (SIGKILL or SIGTERM) restarts no worker (the
   same pids run on); junk restarts nothing; a worker fault uses exactly one restart and a
   membership change none.
10. At the end the release file makes every worker exit 0 and every agent still running,
   spares included, exits 0; then the server exits 0 on SIGTERM.

On a violation the campaign stops at once and the failure message holds the seed, the
whole timeline (time, fault, target, what was observed: rounds, exits, the server's job
lines), each agent's last lines and the server's. ``CHAOS_SEED=<seed>`` replays the same
choices (timing on a busy machine can still differ). Everything is bounded; every process
group is killed and the temporary directory removed, failure or not.

Environment:

- ``CHAOS_SEED``: the seed (default: a random one, printed).
- ``CHAOS_SECONDS``: how long to inject faults (default 60).
- ``CHAOS_FAULTS``: ``kind,kind`` to inject only these, or ``-kind,-kind`` to leave some out
  (default: all), for chasing one bug while another is being fixed.
- ``CHAOS_REPORT``: a file to write the full report to, pass or fail.
- ``CHAOS_VERBOSE=1``: print the whole timeline on success too.
- ``CHAOS_KEEP=1``: keep the temporary directory (the server's state dir, the workers' reports,
  the agents' log dirs) when the campaign fails, and say where it is.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from protocol import MAGIC

from .procs import ROOT, WORKERS, Proc, agent_cmd, server_cmd

# --- the job --------------------------------------------------------------------------------

JOB = "chaos"
MIN_NODES, MAX_NODES, NPROC = 2, 4, 2
MAX_AGENTS = 6  # alive at once
MAX_RESTARTS = 100000
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 4.0
LAST_CALL_TIMEOUT = 1.5
RECONNECT_TIMEOUT = 20.0
SHUTDOWN_TIMEOUT = 5.0  # the agents' grace between SIGTERM and SIGKILL for workers
RDZV_CONF = (
    f"heartbeat_interval={HEARTBEAT_INTERVAL},heartbeat_timeout={HEARTBEAT_TIMEOUT},"
    f"last_call_timeout={LAST_CALL_TIMEOUT},reconnect_timeout={RECONNECT_TIMEOUT},exit_barrier_timeout=60,"
    # The job has its own rdzv-server: an agent started while it restarts must wait for it, not
    # host an embedded one on its port (which the restarted server then cannot bind).
    "is_host=false"
)
# How long each agent's workers take to "checkpoint" on SIGTERM (one value per agent, from the
# RNG): a node whose workers are still stopping is then visible to invariant 3.
TERM_DELAYS = (0.0, 0.3, 0.8, 1.5)
DRAIN_DELAY = 2.0  # a drained node's workers: longer than any other's (see chaos_worker.py)
WORKER = str(WORKERS / "chaos_worker.py")

FAULT_KINDS = (
    "worker_kill",
    "worker_fail",
    "agent_kill",
    "drain_sigterm",
    "drain_server",
    "agent_stop",
    "server_kill",
    "server_term",
    "scale_up",
    "junk",
)
COMPOUND_ODDS = (0.4, 0.25)  # of a second fault in an episode, then of a third

# --- bounds (generous: two slow cores) ------------------------------------------------------

RECOVERY_BOUND = 20.0  # the longest legitimate path: a node lost in the 10 s resume window
FIRST_ROUND_BOUND = 45.0
RECOVERY_SETTLE = 0.3
ORPHAN_BOUND = 5.0
DRAIN_EXIT_BOUND = SHUTDOWN_TIMEOUT + 10.0 + 10.0  # workers' grace, the agent's wait for Left, slack
THAW_GRACE = 10.0  # after SIGCONT, the thawed agent's stale workers may still run this long
SILENT_BOUND = HEARTBEAT_TIMEOUT + 7.0  # a frozen agent is declared silent within this
SERVER_START_BOUND = 30.0
SERVER_STOP_BOUND = 20.0
NOTICE_BOUND = 10.0  # an agent notices that its server went away
END_BOUND = 60.0
UNMATCHED_BOUND = 10.0  # a worker's report is matched to its agent's round line within this
JUDGE_DELAY = 2.0  # a superseded round is judged this long after (its last reports arrive)
LOG_SETTLE = 3.0  # an exited process's last lines are read within this
HEALTH_PERIOD, HEALTH_TIMEOUT, HEALTH_FAILS = 1.0, 5.0, 3
TICK = 0.05


class ChaosFailure(AssertionError):
    pass


def mono() -> float:
    return time.monotonic()


# --- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    seed: int
    seconds: float
    faults: frozenset[str]
    report_path: str | None = None
    verbose: bool = False
    keep: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Config:
        raw_seed = environ.get("CHAOS_SEED", "").strip()
        seed = int(raw_seed) if raw_seed else random.SystemRandom().randrange(2**32)
        seconds = float(environ.get("CHAOS_SECONDS", "60") or "60")
        return cls(
            seed=seed,
            seconds=seconds,
            faults=parse_faults(environ.get("CHAOS_FAULTS", "")),
            report_path=environ.get("CHAOS_REPORT") or None,
            verbose=environ.get("CHAOS_VERBOSE", "") not in ("", "0"),
            keep=environ.get("CHAOS_KEEP", "") not in ("", "0"),
        )


def parse_faults(text: str) -> frozenset[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        return frozenset(FAULT_KINDS)
    unknown = sorted({x.lstrip("-") for x in items} - set(FAULT_KINDS))
    if unknown:
        raise ValueError(f"CHAOS_FAULTS: unknown kind(s) {unknown}; kinds: {', '.join(FAULT_KINDS)}")
    if all(x.startswith("-") for x in items):
        return frozenset(FAULT_KINDS) - {x[1:] for x in items}
    if any(x.startswith("-") for x in items):
        raise ValueError("CHAOS_FAULTS: give kinds to keep, or -kinds to leave out, not both")
    return frozenset(items)


# --- processes by identity ------------------------------------------------------------------


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of a live (non-zombie) process, or None: with the pid, an identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int, ticks: int) -> bool:
    return start_ticks(pid) == ticks


def signal_exact(pid: int, ticks: int, sig: int, *, group: bool = False) -> bool:
    """Signal a process (or its group) only if it is still the one we know."""
    if not alive(pid, ticks):
        return False
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def pick_port() -> int:
    """A free port below the ephemeral range, so no outgoing connection takes it while the
    server is down (an agent reconnecting could otherwise connect to itself)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    picker = random.SystemRandom()
    for _ in range(200):
        port = picker.randrange(10000, max(10001, low - 1))
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def stderr_done(proc: Proc) -> bool:
    """The reader of the process's stderr reached its end (every line is in ``proc.err``)."""
    return not proc._threads[1].is_alive()


# --- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentRound:
    """One ``round N: ...`` line of an agent; its k-th is the round of its attempt_k."""

    number: int
    group_rank: int
    gws: int
    first_rank: int
    world: int
    master: str
    port: int
    restart: int

    @property
    def key(self) -> tuple[int, str, int, int, int]:
        return (self.number, self.master, self.port, self.restart, self.world)


@dataclass(eq=False)
class Worker:
    pid: int
    ticks: int
    t_start: float
    agent_pid: int
    env: dict[str, str | None]
    seen_at: float
    agent: Agent | None = None
    round: Round | None = None
    rank: int = -1
    local_rank: int = -1
    attempt: int = -1
    dead_at: float | None = None
    term_t: float | None = None
    exit: dict[str, object] | None = None
    orphan_noted: bool = False

    def label(self) -> str:
        who = self.agent.name if self.agent is not None else f"agent pid {self.agent_pid}"
        rnd = f"round {self.round.number}" if self.round is not None else "round ?"
        return f"pid {self.pid} ({rnd}, rank {self.rank}, {who})"


@dataclass(eq=False)
class Agent:
    name: str
    proc: Proc
    term_delay: float
    started_at: float
    state: str = "running"  # running | frozen | draining | killed | ending
    node_id: str | None = None
    frozen_at: float | None = None
    thawed_at: float | None = None
    exempt_until: float = 0.0
    drain_how: str = ""
    drain_at: float | None = None
    drain_goes_on: bool = False  # the campaign's model: the job goes on without it
    drain_up: bool = False  # the server was up and the agent connected when it was drained
    drain_why: str = ""
    exited_at: float | None = None
    rc: int | None = None
    exit_judged: bool = False
    back_ts: float = 0.0  # wall time of its last line that proves a live connection
    lost_ts: float = 0.0  # wall time of its last "lost the connection ... reconnecting"
    silent_at: float | None = None
    log_pos: int = 0
    rounds: list[AgentRound] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.p.pid

    def exempt(self, now: float) -> bool:
        """Its workers may outlive their round: it is frozen, or was until a moment ago."""
        return self.state == "frozen" or now < self.exempt_until

    def tail(self, n: int = 15) -> str:
        lines = [readable(line) for line in self.proc.err if not any(b in line for b in AGENT_BANNER)]
        return "\n".join(f"      {line}" for line in lines[-n:])


@dataclass(eq=False)
class Round:
    key: tuple[int, str, int, int, int]
    number: int
    gws: int
    world: int
    restart: int
    first_seen: float
    workers: dict[int, Worker] = field(default_factory=dict)
    holders: dict[int, Agent] = field(default_factory=dict)  # group rank -> agent
    server_epoch: int | None = None
    superseded_at: float | None = None
    complete_at: float | None = None
    ending_at: float | None = None  # an agent was told to leave it, or one of its workers to stop
    judged: bool = False

    def describe(self) -> str:
        nodes = ", ".join(f"{g}:{a.name}" for g, a in sorted(self.holders.items()))
        return (
            f"round {self.number} ({self.gws} nodes [{nodes}], world {self.world}, "
            f"restart {self.restart}, master {self.key[1]}:{self.key[2]})"
        )


@dataclass(eq=False)
class Server:
    epoch: int
    proc: Proc
    started_at: float
    state: str = "starting"  # starting | up | stopping | down
    up_at: float | None = None
    log_pos: int = 0
    rc: int | None = None


@dataclass
class Pending:
    """A continuation of a fault: ``run`` once ``due(now)``; a violation if not due by ``deadline``."""

    label: str
    due: Callable[[float], bool]
    run: Callable[[], None]
    deadline: float | None = None


@dataclass
class Episode:
    n: int
    kinds: list[str] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    last_action: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    round_key: tuple[int, str, int, int, int] | None
    number: int
    restart: int
    pids: frozenset[tuple[int, int]]
    starts: int


@dataclass
class Row:
    t: float
    kind: str
    target: str
    observed: str


# --- log lines ------------------------------------------------------------------------------

AGENT_ROUND_RE = re.compile(
    r"^round (\d+): group rank (\d+) of (\d+), ranks? (\d+)(?:-\d+)?, world size (\d+), "
    r"master (\S+):(\d+), restart (\d+)"
)
AGENT_LOST_RE = re.compile(r"lost the connection to the rendezvous server \(.*reconnecting")
AGENT_RESTART_RE = re.compile(r"^re-rendezvous after round (\d+)")
AGENT_BACK_RE = re.compile(r"reconnected; |resumed round \d+|waiting for nodes")
AGENT_BANNER = ("*****", "Setting OMP_NUM_THREADS")
SERVER_ROUND_RE = re.compile(
    r"job "
    + JOB
    + r": round (\d+) complete: (\d+) nodes, world size (\d+), master (\S+):(\d+), restarts (\d+)"
)
SERVER_JOB_RE = re.compile(r"rdzv_server: (job " + JOB + r": .*)$")
NODE_ID_RE = re.compile(r"(?:node|spare) (\S+:(\d+):[0-9a-f]+)\b")
SILENT_RE = re.compile(r"(?:node|spare) (\S+) went silent")
NAMED_NODE_RE = re.compile(r"\b(node|spare) (\S+:\d+:[0-9a-f]+)")
ATTEMPT_RE = re.compile(r"/attempt_(\d+)/(\d+)/error\.json$")


def parse_agent_line(line: str) -> tuple[float | None, str, str, str]:
    """(wall time, level, node id, message) of one ``--log-format json`` line; a line that is not
    JSON (a worker's stderr relayed) has no time."""
    if line.startswith("{"):
        try:
            rec = json.loads(line)
            return float(rec["ts"]), str(rec["level"]), str(rec.get("node", "")), str(rec["msg"])
        except (ValueError, KeyError, TypeError):
            pass
    return None, "", "", line


def readable(line: str) -> str:
    ts, level, _, msg = parse_agent_line(line)
    if ts is None:
        return msg
    return f"{time.strftime('%H:%M:%S', time.localtime(ts))}.{int(ts % 1 * 1000):03d} {level.upper()}: {msg}"


# --- the campaign ---------------------------------------------------------------------------


class Campaign:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.t0 = mono()
        self.cond = threading.Condition(threading.RLock())
        self.rows: list[Row] = []
        self.violations: list[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.reports = self.tmp / "reports"
        self.reports.mkdir()
        self.state_dir = self.tmp / "state"
        self.release = self.tmp / "release"
        self.control = self.tmp / "control"
        self.control.mkdir()
        self.port = pick_port()
        self.agents: list[Agent] = []
        self.by_pid: dict[int, Agent] = {}
        self.servers: list[Server] = []
        self.server: Server | None = None
        self.workers: dict[tuple[int, int], Worker] = {}
        self.unbound: list[Worker] = []
        self.seen_reports: set[str] = set()
        self.rounds: dict[tuple[int, str, int, int, int], Round] = {}
        self.by_number: dict[int, Round] = {}
        self.newest: Round | None = None
        # (time, kind, target, server epoch): what may explain an incomplete round
        self.actions: list[tuple[float, str, str, int]] = []
        self.counts: dict[str, int] = {}
        self.recoveries: list[tuple[str, float]] = []
        self.episodes = 0
        self.junk_threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.next_agent = 0
        self.cycles = 0  # of the monitor
        self.last_stop_wall = 0.0  # time.time() when the campaign last stopped the server
        self.stop_times: list[float] = []  # mono() of each stop

    # -- bookkeeping -------------------------------------------------------------------------

    def rel(self, t: float) -> float:
        return t - self.t0

    def note(self, kind: str, target: str = "", observed: str = "", t: float | None = None) -> None:
        with self.cond:
            self.rows.append(Row(mono() if t is None else t, kind, target, observed))

    def violate(self, text: str) -> None:
        with self.cond:
            self.violations.append(text)
            self.rows.append(Row(mono(), "VIOLATION", "", text))
            self.cond.notify_all()

    def action(self, kind: str, target: str, observed: str = "", ep: Episode | None = None) -> None:
        now = mono()
        epoch = self.server.epoch if self.server is not None else -1
        with self.cond:
            self.actions.append((now, kind, target, epoch))
            self.rows.append(Row(now, f">> {kind}", target, observed))
        if ep is not None:
            ep.last_action = now

    def check_failed(self) -> None:
        if self.violations:
            raise ChaosFailure(self.violations[0])

    def wait(self, pred: Callable[[], bool], timeout: float, ep: Episode | None = None) -> bool:
        """Wait (bounded) until ``pred`` holds, running due continuations; raise on a violation."""
        deadline = mono() + timeout
        while True:
            if ep is not None:
                self.run_pending(ep)
            with self.cond:
                self.check_failed()
                if pred():
                    return True
                left = deadline - mono()
                if left <= 0:
                    return False
                self.cond.wait(min(left, TICK * 2))

    def idle(self, seconds: float, ep: Episode | None = None) -> None:
        """A gap in the schedule (not a synchronisation: those are ``wait``)."""
        self.wait(lambda: False, seconds, ep)

    def run_pending(self, ep: Episode) -> None:
        now = mono()
        for p in list(ep.pending):
            if p.due(now):
                ep.pending.remove(p)
                p.run()
                ep.last_action = max(ep.last_action, mono())
            elif p.deadline is not None and now > p.deadline:
                ep.pending.remove(p)
                self.violate(f"{p.label}: not done within its bound")

    # -- processes ---------------------------------------------------------------------------

    def start_server(self) -> Server:
        argv = server_cmd("--host", "127.0.0.1", "--port", str(self.port), "--state-dir", str(self.state_dir))
        proc = Proc(argv)
        with self.cond:
            srv = Server(epoch=len(self.servers), proc=proc, started_at=mono())
            self.servers.append(srv)
            self.server = srv
        return srv

    def start_agent(self, why: str, ep: Episode | None = None) -> Agent:
        name = f"a{self.next_agent}"
        delay = self.rng.choice(TERM_DELAYS)
        env = {
            "CHAOS_REPORT_DIR": str(self.reports),
            "CHAOS_RELEASE_FILE": str(self.release),
            "CHAOS_TERM_DELAY": str(delay),
            "CHAOS_CONTROL_DIR": str(self.control),
            "CHAOS_DRAIN_DELAY": str(DRAIN_DELAY),
            "CHAOS_WORKER_TIMEOUT": str(self.cfg.seconds + 600),
            "LOGLEVEL": "INFO",
        }
        argv = agent_cmd(
            "--nnodes",
            f"{MIN_NODES}:{MAX_NODES}",
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            JOB,
            "--max-restarts",
            str(MAX_RESTARTS),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--rdzv-conf",
            RDZV_CONF,
            "--log-dir",
            str(self.tmp / "logs" / name),
            "--log-format",
            "json",  # each line carries the agent's own time: see connected()
            # Ranks follow the reported address, then the node id (which holds the pid): an
            # address of its own per agent makes them follow the agents' order, so a seed replays
            # the same ranks. Only reported (the rank 0 node's is MASTER_ADDR, which these
            # workers never dial); every connection stays on 127.0.0.1.
            "--local-addr",
            f"127.0.0.{self.next_agent % 250 + 1}",
            WORKER,
        )
        self.next_agent += 1
        proc = Proc(argv, env=env)
        with self.cond:
            a = Agent(name=name, proc=proc, term_delay=delay, started_at=mono())
            self.agents.append(a)
            self.by_pid[a.pid] = a
        self.action(why, name, f"pid {a.pid}, workers' term delay {delay:g} s", ep)
        return a

    # -- the monitor -------------------------------------------------------------------------

    def monitor(self) -> None:
        while not self.stopping.is_set():
            try:
                with self.cond:
                    self.cycle(mono())
                    self.cond.notify_all()
            except Exception as exc:  # a bug of ours must fail the test, not hang it
                self.violate(f"monitor crashed: {type(exc).__name__}: {exc}")
                raise
            self.stopping.wait(TICK)

    def cycle(self, now: float) -> None:
        self.cycles += 1
        for srv in self.servers:
            self.read_server(srv, now)
        for a in self.agents:
            self.read_agent(a, now)
        self.read_reports(now)
        self.bind_workers(now)
        self.check_server(now)
        self.check_agents(now)
        self.check_workers(now)
        self.judge_rounds(now)

    def read_server(self, srv: Server, now: float) -> None:
        lines = srv.proc.err[srv.log_pos :]
        srv.log_pos += len(lines)
        for line in lines:
            if "Traceback" in line:
                self.violate(f"server#{srv.epoch} logged a traceback: {line}")
            if srv.state == "starting" and "listening on" in line:
                srv.state, srv.up_at = "up", now
                self.note("server up", f"server#{srv.epoch}", f"listening after {now - srv.started_at:.2f} s")
            for m in NODE_ID_RE.finditer(line):
                a = self.by_pid.get(int(m.group(2)))
                if a is not None and a.node_id is None:
                    a.node_id = m.group(1)
            m = SILENT_RE.search(line)
            if m:
                for a in self.agents:
                    if a.node_id == m.group(1):
                        a.silent_at = now
                        frozen = a.state == "frozen" or (a.thawed_at is not None and now - a.thawed_at < 2.0)
                        if not frozen and a.exited_at is None and a.state != "killed":
                            self.violate(
                                f"server#{srv.epoch} declared {a.name} silent, but it was neither frozen nor "
                                f"dead ({a.state}): its heartbeats stopped for {HEARTBEAT_TIMEOUT:g} s"
                            )
            m = SERVER_ROUND_RE.search(line)
            if m:
                number, nodes, world, master, port, restart = m.groups()
                self.server_round(
                    srv, int(number), int(nodes), int(world), master, int(port), int(restart), now
                )
            m = SERVER_JOB_RE.search(line)
            if m and " joined (" not in line:
                self.note("server", f"server#{srv.epoch}", m.group(1))
            if f"job {JOB}: failed" in line:
                self.violate(f"the job failed (server#{srv.epoch}): {line}")

    def read_agent(self, a: Agent, now: float) -> None:
        lines = a.proc.err[a.log_pos :]
        a.log_pos += len(lines)
        for line in lines:
            ts, level, node, msg = parse_agent_line(line)
            if "Traceback" in msg or "UnexpectedEvent" in msg:
                self.violate(f"{a.name} logged a traceback: {msg}")
            if node and a.node_id is None:
                a.node_id = node
            if ts is None or any(b in msg for b in AGENT_BANNER) or not msg.strip():
                continue
            m = AGENT_ROUND_RE.search(msg)
            if m:
                n, g, gws, first, world, master, port, restart = m.groups()
                ar = AgentRound(
                    int(n), int(g), int(gws), int(first), int(world), master, int(port), int(restart)
                )
                a.rounds.append(ar)
                a.back_ts = max(a.back_ts, ts)
                self.agent_round(a, ar, now)
            elif AGENT_LOST_RE.search(msg):
                a.lost_ts = max(a.lost_ts, ts)
            elif AGENT_BACK_RE.search(msg):
                a.back_ts = max(a.back_ts, ts)
            m = AGENT_RESTART_RE.search(msg)
            if m:
                r = self.by_number.get(int(m.group(1)))
                if r is not None and r.ending_at is None:
                    r.ending_at = now
            self.note("agent", a.name, msg if level == "info" else f"{level.upper()}: {msg}")

    def connected(self, a: Agent) -> bool:
        """The agent's last word on its connection is that it is up, since the server last stopped."""
        return a.back_ts > max(a.lost_ts, self.last_stop_wall)

    def saw_server_go(self, a: Agent) -> bool:
        """Its last word on its connection is that it lost it, after the server last stopped."""
        return a.lost_ts > max(a.back_ts, self.last_stop_wall)

    def server_round(
        self,
        srv: Server,
        number: int,
        nodes: int,
        world: int,
        master: str,
        port: int,
        restart: int,
        now: float,
    ) -> None:
        if not MIN_NODES <= nodes <= MAX_NODES:
            self.violate(
                f"server#{srv.epoch} completed round {number} with {nodes} nodes "
                f"(job: {MIN_NODES}:{MAX_NODES})"
            )
        if world != nodes * NPROC:
            self.violate(
                f"server#{srv.epoch}: round {number} has world size {world} for {nodes} nodes of {NPROC}"
            )
        r = self.get_round((number, master, port, restart, world), nodes, now)
        r.server_epoch = srv.epoch

    def agent_round(self, a: Agent, ar: AgentRound, now: float) -> None:
        if not MIN_NODES <= ar.gws <= MAX_NODES:
            self.violate(f"{a.name} got round {ar.number} with {ar.gws} nodes (job: {MIN_NODES}:{MAX_NODES})")
        if (
            ar.world != ar.gws * NPROC
            or ar.first_rank != ar.group_rank * NPROC
            or not 0 <= ar.group_rank < ar.gws
        ):
            self.violate(f"{a.name}'s round line is inconsistent: {ar}")
        r = self.get_round(ar.key, ar.gws, now)
        holder = r.holders.get(ar.group_rank)
        if holder is not None and holder is not a:
            self.violate(f"{r.describe()}: group rank {ar.group_rank} given to {holder.name} and {a.name}")
        mine = [g for g, x in r.holders.items() if x is a and g != ar.group_rank]
        if mine:
            self.violate(f"{r.describe()}: {a.name} holds group ranks {mine} and {ar.group_rank}")
        r.holders[ar.group_rank] = a

    def get_round(self, key: tuple[int, str, int, int, int], gws: int, now: float) -> Round:
        r = self.rounds.get(key)
        if r is not None:
            if r.gws != gws:
                self.violate(f"{r.describe()}: also seen with {gws} nodes")
            return r
        number, _, _, restart, world = key
        r = Round(key=key, number=number, gws=gws, world=world, restart=restart, first_seen=now)
        other = self.by_number.get(number)
        if other is not None:
            self.violate(f"round number {number} used twice: {other.describe()} and {r.describe()}")
        self.rounds[key] = r
        self.by_number[number] = r
        older = [x for x in self.rounds.values() if x.number < number]
        if older and restart < max(x.restart for x in older):
            self.violate(
                f"{r.describe()}: the restart count went down "
                f"(earlier rounds had {max(x.restart for x in older)})"
            )
        for x in self.rounds.values():
            if x.number < number and x.superseded_at is None:
                x.superseded_at = now
        if self.newest is None or number > self.newest.number:
            self.newest = r
        else:
            r.superseded_at = now
        return r

    def read_reports(self, now: float) -> None:
        try:
            names = [n for n in os.listdir(self.reports) if not n.startswith(".")]
        except OSError:
            return
        fresh = sorted(set(names) - self.seen_reports, key=lambda n: (n.split(".")[2] != "start", n))
        for name in fresh:
            self.seen_reports.add(name)
            try:
                rec = json.loads((self.reports / name).read_text())
            except (OSError, ValueError) as exc:
                self.violate(f"unreadable worker report {name}: {exc}")
                continue
            key = (int(rec["pid"]), int(rec["start_ticks"]))
            if rec["kind"] == "start":
                w = Worker(
                    pid=key[0],
                    ticks=key[1],
                    t_start=float(rec["t"]),
                    agent_pid=int(rec["agent_pid"]),
                    env=dict(rec["env"]),
                    seen_at=now,
                )
                self.workers[key] = w
                self.unbound.append(w)
                continue
            w = self.workers.get(key)
            if w is None:
                self.violate(f"worker report {name} without a start report")
                continue
            if rec["kind"] == "term":
                w.term_t = float(rec["t"])
                if w.round is not None and w.round.ending_at is None:
                    w.round.ending_at = now
            elif rec["kind"] == "exit":
                w.exit = rec
            elif rec["kind"] == "orphaned":
                self.note("worker", w.label(), f"orphaned: its parent is now pid {rec.get('new_parent')}")

    def bind_workers(self, now: float) -> None:
        for w in list(self.unbound):
            a = self.by_pid.get(w.agent_pid)
            if a is None:
                self.unbound.remove(w)
                self.violate(
                    f"worker pid {w.pid} has parent pid {w.agent_pid}, which is no agent of the campaign"
                )
                continue
            w.agent = a
            m = ATTEMPT_RE.search(w.env.get("TORCHELASTIC_ERROR_FILE") or "")
            if m is None:
                self.unbound.remove(w)
                self.violate(
                    f"worker pid {w.pid}: no attempt in "
                    f"TORCHELASTIC_ERROR_FILE={w.env.get('TORCHELASTIC_ERROR_FILE')!r}"
                )
                continue
            w.attempt, w.local_rank = int(m.group(1)), int(m.group(2))
            if len(a.rounds) <= w.attempt:
                if now - w.seen_at > UNMATCHED_BOUND:
                    self.unbound.remove(w)
                    self.violate(
                        f"worker pid {w.pid} of {a.name} runs attempt {w.attempt}, but {a.name} logged only "
                        f"{len(a.rounds)} round line(s) within {UNMATCHED_BOUND:g} s"
                    )
                continue
            self.unbound.remove(w)
            ar = a.rounds[w.attempt]
            self.check_env(w, a, ar)
            r = self.rounds[ar.key]
            w.round = r
            a.workers.append(w)
            if w.rank in r.workers:
                self.violate(
                    f"{r.describe()}: rank {w.rank} started twice: "
                    f"{r.workers[w.rank].label()} and {w.label()}"
                )
                continue
            r.workers[w.rank] = w
            if r.complete_at is None and len(r.workers) == r.world:
                r.complete_at = now
                self.note("round started", f"round {r.number}", f"all {r.world} ranks up: {r.describe()}")

    def check_env(self, w: Worker, a: Agent, ar: AgentRound) -> None:
        env = w.env
        try:
            w.rank = int(env.get("RANK") or -1)
        except ValueError:
            w.rank = -1
        want = {
            "RANK": ar.first_rank + w.local_rank,
            "WORLD_SIZE": ar.world,
            "GROUP_RANK": ar.group_rank,
            "GROUP_WORLD_SIZE": ar.gws,
            "LOCAL_RANK": w.local_rank,
            "LOCAL_WORLD_SIZE": NPROC,
            "ROLE_RANK": ar.first_rank + w.local_rank,
            "ROLE_WORLD_SIZE": ar.world,
            "TORCHELASTIC_RESTART_COUNT": ar.restart,
            "TORCHELASTIC_MAX_RESTARTS": MAX_RESTARTS,
            "TORCHELASTIC_RUN_ID": JOB,
            "MASTER_ADDR": ar.master,
            "MASTER_PORT": ar.port,
        }
        wrong = {k: (env.get(k), v) for k, v in want.items() if env.get(k) != str(v)}
        if not 0 <= w.local_rank < NPROC:
            wrong["local rank dir"] = (str(w.local_rank), f"0..{NPROC - 1}")
        if wrong:
            text = ", ".join(f"{k}={got!r} (expected {exp})" for k, (got, exp) in wrong.items())
            self.violate(f"worker pid {w.pid} of {a.name} (attempt {w.attempt}, round {ar.number}): {text}")

    def check_server(self, now: float) -> None:
        srv = self.server
        if srv is None:
            return
        if srv.state in ("starting", "up") and srv.proc.p.poll() is not None:
            srv.rc = srv.proc.p.returncode
            srv.state = "down"
            self.violate(f"server#{srv.epoch} died (rc {srv.rc}) without the campaign stopping it")
        elif srv.state == "starting" and now - srv.started_at > SERVER_START_BOUND:
            self.violate(f"server#{srv.epoch} not listening {SERVER_START_BOUND:g} s after its start")

    def check_agents(self, now: float) -> None:
        for a in self.agents:
            if a.exited_at is None and a.proc.p.poll() is not None:
                a.exited_at, a.rc = now, a.proc.p.returncode
                if a.exempt(now):
                    a.exempt_until = max(a.exempt_until, now + ORPHAN_BOUND)
            if (
                a.exited_at is not None
                and not a.exit_judged
                and (stderr_done(a.proc) or now - a.exited_at > LOG_SETTLE)
            ):
                a.exit_judged = True
                self.judge_exit(a, now)
            if a.state == "draining" and a.exited_at is None and now - (a.drain_at or now) > DRAIN_EXIT_BOUND:
                a.state = "killed"  # reported once; cleanup kills it
                self.violate(f"drained agent {a.name} did not exit within {DRAIN_EXIT_BOUND:g} s\n{a.tail()}")

    def judge_exit(self, a: Agent, now: float) -> None:
        last = parse_agent_line(a.proc.err[-1])[3] if a.proc.err else ""
        self.note("agent exit", a.name, f"rc {a.rc} ({a.state}): {last}", t=a.exited_at)
        if a.state in ("running", "frozen"):
            self.violate(f"agent {a.name} exited with rc {a.rc} although nobody stopped it\n{a.tail()}")
        elif a.state == "ending" and a.rc != 0:
            self.violate(
                f"agent {a.name} exited with rc {a.rc} at the end of the job (expected 0)\n{a.tail()}"
            )
        elif a.state == "draining":
            self.judge_drain(a, now)

    def judge_drain(self, a: Agent, now: float) -> None:
        """The rule (node_agent/machine/agent.py): exit 0 only when the server's Left says the job goes on
        without this node; otherwise, and when no answer comes, 1. The answer must match what
        the campaign knows, and a server that was up the whole time must give one."""
        final = "\n".join(parse_agent_line(line)[3] for line in a.proc.err[-8:])
        said_on = "which goes on without this node" in final or "done: all nodes finished" in final
        said_off = "which does not go on without this node" in final
        assert a.drain_at is not None
        stopped = [t for t in self.stop_times if a.drain_at - 0.5 <= t <= (a.exited_at or now)]
        wrong = []
        if a.rc not in (0, 1):
            wrong.append(f"exit code {a.rc}, neither 0 nor 1")
        elif a.rc == 0 and not said_on:
            wrong.append("exit 0, but the server never said that the job goes on without it")
        elif a.rc == 1 and said_on:
            wrong.append("exit 1, although the server said that the job goes on without it")
        if said_off and a.drain_goes_on:
            wrong.append(f"the server said the job does not go on without it, but {a.drain_why}")
        if not said_on and not said_off and a.drain_up and not stopped:
            wrong.append("no answer from the server, which was up (and the agent connected) all along")
        if wrong:
            self.violate(
                f"drained agent {a.name} ({a.drain_how}) exited rc {a.rc}: {'; '.join(wrong)}\n{a.tail()}"
            )

    def check_workers(self, now: float) -> None:
        by_round: dict[Round, list[Worker]] = {}
        for w in self.workers.values():
            if w.dead_at is not None:
                continue
            if not alive(w.pid, w.ticks):
                w.dead_at = now
                continue
            a = w.agent or self.by_pid.get(w.agent_pid)
            if a is None:
                continue
            if a.exited_at is not None and now - a.exited_at > ORPHAN_BOUND and not w.orphan_noted:
                w.orphan_noted = True
                self.violate(
                    f"orphan: worker {w.label()} still alive {now - a.exited_at:.1f} s after its agent "
                    f"{a.name} exited (rc {a.rc}, {a.state})"
                )
            if w.round is not None and not a.exempt(now):
                by_round.setdefault(w.round, []).append(w)
        if len(by_round) > 1:
            parts = []
            for r, ws in sorted(by_round.items(), key=lambda kv: kv[0].number):
                who = ", ".join(f"{w.label()} [{w.agent.state if w.agent else '?'}]" for w in ws)
                parts.append(f"{r.describe()}: {who}")
            self.violate("workers of two rounds alive at once:\n    " + "\n    ".join(parts))

    def judge_rounds(self, now: float) -> None:
        for r in self.rounds.values():
            if r.judged or r.superseded_at is None or now < r.superseded_at + JUDGE_DELAY:
                continue
            r.judged = True
            missing = [k for k in range(r.world) if k not in r.workers]
            if not missing:
                continue
            why = self.excuse(r)
            if why is not None:
                self.note("round cut", f"round {r.number}", f"ranks {missing} never started: {why}")
                continue
            unstarted = sorted({k // NPROC for k in missing})
            holders = ", ".join(
                f"group rank {g}: {r.holders[g].name if g in r.holders else 'no agent said so'}"
                for g in unstarted
            )
            self.violate(
                f"{r.describe()} was superseded with ranks {missing} never started ({holders}), and no "
                f"campaign action during its life (+{self.rel(r.first_seen):.2f} .. "
                f"+{self.rel(r.superseded_at):.2f}) "
                f"explains it (completed by server#{r.server_epoch})"
            )

    def excuse(self, r: Round) -> str | None:
        assert r.superseded_at is not None
        lo, hi = r.first_seen - 1.0, r.superseded_at + 0.5
        for t, kind, target, epoch in self.actions:
            if not lo <= t <= hi or kind in ("junk", "server restart"):
                continue
            if (
                kind in ("server_kill", "server_term")
                and r.server_epoch is not None
                and r.server_epoch != epoch
            ):
                continue  # it hit another server process than the one that completed this round
            return f"{kind} {target} at +{self.rel(t):.2f}"
        for a in self.agents:
            if (
                a.frozen_at is not None
                and a.frozen_at <= hi
                and (a.thawed_at is None or a.thawed_at >= lo - HEARTBEAT_TIMEOUT)
            ):
                return f"{a.name} frozen at +{self.rel(a.frozen_at):.2f}"
        return None

    # -- /healthz ----------------------------------------------------------------------------

    def health(self) -> None:
        fails = 0
        while not self.stopping.wait(HEALTH_PERIOD):
            with self.cond:
                srv = self.server
                if srv is None or srv.state != "up":
                    fails = 0
                    continue
            status, err = None, ""
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HEALTH_TIMEOUT)
                try:
                    conn.request("GET", "/healthz")
                    resp = conn.getresponse()
                    resp.read()
                    status = resp.status
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException) as exc:
                err = f"{type(exc).__name__}: {exc}"
            with self.cond:
                if self.server is not srv or srv.state != "up":
                    fails = 0
                    continue
                if status == 200:
                    fails = 0
                elif status is not None:
                    self.violate(f"GET /healthz on server#{srv.epoch} answered {status}")
                else:
                    fails += 1
                    if fails >= HEALTH_FAILS:
                        self.violate(
                            f"GET /healthz on server#{srv.epoch} failed {fails} times in a row: {err}"
                        )
                        fails = 0

    # -- the state the faults need -----------------------------------------------------------

    def server_up(self) -> bool:
        return self.server is not None and self.server.state == "up"

    def server_down(self) -> bool:
        """Stopped by the campaign and not started again yet."""
        return self.server is not None and self.server.state == "down"

    def healthy(self) -> list[Agent]:
        return [a for a in self.agents if a.state == "running" and a.exited_at is None]

    def alive_agents(self) -> list[Agent]:
        return [a for a in self.agents if a.exited_at is None and a.state != "killed"]

    def live_workers(self) -> list[Worker]:
        out = []
        for w in self.workers.values():
            a = w.agent
            if w.dead_at is None and w.round is not None and a is not None and a.state == "running":
                if self.connected(a) and w.exit is None and w.term_t is None:
                    out.append(w)
        return sorted(out, key=lambda w: (w.round.number if w.round else -1, w.rank, w.pid))

    def drain_targets(self) -> tuple[list[Agent], bool, str]:
        """Whom a SIGTERM may drain, whether the server is up to answer, and why the job goes on."""
        healthy = self.healthy()
        linked = [a for a in healthy if self.connected(a)]
        if self.server_up() and len(linked) >= 3:
            return linked, True, "at least 2 other agents connected to the server remained"
        if self.server_down() and len(healthy) >= 3:
            why = "at least 2 other agents remained (members kept by the server across its restart)"
            return healthy, False, why
        return [], False, ""

    def eligible(self) -> dict[str, float]:
        w: dict[str, float] = {}
        healthy = self.healthy()
        if self.server_up() and self.live_workers():
            w["worker_kill"] = 3.0
            w["worker_fail"] = 3.0
        if len(healthy) >= 3:
            w["agent_kill"] = 2.0
            w["agent_stop"] = 1.5
        if self.drain_targets()[0]:
            w["drain_sigterm"] = 2.0
        linked = [a for a in healthy if self.connected(a)]
        if self.server_up() and len(linked) >= 3 and any(a.node_id for a in linked):
            w["drain_server"] = 1.5
        if self.server_up():
            w["server_kill"] = 1.5
            w["server_term"] = 1.5
            w["junk"] = 1.0
        pop = len(self.alive_agents())
        if pop < MAX_AGENTS:
            w["scale_up"] = 3.0 if pop < 5 else 1.0
        return {k: v for k, v in w.items() if k in self.cfg.faults}

    def pick(self) -> str | None:
        with self.cond:
            weights = self.eligible()
        if not weights:
            return None
        kinds = sorted(weights)
        return self.rng.choices(kinds, weights=[weights[k] for k in kinds])[0]

    # -- faults ------------------------------------------------------------------------------

    def inject(self, kind: str, ep: Episode) -> None:
        ep.kinds.append(kind)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        getattr(self, f"fault_{kind}")(ep)

    def fault_worker_kill(self, ep: Episode) -> None:
        self.worker_fault(ep, "worker_kill", signal.SIGKILL)

    def fault_worker_fail(self, ep: Episode) -> None:
        self.worker_fault(ep, "worker_fail", signal.SIGUSR2)

    def worker_fault(self, ep: Episode, kind: str, sig: int) -> None:
        with self.cond:
            w = self.rng.choice(self.live_workers())
            done = signal_exact(w.pid, w.ticks, sig)
        self.action(kind, w.label(), "signalled" if done else "already gone", ep)
        # Recovery is judged only once the fault has happened.
        if not self.wait(lambda: w.dead_at is not None, NOTICE_BOUND):
            self.violate(
                f"worker {w.label()} still alive {NOTICE_BOUND:g} s after {signal.Signals(sig).name}"
            )

    def fault_agent_kill(self, ep: Episode) -> None:
        with self.cond:
            candidates = [a for a in self.agents if a.state in ("running", "frozen") and a.exited_at is None]
            a = self.rng.choice(candidates)
            delay = self.rng.uniform(0.0, 1.0)
            was = a.state
            a.state = "killed"
            if a.exempt(mono()):
                a.exempt_until = max(a.exempt_until, mono() + ORPHAN_BOUND)
            os.kill(a.pid, signal.SIGKILL)
        self.action("agent_kill", a.name, f"SIGKILL (it was {was}); a replacement in {delay:.2f} s", ep)
        t = mono() + delay
        ep.pending.append(
            Pending(f"replace {a.name}", lambda now: now >= t, lambda: self.start_agent("replacement", ep))
        )

    def fault_agent_stop(self, ep: Episode) -> None:
        with self.cond:
            a = self.rng.choice(self.healthy())
            hold = self.rng.uniform(0.0, 1.5)
            a.state, a.frozen_at, a.silent_at = "frozen", mono(), None
            os.kill(a.pid, signal.SIGSTOP)
        self.action(
            "agent_stop", a.name, f"SIGSTOP until the server says it went silent, then {hold:.2f} s", ep
        )
        frozen_at = a.frozen_at
        assert frozen_at is not None

        def due(now: float) -> bool:
            if a.state != "frozen":
                return True  # killed meanwhile
            if a.silent_at is not None:
                return now >= a.silent_at + hold
            return now >= frozen_at + SILENT_BOUND + hold

        def thaw() -> None:
            with self.cond:
                if a.state != "frozen":
                    return
                silent = (
                    "declared silent" if a.silent_at is not None else "NOT declared silent (server down?)"
                )
                a.state, a.thawed_at = "running", mono()
                a.exempt_until = a.thawed_at + THAW_GRACE
                os.kill(a.pid, signal.SIGCONT)
            self.action("thaw", a.name, f"SIGCONT after {mono() - frozen_at:.2f} s; {silent}", ep)

        ep.pending.append(Pending(f"thaw {a.name}", due, thaw))

    def fault_drain_sigterm(self, ep: Episode) -> None:
        with self.cond:
            targets, up, why = self.drain_targets()
            a = self.rng.choice(targets)
        if not up:
            # A drain while the server is away: the agent must have seen it go first.
            if not self.wait(lambda: self.saw_server_go(a) or a.exited_at is not None, NOTICE_BOUND):
                self.violate(f"{a.name} did not notice within {NOTICE_BOUND:g} s that the server went away")
                return
        with self.cond:
            if a.exited_at is not None or a.state != "running":
                self.note("skipped", a.name, "drain: the agent is no longer running")
                return
            a.state, a.drain_how, a.drain_at = "draining", "SIGTERM", mono()
            (self.control / f"drain-{a.pid}").touch()
            a.drain_goes_on, a.drain_up, a.drain_why = True, up, why
            os.kill(a.pid, signal.SIGTERM)
        how = "the server is up" if up else "the server is down: exit 1 unless it answers after its restart"
        self.action("drain_sigterm", a.name, f"SIGTERM; {how}; the job goes on ({why})", ep)

    def fault_drain_server(self, ep: Episode) -> None:
        with self.cond:
            targets = [a for a in self.healthy() if self.connected(a) and a.node_id]
            a = self.rng.choice(targets)
            a.state, a.drain_how, a.drain_at = "draining", "rdzv-server drain", mono()
            (self.control / f"drain-{a.pid}").touch()
            a.drain_goes_on, a.drain_up = True, True
            a.drain_why = "at least 2 other agents connected to the server remained"
            node = a.node_id
            assert node is not None
        argv = server_cmd(
            "drain", "--endpoint", f"127.0.0.1:{self.port}", "--job", JOB, "--node", node, "--reason", "chaos"
        )
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, cwd=ROOT, check=False)
            rc, out = done.returncode, (done.stdout + done.stderr).decode(errors="replace").strip()
        except subprocess.TimeoutExpired:
            rc, out = -1, "timed out after 30 s"
        if rc == 3:  # the server does not have the node (yet): it sent nothing
            with self.cond:
                if a.state == "draining" and a.exited_at is None:
                    a.state, a.drain_at, a.drain_goes_on, a.drain_up = "running", None, False, False
                    (self.control / f"drain-{a.pid}").unlink(missing_ok=True)
            self.note("skipped", a.name, f"rdzv-server drain: {out}")
            return
        if rc != 0:
            self.violate(f"rdzv-server drain of {a.name} ({node}) failed with rc {rc}: {out}")
        self.action("drain_server", a.name, f"rdzv-server drain --node {node}: rc {rc}; the job goes on", ep)

    def fault_server_kill(self, ep: Episode) -> None:
        self.server_stop(ep, "server_kill", signal.SIGKILL)

    def fault_server_term(self, ep: Episode) -> None:
        self.server_stop(ep, "server_term", signal.SIGTERM)

    def server_stop(self, ep: Episode, kind: str, sig: int) -> None:
        with self.cond:
            srv = self.server
            assert srv is not None
            delay = self.rng.uniform(0.0, 2.0)
            srv.state = "stopping"
            self.last_stop_wall = time.time()
            self.stop_times.append(mono())
            srv.proc.p.send_signal(sig)
        self.action(
            kind,
            f"server#{srv.epoch}",
            f"{signal.Signals(sig).name}; restart {delay:.2f} s after it exits",
            ep,
        )
        stop_deadline = mono() + SERVER_STOP_BOUND

        def exited() -> None:
            with self.cond:
                srv.rc = srv.proc.p.returncode
                srv.state = "down"
            ok = srv.rc == 0 if sig == signal.SIGTERM else srv.rc == -signal.SIGKILL
            self.note("server exit", f"server#{srv.epoch}", f"rc {srv.rc}")
            if not ok:
                self.violate(
                    f"server#{srv.epoch} exited rc {srv.rc} after {signal.Signals(sig).name}\n"
                    + "\n".join(srv.proc.err[-15:])
                )
            t = mono() + delay
            ep.pending.append(
                Pending("restart the server", lambda now: now >= t, lambda: self.restart_server(ep))
            )

        ep.pending.append(
            Pending(
                f"server#{srv.epoch} exits", lambda now: srv.proc.p.poll() is not None, exited, stop_deadline
            )
        )

    def restart_server(self, ep: Episode) -> None:
        srv = self.start_server()
        self.action("server restart", f"server#{srv.epoch}", f"same port {self.port} and state dir", ep)
        up_deadline = mono() + SERVER_START_BOUND
        ep.pending.append(
            Pending(
                f"server#{srv.epoch} listening",
                lambda now: srv.state != "starting",
                lambda: None,
                up_deadline,
            )
        )

    def fault_scale_up(self, ep: Episode) -> None:
        self.start_agent("scale_up", ep)

    def fault_junk(self, ep: Episode) -> None:
        seed = self.rng.randrange(2**32)
        count = self.rng.randint(3, 8)
        t = threading.Thread(target=self.junk_burst, args=(seed, count), daemon=True)
        self.junk_threads.append(t)
        self.action("junk", f"port {self.port}", f"{count} connections (seed {seed})", ep)
        t.start()

    # -- junk --------------------------------------------------------------------------------

    def junk_burst(self, seed: int, count: int) -> None:
        rng = random.Random(seed)
        outcomes = []
        for _ in range(count):
            kind = rng.choice(("random", "magic_random", "half_open", "half_close", "http", "http_bad"))
            try:
                outcomes.append(f"{kind}: {getattr(self, f'junk_{kind}')(rng)}")
            except OSError as exc:
                outcomes.append(f"{kind}: {type(exc).__name__}")
            if self.stopping.is_set():
                break
        self.note("junk done", f"port {self.port}", "; ".join(outcomes))

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=3.0)
        s.settimeout(1.0)
        return s

    @staticmethod
    def drain_reply(s: socket.socket, window: float) -> tuple[bytes, str]:
        """What the server says until it closes or ``window`` passes."""
        got = b""
        deadline = mono() + window
        try:
            while mono() < deadline:
                s.settimeout(max(0.01, deadline - mono()))
                chunk = s.recv(65536)
                if not chunk:
                    return got, "closed"
                got += chunk
        except TimeoutError:
            return got, "open"
        except ConnectionResetError:
            return got, "reset"
        return got, "open"

    def junk_random(self, rng: random.Random) -> str:
        with self.connect() as s:
            s.sendall(rng.randbytes(rng.randint(1, 2048)))
            return self.drain_reply(s, 1.0)[1]

    def junk_magic_random(self, rng: random.Random) -> str:
        with self.connect() as s:
            s.sendall(MAGIC + rng.randbytes(rng.randint(1, 512)))
            return self.drain_reply(s, 1.0)[1]

    def junk_half_open(self, rng: random.Random) -> str:
        with self.connect() as s:
            s.sendall(MAGIC[: rng.randint(0, len(MAGIC))])
            return self.drain_reply(s, rng.uniform(0.2, 2.0))[1]

    def junk_half_close(self, rng: random.Random) -> str:
        with self.connect() as s:
            s.sendall(MAGIC + rng.randbytes(rng.randint(0, 3)))
            s.shutdown(socket.SHUT_WR)
            return self.drain_reply(s, 2.0)[1]

    def junk_http(self, rng: random.Random) -> str:
        path = rng.choice(("/healthz", f"/v1/jobs/{JOB}", "/metrics", "/v1/jobs"))
        with self.connect() as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            got, how = self.drain_reply(s, 3.0)
            return f"{path} {got.split(b' ', 2)[1].decode(errors='replace') if got.count(b' ') >= 2 else how}"

    def junk_http_bad(self, rng: random.Random) -> str:
        choices = (
            b"POST /v1/jobs/"
            + JOB.encode()
            + b"/nodes/no-such-node/drain HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            b"GET /" + bytes(rng.randrange(32, 127) for _ in range(40)) + b" HTTP/1.1\r\n\r\n",
            b"BREW /pot HTTP/9.9\r\nX: " + rng.randbytes(64) + b"\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nContent-Length: 99999999\r\n\r\npartial",
        )
        with self.connect() as s:
            s.sendall(rng.choice(choices))
            got, how = self.drain_reply(s, 2.0)
            return got.split(b"\r\n", 1)[0].decode(errors="replace")[:40] or how

    # -- episodes ----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self.cond:
            r = self.newest
            pids = frozenset((w.pid, w.ticks) for w in (r.workers.values() if r else ()) if w.dead_at is None)
            return Snapshot(
                round_key=r.key if r else None,
                number=r.number if r else -1,
                restart=r.restart if r else -1,
                pids=pids,
                starts=len(self.workers),
            )

    def problems(self, now: float) -> list[str]:
        """Why the job is not (yet) recovered; empty when it is."""
        out = []
        if not self.server_up():
            out.append("the server is not up")
        running = self.healthy()
        for a in self.agents:
            if a.state == "frozen":
                out.append(f"{a.name} is frozen")
            if a in running and not self.connected(a):
                out.append(f"{a.name} is not connected to the server")
        if self.unbound:
            out.append(f"{len(self.unbound)} worker report(s) not matched to a round yet")
        r = self.newest
        if r is None:
            out.append("no round yet")
            return out
        missing = [k for k in range(r.world) if k not in r.workers or r.workers[k].dead_at is not None]
        if missing:
            out.append(f"{r.describe()}: ranks {missing} not running")
        if r.ending_at is not None:
            out.append(f"{r.describe()} is being stopped (since +{self.rel(r.ending_at):.2f})")
        elsewhere = sorted(
            {w.agent.name for w in r.workers.values() if w.agent is not None and w.agent not in running}
        )
        if elsewhere:
            out.append(f"{r.describe()}: runs on agents that are not healthy: {elsewhere}")
        want = min(MAX_NODES, len(running))
        if r.gws != want:
            out.append(f"{r.describe()} has {r.gws} nodes; {len(running)} healthy agents should give {want}")
        stale = [w.label() for w in self.workers.values() if w.dead_at is None and w.round is not r]
        if stale:
            out.append(f"workers of older rounds still alive: {stale}")
        return out

    def await_recovery(self, ep: Episode, bound: float = RECOVERY_BOUND) -> None:
        """Wait until the job is whole again and stays so for ``RECOVERY_SETTLE`` (a restart that
        is on its way shows within that time), from what the monitor saw after the last action."""
        seen = self.cycles + 2
        since: list[float] = []

        def settled() -> bool:
            if self.cycles < seen or self.problems(mono()):
                since.clear()
                return False
            if not since:
                since.append(mono())
            return mono() - since[0] >= RECOVERY_SETTLE

        ok = self.wait(settled, bound - (mono() - ep.last_action), ep)
        if not ok:
            with self.cond:
                probs = self.problems(mono())
            self.violate(
                f"no recovery within {bound:g} s of the last action of episode {ep.n} "
                f"({' + '.join(ep.kinds)}):\n    " + "\n    ".join(probs)
            )
            self.check_failed()
        took = mono() - ep.last_action
        self.recoveries.append((" + ".join(ep.kinds), took))
        r = self.newest
        assert r is not None
        self.note(
            "recovered", f"episode {ep.n}", f"{r.describe()} running, {took:.2f} s after the last action"
        )

    def check_episode(self, ep: Episode, before: Snapshot) -> None:
        """What a single fault must (not) change; faults in combination only have the invariants."""
        if len(ep.kinds) != 1:
            return
        kind = ep.kinds[0]
        after = self.snapshot()
        if kind in ("server_kill", "server_term", "junk"):
            if (
                after.round_key != before.round_key
                or after.pids != before.pids
                or after.starts != before.starts
            ):
                with self.cond:
                    new = [w.label() for w in list(self.workers.values())[before.starts :]]
                self.violate(
                    f"{kind} restarted workers: before round {before.number} "
                    f"pids {sorted(p for p, _ in before.pids)}, "
                    f"after round {after.number} pids {sorted(p for p, _ in after.pids)}; new workers: {new}"
                )
        elif kind in ("worker_kill", "worker_fail"):
            if after.restart != before.restart + 1:
                self.violate(f"{kind}: restart count went {before.restart} -> {after.restart} (expected +1)")
        elif after.restart != before.restart:
            self.violate(
                f"{kind}: restart count went {before.restart} -> {after.restart} "
                "(a membership change uses none)"
            )
        self.check_failed()

    def episode(self) -> None:
        self.episodes += 1
        ep = Episode(self.episodes, last_action=mono())
        before = self.snapshot()
        kind = self.pick()
        if kind is None:
            self.idle(1.0)
            return
        self.inject(kind, ep)
        for odds in COMPOUND_ODDS:
            if self.rng.random() >= odds:
                break
            self.idle(self.rng.uniform(0.05, 1.5), ep)
            more = self.pick()
            if more is None:
                break
            self.inject(more, ep)
        while ep.pending:
            self.idle(TICK, ep)
        self.await_recovery(ep)
        self.check_episode(ep, before)
        self.idle(self.rng.uniform(0.2, 1.0))

    # -- the whole run -----------------------------------------------------------------------

    def run(self) -> None:
        self.note(
            "start",
            f"seed {self.cfg.seed}",
            f"{self.cfg.seconds:g} s, faults: {', '.join(sorted(self.cfg.faults))}",
        )
        for target in (self.monitor, self.health):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self.threads.append(t)
        srv = self.start_server()
        if not self.wait(lambda: srv.state == "up", SERVER_START_BOUND):
            self.violate(f"the server did not start\n{srv.proc.stderr}")
            self.check_failed()
        # The first round's nodes, then the spares once it runs: who is a spare is the seed's.
        spares = self.rng.randint(1, MAX_AGENTS - MAX_NODES)
        for group in (MAX_NODES, *[1] * spares):
            ep = Episode(0, ["start"], last_action=mono())
            for _ in range(group):
                self.start_agent("agent start", ep)
            self.await_recovery(ep, FIRST_ROUND_BOUND)
        deadline = mono() + self.cfg.seconds
        while mono() < deadline:
            self.episode()
        self.finish()

    def finish(self) -> None:
        with self.cond:
            final = self.newest
            ending = [a for a in self.agents if a.state == "running" and a.exited_at is None]
            for a in ending:
                a.state = "ending"
        self.release.touch()
        self.action(
            "release", f"{len(ending)} agents", "release file created: workers exit 0, agents must exit 0"
        )
        if not self.wait(
            lambda: all(a.exited_at is not None and a.exit_judged for a in self.agents), END_BOUND
        ):
            left = [a.name for a in self.agents if a.exited_at is None]
            self.violate(f"agents still running {END_BOUND:g} s after the release: {left}")
        self.check_failed()
        assert final is not None
        if not self.wait(lambda: all(w.exit is not None for w in final.workers.values()), 10.0):
            self.violate(f"{final.describe()}: workers without an exit report after the release")
        bad = [f"{w.label()}: {w.exit}" for w in final.workers.values() if w.exit and w.exit.get("code") != 0]
        if bad:
            self.violate(f"workers did not exit 0 on release: {bad}")
        srv = self.server
        assert srv is not None
        with self.cond:
            srv.state = "stopping"
        srv.proc.p.send_signal(signal.SIGTERM)
        if not self.wait(lambda: srv.proc.p.poll() is not None, SERVER_STOP_BOUND):
            self.violate(f"server#{srv.epoch} did not exit within {SERVER_STOP_BOUND:g} s of SIGTERM")
        elif srv.proc.p.returncode != 0:
            self.violate(f"server#{srv.epoch} exited rc {srv.proc.p.returncode} on SIGTERM at the end")
        with self.cond:
            srv.state = "down"
        self.note("end", f"server#{srv.epoch}", f"rc {srv.proc.p.returncode}")
        if not self.wait(lambda: all(w.dead_at is not None for w in self.workers.values()), ORPHAN_BOUND):
            self.violate(
                "workers alive after every agent exited: "
                + ", ".join(w.label() for w in self.workers.values() if w.dead_at is None)
            )
        self.check_failed()

    def cleanup(self) -> None:
        self.stopping.set()
        with self.cond:
            agents, servers, workers = list(self.agents), list(self.servers), list(self.workers.values())
        for a in agents:
            a.proc.kill()  # its session; SIGKILL ends a stopped process too
        for w in workers:
            signal_exact(w.pid, w.ticks, signal.SIGKILL, group=True)
        for srv in servers:
            srv.proc.kill()
        for t in [*self.threads, *self.junk_threads]:
            t.join(timeout=10)
        if self.cfg.keep and self.violations:
            self.note("kept", str(self.tmp), "CHAOS_KEEP: the temporary directory is kept")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the report --------------------------------------------------------------------------

    def named(self, text: str) -> str:
        """The agents' names for their node ids (``node vm:1234:ab12`` reads ``node a3``)."""
        names = {a.node_id: a.name for a in self.agents if a.node_id}
        return NAMED_NODE_RE.sub(lambda m: f"{m.group(1)} {names.get(m.group(2), m.group(2))}", text)

    def render(self) -> str:
        with self.cond:
            rows = sorted(self.rows, key=lambda r: r.t)
            return "\n".join(
                f"  +{self.rel(r.t):8.3f}  {r.kind:<16} {r.target:<34} {self.named(r.observed)}" for r in rows
            )

    def agents_report(self) -> str:
        out = []
        for a in self.agents:
            out.append(
                f"  {a.name}: pid {a.pid}, node id {a.node_id}, state {a.state}, rc {a.rc}, "
                f"term delay {a.term_delay:g} s, "
                f"{len(a.rounds)} round(s), last lines:\n{self.named(a.tail(12))}"
            )
        for srv in self.servers:
            tail = self.named("\n".join(f"      {line}" for line in srv.proc.err[-12:]))
            out.append(
                f"  server#{srv.epoch}: pid {srv.proc.p.pid}, state {srv.state}, rc {srv.rc}, "
                f"last lines:\n{tail}"
            )
        return "\n".join(out)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        worst = max(self.recoveries, key=lambda x: x[1], default=("-", 0.0))
        restarts = self.newest.restart if self.newest else 0
        return (
            f"chaos: seed {self.cfg.seed}: {self.episodes} episode(s) in {mono() - self.t0:.1f} s; "
            f"faults: {kinds}; "
            f"{len(self.rounds)} rounds, restart count {restarts}, {len(self.workers)} worker starts, "
            f"{len(self.agents)} agents, {len(self.servers)} server processes; slowest recovery "
            f"{worst[1]:.2f} s ({worst[0]})"
        )


@dataclass
class Result:
    seed: int
    summary: str
    episodes: int
    counts: dict[str, int]
    report: str


def run_campaign(cfg: Config) -> Result:
    """Run one campaign; raise AssertionError with the seed and timeline on any violation."""
    print(
        f"chaos: seed {cfg.seed} (replay with CHAOS_SEED={cfg.seed}), {cfg.seconds:g} s of faults", flush=True
    )
    c = Campaign(cfg)
    failure: BaseException | None = None
    try:
        c.run()
    except BaseException as exc:  # a violation, a bug of ours, or pytest's timeout: report it all
        failure = exc
    finally:
        c.cleanup()
    report = (
        f"{c.summary()}\nreplay: CHAOS_SEED={cfg.seed} CHAOS_SECONDS={cfg.seconds:g}"
        + (f" CHAOS_FAULTS={','.join(sorted(cfg.faults))}" if set(cfg.faults) != set(FAULT_KINDS) else "")
        + f"\n\ntimeline (seconds since the start):\n{c.render()}\n\nprocesses:\n{c.agents_report()}\n"
    )
    if cfg.report_path:
        Path(cfg.report_path).write_text(report)
    if failure is not None or c.violations:
        first = c.violations[0] if c.violations else f"{type(failure).__name__}: {failure}"
        more = (
            f"\n(and {len(c.violations) - 1} more violation(s), in the timeline)"
            if len(c.violations) > 1
            else ""
        )
        message = f"CHAOS FAILURE, seed {cfg.seed}: {c.named(first)}{more}\n\n{report}"
        print(message.split("\n", 1)[0], flush=True)
        if isinstance(failure, KeyboardInterrupt):
            raise failure
        raise ChaosFailure(message) from (None if isinstance(failure, ChaosFailure) else failure)
    print(c.summary(), flush=True)
    if cfg.verbose:
        print(report, flush=True)
    return Result(cfg.seed, c.summary(), c.episodes, dict(c.counts), report)
