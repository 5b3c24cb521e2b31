"""Log directory layout: torchrun's, except that an attempt directory is never reused."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from node_agent.logs import RunLogs


def test_layout_matches_torchrun(tmp_path: Path) -> None:
    logs = RunLogs(str(tmp_path), "job1")
    root = Path(logs.root)
    assert root.parent == tmp_path and root.name.startswith("job1_") and root.is_dir()

    attempt = logs.new_attempt()
    assert (attempt.index, attempt.dir) == (0, str(root / "attempt_0"))
    assert attempt.stdout_path(0) == str(root / "attempt_0" / "0" / "stdout.log")
    assert attempt.stderr_path(1) == str(root / "attempt_0" / "1" / "stderr.log")
    assert attempt.error_file(1) == str(root / "attempt_0" / "1" / "error.json")
    # The worker writes error.json itself, and torch does not create missing directories.
    assert (root / "attempt_0" / "1").is_dir()


def test_attempts_never_reuse_a_directory(tmp_path: Path) -> None:
    logs = RunLogs(str(tmp_path), "job1")
    first = logs.new_attempt()
    Path(first.stdout_path(0)).write_text("attempt 0's output")
    second = logs.new_attempt()
    os.mkdir(os.path.join(logs.root, "attempt_2"))  # taken behind our back
    third = logs.new_attempt()

    assert [a.index for a in (first, second, third)] == [0, 1, 3]
    assert Path(first.stdout_path(0)).read_text() == "attempt 0's output"
    # Two runs with the same id never share a directory either.
    assert RunLogs(str(tmp_path), "job1").root != logs.root


def test_default_base_is_a_fresh_torchelastic_tempdir() -> None:
    logs = RunLogs(None, "job1")
    base = Path(logs.root).parent
    try:
        assert base.parent == Path(tempfile.gettempdir()) and base.name.startswith("torchelastic_")
        assert Path(logs.root).name.startswith("job1_")
    finally:
        shutil.rmtree(base)


def test_missing_log_dir_is_created_and_a_file_is_refused(tmp_path: Path) -> None:
    logs = RunLogs(str(tmp_path / "a" / "b"), "job1")
    assert Path(logs.root).parent == tmp_path / "a" / "b"
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        RunLogs(str(tmp_path / "file"), "job1")


def test_run_id_with_a_separator_stays_one_directory(tmp_path: Path) -> None:
    logs = RunLogs(str(tmp_path), "team/job")
    assert Path(logs.root).parent == tmp_path and Path(logs.root).name.startswith("team_job_")
