"""snapshot_torch.save/load with real torch, on the CPU: a resumed run is bit-identical."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node_agent import worker
from node_agent.worker import snapshot_torch
from node_agent.worker import snapshots as S

torch = pytest.importorskip("torch")


@pytest.fixture
def rank_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "r0"
    d.mkdir()
    monkeypatch.setenv(S.DIR_VAR, str(d))
    monkeypatch.delenv(S.LIMIT_VAR, raising=False)
    monkeypatch.delenv(S.RESTORE_VAR, raising=False)
    return d


def make(seed: int, opt: str) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    if opt == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optimizer


def train(model: Any, optimizer: Any, steps: range, at: Callable[[int], None] = lambda s: None) -> None:
    """Data and dropout both draw from torch's global generator: a resume must restore it."""
    for step in steps:
        x = torch.randn(4, 8)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        at(step)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_a_resumed_run_matches_an_uninterrupted_one_bit_for_bit(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch, opt: str
) -> None:
    k, n = 5, 12
    model, optimizer = make(0, opt)

    def at(step: int) -> None:
        if step == k:
            snapshot_torch.save(step, model=model, optimizer=optimizer, epoch=2, note="hi")

    train(model, optimizer, range(n), at)
    expected = [p.detach().clone() for p in model.parameters()]

    monkeypatch.setenv(S.RESTORE_VAR, str(k))
    fresh, fresh_opt = make(123, opt)  # other weights, other generator state
    loaded = snapshot_torch.load(model=fresh, optimizer=fresh_opt)
    assert loaded == snapshot_torch.Loaded(k, {"epoch": 2, "note": "hi"})
    train(fresh, fresh_opt, range(loaded.step + 1, n))
    for got, want in zip(fresh.parameters(), expected, strict=True):
        assert torch.equal(got, want)


def test_the_snapshot_file_holds_what_the_docs_say(rank_dir: Path) -> None:
    model, optimizer = make(0, "sgd")
    snapshot_torch.save(3, model=model, optimizer=optimizer, epoch=1)
    state = torch.load(rank_dir / f"{3:020d}.snap", weights_only=True)
    assert set(state) == {"step", "model", "optimizer", "extra", "rng"}
    assert state["step"] == 3 and state["extra"] == {"epoch": 1}
    assert set(state["rng"]) == {"cpu", "cuda"}
    assert torch.equal(state["rng"]["cpu"], torch.get_rng_state())


def test_nothing_to_restore_leaves_the_objects_alone(rank_dir: Path) -> None:
    model, optimizer = make(0, "sgd")
    snapshot_torch.save(1, model=model)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert snapshot_torch.load(model=model, optimizer=optimizer) is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_missing_snapshot_raises(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(S.RESTORE_VAR, "4")
    with pytest.raises(worker.SnapshotMissing):
        snapshot_torch.load()


def test_loading_state_the_snapshot_lacks_raises(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = make(0, "sgd")
    snapshot_torch.save(2, model=model)
    monkeypatch.setenv(S.RESTORE_VAR, "2")
    with pytest.raises(RuntimeError, match="holds no optimizer state"):
        snapshot_torch.load(model=model, optimizer=optimizer)


def test_a_file_save_did_not_write_is_refused(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with worker.snapshot(2) as f:
        torch.save({"step": 3}, f)
    monkeypatch.setenv(S.RESTORE_VAR, "2")
    with pytest.raises(RuntimeError, match=r"not a snapshot_torch\.save"):
        snapshot_torch.load()


def test_extras_of_other_types_need_weights_only_false(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot_torch.save(1, where=Path("/x"))
    monkeypatch.setenv(S.RESTORE_VAR, "1")
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        snapshot_torch.load()
    loaded = snapshot_torch.load(weights_only=False)
    assert loaded is not None and loaded.extra == {"where": Path("/x")}


def test_outside_node_agent_save_and_load_are_no_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (S.DIR_VAR, S.LIMIT_VAR, S.RESTORE_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    model, optimizer = make(0, "adam")
    snapshot_torch.save(1, model=model, optimizer=optimizer)
    assert snapshot_torch.load(model=model, optimizer=optimizer) is None
    assert os.listdir(tmp_path) == []


def test_a_bad_step_names_the_function(rank_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"snapshot_torch\.save\(\)"):
        snapshot_torch.save(-1)
    with pytest.raises(TypeError, match=r"snapshot_torch\.save\(\)"):
        snapshot_torch.save(1.5)  # type: ignore[arg-type]
