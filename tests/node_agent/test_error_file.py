"""node_agent.error_file: what the launcher's TORCHELASTIC_ERROR_FILE receives, case by case."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from node_agent.error_file import (
    MAX_BYTES,
    MAX_DEPTH,
    TRACEBACK_HINT,
    exception_record,
    launcher_error_file,
    outcome_record,
    read_worker_file,
    write,
)
from node_agent.supervisor.output import read_error_file
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


def test_the_path_is_read_once_and_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher_error_file({"TORCHELASTIC_ERROR_FILE": "e.json"}) == str(tmp_path / "e.json")
    assert launcher_error_file({}) is None
    assert launcher_error_file({"TORCHELASTIC_ERROR_FILE": ""}) is None


# --- a worker's error file is the user's: read with bounds, once --------------------------------


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_deeply_nested_error_file_is_reported_as_a_failure_not_raised(tmp_path: Path) -> None:
    """2,000 levels of JSON once crashed the agent (json's RecursionError was not caught)."""
    path = tmp_path / "error.json"
    path.write_text('{"message": ' + _deep(2000) + "}")
    root = failure(error_file=str(path), message="E: x\ntb")
    record = outcome_record(1, "failed", root, (root,))
    assert record is not None
    assert record["message"]["message"].endswith("failed with exit code 1: E: x")


def test_a_deeply_nested_error_file_is_named_as_not_used(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": ' + _deep(2000) + "}")
    logged: list[str] = []
    data, text, problem = read_error_file(str(path), logged.append)
    assert (data, text) == (None, "")
    assert problem == "JSON nested more than 32 levels deep"
    assert logged and "is not used (JSON nested more than 32 levels deep)" in logged[0]


def test_nesting_is_bounded_at_max_depth_strings_aside(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    inner = '{"m": "[[[[ {{{{ \\" ]]]]"}'  # brackets in strings do not count
    path.write_text('{"a": ' * (MAX_DEPTH - 1) + inner + "}" * (MAX_DEPTH - 1))
    assert read_worker_file(str(path))[1] == ""  # MAX_DEPTH levels: read
    path.write_text('{"a": ' * MAX_DEPTH + inner + "}" * MAX_DEPTH)
    assert read_worker_file(str(path)) == (None, f"JSON nested more than {MAX_DEPTH} levels deep")


def test_a_large_error_file_is_not_read(tmp_path: Path) -> None:
    """A 64 MiB file (a 1 GiB one took the agent to 5.3 GB) is refused from its size: the agent
    allocates nothing like it, and the failure is reported from what the agent saw."""
    path = tmp_path / "error.json"
    with open(path, "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk needed
    root = failure(error_file=str(path), message="E: x\ntb")
    tracemalloc.start()
    try:
        record = outcome_record(1, "failed", root, (root,))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # 2 MiB; MAX_BYTES is 1 MiB
    assert record is not None and record["message"]["message"].endswith("failed with exit code 1: E: x")
    data, problem = read_worker_file(str(path))
    assert data is None and problem == f"{64 << 20} bytes, over the {MAX_BYTES} bytes read of an error file"


def test_reads_stop_at_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never more than MAX_BYTES + 1 bytes read, whatever the file's size says; a file of exactly
    MAX_BYTES is read, one byte more is not used."""
    path = tmp_path / "error.json"
    body = '{"message": "' + "x" * (MAX_BYTES - 15) + '"}'
    path.write_text(body)
    assert len(body) == MAX_BYTES
    asked: list[int] = []
    got: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        asked.append(n)
        data = real_read(fd, n)
        got.append(len(data))
        return data

    monkeypatch.setattr(os, "read", read)
    data, problem = read_worker_file(str(path))
    assert problem == "" and data is not None and len(data["message"]) == MAX_BYTES - 15
    assert max(asked) <= MAX_BYTES + 1 and sum(got) == MAX_BYTES
    path.write_text(body + " ")
    assert (
        read_worker_file(str(path))[1]
        == f"{MAX_BYTES + 1} bytes, over the {MAX_BYTES} bytes read of an error file"
    )
    # A file whose size says less than it gives (a growing one, /proc): the reads still stop.
    path.write_text("{}")
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 0, *real_fstat(fd)[7:])))
    with open(path, "w") as f:
        f.write(" " * (3 * MAX_BYTES))
    got.clear()
    assert read_worker_file(str(path)) == (None, f"over the {MAX_BYTES} bytes read of an error file")
    assert sum(got) == MAX_BYTES + 1


def test_what_is_not_a_record_is_named(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    assert read_worker_file(str(path)) == (None, "")  # none written: nothing to say
    path.write_text("{half")
    assert read_worker_file(str(path))[1].startswith("not JSON (")
    path.write_text("[1, 2]")
    assert read_worker_file(str(path)) == (None, "a JSON list, not torch's record (an object)")
    path.write_bytes(b'{"message": "caf\xe9 \xff"}')  # not UTF-8: read with replacements
    data, problem = read_worker_file(str(path))
    assert problem == "" and data == {"message": "caf\ufffd \ufffd"}
    path.unlink()
    os.symlink("/dev/zero", path)  # endless, and its size says 0
    assert read_worker_file(str(path)) == (None, "not a regular file")
    path.unlink()
    os.mkfifo(path)  # opening it must not wait for a writer
    assert read_worker_file(str(path)) == (None, "not a regular file")


def test_the_file_is_read_once_per_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the agent read when the worker failed is what the launcher's error file copies: the
    file is not read again while unchanged, and the copy leaves the first record as it was."""
    path = tmp_path / "error.json"
    worker = {"message": {"message": "E: x", "extraInfo": {"py_callstack": "tb", "timestamp": "5"}}}
    path.write_text(json.dumps(worker))
    first, text, problem = read_error_file(str(path), lambda line: None)
    assert first == worker and text == "E: x\ntb" and problem == ""
    reads: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    root = failure(error_file=str(path))
    assert outcome_record(1, "failed", root, (root,)) == {"message": {**worker["message"], "errorCode": 1}}
    assert reads == []
    assert first == worker  # errorCode went into the copy only
    path.write_text(json.dumps({"message": "rewritten"}))  # a new file: read again
    assert outcome_record(1, "failed", root, (root,)) == {"message": "rewritten"}
    assert reads


def test_write_never_follows_a_link_at_the_old_temporary_name(tmp_path: Path) -> None:
    """The launcher's error file was written through ``<path>.<pid>.tmp``, a name anyone could
    plant a link at beforehand; the link's target was overwritten and the link renamed over
    the error file."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "launcher.json"
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    write(str(path), {"message": "x"}, lambda text, level: None)
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and json.loads(path.read_text()) == {"message": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", "launcher.json", f"launcher.json.{os.getpid()}.tmp"]
    )
