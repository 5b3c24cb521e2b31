"""The state log: replaying the machine's logged inputs rebuilds its state; torn tails drop.

Pure where it can be: a machine that records what the log would keep, replayed into a fresh
one, must dump (``state_image.dump``) to the same state. The file tests use a real state dir.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from protocol import (
    Assignment,
    HangDetected,
    Heartbeat,
    Leave,
    Progress,
    Stacks,
    WorkersFailed,
    WorkersSucceeded,
    decode_payload,
)
from protocol.auth import TokenTable
from rdzv_server import journal, state_image, wal
from rdzv_server.journal import LOG_NAME, StateLog, apply_record, event_record
from rdzv_server.machine.state import (
    Connected,
    Disconnected,
    DrainRequested,
    Effect,
    Event,
    NotFound,
    Received,
    Rendezvous,
    Restarted,
    ShuttingDown,
    Tick,
)
from rdzv_server.service import RendezvousService
from rdzv_server.wal import FILE_HEADER, StateLogError

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
        # As StateLog.record does.
        rec = event_record(event, effects, unchanged=self.unchanged, facts=self.facts)
        if rec is not None:
            self._keep(rec, now)
        return effects


def replayed(records: list[dict[str, Any]]) -> Rendezvous:
    m = Rendezvous(None, expire_silent=False)
    for rec in records:
        apply_record(m, rec)
    return m


def state(m: Rendezvous) -> dict[str, Any]:
    """The machine's state, without what heartbeats alone change (not logged)."""
    d = state_image.dump(m)
    for c in d["conns"]:
        c.pop("last_seen")
    return d


def replays_from_every_cut(records: list[dict[str, Any]], live: Rendezvous) -> None:
    """A snapshot taken after any record (through msgpack, as on disk), then the records after
    it replayed, gives the live machine's state."""
    for cut in range(len(records) + 1):
        restored = state_image.load(
            msgpack.unpackb(msgpack.packb(state_image.dump(replayed(records[:cut]))), raw=False),
            Rendezvous(None, expire_silent=False),
        )
        for rec in records[cut:]:
            apply_record(restored, rec)
        assert state(restored) == state(live), f"replay from record {cut} differs"


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
    h.machine.handle(DrainRequested("job", "node1", "scale down"), h.now)
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
        restored = state_image.load(
            msgpack.unpackb(msgpack.packb(state_image.dump(replayed(records[:cut]))), raw=False),
            Rendezvous(None, expire_silent=False),
        )
        for rec in records[cut:]:
            apply_record(restored, rec)
        assert state(restored) == state(h.machine)


def training_history(h: Harness) -> None:
    """Issue 19's inputs: progress (a straggler noted), a hang reported by two nodes with
    their stacks, the straggler left out of the next round, then a crash loop."""
    kw = dict(min_nodes=2, max_nodes=3, max_restarts=9, last_call_timeout=1.0, exclude_stragglers=True)
    a, b, c = h.join(**kw), h.join(**kw), h.join(**kw)
    h.advance(0.1)
    for i in range(3):
        for x in (a, b, c):
            slow = 300.0 if x == c else 100.0
            h.send(x, Progress(round=0, min_step=i, max_step=i, compute_ms=(100.0, slow)))
        h.advance(1.0)
    h.send(b, HangDetected(round=0, ranks=(2,), step=2, phase="compute", silent_s=30.0))
    h.send(a, HangDetected(round=0, ranks=(0, 1), step=2, silent_s=31.0))
    st = Stacks(round=0, ranks=(2,), steps=(2,), phases=("compute",), silent_s=(30.0,), stacks=("frame",))
    h.send(b, st)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=2))
    for x in (a, b, c):
        h.join(x, **kw)
    h.advance(0.1)  # the round forms without the straggler
    for rnd in (1, 2, 3):
        h.send(a, WorkersFailed(round=rnd, failure=failure(), step=2))
        if rnd < 3:  # the third fails the job
            h.join(a, **kw), h.join(b, **kw)
            h.advance(1.1)


