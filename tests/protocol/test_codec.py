"""The wire format: encode, decode_payload and FrameDecoder, fed scripted and random bytes."""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing

import msgpack
import msgpack.fallback
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    CLIENT_MESSAGES,
    HEADER,
    MAGIC,
    MAX_ADDR_LEN,
    MAX_CODE_LEN,
    MAX_FRAME_SIZE,
    MAX_ID_LEN,
    MAX_NODES,
    MAX_NPROC,
    MAX_TEXT_LEN,
    MESSAGE_TYPES,
    SERVER_MESSAGES,
    Armed,
    Assignment,
    BadMagic,
    CollectStacks,
    Drain,
    Error,
    Failure,
    FrameDecoder,
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
    UnknownMessageType,
    Waiting,
    Welcome,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
    decode_payload,
    encode,
    encode_many,
    frame_limits,
)
from protocol.codec import MAX_CONTAINERS, MAX_MAP_LEN, computed_frame_limits, largest_client_messages
from protocol.messages import MAX_SUMMARY_LEN

FAILURE = Failure(
    node_id="node-1",
    addr="10.0.0.1",
    rank=3,
    local_rank=1,
    exitcode=-9,
    signal="SIGKILL",
    timestamp=1_700_000_000.25,
    message="RuntimeError: CUDA error: device-side assert triggered",
)
JOIN = Join(
    job_id="job-7",
    node_id="node-1",
    addr="10.0.0.1",
    nproc=8,
    min_nodes=2,
    max_nodes=4,
    entrypoint="train.py --lr 0.1",
    master_port=29500,
    max_restarts=3,
    last_call_timeout=30,
    heartbeat_interval=5.0,
    heartbeat_timeout=30.0,
)

JOB_FAILED = JobFailed(reason="max restarts reached", failure=FAILURE)
WORKERS_FAILED = WorkersFailed(round=2, failure=FAILURE)

# Every message type, with optional fields both left at their defaults and set.
SAMPLES = [
    Hello(versions=(1,), software="node-agent 0.1.0"),
    Hello(versions=[1, 2, 7], software=""),
    JOIN,
    dataclasses.replace(JOIN, spare=True, addr="", entrypoint="\N{SNOWMAN} unicode"),
    dataclasses.replace(JOIN, min_nodes=4, node_rank=3),
    dataclasses.replace(JOIN, hosts_store=True),
    Heartbeat(),
    WORKERS_FAILED,
    WorkersFailed(
        round=0, failure=Failure(node_id="n", addr="", rank=0, local_rank=0, exitcode=1, timestamp=0)
    ),
    WorkersSucceeded(round=2, idle_ms=1250.0),
    Leave(),
    Leave(reason="scale down"),
    Welcome(version=1, software="rdzv-server 0.1.0"),
    Waiting(job_id="job-7", round=1, joined=1, min_nodes=2, max_nodes=4),
    Waiting(job_id="job-7", round=1, joined=1, min_nodes=2, max_nodes=4, reason="1 more"),
    Assignment(
        job_id="job-7",
        round=1,
        group_rank=1,
        group_world_size=2,
        rank_offset=8,
        world_size=16,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=0,
        max_restarts=3,
    ),
    Assignment(
        job_id="job-7",
        round=2,
        group_rank=0,
        group_world_size=2,
        rank_offset=0,
        world_size=16,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=1,
        max_restarts=3,
        agent_store=True,
    ),
    Restart(round=3, reason="node-2 failed", restart_count=1),
    JobFailed(reason="max restarts reached"),
    JOB_FAILED,
    JobDone(),
    Drain(reason="scale down"),
    GoingAway(reason="SIGTERM"),
    JobFailed(reason="3 restarts in a row made no step progress", code="crash_loop"),
    Progress(round=2, min_step=-1, max_step=-1),
    Progress(
        round=3,
        min_step=17,
        max_step=19,
        step_p50_ms=120.5,
        step_p90_ms=180.0,
        phase="compute",
        age_ms=40.0,
        compute_ms=(80.0, 0.0, 160.25),
    ),
    HangDetected(round=3, ranks=(2,), step=20, phase="compute", silent_s=31.5),
    Stacks(
        round=3,
        ranks=(2, 3),
        steps=(20, 19),
        phases=("compute", ""),
        silent_s=(31.5, 30.0),
        stacks=('File "train.py", line 40 in <module>', ""),
    ),
    CollectStacks(round=3, reason="rank 2 hung"),
    Armed(round=3, step=72, late=False),
    Armed(round=3, step=72, late=True, checked=80),
    WorkersCommitted(round=3, step=72),
    LeaveAfterCommit(round=3, reason="received SIGTERM"),
    StopAt(round=3, step=72, state="arm"),
    StopAt(round=3, step=72, state="cancel"),
    SnapshotsHeld(world_size=16, ranks=(0, 1, 0, 9), steps=(40, 40, 41, 40)),
    KeepSnapshot(step=40, replicate=41),
    Standbys(
        term=2,
        host_node="node0",
        host_in_round=True,
        endpoints=("10.0.0.2:29500", "10.0.0.3:29500"),
        nodes=("node1", "node2"),
    ),
    Left(job_continues=True),
    Left(job_continues=False, reason="this node was the last of the job"),
    Resumed(job_id="job-7", round=2, rebuilt=True),
    Error(code="invalid_field", message="join.nproc: must be in 1..4096, got 0"),
    Error(code="invalid_field", message="m", field="join.nproc", fatal=False),
]
SAMPLES.append(
    Resume(join=JOIN, assignment=next(m for m in SAMPLES if isinstance(m, Assignment)), succeeded=True)
)


