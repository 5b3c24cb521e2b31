"""The state image: the rendezvous machine's state as plain, versioned data, which the state
log's snapshots hold (``journal.py``). Not the training snapshots (``node_agent/snapshots/``,
``machine/restore_rules.py``).

``dump(machine)`` gives nested dicts, lists, strings and numbers that msgpack can carry;
``load(data)`` builds an equal machine from them. Every field is named here on purpose
(never pickle, never ``asdict``): a change to the machine's state shows up as a change to
this file, with ``VERSION`` bumped when the format changes; every version in ``READS`` still
loads. A field added since is read with its default when missing (``Member.node_rank``,
``Job.ranks_noted``, ``Member.node_secret``, ``Job.failures_total``; issue 19's job settings
``straggler_threshold``, ``exclude_stragglers``, ``crash_loop_restarts``, the counters
``Job.best_step``, ``Job.stuck_restarts``, ``Job.fail_code``, ``Job.hang_round``; issue 20's
``commit_timeout``, ``commit_steps`` and ``Job.commit``, a commit point under way;
``Job.hang_verdict``, a hang's failure waiting for every node's stacks; issue 47's
``Job.goodput``, the logged part of where the job's time went (an image without it is
adopted: ``machine/goodput.py``); and the
history's typed fields ``ranks``, ``step``, ``phase``, ``silent_s``, ``scores``,
``restarts``), so snapshots of every age load; such additions keep the version at 2. A
job's training progress and latest hang report are volatile (``machine/progress.py``): not kept.

Versions: 1 kept each history event as ``[time, kind, text]``; 2 (typed history) adds the
event's typed fields, ``[time, kind, text, {field: value}]`` (only those not empty). A
version 1 event gets the typed fields its sentence states without doubt (``_V1Facts``: a
join's node, address and nproc; a departure's node; a round's number; which failure a failure
event reports), by a few bounded splits, never a regular expression; a field it cannot tell
for sure stays empty (a ``lost`` node's kind of departure, an id that is not exactly one
known id).

Loading applies the machine's bounds (``machine/jobs.py``) to what an older server kept without
them: a job's failures (the first, the last few and a count), its history texts, exclusions
and entrypoint.

What is kept: connections (a member is bound to one; after a restart they become AWAY),
jobs (settings, members, spares, rank order, round, restart count, exclusions, failures,
history, deadlines), the recently forgotten jobs and the counters behind /metrics. What is
not: the heartbeat sweep's next time (sweeping is re-armed when agents come back) and the
token table (configuration, from the command line).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, replace
from typing import Any

from protocol import Failure
from protocol.errors import InvalidField, ProtocolError
from protocol.failure_text import describe_failure
from protocol.messages import MAX_ADDR_LEN, MAX_CODE_LEN, MAX_ID_LEN, MAX_PHASE_LEN, clip_text

from .machine import goodput
from .machine.history import Departure, EventKind, JobEvent
from .machine.jobs import REASON_LEN, Commit, HangVerdict
from .machine.state import (
    FAILURE_PATH_LEN,
    FAILURE_TEXT_LEN,
    Conn,
    ConnPhase,
    Job,
    JobPhase,
    JobSettings,
    Member,
    MemberState,
    Rendezvous,
    Stats,
    entrypoint_key,
    escape,
)
from .status import failure_numbers  # the numbers Job.add_failure keeps failures under

FORMAT = "rdzv-server state"
VERSION = 2
READS = (1, 2)  # the versions load() reads


class StateImageError(Exception):
    """A snapshot that cannot be read: not ours, a version we do not know, or a bad field."""


# --- dump ---------------------------------------------------------------------------------


def dump(machine: Rendezvous) -> dict[str, Any]:
    s = machine.stats
    return {
        "format": FORMAT,
        "version": VERSION,
        "conns": [_dump_conn(c) for c in machine.conns.values()],
        "jobs": [_dump_job(j) for j in machine.jobs.values()],
        "finished_jobs": [_dump_job(j) for j in machine.finished_jobs],
        "stats": {
            "jobs_created": s.jobs_created,
            "jobs_finished": s.jobs_finished,
            "jobs_failed": s.jobs_failed,
            "rounds_started": s.rounds_started,
            "rounds_completed": s.rounds_completed,
            "restarts": s.restarts,
            "failures": dict(s.failures),
            "latency_buckets": list(s.latency_buckets),
            "latency_sum": s.latency_sum,
            "latency_count": s.latency_count,
        },
        "resume_deadline": machine.resume_deadline,
        "draining": machine.draining,
    }


def _dump_conn(c: Conn) -> dict[str, Any]:
    # The challenge is not kept: a restored connection never joins again.
    return {
        "id": c.id,
        "peer": c.peer,
        "phase": c.phase.value,
        "last_seen": c.last_seen,
        "job_id": c.job_id,
        "node_id": c.node_id,
        "local": c.local,
    }


def _dump_member(m: Member) -> dict[str, Any]:
    return {
        "node_id": m.node_id,
        "conn": m.conn,
        "addr": m.addr,
        "nproc": m.nproc,
        "master_port": m.master_port,
        "seq": m.seq,
        "joined_at": m.joined_at,
        "state": m.state.value,
        "failures": m.failures,
        "node_rank": m.node_rank,
        "node_secret": m.node_secret,  # the state dir is private (only the server reads it)
        "hosts_store": m.hosts_store,
        "replica_port": m.replica_port,
        "replica_key": m.replica_key,  # private, as node_secret
        "replica_cert": m.replica_cert,
        "durable_world": m.durable_world,
        "durable_steps": list(m.durable_steps),
        "standby_port": m.standby_port,
    }


def _dump_job(j: Job) -> dict[str, Any]:
    return {
        "id": j.id,
        "settings": j.settings.to_dict(),
        "phase": j.phase.value,
        "round": j.round,
        "restart_count": j.restart_count,
        "members": [_dump_member(m) for m in j.members.values()],
        "spares": [_dump_member(m) for m in j.spares.values()],
        "order": list(j.order),
        "last_call_deadline": j.last_call_deadline,
        "failures": [asdict(f) for f in j.failures],  # Failure(**d) loads it back, validated
        "failures_total": j.failures_total,
        "next_seq": j.next_seq,
        "created_at": j.created_at,
        "gathering_since": j.gathering_since,
        "running_since": j.running_since,
        "rounds_completed": j.rounds_completed,
        "outcome": j.outcome,
        "excluded": [[nid, why] for nid, why in j.excluded.items()],
        "history": [_dump_event(e) for e in j.history],
        "resume_expect": None if j.resume_expect is None else list(j.resume_expect),
        "resume_slots": [[rank, nid] for rank, nid in j.resume_slots.items()],
        "ranks_noted": j.ranks_noted,
        "best_step": j.best_step,
        "stuck_restarts": j.stuck_restarts,
        "fail_code": j.fail_code,
        "hang_round": j.hang_round,
        "commit": None if j.commit is None else _dump_commit(j.commit),
        "hang_verdict": None if j.hang_verdict is None else _dump_hang_verdict(j.hang_verdict),
        # The running round's ranks (issue 42: whose snapshot claims are believed) and its
        # restore step; absent before: unknown until the next round.
        "world_size": j.world_size,
        "round_spans": [[nid, r.start, r.stop] for nid, r in j.round_spans.items()],
        "restore_step": j.restore_step,
        # Where the job's time went (issue 47): absent before, then adopted (goodput.adopted).
        "goodput": goodput.dump(j.goodput),
    }


def _dump_hang_verdict(v: HangVerdict) -> dict[str, Any]:
    return {
        "round": v.round,
        "node": v.node,
        "failure": asdict(v.failure),
        "step": v.step,
        "deadline": v.deadline,
    }


def _load_hang_verdict(d: dict[str, Any]) -> HangVerdict:
    return HangVerdict(
        round=_int(d["round"]),
        node=str(d["node"]),
        failure=_load_failure(d["failure"]),
        step=_int(d["step"]),
        deadline=float(d["deadline"]),
    )


def _dump_commit(c: Commit) -> dict[str, Any]:
    return {
        "round": c.round,
        "step": c.step,
        "reason": c.reason,
        "deadline": c.deadline,
        "started_at": c.started_at,
        "arms": c.arms,
        "go": c.go,
        "drains": list(c.drains),
        "armed": sorted(c.armed),
        "committed": sorted(c.committed),  # read by servers from before "stopped"
        "stopped": dict(c.stopped),
    }


def _load_commit(d: dict[str, Any]) -> Commit:
    return Commit(
        round=_int(d["round"]),
        step=_int(d["step"]),
        reason=str(d["reason"])[:REASON_LEN],
        deadline=float(d["deadline"]),
        started_at=float(d["started_at"]),
        arms=_int(d["arms"]),
        go=bool(d["go"]),
        drains=[str(x) for x in d["drains"]],
        armed={str(x) for x in d["armed"]},
        # An older snapshot names the nodes that stopped, at the step asked for.
        stopped={str(k): _int(v) for k, v in d["stopped"].items()}
        if isinstance(d.get("stopped"), dict)
        else dict.fromkeys((str(x) for x in d["committed"]), _int(d["step"])),
    )


def _dump_event(e: JobEvent) -> list[Any]:
    fields: dict[str, Any] = {}
    if e.node:
        fields["node"] = e.node
    if e.addr:
        fields["addr"] = e.addr
    if e.nproc is not None:
        fields["nproc"] = e.nproc
    if e.round is not None:
        fields["round"] = e.round
    if e.departure is not None:
        fields["departure"] = e.departure.value
    if e.spare:
        fields["spare"] = True
    if e.failure_no:
        fields["failure_no"] = e.failure_no
    if e.ranks:
        fields["ranks"] = list(e.ranks)
    if e.step is not None:
        fields["step"] = e.step
    if e.phase:
        fields["phase"] = e.phase
    if e.silent_s is not None:
        fields["silent_s"] = e.silent_s
    if e.scores:
        fields["scores"] = list(e.scores)
    if e.restarts:
        fields["restarts"] = e.restarts
    return [e.time, e.kind.value, e.text, fields]


# --- load ---------------------------------------------------------------------------------


def load(data: Any, machine: Rendezvous | None = None) -> Rendezvous:
    """Fill ``machine`` (a fresh one by default) from ``dump``'s output; StateImageError if bad."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StateImageError("not a rdzv-server state snapshot")
    if data.get("version") not in READS:
        raise StateImageError(
            f"snapshot version {data.get('version')!r}; this server reads versions "
            + ", ".join(map(str, READS))
        )
    m = machine if machine is not None else Rendezvous()
    try:
        m.conns = {c.id: c for c in map(_load_conn, data["conns"])}
        m.jobs = {j.id: j for j in map(_load_job, data["jobs"])}
        m.finished_jobs.clear()
        m.finished_jobs.extend(_load_job(j) for j in data["finished_jobs"])
        s = data["stats"]
        m.stats = Stats(
            jobs_created=_int(s["jobs_created"]),
            jobs_finished=_int(s["jobs_finished"]),
            jobs_failed=_int(s["jobs_failed"]),
            rounds_started=_int(s["rounds_started"]),
            rounds_completed=_int(s["rounds_completed"]),
            restarts=_int(s["restarts"]),
            failures=Counter({str(k): _int(v) for k, v in s["failures"].items()}),
            latency_buckets=[_int(x) for x in s["latency_buckets"]],
            latency_sum=float(s["latency_sum"]),
            latency_count=_int(s["latency_count"]),
        )
        m.resume_deadline = _opt_float(data["resume_deadline"])
        m.draining = bool(data["draining"])
    except (KeyError, TypeError, ValueError, AttributeError, ProtocolError) as exc:
        raise StateImageError(f"bad snapshot: {type(exc).__name__}: {exc}") from None
    return m


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an int, got {type(v).__name__}")
    return v


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _load_conn(d: dict[str, Any]) -> Conn:
    return Conn(
        id=_int(d["id"]),
        peer=str(d["peer"]),
        phase=ConnPhase(d["phase"]),
        last_seen=float(d["last_seen"]),
        job_id=_opt_str(d["job_id"]),
        node_id=_opt_str(d["node_id"]),
        local=str(d.get("local", "")),  # absent before issue 33
    )


