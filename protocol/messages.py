"""The messages of the rendezvous protocol, as validated frozen dataclasses.

A message is a frozen, keyword-only dataclass with a ``TYPE`` class attribute, the
tag it carries on the wire. Constructors validate every field, so a message that
exists is a message that is well-formed: the state machines never re-check a
port range or an empty id, and a bad value is reported once, at the edge, as an
``InvalidField`` naming ``<type>.<field>``. The codec decodes by calling these
same constructors, which is why there is exactly one set of rules for what the
peer may send and what we may build.

Each field declares its rule next to its type, as ``field(metadata=<rule>)``; a
rule is a function that returns the (possibly coerced) value or raises
``_Reject`` with the reason. Two coercions exist, both for values that arrive
from msgpack: an int where a float is expected becomes a float, and a list where
a tuple is expected becomes a tuple. ``bool`` is never accepted as an int, even
though Python says it is one: ``nproc=True`` is a bug, not 1. Relations between
fields (``min_nodes <= max_nodes``, ``group_rank < group_world_size``) are
checked after the fields, in ``_check_relations``.

Limits bound everything a peer controls, so no single message can exceed the
default frame size and no value can overflow msgpack's 64-bit integers.

Revisions within protocol version 1. Both kinds of change below keep old and new peers
working together, so neither bumps ``PROTOCOL_VERSION``; anything else does.

- A new optional field, whose default means "not given": the codec ignores keys it does not
  know, so an older peer drops it, and a newer one decoding an older peer's frame gets the
  default. (``Join.node_rank``, -1: the agent was given no ``--node-rank``;
  ``Join.node_secret``, "": an agent that proves nothing about its node;
  ``Leave.workers_stopping``, False: a plain Leave; ``Waiting.spare``, False: the node waits
  for its round, not as a hot spare; ``Restart.report`` and ``JobFailed.report``, "": no
  job-wide hang report.)
- A new server -> agent message whose only use is in a moment where an older agent expects
  the connection to close anyway: the older agent fails to decode it, treats that as the lost
  connection it expected, and so does what it did before. (``GoingAway``: it reconnects;
  ``Left``: it exits after its ``Leave``.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import field, fields
from typing import Any, ClassVar, TypeAlias

from protocol.errors import InvalidField, ProtocolError, VersionMismatch, describe
from protocol.records import record

__all__ = [
    "CLIENT_MESSAGES",
    "MAX_ADDR_LEN",
    "MAX_CODE_LEN",
    "MAX_COUNT",
    "MAX_ID_LEN",
    "MAX_NODES",
    "MAX_NPROC",
    "MAX_TEXT_LEN",
    "MAX_TIMEOUT",
    "MAX_VERSIONS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SERVER_MESSAGES",
    "SUPPORTED_VERSIONS",
    "Assignment",
    "Error",
    "Failure",
    "GoingAway",
    "Heartbeat",
    "Hello",
    "JobDone",
    "JobFailed",
    "Join",
    "Leave",
    "Left",
    "Message",
    "Restart",
    "Waiting",
    "Welcome",
    "WorkersFailed",
    "WorkersSucceeded",
    "clip_text",
    "negotiate_version",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)

MAX_ID_LEN = 256
MAX_ADDR_LEN = 256
MAX_TEXT_LEN = 65536
MAX_CODE_LEN = 64
# JobDone/JobFailed.summary: the job's goodput in one line (issue 47), for the agents' consoles.
MAX_SUMMARY_LEN = 512
MAX_PATH_LEN = 4096  # PATH_MAX on Linux
MAX_NODES = 1_000_000
MAX_NPROC = 4096
MAX_TIMEOUT = 1e7
MAX_VERSIONS = 16
# Counts, rounds and versions stay below 2**63 so they fit msgpack's int64.
MAX_COUNT = 2**63 - 1
MAX_PHASE_LEN = 32
# A Stacks message holds at most MAX_STACK_RANKS ranks (the hung ones first) of at most
# MAX_STACK_LEN characters each (innermost frames kept), so it stays under the member frame
# limit; the agent's log dir keeps every rank's full stacks.
MAX_STACK_RANKS = 32
MAX_STACK_LEN = 2048
MAX_RESTORE_SOURCES = 64  # the agents one node's ranks restore from (issue 35)
MAX_DURABLE_STEPS = 4  # the steps one Join offers from its snapshot directory (issue 35)
MAX_HUNG_RANKS = 64  # the hung ranks one HangDetected names (a node has at most MAX_NPROC)
MAX_STANDBYS = 4  # the standby rendezvous hosts a job's agent-hosted server names (issue 45)
_MIN_INT64 = -(2**63)
# Unix seconds; 2**53 is where floats stop holding every integer exactly.
_MAX_TIMESTAMP = float(2**53)


# --- rules -------------------------------------------------------------------


class _Reject(Exception):
    """Raised by a rule; ``_Schema.__post_init__`` turns it into InvalidField."""


_Rule = Callable[[Any], Any]


def _rule(check: _Rule, *, nested: type | None = None) -> dict[str, Any]:
    # ``nested`` tells the codec to decode a sub-map into that class first.
    return {"check": check, "nested": nested}


def _bounds_text(lo: int, hi: int) -> str:
    if hi == MAX_COUNT:
        return f">= {lo}"
    return f"in {lo}..{hi}"


def _integer(lo: int, hi: int) -> dict[str, Any]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Reject(f"must be an int {_bounds_text(lo, hi)}, got {describe(value)}")
        if not lo <= value <= hi:
            raise _Reject(f"must be {_bounds_text(lo, hi)}, got {describe(value)}")
        return value

    return _rule(check)


def _number(*, positive: bool = False, hi: float = MAX_TIMEOUT) -> dict[str, Any]:
    bound = f"{'> 0' if positive else '>= 0'} and <= {hi:g}"

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Reject(f"must be a number {bound}, got {describe(value)}")
        # NaN fails every comparison and inf fails ``<= hi``, so the range test also
        # rejects non-finite floats. It runs before float(), which would raise
        # OverflowError on a huge int.
        in_range = (value > 0 if positive else value >= 0) and value <= hi
        if not in_range:
            raise _Reject(f"must be a finite number {bound}, got {describe(value)}")
        return float(value)

    return _rule(check)


# C0 controls (ESC among them, so no ANSI sequence), DEL and C1 controls: an id holding one
# could forge lines in a log or rows in a terminal table. Free texts may hold them (a worker's
# stderr tail has newlines); whoever shows a text escapes it.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _text(
    max_len: int,
    *,
    nonempty: bool = False,
    optional: bool = False,
    plain: bool = False,
    ascii_only: bool = False,
) -> dict[str, Any]:
    """A string of at most ``max_len`` characters; ``plain``: no control characters (ids,
    addresses, codes); ``ascii_only``: printable ASCII only (proofs and secrets, which are hex or
    base64 and compared byte for byte)."""

    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            kind = "a string or None" if optional else "a string"
            raise _Reject(f"must be {kind}, got {describe(value)}")
        if nonempty and not value:
            raise _Reject("must not be empty")
        if len(value) > max_len:
            raise _Reject(f"must be at most {max_len} characters, got {len(value)}")
        if ascii_only and not (value.isascii() and value.isprintable()):
            raise _Reject("must be printable ASCII")
        if plain and (bad := _CONTROL.search(value)) is not None:
            raise _Reject(f"must not hold control characters, got {bad.group()!r} at {bad.start()}")
        # A lone surrogate passes isinstance but cannot be sent as UTF-8; catch it
        # here, with the field's name, rather than as a UnicodeEncodeError in encode.
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _Reject("must be valid UTF-8 text (contains a lone surrogate)") from None
        return value

    return _rule(check)


def _choice(allowed: tuple[str, ...]) -> dict[str, Any]:
    def check(value: Any) -> str:
        if value not in allowed or not isinstance(value, str):
            raise _Reject(f"must be one of {', '.join(allowed)}, got {describe(value)}")
        return value

    return _rule(check)


def _flag() -> dict[str, Any]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise _Reject(f"must be a bool, got {describe(value)}")
        return value

    return _rule(check)


def _versions() -> dict[str, Any]:
    def check(value: Any) -> tuple[int, ...]:
        if not isinstance(value, list | tuple):
            raise _Reject(f"must be a list of ints, got {describe(value)}")
        if not 1 <= len(value) <= MAX_VERSIONS:
            raise _Reject(f"must hold 1..{MAX_VERSIONS} versions, got {len(value)}")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= MAX_COUNT:
                raise _Reject(f"must hold ints >= 1, got {describe(item)}")
        return tuple(value)

    return _rule(check)


def _failure(*, optional: bool = False) -> dict[str, Any]:
    def check(value: Any) -> Failure | None:
        if value is None and optional:
            return None
        if not isinstance(value, Failure):
            kind = "a Failure or None" if optional else "a Failure"
            raise _Reject(f"must be {kind}, got {describe(value)}")
        return value

    # Called from the class bodies below Failure, so the name is bound by then.
    return _rule(check, nested=Failure)


def _nested(cls: type) -> dict[str, Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, cls):
            raise _Reject(f"must be a {cls.__name__}, got {describe(value)}")
        return value

    return _rule(check, nested=cls)


def _items(check_item: _Rule, what: str, max_items: int) -> dict[str, Any]:
    """A list of at most ``max_items`` values, each passing ``check_item`` (a field's rule)."""

    def check(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise _Reject(f"must be a list of {what}, got {describe(value)}")
        if len(value) > max_items:
            raise _Reject(f"must hold at most {max_items} items, got {len(value)}")
        out = []
        for i, item in enumerate(value):
            try:
                out.append(check_item(item))
            except _Reject as why:
                raise _Reject(f"item {i}: {why}") from None
        return tuple(out)

    return _rule(check)


_ID = _text(MAX_ID_LEN, nonempty=True, plain=True)
_ADDR = _text(MAX_ADDR_LEN, plain=True)
_TEXT = _text(MAX_TEXT_LEN)
_SOFTWARE = _text(MAX_ID_LEN, plain=True)
_SECRET = _text(128, ascii_only=True)  # proofs, challenges and node secrets
_COUNT = _integer(0, MAX_COUNT)
_PORT = _integer(1, 65535)
_TIMEOUT = _number()
_INTERVAL = _number(positive=True)
_STEP = _integer(-1, MAX_COUNT)  # a training step; -1: none reported yet
_PHASE = _text(MAX_PHASE_LEN, plain=True)  # a worker's phase name ("": none)


def _digest_rule() -> dict[str, Any]:
    """A snapshot's sha256, 64 lowercase hex digits, or "" (not known)."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise _Reject(f"must be a string, got {describe(value)}")
        if value and (len(value) != 64 or value.strip("0123456789abcdef")):
            raise _Reject("must be a sha256 as 64 lowercase hex digits, or empty")
        return value

    return _rule(check)


_DIGEST = _digest_rule()

_MAX_MILLIS = MAX_TIMEOUT * 1000
_MILLIS = _number(hi=_MAX_MILLIS)


class _Schema:
    """Shared validation for messages and nested records."""

    __slots__ = ()

    # Set for each class by _compile() at the bottom of this module.
    _PATH: ClassVar[str]
    _CHECKS: ClassVar[tuple[tuple[str, _Rule], ...]]

    def __post_init__(self) -> None:
        for name, check in self._CHECKS:
            value = getattr(self, name)
            try:
                checked = check(value)
            except _Reject as why:
                raise InvalidField(f"{self._PATH}.{name}", str(why)) from None
            if checked is not value:
                # Frozen: coercions (int -> float, list -> tuple) go around __setattr__.
                object.__setattr__(self, name, checked)
        self._check_relations()

    def _check_relations(self) -> None:
        """Checks that span fields; runs after every field passed its own rule."""

    def _copy_with(self, **changes: Any) -> Any:
        """This message with ``changes``, not validated again.

        For a sender that builds many messages alike (a round's Assignments differ only in
        two counters) and keeps the changed values in bounds by construction: the first is
        built, and so checked, by the constructor.
        """
        new = object.__new__(type(self))
        for name, _ in self._CHECKS:
            object.__setattr__(new, name, changes[name] if name in changes else getattr(self, name))
        return new

    def _invalid(self, name: str, reason: str) -> InvalidField:
        return InvalidField(f"{self._PATH}.{name}", reason)


# --- nested records ----------------------------------------------------------


@record(frozen=True, kw_only=True, slots=True)
class Failure(_Schema):
    """Which worker failed and how; nested inside WorkersFailed and JobFailed."""

    node_id: str = field(metadata=_ID)
    addr: str = field(metadata=_ADDR)
    rank: int = field(metadata=_COUNT)
    local_rank: int = field(metadata=_COUNT)
    # Negative means the worker was killed by signal -exitcode, as in subprocess.
    exitcode: int = field(metadata=_integer(_MIN_INT64, MAX_COUNT))
    signal: str = field(default="", metadata=_text(MAX_CODE_LEN, plain=True))
    # Wall-clock time on the failing node; informational only, never compared.
    timestamp: float = field(metadata=_number(hi=_MAX_TIMESTAMP))
    message: str = field(default="", metadata=_TEXT)
    # torchrun's report fields: the worker's pid (0: unknown) and the @record error file it
    # wrote ("" when it wrote none). Added within version 1: older peers ignore them.
    pid: int = field(default=0, metadata=_COUNT)
    error_file: str = field(default="", metadata=_text(MAX_PATH_LEN))


# --- client -> server --------------------------------------------------------


@record(frozen=True, kw_only=True, slots=True)
class Hello(_Schema):
    """First frame after MAGIC: the protocol versions the client speaks."""

    TYPE: ClassVar[str] = "hello"
    versions: tuple[int, ...] = field(metadata=_versions())
    software: str = field(metadata=_SOFTWARE)


@record(frozen=True, kw_only=True, slots=True)
class Join(_Schema):
    """A node asks to take part in the job's next round."""

    TYPE: ClassVar[str] = "join"
    job_id: str = field(metadata=_ID)
    node_id: str = field(metadata=_ID)
    addr: str = field(metadata=_ADDR)
    nproc: int = field(metadata=_integer(1, MAX_NPROC))
    min_nodes: int = field(metadata=_integer(1, MAX_NODES))
    max_nodes: int = field(metadata=_integer(1, MAX_NODES))
    entrypoint: str = field(metadata=_TEXT)
    master_port: int = field(metadata=_PORT)
    max_restarts: int = field(metadata=_COUNT)
    last_call_timeout: float = field(metadata=_TIMEOUT)
    heartbeat_interval: float = field(metadata=_INTERVAL)
    heartbeat_timeout: float = field(metadata=_INTERVAL)
    spare: bool = field(default=False, metadata=_flag())
    # A node whose workers failed this many times is excluded from the job (0: never).
    exclude_after: int = field(default=0, metadata=_COUNT)
    # HMAC of the server's challenge with the job's token (protocol.auth); "" without a token.
    proof: str = field(default="", metadata=_SECRET)
    # --node-rank, when the agent was given one (-1: not given). In a fixed-size job whose
    # nodes all give one the server orders group ranks by it (rdzv_server/machine/state.py, which
    # also refuses one that is out of range or taken: that is a rule of the job, not of
    # this message). Added within version 1: an older server ignores it.
    node_rank: int = field(default=-1, metadata=_integer(-1, MAX_NODES - 1))
    # A random secret the agent picks once per run and sends in every Join (and the Join
    # inside a Resume): only the holder may resume this node's place, since a job token
    # proves the job, not the node. Never shown by the server. "": an older agent.
    node_secret: str = field(default="", metadata=_SECRET)
    # Training-health settings of the job, from --rdzv-conf (issue 19); like exclude_after,
    # every node of a job must send the same. Added within version 1: an older server ignores
    # them. straggler_threshold: a rank whose compute speed is below this fraction of the
    # job's median is flagged; exclude_stragglers: a flagged node is left out of the next
    # planned round; crash_loop_restarts: this many restarts in a row with no step progress
    # end the job (0: never).
    straggler_threshold: float = field(default=0.75, metadata=_number(hi=1.0))
    exclude_stragglers: bool = field(default=False, metadata=_flag())
    crash_loop_restarts: int = field(default=3, metadata=_integer(0, 1_000_000))
    # Commit-point restarts (issue 20), from --rdzv-conf; every node of a job sends the same.
    # commit_timeout: the checkpoint budget of a commit, seconds (0: no commits, every planned
    # change restarts at once as before); commit_steps: how many steps past the highest one
    # reported the job stops at (0: derived from the measured step time). Added within
    # version 1: an older server ignores them (and never asks for a commit).
    commit_timeout: float = field(default=300.0, metadata=_number())
    commit_steps: int = field(default=0, metadata=_integer(0, 1_000_000))
    # This agent can host the workers' TCPStore on master_port (issue 21): it listens there
    # and its store process has torch, or is importing it. Added within version 1: an older
    # agent sends none (False: worker rank 0 hosts the store, as before).
    hosts_store: bool = field(default=False, metadata=_flag())
    # In-memory snapshots (issue 35): the port this agent serves its snapshot replicas on (0:
    # none; the host is the node's address) and the key a peer proves to it, relayed by the
    # server to the job's other agents only (Assignment.replica_key/restore_keys). Never
    # shown. Added within version 1: an older server ignores them (no replication).
    replica_port: int = field(default=0, metadata=_integer(0, 65535))
    replica_key: str = field(default="", metadata=_SECRET)
    # The sha256 of the certificate its replica server shows when the rendezvous uses TLS (the
    # replica channel then uses TLS too, pinned to it; issue 42); "": plain TCP. A new key (and
    # certificate) at every Join: a node that left cannot use the one it knew. Never shown.
    replica_cert: str = field(default="", metadata=_DIGEST)
    # Issue 45: the port this agent would host the rendezvous on should the agent hosting it
    # be lost (0: it cannot). Added within version 1: an older server ignores it.
    standby_port: int = field(default=0, metadata=_integer(0, 65535))
    # Durable snapshots (issue 35, --snapshot-dir): the newest steps (newest first) whose
    # snapshots this agent finds complete for every rank of a job of durable_world ranks in its
    # snapshot directory (-1, (): none, or no directory). The server restores a round from the
    # newest step every member has, when no newer one is in memory. Added within version 1:
    # an older server ignores them.
    durable_world: int = field(default=-1, metadata=_integer(-1, MAX_COUNT))
    durable_steps: tuple[int, ...] = field(
        default=(), metadata=_items(_COUNT["check"], "steps", MAX_DURABLE_STEPS)
    )

    def _check_relations(self) -> None:
        if self.max_nodes < self.min_nodes:
            raise self._invalid("max_nodes", f"must be >= min_nodes ({self.min_nodes}), got {self.max_nodes}")
        if self.durable_world == 0:
            raise self._invalid("durable_world", "must be -1 (none) or a world size, got 0")
        if self.durable_steps and self.durable_world < 1:
            raise self._invalid("durable_steps", "given without a durable_world")


@record(frozen=True, kw_only=True, slots=True)
class Heartbeat(_Schema):
    """The node is alive; carries nothing, the arrival is the message."""

    TYPE: ClassVar[str] = "heartbeat"


@record(frozen=True, kw_only=True, slots=True)
class WorkersFailed(_Schema):
    """A worker of this node failed during ``round``."""

    TYPE: ClassVar[str] = "workers_failed"
    round: int = field(metadata=_COUNT)
    failure: Failure = field(metadata=_failure())
    # The highest step any rank of this node reported in the round (-1: none), so that the
    # server's crash-loop rule rests on what its state log keeps (Progress is not logged).
    # Added within version 1: an older agent sends none.
    step: int = field(default=-1, metadata=_STEP)
    # The restore step this node could not get for a rank of its own before its workers
    # started (every listed holder failed or sent bytes without the owner's digest; -1: not
    # that): the server restores the next round from an older step (issue 42). Added within
    # version 1: an older agent sends none.
    restore_failed: int = field(default=-1, metadata=_STEP)


@record(frozen=True, kw_only=True, slots=True)
class WorkersSucceeded(_Schema):
    """Every worker of this node exited 0 in ``round``."""

    TYPE: ClassVar[str] = "workers_succeeded"
    round: int = field(metadata=_COUNT)
    # How long before this report the node's most recent step was reported (ms; 0: no step,
    # unknown, or an older agent): the server's goodput ends the training there, not at the
    # report (the process group's teardown and the interpreters' exit are not training).
    # Added within version 1: an older agent sends none.
    idle_ms: float = field(default=0.0, metadata=_MILLIS)


@record(frozen=True, kw_only=True, slots=True)
class Leave(_Schema):
    """The node is going away on purpose (not a failure).

    ``workers_stopping``: a notice sent when the node starts stopping its workers to leave
    (a drain). The server restarts the others' round at once but keeps the node's place, not
    ready, so no next round can start while those workers live; the node's plain ``Leave``
    (sent once its workers have exited) is the one that removes it and is answered ``Left``.
    Added within version 1: an older server takes the notice for the Leave itself.
    """

    TYPE: ClassVar[str] = "leave"
    reason: str = field(default="", metadata=_TEXT)
    workers_stopping: bool = field(default=False, metadata=_flag())


# --- training progress and hangs (client -> server) ---------------------------


@record(frozen=True, kw_only=True, slots=True)
class Progress(_Schema):
    """The node's training progress in ``round``, sent with its heartbeats while it changes.

    One summary per node, so its size does not grow with the job: the slowest and fastest
    rank's last step, the node's step-time percentiles, the phase of its least recent rank and
    how long ago that rank last reported, and, per local rank, the median time a step spent in
    the "compute" phase (0: not reported), from which the server scores stragglers.
    """

    TYPE: ClassVar[str] = "progress"
    round: int = field(metadata=_COUNT)
    min_step: int = field(metadata=_STEP)
    max_step: int = field(metadata=_STEP)
    step_p50_ms: float = field(default=0.0, metadata=_MILLIS)
    step_p90_ms: float = field(default=0.0, metadata=_MILLIS)
    phase: str = field(default="", metadata=_PHASE)
    age_ms: float = field(default=0.0, metadata=_MILLIS)
    compute_ms: tuple[float, ...] = field(default=(), metadata=_items(_MILLIS["check"], "numbers", MAX_NPROC))
    # Every local rank calls ``worker.should_stop()`` (its page says so): the job can stop at a
    # commit point. Added within version 1: an older agent sends none (no commits).
    checks: bool = field(default=False, metadata=_flag())

    def __post_init__(self) -> None:
        # Every node of every job sends one of these each second (10,000 a second at 10,000
        # nodes): the shape they all have is checked here in a few comparisons, a quarter of
        # the general rules' cost. Anything else (ints for floats, non-ASCII phase names, a
        # value out of range) takes the general rules, which say what is wrong.
        c = self.compute_ms
        if (
            type(self.round) is int
            and 0 <= self.round <= MAX_COUNT
            and type(self.min_step) is int
            and type(self.max_step) is int
            and -1 <= self.min_step <= self.max_step <= MAX_COUNT
            and type(self.step_p50_ms) is float
            and 0.0 <= self.step_p50_ms <= _MAX_MILLIS
            and type(self.step_p90_ms) is float
            and 0.0 <= self.step_p90_ms <= _MAX_MILLIS
            and type(self.age_ms) is float
            and 0.0 <= self.age_ms <= _MAX_MILLIS
            and type(self.phase) is str
            and len(self.phase) <= MAX_PHASE_LEN
            and self.phase.isascii()
            and (self.phase.isprintable() or not self.phase)
            and type(self.checks) is bool
            and type(c) in (tuple, list)
            and len(c) <= MAX_NPROC
            and all(type(x) is float and 0.0 <= x <= _MAX_MILLIS for x in c)
        ):
            if type(c) is not tuple:
                object.__setattr__(self, "compute_ms", tuple(c))
            return
        _Schema.__post_init__(self)

    def _check_relations(self) -> None:
        if self.max_step < self.min_step:
            raise self._invalid("max_step", f"must be >= min_step ({self.min_step}), got {self.max_step}")


MAX_HELD = MAX_NPROC  # (rank, step) pairs one SnapshotsHeld names (newest first when cut)


@record(frozen=True, kw_only=True, slots=True)
class SnapshotsHeld(_Schema):
    """The complete snapshots this node holds (issue 35): its own ranks' and the replicas it
    keeps for a peer, as pairs (``ranks[i]`` at step ``steps[i]``), all of a job of
    ``world_size`` ranks. Sent when they change, at most once a heartbeat; from it the server
    picks the one step every rank restores from. Sent only by an agent that snapshots: an
    older server never gets one."""

    TYPE: ClassVar[str] = "snapshots_held"
    world_size: int = field(metadata=_integer(1, MAX_COUNT))
    ranks: tuple[int, ...] = field(default=(), metadata=_items(_COUNT["check"], "ranks", MAX_HELD))
    steps: tuple[int, ...] = field(default=(), metadata=_items(_COUNT["check"], "steps", MAX_HELD))
    # The sha256 of each pair's file where this node knows it ("": not known; (): none known,
    # an older agent): the owner's, for its own ranks, becomes the digest every copy of that
    # snapshot must have (issue 42); a replica is taken only with the owner's digest.
    digests: tuple[str, ...] = field(default=(), metadata=_items(_DIGEST["check"], "digests", MAX_HELD))
    # Every snapshot of this node's own ranks holds state every rank holds alike (the workers
    # wrote them with ``replicated=True``: data parallelism): after the world size changes,
    # the server may restore any rank from one of them. Added within version 1.
    replicated: bool = field(default=False, metadata=_flag())

    def _check_relations(self) -> None:
        if len(self.steps) != len(self.ranks):
            raise self._invalid(
                "steps", f"must have one step per rank ({len(self.ranks)}), got {len(self.steps)}"
            )
        if self.digests and len(self.digests) != len(self.ranks):
            raise self._invalid(
                "digests",
                f"must have one digest per rank ({len(self.ranks)}) or none, got {len(self.digests)}",
            )


@record(frozen=True, kw_only=True, slots=True)
class HangDetected(_Schema):
    """Ranks of this node made no progress past their deadline in ``round``.

    The server asks every node of the job for its ranks' stacks (``CollectStacks``); this
    node collects its own, sends them, and then reports its failure as usual.
    """

    TYPE: ClassVar[str] = "hang_detected"
    round: int = field(metadata=_COUNT)
    ranks: tuple[int, ...] = field(metadata=_items(_COUNT["check"], "ranks", MAX_HUNG_RANKS))
    step: int = field(metadata=_STEP)  # the first hung rank's last step
    phase: str = field(default="", metadata=_PHASE)
    silent_s: float = field(default=0.0, metadata=_TIMEOUT)  # how long it had made no progress


@record(frozen=True, kw_only=True, slots=True)
class Stacks(_Schema):
    """Each local rank's stacks (every thread) in ``round``, after a hang; parallel lists."""

    TYPE: ClassVar[str] = "stacks"
    round: int = field(metadata=_COUNT)
    ranks: tuple[int, ...] = field(metadata=_items(_COUNT["check"], "ranks", MAX_STACK_RANKS))
    steps: tuple[int, ...] = field(metadata=_items(_STEP["check"], "steps", MAX_STACK_RANKS))
    phases: tuple[str, ...] = field(metadata=_items(_PHASE["check"], "phase names", MAX_STACK_RANKS))
    silent_s: tuple[float, ...] = field(metadata=_items(_TIMEOUT["check"], "numbers", MAX_STACK_RANKS))
    stacks: tuple[str, ...] = field(metadata=_items(_text(MAX_STACK_LEN)["check"], "texts", MAX_STACK_RANKS))

    def _check_relations(self) -> None:
        n = len(self.ranks)
        for name in ("steps", "phases", "silent_s", "stacks"):
            if len(getattr(self, name)) != n:
                raise self._invalid(
                    name, f"must hold one item per rank ({n}), got {len(getattr(self, name))}"
                )


@record(frozen=True, kw_only=True, slots=True)
class Armed(_Schema):
    """The answer to ``StopAt(state="arm")``: ``step`` is in every local rank's page.

    ``late``: a local rank had already decided whether to stop at a step at or past ``step``
    (it said no before the page said ``step``), or a page could not take it: the job cannot
    stop there, and the server picks a later step. ``checked``: the highest step a local rank
    had decided at (-1: none).
    """

    TYPE: ClassVar[str] = "armed"
    round: int = field(metadata=_COUNT)
    step: int = field(metadata=_COUNT)
    late: bool = field(metadata=_flag())
    checked: int = field(default=-1, metadata=_STEP)


@record(frozen=True, kw_only=True, slots=True)
class WorkersCommitted(_Schema):
    """Every worker of this node stopped at one step ``step`` (at or past the commit step) and
    exited 0 in ``round`` (a planned stop, not a success of the job and not a failure)."""

    TYPE: ClassVar[str] = "workers_committed"
    round: int = field(metadata=_COUNT)
    step: int = field(metadata=_COUNT)


@record(frozen=True, kw_only=True, slots=True)
class LeaveAfterCommit(_Schema):
    """The node wants to leave (SIGTERM to an elastic agent): stop the job's training at a
    commit point first, then send this node ``Drain``. Its workers run on meanwhile; the agent
    drains by itself if no ``Drain`` comes within its commit budget."""

    TYPE: ClassVar[str] = "leave_after_commit"
    round: int = field(metadata=_COUNT)
    reason: str = field(default="", metadata=_TEXT)


# --- server -> client --------------------------------------------------------


@record(frozen=True, kw_only=True, slots=True)
class Welcome(_Schema):
    """Reply to Hello: the version both sides will speak."""

    TYPE: ClassVar[str] = "welcome"
    version: int = field(metadata=_integer(1, MAX_COUNT))
    software: str = field(metadata=_SOFTWARE)
    # A fresh random nonce per connection; a Join must prove the token over it (so a proof
    # seen on one connection is worthless on another). "" when the server needs no token.
    challenge: str = field(default="", metadata=_SECRET)


@record(frozen=True, kw_only=True, slots=True)
class Waiting(_Schema):
    """The node is joined but the round has not formed yet."""

    TYPE: ClassVar[str] = "waiting"
    job_id: str = field(metadata=_ID)
    round: int = field(metadata=_COUNT)
    joined: int = field(metadata=_COUNT)
    min_nodes: int = field(metadata=_integer(1, MAX_NODES))
    max_nodes: int = field(metadata=_integer(1, MAX_NODES))
    reason: str = field(default="", metadata=_TEXT)
    # The node waits as a hot spare (the job is full), not for its round to form.
    spare: bool = field(default=False, metadata=_flag())

    def _check_relations(self) -> None:
        if self.max_nodes < self.min_nodes:
            raise self._invalid("max_nodes", f"must be >= min_nodes ({self.min_nodes}), got {self.max_nodes}")


@record(frozen=True, kw_only=True, slots=True)
class Assignment(_Schema):
    """The round formed: this node's place in it and where to rendezvous."""

    TYPE: ClassVar[str] = "assignment"
    job_id: str = field(metadata=_ID)
    round: int = field(metadata=_COUNT)
    group_rank: int = field(metadata=_COUNT)
    group_world_size: int = field(metadata=_integer(1, MAX_NODES))
    rank_offset: int = field(metadata=_COUNT)
    world_size: int = field(metadata=_integer(1, MAX_COUNT))
    master_addr: str = field(metadata=_text(MAX_ADDR_LEN, nonempty=True, plain=True))
    master_port: int = field(metadata=_PORT)
    restart_count: int = field(metadata=_COUNT)
    max_restarts: int = field(metadata=_COUNT)
    # The group-rank-0 node's agent hosts the round's TCPStore (its Join said hosts_store):
    # every worker connects as a client, TORCHELASTIC_USE_AGENT_STORE=True as under torchrun.
    # Added within version 1: an older server sends none (False: worker rank 0 hosts it).
    agent_store: bool = field(default=False, metadata=_flag())
    # In-memory snapshots (issue 35), all "not given" from an older server. restore_step: the
    # step every rank of the job restores from (-1: none); restore_source: per local rank, -1
    # (this node holds its snapshot) or an index into restore_addrs ("host:port" of an agent
    # holding it) and restore_keys (that agent's key); replica_to/replica_key: the agent this
    # node replicates its ranks' snapshots to ("": none, a job of one node).
    restore_step: int = field(default=-1, metadata=_STEP)
    restore_source: tuple[int, ...] = field(
        default=(), metadata=_items(_integer(-1, MAX_RESTORE_SOURCES - 1)["check"], "indices", MAX_NPROC)
    )
    restore_addrs: tuple[str, ...] = field(
        default=(), metadata=_items(_ADDR["check"], "addresses", MAX_RESTORE_SOURCES)
    )
    restore_keys: tuple[str, ...] = field(
        default=(), metadata=_items(_SECRET["check"], "keys", MAX_RESTORE_SOURCES)
    )
    replica_to: str = field(default="", metadata=_text(MAX_ADDR_LEN, plain=True))
    replica_key: str = field(default="", metadata=_SECRET)
    # restore_step's snapshots are the ones every member's Join offered from its snapshot
    # directory (durable_steps), not in memory: each node reads its ranks' back before its
    # workers start. Added within version 1 (False from an older server).
    restore_durable: bool = field(default=False, metadata=_flag())
    # Issue 42, all "not given" from an older server. restore_alt: per local rank, a second
    # holder to fetch from when the first fails (-1: none; an index as restore_source);
    # restore_digests: per local rank, the sha256 its owner announced for the restore step
    # ("": not known), which a fetched copy (and the worker restoring it) must match;
    # restore_certs: per address, the certificate the holder's replica server shows ("":
    # plain TCP); replica_cert: replica_to's; replica_from/replica_count: the global ranks
    # whose replicas this node takes (from its ring predecessor; count 0: none): a push of
    # any other rank is refused.
    restore_alt: tuple[int, ...] = field(
        default=(), metadata=_items(_integer(-1, MAX_RESTORE_SOURCES - 1)["check"], "indices", MAX_NPROC)
    )
    restore_digests: tuple[str, ...] = field(
        default=(), metadata=_items(_DIGEST["check"], "digests", MAX_NPROC)
    )
    restore_certs: tuple[str, ...] = field(
        default=(), metadata=_items(_DIGEST["check"], "digests", MAX_RESTORE_SOURCES)
    )
    replica_cert: str = field(default="", metadata=_DIGEST)
    replica_from: int = field(default=0, metadata=_COUNT)
    replica_count: int = field(default=0, metadata=_integer(0, MAX_NPROC))
    # The restore step's snapshots are of a job of restore_world ranks (0: of this round's
    # world): state every rank holds alike (SnapshotsHeld.replicated), so each local rank i
    # restores the snapshot of the old rank restore_ranks[i], which this node holds.
    # Added within version 1 (0, (): an older server, or the same world).
    restore_world: int = field(default=0, metadata=_integer(0, MAX_COUNT))
    restore_ranks: tuple[int, ...] = field(default=(), metadata=_items(_COUNT["check"], "ranks", MAX_NPROC))

    def _check_relations(self) -> None:
        if self.restore_world and (self.restore_step < 0 or not self.restore_ranks):
            raise self._invalid("restore_world", "given without a restore_step and restore_ranks")
        if self.restore_world and self.restore_durable:
            raise self._invalid("restore_world", "given with restore_durable (read at its own world only)")
        if self.restore_ranks and not self.restore_world:
            raise self._invalid("restore_ranks", "given without a restore_world")
        if any(r >= self.restore_world for r in self.restore_ranks):
            raise self._invalid("restore_ranks", f"must be < restore_world ({self.restore_world})")
        if self.restore_certs and len(self.restore_certs) != len(self.restore_addrs):
            raise self._invalid(
                "restore_certs", f"must have one per address ({len(self.restore_addrs)}) or none"
            )
        if any(i >= len(self.restore_addrs) for i in self.restore_alt):
            raise self._invalid("restore_alt", f"indexes past restore_addrs ({len(self.restore_addrs)})")
        if self.restore_durable and self.restore_step < 0:
            raise self._invalid("restore_durable", "given without a restore_step")
        if len(self.restore_keys) != len(self.restore_addrs):
            raise self._invalid("restore_keys", f"must have one key per address ({len(self.restore_addrs)})")
        if any(i >= len(self.restore_addrs) for i in self.restore_source):
            raise self._invalid("restore_source", f"indexes past restore_addrs ({len(self.restore_addrs)})")
        if self.group_rank >= self.group_world_size:
            raise self._invalid(
                "group_rank",
                f"must be < group_world_size ({self.group_world_size}), got {self.group_rank}",
            )
        if self.rank_offset >= self.world_size:
            raise self._invalid(
                "rank_offset", f"must be < world_size ({self.world_size}), got {self.rank_offset}"
            )


# --- client -> server, after a lost connection ---------------------------------


@record(frozen=True, kw_only=True, slots=True)
class Resume(_Schema):
    """After a lost connection, in place of Join: the node's join and the round it holds.

    Its workers kept running (or are stopping, or failed: the agent says so after the
    answer). A server that knows the round takes the node back as it was (``Resumed``); one
    that lost its state rebuilds the round from every node's Resume when they agree, and
    otherwise starts a new round (``Restart``). A node the server dropped meanwhile is told to
    join again (``Restart``), or how the job ended (``JobFailed``, ``JobDone``).
    """

    TYPE: ClassVar[str] = "resume"
    join: Join = field(metadata=_nested(Join))
    assignment: Assignment = field(metadata=_nested(Assignment))
    succeeded: bool = field(default=False, metadata=_flag())

    def _check_relations(self) -> None:
        # The restore digests matter only before the workers start, and are the Assignment's
        # largest field: echoed back, they would double the frame a joining agent may send.
        if self.assignment.restore_digests:
            raise self._invalid("assignment", "must not echo restore_digests")


@record(frozen=True, kw_only=True, slots=True)
class Resumed(_Schema):
    """The server took the node back into ``round``; its workers go on untouched."""

    TYPE: ClassVar[str] = "resumed"
    job_id: str = field(metadata=_ID)
    round: int = field(metadata=_COUNT)
    rebuilt: bool = field(default=False, metadata=_flag())  # the server had lost the round


@record(frozen=True, kw_only=True, slots=True)
class Restart(_Schema):
    """Stop the workers; a new round ``round`` is forming."""

    TYPE: ClassVar[str] = "restart"
    round: int = field(metadata=_COUNT)
    reason: str = field(metadata=_TEXT)
    restart_count: int = field(metadata=_COUNT)
    # A hang ended the round: the job's hang report, every node's stacks merged (at most
    # MAX_TEXT_LEN characters), for the agents' consoles and report files. Added within
    # version 1: an older agent ignores it, an older server sends none ("").
    report: str = field(default="", metadata=_TEXT)


@record(frozen=True, kw_only=True, slots=True)
class JobFailed(_Schema):
    """The job is over and failed; ``failure`` is the first failure, if any."""

    TYPE: ClassVar[str] = "job_failed"
    reason: str = field(metadata=_TEXT)
    failure: Failure | None = field(default=None, metadata=_failure(optional=True))
    # Why, as a stable code: "" (a failure past the restart budget, an invalid job ...) or
    # "crash_loop" (restarts in a row made no step progress: the agent's distinct exit code) or
    # "host_lost" (the node hosting the rendezvous was lost and nothing took its place).
    # Added within version 1: an older agent ignores it.
    code: str = field(default="", metadata=_text(MAX_CODE_LEN, plain=True))
    # As Restart.report: the job's hang report when a hang ended it ("": none, or an older server).
    report: str = field(default="", metadata=_TEXT)
    # The job's goodput in one line, as the server's status says it ("goodput 97.3 % over 2 h
    # 14 min: 2 failures cost 41 s and 3 steps; ..."), for each agent to print. Added within
    # version 1: an older agent ignores it, an older server sends none ("").
    summary: str = field(default="", metadata=_text(MAX_SUMMARY_LEN, plain=True))


@record(frozen=True, kw_only=True, slots=True)
class CollectStacks(_Schema):
    """A rank of the job hung in ``round``: send your ranks' stacks (``Stacks``) before any stop."""

    TYPE: ClassVar[str] = "collect_stacks"
    round: int = field(metadata=_COUNT)
    reason: str = field(default="", metadata=_TEXT)


STOP_STATES = ("arm", "go", "cancel")
# Seconds of lead a commit step gives, both sides of the wire: the server picks the step this
# far beyond the estimated current one and adds it to its commit deadline (the push to every
# agent, the page write, each rank's acknowledgement and the answers back, on any sane
# network); an agent draining for a commit waits the commit budget plus this for its Drain.
COMMIT_LEAD = 1.0
# A planned change in a round's first seconds waits this long for every node to say that its
# ranks call should_stop() (a rank's first call may follow its first step) before it gives up
# on a commit point; a draining agent asks for one that early even before its ranks said so.
COMMIT_EARLY_S = 5.0


@record(frozen=True, kw_only=True, slots=True)
class StopAt(_Schema):
    """A commit point for the job's workers in ``round`` (issue 20), in two steps.

    ``arm``: write ``step`` into every local rank's page and answer ``Armed``; a rank that
    reaches it waits in ``should_stop()``. ``go``: every node armed in time; each rank stops
    at the first step >= ``step`` it calls ``should_stop()`` at (``step`` itself for a rank
    that calls it every step). ``cancel``: no stop (a waiting rank goes on).
    """

    TYPE: ClassVar[str] = "stop_at"
    round: int = field(metadata=_COUNT)
    step: int = field(metadata=_COUNT)
    state: str = field(metadata=_choice(STOP_STATES))
    # The seconds left, as sent, to the commit's one deadline (past it the server restarts the
    # round instead): a draining agent waits exactly as long. Added within version 1: 0 from an
    # older server (the agent then estimates it), ignored by an older agent.
    deadline_s: float = field(default=0.0, metadata=_TIMEOUT)


@record(frozen=True, kw_only=True, slots=True)
class KeepSnapshot(_Schema):
    """Which snapshots every agent keeps from pruning (issue 35); sent only to an agent that
    sent ``SnapshotsHeld``, whenever either changes.

    ``step``: the newest step every rank has on two nodes (-1: none yet), so the loss of any
    one node leaves a step every rank can restore. ``replicate``: the step every agent copies to
    its ring peer now (-1: none), one that every rank has on one node: all copy the same step,
    so it becomes the next ``step`` however often the ranks snapshot and however far the copies
    lag their snapshots."""

    TYPE: ClassVar[str] = "keep_snapshot"
    step: int = field(metadata=_STEP)
    replicate: int = field(default=-1, metadata=_STEP)


@record(frozen=True, kw_only=True, slots=True)
class Drain(_Schema):
    """Leave the job cleanly: stop the workers with SIGTERM (they may checkpoint), then Leave."""

    TYPE: ClassVar[str] = "drain"
    reason: str = field(default="", metadata=_TEXT)


@record(frozen=True, kw_only=True, slots=True)
class GoingAway(_Schema):
    """The server is shutting down: keep the workers running, reconnect and resume.

    Added within protocol version 1: an agent that does not know it fails to decode it,
    which it treats as a lost connection, and so it does the same thing.
    """

    TYPE: ClassVar[str] = "going_away"
    reason: str = field(default="", metadata=_TEXT)


@record(frozen=True, kw_only=True, slots=True)
class Left(_Schema):
    """The answer to a member's ``Leave``, sent just before the server closes the connection.

    ``job_continues`` says whether the job goes on without the node (enough members remain,
    a spare took its place, its own part was done, or the job finished): the agent exits 0 on
    a drain only then. Added within protocol version 1, like GoingAway: an older agent fails
    to decode it and takes it for the connection closing, which it expected after its Leave.
    """

    TYPE: ClassVar[str] = "left"
    job_continues: bool = field(metadata=_flag())
    reason: str = field(default="", metadata=_TEXT)


@record(frozen=True, kw_only=True, slots=True)
class JobDone(_Schema):
    """The job is over and every node succeeded."""

    TYPE: ClassVar[str] = "job_done"
    # As JobFailed.summary (added within version 1).
    summary: str = field(default="", metadata=_text(MAX_SUMMARY_LEN, plain=True))


@record(frozen=True, kw_only=True, slots=True)
class Standbys(_Schema):
    """Issue 45: where a job's members go if the agent hosting the rendezvous is lost. The
    standbys' endpoints in the order every agent tries them (so all go to the same one), their
    node ids (a standby finds itself there), the node hosting now, and its ``term``: one more
    at each take-over, so an agent never goes back to a host it has seen replaced.
    ``host_in_round``: the hosting node holds a place in this job's round (a standby that takes
    over then knows the rebuilt round cannot wait for it)."""

    TYPE: ClassVar[str] = "standbys"
    term: int = field(metadata=_COUNT)
    host_node: str = field(metadata=_ID)
    host_in_round: bool = field(default=False, metadata=_flag())
    endpoints: tuple[str, ...] = field(default=(), metadata=_items(_ADDR["check"], "endpoints", MAX_STANDBYS))
    nodes: tuple[str, ...] = field(default=(), metadata=_items(_ID["check"], "node ids", MAX_STANDBYS))

    def _check_relations(self) -> None:
        if len(self.endpoints) != len(self.nodes):
            raise self._invalid("nodes", f"must name one node per endpoint ({len(self.endpoints)})")


@record(frozen=True, kw_only=True, slots=True)
class Error(_Schema):
    """The peer broke the protocol; ``code`` is a ProtocolError code."""

    TYPE: ClassVar[str] = "error"
    code: str = field(metadata=_text(MAX_CODE_LEN, nonempty=True, plain=True))
    message: str = field(metadata=_TEXT)
    # Spelled dataclasses.field here: the attribute named ``field`` shadows the
    # function inside this class body.
    field: str | None = dataclasses.field(default=None, metadata=_text(MAX_ID_LEN, optional=True, plain=True))
    fatal: bool = dataclasses.field(default=True, metadata=_flag())


# --- registries --------------------------------------------------------------

Message: TypeAlias = (
    Hello
    | Join
    | Heartbeat
    | WorkersFailed
    | WorkersSucceeded
    | Leave
    | Resume
    | Progress
    | SnapshotsHeld
    | HangDetected
    | Stacks
    | Armed
    | WorkersCommitted
    | LeaveAfterCommit
    | StopAt
    | Welcome
    | Resumed
    | Waiting
    | Assignment
    | Restart
    | JobFailed
    | JobDone
    | Drain
    | CollectStacks
    | GoingAway
    | Left
    | KeepSnapshot
    | Standbys
    | Error
)

CLIENT_MESSAGES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Join,
        Heartbeat,
        WorkersFailed,
        WorkersSucceeded,
        Leave,
        Resume,
        Progress,
        SnapshotsHeld,
        HangDetected,
        Stacks,
        Armed,
        WorkersCommitted,
        LeaveAfterCommit,
    )
}
SERVER_MESSAGES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Welcome,
        Waiting,
        Assignment,
        Restart,
        JobFailed,
        JobDone,
        Drain,
        Error,
        Resumed,
        GoingAway,
        Left,
        CollectStacks,
        StopAt,
        KeepSnapshot,
        Standbys,
    )
}
MESSAGE_TYPES: dict[str, type[Message]] = {**CLIENT_MESSAGES, **SERVER_MESSAGES}