def payload_of(msg: typing.Any) -> dict[str, typing.Any]:
    return msgpack.unpackb(encode(msg)[HEADER.size :], raw=False)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def packed(obj: typing.Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    decoder = FrameDecoder()
    (decoded,) = decoder.feed(data)
    assert decoded == msg
    assert type(decoded) is type(msg)
    for f in dataclasses.fields(msg):
        assert type(getattr(decoded, f.name)) is type(getattr(msg, f.name))
    assert decoder.buffered == 0
    assert decode_payload(data[HEADER.size :]) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_wire_form_is_a_map_of_every_field(msg):
    data = encode(msg)
    (length,) = HEADER.unpack_from(data)
    assert length == len(data) - 4
    payload = payload_of(msg)
    assert payload.pop("t") == msg.TYPE
    assert set(payload) == {f.name for f in dataclasses.fields(msg)}  # defaults included
    failure = getattr(msg, "failure", None)
    if failure is not None:
        assert payload["failure"] == dataclasses.asdict(failure)


def test_header_is_four_byte_big_endian():
    assert HEADER.size == 4
    assert encode(Heartbeat())[:4] == len(packed({"t": "heartbeat"})).to_bytes(4, "big")


def test_every_split_point():
    stream = encode_many(SAMPLES)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(stream[:cut])
        assert decoder.buffered == cut - len(encode_many(got))
        got += decoder.feed(stream[cut:])
        assert got == SAMPLES
        assert decoder.buffered == 0


def test_byte_by_byte():
    stream = encode_many(SAMPLES)
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == SAMPLES


def test_many_frames_in_one_chunk():
    msgs = [Heartbeat()] * 10_000 + [JOIN] + [WorkersSucceeded(round=r) for r in range(1000)]
    decoder = FrameDecoder()
    assert decoder.feed(encode_many(msgs)) == msgs
    assert decoder.buffered == 0


def test_partial_frame_is_kept():
    data = encode(JOIN)
    decoder = FrameDecoder()
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == len(data) - 1
    assert decoder.feed(b"") == []
    assert decoder.feed(data[-1:] + data[:3]) == [JOIN]
    assert decoder.buffered == 3


def test_large_frame_byte_by_byte():
    msg = dataclasses.replace(JOIN, entrypoint="e" * MAX_TEXT_LEN)
    data = encode(msg)
    decoder = FrameDecoder()
    for i in range(len(data) - 1):
        assert decoder.feed(data[i : i + 1]) == []
    assert decoder.buffered == len(data) - 1
    assert decoder.feed(data[-1:]) == [msg]


def test_a_frame_taken_in_pieces_leaves_no_buffer_behind():
    # After a hang every node's last frame is 16 KB of stacks: it must not stay with its
    # connection until that connection's next read.
    msg = dataclasses.replace(JOIN, entrypoint="e" * MAX_TEXT_LEN)
    data = encode(msg)
    decoder = FrameDecoder()
    assert decoder.feed(data[:100]) == []
    assert decoder.feed(data[100:]) == [msg]
    assert decoder.buffered == 0 and len(decoder._buf) == 0


def test_a_whole_frame_with_a_limit_of_none_is_kept_for_later():
    data = encode(JOIN)
    decoder = FrameDecoder()
    assert decoder.feed(data, limit=0) == []
    assert decoder.buffered == len(data)
    assert decoder.feed(b"", limit=1) == [JOIN]
    assert decoder.feed(data, limit=1) == [JOIN]  # one whole frame alone: the direct path
    assert decoder.buffered == 0


def test_feed_accepts_bytearray_and_memoryview():
    data = encode(JOIN)
    assert FrameDecoder().feed(bytearray(data)) == [JOIN]
    assert FrameDecoder().feed(memoryview(data)) == [JOIN]


def test_largest_possible_messages_fit_the_default_frame_size():
    wide = "\U0010ffff"  # four bytes in UTF-8, the worst case per character
    failure = Failure(
        node_id=wide * MAX_ID_LEN,
        addr=wide * MAX_ADDR_LEN,
        rank=2**63 - 1,
        local_rank=2**63 - 1,
        exitcode=-(2**63),
        signal=wide * MAX_CODE_LEN,
        timestamp=1e15,
        message=wide * MAX_TEXT_LEN,
    )
    largest = [
        dataclasses.replace(
            JOIN,
            job_id=wide * MAX_ID_LEN,
            node_id=wide * MAX_ID_LEN,
            addr=wide * MAX_ADDR_LEN,
            entrypoint=wide * MAX_TEXT_LEN,
        ),
        JobFailed(
            reason=wide * MAX_TEXT_LEN,
            failure=failure,
            report=wide * MAX_TEXT_LEN,
            code=wide * MAX_CODE_LEN,
            summary=wide * MAX_SUMMARY_LEN,
        ),
        JobDone(summary=wide * MAX_SUMMARY_LEN),
        Restart(round=2**63 - 1, reason=wide * MAX_TEXT_LEN, restart_count=0, report=wide * MAX_TEXT_LEN),
        WorkersFailed(round=2**63 - 1, failure=failure),
        Error(code=wide * MAX_CODE_LEN, message=wide * MAX_TEXT_LEN, field=wide * MAX_ID_LEN),
        Hello(versions=(2**63 - 1,) * 16, software=wide * MAX_ID_LEN),
    ]
    for msg in largest:
        data = encode(msg)
        assert len(data) - HEADER.size <= MAX_FRAME_SIZE
        assert FrameDecoder().feed(data) == [msg]


def test_encode_many():
    assert encode_many([]) == b""
    assert encode_many(SAMPLES) == b"".join(encode(m) for m in SAMPLES)
    assert encode_many(iter(SAMPLES[:2])) == encode(SAMPLES[0]) + encode(SAMPLES[1])


@pytest.mark.parametrize("thing", [FAILURE, {"t": "heartbeat"}, None, "heartbeat"], ids=repr)
def test_encode_rejects_what_is_not_a_message(thing):
    with pytest.raises(TypeError):
        encode(thing)


# --- decoding: frame level ---------------------------------------------------

MALFORMED = [
    b"",
    b"\xc1",  # the one byte msgpack never uses
    b"\x92\x01",  # truncated array
    packed([1, 2]),
    packed("join"),
    packed(None),
    packed({"job_id": "j"}),  # no "t"
    packed({"t": 1}),
    packed({"t": None}),
    packed({"t": b"join"}),  # bin, not str
    packed({"t": ["join"]}),
    packed({"t": "heartbeat"}) + b"\xc0",  # trailing bytes
    b"\x81\xa1t\xa2\xff\xfe",  # invalid UTF-8 in a str
    b"\x81\x01\x02",  # int map key
    b"\xdd\xff\xff\xff\xff",  # array claiming 2**32-1 items in 5 bytes
    b"\xdf\xff\xff\xff\xff",  # map likewise
    b"\xdb\xff\xff\xff\xff",  # str likewise
    b"\x82\xa1t\xa5leave\xa6reason" + b"\x91" * 10_000 + b"\xc0",  # 10,000 nested lists
    b"\x82\xa1t\xa5leave\xa6reason" + b"\x81\xa1k" * 10_000 + b"\xc0",  # 10,000 nested maps
    b"\x81" * 100_000,
]


@pytest.mark.parametrize("payload", MALFORMED, ids=lambda p: p[:16].hex())
def test_malformed_payloads(payload):
    with pytest.raises(MalformedFrame) as info:
        decode_payload(payload)
    assert info.value.code == "malformed_frame"
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(frame(payload))


@pytest.mark.parametrize("payload", MALFORMED, ids=lambda p: p[:16].hex())
def test_malformed_payloads_with_pure_python_msgpack(payload, monkeypatch):
    # Installs without the C extension use msgpack.fallback; it must fail the same way.
    monkeypatch.setattr(msgpack, "unpackb", msgpack.fallback.unpackb)
    with pytest.raises(MalformedFrame):
        decode_payload(payload)


@pytest.mark.parametrize("error", [RecursionError, MemoryError, TypeError, KeyError, OverflowError])
def test_any_failure_inside_msgpack_is_a_malformed_frame(error, monkeypatch):
    def unpackb(*args, **kwargs):
        raise error("inside msgpack")

    monkeypatch.setattr(msgpack, "unpackb", unpackb)
    with pytest.raises(MalformedFrame, match=error.__name__):
        FrameDecoder().feed(encode(WorkersSucceeded(round=1)))


def test_heartbeat_frames_decode_to_one_shared_instance_without_msgpack(monkeypatch):
    def unpackb(*args, **kwargs):
        raise AssertionError("a heartbeat frame went through msgpack")

    monkeypatch.setattr(msgpack, "unpackb", unpackb)
    decoder = FrameDecoder(allowed=CLIENT_MESSAGES, expect_magic=True)
    first, second = decoder.feed(MAGIC + encode(Heartbeat()) * 2)
    assert first == Heartbeat() and first is second
    # The payload alone decides: an equal map spelled differently takes the general path.
    monkeypatch.undo()
    str8_key = b"\x81\xd9\x01t\xa9heartbeat"  # {"t": "heartbeat"}, the key as str8, not fixstr
    assert msgpack.unpackb(str8_key) == {"t": "heartbeat"}
    assert FrameDecoder().feed(frame(str8_key)) == [Heartbeat()]
    with pytest.raises(UnknownMessageType):
        FrameDecoder(allowed=SERVER_MESSAGES).feed(encode(Heartbeat()))


def test_a_repeated_join_decodes_once(monkeypatch):
    decoder = FrameDecoder(allowed=CLIENT_MESSAGES)
    (first,) = decoder.feed(encode(JOIN))

    def unpackb(*args, **kwargs):
        raise AssertionError("the same Join went through msgpack again")

    monkeypatch.setattr(msgpack, "unpackb", unpackb)
    again = decoder.feed(encode(JOIN) + encode(Heartbeat()) + encode(JOIN))
    assert again == [JOIN, Heartbeat(), JOIN] and again[0] is first and again[2] is first
    monkeypatch.undo()
    other = dataclasses.replace(JOIN, nproc=JOIN.nproc + 1)
    assert decoder.feed(encode(other)) == [other]
    # An empty payload is not mistaken for a remembered one.
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(frame(b""))


def test_unknown_message_type():
    with pytest.raises(UnknownMessageType) as info:
        decode_payload(packed({"t": "teleport", "to": "mars"}))
    error = info.value
    assert (error.code, error.message_type, error.field) == ("unknown_type", "teleport", "t")
    assert "'teleport'" in str(error)


@pytest.mark.parametrize("msg", [m for m in SAMPLES if m.TYPE in SERVER_MESSAGES], ids=lambda m: m.TYPE)
def test_server_refuses_server_messages(msg):
    with pytest.raises(UnknownMessageType) as info:
        FrameDecoder(allowed=CLIENT_MESSAGES).feed(encode(msg))
    assert info.value.message_type == msg.TYPE
    assert "hello" in str(info.value)


@pytest.mark.parametrize("msg", [m for m in SAMPLES if m.TYPE in CLIENT_MESSAGES], ids=lambda m: m.TYPE)
def test_server_accepts_client_messages_and_client_refuses_them(msg):
    assert FrameDecoder(allowed=CLIENT_MESSAGES).feed(encode(msg)) == [msg]
    with pytest.raises(UnknownMessageType):
        decode_payload(encode(msg)[4:], allowed=SERVER_MESSAGES)


# --- decoding: fields --------------------------------------------------------

REQUIRED = [
    (msg, f.name)
    for msg in SAMPLES
    for f in dataclasses.fields(msg)
    if f.default is dataclasses.MISSING
    # one sample per class is enough
    if msg is next(m for m in SAMPLES if type(m) is type(msg))
]


@pytest.mark.parametrize(("msg", "name"), REQUIRED, ids=lambda x: x if isinstance(x, str) else x.TYPE)
def test_missing_required_field(msg, name):
    payload = payload_of(msg)
    del payload[name]
    with pytest.raises(MissingField) as info:
        decode_payload(packed(payload))
    path = f"{msg.TYPE}.{name}"
    assert (info.value.code, info.value.field) == ("missing_field", path)
    assert path in str(info.value)


@pytest.mark.parametrize("outer", ["workers_failed", "job_failed"])
@pytest.mark.parametrize("name", ["node_id", "addr", "rank", "local_rank", "exitcode", "timestamp"])
def test_missing_field_in_failure(outer, name):
    payload = payload_of(WORKERS_FAILED if outer == "workers_failed" else JOB_FAILED)
    del payload["failure"][name]
    with pytest.raises(MissingField) as info:
        decode_payload(packed(payload))
    assert info.value.field == f"{outer}.failure.{name}"
    assert f"{outer}.failure.{name}" in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("rank", -1),
        ("rank", True),
        ("node_id", ""),
        ("exitcode", 2**64 - 1),
        ("timestamp", "now"),
        ("signal", 9),
    ],
)
@pytest.mark.parametrize("outer", ["workers_failed", "job_failed"])
def test_invalid_field_in_failure_names_the_whole_path(outer, name, value):
    payload = payload_of(WORKERS_FAILED if outer == "workers_failed" else JOB_FAILED)
    payload["failure"][name] = value
    with pytest.raises(InvalidField) as info:
        decode_payload(packed(payload))
    path = f"{outer}.failure.{name}"
    assert (info.value.code, info.value.field) == ("invalid_field", path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("value", [[1, 2], "node-1 died", 7, b"\x81"])
def test_failure_that_is_not_a_map(value):
    payload = payload_of(WORKERS_FAILED)
    payload["failure"] = value
    with pytest.raises(InvalidField) as info:
        decode_payload(packed(payload))
    assert info.value.field == "workers_failed.failure"


def test_required_failure_cannot_be_nil_but_optional_can():
    payload = payload_of(WORKERS_FAILED)
    payload["failure"] = None
    with pytest.raises(InvalidField, match=r"^workers_failed\.failure: "):
        decode_payload(packed(payload))
    assert decode_payload(packed({"t": "job_failed", "reason": "r", "failure": None})) == JobFailed(
        reason="r"
    )


def test_the_jobs_hang_report_travels_and_older_peers_frames_have_none():
    report = "hang: suspect rank 3 on n2\n    stuck_in_data_loader (train.py:26)\n"
    for msg in (
        Restart(round=1, reason="worker failure", restart_count=1, report=report),
        JobFailed(reason="r", failure=FAILURE, report=report),
    ):
        assert FrameDecoder().feed(encode(msg)) == [msg]
    # An older server's frames: no report.
    assert (
        decode_payload(packed({"t": "restart", "round": 1, "reason": "r", "restart_count": 1})).report == ""
    )
    assert decode_payload(packed({"t": "job_failed", "reason": "r"})).report == ""
    with pytest.raises(InvalidField, match=r"^restart\.report: "):
        Restart(round=1, reason="r", restart_count=1, report="x" * (MAX_TEXT_LEN + 1))


WIRE_TYPOS = [
    ("join", "nproc", "8"),
    ("join", "nproc", True),
    ("join", "nproc", 8.0),
    ("join", "nproc", 0),
    ("join", "master_port", 0),
    ("join", "master_port", 65536),
    ("join", "min_nodes", 5),  # > max_nodes: the relation blames max_nodes
    ("join", "last_call_timeout", math.nan),
    ("join", "last_call_timeout", math.inf),
    ("join", "heartbeat_interval", -1.0),
    ("join", "job_id", ""),
    ("join", "job_id", b"job-7"),
    ("join", "spare", 1),
    ("join", "spare", None),
    ("hello", "versions", []),
    ("hello", "versions", {"1": 1}),
    ("hello", "versions", [1.0]),
    ("workers_succeeded", "round", 2**64 - 1),
    ("workers_succeeded", "round", -(2**63)),
    ("workers_succeeded", "round", msgpack.ExtType(5, b"x")),
    ("workers_succeeded", "round", msgpack.Timestamp(0)),
    ("assignment", "group_rank", 2),
    ("assignment", "rank_offset", 16),
    ("error", "fatal", 0),
    ("leave", "reason", ["deep"] * 10),
]


@pytest.mark.parametrize(("tag", "name", "value"), WIRE_TYPOS, ids=lambda x: repr(x)[:30])
def test_invalid_field_from_the_wire(tag, name, value):
    msg = next(m for m in SAMPLES if m.TYPE == tag)
    payload = payload_of(msg)
    payload[name] = value
    with pytest.raises(InvalidField) as info:
        decode_payload(packed(payload))
    blamed = "max_nodes" if (tag, name) == ("join", "min_nodes") else name
    assert info.value.field == f"{tag}.{blamed}"
    assert str(info.value).startswith(f"{tag}.{blamed}: ")


def test_moderately_deep_value_is_an_invalid_field():
    # Nested, but within the payload's budget of containers: the field's rule names it.
    payload = b"\x82\xa1t\xa5leave\xa6reason" + b"\x91" * 20 + b"\xc0"
    with pytest.raises(InvalidField, match=r"^leave\.reason: must be a string, got a list of length 1$"):
        decode_payload(payload)


def test_a_deep_value_is_refused_by_the_container_budget():
    payload = b"\x82\xa1t\xa5leave\xa6reason" + b"\x91" * 500 + b"\xc0"
    with pytest.raises(MalformedFrame, match=f"more than {MAX_CONTAINERS} maps and arrays"):
        decode_payload(payload)


def test_unknown_keys_are_ignored():
    payload = payload_of(WORKERS_FAILED)
    payload["added_in_a_later_revision"] = {"anything": [1, 2, 3]}
    payload["failure"]["gpu"] = "H100"
    payload[b"bin key"] = 1
    assert decode_payload(packed(payload)) == WORKERS_FAILED


def test_missing_optional_fields_take_their_defaults():
    payload = payload_of(dataclasses.replace(JOIN, spare=True))
    del payload["spare"]
    assert decode_payload(packed(payload)) == JOIN
    assert decode_payload(packed({"t": "leave"})) == Leave()
    assert decode_payload(packed({"t": "error", "code": "c", "message": "m"})) == Error(code="c", message="m")
    failure = payload_of(WORKERS_FAILED)
    del failure["failure"]["signal"], failure["failure"]["message"]
    assert decode_payload(packed(failure)).failure == dataclasses.replace(FAILURE, signal="", message="")


def test_join_node_rank_is_optional_on_the_wire_both_ways():
    # An older agent sends no node_rank: "not given". An older server, which knows no
    # node_rank, decodes a newer agent's join without it (unknown keys are ignored).
    payload = payload_of(dataclasses.replace(JOIN, node_rank=1))
    assert payload["node_rank"] == 1
    del payload["node_rank"]
    assert decode_payload(packed(payload)).node_rank == -1
    newer = payload_of(dataclasses.replace(JOIN, node_rank=1))
    newer["added_in_a_later_revision"] = True
    assert decode_payload(packed(newer)) == dataclasses.replace(JOIN, node_rank=1)


def test_an_agent_that_does_not_know_left_fails_to_decode_it():
    # An older agent's decoder knows no "left": it raises, and the agent treats that as the
    # connection closing, which it expected after its Leave (see messages.py).
    older = {tag: cls for tag, cls in SERVER_MESSAGES.items() if tag != "left"}
    with pytest.raises(UnknownMessageType):
        FrameDecoder(allowed=older).feed(encode(Left(job_continues=True)))


def test_ints_on_the_wire_become_floats():
    payload = payload_of(JOIN)
    payload["heartbeat_interval"] = 5
    msg = decode_payload(packed(payload))
    assert msg == JOIN
    assert type(msg.heartbeat_interval) is float


# --- FrameDecoder: limits, magic, death --------------------------------------


def test_oversized_frame_is_refused_as_soon_as_the_header_arrives():
    decoder = FrameDecoder(max_frame_size=100)
    assert decoder.feed(HEADER.pack(100)[:3]) == []
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(HEADER.pack(101)[3:])  # completes header 101: no body sent at all
    error = info.value
    assert (error.code, error.size, error.limit) == ("frame_too_large", 101, 100)
    assert "101" in str(error) and "100" in str(error)


def test_default_frame_limit():
    assert MAX_FRAME_SIZE == 1 << 20
    decoder = FrameDecoder()
    assert decoder.feed(HEADER.pack(MAX_FRAME_SIZE)) == []  # at the limit: wait for the body
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(HEADER.pack(MAX_FRAME_SIZE + 1))
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(encode(Heartbeat()) + HEADER.pack(2**32 - 1))


def test_frame_at_a_small_limit_is_accepted():
    data = encode(JOIN)
    assert FrameDecoder(max_frame_size=len(data) - 4).feed(data) == [JOIN]
    with pytest.raises(FrameTooLarge):
        FrameDecoder(max_frame_size=len(data) - 5).feed(data)


def test_magic_then_frames():
    decoder = FrameDecoder(expect_magic=True, allowed=CLIENT_MESSAGES)
    hello = Hello(versions=(1,), software="x")
    assert decoder.feed(MAGIC + encode(hello) + encode(JOIN)) == [hello, JOIN]
    # MAGIC is read once; later bytes that happen to equal it are a frame header.
    with pytest.raises(FrameTooLarge):
        decoder.feed(MAGIC)


def test_magic_split_across_feeds():
    decoder = FrameDecoder(expect_magic=True)
    for byte in MAGIC:
        assert decoder.feed(bytes([byte])) == []
    assert decoder.buffered == 0
    assert decoder.feed(encode(Heartbeat())) == [Heartbeat()]


@pytest.mark.parametrize(
    "opening",
    [b"G", b"GET / HTTP/1.1\r\n", b"\x16\x03\x01", MAGIC[:7] + b"X", encode(Heartbeat()), b"\x00" * 8],
    ids=repr,
)
def test_bad_magic(opening):
    decoder = FrameDecoder(expect_magic=True)
    with pytest.raises(BadMagic) as info:
        decoder.feed(opening)
    assert info.value.code == "bad_magic"
    assert info.value.got == opening[:8]


def test_bad_magic_is_seen_before_eight_bytes():
    decoder = FrameDecoder(expect_magic=True)
    assert decoder.feed(MAGIC[:3]) == []
    with pytest.raises(BadMagic):
        decoder.feed(b"?")


@pytest.mark.parametrize(
    ("settings", "poison"),
    [
        ({}, frame(b"\xc1")),
        ({"max_frame_size": 10}, HEADER.pack(11)),
        ({"expect_magic": True}, b"GET "),
        ({"allowed": CLIENT_MESSAGES}, encode(JobDone())),
        ({}, frame(packed({"t": "leave", "reason": 1}))),
    ],
    ids=["malformed", "too_large", "magic", "not_allowed", "invalid"],
)
def test_decoder_is_dead_after_an_error(settings, poison):
    decoder = FrameDecoder(**settings)
    with pytest.raises(ProtocolError) as first:
        decoder.feed(poison)
    assert decoder.buffered == 0
    for data in (encode(Heartbeat()), b""):
        with pytest.raises(ProtocolError) as again:
            decoder.feed(data)
        assert again.value is first.value


def test_error_after_good_frames_in_one_chunk():
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame):
        decoder.feed(encode(Heartbeat()) + frame(b"\xc1"))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_frame_size": 0}, ValueError),
        ({"max_frame_size": 2**32}, ValueError),
        ({"max_frame_size": True}, TypeError),
        ({"max_frame_size": 1.5}, TypeError),
        ({"allowed": {"hello": Welcome}}, ValueError),
        ({"allowed": {"hello": Failure}}, ValueError),
    ],
)
def test_decoder_settings_are_checked(kwargs, error):
    with pytest.raises(error):
        FrameDecoder(**kwargs)


