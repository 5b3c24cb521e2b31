"""edge.atomic_write.replace_file: whole or not at all, never through a planted link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edge import atomic_write
from edge.atomic_write import replace_file, temp_name


def test_replaces_whole_with_mode_and_leaves_nothing_beside(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("old")
    os.chmod(path, 0o644)
    replace_file(path, "new é", fsync=True, fsync_dir=True)
    assert path.read_text(encoding="utf-8") == "new é"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the new file's, not the old one's
    replace_file(str(path), b"\x00bytes", mode=0o640)
    assert path.read_bytes() == b"\x00bytes"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 & ~_umask()
    assert os.listdir(tmp_path) == ["f"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_temporary_name_is_beside_and_unpredictable(tmp_path: Path) -> None:
    names = {temp_name(str(tmp_path / "f")) for _ in range(100)}
    assert len(names) == 100
    assert all(os.path.dirname(n) == str(tmp_path) and os.path.basename(n).startswith(".f.") for n in names)


def test_a_link_at_the_temporary_name_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a link planted at the very name drawn (as if guessed) is not followed: the create
    fails, a fresh name is drawn, and the link's target is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = str(tmp_path / ".f.planted.tmp")
    os.symlink(victim, planted)
    drawn = iter([planted, planted, str(tmp_path / ".f.fresh.tmp")])
    monkeypatch.setattr(atomic_write, "temp_name", lambda path: next(drawn))
    replace_file(tmp_path / "f", "data")
    assert victim.read_text() == "precious" and os.readlink(planted) == str(victim)
    assert (tmp_path / "f").read_text() == "data"
    monkeypatch.setattr(atomic_write, "temp_name", lambda path: planted)
    with pytest.raises(FileExistsError):
        replace_file(tmp_path / "f", "other")
    assert victim.read_text() == "precious" and (tmp_path / "f").read_text() == "data"


def test_an_error_removes_the_temporary_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    path.write_text("old")

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space"):
        replace_file(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f"]
    with pytest.raises(OSError):
        replace_file(tmp_path / "missing" / "f", "x")  # no folder: nothing to clean up either
    replace_file(tmp_path / "d", "x")
    os.replace(tmp_path / "d", tmp_path / "e")
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):  # the rename fails: a folder is in the way
        replace_file(tmp_path / "d", "x")
    assert sorted(os.listdir(tmp_path)) == ["d", "e", "f"]
