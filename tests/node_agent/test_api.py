"""node_agent.launch(): LaunchConfig -> the agent's config, and real standalone runs.

The callables below run in the workers, which import this module by name (so they live at its
top level); they only read the environment, so a worker starts in a few tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import threading
from pathlib import Path

import pytest

from node_agent import (
    ChildFailedError,
    LaunchConfig,
    LaunchError,
    ProcessFailure,
    RendezvousError,
    RendezvousTimeoutError,
    SignalException,
    launch,
    launch_async,
)
from node_agent.api import WORKER_MODULE, _launch_error, agent_argv, agent_config_for
from node_agent.config import ConfigError, Std
from node_agent.runner import AgentOutcome
from protocol import Failure


def rank_times_ten() -> int:
    return int(os.environ["RANK"]) * 10


def fail_on_rank_one() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("api boom")
    return "ok"


def describe(prefix: str, *, scale: int = 1) -> tuple[str, int, int]:
    return prefix, int(os.environ["RANK"]) * scale, int(os.environ["WORLD_SIZE"])


def describe_doubled(prefix: str) -> tuple[str, int, int]:
    return describe(prefix, scale=2)


def rank_and_omp() -> tuple[int, str | None]:
    return int(os.environ["RANK"]), os.environ.get("OMP_NUM_THREADS")


# --- real runs (standalone, this machine) ---------------------------------------------------


def test_a_callable_returns_each_ranks_value() -> None:
    assert launch(LaunchConfig(nproc_per_node=3), rank_times_ten) == {0: 0, 1: 10, 2: 20}


def test_arguments_reach_the_callable() -> None:
    assert launch(LaunchConfig(nproc_per_node=2), describe, "w") == {0: ("w", 0, 2), 1: ("w", 1, 2)}


def test_a_script_entrypoint_runs_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "from pathlib import Path\n"
        "Path(sys.argv[1], os.environ['RANK']).write_text(' '.join(sys.argv[2:]))\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    assert launch(LaunchConfig(nproc_per_node=2), str(script), out, "--epochs", 3) == {0: None, 1: None}
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "--epochs 3", "1": "--epochs 3"}


def test_an_argv_list_runs_as_a_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = "import os, sys; open(sys.argv[1] + os.environ['RANK'], 'w').close()"
    assert launch(LaunchConfig(nproc_per_node=2), [sys.executable, "-c", code, str(marker)]) == {
        0: None,
        1: None,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran0", "ran1"]


def test_a_failing_callable_raises_launch_error_naming_the_root_cause() -> None:
    with pytest.raises(LaunchError) as caught:
        launch(LaunchConfig(nproc_per_node=2), fail_on_rank_one)
    err = caught.value
    assert err.rank == 1
    assert err.exit_code != 0
    assert err.root_cause is not None and err.root_cause.exitcode == 1
    headline = str(err).splitlines()[0]
    assert "fail_on_rank_one failed: rank 1 (local rank 1" in headline
    assert "exit code 1: ValueError: api boom" in headline
    assert "Root Cause (first observed failure)" in str(err)  # torch's summary follows


def test_a_failing_script_names_rank_and_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    with pytest.raises(LaunchError, match=r"rank 0 \(local rank 0\) .*exit code 3") as caught:
        launch(LaunchConfig(nproc_per_node=2), str(script))
    assert caught.value.rank == 0


def test_a_launch_runs_in_another_thread_and_leaves_omp_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As torch's elastic_launch: no OMP_NUM_THREADS=1 for the workers (the command line's), no
    # signal handler off the main thread, and this thread's handlers untouched.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    box: dict[int, object] = {}
    thread = threading.Thread(target=lambda: box.update(launch(LaunchConfig(nproc_per_node=2), rank_and_omp)))
    thread.start()
    thread.join(timeout=100)
    assert box == {0: (0, None), 1: (1, None)}
    assert signal.getsignal(signal.SIGTERM) is before


async def test_launch_async_runs_in_a_running_loop() -> None:
    result = await launch_async(LaunchConfig(nproc_per_node=2), describe_doubled, "a")
    assert result == {0: ("a", 0, 2), 1: ("a", 2, 2)}


async def test_launch_refuses_a_running_loop() -> None:
    with pytest.raises(RuntimeError, match=r"running event loop.*launch_async"):
        launch(LaunchConfig(), rank_times_ten)
    await asyncio.sleep(0)


# --- how a launch ends: torch's exception for each ----------------------------------------------


def _failure(exitcode: int, message: str = "", signal_name: str = "") -> Failure:
    return Failure(
        node_id="n:1:ab", addr="127.0.0.1", rank=1, local_rank=1, exitcode=exitcode, timestamp=1.0,
        message=message, pid=12, signal=signal_name,
    )  # fmt: skip


ENDINGS = [
    # (outcome, the handled signal the agent got, the class raised)
    (AgentOutcome(1, "rank 1 failed", _failure(3), (_failure(3),)), None, ChildFailedError),
    (AgentOutcome(1, "received SIGTERM: workers stopped"), int(signal.SIGTERM), SignalException),
    (
        AgentOutcome(1, "timed out after 1 s waiting for the rendezvous (join_timeout)"),
        None,
        RendezvousTimeoutError,
    ),
    (AgentOutcome(1, "rendezvous server refused us: no"), None, RendezvousError),
    (AgentOutcome(1, "health check failed, not joining: sick"), None, LaunchError),
]


@pytest.mark.parametrize(("outcome", "signum", "kind"), ENDINGS, ids=lambda v: getattr(v, "__name__", ""))
def test_each_ending_raises_torchs_class_for_it_which_torchs_record_takes(
    outcome: AgentOutcome, signum: int | None, kind: type[LaunchError], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    torch_errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    from torch.distributed.elastic.multiprocessing.api import SignalException as TorchSignal
    from torch.distributed.elastic.rendezvous import api as torch_rdzv

    error = _launch_error("train.py", outcome, signum)
    assert isinstance(error, kind) and _ours_only(type(error)) is kind
    theirs = {
        ChildFailedError: torch_errors.ChildFailedError,
        SignalException: TorchSignal,
        RendezvousTimeoutError: torch_rdzv.RendezvousTimeoutError,
        RendezvousError: torch_rdzv.RendezvousError,
    }.get(kind)
    if theirs is not None:
        assert isinstance(error, theirs)
    # only a worker failure is a ChildFailedError, and it has failures (torch's @record reads them)
    assert isinstance(error, torch_errors.ChildFailedError) == (kind is ChildFailedError)
    if kind is ChildFailedError:
        assert error.get_first_failure()[0] == 1
    if kind is SignalException:
        assert error.sigval == signal.SIGTERM and str(error) == f"Process {os.getpid()} got signal: 15"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and copy.__dict__ == error.__dict__ and str(copy) == str(error)

    # torch's @record around a launch (tune run's): it records and re-raises, never ValueError
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @torch_errors.record
    def launcher() -> None:
        raise error

    with pytest.raises(kind):
        launcher()
    if kind is not ChildFailedError:  # a failure without an error file: torch's @record writes none
        assert type(error).__name__ in path.read_text()


def _ours_only(cls: type) -> type:
    """Our class of an error (itself, or the one torch's class was joined to)."""
    return next(c for c in cls.__mro__ if c in OURS)


OURS = (ChildFailedError, SignalException, RendezvousTimeoutError, RendezvousError, LaunchError)


def test_a_failure_without_error_file_or_stderr_has_torchs_message() -> None:
    assert ProcessFailure.from_failure(_failure(3)).message.startswith("To enable traceback see: https://")
    killed = ProcessFailure.from_failure(_failure(-9, signal_name="SIGKILL"))
    assert killed.message == "Signal 9 (SIGKILL) received by PID 12"
    assert ProcessFailure.from_failure(_failure(3, "Boom\n")).message == "Boom\n"  # the stderr tail


# --- errors before anything starts ------------------------------------------------------------


def test_a_bad_config_raises_the_command_lines_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--nproc-per-node='0': the number of workers must be >= 1"):
        launch(LaunchConfig(nproc_per_node=0), rank_times_ten)


def test_a_multi_node_job_needs_an_endpoint() -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        launch(LaunchConfig(min_nodes=2, max_nodes=2), rank_times_ten)


def test_a_missing_script_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        launch(LaunchConfig(), str(tmp_path / "nope.py"))


def test_a_callable_that_cannot_be_imported_is_refused_before_starting() -> None:
    with pytest.raises(TypeError, match="importable"):
        launch(LaunchConfig(), lambda: 1)

    def nested() -> None: ...

    with pytest.raises(TypeError, match="importable"):
        launch(LaunchConfig(), nested)


# --- LaunchConfig -> node-agent's command line ------------------------------------------------


def test_every_field_becomes_the_equivalent_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "7")  # the LaunchConfig decides, not PET_*
    script = tmp_path / "train.py"
    script.touch()
    config = LaunchConfig(
        2,
        4,
        3,
        run_id="job-1",
        role="trainer",
        rdzv_endpoint="head:1234",
        rdzv_configs={"last_call_timeout": 5, "is_host": False},
        rdzv_timeout=60,
        max_restarts=2,
        monitor_interval=0.5,
        log_dir=tmp_path / "logs",
        redirects={1: Std.ERR},
        tee=Std.ALL,
        local_ranks_filter={2, 0},
        local_addr="10.0.0.7",
        signals_to_handle=["SIGTERM", "SIGUSR1"],
        shutdown_timeout=5,
        log_line_prefix_template="[${rank}]",
    )
    cfg = agent_config_for(config, [str(script), "--lr", "0.1"])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (2, 4, 3)
    assert (cfg.standalone, cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == (
        False,
        "c10d",
        "head",
        1234,
        "job-1",
    )
    assert (cfg.rdzv_conf.join_timeout, cfg.rdzv_conf.last_call_timeout, cfg.rdzv_conf.is_host) == (
        60,
        5,
        False,
    )
    assert (cfg.role, cfg.max_restarts, cfg.monitor_interval) == ("trainer", 2, 0.5)
    assert cfg.log_dir == str(tmp_path / "logs")
    assert cfg.redirect_for(1) == Std.ERR and cfg.redirect_for(0) == Std.NONE
    assert cfg.tee_for(2) == Std.ALL
    assert cfg.local_ranks_filter == {0, 2}
    assert cfg.local_addr == "10.0.0.7"
    assert cfg.signals_to_handle == ("SIGTERM", "SIGUSR1")
    assert cfg.shutdown_timeout == 5
    assert cfg.log_line_prefix_template == "[${rank}]"
    assert (cfg.training_script, cfg.training_script_args) == (str(script), ("--lr", "0.1"))


def test_an_empty_endpoint_is_a_standalone_run() -> None:
    argv = agent_argv(LaunchConfig(nproc_per_node=2, run_id="ignored"), ["-m", "pkg.train"])
    assert "--standalone" in argv and not any(a.startswith("--rdzv-id") for a in argv)
    cfg = agent_config_for(LaunchConfig(nproc_per_node=2), ["--module", WORKER_MODULE, "p", "r"])
    assert cfg.standalone and cfg.module and cfg.training_script == WORKER_MODULE


def test_numa_options_as_torch_spells_them(tmp_path: Path) -> None:
    """torch's LaunchConfig(numa_options=NumaOptions(...)), its AffinityMode, or a plain mode."""
    from torch.numa.binding import AffinityMode, NumaOptions

    script = tmp_path / "x.py"
    script.write_text("")

    for given in (NumaOptions(affinity_mode=AffinityMode.EXCLUSIVE), AffinityMode.EXCLUSIVE, "exclusive"):
        cfg = agent_config_for(LaunchConfig(numa_options=given), [str(script)])
        assert cfg.numa_binding == "exclusive"
    assert agent_config_for(LaunchConfig(), [str(script)]).numa_binding is None
    with pytest.raises(ConfigError, match="--numa-binding='everywhere' is not valid"):
        agent_config_for(LaunchConfig(numa_options="everywhere"), [str(script)])


def test_a_comma_in_an_rdzv_config_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot carry a ','"):
        agent_argv(LaunchConfig(rdzv_configs={"join_timeout": "1,2"}), ["x.py"])


def test_the_api_is_exported_lazily() -> None:
    import subprocess

    code = "import sys, node_agent.cli; print('node_agent.api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the node-agent command does not pay for the API
