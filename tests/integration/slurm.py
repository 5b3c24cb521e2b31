"""A real Slurm on this one machine: munged, slurmctld and two slurmd, each node a namespace.

Debian's packages (``slurmctld slurmd slurm-client munge``; scripts/test.sh installs them):

    munged                      root namespace, its own socket and a key made for this cluster
    slurmctld  "ctl"            198.18.0.2   net + UTS + mount namespace (netns.py's host 0)
    slurmd     "n1", "n2"       198.18.1.2, 198.18.2.2   each in its own net + UTS + mount namespace

The network is netns.py's: a hub namespace routes between the hosts' /24s, nothing is added
to the root namespace. A daemon is entered with ``nsenter --net=… unshare --mount --uts``, not
``ip netns exec``, which remounts /sys and so hides /sys/fs/cgroup, without which slurmd 22.05
does not start. Inside each mount namespace the cluster's hosts file is bound over /etc/hosts
and the UTS host name is the node's name, so node names resolve inside jobs as on a cluster and
each slurmd finds itself in slurm.conf. The mount namespaces share the filesystem otherwise:
jobs see the checkout, its venv and the test's folders at the same paths.

``ProctrackType=proctrack/linuxproc``: ``scancel`` and ``scancel --signal`` reach every process
of a step, as proctrack/cgroup does on real clusters. Without slurmdbd there is no sacct; job
states and exit codes come from ``scontrol show job`` (``MinJobAge`` keeps finished jobs), the
tasks' exit codes from the slurmd logs. Clients (sbatch, scontrol, scancel) run in the
controller's network namespace. Every wait is bounded; :meth:`SlurmCluster.close` stops what it
started (the daemons by their pids, then whatever is left in its namespaces), removes the
namespaces and its temporary folder.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from .netns import Host, NetnsSetupError, Network
from .procs import ROOT, Proc

PACKAGES = "slurmctld slurmd slurm-client munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "nsenter", "unshare")
CONTROLLER = "ctl"
NODES = ("n1", "n2")
PARTITION = "test"
VENV_BIN = ROOT / ".venv" / "bin"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLIENT_TIMEOUT = 30.0  # one sbatch/scontrol/scancel
START_TIMEOUT = 60.0  # the daemons up and both nodes idle
STOP_TIMEOUT = 10.0  # a daemon's exit after SIGTERM
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")

# Run a daemon in new mount and UTS namespaces (already inside a network namespace): the
# cluster's hosts file over /etc/hosts, the node's name as host name, then the daemon.
_ENTER = (
    'd=$1 n=$2; shift 2; mount --bind "$d/hosts" /etc/hosts && mount --bind "$d/resolv.conf" /etc/resolv.conf'
    ' && hostname "$n" && exec "$@"'
)


class SlurmSetupError(RuntimeError):
    """The cluster did not come up, or a client command failed."""


def require_slurm() -> None:
    """Skip where Slurm cannot run here and we are not root; as root (CI), fail loudly."""
    missing = [
        p for p in PROGRAMS if shutil.which(p, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}") is None
    ]
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of network namespaces needs root")
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: scripts/test.sh installs Debian's {PACKAGES}")


@dataclass(frozen=True)
class Node:
    name: str
    host: Host  # its network namespace, address and veth

    @property
    def ns(self) -> str:
        return self.host.ns

    @property
    def addr(self) -> str:
        return self.host.addr


class SlurmCluster:
    """munged, a controller and the nodes :data:`NODES` in one partition; see the module doc."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: the munge socket's path
        self.dir.chmod(0o755)  # munged wants its socket's folders searchable by all
        self.net: Network | None = None
        self.controller: Node | None = None
        self.nodes: dict[str, Node] = {}
        self._daemons: list[tuple[str, Proc]] = []
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"

    # -- bring-up --------------------------------------------------------------------------

    @classmethod
    def start(cls) -> SlurmCluster:
        require_slurm()
        cluster = cls()
        try:
            cluster._start()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _start(self) -> None:
        try:
            self.net = Network.create(n_hosts=1 + len(NODES))
        except pytest.skip.Exception as exc:  # as root, namespaces that cannot be made are a failure
            pytest.fail(f"cannot make the Slurm cluster's namespaces: {exc}")
        ctl_host, *node_hosts = self.net.hosts
        self.controller = Node(CONTROLLER, ctl_host)
        self.nodes = {name: Node(name, h) for name, h in zip(NODES, node_hosts, strict=True)}
        hosts = self.dir / "hosts"
        hosts.write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            + "".join(f"{n.addr}\t{n.name}\n" for n in (self.controller, *self.nodes.values()))
        )
        hosts.chmod(0o644)
        # No DNS server is reachable from the namespaces: the machine's, whose queries the hub
        # drops, made each lookup of what hosts lacks wait out the resolver's 5 s (torch's store
        # client looks up its own socket's address: 5 s in every init_process_group). One
        # that refuses at once fails those lookups at once, as a cluster's DNS answers them.
        resolv = self.dir / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        resolv.chmod(0o644)
        self._start_munged()
        self._write_conf()
        self._spawn_in(self.controller, "slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes.values():
            (self.dir / node.name / "spool").mkdir(parents=True)
            self._spawn_in(node, "slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", node.name])
        self._wait_nodes_idle()

    def _start_munged(self) -> None:
        d = self.munge_socket.parent
        d.mkdir()
        d.chmod(0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))  # this cluster's own key, never the machine's
        key.chmod(0o400)
        argv = [
            "munged",
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ]
        proc = Proc(argv, env=self._env())
        self._daemons.append(("munged", proc))
        self._until(lambda: self.munge_socket.is_socket(), 15, "munged's socket", proc)

    def _write_conf(self) -> None:
        assert self.controller is not None
        d = self.dir
        (d / "ctld").mkdir()
        plugstack = d / "plugstack.conf"
        plugstack.write_text("")  # none of the machine's SPANK plugins
        lines = [
            "ClusterName=nodeagent",
            f"SlurmctldHost={CONTROLLER}({self.controller.addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'ctld' / 'state'}",
            f"SlurmctldPidFile={d / 'ctld' / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'ctld' / 'slurmctld.log'}",
            f"SlurmdSpoolDir={d / '%n' / 'spool'}",
            f"SlurmdPidFile={d / '%n' / 'slurmd.pid'}",
            f"SlurmdLogFile={d / '%n' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=verbose",  # slurmstepd then logs each task's exit code
            f"PlugStackConfig={plugstack}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "MinJobAge=3600",  # finished jobs stay in scontrol show job
            "KillWait=10",
            "InactiveLimit=0",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d / 'ctld' / 'jobcomp.txt'}",
            *(
                f"NodeName={n.name} NodeAddr={n.addr} CPUs=2 RealMemory=1000 State=UNKNOWN"
                for n in self.nodes.values()
            ),
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn_in(self, node: Node, what: str, argv: Sequence[str]) -> Proc:
        enter = ["nsenter", f"--net=/run/netns/{node.ns}", "unshare", "--mount", "--uts", "--"]
        proc = Proc([*enter, "sh", "-c", _ENTER, "sh", str(self.dir), node.name, *argv], env=self._env())
        self._daemons.append((f"{what} {node.name}", proc))
        return proc

    def _wait_nodes_idle(self) -> None:
        def idle() -> bool:
            res = self.client("scontrol", "show", "node", "-o", check=False)
            states = dict(re.findall(r"NodeName=(\S+) .*?State=(\S+)", res.stdout))
            return all(states.get(n, "").split("+")[0] == "IDLE" for n in self.nodes)

        self._until(idle, START_TIMEOUT, "both nodes IDLE")

    def _until(self, ok: Callable[[], bool], timeout: float, what: str, proc: Proc | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for name, p in [(n, q) for n, q in self._daemons if proc is None or q is proc]:
                if p.p.poll() is not None:
                    raise SlurmSetupError(f"{name} exited with {p.p.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmSetupError(f"no {what} within {timeout:g} s\n{self.logs()}")
            time.sleep(0.2)

    # -- clients ---------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": f"{VENV_BIN}:{SYSTEM_PATH}",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.conf),
        }
        env.update(extra or {})
        return env

    def client(
        self, *argv: str, check: bool = True, timeout: float = CLIENT_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command in the controller's network namespace."""
        assert self.controller is not None
        full = ["nsenter", f"--net=/run/netns/{self.controller.ns}", *argv]
        try:
            res = subprocess.run(
                full, capture_output=True, text=True, env=self._env(), timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise SlurmSetupError(f"{shlex.join(argv)} did not finish within {timeout:g} s") from None
        if check and res.returncode != 0:
            raise SlurmSetupError(
                f"{shlex.join(argv)} exited with {res.returncode}: {res.stderr.strip()}\n{self.logs()}"
            )
        return res

    def sbatch(
        self,
        script: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        chdir: Path,
        options: Sequence[str] = (),
    ) -> int:
        """Submit ``script args``; the job's environment is a clean one plus ``env``, with the
        venv's programs first on PATH. Returns the job id."""
        exported = {
            "PATH": f"{VENV_BIN}:{SYSTEM_PATH}",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        for k, v in exported.items():
            if "," in v or "," in k:
                raise ValueError(f"--export cannot carry a comma: {k}={v}")
        export = "ALL," + ",".join(f"{k}={v}" for k, v in exported.items())
        res = self.client(
            "sbatch", "--parsable", f"--chdir={chdir}", f"--export={export}", *options, str(script), *args
        )
        return int(res.stdout.strip().split(";")[0])

    def job_info(self, job: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, ExitCode, NodeList, StdOut, Restarts...)."""
        out = self.client("scontrol", "show", "job", "-o", str(job)).stdout
        info: dict[str, str] = {}
        for word in out.split():
            key, sep, value = word.partition("=")
            if sep and key not in info:
                info[key] = value
        return info

    def wait_state(self, job: int, states: Collection[str], timeout: float = 60.0) -> dict[str, str]:
        """Poll until the job's state is one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job} not in {sorted(states)} within {timeout:g} s: {info}\n"
                    f"--- output:\n{self.output(job)}\n{self.logs()}"
                )
            time.sleep(0.25)

    def wait_done(self, job: int, timeout: float = 90.0) -> dict[str, str]:
        return self.wait_state(job, FINISHED, timeout)

    def scancel(self, job: int, signal: str | None = None) -> None:
        self.client("scancel", *([f"--signal={signal}"] if signal else []), str(job))

    def requeue(self, job: int, timeout: float = 30.0) -> None:
        """Requeue a running job and let it start again now (requeue holds it ~2 min).

        Not within the second of the requeue: slurmd revokes the job's credential at the
        requeue, with one-second stamps, and refuses a credential made in that same second
        ("Killing non-startable batch JobId=N: Job credential revoked": the job ends FAILED).
        A job whose tasks end at once on SIGTERM (ours) is PENDING again within 0.1 s."""
        self.client("scontrol", "requeue", str(job))
        self.wait_state(job, {"PENDING"}, timeout)
        self._wait_nodes_idle()  # the nodes have ended the run: its credential is revoked by now
        now = time.time()
        time.sleep(math.floor(now) + 1.05 - now)  # into the next second
        self.client("scontrol", "update", f"JobId={job}", "StartTime=now")

    def output(self, job: int) -> str:
        """The text of the job's output file (so far)."""
        try:
            path = Path(self.job_info(job)["StdOut"])
            return path.read_text(errors="replace")
        except (OSError, KeyError, SlurmSetupError) as exc:
            return f"<no output: {exc}>"

    def task_exits(self, job: int, step: int = 0) -> dict[tuple[str, int], int]:
        """{(node, task id): exit status} of a step's tasks, as each node's slurmstepd logged
        them (the wait status: a signal's number, or 256 * an exit code)."""
        rx = re.compile(
            rf"\[{job}\.{step}\] task (\d+) \(\d+\) exited(?: with exit code (\d+)|\. Killed by signal (\d+))"
        )
        found: dict[tuple[str, int], int] = {}
        for name in self.nodes:
            for m in rx.finditer(self.log(name)):
                found[(name, int(m.group(1)))] = int(m.group(2)) * 256 if m.group(2) else int(m.group(3))
        return found

    # -- inside the nodes ------------------------------------------------------------------

    def node_processes(self, node: str) -> dict[int, str]:
        """{pid: command line} of every process inside the node's namespace but its slurmd."""
        daemon = {p.p.pid for n, p in self._daemons if n == f"slurmd {node}"}
        res = subprocess.run(
            ["ip", "netns", "pids", self.nodes[node].ns], capture_output=True, text=True, timeout=10
        )
        procs = {}
        for pid in map(int, res.stdout.split()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if pid not in daemon and cmd:
                procs[pid] = cmd
        return procs

    def wait_no_processes(self, node: str, pattern: str, timeout: float = 30.0) -> None:
        """Until no process of the node matches ``pattern`` (slurmstepd's exit is not instant)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            left = {pid: c for pid, c in self.node_processes(node).items() if rx.search(c)}
            if not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{node}: still running after {timeout:g} s: {left}")
            time.sleep(0.25)

    def log(self, name: str) -> str:
        """A daemon's log: ``ctl``, a node's name or ``munge``."""
        path = {
            CONTROLLER: self.dir / "ctld" / "slurmctld.log",
            "munge": self.dir / "munge" / "munged.log",
        }.get(name, self.dir / name / "slurmd.log")
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def logs(self, tail: int = 40) -> str:
        """The last lines of every log and daemon output, for a failure's message."""
        parts = []
        for name in (CONTROLLER, *self.nodes, "munge"):
            lines = self.log(name).splitlines()[-tail:]
            parts.append(f"--- {name} log:\n" + "\n".join(lines))
        for name, p in self._daemons:
            if p.stderr or p.stdout:
                parts.append(f"--- {name} output:\n{p.stdout}\n{p.stderr}")
        return "\n".join(parts)

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the daemons (SIGTERM, then SIGKILL), then everything left in the namespaces;
        remove the namespaces and the temporary folder. Safe at any point of start()."""
        errors: list[str] = []
        for _, proc in reversed(self._daemons):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for _, proc in reversed(self._daemons):
            try:
                proc.p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill()
        self._daemons.clear()
        if self.net is not None:
            try:
                self.net.close()  # kills what is left in the namespaces: slurmstepd, jobs' processes
            except NetnsSetupError as exc:
                errors.append(str(exc))
            self.net = None
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise SlurmSetupError("; ".join(errors))

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def slurm_cluster() -> Iterator[SlurmCluster]:
    """The body of a module-scoped fixture: one cluster for a test module."""
    cluster = SlurmCluster.start()
    try:
        yield cluster
    finally:
        cluster.close()
