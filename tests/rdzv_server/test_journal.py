"""The state log: replaying the machine's logged inputs rebuilds its state; torn tails drop.

Pure where it can be: a machine that records what the log would keep, replayed into a fresh
one, must dump (``snapshot.dump``) to the same state. The file tests use a real state dir.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from protocol import Assignment, Heartbeat, Leave, WorkersFailed, WorkersSucceeded, decode_payload
from protocol.auth import TokenTable
from rdzv_server import journal, snapshot
from rdzv_server.journal import FILE_HEADER, LOG_NAME, StateLog, StateLogError, apply_record, event_record
from rdzv_server.state import Effect, Event, Rendezvous

from .harness import Harness, failure


class Recording(Rendezvous):
    """A machine that keeps, beside its state, the records the state log would write."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.records: list[dict[str, Any]] = []

    def _keep(self, rec: dict[str, Any], now: float) -> None:
        rec["t"], rec["w"] = now, 0.0
        # Through msgpack, as the file does.
        self.records.append(msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False))

    def handle(self, event: Event, now: float) -> list[Effect]:
        effects = super().handle(event, now)
        rec = event_record(event, effects)
        if rec is not None:
            self._keep(rec, now)
        return effects

    def drain(self, job_id: str, node_id: str, reason: str, now: float) -> list[Effect]:
        effects = super().drain(job_id, node_id, reason, now)
        self._keep({"k": "drain", "job": job_id, "node": node_id, "why": reason}, now)
        return effects


def replayed(records: list[dict[str, Any]]) -> Rendezvous:
    m = Rendezvous(None, expire_silent=False)
    for rec in records:
        apply_record(m, rec)
    return m


def state(m: Rendezvous) -> dict[str, Any]:
    """The machine's state, without what heartbeats alone change (not logged)."""
    d = snapshot.dump(m)
    for c in d["conns"]:
        c.pop("last_seen")
    return d


def busy_history(h: Harness) -> None:
    """Joins, a round, a failure and restart, an exclusion, a silent node, a leave, a drain."""
    kw = dict(min_nodes=1, max_nodes=3, max_restarts=5, exclude_after=2, last_call_timeout=1.0)
    a, b, c = h.join(**kw), h.join(**kw), h.join(**kw)
    h.advance(0.1)
    got = {x: h.last(x, Assignment) for x in (a, b, c)}
    assert all(got.values())
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2")))
    h.join(a, **kw), h.join(b, **kw), h.join(c, **kw)
    h.advance(0.1)
    h.send(b, WorkersFailed(round=1, failure=failure(rank=2, node="node2")))  # excluded now
    h.join(a, **kw), h.join(c, **kw)
    h.advance(0.1)
    # c goes silent; a keeps beating: the sweep drops c.
    for _ in range(12):
        h.advance(0.5)
        h.send(a, Heartbeat())
    h.join(a, **kw)
    h.machine.drain("job", "node1", "scale down", h.now)
    h.join(**{**kw, "spare": True}, job="job")
    h.send(a, Leave(reason="drained"))
    d = h.join(job="other")
    h.send(d, WorkersSucceeded(round=0))


def test_replaying_the_logged_inputs_rebuilds_the_same_state() -> None:
    h = Harness(machine=Recording())
    busy_history(h)
    m = h.machine
    assert "node2" in m.jobs["job"].excluded and m.jobs["job"].restart_count == 2
    assert any("went silent" in e.text for e in m.jobs["job"].history)
    logged = [decode_payload(r["msg"]) for r in m.records if r["k"] == "received"]
    assert logged and not any(isinstance(msg, Heartbeat) for msg in logged)
    assert state(replayed(m.records)) == state(m)


