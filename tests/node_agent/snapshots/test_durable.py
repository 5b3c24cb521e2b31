"""node_agent/snapshots/durable.py: the snapshot directory (--snapshot-dir). What it offers is
only what is complete for every rank; persisting is atomic; pruning never removes the newest
complete step; reading back goes through the holdings' bound; symlinks are never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_agent.snapshots.durable import DurableDir, Offer, job_folder
from node_agent.snapshots.holdings import Holdings, NoRoom, snap_name


def _src(tmp_path: Path, data: bytes) -> int:
    path = tmp_path / f"src-{len(data)}-{data[:4].hex()}"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def _persist(d: DurableDir, tmp_path: Path, world: int, rank: int, step: int, data: bytes = b"state") -> int:
    fd = _src(tmp_path, data)
    try:
        return d.persist(world, rank, step, fd)
    finally:
        os.close(fd)


def test_job_folders_are_plain_names_or_digests() -> None:
    assert job_folder("slurm-4242") == "slurm-4242"
    for odd in ("..", ".", "a/b", "../../etc", "x" * 200, "", "é"):
        name = job_folder(odd)
        assert name.startswith("job-") and "/" not in name and len(name) == 28, name


def test_a_step_is_offered_once_every_rank_has_it(tmp_path: Path) -> None:
    d = DurableDir(tmp_path / "dir", "job")
    assert d.offer() == Offer()  # nothing yet, not even the folder
    _persist(d, tmp_path, 2, 0, 10)
    assert d.offer() == Offer()  # rank 1 lacks it
    _persist(d, tmp_path, 2, 1, 10)
    _persist(d, tmp_path, 2, 0, 11)
    assert d.offer() == Offer(2, (10,))
    _persist(d, tmp_path, 2, 1, 11)
    assert d.offer() == Offer(2, (11, 10))
    # Another world size with a newer complete step wins; the files are private.
    _persist(d, tmp_path, 1, 0, 12)
    assert d.offer() == Offer(1, (12,))
    assert (os.stat(d.rank_dir(1, 0)).st_mode & 0o777) == 0o700
    assert (os.stat(d.rank_dir(1, 0) / snap_name(12)).st_mode & 0o777) == 0o600
    assert (d.rank_dir(1, 0) / snap_name(12)).read_bytes() == b"state"


def test_pruning_keeps_the_newest_two_and_the_newest_complete_step(tmp_path: Path) -> None:
    d = DurableDir(tmp_path / "dir", "job")
    for rank in (0, 1):
        _persist(d, tmp_path, 2, rank, 10)
    # This node (rank 0) runs ahead of the other: steps 11-13 are its own only.
    for step in (11, 12, 13):
        _persist(d, tmp_path, 2, 0, step)
        d.prune(2, range(0, 1))
    assert sorted(os.listdir(d.rank_dir(2, 0))) == [snap_name(s) for s in (10, 12, 13)]
    _persist(d, tmp_path, 2, 1, 13)
    d.prune(2, range(0, 2))
    assert sorted(os.listdir(d.rank_dir(2, 0))) == [snap_name(12), snap_name(13)]  # 10 went
    assert d.offer() == Offer(2, (13,))
    # Never complete (a folder local to this node, in a job of several): its newest two.
    local = DurableDir(tmp_path / "local", "job")
    for step in (1, 2, 3):
        _persist(local, tmp_path, 4, 2, step)
    local.prune(4, range(2, 3))
    assert sorted(os.listdir(local.rank_dir(4, 2))) == [snap_name(2), snap_name(3)]


def test_a_persist_that_fails_leaves_no_part_and_the_previous_step(tmp_path: Path) -> None:
    d = DurableDir(tmp_path / "dir", "job")
    _persist(d, tmp_path, 1, 0, 5, b"five")
    bad = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # reading a folder fails
    try:
        with pytest.raises(OSError):
            d.persist(1, 0, 6, bad)
    finally:
        os.close(bad)
    assert os.listdir(d.rank_dir(1, 0)) == [snap_name(5)]
    assert d.offer() == Offer(1, (5,))


def test_reading_back_goes_into_the_holdings_within_their_bound(tmp_path: Path) -> None:
    d = DurableDir(tmp_path / "dir", "job")
    _persist(d, tmp_path, 2, 1, 7, b"x" * 100)
    h = Holdings(tmp_path / "mem", memory=1 << 20, file_limit=1 << 10)
    assert d.read_into(h, 2, 1, 7) == 100
    assert h.path(1, 7) is not None and h.path(1, 7).read_bytes() == b"x" * 100  # type: ignore[union-attr]
    with pytest.raises(FileNotFoundError):
        d.read_into(h, 2, 0, 7)  # not persisted
    _persist(d, tmp_path, 2, 0, 7, b"y" * 2000)
    with pytest.raises(NoRoom):
        d.read_into(Holdings(tmp_path / "small", memory=1 << 20, file_limit=1000), 2, 0, 7)
    assert not list((tmp_path / "small").rglob("*.part"))


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    d = DurableDir(tmp_path / "dir", "job")
    _persist(d, tmp_path, 1, 0, 1)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    folder = d.rank_dir(1, 0)
    os.symlink(outside, folder / snap_name(2))  # a planted link named like a snapshot
    assert d.offer() == Offer(1, (1,))  # not counted
    h = Holdings(tmp_path / "mem", memory=1 << 20, file_limit=1 << 10)
    with pytest.raises(OSError):
        d.read_into(h, 1, 0, 2)
    os.symlink(outside, folder / (snap_name(3) + ".part"))
    _persist(d, tmp_path, 1, 0, 3, b"new")  # the link is replaced, not written through
    assert outside.read_bytes() == b"secret"
    d.prune(1, range(1))
    assert outside.exists()


def test_forget_removes_the_job_folder_only(tmp_path: Path) -> None:
    d, other = DurableDir(tmp_path / "dir", "job"), DurableDir(tmp_path / "dir", "other")
    _persist(d, tmp_path, 1, 0, 1)
    _persist(other, tmp_path, 1, 0, 1)
    d.forget()
    assert not d.job.exists() and other.offer() == Offer(1, (1,))
    d.forget()  # gone already: no error


def test_scans_are_bounded_past_their_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent.snapshots import durable

    d = DurableDir(tmp_path / "dir", "job")
    # A world past MAX_SCAN_RANKS is never scanned (a scan lists every rank folder).
    monkeypatch.setattr(durable, "MAX_SCAN_RANKS", 2)
    _persist(d, tmp_path, 3, 0, 1)
    assert d.complete_steps(3) == [] and d.offer() == Offer()
    # A rank folder holding more than MAX_FILES names: at most that many are read.
    monkeypatch.setattr(durable, "MAX_FILES", 4)
    for step in range(10):
        (d.rank_dir(1, 0)).mkdir(parents=True, exist_ok=True)
        (d.rank_dir(1, 0) / snap_name(step)).write_bytes(b"x")
    assert 1 <= len(d.complete_steps(1)) <= 4
    # More world folders than MAX_WORLDS: only that many are looked at.
    monkeypatch.setattr(durable, "MAX_WORLDS", 1)
    assert d.offer().world == 1 and len(d.offer().steps) <= 4  # w1 only; w3 is not looked at