# --- properties --------------------------------------------------------------


def plain(**kw: typing.Any) -> st.SearchStrategy[str]:
    """Text without control characters, as ids, addresses and codes must be."""
    return st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), **kw)


ids = plain(min_size=1, max_size=MAX_ID_LEN)
texts = st.text(max_size=200)
counts = st.integers(0, 2**63 - 1)
small = st.integers(0, 1000)
ports = st.integers(1, 65535)
timeouts = st.one_of(st.floats(0, 1e7), st.integers(0, 10**7))
positive = st.one_of(st.floats(1e-9, 1e7), st.integers(1, 10**7))

failures = st.builds(
    Failure,
    node_id=ids,
    addr=plain(max_size=MAX_ADDR_LEN),
    rank=counts,
    local_rank=small,
    exitcode=st.integers(-(2**63), 2**63 - 1),
    signal=st.sampled_from(["", "SIGKILL", "SIGTERM", "SIGSEGV"]),
    timestamp=st.one_of(st.floats(0, 2e9), st.integers(0, 2**40)),
    message=texts,
)


@st.composite
def node_bounds(draw):
    lo = draw(st.integers(1, MAX_NODES))
    return lo, draw(st.integers(lo, MAX_NODES))


@st.composite
def joins(draw):
    lo, hi = draw(node_bounds())
    return Join(
        job_id=draw(ids),
        node_id=draw(ids),
        addr=draw(plain(max_size=MAX_ADDR_LEN)),
        nproc=draw(st.integers(1, MAX_NPROC)),
        min_nodes=lo,
        max_nodes=hi,
        entrypoint=draw(texts),
        master_port=draw(ports),
        max_restarts=draw(counts),
        last_call_timeout=draw(timeouts),
        heartbeat_interval=draw(positive),
        heartbeat_timeout=draw(positive),
        spare=draw(st.booleans()),
        node_rank=draw(st.integers(-1, MAX_NODES - 1)),
        hosts_store=draw(st.booleans()),
    )