def test_replay_from_any_snapshot_point_agrees() -> None:
    h = Harness(machine=Recording())
    busy_history(h)
    records = h.machine.records
    for cut in (0, 5, len(records) // 2, len(records) - 1):
        restored = snapshot.load(
            msgpack.unpackb(msgpack.packb(snapshot.dump(replayed(records[:cut]))), raw=False),
            Rendezvous(None, expire_silent=False),
        )
        for rec in records[cut:]:
            apply_record(restored, rec)
        assert state(restored) == state(h.machine)


def test_snapshot_round_trips_and_rejects_what_it_does_not_know() -> None:
    h = Harness()
    busy_history(h)
    d = snapshot.dump(h.machine)
    assert snapshot.dump(snapshot.load(d)) == d
    with pytest.raises(snapshot.SnapshotError, match="version"):
        snapshot.load({**d, "version": 99})
    with pytest.raises(snapshot.SnapshotError, match="bad snapshot"):
        snapshot.load({**d, "jobs": [{"id": "x"}]})


def test_a_join_refused_for_its_token_replays_without_tokens() -> None:
    h = Harness(machine=Recording(TokenTable(default="secret")))
    c = h.join()  # no proof: refused
    assert c in h.closed
    assert h.machine.records[-1]["k"] == "disconnected"
    assert state(replayed(h.machine.records)) == state(h.machine)


# --- files --------------------------------------------------------------------------------


def drive(log: StateLog, h: Harness) -> None:
    """Route a harness's events through a state log, as the service does."""
    machine = log.machine
    orig = machine.handle

    def handle(event: Event, now: float) -> list[Effect]:
        effects = orig(event, now)
        log.record(event, effects, now)
        log.sync()
        return effects

    machine.handle = handle  # type: ignore[method-assign]
    h.machine = machine


def test_state_dir_survives_restarts_and_compaction(tmp_path: Path) -> None:
    log, found, _ = StateLog.open(tmp_path, snapshot_every=7)
    assert found.replayed == 0 and found.jobs == 0
    h = Harness()
    drive(log, h)
    a, _ = h.join(), h.join()
    assert h.last(a, Assignment) is not None
    h.send(a, WorkersSucceeded(round=0))
    before = state(log.machine)
    log.close()
    assert (tmp_path / journal.SNAP_NAME).exists()  # compacted at least once
    log2, found2, effects = StateLog.open(tmp_path, snapshot_every=7)
    try:
        job = log2.machine.jobs["job"]
        assert found2.jobs == 1 and job.round == 0 and job.restart_count == 0
        assert [m.state.value for m in job.members.values()] == ["succeeded", "running"]
        after = state(log2.machine)
        # Recovery marks the old connections away and notes it; the rest is as it was.
        for d in (before, after):
            for c in d["conns"]:
                c.pop("phase")
            d.pop("resume_deadline")
            for j in d["jobs"]:
                j["history"] = [e for e in j["history"] if e[1] != "recovered"]
        assert after == before
        assert any("waiting up to" in getattr(e, "text", "") for e in effects)
        assert log2.clock() >= job.created_at
    finally:
        log2.close()


def test_a_second_server_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    log, _, _ = StateLog.open(tmp_path)
    try:
        with pytest.raises(StateLogError, match="in use"):
            StateLog.open(tmp_path)
    finally:
        log.close()


def _log_with_records(tmp_path: Path) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    """A state dir whose log ends with a large record; the states before and after it."""
    d = tmp_path / "live"
    log, _, _ = StateLog.open(d)
    h = Harness()
    drive(log, h)
    a, _ = h.join(), h.join()
    big = failure(rank=1, node="node1")
    big = dataclasses.replace(big, message="Traceback ... " * 20)
    before = state(log.machine)
    h.send(a, WorkersFailed(round=0, failure=big))
    after = state(log.machine)
    log.close()
    return d, [before], after


def _last_record_start(path: Path) -> int:
    data = path.read_bytes()
    found = journal.scan(data, FILE_HEADER.size)
    assert not found.torn
    return found.good_end - len(found.records[-1]) - journal.RECORD_HEADER.size


def test_torn_write_at_every_byte_of_the_last_record_replays_to_the_state_before(tmp_path: Path) -> None:
    live, (before,), after = _log_with_records(tmp_path)
    path = live / LOG_NAME
    full = path.read_bytes()
    start = _last_record_start(path)
    assert len(full) - start > 300  # the failure record, with its message
    whole = Rendezvous(None, expire_silent=False)
    journal.replay_log(path, whole, 0)
    assert state(whole) == after
    work = tmp_path / "cut.log"
    for cut in range(start, len(full)):
        work.write_bytes(full[:cut])
        m = Rendezvous(None, expire_silent=False)
        _, _, dropped, _ = journal.replay_log(work, m, 0)
        assert state(m) == before, f"cut at {cut}"
        assert dropped == cut - start
        assert work.stat().st_size == start  # the torn tail was truncated away


def test_zero_filled_tail_is_torn_but_damage_before_more_records_refuses(tmp_path: Path) -> None:
    live, (before,), _ = _log_with_records(tmp_path)
    path = live / LOG_NAME
    full = path.read_bytes()
    start = _last_record_start(path)
    # The file system kept the new size but not the data: zeros where the record was.
    path.write_bytes(full[:start] + bytes(len(full) - start))
    m = Rendezvous(None, expire_silent=False)
    journal.replay_log(path, m, 0)
    assert state(m) == before
    # A flipped byte in an earlier record, with records after it: damage, not a torn write.
    damaged = bytearray(full)
    damaged[FILE_HEADER.size + 12] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(StateLogError, match="checksum"):
        journal.replay_log(path, Rendezvous(None, expire_silent=False), 0)


def test_opening_drops_a_torn_tail_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live, _, _ = _log_with_records(tmp_path)
    path = live / LOG_NAME
    full = path.read_bytes()
    path.write_bytes(full[:-5])
    copy = tmp_path / "copy"
    shutil.copytree(live, copy)
    with caplog.at_level("WARNING", logger="rdzv_server"):
        log, found, _ = StateLog.open(copy)
    log.close()
    assert found.dropped_bytes > 0
    assert "dropped a torn last record" in caplog.text


# --- a state dir nobody else can steer --------------------------------------------------------


def test_a_planted_tmp_symlink_is_not_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, snapshot_every=1)
    try:
        (d / (LOG_NAME + ".tmp")).symlink_to(outside)
        (d / (journal.SNAP_NAME + ".tmp")).symlink_to(outside)
        log.compact()  # writes both files through their .tmp names
    finally:
        log.close()
    assert outside.read_bytes() == b"keep me"
    assert not (d / (LOG_NAME + ".tmp")).exists() and (d / journal.SNAP_NAME).is_file()


@pytest.mark.parametrize("name", [journal.LOCK_NAME, LOG_NAME, journal.SNAP_NAME])
def test_a_symlink_in_place_of_a_state_file_is_refused(tmp_path: Path, name: str) -> None:
    outside = tmp_path / "elsewhere"
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    (d / name).symlink_to(outside)
    with pytest.raises(StateLogError, match="symlink"):
        StateLog.open(d)
    assert not outside.exists()


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StateLogError, match="writable by other users"):
        StateLog.open(d)


def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(StateLogError, match="is a symlink"):
        StateLog.open(tmp_path / "link")


def test_the_dir_and_its_files_are_private_under_any_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0)
    try:
        log, _, _ = StateLog.open(tmp_path / "new" / "state", snapshot_every=1)
        log.compact()
        log.close()
    finally:
        os.umask(old)
    d = tmp_path / "new" / "state"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
