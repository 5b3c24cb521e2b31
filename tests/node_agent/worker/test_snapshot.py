"""worker.snapshot() and worker.restore() against a real rank directory (tmp_path), in process."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from node_agent import worker
from node_agent.worker import snapshots as S


def name(step: int) -> str:
    return f"{step:020d}.snap"


@pytest.fixture
def rank_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "snapshots" / "r5"
    d.mkdir(parents=True)
    monkeypatch.setenv(S.DIR_VAR, str(d))
    monkeypatch.delenv(S.LIMIT_VAR, raising=False)
    monkeypatch.delenv(S.RESTORE_VAR, raising=False)
    return d


@pytest.fixture
def outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (S.DIR_VAR, S.LIMIT_VAR, S.RESTORE_VAR):
        monkeypatch.delenv(var, raising=False)


def write(step: int, data: bytes) -> None:
    with worker.snapshot(step) as f:
        f.write(data)


def files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# --- the API -----------------------------------------------------------------------------------


def test_the_worker_module_exposes_the_snapshot_api() -> None:
    for n in ("snapshot", "restore", "Restored", "SnapshotTooLarge", "SnapshotMissing"):
        assert n in worker.__all__
        assert getattr(worker, n) is getattr(S, n)
    assert issubclass(worker.SnapshotTooLarge, OSError)
    assert issubclass(worker.SnapshotMissing, RuntimeError)
    with pytest.raises(AttributeError, match="no attribute 'snapshot_nope'"):
        worker.snapshot_nope  # noqa: B018


# --- writing -----------------------------------------------------------------------------------


def test_a_snapshot_is_one_file_named_by_its_step(rank_dir: Path) -> None:
    write(42, b"state")
    assert files(rank_dir) == ["00000000000000000042.snap"]
    assert (rank_dir / name(42)).read_bytes() == b"state"
    assert S.step_name(2**63 - 1) == "09223372036854775807.snap"


def test_it_is_written_as_part_and_renamed_complete_at_the_end(rank_dir: Path) -> None:
    with worker.snapshot(7) as f:
        assert f.write(b"a" * 100) == 100
        f.flush()
        assert files(rank_dir) == ["00000000000000000007.snap.part"]
        assert (rank_dir / "00000000000000000007.snap.part").read_bytes() == b"a" * 100
        f.write(memoryview(b"bc"))
        f.write(bytearray(b"d"))
        assert f.tell() == 103
    assert files(rank_dir) == [name(7)]
    assert (rank_dir / name(7)).read_bytes() == b"a" * 100 + b"bcd"


def test_big_writes_and_small_ones_arrive_in_order(rank_dir: Path) -> None:
    big = os.urandom(S.BUFFER_SIZE + 12345)
    with worker.snapshot(1) as f:
        f.write(b"head")
        f.write(big)
        f.write(b"tail")
    assert (rank_dir / name(1)).read_bytes() == b"head" + big + b"tail"


def test_seek_and_tell(rank_dir: Path) -> None:
    with worker.snapshot(3) as f:
        f.write(b"0123456789")
        assert f.seek(0, os.SEEK_CUR) == 10
        assert f.seek(2) == 2
        f.write(b"xy")
        assert f.tell() == 4
        f.seek(10)
        with pytest.raises(io.UnsupportedOperation):
            f.seek(0, os.SEEK_END)
        with pytest.raises(ValueError):
            f.seek(-11, os.SEEK_CUR)
        assert f.writable() and f.seekable() and not f.readable()
    assert (rank_dir / name(3)).read_bytes() == b"01xy456789"


def test_an_exception_in_the_block_removes_the_part_and_keeps_the_previous(rank_dir: Path) -> None:
    write(1, b"one")
    with pytest.raises(ZeroDivisionError), worker.snapshot(2) as f:
        f.write(b"half of two")
        1 / 0  # noqa: B018
    assert files(rank_dir) == [name(1)]
    assert (rank_dir / name(1)).read_bytes() == b"one"


def test_a_failed_snapshot_of_the_same_step_keeps_the_complete_one(rank_dir: Path) -> None:
    write(5, b"five")
    with pytest.raises(KeyboardInterrupt), worker.snapshot(5) as f:
        f.write(b"not five")
        raise KeyboardInterrupt
    assert files(rank_dir) == [name(5)]
    assert (rank_dir / name(5)).read_bytes() == b"five"


def test_a_snapshot_of_the_same_step_replaces_it(rank_dir: Path) -> None:
    write(5, b"five")
    write(5, b"five again")
    assert files(rank_dir) == [name(5)]
    assert (rank_dir / name(5)).read_bytes() == b"five again"


def test_a_snapshot_block_is_entered_once(rank_dir: Path) -> None:
    s = worker.snapshot(1)
    with s as f:
        f.write(b"x")
    with pytest.raises(RuntimeError, match="entered once"), s:
        pass


# --- the limit ---------------------------------------------------------------------------------


def test_the_limit_allows_exactly_its_bytes(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(S.LIMIT_VAR, "10")
    write(1, b"0123456789")
    assert (rank_dir / name(1)).read_bytes() == b"0123456789"


def test_writing_past_the_limit_raises_and_keeps_the_previous(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(1, b"one")
    monkeypatch.setenv(S.LIMIT_VAR, "100")
    with pytest.raises(worker.SnapshotTooLarge) as e, worker.snapshot(2) as f:
        f.write(b"x" * 60)
        f.write(b"y" * 41)
    err = e.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert (err.step, err.limit, err.size) == (2, 100, 101)
    assert "100 bytes" in str(err) and "--snapshot-memory" in str(err) and S.LIMIT_VAR in str(err)
    assert files(rank_dir) == [name(1)]
    assert (rank_dir / name(1)).read_bytes() == b"one"


def test_bytes_past_the_limit_never_reach_the_file(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(S.LIMIT_VAR, "100")
    part = rank_dir / "00000000000000000002.snap.part"
    with pytest.raises(worker.SnapshotTooLarge), worker.snapshot(2) as f:
        f.write(b"x" * 50)
        try:
            f.write(b"y" * (S.BUFFER_SIZE * 2))  # past any buffer: it would go straight through
        except worker.SnapshotTooLarge:
            f.write(b"z" * 1000)  # dropped: the snapshot is abandoned already
            f.flush()
            assert part.stat().st_size <= 100
            raise
    assert files(rank_dir) == []


def test_a_limit_error_caught_in_the_block_is_raised_at_its_end(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(S.LIMIT_VAR, "4")
    with pytest.raises(worker.SnapshotTooLarge), worker.snapshot(1) as f:
        try:
            f.write(b"12345")
        except OSError:
            pass
    assert files(rank_dir) == []


# The last: Arabic-Indic digits, which str.isdigit() takes but are no decimal for the agent.
@pytest.mark.parametrize("value", ["", "lots", "-5", "1e9", "\u0661\u0660"])
def test_an_invalid_limit_is_no_limit(rank_dir: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(S.LIMIT_VAR, value)
    write(1, b"x" * 1000)
    assert files(rank_dir) == [name(1)]


def test_the_limit_with_torch_save(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save wraps the error in its own (its writer fails on the way out): the block
    still ends with SnapshotTooLarge."""
    torch = pytest.importorskip("torch")
    write(1, b"one")
    monkeypatch.setenv(S.LIMIT_VAR, str(1 << 20))
    with pytest.raises(worker.SnapshotTooLarge), worker.snapshot(2) as f:
        torch.save({"w": torch.zeros(1 << 20)}, f)  # 4 MiB of floats
    assert files(rank_dir) == [name(1)]


