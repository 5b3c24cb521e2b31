"""One harness for "replace the word torchrun by node-agent and nothing else changes".

A :class:`Line` is a launch line as people type it (the launcher word left out) with the
environment it runs in; :func:`run_line` runs it under one launcher, every node as its own
process on 127.0.0.1, and returns what a user sees: exit codes, each worker's argv and
environment (dumped by the worker), the console and the log directory. :func:`compare` checks
ours against torchrun's, minus the values that must differ (``DIFFERENT_BY_DESIGN``, each with
its reason; the README lists the same).

torchrun runs as ``python -m torch.distributed.run`` and ours as ``python -m node_agent``, the
spelling recipes use to pin the interpreter.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .procs import WORKERS, Proc, free_port

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "ours": [sys.executable, "-m", "node_agent"],
}

# Only ours, and why (README "Progress, hangs and stragglers" and "In-memory snapshots"): every
# rank's progress page (in the agent's private folder, never in --log-dir) and its environment
# variable, torch's flight-recorder dump variables (dumps into the attempt's log folder, only
# after a hang), and the rank's snapshot folder and size limit (with our rendezvous server;
# NODE_AGENT_RESTORE_STEP too, when a restart restores a snapshot), and the rank's place folder
# (README "Restarts in place").
ADDED_KEYS = {
    "NODE_AGENT_PROGRESS_PAGE",
    "NODE_AGENT_SNAPSHOT_DIR",
    "NODE_AGENT_SNAPSHOT_LIMIT",
    "NODE_AGENT_PLACE_DIR",  # where worker.run learns its next place (restarts in place)
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_FR_DEBUG_INFO_PIPE_FILE",
}

# Worker environment values that differ between two runs or two launchers, and why.
DIFFERENT_BY_DESIGN = {
    "MASTER_PORT": "a free port chosen per run (where the line gives one, both use it: checked apart)",
    "TORCHELASTIC_RUN_ID": "a fresh uuid per --standalone run",
    "TORCHELASTIC_ERROR_FILE": "each launcher's own log directory",
    "TORCHELASTIC_USE_AGENT_STORE": (
        "True where our agent hosts the store, as torchrun's; False (worker rank 0 hosts it) under "
        "the static backend, --no-python, or without a usable torch in the workers' Python"
    ),
    "MASTER_ADDR": "127.0.0.1 for a standalone run, torchrun's 'localhost' (may resolve to ::1 first)",
    "_pid": "the worker's own pid",
    "DUMP_DIR": "this test's output folder, one per launcher",
    "TORCHELASTIC_HEALTH_CHECK_PORT": "the test's free port, one per launcher run",
    "PET_MASTER_PORT": "the test's free port, one per launcher run",
}

# What torch itself prints while torchrun imports it; not torchrun's launch behaviour.
_TORCH_IMPORT_NOISE = re.compile(r"Failed to initialize NumPy|_conversion_method_template")


@dataclass(frozen=True)
class Line:
    """A launch line: ``args`` and ``env`` may use {script}, {python}, {port}, {node_rank},
    {log_dir}, {port2} (a second free port)."""

    id: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    nodes: int = 1
    script: str = "dump_env.py"
    worker_env: Mapping[str, str] = field(default_factory=dict)  # e.g. FAIL_RANK for dump_env.py
    expect_exit: int = 0
    # What a user can compare across launchers for this line.
    same_group_ranks: bool = True  # GROUP_RANK of each node (static: from --node-rank)
    master_port_given: bool = False  # both launchers' workers get exactly {port}
    log_files: bool = False  # the same files under --log-dir
    console: bool = True  # the workers' console lines (not the launchers' own)


@dataclass
class Outcome:
    codes: list[int]
    dumps: list[dict[str, str]]  # one per worker, by RANK
    stdout: list[str]  # one per node
    stderr: list[str]
    log_files: set[str]  # under {log_dir}, files and folders, the run folder's name replaced by RUN
    port: int
    filtered: dict[str, Counter[str]] = field(default_factory=dict)  # filtered_*.log: their lines


def run_line(launcher: str, line: Line, tmp: Path, timeout: float = 90.0) -> Outcome:
    out = tmp / launcher
    dumps, log_dir = out / "dumps", out / "logs"
    dumps.mkdir(parents=True)
    port, port2 = free_port(), free_port()
    script = str(WORKERS / line.script)
    procs = []
    try:
        for node in range(line.nodes):
            values = {
                "script": script,
                "python": sys.executable,
                "port": port,
                "port2": port2,
                "node_rank": node,
                "log_dir": log_dir,
            }
            args = [a.format(**values) for a in line.args]
            env = {k: v.format(**values) for k, v in line.env.items()}
            env.update(line.worker_env)
            env.update({"DUMP_DIR": str(dumps), "NODE_TAG": str(node), "PARITY_MARK": "inherited"})
            procs.append(Proc([*LAUNCHERS[launcher], *args], env=env))
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    files, filtered = set(), {}
    if log_dir.exists():
        for path in log_dir.rglob("*"):  # every file and folder: torchrun's tree, byte for byte
            parts = path.relative_to(log_dir).parts
            name = "/".join(("RUN", *parts[1:]))
            files.add(name + ("/" if path.is_dir() else ""))
            if path.is_file() and path.name.startswith("filtered_"):
                filtered[name] = Counter(path.read_text(errors="replace").splitlines())
    found = [json.loads(p.read_text()) for p in sorted(dumps.glob("*.json"))]  # env-R / node-R.json
    ranked = sorted(found, key=lambda d: int(d.get("RANK", "-1")))
    return Outcome(codes, ranked, [p.stdout for p in procs], [p.stderr for p in procs], files, port, filtered)


_WORKER_TEXT = re.compile(r"(\[\w+\]:)?(worker rank \d+ of \d+ done|rank \d+ failing on purpose)")


def worker_lines(text: str) -> Counter[str]:
    """What the workers printed (dump_env.py), tee prefix included. Found anywhere in a line:
    ranks sharing the launcher's stdout write their text and its newline separately, so two
    ranks' lines can run together, under torchrun as under a direct file descriptor."""
    ours = ("[node-agent]", '{"name": "torchelastic.')  # our lines; torchrun's JSON events
    workers = "\n".join(line for line in text.splitlines() if not line.startswith(ours))
    return Counter(m.group(0) for m in _WORKER_TEXT.finditer(workers))