def _compile(cls: type[_Schema], path: str) -> None:
    # A KeyError here means a field was declared without a rule: every field of
    # every message must say how it is validated.
    cls._PATH = path
    # fields() takes any @record class; _Schema itself is not one, so mypy cannot tell.
    cls._CHECKS = tuple((f.name, f.metadata["check"]) for f in fields(cls))  # type: ignore[arg-type]


_compile(Failure, "failure")
for _cls in MESSAGE_TYPES.values():
    _compile(_cls, _cls.TYPE)
del _cls


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut, so a text built
    from a peer's (a reason quoting another, a list of names) always fits its field."""
    if len(text) <= limit:
        return text
    marker = f" ... [{len(text) - limit:,}+ more characters]"
    if limit <= len(marker):
        return text[:limit]
    keep = limit - len(marker)
    return text[:keep] + f" ... [{len(text) - keep:,} more characters]"[: limit - keep]


def negotiate_version(theirs: Sequence[int], *, ours: Sequence[int] = SUPPORTED_VERSIONS) -> int:
    """The highest protocol version both sides speak, else VersionMismatch."""
    common = set(ours).intersection(theirs)
    if not common:
        raise VersionMismatch(ours=ours, theirs=theirs, field="hello.versions")
    return max(common)


def error_message(exc: ProtocolError, *, fatal: bool = True) -> Error:
    """The ``Error`` reply telling the peer what it got wrong."""
    field = exc.field[:MAX_ID_LEN] if exc.field is not None else None
    return Error(code=exc.code, message=str(exc)[:MAX_TEXT_LEN], field=field, fatal=fatal)