@st.composite
def waitings(draw):
    lo, hi = draw(node_bounds())
    return Waiting(
        job_id=draw(ids),
        round=draw(counts),
        joined=draw(small),
        min_nodes=lo,
        max_nodes=hi,
        reason=draw(texts),
    )


@st.composite
def assignments(draw):
    group_world_size = draw(st.integers(1, MAX_NODES))
    world_size = draw(st.integers(1, 2**63 - 1))
    return Assignment(
        job_id=draw(ids),
        round=draw(counts),
        group_rank=draw(st.integers(0, group_world_size - 1)),
        group_world_size=group_world_size,
        rank_offset=draw(st.integers(0, world_size - 1)),
        world_size=world_size,
        master_addr=draw(plain(min_size=1, max_size=MAX_ADDR_LEN)),
        master_port=draw(ports),
        restart_count=draw(counts),
        max_restarts=draw(counts),
        agent_store=draw(st.booleans()),
    )


messages = st.one_of(
    st.builds(
        Hello,
        versions=st.lists(st.integers(1, 2**63 - 1), min_size=1, max_size=16),
        software=plain(max_size=MAX_ID_LEN),
    ),
    joins(),
    st.just(Heartbeat()),
    st.builds(WorkersFailed, round=counts, failure=failures),
    st.builds(WorkersSucceeded, round=counts),
    st.builds(Leave, reason=texts),
    st.builds(Welcome, version=st.integers(1, 2**63 - 1), software=plain(max_size=MAX_ID_LEN)),
    waitings(),
    assignments(),
    st.builds(Restart, round=counts, reason=texts, restart_count=counts),
    st.builds(JobFailed, reason=texts, failure=st.none() | failures),
    st.just(JobDone()),
    st.builds(Drain, reason=st.text(max_size=20)),
    st.builds(Left, job_continues=st.booleans(), reason=texts),
    st.builds(
        Error,
        code=plain(min_size=1, max_size=MAX_CODE_LEN),
        message=texts,
        field=st.none() | plain(max_size=MAX_ID_LEN),
        fatal=st.booleans(),
    ),
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[typing.Any]:
    out = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    return out


@given(msgs=st.lists(messages, max_size=8), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_property_valid_messages_round_trip_in_any_chunking(msgs, cuts):
    stream = encode_many(msgs)
    assert feed_all(FrameDecoder(), chunked(stream, cuts)) == msgs


@given(msg=messages)
def test_property_round_trip_is_exact(msg):
    decoded = decode_payload(encode(msg)[HEADER.size :])
    assert decoded == msg
    assert repr(decoded) == repr(msg)  # same types too, not merely equal values


def only_messages_or_protocol_errors(decoder: FrameDecoder, chunks: list[bytes]) -> None:
    try:
        for msg in feed_all(decoder, chunks):
            assert type(msg) in MESSAGE_TYPES.values()
    except ProtocolError:
        pass


decoders = st.builds(
    FrameDecoder,
    max_frame_size=st.sampled_from([MAX_FRAME_SIZE, 64, 1]),
    allowed=st.sampled_from([None, CLIENT_MESSAGES, SERVER_MESSAGES]),
    expect_magic=st.booleans(),
)


@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=20), decoder=decoders)
def test_property_random_bytes_only_yield_messages_or_protocol_errors(data, cuts, decoder):
    only_messages_or_protocol_errors(decoder, chunked(data, cuts))


