"""node_agent.error_file: what the launcher's TORCHELASTIC_ERROR_FILE receives, case by case."""

from __future__ import annotations

import json
from pathlib import Path

from node_agent.error_file import TRACEBACK_HINT, exception_record, launcher_error_file, outcome_record, write
from protocol import Failure


def failure(**kw: object) -> Failure:
    base: dict[str, object] = dict(
        node_id="n1", addr="10.0.0.1", rank=3, local_rank=1, exitcode=1, timestamp=1700000000.7, pid=42
    )
    return Failure(**{**base, **kw})  # type: ignore[arg-type]


def test_success_writes_nothing() -> None:
    assert outcome_record(0, "done", None, ()) is None


def test_a_local_error_file_is_copied_with_its_error_code(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    worker = {"message": {"message": "E: x", "extraInfo": {"py_callstack": "tb", "timestamp": "5"}}}
    path.write_text(json.dumps(worker))
    root = failure(exitcode=-11, signal="SIGSEGV", error_file=str(path))
    record = outcome_record(1, "failed", root, (root,))
    assert record == {"message": {**worker["message"], "errorCode": -11}}


def test_a_flat_message_is_copied_as_is(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "flat", "timestamp": "5"}))
    root = failure(error_file=str(path))
    assert outcome_record(1, "failed", None, (root,)) == {"message": "flat", "timestamp": "5"}


def test_an_unreadable_local_file_falls_back_to_the_failure(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("{half")
    root = failure(error_file=str(path), message="E: x\ntb")
    record = outcome_record(1, "failed", root, (root,))
    assert record is not None
    assert (
        record["message"]["message"]
        == "rank 3 (local rank 1) on node n1 (10.0.0.1) failed with exit code 1: E: x"
    )


def test_a_remote_root_cause_is_built_from_the_failure(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "not this node's"}}))
    root = failure(error_file=str(path), message="E: x\nTraceback ...")  # the path is n1's, not ours
    mine = failure(node_id="n2", addr="10.0.0.2", rank=0, local_rank=0, timestamp=1700000009.0)
    record = outcome_record(1, "failed", root, (mine,))
    assert record == {
        "message": {
            "message": "rank 3 (local rank 1) on node n1 (10.0.0.1) failed with exit code 1: E: x",
            "extraInfo": {"py_callstack": "E: x\nTraceback ...\n", "timestamp": "1700000000"},
            "errorCode": 1,
        }
    }


def test_without_error_file_or_text_torchs_own_words_are_used() -> None:
    killed = failure(exitcode=-9, signal="SIGKILL")
    record = outcome_record(1, "failed", killed, ())
    assert record is not None
    assert record["message"]["message"].endswith("failed with signal SIGKILL")
    assert record["message"]["extraInfo"]["py_callstack"] == "Signal 9 (SIGKILL) received by PID 42"
    record = outcome_record(1, "failed", failure(), ())
    assert record is not None
    assert record["message"]["extraInfo"]["py_callstack"] == TRACEBACK_HINT


def test_the_earliest_local_failure_stands_in_for_a_missing_root() -> None:
    late, early = (
        failure(rank=0, timestamp=20.0, message="late"),
        failure(rank=1, timestamp=10.0, message="early"),
    )
    record = outcome_record(1, "failed", None, (late, early))
    assert record is not None
    assert record["message"]["extraInfo"]["py_callstack"] == "early\n"


def test_no_worker_failure_records_the_agents_reason() -> None:
    record = outcome_record(1, "timed out waiting", None, ())
    assert record is not None
    assert set(record["message"]) == {"message", "extraInfo"}
    assert record["message"]["message"] == "timed out waiting"


def test_exception_record_is_torchs_shape() -> None:
    try:
        raise RuntimeError("bad")
    except RuntimeError as exc:
        record = exception_record(exc)
    assert record["message"]["message"] == "RuntimeError: bad"
    assert record["message"]["extraInfo"]["py_callstack"].startswith("Traceback (most recent call last)")
    assert record["message"]["extraInfo"]["timestamp"].isdigit()


def test_write_replaces_and_reports_failure(tmp_path: Path) -> None:
    lines: list[tuple[str, str]] = []
    path = tmp_path / "launcher.json"
    path.write_text("old")
    write(str(path), {"message": "x"}, lambda text, level: lines.append((text, level)))
    assert json.loads(path.read_text()) == {"message": "x"}
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left
    write(
        str(tmp_path / "missing" / "f.json"),
        {"message": "x"},
        lambda text, level: lines.append((text, level)),
    )
    assert lines[-1][1] == "warning" and "could not write TORCHELASTIC_ERROR_FILE" in lines[-1][0]


def test_the_path_is_read_once_and_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher_error_file({"TORCHELASTIC_ERROR_FILE": "e.json"}) == str(tmp_path / "e.json")
    assert launcher_error_file({}) is None
    assert launcher_error_file({"TORCHELASTIC_ERROR_FILE": ""}) is None
