"""Real wrappers, each run as it ships (on torch's torchrun) and routed to node-agent as the
README's wrapper table says, and compared (issue 46): ``accelerate launch``, ``tune run`` with a
tiny recipe of ours, TorchX's ``dist.ddp`` on ``local_cwd``, Lightning's ``fabric run``, torch's
``python -m torch.distributed.run`` and torch's documented ``elastic_launch`` examples.

What a wrapper or a scheduler acts on is compared: exit codes (``accelerate launch`` exits
128+signal on torch's ``SignalException``), what the workers saw (one gloo all-reduce), the
exception a wrapper's ``@record`` handles, and the launcher's ``TORCHELASTIC_ERROR_FILE``
(``torchx run`` shows it as the job's ``structured_error_msg``). The two ways of each case run
at once, so a case costs about one run; every run is one tiny script
(``workers/wrapped_train.py``; ``workers/elastic_examples.py`` for ``elastic_launch``), whose
failing and signalled modes import nothing heavy. The versions are pyproject's test extras.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node_agent.shim import write_shim

from .procs import WORKERS, free_port, kill_session

pytest.importorskip("torch")

BIN = Path(sys.executable).parent  # the venv's console scripts: torchrun and the wrappers
SCRIPT = WORKERS / "wrapped_train.py"
ROUTED = (sys.executable, "-m", "node_agent.inprocess")  # the README's route for in-process wrappers
WAYS = ("torchrun", "routed")
RUN_S = 150.0  # one wrapper run, worst case on a loaded 2-core machine (tune alone imports ~5 s of CPU)

pytestmark = pytest.mark.timeout(2 * RUN_S)


def tool(name: str, module: str) -> str:
    pytest.importorskip(module)
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed beside this Python")
    return str(path)


@dataclass
class Run:
    """One wrapper process in a session of its own, its console in a file."""

    p: subprocess.Popen[bytes]
    log: Path
    ready: Path

    def wait(self, timeout: float = RUN_S) -> int:
        return self.p.wait(timeout=timeout)

    @property
    def out(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, n: int = 2, timeout: float = RUN_S) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.ready.iterdir())) < n:
            assert self.p.poll() is None, self.out
            assert time.monotonic() < deadline, f"workers not ready:\n{self.out}"
            time.sleep(0.1)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def _start(
        way: str, argv: Sequence[str], *, cwd: Path | None = None, path: str = "", unset: str = "", **env: str
    ) -> Run:
        folder = tmp_path / way
        (folder / "ready").mkdir(parents=True, exist_ok=True)
        full = {**os.environ, "PYTHONUNBUFFERED": "1", "READY_DIR": str(folder / "ready"), **env}
        if unset:
            full.pop(unset, None)
        full["PATH"] = os.pathsep.join(p for p in (path, str(BIN), os.environ.get("PATH", "")) if p)
        log = folder / "console.txt"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                list(argv), cwd=cwd or folder, env=full, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        run = Run(p, log, folder / "ready")
        runs.append(run)
        return run

    try:
        yield _start
    finally:
        for run in runs:
            kill_session(run.p)


def both(start: Any, argv: Any, **kw: Any) -> dict[str, Run]:
    """Both ways at once; ``argv(way)`` is each one's command line."""
    return {way: start(way, argv(way), **kw) for way in WAYS}


def codes(runs: dict[str, Run]) -> dict[str, int]:
    return {way: run.wait() for way, run in runs.items()}


def results(run: Run) -> list[dict[str, Any]]:
    found = [json.loads(m) for m in re.findall(r"result (\{[^}]*\})", run.out)]
    return sorted(found, key=lambda r: r["rank"])


def check_trained(runs: dict[str, Run], *, gloo: bool = True) -> None:
    """Both succeeded, their workers saw the same, and (``gloo``) trained: the all-reduce's sum."""
    assert codes(runs) == dict.fromkeys(WAYS, 0), {w: r.out[-3000:] for w, r in runs.items()}
    seen = {way: results(run) for way, run in runs.items()}
    assert seen["routed"] == seen["torchrun"], seen
    assert [(r["rank"], r["world_size"], r.get("sum")) for r in seen["routed"]] == [
        (0, 2, 3.0 if gloo else None),
        (1, 2, 3.0 if gloo else None),
    ]


def signal_both(runs: dict[str, Run], sig: int, *, group: bool = False) -> dict[str, int]:
    """Once every worker of both runs is up: ``sig`` to each launcher (to its whole process
    group with ``group``, as a terminal's Ctrl-C), then their exit codes."""
    for run in runs.values():
        run.wait_ready()
    for run in runs.values():
        if group:
            os.killpg(run.p.pid, sig)
        else:
            run.p.send_signal(sig)
    return codes(runs)


# --- accelerate launch (in-process: torch.distributed.run.run) ------------------------------