def _load_member(d: dict[str, Any]) -> Member:
    return Member(
        node_id=str(d["node_id"]),
        conn=_int(d["conn"]),
        addr=str(d["addr"]),
        nproc=_int(d["nproc"]),
        master_port=_int(d["master_port"]),
        seq=_int(d["seq"]),
        joined_at=float(d["joined_at"]),
        state=MemberState(d["state"]),
        failures=_int(d["failures"]),
        node_rank=_int(d.get("node_rank", -1)),  # absent from snapshots before node ranks
        node_secret=str(d.get("node_secret", "")),  # absent before node secrets
        hosts_store=d.get("hosts_store", False) is True,  # absent before agent stores
        replica_port=_int(d.get("replica_port", 0)),  # absent before snapshots (issue 35)
        replica_key=str(d.get("replica_key", "")),
        replica_cert=str(d.get("replica_cert", "")),
        durable_world=_int(d.get("durable_world", -1)),  # absent before --snapshot-dir
        durable_steps=tuple(_int(x) for x in d.get("durable_steps", ())),
        standby_port=_int(d.get("standby_port", 0)),  # absent before standbys (issue 45)
    )


def _load_job(d: dict[str, Any]) -> Job:
    s = d["settings"]
    job = Job(
        id=str(d["id"]),
        settings=JobSettings(
            min_nodes=_int(s["min_nodes"]),
            max_nodes=_int(s["max_nodes"]),
            entrypoint=entrypoint_key(str(s["entrypoint"])),  # older servers kept it whole
            max_restarts=_int(s["max_restarts"]),
            last_call_timeout=float(s["last_call_timeout"]),
            heartbeat_timeout=float(s["heartbeat_timeout"]),
            exclude_after=_int(s["exclude_after"]),
            # Absent from snapshots before issue 19: the defaults of Join.
            straggler_threshold=float(s.get("straggler_threshold", 0.75)),
            exclude_stragglers=bool(s.get("exclude_stragglers", False)),
            crash_loop_restarts=_int(s.get("crash_loop_restarts", 3)),
            # Absent before issue 20: the defaults of Join.
            commit_timeout=float(s.get("commit_timeout", 300.0)),
            commit_steps=_int(s.get("commit_steps", 0)),
        ),
        phase=JobPhase(d["phase"]),
        round=_int(d["round"]),
        restart_count=_int(d["restart_count"]),
        members={m.node_id: m for m in map(_load_member, d["members"])},
        spares={m.node_id: m for m in map(_load_member, d["spares"])},
        order=[str(x) for x in d["order"]],
        last_call_deadline=_opt_float(d["last_call_deadline"]),
        next_seq=_int(d["next_seq"]),
        created_at=float(d["created_at"]),
        gathering_since=float(d["gathering_since"]),
        running_since=float(d.get("running_since", 0.0)),
        rounds_completed=_int(d["rounds_completed"]),
        outcome=str(d["outcome"]),
        resume_slots={_int(rank): str(nid) for rank, nid in d["resume_slots"]},
        ranks_noted=bool(d.get("ranks_noted", False)),
        best_step=_int(d.get("best_step", -1)),  # absent before crash loops were counted
        stuck_restarts=_int(d.get("stuck_restarts", 0)),
        fail_code=str(d.get("fail_code", ""))[:MAX_CODE_LEN],
        hang_round=_int(d.get("hang_round", -1)),
        commit=None if d.get("commit") is None else _load_commit(d["commit"]),
        hang_verdict=None if d.get("hang_verdict") is None else _load_hang_verdict(d["hang_verdict"]),
        world_size=_int(d.get("world_size", 0)),
        restore_step=_int(d.get("restore_step", -1)),
    )
    for nid, start, stop in d.get("round_spans", ()):
        if 0 <= _int(start) <= _int(stop) <= job.world_size:
            job.round_spans[str(nid)] = range(_int(start), _int(stop))
    failures = [_load_failure(f) for f in d["failures"]]
    for f in failures:
        job.add_failure(f)  # an older server kept them all: keep the first and the last few
    job.failures_total = max(_int(d.get("failures_total", 0)), len(failures))
    for nid, why in d["excluded"]:
        job.exclude(str(nid), str(why))
    v1: _V1Facts | None = None
    for e in d["history"]:
        event = _load_event(e)
        if len(e) == 3:  # version 1: no typed fields, only the sentence
            v1 = v1 or _V1Facts(job)
            event = v1.recover(event)
        job.record(event)
    g = d.get("goodput")
    job.goodput = goodput.load(g) if g is not None else goodput.adopted(job)
    expect = d["resume_expect"]
    if expect is not None:
        r, n, world, addr, port = expect
        job.resume_expect = (_int(r), _int(n), _int(world), str(addr), _int(port))
    return job