# --- pruning -----------------------------------------------------------------------------------


def test_pruning_keeps_the_newest_two(rank_dir: Path) -> None:
    for step in range(1, 6):
        write(step, b"%d" % step)
    assert files(rank_dir) == [name(4), name(5)]


def test_pruning_keeps_the_pinned_step(rank_dir: Path) -> None:
    (rank_dir / ".pin").write_text("2\n")
    for step in range(1, 6):
        write(step, b"%d" % step)
    assert files(rank_dir) == [".pin", name(2), name(4), name(5)]


def test_pruning_keeps_every_pinned_step(rank_dir: Path) -> None:
    # The agent pins two: the step kept on two nodes and the one being copied to the peer.
    (rank_dir / ".pin").write_text("2 5\n")
    for step in range(1, 9):
        write(step, b"%d" % step)
    assert files(rank_dir) == [".pin", name(2), name(5), name(7), name(8)]


@pytest.mark.parametrize("pin", ["", "two", "-2", "2.0", "99999999999999999999999"])
def test_an_unreadable_pin_is_ignored(rank_dir: Path, pin: str) -> None:
    (rank_dir / ".pin").write_text(pin)
    for step in range(1, 5):
        write(step, b"x")
    assert files(rank_dir) == [".pin", name(3), name(4)]


