"""Log directory layout: torchrun's, except that an attempt directory is never reused."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from node_agent.logs import RunLogs
from node_agent.runtime_dir import RuntimeDir


@pytest.fixture
def rt(tmp_path: Path) -> RuntimeDir:
    (tmp_path / "shm").mkdir()
    return RuntimeDir(str(tmp_path / "shm"))


def test_layout_matches_torchrun(tmp_path: Path, rt: RuntimeDir) -> None:
    logs = RunLogs(str(tmp_path / "logs"), "job1", rt)
    root = Path(logs.root)
    assert root.parent == tmp_path / "logs" and root.name.startswith("job1_") and root.is_dir()

    attempt = logs.new_attempt()
    assert (attempt.index, attempt.dir) == (0, str(root / "attempt_0"))
    assert attempt.stdout_path(0) == str(root / "attempt_0" / "0" / "stdout.log")
    assert attempt.stderr_path(1) == str(root / "attempt_0" / "1" / "stderr.log")
    assert attempt.error_file(1) == str(root / "attempt_0" / "1" / "error.json")
    # The worker writes error.json itself, and torch does not create missing directories.
    assert (root / "attempt_0" / "1").is_dir()
    # Pages and flight-recorder pipes are not logs: they live in the private folder, and a
    # run with nothing to report leaves torchrun's tree (the drop-in test compares them).
    page = Path(attempt.page_path(0))
    assert page.parent.parent == Path(rt.path) / "attempt_0" and page.name == "progress.page"
    assert Path(attempt.flight_recorder_stem("pipe")).parent == Path(rt.path) / "attempt_0"
    assert attempt.flight_recorder_stem("trace") == str(root / "attempt_0" / "nccl_trace_rank_")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "attempt_0",
        "attempt_0/0",
        "attempt_0/1",
    ]


def test_attempts_never_reuse_a_directory(tmp_path: Path, rt: RuntimeDir) -> None:
    logs = RunLogs(str(tmp_path / "logs"), "job1", rt)
    first = logs.new_attempt()
    Path(first.stdout_path(0)).write_text("attempt 0's output")
    second = logs.new_attempt()
    os.mkdir(os.path.join(logs.root, "attempt_2"))  # taken behind our back
    third = logs.new_attempt()

    assert [a.index for a in (first, second, third)] == [0, 1, 3]
    assert Path(first.stdout_path(0)).read_text() == "attempt 0's output"
    # Two runs with the same id never share a directory either.
    assert RunLogs(str(tmp_path / "logs"), "job1", rt).root != logs.root


def test_default_base_is_a_fresh_torchelastic_tempdir(rt: RuntimeDir) -> None:
    logs = RunLogs(None, "job1", rt)
    base = Path(logs.root).parent
    try:
        assert base.parent == Path(tempfile.gettempdir()) and base.name.startswith("torchelastic_")
        assert Path(logs.root).name.startswith("job1_")
    finally:
        shutil.rmtree(base)


def test_missing_log_dir_is_created_and_a_file_is_refused(tmp_path: Path, rt: RuntimeDir) -> None:
    logs = RunLogs(str(tmp_path / "a" / "b"), "job1", rt)
    assert Path(logs.root).parent == tmp_path / "a" / "b"
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        RunLogs(str(tmp_path / "file"), "job1", rt)


def test_run_id_with_a_separator_stays_one_directory(tmp_path: Path, rt: RuntimeDir) -> None:
    logs = RunLogs(str(tmp_path), "team/job", rt)
    assert Path(logs.root).parent == tmp_path and Path(logs.root).name.startswith("team_job_")
