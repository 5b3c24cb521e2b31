"""Every snapshot loader we ship unpickles with torch.load(weights_only=True) (issue 42): a
restored file may be a peer's replica or come from --snapshot-dir, so one holding a pickle
that would run code is refused (UnsafeSnapshot) before any of it runs, and what the loaders
need beside torch's own types is a short allow-list (numpy's generator state for Hugging Face,
argparse.Namespace hyper-parameters for Lightning) plus what the script names."""

from __future__ import annotations

import argparse
import os
import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.worker import snapshot_torch
from node_agent.worker import snapshots as S

torch = pytest.importorskip("torch")


class Planted:
    """Unpickling it writes a marker file: code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(autouse=True)
def _process_allow_list() -> Iterator[None]:
    """lightning_snapshots.resume_path registers its types for Lightning's own load: undone."""
    before = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


@pytest.fixture
def rank_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "r0"
    d.mkdir()
    monkeypatch.setenv(S.DIR_VAR, str(d))
    monkeypatch.delenv(S.LIMIT_VAR, raising=False)
    monkeypatch.setenv(S.RESTORE_VAR, "3")
    return d


def _plant(rank_dir: Path, record: dict[str, Any]) -> Path:
    path = rank_dir / f"{3:020d}.snap"
    torch.save(record, path)
    return path


def _loaders() -> dict[str, Any]:
    out: dict[str, Any] = {"snapshot_torch": lambda: snapshot_torch.load()}
    try:
        from node_agent.worker import hf_snapshots

        out["hf"] = hf_snapshots.resume_checkpoint
    except ImportError:
        pass
    try:
        from node_agent.worker import lightning_snapshots

        out["lightning"] = lightning_snapshots.resume_path
    except ImportError:
        pass
    return out


def _records(marker: Path) -> dict[str, dict[str, Any]]:
    """What each loader would accept, with the planted object where a state goes."""
    bad = Planted(marker)
    return {
        "snapshot_torch": {"step": 3, "model": None, "optimizer": None, "extra": {"x": bad}, "rng": {}},
        "hf": {
            "format": "node-agent-hf-snapshot-1", "step": 3, "model": {"w": bad}, "optimizer": None,
            "scheduler": None, "trainer_state": "{}", "rng": {"cpu": torch.get_rng_state()},
        },
        "lightning": {"state_dict": {"w": torch.zeros(1)}, "hyper_parameters": {"x": bad}},
    }  # fmt: skip


@pytest.mark.parametrize("loader", ["snapshot_torch", "hf", "lightning"])
def test_a_snapshot_whose_pickle_would_run_code_is_refused(
    rank_dir: Path, tmp_path: Path, loader: str
) -> None:
    loaders = _loaders()
    if loader not in loaders:
        pytest.skip(f"{loader}'s library is not installed")
    marker = tmp_path / "ran"
    _plant(rank_dir, _records(marker)[loader])
    with pytest.raises(snapshot_torch.UnsafeSnapshot, match="weights only") as info:
        loaders[loader]()
    assert "system" in str(info.value)  # names what it refused
    assert not marker.exists()
    # What the file would have done under an unrestricted load (the test's premise):
    with pytest.raises(pickle.UnpicklingError):
        torch.load(rank_dir / f"{3:020d}.snap", weights_only=True)
    torch.load(rank_dir / f"{3:020d}.snap", weights_only=False)
    assert marker.exists()


def test_the_hf_snapshot_needs_only_numpys_generator_state_beside_torchs_types(rank_dir: Path) -> None:
    hf_snapshots = pytest.importorskip("node_agent.worker.hf_snapshots")
    numpy = pytest.importorskip("numpy")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    rng = {"python": random.getstate(), "cpu": torch.get_rng_state(), "numpy": numpy.random.get_state()}
    record = {
        "format": hf_snapshots.FORMAT, "step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(), "trainer_state": "{}", "rng": rng,
    }  # fmt: skip
    path = _plant(rank_dir, record)
    assert sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) == sorted(
        f"{g.__module__}.{g.__qualname__}" for g in hf_snapshots.allowed_globals()[:3]
    )
    folder = hf_snapshots.resume_checkpoint()
    assert folder is not None
    with torch.serialization.safe_globals(hf_snapshots.allowed_globals()):
        back = torch.load(os.path.join(folder, "rng_state.pth"), weights_only=True)
    assert back["numpy"][0] == "MT19937" and numpy.array_equal(back["numpy"][1], rng["numpy"][1])


def test_lightning_hyper_parameters_from_parsed_arguments_load_and_others_are_named(rank_dir: Path) -> None:
    lightning_snapshots = pytest.importorskip("node_agent.worker.lightning_snapshots")
    record = {"state_dict": {"w": torch.zeros(1)}, "hyper_parameters": {"args": argparse.Namespace(lr=0.1)}}
    path = _plant(rank_dir, record)
    assert lightning_snapshots.resume_path() == str(path)
    _plant(rank_dir, {"state_dict": {}, "hyper_parameters": {"where": Path("/data")}})
    with pytest.raises(snapshot_torch.UnsafeSnapshot, match="PosixPath"):
        lightning_snapshots.resume_path()
    assert lightning_snapshots.resume_path(safe_globals=[type(Path("/data"))]) == str(path)


def test_snapshot_torch_extras_of_other_types_are_allowed_by_name(rank_dir: Path) -> None:
    snapshot_torch.save(3, where=Path("/x"))
    with pytest.raises(snapshot_torch.UnsafeSnapshot, match="PosixPath"):
        snapshot_torch.load()
    loaded = snapshot_torch.load(safe_globals=[type(Path("/x"))])
    assert loaded is not None and loaded.extra == {"where": Path("/x")}
