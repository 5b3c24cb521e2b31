"""What importing the snapshot modules costs, in a fresh interpreter: no torch, no asyncio, no
agent code; and ``node_agent.worker`` imports them only at the first use of a snapshot name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VARS = ("NODE_AGENT_PROGRESS_PAGE", "NODE_AGENT_SNAPSHOT_DIR", "NODE_AGENT_RESTORE_STEP")
# What node_agent.worker loads already (tests/node_agent/progress/test_worker_page.py), and errno.
ALLOWED = {
    "node_agent",
    "node_agent.worker",
    "node_agent.worker.layout",
    "node_agent.worker.snapshots",
    "__future__",
    "struct",
    "_struct",
    "mmap",
    "faulthandler",
    "errno",
}


def new_modules(code: str) -> set[str]:
    probe = f"import sys; before = set(sys.modules)\n{code}\nprint(sorted(set(sys.modules) - before))"
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return set(eval(out.stdout.splitlines()[-1]))


def test_importing_snapshots_loads_only_the_standard_library_it_needs() -> None:
    mods = new_modules("import node_agent.worker.snapshots")
    assert mods <= ALLOWED, sorted(mods - ALLOWED)


def test_using_a_snapshot_name_of_the_worker_module_loads_no_more() -> None:
    mods = new_modules("from node_agent import worker\nwith worker.snapshot(1) as f: f.write(b'x')")
    assert mods <= ALLOWED, sorted(mods - ALLOWED)


def test_the_worker_module_leaves_snapshots_until_used() -> None:
    assert "node_agent.worker.snapshots" not in new_modules(
        "from node_agent import worker; worker.progress(1)"
    )


def test_importing_snapshot_torch_does_not_import_torch() -> None:
    pytest.importorskip("torch")
    mods = new_modules("from node_agent.worker import snapshot_torch")
    assert not {m for m in mods if m.split(".")[0] in {"torch", "asyncio", "numpy"}}
    assert {m for m in mods if m.startswith(("node_agent", "protocol", "edge"))} <= ALLOWED | {
        "node_agent.worker.snapshot_torch"
    }