def _load_event(e: list[Any]) -> JobEvent:
    """``[time, kind, text]`` (version 1) or ``[time, kind, text, fields]`` (version 2)."""
    t, kind, text, *more = e
    if len(more) > 1:
        raise ValueError(f"a history event of {len(e)} items")
    f: dict[str, Any] = more[0] if more else {}
    departure, nproc, rnd = f.get("departure"), f.get("nproc"), f.get("round")
    step, silent = f.get("step"), f.get("silent_s")
    return JobEvent(
        float(t),
        EventKind(kind),
        str(text),
        node=str(f.get("node", ""))[:MAX_ID_LEN],
        addr=str(f.get("addr", ""))[:MAX_ADDR_LEN],
        nproc=None if nproc is None else _int(nproc),
        round=None if rnd is None else _int(rnd),
        departure=None if departure is None else Departure(departure),
        spare=bool(f.get("spare", False)),
        failure_no=_int(f.get("failure_no", 0)),
        ranks=tuple(_int(r) for r in f.get("ranks", ())),
        step=None if step is None else _int(step),
        phase=str(f.get("phase", ""))[:MAX_PHASE_LEN],
        silent_s=None if silent is None else float(silent),
        scores=tuple(float(x) for x in f.get("scores", ())),
        restarts=_int(f.get("restarts", 0)),
    )


