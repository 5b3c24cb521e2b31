"""Warm interpreters (--preload): a worker made from one is a cold start's twin.

Each test runs the same worker twice through the real supervisor, cold and then warm (a
``WarmPool`` feeding the ``WorkerGroup``), and compares what the worker saw of its start
(tests/node_agent/workers/warm_probe.py), what it printed and how it ended.  The preloaded
module is ``json`` (cheap); tests/integration/test_preload.py does it with torch, with the same
probe.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from node_agent.config import AgentConfig, Std, StdSpec
from node_agent.supervisor.group import WorkerGroup
from node_agent.supervisor.spec import GroupResult
from node_agent.supervisor.warm import ROUND_VARS, WarmInterpreter, WarmPool, _python_flags, warm_env
from node_agent.worker_env import worker_argv, worker_specs
from protocol import Assignment

WORKERS = Path(__file__).parent.parent / "workers"
PROBE = WORKERS / "warm_probe.py"
MARK_VAR = "NODE_AGENT_WARM_TEST"
MARK = uuid.uuid4().hex


class Capture:
    """A console stand-in (no file descriptor: the worker's streams pass through the agent)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass


class Paths:
    def __init__(self, root: Path) -> None:
        self.root = root

    def error_file(self, local_rank: int) -> str:
        return str(self.root / f"error_{local_rank}.json")

    def stdout_path(self, local_rank: int) -> str:
        return str(self.root / f"stdout_{local_rank}.log")

    def stderr_path(self, local_rank: int) -> str:
        return str(self.root / f"stderr_{local_rank}.log")

    def filtered_stdout_path(self) -> str:
        return str(self.root / "filtered_stdout.log")

    def filtered_stderr_path(self) -> str:
        return str(self.root / "filtered_stderr.log")

    def place_dir(self, local_rank: int) -> str:
        return str(self.root / f"place_{local_rank}")

    def page_path(self, local_rank: int) -> str:
        return str(self.root / f"page_{local_rank}")

    def flight_recorder_stem(self, kind: str) -> str:
        return str(self.root / f"fr_{kind}_")


def assignment(restart_count: int = 0, *, offset: int = 0, world: int = 1, port: int = 29999) -> Assignment:
    return Assignment(
        job_id="warmtest",
        round=restart_count + 1,
        group_rank=0 if offset == 0 else 1,
        group_world_size=1 if offset == 0 else 2,
        rank_offset=offset,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        restart_count=restart_count,
        max_restarts=3,
    )


def config(*args: str, module: bool = False, preload: tuple[str, ...] = ("json",), **kw: Any) -> AgentConfig:
    script = "warm_probe" if module else str(PROBE)
    return AgentConfig(
        training_script=script,
        training_script_args=args,
        module=module,
        python_exec=sys.executable,
        preload=preload,
        rdzv_id="warmtest",
        **kw,
    )


class Run:
    def __init__(
        self, result: GroupResult, out: bytes, err: bytes, state: dict[str, Any] | None, log: list[str]
    ):
        self.result = result
        self.out = out
        self.err = err
        self.state = state
        self.log = log
        self.exit = result.exits[0]


async def run_once(cfg: AgentConfig, tmp: Path, *, warm: bool, environ: dict[str, str] | None = None) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    probe_out = tmp / "state-0-0.json"  # rank 0, restart 0
    env = dict(environ if environ is not None else os.environ)
    env.update({"DUMP_DIR": str(tmp), MARK_VAR: MARK})
    log: list[str] = []
    pool = WarmPool(cfg, env, log.append) if warm else None
    out, err = Capture(), Capture()
    group = WorkerGroup(stdout=out, stderr=err, log=log.append, warm=pool)  # type: ignore[arg-type]
    try:
        if pool is not None:
            pool.start()
        await group.start(worker_specs(cfg, assignment(), env, Paths(tmp)))
        result = await asyncio.wait_for(group.wait(), 30)
    finally:
        await group.stop(grace=0.0)
        if pool is not None:
            await pool.close()
    state = json.loads(probe_out.read_text()) if probe_out.exists() else None
    if probe_out.exists():
        probe_out.unlink()
    return Run(result, bytes(out.data), bytes(err.data), state, log)


async def both(cfg: AgentConfig, tmp: Path, **kw: Any) -> tuple[Run, Run]:
    cold = await run_once(cfg, tmp, warm=False, **kw)
    warm = await run_once(cfg, tmp, warm=True, **kw)
    assert any("1 warm" in line for line in warm.log), warm.log
    return cold, warm


# --- the environment a warm interpreter starts with -------------------------------------------


def test_only_round_variables_are_held_back(tmp_path: Path) -> None:
    """Every worker variable that differs between two rounds is one the warm interpreter only
    gets at the handoff; everything else it had while importing."""
    cfg = config(nproc_per_node=2)
    a = worker_specs(cfg, assignment(0, world=2), os.environ, Paths(tmp_path / "a"))
    b = worker_specs(cfg, assignment(2, offset=2, world=4, port=31000), os.environ, Paths(tmp_path / "b"))
    for sa, sb in zip(a, b, strict=True):
        differing = {k for k in set(sa.env) | set(sb.env) if sa.env.get(k) != sb.env.get(k)}
        assert differing <= ROUND_VARS, differing - ROUND_VARS
        held = {k: v for k, v in sa.env.items() if k not in ROUND_VARS}
        assert held == warm_env(cfg, os.environ, sa.local_rank)


def test_an_interpreter_bound_otherwise_is_not_taken() -> None:
    """Its --numa-binding is its start's (its imports saw those CPUs): another binding, or none
    where it has one, sends the worker cold."""
    argv, env = worker_argv(config(), 0), dict(os.environ)
    interp = WarmInterpreter(0, argv, env)
    assert interp.mismatch(argv, env) is None
    assert interp.mismatch(argv, env, frozenset({0})) == "its CPU binding differs"
    interp.cpus = frozenset({0})
    assert interp.mismatch(argv, env, frozenset({0})) is None
    assert interp.mismatch(argv, env) == "its CPU binding differs"


# --- one interpreter, alone ----------------------------------------------------------------------


async def test_a_failed_preload_says_why(tmp_path: Path) -> None:
    argv = worker_argv(config(), 0)
    interp = WarmInterpreter(0, argv, dict(os.environ))
    await interp.spawn(_python_flags(argv), ["no_such_module_xyz"], None)
    with pytest.raises(Exception, match="No module named 'no_such_module_xyz'"):
        await asyncio.wait_for(interp.ready(), 30)
    interp.kill()


async def test_a_failed_preload_starts_the_worker_cold_and_says_so_once(tmp_path: Path) -> None:
    run = await run_once(config(preload=("no_such_module_xyz",)), tmp_path, warm=True)
    assert run.exit.exitcode == 0
    said = [line for line in run.log if "--preload" in line]
    assert len(said) == 1 and "No module named 'no_such_module_xyz'" in said[0], run.log
    assert not any("warm" in line for line in run.log if line.startswith("started"))


# --- cold and warm: the same worker ----------------------------------------------------------


async def test_script_worker_sees_what_a_cold_one_sees(tmp_path: Path) -> None:
    cold, warm = await both(config("ok"), tmp_path)
    assert cold.state is not None and warm.state is not None
    assert warm.state == cold.state
    assert warm.state["file"] == str(PROBE) and warm.state["spec"] is None
    assert warm.exit.exitcode == cold.exit.exitcode == 0
    assert warm.out == cold.out and warm.err == cold.err


async def test_module_worker_sees_what_a_cold_one_sees(tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(WORKERS)  # -m finds the module in the working directory, as python does
    try:
        cold, warm = await both(config("ok", module=True), tmp_path)
    finally:
        os.chdir(cwd)
    assert cold.state is not None and warm.state is not None
    assert warm.state == cold.state
    assert warm.state["spec"] == ["warm_probe", str(PROBE)]
    assert warm.state["path0"] == str(WORKERS)


@pytest.mark.parametrize(
    ("how", "code"),
    [("exit3", 3), ("exitmsg", 1), ("raise", 1), ("kbint", -signal.SIGINT), ("sigterm", -signal.SIGTERM)],
)
async def test_ends_as_a_cold_worker_ends(tmp_path: Path, how: str, code: int) -> None:
    """Exit codes, SystemExit messages, tracebacks (no frame of the boot), death by signal."""
    cold, warm = await both(config(how), tmp_path)
    assert cold.exit.exitcode == warm.exit.exitcode == code
    assert warm.err == cold.err
    assert warm.exit.error_message == cold.exit.error_message
    assert b"warm_boot" not in warm.err


async def test_files_and_prefixes_are_a_cold_workers(tmp_path: Path) -> None:
    """--redirects and --tee: the same log files and prefixed console lines."""
    cfg = config("ok", redirects=StdSpec(default=Std.ERR), tee=StdSpec(default=Std.OUT))
    cold = await run_once(cfg, tmp_path / "cold", warm=False)
    warm = await run_once(cfg, tmp_path / "warm", warm=True)
    assert any("1 warm" in line for line in warm.log)
    for name in ("stdout_0.log", "stderr_0.log"):
        assert (tmp_path / "warm" / name).read_bytes() == (tmp_path / "cold" / name).read_bytes()
    assert warm.out == cold.out and warm.out.startswith(b"[default0]:probe ok")
    assert warm.err == cold.err == b""


async def test_preload_output_comes_first_where_the_worker_writes(tmp_path: Path) -> None:
    """An import's output (a warning) goes where a cold worker's would: before its own lines."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "noisy_mod.py").write_text(
        "import sys\nprint('noisy imported')\nprint('noisy warns', file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(mods)}
    run = await run_once(config("ok", preload=("noisy_mod",)), tmp_path, warm=True, environ=env)
    assert any("1 warm" in line for line in run.log)
    assert run.out.startswith(b"noisy imported\nprobe ok")
    assert run.err.startswith(b"noisy warns\nprobe stderr line")


async def test_a_replacement_warms_once_a_worker_ends(tmp_path: Path) -> None:
    """Two attempts in a row on one group: both warm, different pids."""
    env = {**os.environ, MARK_VAR: MARK, "DUMP_DIR": str(tmp_path)}
    cfg = config("ok")
    log: list[str] = []
    pool = WarmPool(cfg, env, log.append, refill_delay=60.0)
    group = WorkerGroup(stdout=Capture(), stderr=Capture(), log=log.append, warm=pool)  # type: ignore[arg-type]
    pool.start()
    pids = []
    try:
        for attempt in range(2):
            await group.start(worker_specs(cfg, assignment(attempt), env, Paths(tmp_path / str(attempt))))
            pids.append(group.pids[0])
            result = await asyncio.wait_for(group.wait(), 30)
            assert result.state == "succeeded"
    finally:
        await group.stop(grace=0.0)
        await pool.close()
    started = [line for line in log if line.startswith("started")]
    assert len(started) == 2 and all("1 warm" in line for line in started), log
    assert pids[0] != pids[1]


# --- the flag ------------------------------------------------------------------------------------


def test_preload_flag_and_variable() -> None:
    from node_agent.cli.parse import parse_config
    from node_agent.config import ConfigError
    from node_agent.supervisor.warm import warm_pool

    cfg = parse_config(["--preload", "torch, torch.nn,torch", str(PROBE)], {})
    assert cfg.preload == ("torch", "torch.nn")
    assert parse_config([str(PROBE)], {"PET_PRELOAD": "numpy"}).preload == ("numpy",)
    assert parse_config([str(PROBE)], {}).preload == ()
    with pytest.raises(ConfigError, match="PET_PRELOAD='torch,2x': '2x' is not a module name"):
        parse_config([str(PROBE)], {"PET_PRELOAD": "torch,2x"})
    said: list[str] = []
    assert (
        warm_pool(parse_config(["--no-python", "--preload", "torch", "true"], os.environ), {}, said.append)
        is None
    )
    assert len(said) == 1 and "--no-python" in said[0]
