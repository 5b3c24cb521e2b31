"""What users install: the sdist and the wheel built from this checkout, installed outside it.

The module builds both with ``python -m build`` from a clean copy of the checkout (it builds the
wheel from the sdist, so a file the sdist leaves out is missing from the wheel too), checks
their contents against the source tree, installs the wheel into a fresh venv in a temporary
directory (no extras, no torch) and runs the installed programs from a directory outside the
checkout, with no ``PYTHONPATH`` reaching it: ``--version``, a standalone job whose workers use
``from node_agent import worker``, ``python -m`` for both programs, and a two-node job on the
venv's ``rdzv-server`` watched through ``rdzv-server status``, the dashboard and the JSON API.

The build and the install happen once, in a module-scoped fixture (tens of seconds: pip may
fetch the dependencies from its cache or the index).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "edge", "rdzv_server", "node_agent")
DATA_FILES = ("rdzv_server/dashboard.html",)
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
JOB = "fresh-install"

# Each rank reports a few steps through the installed worker module, then says where that
# module came from and whether it attached to the agent's progress page.
TRAIN = """\
import os
import sys

import node_agent
from node_agent import worker

rank = os.environ["RANK"]
for step in range(3):
    with worker.phase("compute"):
        pass
    worker.progress(step)
    if worker.should_stop():
        break
# One write: both ranks share the console, and print writes its text and newline apart
# when unbuffered (torchrun's workers are), so two ranks' lines could run together.
line = f"rank {rank} done step {step} attached={worker.attached()} from {node_agent.__file__}\\n"
sys.stdout.write(line)
sys.stdout.flush()
"""

# A rank of the two-node job: it reports progress, connects to the test's release socket, says
# it runs, and waits there (bounded) for "release"; the test closing the socket instead (a
# failure) makes it exit 3 at once.
TRAIN_HELD = """\
import os
import socket
import sys

from node_agent import worker

rank = os.environ["RANK"]
for step in range(3):
    worker.progress(step)
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60) as conn:
    conn.sendall(f"{rank}\\n".encode())
    print(f"rank {rank} running", flush=True)
    reply = conn.recv(64)
print(f"rank {rank} released: {reply!r}", flush=True)
sys.exit(0 if reply == b"release" else 3)
"""


def source_modules() -> set[str]:
    """Every module of the source packages, as a path relative to the checkout."""
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.add(path.relative_to(REPO).as_posix())
    assert found, f"no modules found under {REPO}"
    return found


def shown(result: subprocess.CompletedProcess[str]) -> str:
    command = " ".join(map(str, result.args))
    return f"$ {command}\nexit {result.returncode}\n{result.stdout}{result.stderr or ''}"


@dataclass
class Install:
    root: Path  # a temporary directory outside the checkout
    wheel: Path
    sdist: Path
    venv: Path
    work: Path  # the users' working directory: the training scripts, the cwd of every run
    env: dict[str, str]

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.work,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def user_env(venv: Path) -> dict[str, str]:
    """The environment of a user of the venv: nothing reaches the checkout, the venv's bin first."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not _inside(Path(p), REPO)]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    local = "127.0.0.1,localhost"  # our own requests to the local server never go to a proxy
    for var in ("no_proxy", "NO_PROXY"):
        env[var] = f"{env[var]},{local}" if env.get(var) else local
    env.pop("LOGLEVEL", None)  # the agents' informational lines go into the failure messages
    return env


# What .gitignore keeps out of a clone: the venv, builds, caches (and .git itself).
_ROOT_ONLY = {".git", ".venv", "build", "dist", "tmp"}
_ANYWHERE = ("__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis")


def _not_source(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in _ANYWHERE)}
    if Path(folder).resolve() == REPO:
        skipped |= _ROOT_ONLY & set(names)
    return skipped


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _one(paths: Sequence[Path], what: str, log: str) -> Path:
    assert len(paths) == 1, f"expected one {what}, found {[p.name for p in paths]}\n{log}"
    return paths[0]


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    root = tmp_path_factory.mktemp("fresh-install")
    assert not _inside(root, REPO), f"the temporary directory {root} is inside the checkout"
    venv = root / "venv"
    env = user_env(venv)

    # The build runs on a copy of the source tree, without what building or testing left in the
    # checkout: setuptools reads an old *.egg-info/SOURCES.txt into the sdist, so a stale one
    # would hide a module the packaging leaves out (and the build writes none into the checkout).
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_not_source)
    dist = root / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(source)],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, f"building the sdist and the wheel failed:\n{shown(build)}"
    wheel = _one(sorted(dist.glob("*.whl")), "wheel", shown(build))
    sdist = _one(sorted(dist.glob("*.tar.gz")), "sdist", shown(build))

    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, f"creating the venv failed:\n{shown(made)}"
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", str(wheel)],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert pip.returncode == 0, f"installing the wheel failed:\n{shown(pip)}"

    work = root / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    (work / "train_held.py").write_text(TRAIN_HELD)
    return Install(root=root, wheel=wheel, sdist=sdist, venv=venv, work=work, env=env)


