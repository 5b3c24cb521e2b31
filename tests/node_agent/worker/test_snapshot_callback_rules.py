"""The snapshot callbacks' rules: ``every_n_steps`` is checked, and outside node-agent the
callbacks write nothing and there is nothing to resume from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _modules() -> list:
    out = []
    for lib, name in (("lightning", "lightning_snapshots"), ("transformers", "hf_snapshots")):
        pytest.importorskip(lib)
        out.append(__import__(f"node_agent.worker.{name}", fromlist=["SnapshotCallback"]))
    return out


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_every_n_steps_must_be_a_positive_int(bad: object) -> None:
    for mod in _modules():
        with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
            mod.SnapshotCallback(every_n_steps=bad)


def test_outside_node_agent_nothing_is_written_or_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_AGENT_SNAPSHOT_DIR", raising=False)
    monkeypatch.delenv("NODE_AGENT_RESTORE_STEP", raising=False)
    lm, hm = _modules()
    assert lm.resume_path() is None and hm.resume_checkpoint() is None
    boom = SimpleNamespace()  # any use of the trainer's checkpoint or the model would raise
    trainer = SimpleNamespace(global_step=3, _checkpoint_connector=boom)
    lm.SnapshotCallback(every_n_steps=1).on_train_batch_end(trainer, None, None, None, 0)
    state = SimpleNamespace(global_step=3)
    hm.SnapshotCallback(every_n_steps=1).on_step_end(None, state, None, model=boom, optimizer=boom)


def test_a_step_off_the_interval_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_AGENT_SNAPSHOT_DIR", str(tmp_path))
    lm, hm = _modules()
    trainer = SimpleNamespace(global_step=3, _checkpoint_connector=SimpleNamespace())
    lm.SnapshotCallback(every_n_steps=2).on_train_batch_end(trainer, None, None, None, 0)
    hm.SnapshotCallback(every_n_steps=2).on_step_end(None, SimpleNamespace(global_step=3), None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["lightning_snapshots", "hf_snapshots"])
def test_the_modules_import_nothing_beyond_their_library(name: str) -> None:
    """Importing a callback module loads its library (which loads torch) and node-agent's stdlib
    worker modules; the module itself adds no third-party import."""
    lib = "lightning.pytorch" if name == "lightning_snapshots" else "transformers"
    pytest.importorskip(lib.split(".")[0])
    code = (
        f"import sys, {lib} as lib\n"
        + ("lib.TrainerCallback\n" if lib == "transformers" else "")
        + "import node_agent.worker.lightning\n" * (name == "lightning_snapshots")
        + "before = set(sys.modules)\n"
        + f"import node_agent.worker.{name}\n"
        + "new = {m.split('.')[0] for m in set(sys.modules) - before} - sys.stdlib_module_names\n"
        + "print(sorted(new))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(eval(out.stdout.strip().splitlines()[-1])) <= {"node_agent"}, out.stdout