def launcher_lines(outcome: Outcome) -> list[str]:
    """What the launcher itself printed on stderr: every line but the workers' and torch's
    import noise."""
    lines = []
    for text in outcome.stderr:
        for line in text.splitlines():
            if line.strip() and not worker_lines(line) and not _TORCH_IMPORT_NOISE.search(line):
                lines.append(line)
    return lines


def compare(theirs: Outcome, ours: Outcome, line: Line) -> None:
    """Assert that a user sees the same from both launchers, but for DIFFERENT_BY_DESIGN."""
    where = f"torchrun:\n{theirs.stderr}\nours:\n{ours.stderr}"
    assert theirs.codes == ours.codes == [line.expect_exit] * line.nodes, where
    assert len(theirs.dumps) == len(ours.dumps), where
    for t, o in zip(theirs.dumps, ours.dumps, strict=True):
        assert t["RANK"] == o["RANK"]
        ours_keys = set(o) - ADDED_KEYS
        assert ours_keys == set(t), (
            f"keys only ours: {ours_keys - set(t)}, only torchrun's: {set(t) - ours_keys}"
        )
        differ = {k for k in t if t[k] != o[k]} - set(DIFFERENT_BY_DESIGN)
        assert not differ, {k: (t[k], o[k]) for k in differ}
        assert json.loads(o.get("_argv", "[]")) == json.loads(t.get("_argv", "[]"))
        assert o["PARITY_MARK"] == "inherited"
    if line.same_group_ranks:
        assert _group_ranks(ours) == _group_ranks(theirs)
    if line.master_port_given:
        assert {d["MASTER_PORT"] for d in theirs.dumps} == {str(theirs.port)}
        assert {d["MASTER_PORT"] for d in ours.dumps} == {str(ours.port)}
    if line.log_files:
        assert ours.log_files == theirs.log_files
        assert ours.filtered == theirs.filtered
        assert all(ours.filtered.values()) or not ours.filtered, ours.filtered  # not vacuous
    if line.console:
        for name, t_text, o_text in (
            ("stdout", theirs.stdout, ours.stdout),
            ("stderr", theirs.stderr, ours.stderr),
        ):
            t_lines, o_lines = worker_lines("\n".join(t_text)), worker_lines("\n".join(o_text))
            assert o_lines == t_lines, (
                f"{name}: only ours {o_lines - t_lines}, only torchrun's {t_lines - o_lines}\n"
                f"torchrun's {name}: {t_text}\nours: {o_text}"
            )


def _group_ranks(outcome: Outcome) -> dict[str, str]:
    return {d["NODE_TAG"]: d["GROUP_RANK"] for d in outcome.dumps}


def run_both(line: Line, tmp: Path) -> tuple[Outcome, Outcome]:
    theirs = run_line("torchrun", line, tmp)
    ours = run_line("ours", line, tmp)
    return theirs, ours