# -- what is in the packages ----------------------------------------------------------------


def test_wheel_has_every_module_and_no_tests(install: Install) -> None:
    with zipfile.ZipFile(install.wheel) as wheel:
        names = set(wheel.namelist())
    missing = sorted((source_modules() | set(DATA_FILES)) - names)
    assert not missing, f"{install.wheel.name} lacks {len(missing)} files of the checkout: {missing}"
    stray = sorted(n for n in names if n.split("/", 1)[0] in ("tests", "bench"))
    assert not stray, f"{install.wheel.name} holds files of tests/ or bench/: {stray}"


def test_sdist_is_complete(install: Install) -> None:
    with tarfile.open(install.sdist) as sdist:
        # Every member is under one top folder, elastic_launch-<version>/.
        names = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    wanted = source_modules() | set(DATA_FILES) | {"README.md", "pyproject.toml"}
    missing = sorted(wanted - names)
    assert not missing, f"{install.sdist.name} lacks {len(missing)} files of the checkout: {missing}"


# -- the installed programs -----------------------------------------------------------------


@pytest.mark.parametrize("program", ["node-agent", "rdzv-server"])
def test_version(install: Install, program: str) -> None:
    result = install.run(install.bin(program), "--version", timeout=60)
    assert result.returncode == 0, shown(result)
    assert result.stdout.strip() == f"{program} {VERSION}", shown(result)


def test_installed_outside_the_checkout_without_torch(install: Install) -> None:
    python = install.bin("python")
    no_torch = install.run(
        python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    )
    assert no_torch.returncode == 0, f"the fresh venv can import torch:\n{shown(no_torch)}"

    where = install.run(
        python,
        "-c",
        "import json, sysconfig, protocol, edge, rdzv_server, node_agent, node_agent.worker as w\n"
        "print(json.dumps({'purelib': sysconfig.get_paths()['purelib'],"
        " 'modules': {m.__name__: m.__file__ for m in (protocol, edge, rdzv_server, node_agent, w)}}))",
    )
    assert where.returncode == 0, shown(where)
    doc = json.loads(where.stdout)
    site = Path(doc["purelib"])
    assert _inside(site, install.venv), f"{site} is not the venv's site-packages\n{shown(where)}"
    for name, file in doc["modules"].items():
        assert _inside(Path(file), site), f"{name} comes from {file}, not {site}\n{shown(where)}"
        assert not _inside(Path(file), REPO), f"{name} comes from the checkout: {file}"


def _assert_ranks_done(result: subprocess.CompletedProcess[str], nproc: int, site: Path) -> None:
    assert result.returncode == 0, shown(result)
    for rank in range(nproc):
        line = re.search(rf"^rank {rank} done step 2 attached=(\w+) from (.+)$", result.stdout, re.M)
        assert line, f"no line of rank {rank}:\n{shown(result)}"
        assert line[1] == "True", f"rank {rank}'s worker module did not attach:\n{shown(result)}"
        assert _inside(Path(line[2]), site), f"rank {rank} imported node_agent from {line[2]}"


def test_standalone_job(install: Install) -> None:
    result = install.run(install.bin("node-agent"), "--standalone", "--nproc-per-node", "2", "train.py")
    _assert_ranks_done(result, 2, install.venv)


def test_python_m_node_agent(install: Install) -> None:
    result = install.run(
        install.bin("python"), "-m", "node_agent", "--standalone", "--nproc-per-node", "1", "train.py"
    )
    _assert_ranks_done(result, 1, install.venv)


def test_python_m_rdzv_server_help(install: Install) -> None:
    result = install.run(install.bin("python"), "-m", "rdzv_server", "--help", timeout=60)
    assert result.returncode == 0, shown(result)
    assert result.stdout.startswith("usage:"), shown(result)
    assert "--port" in result.stdout, shown(result)


# -- a two-node job on the installed rdzv-server --------------------------------------------


