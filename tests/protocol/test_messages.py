"""Message constructors: every field's rule, the registries, versions and errors."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import typing

import pytest

from protocol import (
    CLIENT_MESSAGES,
    MAX_ADDR_LEN,
    MAX_ID_LEN,
    MAX_NODES,
    MAX_NPROC,
    MAX_TEXT_LEN,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Armed,
    Assignment,
    BadMagic,
    CollectStacks,
    Drain,
    Error,
    Failure,
    FrameTooLarge,
    GoingAway,
    HangDetected,
    Heartbeat,
    Hello,
    InvalidField,
    JobDone,
    JobFailed,
    Join,
    KeepSnapshot,
    Leave,
    LeaveAfterCommit,
    Left,
    MalformedFrame,
    Message,
    MissingField,
    Progress,
    ProtocolError,
    Restart,
    Resume,
    Resumed,
    SnapshotsHeld,
    Stacks,
    Standbys,
    StopAt,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
    Waiting,
    Welcome,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
    error_message,
    negotiate_version,
)
from protocol.errors import describe
from protocol.messages import MAX_TIMEOUT, clip_text

FAILURE = {
    "node_id": "node-1",
    "addr": "10.0.0.1",
    "rank": 3,
    "local_rank": 1,
    "exitcode": -9,
    "signal": "SIGKILL",
    "timestamp": 1_700_000_000.5,
    "message": "RuntimeError: CUDA error",
    "pid": 4242,
    "error_file": "/tmp/torchelastic_x/attempt_0/1/error.json",
}

# One valid set of arguments per class; each test below breaks one field of it.
VALID: dict[type, dict[str, typing.Any]] = {
    Failure: FAILURE,
    Hello: {"versions": (1,), "software": "node-agent 0.1.0"},
    Join: {
        "job_id": "job-7",
        "node_id": "node-1",
        "addr": "10.0.0.1",
        "nproc": 8,
        "min_nodes": 2,
        "max_nodes": 4,
        "entrypoint": "train.py --lr 0.1",
        "master_port": 29500,
        "max_restarts": 3,
        "last_call_timeout": 30.0,
        "heartbeat_interval": 5.0,
        "heartbeat_timeout": 30.0,
        "spare": True,
        "exclude_after": 3,
        "proof": "ab" * 32,
        "node_rank": 3,
        "node_secret": "0f" * 16,
        "straggler_threshold": 0.5,
        "exclude_stragglers": True,
        "crash_loop_restarts": 5,
        "commit_timeout": 60.0,
        "commit_steps": 4,
        "hosts_store": True,
        "replica_port": 40123,
        "replica_key": "9e" * 32,
        "replica_cert": "5c" * 32,
        "standby_port": 29500,
        "durable_world": 16,
        "durable_steps": (40, 20),
    },
    Heartbeat: {},
    WorkersFailed: {"round": 2, "failure": Failure(**FAILURE), "step": 41, "restore_failed": 40},
    WorkersSucceeded: {"round": 2, "idle_ms": 1250.0},
    Leave: {"reason": "scale down", "workers_stopping": True},
    Welcome: {"version": 1, "software": "rdzv-server 0.1.0", "challenge": "cd" * 16},
    Waiting: {
        "job_id": "job-7",
        "round": 1,
        "joined": 1,
        "min_nodes": 2,
        "max_nodes": 4,
        "reason": "1 more",
        "spare": True,
    },
    Assignment: {
        "job_id": "job-7",
        "round": 1,
        "group_rank": 1,
        "group_world_size": 2,
        "rank_offset": 8,
        "world_size": 16,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "restart_count": 0,
        "max_restarts": 3,
        "agent_store": True,
        "restore_step": 40,
        "restore_source": (-1, 0),
        "restore_addrs": ("10.0.0.3:40123",),
        "restore_keys": ("9e" * 32,),
        "replica_to": "10.0.0.2:40123",
        "replica_key": "7a" * 32,
        "restore_durable": False,
        "restore_alt": (-1, -1),
        "restore_digests": ("", "ab" * 32),
        "restore_certs": ("5c" * 32,),
        "replica_cert": "3d" * 32,
        "replica_from": 0,
        "replica_count": 8,
        "restore_world": 0,
        "restore_ranks": (),
    },
    Restart: {"round": 3, "reason": "node-2 failed", "restart_count": 1, "report": "hang: suspect rank 3"},
    JobFailed: {
        "reason": "max restarts reached",
        "failure": Failure(**FAILURE),
        "code": "crash_loop",
        "report": "hang: suspect rank 3",
        "summary": "goodput unknown (no training progress reported) over 9 s: rendezvous 2 s",
    },
    Progress: {
        "round": 3,
        "min_step": 17,
        "max_step": 19,
        "step_p50_ms": 120.5,
        "step_p90_ms": 180.0,
        "phase": "compute",
        "age_ms": 40.0,
        "compute_ms": (80.0, 0.0),
        "checks": True,
    },
    HangDetected: {"round": 3, "ranks": (2,), "step": 20, "phase": "compute", "silent_s": 31.5},
    Stacks: {
        "round": 3,
        "ranks": (2, 3),
        "steps": (20, -1),
        "phases": ("compute", ""),
        "silent_s": (31.5, 0.0),
        "stacks": ('File "train.py", line 40 in <module>', ""),
    },
    CollectStacks: {"round": 3, "reason": "rank 2 hung"},
    Armed: {"round": 3, "step": 72, "late": True, "checked": 73},
    WorkersCommitted: {"round": 3, "step": 72},
    LeaveAfterCommit: {"round": 3, "reason": "received SIGTERM"},
    StopAt: {"round": 3, "step": 72, "state": "go", "deadline_s": 301.5},
    SnapshotsHeld: {
        "world_size": 16,
        "ranks": (8, 9, 0),
        "steps": (40, 40, 39),
        "digests": ("ab" * 32, "", "cd" * 32),
        "replicated": True,
    },
    KeepSnapshot: {"step": 40, "replicate": 41},
    JobDone: {"summary": "goodput 97.3 % over 2 h 14 min: 2 failures cost 41 s and 3 steps"},
    Drain: {"reason": "operator asked"},
    GoingAway: {"reason": "SIGTERM"},
    Left: {"job_continues": False, "reason": "this node was the last of the job"},
    Resumed: {"job_id": "job-7", "round": 1, "rebuilt": True},
    Standbys: {
        "term": 3,
        "host_node": "node-a",
        "host_in_round": True,
        "endpoints": ("10.0.0.2:29500",),
        "nodes": ("node-b",),
    },
    Error: {"code": "invalid_field", "message": "join.nproc: bad", "field": "join.nproc", "fatal": False},
}


VALID[Resume] = {
    "join": Join(**VALID[Join]),
    "assignment": Assignment(**{**VALID[Assignment], "restore_digests": ()}),
    "succeeded": True,
}


def path_of(cls: type) -> str:
    return "failure" if cls is Failure else cls.TYPE


def build(cls: type, **changes: typing.Any) -> typing.Any:
    return cls(**{**VALID[cls], **changes})


def assert_invalid(
    cls: type, name: str, value: typing.Any, *, blamed: str | None = None, **others: typing.Any
):
    with pytest.raises(InvalidField) as info:
        build(cls, **{name: value}, **others)
    path = f"{path_of(cls)}.{blamed or name}"
    assert info.value.code == "invalid_field"
    assert info.value.field == path
    assert str(info.value).startswith(f"{path}: ")
    return info.value


def fields_of_kind(kind: type) -> list[tuple[type, str]]:
    # The field's kind comes from the valid sample, not from the code under test.
    return [
        (cls, name) for cls, sample in VALID.items() for name, value in sample.items() if type(value) is kind
    ]


ALL_FIELDS = [(cls, f.name) for cls in VALID for f in dataclasses.fields(cls)]


def test_valid_samples_cover_every_field():
    for cls, sample in VALID.items():
        assert set(sample) == {f.name for f in dataclasses.fields(cls)}, cls


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.__name__)
def test_valid_sample_constructs(cls):
    msg = build(cls)
    for name, value in VALID[cls].items():
        assert getattr(msg, name) == value


# --- wrong types -------------------------------------------------------------


@pytest.mark.parametrize(("cls", "name"), ALL_FIELDS, ids=lambda x: getattr(x, "__name__", x))
def test_every_field_rejects_an_arbitrary_object(cls, name):
    assert_invalid(cls, name, object())


@pytest.mark.parametrize(("cls", "name"), fields_of_kind(int), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None, b"1"], ids=repr)
def test_int_fields_reject_bool_float_and_str(cls, name, bad):
    error = assert_invalid(cls, name, bad)
    assert "int" in error.reason


@pytest.mark.parametrize(("cls", "name"), fields_of_kind(float), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, -1, True, "1.0", None], ids=repr)
def test_float_fields_reject_nan_inf_negative_bool_and_str(cls, name, bad):
    assert_invalid(cls, name, bad)


@pytest.mark.parametrize(("cls", "name"), fields_of_kind(str), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [1, b"bytes", ["a"], "bad \ud800 surrogate"], ids=repr)
def test_str_fields_reject_non_text(cls, name, bad):
    assert_invalid(cls, name, bad)


@pytest.mark.parametrize(("cls", "name"), fields_of_kind(bool), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("bad", [0, 1, "true", None], ids=repr)
def test_bool_fields_reject_ints_and_str(cls, name, bad):
    assert_invalid(cls, name, bad)


# --- ranges, lengths, relations ----------------------------------------------

OUT_OF_RANGE = [
    # (class, field, value, extra valid changes, field blamed if not `field`)
    (Failure, "node_id", "", {}, None),
    (Failure, "node_id", "n" * (MAX_ID_LEN + 1), {}, None),
    (Failure, "addr", "a" * (MAX_ADDR_LEN + 1), {}, None),
    (Failure, "rank", -1, {}, None),
    (Failure, "local_rank", -1, {}, None),
    (Failure, "exitcode", 2**63, {}, None),
    (Failure, "exitcode", -(2**63) - 1, {}, None),
    (Failure, "signal", "S" * 65, {}, None),
    (Failure, "timestamp", -0.5, {}, None),
    (Failure, "timestamp", 10**400, {}, None),
    (Failure, "message", "m" * (MAX_TEXT_LEN + 1), {}, None),
    (Hello, "versions", (), {}, None),
    (Hello, "versions", (1,) * 17, {}, None),
    (Hello, "versions", (0,), {}, None),
    (Hello, "versions", (1, True), {}, None),
    (Hello, "versions", (1, "2"), {}, None),
    (Hello, "versions", "1", {}, None),
    (Hello, "versions", 1, {}, None),
    (Hello, "software", "s" * (MAX_ID_LEN + 1), {}, None),
    (Join, "job_id", "", {}, None),
    (Join, "job_id", "j" * (MAX_ID_LEN + 1), {}, None),
    (Join, "node_id", "", {}, None),
    (Join, "addr", "a" * (MAX_ADDR_LEN + 1), {}, None),
    (Join, "nproc", 0, {}, None),
    (Join, "nproc", MAX_NPROC + 1, {}, None),
    (Join, "min_nodes", 0, {}, None),
    (Join, "max_nodes", MAX_NODES + 1, {}, None),
    (Join, "min_nodes", 5, {"max_nodes": 4}, "max_nodes"),
    (Join, "entrypoint", "e" * (MAX_TEXT_LEN + 1), {}, None),
    (Join, "master_port", 0, {}, None),
    (Join, "master_port", 65536, {}, None),
    (Join, "master_port", -1, {}, None),
    (Join, "max_restarts", -1, {}, None),
    (Join, "max_restarts", 2**63, {}, None),
    (Join, "last_call_timeout", -0.001, {}, None),
    (Join, "last_call_timeout", 1e7 + 1, {}, None),
    (Join, "last_call_timeout", 10**400, {}, None),
    (Join, "heartbeat_interval", 0, {}, None),
    (Join, "heartbeat_interval", 0.0, {}, None),
    (Join, "heartbeat_timeout", 0, {}, None),
    (Join, "heartbeat_timeout", 1e8, {}, None),
    (Join, "proof", "a" * 129, {}, None),
    (Join, "node_secret", "a" * 129, {}, None),
    (WorkersFailed, "round", -1, {}, None),
    (WorkersFailed, "round", 2**63, {}, None),
    (WorkersFailed, "failure", None, {}, None),
    (WorkersFailed, "failure", FAILURE, {}, None),
    (WorkersSucceeded, "round", -1, {}, None),
    (WorkersSucceeded, "idle_ms", -1.0, {}, None),
    (WorkersSucceeded, "idle_ms", float("nan"), {}, None),
    (WorkersSucceeded, "idle_ms", MAX_TIMEOUT * 1000 + 1, {}, None),
    (Leave, "reason", None, {}, None),
    (Leave, "reason", "r" * (MAX_TEXT_LEN + 1), {}, None),
    (Leave, "workers_stopping", 1, {}, None),
    (Welcome, "version", 0, {}, None),
    (Welcome, "software", "s" * (MAX_ID_LEN + 1), {}, None),
    (Waiting, "job_id", "", {}, None),
    (Waiting, "round", -1, {}, None),
    (Waiting, "joined", -1, {}, None),
    (Waiting, "min_nodes", 0, {}, None),
    (Waiting, "max_nodes", MAX_NODES + 1, {}, None),
    (Waiting, "min_nodes", 5, {"max_nodes": 4}, "max_nodes"),
    (Waiting, "reason", "r" * (MAX_TEXT_LEN + 1), {}, None),
    (Waiting, "spare", 1, {}, None),
    (Waiting, "spare", "yes", {}, None),
    (Assignment, "job_id", "", {}, None),
    (Assignment, "round", -1, {}, None),
    (Assignment, "group_rank", -1, {}, None),
    (Assignment, "group_rank", 2, {"group_world_size": 2}, None),
    (Assignment, "group_rank", 3, {"group_world_size": 2}, None),
    (Assignment, "group_world_size", 0, {"group_rank": 0}, None),
    (Assignment, "group_world_size", MAX_NODES + 1, {}, None),
    (Assignment, "rank_offset", -1, {}, None),
    (Assignment, "rank_offset", 16, {"world_size": 16}, None),
    (Assignment, "world_size", 0, {"rank_offset": 0}, None),
    (Assignment, "master_addr", "", {}, None),
    (Assignment, "master_addr", "a" * (MAX_ADDR_LEN + 1), {}, None),
    (Assignment, "master_port", 0, {}, None),
    (Assignment, "master_port", 65536, {}, None),
    (Assignment, "restart_count", -1, {}, None),
    (Assignment, "max_restarts", -1, {}, None),
    (Restart, "round", -1, {}, None),
    (Restart, "reason", None, {}, None),
    (Restart, "restart_count", -1, {}, None),
    (JobFailed, "reason", "r" * (MAX_TEXT_LEN + 1), {}, None),
    (JobFailed, "failure", "node-1 died", {}, None),
    (JobFailed, "failure", FAILURE, {}, None),
    (Error, "code", "", {}, None),
    (Error, "code", "c" * 65, {}, None),
    (Error, "message", None, {}, None),
    (Error, "message", "m" * (MAX_TEXT_LEN + 1), {}, None),
    (Error, "field", 1, {}, None),
    (Error, "field", "f" * (MAX_ID_LEN + 1), {}, None),
]


@pytest.mark.parametrize(
    ("cls", "name", "value", "others", "blamed"),
    OUT_OF_RANGE,
    ids=[f"{c.__name__}.{n}={describe(v)}" for c, n, v, _, _ in OUT_OF_RANGE],
)
def test_out_of_range_values_are_rejected(cls, name, value, others, blamed):
    assert_invalid(cls, name, value, blamed=blamed, **others)


ON_THE_EDGE = [
    (Failure, {"exitcode": -(2**63)}),
    (Failure, {"exitcode": 2**63 - 1}),
    (Failure, {"rank": 0, "local_rank": 0, "addr": "", "signal": "", "message": ""}),
    (Failure, {"timestamp": 0}),
    (Hello, {"versions": tuple(range(1, 17))}),
    (Hello, {"software": ""}),
    (Join, {"nproc": 1}),
    (Join, {"nproc": MAX_NPROC}),
    (Join, {"min_nodes": 1, "max_nodes": 1}),
    (Join, {"min_nodes": MAX_NODES, "max_nodes": MAX_NODES}),
    (Join, {"master_port": 1}),
    (Join, {"master_port": 65535}),
    (Join, {"last_call_timeout": 0}),
    (Join, {"last_call_timeout": 1e7}),
    (Join, {"heartbeat_interval": 1e-9, "heartbeat_timeout": 1e7}),
    (Join, {"max_restarts": 2**63 - 1}),
    (Join, {"addr": "", "entrypoint": ""}),
    (Join, {"job_id": "j" * MAX_ID_LEN, "node_id": "\N{SNOWMAN}" * MAX_ID_LEN}),
    (Join, {"entrypoint": "e" * MAX_TEXT_LEN}),
    (Waiting, {"joined": 0, "round": 0, "reason": ""}),
    (Assignment, {"group_rank": 0, "group_world_size": 1, "rank_offset": 0, "world_size": 1}),
    (Assignment, {"group_rank": MAX_NODES - 1, "group_world_size": MAX_NODES}),
    (Error, {"field": None, "code": "c" * 64}),
]


@pytest.mark.parametrize(("cls", "changes"), ON_THE_EDGE, ids=lambda x: getattr(x, "__name__", None))
def test_values_on_the_edge_are_accepted(cls, changes):
    msg = build(cls, **changes)
    for name, value in changes.items():
        assert getattr(msg, name) == value


# --- coercion, defaults, dataclass shape -------------------------------------


def test_ints_in_float_fields_become_floats():
    join = build(Join, last_call_timeout=0, heartbeat_interval=5, heartbeat_timeout=30)
    assert (join.last_call_timeout, join.heartbeat_interval, join.heartbeat_timeout) == (0.0, 5.0, 30.0)
    assert all(type(v) is float for v in (join.last_call_timeout, join.heartbeat_interval))
    assert type(build(Failure, timestamp=1_700_000_000).timestamp) is float


def test_lists_in_tuple_fields_become_tuples():
    hello = build(Hello, versions=[1, 2])
    assert hello.versions == (1, 2)
    assert type(hello.versions) is tuple
    hash(hello)  # a list would have made it unhashable


def test_defaults():
    assert Leave().reason == "" and Leave().workers_stopping is False
    assert Join(**{k: v for k, v in VALID[Join].items() if k != "spare"}).spare is False
    assert JobFailed(reason="x").failure is None
    error = Error(code="bad_magic", message="no")
    assert (error.field, error.fatal) == (None, True)
    optional = ("signal", "message", "pid", "error_file")
    failure = Failure(**{k: v for k, v in FAILURE.items() if k not in optional})
    assert (failure.signal, failure.message) == ("", "")
    assert Waiting(**{k: v for k, v in VALID[Waiting].items() if k != "reason"}).reason == ""
    # An older server sends no "spare": the node then waits for its round, not as a spare.
    assert Waiting(**{k: v for k, v in VALID[Waiting].items() if k != "spare"}).spare is False


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.__name__)
def test_messages_are_frozen_slotted_and_keyword_only(cls):
    msg = build(cls)
    assert msg == build(cls)
    assert hash(msg) == hash(build(cls))
    assert not hasattr(msg, "__dict__")
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, f.name, getattr(msg, f.name))
    if VALID[cls]:
        with pytest.raises(TypeError):
            cls(*VALID[cls].values())
    if any(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)):
        with pytest.raises(TypeError):  # a missing argument is our bug, not the peer's
            cls()


# --- registries --------------------------------------------------------------


def test_going_away_is_a_server_message_with_a_bounded_reason():
    assert GoingAway().reason == ""
    assert SERVER_MESSAGES["going_away"] is GoingAway
    assert "going_away" not in CLIENT_MESSAGES
    assert_invalid(GoingAway, "reason", 7)
    assert_invalid(GoingAway, "reason", "x" * (MAX_TEXT_LEN + 1))


def test_left_is_a_server_message_whose_answer_is_required():
    assert SERVER_MESSAGES["left"] is Left
    assert "left" not in CLIENT_MESSAGES
    assert Left(job_continues=True).reason == ""
    with pytest.raises(TypeError):
        Left()  # type: ignore[call-arg]  # no default: a missing answer is our bug
    assert_invalid(Left, "job_continues", 1)
    assert_invalid(Left, "job_continues", None)
    assert_invalid(Left, "reason", "x" * (MAX_TEXT_LEN + 1))


def test_join_node_rank_defaults_to_not_given_and_is_bounded():
    assert build(Join, node_rank=-1).node_rank == -1
    assert Join(**{k: v for k, v in VALID[Join].items() if k != "node_rank"}).node_rank == -1
    assert build(Join, node_rank=MAX_NODES - 1).node_rank == MAX_NODES - 1
    assert_invalid(Join, "node_rank", -2)
    assert_invalid(Join, "node_rank", MAX_NODES)
    assert_invalid(Join, "node_rank", True)
    assert_invalid(Join, "node_rank", 1.0)
    # Not checked against max_nodes here: that is the job's rule, which the server applies
    # (and answers with an Error naming the job), so an agent never fails building its join.
    assert build(Join, node_rank=9, max_nodes=4).node_rank == 9


def test_standbys_name_one_node_per_endpoint():
    assert_invalid(Standbys, "nodes", ("node-b", "node-c"), blamed="nodes")
    assert_invalid(Standbys, "endpoints", ("10.0.0.2:1",) * 5)


def test_registries():
    assert set(CLIENT_MESSAGES) == {
        "hello",
        "join",
        "heartbeat",
        "workers_failed",
        "workers_succeeded",
        "leave",
        "resume",
        "progress",
        "snapshots_held",
        "hang_detected",
        "stacks",
        "armed",
        "workers_committed",
        "leave_after_commit",
    }
    assert set(SERVER_MESSAGES) == {
        "welcome",
        "waiting",
        "assignment",
        "restart",
        "job_failed",
        "job_done",
        "drain",
        "resumed",
        "going_away",
        "left",
        "error",
        "collect_stacks",
        "stop_at",
        "keep_snapshot",
        "standbys",
    }
    assert not set(CLIENT_MESSAGES) & set(SERVER_MESSAGES)
    assert MESSAGE_TYPES == {**CLIENT_MESSAGES, **SERVER_MESSAGES}
    for tag, cls in MESSAGE_TYPES.items():
        assert cls.TYPE == tag
    assert set(typing.get_args(Message)) == set(MESSAGE_TYPES.values())
    assert not hasattr(Failure, "TYPE")
    assert set(VALID) == {Failure, *MESSAGE_TYPES.values()}


# --- versions ----------------------------------------------------------------


def test_version_constants():
    assert PROTOCOL_VERSION == 1
    assert SUPPORTED_VERSIONS == (1,)
    assert PROTOCOL_VERSION in SUPPORTED_VERSIONS


@pytest.mark.parametrize(
    ("theirs", "ours", "agreed"),
    [
        ((1,), (1,), 1),
        ([1, 2, 3], (1,), 1),
        ((3, 1, 2), (1, 2), 2),
        ((2,), (1, 2, 3), 2),
        ((1, 2, 5, 9), (2, 5, 7), 5),
    ],
)
def test_negotiate_version_picks_the_highest_common_version(theirs, ours, agreed):
    assert negotiate_version(theirs, ours=ours) == agreed
    # Symmetric: the client checking the server's choice agrees with the server.
    assert negotiate_version(ours, ours=theirs) == agreed


def test_negotiate_version_defaults_to_our_supported_versions():
    assert negotiate_version(Hello(versions=(1,), software="x").versions) == PROTOCOL_VERSION


@pytest.mark.parametrize(("theirs", "ours"), [((2, 3), (1,)), ((1,), (2, 3)), ((), (1,))])
def test_version_mismatch_names_both_sides(theirs, ours):
    with pytest.raises(VersionMismatch) as info:
        negotiate_version(theirs, ours=ours)
    error = info.value
    assert error.code == "version_mismatch"
    assert (error.ours, error.theirs) == (tuple(ours), tuple(theirs))
    assert str(list(ours)) in str(error)
    assert str(list(theirs)) in str(error)
    assert error.field == "hello.versions"


# --- errors ------------------------------------------------------------------

ERRORS = [
    (MalformedFrame("not msgpack"), "malformed_frame"),
    (FrameTooLarge(2_000_000, 1 << 20), "frame_too_large"),
    (BadMagic(b"GET / HT"), "bad_magic"),
    (UnknownMessageType("nope", accepted=["join", "hello"]), "unknown_type"),
    (MissingField("join.nproc"), "missing_field"),
    (InvalidField("join.nproc", "must be in 1..4096, got 0"), "invalid_field"),
    (VersionMismatch(ours=(1,), theirs=(2,)), "version_mismatch"),
    (UnexpectedMessage("join while running, node n1", field="t"), "unexpected_message"),
]


@pytest.mark.parametrize(("error", "code"), ERRORS, ids=lambda e: type(e).__name__)
def test_errors_have_stable_codes_and_survive_pickle(error, code):
    assert isinstance(error, ProtocolError)
    assert error.code == type(error).code == code
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is type(error)
        assert (str(clone), clone.code, clone.field) == (str(error), error.code, error.field)


def test_error_text_is_readable():
    assert (
        str(FrameTooLarge(2_000_000, 1_048_576))
        == "frame of 2000000 bytes exceeds the limit of 1048576 bytes"
    )
    assert str(MissingField("join.nproc")) == "join.nproc: required field is missing"
    assert str(InvalidField("join.nproc", "must be >= 1")) == "join.nproc: must be >= 1"
    assert "'nope'" in str(UnknownMessageType("nope"))
    assert "(accepted here: hello, join)" in str(UnknownMessageType("x", accepted=["join", "hello"]))
    assert "b'GET / HT'" in str(BadMagic(b"GET / HT"))
    assert str(UnexpectedMessage("join while running")) == "join while running"


@pytest.mark.parametrize(("error", "_code"), ERRORS, ids=lambda e: type(e).__name__)
def test_error_message_builds_the_reply(error, _code):
    reply = error_message(error)
    assert reply == Error(code=error.code, message=str(error), field=error.field, fatal=True)
    assert error_message(error, fatal=False).fatal is False


def test_error_message_truncates_what_does_not_fit():
    error = InvalidField("x" * 1000, "y" * (2 * MAX_TEXT_LEN))
    reply = error_message(error)
    assert len(reply.message) == MAX_TEXT_LEN
    assert reply.field == "x" * MAX_ID_LEN


def test_describe_is_short_and_never_raises():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert describe(deep) == "a list of length 1"
    assert describe(10**5000) == "an int of 16610 bits"
    assert len(describe("x" * 10**6)) < 120
    assert describe(b"\x00" * 10) == repr(b"\x00" * 10)
    assert describe(math.nan) == "nan"
    assert describe(object()) == "a value of type object"


def test_error_for_a_huge_value_stays_short():
    error = assert_invalid(Join, "job_id", "j" * 10**6)
    assert len(str(error)) < 200
    error = assert_invalid(Join, "nproc", 10**5000)
    assert "bits" in str(error)


def test_copy_with_equals_the_validated_message() -> None:
    kw = dict(
        job_id="j",
        round=2,
        group_rank=0,
        group_world_size=3,
        rank_offset=0,
        world_size=12,
        master_addr="10.0.0.1",
        master_port=29400,
        restart_count=1,
        max_restarts=3,
    )
    first = Assignment(**kw)
    copy_ = first._copy_with(group_rank=2, rank_offset=8)
    assert copy_ == Assignment(**{**kw, "group_rank": 2, "rank_offset": 8})
    assert type(copy_) is Assignment and first.group_rank == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy_.round = 3


# --- ids hold no control characters; secrets are printable ASCII --------------------------

ID_FIELDS = [
    (Join, "job_id"),
    (Join, "node_id"),
    (Join, "addr"),
    (Failure, "node_id"),
    (Failure, "addr"),
    (Failure, "signal"),
    (Hello, "software"),
    (Waiting, "job_id"),
    (Assignment, "master_addr"),
    (Error, "code"),
    (Error, "field"),
]
FORGERIES = ["n1\nINFO job x: node evil joined", "n\x1b[31mred", "n\x00", "n\x7f", "n\x85", "n\x9b2J"]


@pytest.mark.parametrize(("cls", "name"), ID_FIELDS)
@pytest.mark.parametrize("bad", FORGERIES)
def test_an_id_with_a_control_character_is_refused_naming_it(cls: type, name: str, bad: str) -> None:
    with pytest.raises(InvalidField, match="control characters") as info:
        cls(**{**VALID[cls], name: bad})
    assert info.value.field == f"{cls._PATH}.{name}"


def test_ids_may_hold_any_printable_unicode() -> None:
    j = Join(**{**VALID[Join], "node_id": "nœud-ü-节点-\u00a0x", "job_id": "训练"})
    assert j.node_id.startswith("nœud")


def test_free_texts_may_still_hold_newlines_and_escapes() -> None:
    # Shown escaped by whoever shows them; a worker's error is many lines.
    assert Leave(reason="a\nb\x1b[0m").reason == "a\nb\x1b[0m"
    assert Failure(**{**FAILURE, "message": "Traceback:\n  x"}).message.count("\n") == 1


@pytest.mark.parametrize("name", ["proof", "node_secret"])
@pytest.mark.parametrize("bad", ["é" * 64, "ab\ncd", "\x00" * 8, "ab cd"[:2] + "\u200b"])
def test_a_proof_or_secret_must_be_printable_ascii(name: str, bad: str) -> None:
    with pytest.raises(InvalidField, match="printable ASCII") as info:
        Join(**{**VALID[Join], name: bad})
    assert info.value.field == f"join.{name}"


def test_a_non_ascii_challenge_is_refused() -> None:
    with pytest.raises(InvalidField, match=r"welcome\.challenge"):
        Welcome(**{**VALID[Welcome], "challenge": "é" * 32})


@pytest.mark.parametrize("n", [0, 1, 40, 41, 100, 65536, 10**6])
def test_clip_text_fits_the_limit_and_says_how_much_was_cut(n: int) -> None:
    text = "x" * n
    clipped = clip_text(text, 40)
    assert len(clipped) <= 40
    if n <= 40:
        assert clipped == text
    else:
        assert clipped.startswith("x") and f"{n - clipped.index(' ...'):,} more characters" in clipped


def test_a_clipped_text_is_valid_in_its_field() -> None:
    assert Restart(round=1, reason=clip_text("é" * 10**6, MAX_TEXT_LEN), restart_count=0)


def test_snapshot_fields_hold_together():
    # Issue 35: a restore plan whose parts disagree, or a holding list of unequal halves, is
    # the sender's error, refused where it enters.
    assert_invalid(Assignment, "restore_keys", ("9e" * 32, "7a" * 32))
    assert_invalid(Assignment, "restore_source", (-1, 1), blamed="restore_source")
    assert_invalid(Assignment, "restore_source", (-2,))
    assert_invalid(SnapshotsHeld, "steps", (40, 40))
    assert_invalid(SnapshotsHeld, "ranks", (-1, 0, 1), blamed="ranks")
    assert_invalid(KeepSnapshot, "step", -2)
    assert_invalid(KeepSnapshot, "replicate", -2)
    assert_invalid(Join, "durable_steps", (40,), durable_world=-1)
    assert_invalid(Join, "durable_steps", (1, 2, 3, 4, 5))  # at most MAX_DURABLE_STEPS
    assert_invalid(Join, "durable_world", 0)  # -1 (none) or a world size
    assert_invalid(Assignment, "restore_durable", True, restore_step=-1)
    # Issue 42: digests are sha256 hex or nothing, one per pair; alternates index addresses.
    assert_invalid(SnapshotsHeld, "digests", ("ab" * 32,))
    assert_invalid(SnapshotsHeld, "digests", ("AB" * 32, "", ""), blamed="digests")
    assert_invalid(SnapshotsHeld, "digests", ("ab" * 31, "", ""), blamed="digests")
    assert_invalid(Assignment, "restore_alt", (-1, 1), blamed="restore_alt")
    assert_invalid(Assignment, "restore_certs", ("5c" * 32, "5c" * 32))
    assert_invalid(Join, "replica_cert", "zz" * 32)
    # Absent, they mean "nothing": an older server's Assignment restores nothing.
    plain = Assignment(
        **{k: v for k, v in VALID[Assignment].items() if not k.startswith(("restore", "replica"))}
    )
    assert (plain.restore_step, plain.restore_source, plain.replica_to) == (-1, (), "")
    assert not plain.restore_durable
    older = Join(**{k: v for k, v in VALID[Join].items() if not k.startswith("durable")})
    assert (older.durable_world, older.durable_steps) == (-1, ())
    # Issue 44: a restore at another world names that world and one old rank per local rank,
    # each below it, with a step, and never with the snapshot directory's.
    assert_invalid(Assignment, "restore_world", 4, restore_ranks=())
    assert_invalid(Assignment, "restore_world", 4, restore_ranks=(1, 1), restore_step=-1)
    assert_invalid(Assignment, "restore_ranks", (1, 1), restore_world=0)
    assert_invalid(Assignment, "restore_ranks", (1, 4), restore_world=4)
    assert_invalid(Assignment, "restore_ranks", (0,) * (MAX_NPROC + 1), restore_world=4)  # one per local rank
    assert_invalid(Assignment, "restore_world", 4, restore_ranks=(1, 1), restore_durable=True)
    assert (plain.restore_world, plain.restore_ranks) == (0, ())
    assert build(Assignment, restore_world=4, restore_ranks=(3, 3)).restore_ranks == (3, 3)
    assert not build(SnapshotsHeld, replicated=False).replicated
