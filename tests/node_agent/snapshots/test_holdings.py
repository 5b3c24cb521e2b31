"""node_agent/snapshots/holdings.py: what a node holds, read and pruned by the on-disk contract
only; odd names and symlinks are never counted, followed or used to remove anything outside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_agent.snapshots import holdings as holdings_mod
from node_agent.snapshots.holdings import Busy, Holdings, NoRoom, part_name, snap_name


def _snap(h: Holdings, rank: int, step: int, size: int = 10) -> Path:
    path = h.rank_dir(rank) / snap_name(step)
    path.write_bytes(b"x" * size)
    return path


def _holdings(tmp_path: Path, memory: int = 1 << 20, file_limit: int = 1 << 16) -> Holdings:
    return Holdings(tmp_path / "snapshots", memory=memory, file_limit=file_limit)


def test_names_follow_the_contract() -> None:
    assert snap_name(7) == "00000000000000000007.snap"
    assert part_name(2**63 - 1) == "09223372036854775807.snap.part"


def test_rank_dirs_are_private(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    assert (os.stat(h.root).st_mode & 0o777) == 0o700
    d = h.rank_dir(12)
    assert d == h.root / "r12" and (os.stat(d).st_mode & 0o777) == 0o700
    assert h.rank_dir(12) == d  # idempotent
    with pytest.raises(ValueError):
        h.rank_dir(2**31)
    with pytest.raises(ValueError):
        h.rank_dir(-1)


def test_inventory_and_path(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    for step in (3, 10, 7):
        _snap(h, 0, step)
    _snap(h, 5, 1)
    (h.rank_dir(5) / part_name(2)).write_bytes(b"half")
    h.rank_dir(9)  # empty: not listed
    assert h.inventory() == {0: (10, 7, 3), 5: (1,)}
    assert h.path(0, 7) == h.root / "r0" / snap_name(7)
    assert h.path(0, 8) is None
    assert h.path(5, 2) is None  # a .part is not a snapshot
    assert h.path(77, 1) is None


def test_odd_names_and_symlinks_are_ignored(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    _snap(h, 1, 4)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / snap_name(99)
    target.write_bytes(b"precious")
    # Names that almost match, and links where a rank dir or a snapshot would be.
    for name in ("r01", "r", "rx", "r-1", "r1.bak", "R2", "r99999999999"):
        (h.root / name).mkdir()
        (h.root / name / snap_name(1)).write_bytes(b"y")
    (h.root / "r3").symlink_to(outside)
    d = h.rank_dir(1)
    for name in ("7.snap", snap_name(5) + ".old", f"{6:021d}.snap", "99999999999999999999.snap"):
        (d / name).write_bytes(b"z")
    (d / snap_name(8)).symlink_to(target)
    (d / snap_name(9)).mkdir()
    (h.root / "stray.txt").write_text("hello")
    assert h.inventory() == {1: (4,)}
    assert h.path(1, 8) is None and h.path(1, 9) is None
    assert h.path(3, 99) is None
    assert h.rank_dir(3).is_dir() and not h.rank_dir(3).is_symlink()  # the link replaced, not used
    h.pin(4)
    assert not (outside / ".pin").exists()
    h.prune(keep=0)
    h.drop_partials()
    assert target.read_bytes() == b"precious"
    h.clear()
    assert list(h.root.iterdir()) == []
    assert target.read_bytes() == b"precious" and outside.is_dir()


def test_prune_keeps_the_newest_and_the_pinned(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    for step in range(1, 7):
        _snap(h, 0, step)
        _snap(h, 1, step * 10)
    h.pin(2)
    removed = h.prune(keep=2)
    assert len(removed) == 3 + 4
    assert h.inventory() == {0: (6, 5, 2), 1: (60, 50)}
    assert (h.root / "r0" / ".pin").read_text() == "2"


def test_pin_reaches_new_rank_dirs_atomically(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    h.rank_dir(0)
    h.pin(41)
    assert (h.root / "r0" / ".pin").read_text() == "41"
    assert (h.rank_dir(3) / ".pin").read_text() == "41"
    h.pin(42, 40)  # the step kept and the one being copied: both, in place of the old
    assert {p.read_text() for p in h.root.glob("r*/.pin")} == {"40 42"}
    h.pin(-1, 43)  # nothing kept yet: only the one being copied
    assert {p.read_text() for p in h.root.glob("r*/.pin")} == {"43"}
    assert not list(h.root.glob("r*/.pin.tmp"))
    assert h.inventory() == {}  # .pin is no snapshot


def test_drop_partials(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    _snap(h, 0, 1)
    (h.rank_dir(0) / part_name(2)).write_bytes(b"half")
    (h.rank_dir(4) / part_name(9)).write_bytes(b"half")
    receiving = h.admit(6, 3, 5)
    receiving.write_bytes(b"12345")
    assert sorted(p.name for p in h.drop_partials()) == [part_name(2), part_name(9)]
    assert receiving.exists()  # our receiver's part stays
    assert h.inventory() == {0: (1,)}


def test_used_bytes_and_room(tmp_path: Path) -> None:
    h = _holdings(tmp_path, memory=100_000, file_limit=50_000)
    assert h.used_bytes() == 0
    _snap(h, 0, 1, size=10_000)
    used = h.used_bytes()
    assert 10_000 <= used <= 10_000 + 8192  # st_size, or whole pages where the fs counts them
    assert h.room_for(50_000)
    assert not h.room_for(50_001)  # over the per-file limit
    _snap(h, 1, 1, size=45_000)
    assert not h.room_for(50_000)  # over the node's memory
    assert h.room_for(100_000 - h.used_bytes())  # exactly full is allowed
    sparse = h.rank_dir(2) / part_name(5)
    with open(sparse, "wb") as f:
        f.truncate(30_000)
    assert h.used_bytes() >= 10_000 + 45_000 + 30_000  # a sparse file counts at its size


def test_admit_reserves_and_complete_prunes(tmp_path: Path) -> None:
    # 4 KiB a file at least: a file system that counts whole pages must not change the outcome.
    h = _holdings(tmp_path, memory=100_000, file_limit=60_000)
    for step in (1, 2):
        _snap(h, 0, step, size=4096)
    part = h.admit(0, 3, 50_000)
    assert part == h.root / "r0" / part_name(3)
    with pytest.raises(NoRoom):
        h.admit(1, 3, 50_000)  # the first receive's bytes are counted before they are written
    with pytest.raises(Busy):
        h.admit(0, 3, 1)
    with pytest.raises(NoRoom):
        h.admit(2, 3, 60_001)
    part.write_bytes(b"s" * 50_000)
    final = h.complete(0, 3, part)
    assert final == h.path(0, 3)
    assert h.inventory() == {0: (3, 2)}  # rank 0 pruned to its newest two
    assert h.room_for(40_000)


def test_abandon_removes_the_part(tmp_path: Path) -> None:
    h = _holdings(tmp_path, memory=100, file_limit=100)
    part = h.admit(0, 1, 100)
    assert not h.room_for(1)
    part.write_bytes(b"p" * 10)
    h.abandon(0, 1)
    assert not part.exists()
    assert h.room_for(100)
    h.abandon(0, 1)  # twice is harmless


def test_complete_after_clear_leaves_nothing(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    part = h.admit(0, 1, 4)
    part.write_bytes(b"abcd")
    h.clear()
    with pytest.raises(OSError):
        h.complete(0, 1, part)
    assert h.inventory() == {} and h.used_bytes() == 0


def test_clear_forgets_the_pin(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    _snap(h, 0, 1)
    h.pin(1)
    h.clear()
    assert h.pinned == frozenset()
    assert not (h.rank_dir(0) / ".pin").exists()


def test_scans_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holdings_mod, "MAX_RANK_DIRS", 3)
    monkeypatch.setattr(holdings_mod, "MAX_FILES", 4)
    h = _holdings(tmp_path)
    for rank in range(5):
        _snap(h, rank, 1)
    for step in range(2, 10):
        _snap(h, 0, step)
    inv = h.inventory()
    assert len(inv) == 3
    assert all(len(steps) <= 4 for steps in inv.values())


def test_bad_arguments_are_ours(tmp_path: Path) -> None:
    h = _holdings(tmp_path)
    with pytest.raises(ValueError):
        h.path(0, 2**63)
    with pytest.raises(ValueError):
        h.pin(2**63)
    with pytest.raises(ValueError):
        h.admit(True, 1, 1)
    with pytest.raises(ValueError):
        Holdings(tmp_path / "x", memory=-1, file_limit=1)