def test_training_health_replays_from_any_snapshot_point() -> None:
    """Hang events, straggler notes and exclusions, crash-loop counters: a replay agrees with
    the live machine from every cut, though Progress and Stacks are never logged."""
    h = Harness(machine=Recording())
    training_history(h)
    job = h.machine.jobs["job"]
    kinds = {e.kind.value for e in job.history}
    assert {"hang", "straggler", "excluded", "crash_loop", "failed"} <= kinds, kinds
    assert job.fail_code == "crash_loop" and "node3" in job.excluded
    replays_from_every_cut(h.machine.records, h.machine)


def test_snapshot_round_trips_and_rejects_what_it_does_not_know() -> None:
    h = Harness()
    busy_history(h)
    d = state_image.dump(h.machine)
    assert state_image.dump(state_image.load(d)) == d
    with pytest.raises(state_image.StateImageError, match="version"):
        state_image.load({**d, "version": 99})
    with pytest.raises(state_image.StateImageError, match="bad snapshot"):
        state_image.load({**d, "jobs": [{"id": "x"}]})


def test_progress_refused_before_a_join_is_logged_and_replays() -> None:
    """Progress and Stacks are volatile and not logged, but one from a connection that has not
    joined is refused: the dropped connection is state, and the log keeps it (found by the
    model test, test_model.py)."""
    h = Harness(machine=Recording())
    a, b = h.connect(), h.connect()
    h.send(a, Progress(round=0, min_step=0, max_step=0))
    h.send(b, Stacks(round=0, ranks=(0,), steps=(0,), phases=("",), silent_s=(0.0,), stacks=("f",)))
    assert a in h.closed and b in h.closed and not h.machine.conns
    assert state(replayed(h.machine.records)) == state(h.machine)


def test_a_tick_that_ends_the_resume_window_and_drops_a_silent_spare_replays() -> None:
    """One tick: a member not back after a restart is lost, and a spare that went silent is
    swept. The log keeps the sweep's drop as a disconnection after the tick, so the live tick
    must sweep last too, or the spare takes the lost member's place in one and not the other
    (found by the model test, test_model.py)."""
    h = Harness(machine=Recording())
    kw = dict(min_nodes=1, max_nodes=1, heartbeat_timeout=30.0)
    h.join(node="n0", **kw)  # a round at once (the job is full)
    h._apply(h.machine.handle(Restarted(), h.now))  # n0 is away, for 60 s
    spare = h.join(node="n1", **kw)
    h.advance(29.0)
    h.machine.heartbeat(spare, h.now)  # its last word: silent for over 30 s at t=60
    h.advance(31.0)
    assert spare in h.closed and "job" not in h.machine.jobs
    assert state(replayed(h.machine.records)) == state(h.machine)


def test_ignored_messages_are_not_logged_and_replay_stays_exact() -> None:
    h = Harness(machine=Recording())
    busy_history(h)
    m = h.machine
    a = next(c.id for c in m.conns.values() if c.job_id == "job")
    rnd = m.jobs["job"].round
    n = len(m.records)
    # Stale frames a member may repeat without end: each changes nothing.
    for _ in range(50):
        h.send(a, WorkersSucceeded(round=rnd + 7))
        h.send(a, WorkersFailed(round=rnd + 7, failure=failure(rank=0, node="node1")))
    assert len(m.records) == n
    assert state(replayed(m.records)) == state(m)


def test_the_state_log_writes_nothing_for_ignored_frames(tmp_path: Path) -> None:
    log, _, _ = StateLog.open(tmp_path)
    h = Harness()
    drive(log, h)
    a, _ = h.join(), h.join()
    assert h.last(a, Assignment) is not None
    seq, size = log.seq, (tmp_path / LOG_NAME).stat().st_size
    for _ in range(200):
        h.send(a, WorkersSucceeded(round=9))
    assert (log.seq, (tmp_path / LOG_NAME).stat().st_size) == (seq, size)
    log.close()


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
    found = wal.scan(data, FILE_HEADER.size)
    assert not found.torn
    return found.good_end - len(found.records[-1]) - wal.RECORD_HEADER.size


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


@pytest.mark.parametrize("name", [wal.LOCK_NAME, LOG_NAME, journal.SNAP_NAME])
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


# --- growth: compaction by size, a streamed replay, a nearly full disk -----------------------