class _V1Facts:
    """The typed fields a version 1 event's sentence states without doubt, for the status API.

    Version 1's sentences (fixed by that server) begin ``node ID (ADDR, nproc N) joined (...)``
    (joins), ``node ID ...`` or ``spare ID ...`` (departures, spares, drains, resumes) and
    ``round N ...`` (rounds, worker failures); a failure's sentence holds its description. Ids and
    addresses may hold spaces and parentheses, so an id is taken only when the text's prefix is
    exactly one known id (the job's members, spares, rank order, exclusions, failures, and the
    joins before it), and a join's id and address only when one `` (`` separates them. No
    regular expression: a few splits and set lookups over at most 512 characters an event.
    """

    def __init__(self, job: Job) -> None:
        self.ids = {*job.members, *job.spares, *job.order, *job.excluded, *(f.node_id for f in job.failures)}
        self.failures = [
            (describe_failure(f), n) for f, n in zip(job.failures, failure_numbers(job), strict=True)
        ]

    def recover(self, e: JobEvent) -> JobEvent:
        if e.kind is EventKind.JOINED:
            return self._node_and_addr(e, ") joined (")
        if e.kind is EventKind.SPARE and e.text.endswith(") waits as a spare"):
            return self._node_and_addr(e, ") waits as a spare")
        if e.kind in (EventKind.ROUND, EventKind.FAILURE):
            digits = e.text[len("round ") : len("round ") + 20].partition(" ")[0].rstrip(":")
            rnd = int(digits) if e.text.startswith("round ") and digits.isdecimal() else None
            number = (
                next((n for text, n in self.failures if text in e.text), 0)
                if e.kind is EventKind.FAILURE
                else 0
            )
            return replace(e, round=rnd, failure_no=number)
        if e.kind in _V1_ABOUT_A_NODE:
            spare = e.text.startswith("spare ")
            node = self._known_id(e.text, "spare " if spare else "node ")
            departure = _V1_DEPARTURES.get(e.kind)
            return replace(
                e, node=node, spare=spare and departure is not None, departure=departure if node else None
            )
        return e

    def _known_id(self, text: str, prefix: str) -> str:
        """The one known id that ``text`` names right after ``prefix`` (then a space); else ""."""
        if not text.startswith(prefix):
            return ""
        head = text[len(prefix) : len(prefix) + MAX_ID_LEN + 1]
        found = [head[:i] for i, ch in enumerate(head) if ch == " " and head[:i] in self.ids]
        return found[0] if len(found) == 1 else ""

    def _node_and_addr(self, e: JobEvent, end: str) -> JobEvent:
        # "node ID (ADDR, nproc N) joined (K of RANGE)", "node ID (ADDR) waits as a spare": the
        # last ``end`` and ", nproc " are the sentence's own (the server's text follows them);
        # then exactly one " (" must remain between the id and the address.
        head, sep, tail = e.text.rpartition(end)
        nproc = None
        if e.kind is EventKind.JOINED:
            head, sep2, digits = head.rpartition(", nproc ")
            if not (sep2 and tail.endswith(")") and digits.isdecimal()):
                return e
            nproc = int(digits[:9])
        if not (sep and head.startswith("node ")):
            return e
        node, sep, addr = head[len("node ") :].partition(" (")
        if not sep or " (" in addr or not node or len(node) > MAX_ID_LEN or len(addr) > MAX_ADDR_LEN:
            return e
        self.ids.add(node)
        return replace(e, node=node, addr=addr, nproc=nproc)