@given(
    payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
)
def test_property_random_payloads_in_valid_frames(payloads, cuts):
    stream = b"".join(frame(p) for p in payloads)
    only_messages_or_protocol_errors(FrameDecoder(), chunked(stream, cuts))


FIELD_NAMES = sorted({f.name for cls in [Failure, *MESSAGE_TYPES.values()] for f in dataclasses.fields(cls)})
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELD_NAMES), inner, max_size=6)
    ),
    max_leaves=20,
)
maps = st.builds(
    lambda tag, fields: {**fields, "t": tag} if tag is not None else fields,
    st.none() | st.sampled_from(sorted(MESSAGE_TYPES)) | st.text(max_size=5),
    st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=12),
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(obj=maps | values)
def test_property_random_msgpack_maps_only_yield_messages_or_protocol_errors(obj):
    try:
        msg = decode_payload(packed(obj))
    except ProtocolError:
        return
    assert type(msg) in MESSAGE_TYPES.values()
    assert decode_payload(encode(msg)[HEADER.size :]) == msg


@given(msg=messages, data=st.data())
def test_property_one_broken_field_is_named(msg, data):
    names = [f.name for f in dataclasses.fields(msg)]
    if not names:
        return
    name = data.draw(st.sampled_from(names))
    payload = payload_of(msg)
    payload[name] = data.draw(st.sampled_from([None, -1, "", b"\x00", [], {}, True, math.nan, "x" * 70_000]))
    try:
        decoded = decode_payload(packed(payload))
    except (InvalidField, MissingField) as exc:
        assert exc.field is not None
        assert exc.field.startswith(f"{msg.TYPE}.")
        assert str(exc).startswith(exc.field)
    else:
        assert isinstance(decoded, type(msg))  # the new value happened to be valid