def accelerate(way: str, mode: str) -> list[str]:
    line = [tool("accelerate", "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
    line += ["--main_process_port", str(free_port()), str(SCRIPT), mode]
    return [*ROUTED, *line] if way == "routed" else line


def test_accelerate_launch_trains_alike(start: Any) -> None:
    check_trained(both(start, lambda way: accelerate(way, "ok")))


def test_accelerate_launch_a_failing_rank_alike(start: Any) -> None:
    runs = both(start, lambda way: accelerate(way, "fail"))
    assert codes(runs) == dict.fromkeys(WAYS, 1)
    for run in runs.values():  # the traceback of torch's ChildFailedError, rank 1's exit code
        assert re.search(r"ChildFailedError: ", run.out), run.out[-3000:]
        assert re.search(r"rank +: 1 \(local_rank: 1\)\n +exitcode +: 3 \(pid", run.out), run.out[-3000:]


@pytest.mark.parametrize(
    ("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "Ctrl-C"]
)
def test_accelerate_launch_stopped_by_a_signal_exits_128_plus_it(start: Any, sig: int, group: bool) -> None:
    # A scheduler's SIGTERM to the launcher; Ctrl-C: SIGINT to the terminal's whole process group.
    runs = both(start, lambda way: accelerate(way, "hang"))
    assert signal_both(runs, sig, group=group) == dict.fromkeys(WAYS, 128 + sig), runs["routed"].out[-3000:]
    for run in runs.values():  # accelerate took the exception: no traceback of the launcher's
        assert not re.search(r"ChildFailedError|SignalException|no worker failed", run.out), run.out[-3000:]


# --- tune run (in-process, under tune's own @record) ---------------------------------------


def tune(way: str, mode: str) -> list[str]:
    line = [
        tool("tune", "torchtune"),
        "run",
        "--nproc_per_node",
        "2",
        "recipe",
        "--config",
        "config.yaml",
        mode,
    ]
    return [*ROUTED, *line] if way == "routed" else line


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A tiny recipe of our own, as ``tune cp`` leaves one: a module in the working folder and
    its config (``tune run`` runs a custom recipe as ``python -m recipe``)."""
    folder = tmp_path / "recipe"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "recipe.py")
    (folder / "config.yaml").write_text("lr: 0.1\n")
    return folder


def test_tune_run_starts_the_recipe_alike(start: Any, recipe: Path) -> None:
    # Standalone, as TorchX's dist.ddp below (which trains over it): the workers' view compared.
    check_trained(both(start, lambda way: tune(way, "env"), cwd=recipe), gloo=False)


def test_tune_run_a_failing_rank_alike(start: Any, recipe: Path) -> None:
    runs = both(start, lambda way: tune(way, "fail"), cwd=recipe)
    assert codes(runs) == dict.fromkeys(WAYS, 1)
    for run in runs.values():
        # tune's @record took the ChildFailedError (with its failures) as torch's own
        assert "no worker failed" not in run.out, run.out[-3000:]
        assert re.search(r"ChildFailedError: ", run.out), run.out[-3000:]
        assert re.search(r"exitcode +: 3 \(pid", run.out), run.out[-3000:]


def test_tune_run_stopped_by_sigterm_alike(start: Any, recipe: Path, tmp_path: Path) -> None:
    files = {way: tmp_path / f"{way}-error.json" for way in WAYS}
    runs = {
        way: start(way, tune(way, "hang"), cwd=recipe, TORCHELASTIC_ERROR_FILE=str(files[way]))
        for way in WAYS
    }
    assert signal_both(runs, signal.SIGTERM) == dict.fromkeys(WAYS, 1)
    for way, run in runs.items():
        # tune's @record records torch's SignalException and re-raises it: the user's last line
        last = run.out.rstrip().splitlines()[-1]
        assert re.fullmatch(r"[\w.]*SignalException: Process \d+ got signal: 15", last), (
            way,
            run.out[-3000:],
        )
        message = json.loads(files[way].read_text())["message"]["message"]
        assert re.fullmatch(r"SignalException: Process \d+ got signal: 15", message), (way, message)


# --- python -m torch.distributed.run: main under @record ------------------------------------


def test_main_writes_the_launchers_error_file_on_a_signal_alike(start: Any, tmp_path: Path) -> None:
    files = {way: tmp_path / f"{way}-error.json" for way in WAYS}
    module = {"torchrun": "torch.distributed.run", "routed": "node_agent.run"}
    runs = {
        way: start(
            way,
            [sys.executable, "-m", module[way], "--nproc-per-node", "2", str(SCRIPT), "hang"],
            TORCHELASTIC_ERROR_FILE=str(files[way]),
        )
        for way in WAYS
    }
    assert signal_both(runs, signal.SIGTERM) == dict.fromkeys(WAYS, 1)
    for way in WAYS:
        message = json.loads(files[way].read_text())["message"]["message"]
        assert re.fullmatch(r"SignalException: Process \d+ got signal: 15", message), (way, message)


# --- TorchX dist.ddp on local_cwd (starts the torchrun command) -------------------------------


def torchx_ddp(mode: str) -> list[str]:
    return [
        tool("torchx", "torchx"),
        "run",
        "-s",
        "local_cwd",
        "dist.ddp",
        "-j",
        "1x2",
        "--script",
        str(SCRIPT),
        "--",
        mode,
    ]


@pytest.fixture
def shim(tmp_path: Path) -> str:
    """The README's route for TorchX: ``python -m node_agent.shim DIR``, DIR first on PATH."""
    folder = tmp_path / "shim"
    done = subprocess.run(
        [sys.executable, "-m", "node_agent.shim", str(folder)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (folder / "torchrun").exists()
    return str(folder)


def test_torchx_dist_ddp_trains_alike(start: Any, shim: str) -> None:
    runs = {way: start(way, torchx_ddp("ok"), path=shim if way == "routed" else "") for way in WAYS}
    check_trained(runs)
    assert "[node-agent]" not in runs["torchrun"].out


def structured_error(out: str) -> str:
    """The root cause ``torchx run`` shows for a failed app (its AppStatus, as ``torchx
    status`` prints it): the ``structured_error_msg`` block."""
    assert "Job finished: FAILED" in out, out[-3000:]
    return out.split("structured_error_msg:", 1)[1].split("ui_url:", 1)[0]


def test_torchx_status_shows_the_root_cause_alike(start: Any, shim: str) -> None:
    runs = {way: start(way, torchx_ddp("raise"), path=shim if way == "routed" else "") for way in WAYS}
    assert codes(runs) == dict.fromkeys(WAYS, 1)
    for way, run in runs.items():
        error = structured_error(run.out)
        assert "message: 'ValueError: rank one is broken'" in error, (way, error)
        assert "errorCode: 1" in error and 'raise ValueError(\\"rank' in error, (way, error)
    assert "[node-agent]" in runs["routed"].out  # it was ours that ran


def test_the_shim_never_replaces_another_torchrun(tmp_path: Path) -> None:
    theirs = tmp_path / "torchrun"
    theirs.write_text("#!/bin/sh\n")
    with pytest.raises(FileExistsError, match="not node-agent's shim"):
        write_shim(str(tmp_path))
    assert theirs.read_text() == "#!/bin/sh\n"
    ours = write_shim(str(tmp_path / "new"))
    assert write_shim(str(tmp_path / "new")) == ours  # its own: rewritten
    assert os.access(ours, os.X_OK)


# --- fabric run (in-process: torch.distributed.run.main) ------------------------------------


def test_fabric_run_starts_the_script_alike(start: Any) -> None:
    # torchrun's static master port, as accelerate above (which trains over it): compared.
    def line(way: str) -> list[str]:
        fabric = [tool("fabric", "lightning"), "run", "--accelerator", "cpu", "--devices", "2"]
        fabric += ["--main-port", str(free_port()), str(SCRIPT), "env"]
        return [*ROUTED, *fabric] if way == "routed" else fabric

    check_trained(both(start, line), gloo=False)


# --- torch's documented elastic_launch examples -----------------------------------------------


def test_torchs_elastic_launch_examples_alike(start: Any, tmp_path: Path) -> None:
    out = {way: tmp_path / f"{way}.json" for way in WAYS}
    lib = {"torchrun": "torch", "routed": "ours"}
    runs = {}
    for way in WAYS:
        argv = [
            sys.executable,
            str(WORKERS / "elastic_examples.py"),
            lib[way],
            str(out[way]),
            str(free_port()),
        ]
        runs[way] = start(way, argv, unset="OMP_NUM_THREADS")
    assert codes(runs) == dict.fromkeys(WAYS, 0), {w: r.out[-3000:] for w, r in runs.items()}
    seen = {way: json.loads(out[way].read_text()) for way in WAYS}
    for what in seen.values():
        del what["signal"]["text"]  # names the launcher's pid
        # Rank 0 exits 0 at once, but on a loaded machine it may still run when rank 1 fails:
        # then both launchers stop it and count it too (torch's did in a CI run). The failed
        # rank is in both; which others are is the machine's timing, not the launcher's.
        assert 1 in what["child"].pop("ranks"), what
    assert seen["routed"] == seen["torchrun"]
    ours = seen["routed"]
    # From a thread, results as torch's, OMP_NUM_THREADS left alone, no handler touched
    assert ours["thread"] == {"0": ["t", 0, None], "1": ["t", 1, None]} and ours["handler_kept"]
    assert ours["child"]["message"].startswith("To enable traceback see: ")
    assert ours["rendezvous"] == {"rendezvous_error": True, "type": "RendezvousTimeoutError"}
    assert ours["signal"] == {"sigval": 15, "is_child_failed": False}
    assert "Setting OMP_NUM_THREADS" not in runs["routed"].out