def test_the_log_is_compacted_when_it_outgrows_the_snapshot(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", 4096)
    log, _, _ = StateLog.open(tmp_path)  # by count only every 50,000 records
    h = Harness()
    drive(log, h)
    kw = dict(min_nodes=1, max_nodes=1, max_restarts=10_000)
    a = h.join(**kw)
    for r in range(60):  # fail, restart, rejoin: real changes, each logged
        h.send(a, WorkersFailed(round=r, failure=failure(rank=0, node="node1")))
        h.join(a, **kw)
    snap = (tmp_path / journal.SNAP_NAME).stat().st_size
    assert snap > 0 and log.seq < 1000
    # Never more than the larger of the floor and 4 snapshots (plus the record that crossed it).
    assert (tmp_path / LOG_NAME).stat().st_size < max(4096, journal.COMPACT_RATIO * snap) + 2048
    before = state(log.machine)
    log.close()
    log2, _, _ = StateLog.open(tmp_path)
    try:
        assert log2.machine.jobs["job"].round == before["jobs"][0]["round"] == 60
    finally:
        log2.close()


REPLAY_RSS = """
import sys, time
from pathlib import Path
from rdzv_server import journal
import rdzv_server.machine.state

def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))

base = hwm()
log, found, _ = journal.StateLog.open(Path(sys.argv[1]), fsync=False, snapshot_every=10**9)
print(found.replayed, hwm() - base)
"""


def test_replay_reads_the_log_a_record_at_a_time(tmp_path: Path) -> None:
    """Restarting on a 32 MiB log must not need the file (or a list of its records) in memory."""
    import subprocess
    import sys
    import time

    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    pairs = 15_000
    with open(d / LOG_NAME, "wb") as f:
        f.write(FILE_HEADER.pack(wal.LOG_MAGIC, 0))
        w = time.time()
        for i in range(pairs):  # a connection that comes and goes: replays to no state at all
            for rec in (
                {"k": "connected", "conn": i + 1, "peer": "p" * 2000},
                {"k": "disconnected", "conn": i + 1, "why": "x"},
            ):
                rec["t"], rec["w"] = 1.0 + i, w
                f.write(wal.frame(msgpack.packb(rec, use_bin_type=True)))
    size = (d / LOG_NAME).stat().st_size
    assert size > 30 << 20
    out = subprocess.run(
        [sys.executable, "-c", REPLAY_RSS, str(d)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    replayed, grew_kb = int(out[0]), int(out[1])
    assert replayed == 2 * pairs
    # Reading it whole cost twice the file (+64 MiB); streamed, a few MiB of buffers.
    assert grew_kb < 8 * 1024, f"replaying a {size >> 20} MiB log grew the peak RSS by {grew_kb} kB"


class FakeStatvfs:
    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path: object) -> Any:
        return type("st", (), {"f_bavail": self.free // 4096, "f_frsize": 4096})()


def test_a_nearly_full_disk_refuses_new_nodes_and_serves_running_jobs(tmp_path: Path, monkeypatch) -> None:
    disk = FakeStatvfs(1 << 30)
    monkeypatch.setattr(journal.os, "statvfs", disk)
    log, _, _ = StateLog.open(tmp_path, min_free=64 << 20)
    h = Harness()
    drive(log, h)
    a, _ = h.join(), h.join()
    assert h.last(a, Assignment) is not None and not log.machine.refuse_joins
    disk.free = 10 << 20
    log.check_space(force=True)
    text = log.machine.refuse_joins
    assert (
        text.startswith("the server's state disk is nearly full (10.0 MiB free in ") and str(tmp_path) in text
    )
    assert text.endswith("no new nodes until space is freed")
    newcomer = h.join(job="other")
    assert newcomer in h.closed  # refused, with the text
    err = h.inbox[newcomer][-1]
    assert err.code == "server_busy" and err.message == text
    h.send(a, WorkersSucceeded(round=0))  # the running job goes on
    assert log.machine.jobs["job"].members["node1"].state.value == "succeeded"
    # The refusal is logged as the disconnection it caused: replay (no disk check) agrees.
    log.sync()
    copy = Rendezvous(None, expire_silent=False)
    journal.replay_log(tmp_path / LOG_NAME, copy, 0)
    assert "other" not in copy.jobs
    disk.free = 1 << 30
    log.check_space(force=True)
    assert log.machine.refuse_joins == ""
    c = h.join(job="other", min_nodes=1, max_nodes=1)
    assert h.last(c, Assignment) is not None
    log.close()


# --- one entry point, one table -------------------------------------------------------------


def test_the_operators_and_the_servers_own_inputs_are_events_logged_like_any_other() -> None:
    h = Harness(machine=Recording())
    busy_history(h)
    m = h.machine
    kinds = [r["k"] for r in m.records]
    assert kinds.count("drain") == 1  # busy_history drains node1 once, through handle
    h._apply(m.handle(ShuttingDown("SIGTERM"), h.now))
    assert m.records[-1]["k"] == "going_away" and m.draining
    assert state(replayed(m.records)) == state(m)


def test_a_drain_of_what_does_not_exist_is_not_found_and_not_logged() -> None:
    h = Harness(machine=Recording())
    h.join(), h.join()
    n = len(h.machine.records)
    for event, text in [
        (DrainRequested("nojob", "node1"), "no job 'nojob'"),
        (DrainRequested("job", "nonode"), "job 'job' has no node 'nonode'"),
    ]:
        assert h.machine.handle(event, h.now) == [NotFound(text)]
    assert len(h.machine.records) == n
    with pytest.raises(KeyError, match="no job"):  # the service's call form, for the HTTP API's 404
        RendezvousService().drain("nojob", "node1")


def test_each_record_kind_reads_back_as_the_event_it_was_written_from() -> None:
    events = [
        Connected(3, "10.0.0.1:5"),
        Disconnected(3, "connection lost"),
        DrainRequested("job", "node1", "scale down"),
        ShuttingDown("SIGTERM"),
        Restarted(),
    ]
    assert {type(e) for e in events} | {Received, Tick} == {row.event for row in journal.RECORDS.values()}
    for event in events:
        rec = event_record(event, [])
        assert rec is not None and journal.RECORDS[rec["k"]].read(rec) == [event]


def test_record_kinds_of_older_servers_still_replay() -> None:
    """Drains, shutdowns and restarts were appended as ad-hoc records before they were events;
    a state log written then must replay to the state the events give now."""
    h = Harness(machine=Recording())
    a, _ = h.join(), h.join()
    assert h.last(a, Assignment) is not None
    old = [
        {"k": "drain", "job": "job", "node": "node1", "why": "scale down"},
        {"k": "drain", "job": "nojob", "node": "x", "why": ""},  # a no-op, never an error
        {"k": "going_away", "why": "SIGTERM"},
        {"k": "recover"},
    ]
    m = replayed([*h.machine.records, *({**r, "t": h.now, "w": 0.0} for r in old)])
    for event in (DrainRequested("job", "node1", "scale down"), ShuttingDown("SIGTERM"), Restarted()):
        h._apply(h.machine.handle(event, h.now))
    assert state(m) == state(h.machine)
    assert any(e.kind.value == "drain" for e in m.jobs["job"].history)
    with pytest.raises(StateLogError, match="unknown record kind"):
        apply_record(m, {"k": "newer", "t": 1.0, "w": 0.0})


def test_the_state_log_reads_only_the_clocks_it_is_given(tmp_path: Path) -> None:
    mono, wall = [100.0], [5_000.0]
    log, _, _ = StateLog.open(tmp_path, monotonic=lambda: mono[0], wall=lambda: wall[0], fsync=False)
    assert log.clock() == 100.0
    h = Harness()
    drive(log, h)
    h.now = log.clock()
    h.join()
    log.compact()
    log.close()
    body = msgpack.unpackb(wal.scan((tmp_path / "state.snap").read_bytes(), FILE_HEADER.size).records[0])
    assert (body["t"], body["w"]) == (100.0, 5_000.0)
    # Restarted 60 s later (wall) on a monotonic clock that began again: the machine's clock
    # goes on from where it was, plus the downtime.
    mono[0], wall[0] = 7.0, 5_060.0
    log2, _, _ = StateLog.open(tmp_path, monotonic=lambda: mono[0], wall=lambda: wall[0], fsync=False)
    assert log2.clock() == 160.0
    mono[0] += 2.5
    assert log2.clock() == 162.5
    log2.close()