# --- hostile streams: properties the fuzz run relies on ------------------------------------

client_messages = st.one_of(
    st.builds(
        Hello,
        versions=st.lists(st.integers(1, 2**63 - 1), min_size=1, max_size=16),
        software=plain(max_size=200),
    ),
    joins(),
    st.just(Heartbeat()),
    st.builds(WorkersFailed, round=counts, failure=failures),
    st.builds(WorkersSucceeded, round=counts),
    st.builds(Leave, reason=texts),
)


def server_side() -> FrameDecoder:
    return FrameDecoder(allowed=CLIENT_MESSAGES, expect_magic=True)


@given(msgs=st.lists(client_messages, max_size=6), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_property_any_split_after_magic_decodes_identically(msgs, cuts):
    stream = MAGIC + encode_many(msgs)
    assert feed_all(server_side(), chunked(stream, cuts)) == feed_all(server_side(), [stream]) == msgs


@given(msgs=st.lists(client_messages, min_size=1, max_size=6), data=st.data())
def test_property_a_truncated_stream_yields_its_whole_frames_and_keeps_the_rest(msgs, data):
    frames = [encode(m) for m in msgs]
    stream = MAGIC + b"".join(frames)
    cut = data.draw(st.integers(0, len(stream)))
    decoder = server_side()
    got = decoder.feed(stream[:cut])
    whole = 0
    end = len(MAGIC)
    while whole < len(frames) and end + len(frames[whole]) <= cut:
        end += len(frames[whole])
        whole += 1
    assert got == msgs[:whole]
    assert decoder.buffered == (cut - end if cut >= len(MAGIC) else cut)


@st.composite
def mutated_streams(draw):
    """A valid client stream with a few random edits: flips, overwrites, inserts, deletes."""
    stream = bytearray(MAGIC + encode_many(draw(st.lists(client_messages, min_size=1, max_size=4))))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(stream)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        if op == "insert" or i == len(stream):
            stream[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "flip":
            stream[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            stream[i] = draw(st.integers(0, 255))
        else:
            del stream[i : i + draw(st.integers(1, 16))]
    return bytes(stream)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(stream=mutated_streams(), cuts=st.lists(st.integers(0, 10**5), max_size=8))
def test_property_mutated_valid_streams_yield_valid_messages_or_a_protocol_error(stream, cuts):
    decoder = server_side()
    try:
        for msg in feed_all(decoder, chunked(stream, cuts)):
            assert type(msg) in CLIENT_MESSAGES.values()
            assert decode_payload(encode(msg)[HEADER.size :]) == msg  # it is a real, valid message
    except ProtocolError as first:
        # Dead from then on, with the same error, and holding nothing.
        with pytest.raises(ProtocolError) as again:
            decoder.feed(packed({"t": "heartbeat"}))
        assert again.value is first
        assert decoder.buffered == 0


@given(
    depth=st.integers(1, 50_000),
    opener=st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"]),
    where=st.sampled_from(["top", "field", "failure"]),
)
def test_property_nesting_of_any_depth_is_a_protocol_error(depth, opener, where):
    inner = opener * depth + b"\xc0"
    if where == "top":
        payload = inner
    elif where == "field":
        payload = b"\x82\xa1t\xa5leave\xa6reason" + inner
    else:
        payload = b"\x83\xa1t\xaeworkers_failed\xa5round\x00\xa7failure" + inner
    decoder = server_side()
    with pytest.raises(ProtocolError):
        decoder.feed(MAGIC + frame(payload))


@given(
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=20),
    limit=st.sampled_from([1, 64, 1000]),
)
def test_property_the_buffer_never_holds_more_than_one_frame(data, cuts, limit):
    # What a peer can make us hold: one frame of at most the limit, its header, and the magic.
    decoder = FrameDecoder(max_frame_size=limit, allowed=CLIENT_MESSAGES, expect_magic=True)
    try:
        for chunk in chunked(MAGIC + data, cuts):
            decoder.feed(chunk)
            assert decoder.buffered <= HEADER.size - 1 + limit or decoder.buffered <= len(MAGIC)
    except ProtocolError:
        assert decoder.buffered == 0


def test_a_dead_decoder_does_not_keep_its_bad_frame_alive():
    # Regression (found by tests/integration/test_server_fuzz.py): the kept error held the
    # traceback of the failed decode, whose frames held the buffer and the decoded objects, in
    # a cycle through the decoder; until a full collection, every bad frame pinned its size.
    import gc
    import tracemalloc

    bad = frame(packed({"t": "leave", "reason": "x" * 200_000}))  # too long: an InvalidField
    gc.disable()
    tracemalloc.start()
    try:
        for _ in range(20):
            decoder = FrameDecoder()
            with pytest.raises(InvalidField) as info:
                decoder.feed(bad)
            assert info.value.__context__ is None
            del decoder, info
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 2 * len(bad), held


# --- frame limits per stage, and msgpack's limits ---------------------------------------

WIDE = "\U0001f600"


def _grown(value: typing.Any) -> list[typing.Any]:
    """Values one step larger on the wire than ``value``, which its field must refuse."""
    if isinstance(value, str):
        return [value + "f", value[:-1] + WIDE] if value and not value[-1:] == WIDE else [value + WIDE]
    if isinstance(value, tuple):
        return [(*value, value[-1])] if value else []  # empty: a rule of the message keeps it so
    if isinstance(value, bool | float):
        return []  # every value of these has the same size
    if isinstance(value, int):
        return [] if len(msgpack.packb(value)) == 9 else [value + 1]
    return []


def _assert_largest(
    msg: typing.Any, path: str, within: typing.Callable[[typing.Any], typing.Any] = lambda m: m
) -> None:
    """No field of ``msg`` can grow; ``within`` puts a changed ``msg`` back into the message it
    is nested in, whose own rules may refuse what ``msg``'s allow (a Resume's assignment)."""
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if dataclasses.is_dataclass(value):
            name = f.name
            _assert_largest(
                value, f"{path}.{name}", lambda v, name=name: within(dataclasses.replace(msg, **{name: v}))
            )
            continue
        for bigger in _grown(value):
            try:
                within(dataclasses.replace(msg, **{f.name: bigger}))
            except InvalidField:
                continue
            raise AssertionError(f"{path}.{f.name} could be larger: {bigger!r:.80}")


def test_a_resume_never_echoes_the_restore_digests():
    # The one Assignment field a Resume may not carry (it would double the join-stage frame).
    a = largest_client_messages()[Resume].assignment
    with pytest.raises(InvalidField, match="restore_digests"):
        Resume(
            join=largest_client_messages()[Resume].join,
            assignment=dataclasses.replace(a, restore_digests=("0" * 64,)),
        )


def test_every_client_message_has_a_largest_example_and_it_is_the_largest():
    examples = largest_client_messages()
    assert set(examples) == set(CLIENT_MESSAGES.values())
    for cls, msg in examples.items():
        assert type(msg) is cls
        _assert_largest(msg, cls.TYPE)


def test_the_written_frame_limits_are_the_schemas():
    # FRAME_LIMITS is computed_frame_limits() written down (a server start skips computing it):
    # a schema change that moves a limit must write the new one there.
    assert frame_limits() == computed_frame_limits()


def test_the_largest_legal_message_of_each_stage_fits_its_frame_limit():
    limits = frame_limits()
    sizes = {cls: len(encode(msg)) - HEADER.size for cls, msg in largest_client_messages().items()}
    assert sizes[Hello] <= limits.hello <= 4096  # a hello is small: so is what a stranger may send
    for cls in (Join, Resume, Leave, Heartbeat):
        assert sizes[cls] <= limits.join
    assert max(sizes.values()) <= limits.member <= MAX_FRAME_SIZE
    # and each decodes (the container and string limits let the largest through)
    for msg in largest_client_messages().values():
        decoder = FrameDecoder(max_frame_size=limits.member, allowed=CLIENT_MESSAGES)
        assert decoder.feed(encode(msg)) == [msg]


def test_a_frame_of_a_million_empty_maps_is_refused_without_decoding_it():
    # The attack of issue 17: 1 MiB of empty maps under an unknown key cost 55 ms and 73 MB.
    import tracemalloc

    n = 1_000_000
    flat = b"\x82\xa1t\xa5hello\xa1x\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    # The same in arrays short enough to pass the array limit: the container budget stops it.
    chunk = b"\xdc\x00\x40" + b"\x80" * 64
    nested = b"\x82\xa1t\xa5hello\xa1x\xdc\x00\x40" + chunk * 64
    for payload, why in (
        (flat, "not valid msgpack"),
        (nested, f"more than {MAX_CONTAINERS} maps and arrays"),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(MalformedFrame, match=why):
                decode_payload(payload)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
    # A map wider than any message is refused by its header.
    wide = msgpack.packb({"t": "leave", **{f"k{i}": 0 for i in range(MAX_MAP_LEN + 1)}})
    with pytest.raises(MalformedFrame):
        decode_payload(wide)
    # Before its hello, a peer's frame may hold 2 KiB at most: the header alone is refused.
    decoder = FrameDecoder(max_frame_size=frame_limits().hello, expect_magic=True)
    with pytest.raises(FrameTooLarge):
        decoder.feed(MAGIC + HEADER.pack(len(flat)))


def test_feed_with_a_limit_takes_frames_a_few_at_a_time_and_the_limit_may_change():
    hello = encode(Hello(versions=(1,), software="t"))
    join = encode(JOIN)
    decoder = FrameDecoder(max_frame_size=frame_limits().hello, expect_magic=True)
    stream = MAGIC + hello + encode(Heartbeat()) * 3 + join
    assert decoder.feed(stream, limit=1) == [Hello(versions=(1,), software="t")]
    assert decoder.feed(limit=2) == [Heartbeat(), Heartbeat()]
    assert decoder.feed(limit=1) == [Heartbeat()]
    assert decoder.buffered == len(join)
    decoder.max_frame_size = len(join) - HEADER.size - 1  # the join's stage would not allow it
    with pytest.raises(FrameTooLarge):
        decoder.feed(limit=1)
    decoder = FrameDecoder(expect_magic=True)
    decoder.feed(stream, limit=1)
    decoder.max_frame_size = len(join)
    assert decoder.feed() == [Heartbeat()] * 3 + [JOIN]
    assert decoder.buffered == 0