# The v1 kinds whose sentence begins with the node's id, and the departure each one was.
_V1_ABOUT_A_NODE = {
    EventKind.LOST,
    EventKind.LEFT,
    EventKind.EXCLUDED,
    EventKind.SPARE,
    EventKind.DRAIN,
    EventKind.RESUMED,
}
# A v1 "lost" is not told apart (connection, silence, refused, not back, stale): left empty.
_V1_DEPARTURES = {EventKind.LEFT: Departure.LEFT, EventKind.EXCLUDED: Departure.EXCLUDED}


def _load_failure(d: dict[str, Any]) -> Failure:
    """The message's own validation. An older server kept messages of any length (cut now) and
    ids with control characters (escaped now, as the log shows them), so its snapshots load."""
    d = {
        **d,
        "message": clip_text(str(d.get("message", "")), FAILURE_TEXT_LEN),
        "error_file": clip_text(str(d.get("error_file", "")), FAILURE_PATH_LEN),
    }
    try:
        return Failure(**d)
    except InvalidField:
        limits = {"node_id": MAX_ID_LEN, "addr": MAX_ADDR_LEN, "signal": MAX_CODE_LEN}
        plain = {k: escape(v)[:n] for k, n in limits.items() if isinstance(v := d.get(k), str)}
        return Failure(**{**d, **plain})