def test_a_pin_that_is_a_directory_is_ignored(rank_dir: Path) -> None:
    (rank_dir / ".pin").mkdir()
    for step in range(1, 5):
        write(step, b"x")
    assert files(rank_dir) == [".pin", name(3), name(4)]


def test_pruning_touches_only_complete_snapshots(rank_dir: Path) -> None:
    others = [
        "00000000000000000009.snap.part",  # being written (a replica, say)
        "1.snap",
        "0000000000000000000x.snap",
        "00000000000000000001.snap.tmp",
        "000000000000000000001.snap",
        "notes",
    ]
    for n in others:
        (rank_dir / n).write_bytes(b"keep me")
    for step in range(1, 5):
        write(step, b"x")
    assert files(rank_dir) == sorted([*others, name(3), name(4)])


def test_the_step_just_written_is_never_pruned(rank_dir: Path) -> None:
    """Newer snapshots may be there (a replica, or a step past the one the job restored from):
    the one just written stays all the same."""
    for step in (10, 11):
        write(step, b"x")
    write(3, b"three")
    assert files(rank_dir) == [name(3), name(10), name(11)]


def test_a_snapshot_that_vanishes_while_pruning_is_fine(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3):
        (rank_dir / name(step)).write_bytes(b"x")
    real = os.listdir
    monkeypatch.setattr(S.os, "listdir", lambda d: [*real(d), name(0)])  # pruned by the agent
    assert S.prune(str(rank_dir)) == [1]
    monkeypatch.undo()
    assert files(rank_dir) == [name(2), name(3)]


# --- restoring ---------------------------------------------------------------------------------


