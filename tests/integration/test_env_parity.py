"""The environment a worker sees under node-agent equals torchrun's, key by key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .dropin import ADDED_KEYS
from .procs import WORKERS, Proc, agent_cmd, read_env_dumps

# Values that must differ between two runs or two launchers, and why.
DIFFERENT_BY_DESIGN = {
    "MASTER_PORT": "a free port chosen per run",
    "TORCHELASTIC_RUN_ID": "a fresh uuid per --standalone run",
    "TORCHELASTIC_ERROR_FILE": "each launcher's own log directory",
    "MASTER_ADDR": "127.0.0.1 here, torchrun's 'localhost' (which may resolve to ::1 first)",
    "TORCHELASTIC_USE_AGENT_STORE": "False where the node has no core to spare for our store process",
    "_pid": "the worker's own pid",
    "DUMP_DIR": "this test's output folder, one per launcher",
}


ADDED_BY_DESIGN = ADDED_KEYS  # keys only ours has: dropin.py says why


def launch(argv: list[str], out: Path) -> list[dict[str, str]]:
    out.mkdir()
    env = {"DUMP_DIR": str(out), "PARITY_MARK": "inherited"}
    p = Proc(argv, env=env)
    try:
        assert p.wait(timeout=90) == 0, p.stderr
    finally:
        p.kill()
    return read_env_dumps(out)


def test_worker_env_matches_torchrun(tmp_path: Path) -> None:
    script = str(WORKERS / "dump_env.py")
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    theirs = launch([sys.executable, "-m", "torch.distributed.run", *flags, script], tmp_path / "torchrun")
    ours = launch(agent_cmd(*flags, script), tmp_path / "ours")
    assert len(theirs) == len(ours) == 2
    for t, o in zip(theirs, ours, strict=True):
        assert t["RANK"] == o["RANK"]
        assert set(o) - ADDED_BY_DESIGN == set(t), (
            f"keys only ours: {set(o) - set(t) - ADDED_BY_DESIGN}, only torchrun's: {set(t) - set(o)}"
        )
        assert ADDED_BY_DESIGN <= set(o)
        assert o["NODE_AGENT_PROGRESS_PAGE"].endswith(f"/{o['LOCAL_RANK']}/progress.page")
        differ = {k for k in t if t[k] != o[k]}
        assert differ <= set(DIFFERENT_BY_DESIGN), {
            k: (t[k], o[k]) for k in differ - set(DIFFERENT_BY_DESIGN)
        }
        assert o["PARITY_MARK"] == "inherited"
        # Our agent hosts the store, as torchrun's, where a core is free for its store process.
        spare = len(os.sched_getaffinity(0)) > 2
        assert o["TORCHELASTIC_USE_AGENT_STORE"] == ("True" if spare else "False")
        assert o["_argv"] == t["_argv"] == "[]"