class Proc:
    """A program started from the venv, its stdout and stderr read by a thread as they come."""

    def __init__(self, name: str, argv: Sequence[str], install: Install) -> None:
        self.name = name
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            argv,
            cwd=install.work,
            env=install.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # end of output
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> None:
        """Wait until a line matches ``pattern``; fail at the deadline or at the end of output."""
        regex = re.compile(pattern)

        def seen() -> bool:
            return any(regex.search(line) for line in self.lines) or (self.lines[-1:] == [""])

        with self._changed:
            self._changed.wait_for(seen, timeout=timeout)
            if not any(regex.search(line) for line in self.lines):
                pytest.fail(f"{self.name} did not print /{pattern}/ within {timeout} s:\n{self.describe()}")

    def describe(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}):\n{self.output()}"

    def stop(self) -> None:
        """Kill it if it still runs, and reap it and its reader (bounded)."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        finally:
            self._reader.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, server: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"rdzv-server did not accept connections on {port}:\n{server.describe()}")
            time.sleep(0.05)  # polling a port: nothing to await


def _get(url: str) -> tuple[int, str, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to 127.0.0.1
    with opener.open(url, timeout=10) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read().decode()


def _accept_ranks(
    listener: socket.socket, held: list[socket.socket], agents: Sequence[Proc], procs: Sequence[Proc]
) -> None:
    """Accept one release connection per agent's rank into ``held``; fail at a deadline or as
    soon as an agent exits first (its pidfd becomes readable)."""
    deadline = time.monotonic() + 90
    exits = [os.pidfd_open(agent.proc.pid) for agent in agents]
    try:
        while len(held) < len(agents):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([listener, *exits], [], [], max(left, 0))
            if listener in ready:
                held.append(listener.accept()[0])
            elif ready or left <= 0:
                why = "an agent exited" if ready else "90 s passed"
                pytest.fail(f"{why} before every rank ran:\n" + "\n".join(p.describe() for p in procs))
    finally:
        for fd in exits:
            os.close(fd)


def test_two_node_job_on_the_installed_server(install: Install) -> None:
    port = _free_port()
    procs: list[Proc] = []
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)  # accept() only once select() says a connection waits
        release_port = listener.getsockname()[1]
        try:
            server = Proc(
                "rdzv-server",
                [install.bin("rdzv-server"), "--host", "127.0.0.1", "--port", str(port)],
                install,
            )
            procs.append(server)
            server.wait_for_line(rf"listening on 127\.0\.0\.1:{port}\b", timeout=60)
            _wait_for_port(port, server, timeout=30)

            endpoint = f"127.0.0.1:{port}"
            agent_argv = [
                install.bin("node-agent"),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                JOB,
                "train_held.py",
                str(release_port),
            ]
            agents = [Proc(f"node-agent {i}", agent_argv, install) for i in range(2)]
            procs.extend(agents)

            _accept_ranks(listener, held, agents, procs)
            for agent in agents:  # each agent runs one rank; which, the rendezvous decides
                agent.wait_for_line(r"^rank \d running$", timeout=30)
            every = "\n".join(a.describe() for a in agents)
            for rank in (0, 1):
                assert re.search(rf"^rank {rank} running$", every, re.M), f"no line of rank {rank}:\n{every}"

            status = install.run(install.bin("rdzv-server"), "status", "--endpoint", endpoint, "--job", JOB)
            context = shown(status) + "\n" + "\n".join(p.describe() for p in procs)
            assert status.returncode == 0, context
            assert f"job {JOB}: running" in status.stdout, context
            assert "nodes 2/2" in status.stdout, context

            code, kind, body = _get(f"http://{endpoint}/")
            assert code == 200 and kind.startswith("text/html"), f"dashboard: {code} {kind}\n{body[:500]}"
            assert "<html" in body.lower(), f"the dashboard is not HTML:\n{body[:500]}"
            code, kind, body = _get(f"http://{endpoint}/v1/jobs/{JOB}")
            assert code == 200 and kind.startswith("application/json"), f"job: {code} {kind}\n{body[:500]}"
            job = json.loads(body)
            assert job["id"] == JOB and job["phase"] == "running" and job["nodes"] == 2, body

            for conn in held:
                conn.sendall(b"release")
            for agent in agents:
                try:
                    rc = agent.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{agent.name} did not exit after the release:\n{agent.describe()}")
                assert rc == 0, "\n".join(p.describe() for p in procs)
                agent.wait_for_line(r"^rank \d released: b'release'$", timeout=10)

            server.proc.send_signal(signal.SIGTERM)
            try:
                rc = server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rdzv-server did not stop on SIGTERM:\n{server.describe()}")
            assert rc == 0, server.describe()
        finally:
            for conn in held:
                conn.close()  # a rank still waiting exits 3 at once
            for proc in reversed(procs):
                proc.stop()