def test_nothing_to_restore_without_a_step(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(3, b"x")
    assert worker.restore() is None
    monkeypatch.setenv(S.RESTORE_VAR, "-1")
    assert worker.restore() is None


def test_restore_gives_the_chosen_step(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(3, b"three")
    write(4, b"four")
    monkeypatch.setenv(S.RESTORE_VAR, "3")
    r = worker.restore()
    assert r == worker.Restored(3, str(rank_dir / name(3)))
    assert r is not None and r.step == 3 and r.path == str(rank_dir / name(3))
    with r.open() as f:
        assert f.read() == b"three"
    assert "step=3" in repr(r)


@pytest.mark.parametrize("leftover", [None, "part"])
def test_a_missing_snapshot_of_the_chosen_step_raises(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch, leftover: str | None
) -> None:
    write(4, b"four")
    if leftover:  # a snapshot that never completed is no snapshot
        (rank_dir / "00000000000000000003.snap.part").write_bytes(b"half")
    monkeypatch.setenv(S.RESTORE_VAR, "3")
    with pytest.raises(worker.SnapshotMissing, match=r"step 3\b") as e:
        worker.restore()
    assert str(rank_dir) in str(e.value) and "diverge" in str(e.value)


def test_a_missing_directory_with_a_chosen_step_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(S.DIR_VAR, str(tmp_path / "gone"))
    monkeypatch.setenv(S.RESTORE_VAR, "0")
    with pytest.raises(worker.SnapshotMissing, match="directory is missing"):
        worker.restore()


@pytest.mark.parametrize("value", ["three", "-2", "1.0", "99999999999999999999"])
def test_a_restore_step_that_is_not_a_step_raises(
    rank_dir: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(S.RESTORE_VAR, value)
    with pytest.raises(RuntimeError, match=S.RESTORE_VAR):
        worker.restore()


def test_torch_round_trip(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(300, 200), "b": torch.arange(7), "step": 9, "note": "x"}
    with worker.snapshot(9) as f:
        torch.save(state, f)
    monkeypatch.setenv(S.RESTORE_VAR, "9")
    r = worker.restore()
    assert r is not None
    for loaded in (torch.load(r.path, mmap=True), torch.load(r.open())):
        assert loaded.keys() == state.keys()
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
        assert (loaded["step"], loaded["note"]) == (9, "x")


# --- outside node-agent ------------------------------------------------------------------------


def test_outside_node_agent_snapshots_are_discarded(
    outside: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with worker.snapshot(3) as f:
        assert f.write(b"abc") == 3
        assert f.write(memoryview(b"de")) == 2
        assert f.tell() == 5
        f.flush()
    assert os.listdir(tmp_path) == []
    assert worker.restore() is None
    monkeypatch.setenv(S.RESTORE_VAR, "3")  # a step but no directory: not under node-agent
    assert worker.restore() is None


def test_outside_node_agent_torch_save_runs(outside: None) -> None:
    torch = pytest.importorskip("torch")
    with worker.snapshot(1) as f:
        torch.save({"w": torch.ones(1000)}, f)
        assert f.tell() > 4000


def test_a_directory_variable_naming_no_directory_is_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    monkeypatch.setenv(S.DIR_VAR, str(not_a_dir))
    write(1, b"x")
    assert os.listdir(tmp_path) == ["file"]


# --- arguments ---------------------------------------------------------------------------------


class Index:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("bad", [True, 1.0, "3", None, b"3"])
@pytest.mark.parametrize("where", ["rank_dir", "outside"])
def test_a_step_that_is_not_an_int_is_a_type_error(
    bad: object, where: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(where)
    with pytest.raises(TypeError, match=r"worker\.snapshot\(\) takes an int step"):
        worker.snapshot(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**63, Index(-3)])
@pytest.mark.parametrize("where", ["rank_dir", "outside"])
def test_a_step_out_of_range_is_a_value_error(
    bad: object, where: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(where)
    with pytest.raises(ValueError, match=r"worker\.snapshot\(\) takes a step in 0\.\.2\*\*63-1"):
        worker.snapshot(bad)  # type: ignore[arg-type]


def test_integer_like_steps_are_taken(rank_dir: Path) -> None:
    np = pytest.importorskip("numpy")
    write(np.int64(6), b"six")
    write(Index(7), b"seven")  # type: ignore[arg-type]
    assert files(rank_dir) == [name(6), name(7)]


def test_the_limit_counts_bytes_not_items(rank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import array

    monkeypatch.setenv(S.LIMIT_VAR, "31")
    doubles = array.array("d", [1.0] * 4)  # 32 bytes in 4 items
    with pytest.raises(worker.SnapshotTooLarge), worker.snapshot(1) as f:
        f.write(memoryview(doubles))
    with pytest.raises(worker.SnapshotTooLarge), worker.snapshot(1) as f:
        f.write(doubles)


def test_the_agent_sets_the_variables_the_worker_reads() -> None:
    from node_agent import worker_env

    assert (S.DIR_VAR, S.LIMIT_VAR, S.RESTORE_VAR, S.DIGEST_VAR) == worker_env.SNAPSHOT_VARS


def test_restore_refuses_a_file_that_is_not_the_owners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: where the snapshot came from another node the agent says the owner's sha256;
    a file with other bytes is never handed to the script (torch.load would unpickle it)."""
    import hashlib

    (tmp_path / S.step_name(7)).write_bytes(b"the owner's bytes")
    monkeypatch.setenv(S.DIR_VAR, str(tmp_path))
    monkeypatch.setenv(S.RESTORE_VAR, "7")
    monkeypatch.setenv(S.DIGEST_VAR, hashlib.sha256(b"the owner's bytes").hexdigest())
    r = S.restore()
    assert r is not None and r.step == 7
    (tmp_path / S.step_name(7)).write_bytes(b"a planted pickle")
    with pytest.raises(S.SnapshotCorrupt, match="not the file its owner made"):
        S.restore()
    with pytest.raises(S.SnapshotMissing):  # what scripts catch already
        S.restore()
