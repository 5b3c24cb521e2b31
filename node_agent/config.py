"""The node agent's configuration: one frozen value, built once at the edge.

``node_agent.args.parse_config`` fills :class:`AgentConfig` from torchrun's flags and ``PET_*``
variables and validates everything before anything slow happens. The rest of the agent reads
this object and never ``os.environ``: a test builds an ``AgentConfig`` directly and the code
under test behaves exactly as it would for the equivalent command line.

Field names follow torchrun's argparse ``dest`` names, so a torchrun user can map each field to
the flag they know. Where torchrun keeps a raw string (``--redirects 0:1,1:2``,
``--signals-to-handle``, ``--rdzv-conf``) we keep the parsed value, so a bad value fails at
start-up and not half-way through a run.

This module must stay cheap to import: the agent starts in milliseconds, so nothing here (or in
anything it imports) may pull in torch or an event loop.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import field
from enum import IntFlag
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from protocol.messages import MAX_TIMEOUT
from protocol.records import record

from .rdzv import BACKENDS

__all__ = [
    "DEFAULT_RDZV_PORT",
    "DEFAULT_SIGNALS",
    "EXTRA_RDZV_KEYS",
    "START_METHODS",
    "AgentConfig",
    "ConfigError",
    "RdzvConf",
    "Std",
    "StdSpec",
]

logger = logging.getLogger(__name__)

# Our rendezvous server's port (rdzv_server.cli uses the same). torchrun's c10d backend
# defaults to 29400; an endpoint written with an explicit port is unaffected.
DEFAULT_RDZV_PORT = BACKENDS["c10d"].default_port
DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
START_METHODS: tuple[str, ...] = ("spawn", "fork", "forkserver")
PASS_LOCAL_RANK_STYLES: tuple[str, ...] = ("dash", "underscore")
LOG_FORMATS: tuple[str, ...] = ("text", "json")

LogFormat = Literal["text", "json"]


class ConfigError(Exception):
    """The user's configuration is wrong; the message says what was wrong and what is accepted."""


class Std(IntFlag):
    """Which of a worker's standard streams a setting applies to (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def is_module_name(text: str) -> bool:
    """A dotted Python module name: ``torch``, ``torch.distributed``."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit also accepts characters such as "²" that int() refuses."""
    return text.isascii() and text.isdigit()


_K = TypeVar("_K")
_V = TypeVar("_V")


def _frozen_map(items: Mapping[_K, _V] | None = None) -> Mapping[_K, _V]:
    return MappingProxyType(dict(items or {}))


@record(frozen=True, kw_only=True)
class StdSpec:
    """A ``--redirects``/``--tee`` value: a setting per local rank, with a default for the rest.

    torchrun accepts one value for every rank (``3``) or a map (``0:1,1:2``) in which unlisted
    ranks get NONE; both become a ``StdSpec`` so callers never look at the raw string.
    """

    default: Std = Std.NONE
    per_rank: Mapping[int, Std] = field(default_factory=_frozen_map)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", Std(self.default))
        object.__setattr__(self, "per_rank", _frozen_map({int(k): Std(v) for k, v in self.per_rank.items()}))

    def for_rank(self, local_rank: int) -> Std:
        return self.per_rank.get(local_rank, self.default)

    @classmethod
    def parse(cls, text: str, *, origin: str) -> StdSpec:
        """Parse torchrun's syntax: ``N`` or ``RANK:N,RANK:N`` with N in 0..3.

        torchrun only allows one-digit ranks in the map; we allow any rank, which accepts every
        string torchrun accepts.
        """
        accepted = "0 (none), 1 (stdout), 2 (stderr), 3 (both), or a map like 0:1,1:2"
        value = text.strip()
        if value in ("0", "1", "2", "3"):
            return cls(default=Std(int(value)))
        per_rank: dict[int, Std] = {}
        for item in value.split(","):
            rank_text, sep, std_text = item.strip().partition(":")
            if not sep or not is_count(rank_text.strip()) or std_text.strip() not in ("0", "1", "2", "3"):
                raise ConfigError(f"{origin}={text!r} is not valid: expected {accepted}")
            rank = int(rank_text)
            if rank in per_rank:
                raise ConfigError(f"{origin}={text!r} names local rank {rank} twice")
            per_rank[rank] = Std(int(std_text))
        return cls(default=Std.NONE, per_rank=per_rank)


# --rdzv-conf keys that torch's rendezvous backends (c10d, static, etcd, etcd-v2) read but that
# have no meaning for our rendezvous server. They are accepted so a torchrun command line works
# unchanged, and kept in RdzvConf.extra so nothing is lost. "timeout" is one torchrun's
# LaunchConfig always injects (900 s); only its static and etcd backends read it.
EXTRA_RDZV_KEYS: tuple[str, ...] = (
    "store_type",  # c10d: tcp | file
    "use_libuv",  # c10d, TCPStore backend choice (torch <= 2.3)
    "timeout",  # static / etcd
    "rank",  # static (torchrun fills it from --node-rank)
    "local_addr",
    "protocol",  # etcd / etcd-v2
    "cacert",  # etcd
    "cert",  # etcd
    "key",  # etcd
    "ca_cert",  # etcd-v2
    "ssl_cert",  # etcd-v2
    "ssl_cert_key",  # etcd-v2
    "etcd_prefix",  # etcd
)
MAX_COMMIT_TIMEOUT = MAX_TIMEOUT  # the most a Join carries
_EXTRA_INT_KEYS = frozenset({"timeout", "rank"})
_EXTRA_BOOL_KEYS = frozenset({"use_libuv"})

_FLOAT_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_interval",
    "heartbeat_timeout",
    "read_timeout",
    "exit_barrier_timeout",
    "reconnect_timeout",
)
# torchrun's liveness knobs, translated into ours (see RdzvConf.parse).
_KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")
_TORCH_KEEP_ALIVE_MAX_ATTEMPT = 3

_TRUE = frozenset({"1", "true", "t", "yes", "y"})  # the spellings torch's get_as_bool accepts
_FALSE = frozenset({"0", "false", "f", "no", "n"})


def parse_bool(text: str, *, what: str) -> bool:
    """Parse a boolean the way torch's rendezvous parameters do (true/false/1/0/yes/no/t/f/y/n)."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{what}={text!r} is not a boolean: use true/false, 1/0 or yes/no")


def parse_float(text: str, *, what: str) -> float:
    """Parse a finite number; every wait is bounded, so inf and nan are refused."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what}={text!r} must be a finite number")
    return value


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, *, what: str) -> int:
    """A byte count: digits with an optional K, M, G or T (powers of 1024; "B", "iB" allowed
    after it: "8G", "8GiB", "512MB"), never negative."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not a size (bytes, or a number with K, M, G or T)") from None
    if not math.isfinite(value) or value < 0 or value * _SIZE_UNITS[unit] >= 2**63:
        raise ConfigError(f"{what}={text!r} must be a size from 0 to 8 EiB")
    return int(value * _SIZE_UNITS[unit])


def parse_int(text: str, *, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not an integer") from None


@record(frozen=True, kw_only=True)
class RdzvConf:
    """``--rdzv-conf`` for our rendezvous: timeouts in seconds, plus accepted-but-unused keys."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    # Our liveness timeout: the server declares a node gone when it has been silent this long.
    # (torch's heartbeat_timeout is the deadline of one keep-alive write; ours is the liveness
    # bound torch spells keep_alive_interval x keep_alive_max_attempt.)
    heartbeat_timeout: float = 5.0
    read_timeout: float = 60.0  # how long to keep trying to connect to the endpoint
    is_host: bool | None = None  # None: not said; rdzv/hosting.py decides whether to host
    exit_barrier_timeout: float = 300.0
    # How long an agent whose server connection broke keeps its workers running while it
    # reconnects and resumes its round (0: stop them at once).
    reconnect_timeout: float = 30.0
    # Exclude a node from the job once its workers have failed this many times (0: never).
    exclude_after: int = 0
    # Training health (issue 19), sent in the Join; every node of a job must give the same.
    straggler_threshold: float = 0.75  # flag a rank slower than this fraction of the median
    exclude_stragglers: bool = False  # leave a flagged node out of the next planned round
    crash_loop_restarts: int = 3  # restarts in a row with no step progress that end the job
    # Commit-point restarts (issue 20), sent in the Join; every node of a job must give the same.
    # commit_timeout: the checkpoint budget of a commit, seconds (0: no commits, a planned change
    # restarts at once); commit_steps: how far past the highest step reported the job stops
    # (0: derived from the measured step time).
    commit_timeout: float = 300.0
    commit_steps: int = 0
    extra: Mapping[str, str] = field(default_factory=_frozen_map)

    def __post_init__(self) -> None:
        for name in _FLOAT_KEYS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"--rdzv-conf {name}={value!r} must be a finite number of seconds")
        for name in ("join_timeout", "heartbeat_interval", "heartbeat_timeout", "read_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(self, name)!r} must be > 0 seconds")
        for name in ("last_call_timeout", "close_timeout", "exit_barrier_timeout", "reconnect_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(self, name)!r} must be >= 0 seconds")
        if (
            not isinstance(self.commit_timeout, (int, float))
            or not 0 <= self.commit_timeout <= MAX_COMMIT_TIMEOUT
        ):
            raise ConfigError(
                f"--rdzv-conf commit_timeout={self.commit_timeout!r} must be in 0..{MAX_COMMIT_TIMEOUT:g} "
                "seconds (0: no commit points)"
            )
        if type(self.commit_steps) is not int or not 0 <= self.commit_steps <= 1_000_000:
            raise ConfigError(
                f"--rdzv-conf commit_steps={self.commit_steps!r} must be in 0..1000000 (0: auto)"
            )
        if self.heartbeat_timeout < self.heartbeat_interval:
            raise ConfigError(
                f"--rdzv-conf heartbeat_timeout={self.heartbeat_timeout} is shorter than "
                f"heartbeat_interval={self.heartbeat_interval}: a live node would be declared gone"
            )
        unknown = sorted(set(self.extra) - set(EXTRA_RDZV_KEYS))
        if unknown:
            raise ConfigError(f"--rdzv-conf: unknown key(s) {', '.join(unknown)}; {_accepted_keys()}")
        object.__setattr__(self, "extra", _frozen_map(self.extra))

    @classmethod
    def parse(cls, text: str, *, origin: str = "--rdzv-conf") -> RdzvConf:
        """Parse torchrun's ``key=value,key=value`` (no escaping; a later key wins, as in torch)."""
        pairs: dict[str, str] = {}
        stripped = text.strip()
        if stripped:
            for item in stripped.split(","):
                key, sep, value = item.partition("=")
                key, value = key.strip(), value.strip()
                if not key:
                    raise ConfigError(f"{origin}={text!r}: expected key=value pairs separated by commas")
                if not sep or not value:
                    raise ConfigError(f"{origin}: key {key!r} has no value (write {key}=VALUE)")
                pairs[key] = value

        unknown = sorted(k for k in pairs if k not in cls.accepted_keys())
        if unknown:
            # torchrun passes every key to its backend, which reads its own and ignores the rest;
            # Kubeflow's training-operator copies a job's rdzvConf into PET_RDZV_CONF verbatim.
            _warn_unknown_keys(origin, unknown)
            for key in unknown:
                del pairs[key]

        kwargs: dict[str, Any] = {}  # checked again by the constructor
        for key in _FLOAT_KEYS:
            if key in pairs:
                kwargs[key] = parse_float(pairs[key], what=f"{origin} {key}")
        if "is_host" in pairs:
            kwargs["is_host"] = parse_bool(pairs["is_host"], what=f"{origin} is_host")
        for key in ("exclude_after", "crash_loop_restarts", "commit_steps"):
            if key in pairs:
                kwargs[key] = parse_int(pairs[key], what=f"{origin} {key}")
                if not 0 <= kwargs[key] <= 1_000_000:
                    raise ConfigError(f"{origin} {key}={pairs[key]} must be in 0..1000000")
        if "commit_timeout" in pairs:
            budget = parse_float(pairs["commit_timeout"], what=f"{origin} commit_timeout")
            if not 0 <= budget <= MAX_COMMIT_TIMEOUT:
                raise ConfigError(
                    f"{origin} commit_timeout={pairs['commit_timeout']} must be in 0..{MAX_COMMIT_TIMEOUT:g} "
                    "seconds: the checkpoint budget of a commit point (0: no commit points)"
                )
            kwargs["commit_timeout"] = budget
        if "exclude_stragglers" in pairs:
            kwargs["exclude_stragglers"] = parse_bool(
                pairs["exclude_stragglers"], what=f"{origin} exclude_stragglers"
            )
        if "straggler_threshold" in pairs:
            threshold = parse_float(pairs["straggler_threshold"], what=f"{origin} straggler_threshold")
            if not 0 < threshold <= 1:
                raise ConfigError(
                    f"{origin} straggler_threshold={pairs['straggler_threshold']} must be in (0, 1]: "
                    "the fraction of the median speed below which a rank is flagged"
                )
            kwargs["straggler_threshold"] = threshold

        # torchrun declares a node dead after keep_alive_interval x keep_alive_max_attempt
        # seconds without a heartbeat; that product is exactly our heartbeat_timeout, and
        # keep_alive_interval is our heartbeat_interval. When either torch key is given, the
        # torch pair decides the liveness timeout (a missing half takes its default: our
        # interval, torch's 3 attempts), since that is what the user tuned.
        if any(k in pairs for k in _KEEP_ALIVE_KEYS):
            if "keep_alive_interval" in pairs and "heartbeat_interval" in pairs:
                raise ConfigError(
                    f"{origin}: keep_alive_interval and heartbeat_interval are the same setting; give one"
                )
            if "keep_alive_interval" in pairs:
                interval = parse_float(pairs["keep_alive_interval"], what=f"{origin} keep_alive_interval")
                kwargs["heartbeat_interval"] = interval
            else:
                interval = float(kwargs.get("heartbeat_interval", cls.heartbeat_interval))
            attempts = _TORCH_KEEP_ALIVE_MAX_ATTEMPT
            if "keep_alive_max_attempt" in pairs:
                attempts = parse_int(pairs["keep_alive_max_attempt"], what=f"{origin} keep_alive_max_attempt")
                if attempts < 1:
                    raise ConfigError(f"{origin} keep_alive_max_attempt={attempts} must be >= 1")
            if "heartbeat_timeout" in pairs:
                logger.warning(
                    "--rdzv-conf: heartbeat_timeout=%s is replaced by keep_alive_interval x "
                    "keep_alive_max_attempt = %s s (the liveness timeout torchrun uses)",
                    pairs["heartbeat_timeout"],
                    interval * attempts,
                )
            kwargs["heartbeat_timeout"] = interval * attempts

        extra: dict[str, str] = {}
        for key in EXTRA_RDZV_KEYS:
            if key not in pairs:
                continue
            value = pairs[key]
            # These keys have no effect here, but a value torch would reject is still a mistake.
            if key in _EXTRA_INT_KEYS:
                parse_int(value, what=f"{origin} {key}")
            elif key in _EXTRA_BOOL_KEYS:
                parse_bool(value, what=f"{origin} {key}")
            elif key == "store_type" and value.lower() not in ("tcp", "file"):
                raise ConfigError(f"{origin} store_type={value!r}: torch accepts tcp or file")
            extra[key] = value
        return cls(extra=extra, **kwargs)

    @staticmethod
    def accepted_keys() -> tuple[str, ...]:
        return (*_FLOAT_KEYS, "is_host", *_OWN_KEYS, *_KEEP_ALIVE_KEYS, *EXTRA_RDZV_KEYS)


_OWN_KEYS = (
    "exclude_after",
    "straggler_threshold",
    "exclude_stragglers",
    "crash_loop_restarts",
    "commit_timeout",
    "commit_steps",
)


_WARNED_UNKNOWN: set[tuple[str, ...]] = set()


def _warn_unknown_keys(origin: str, unknown: list[str]) -> None:
    """Say once per process which ``--rdzv-conf`` keys are ignored, and which ones are read."""
    if tuple(unknown) in _WARNED_UNKNOWN:
        return
    _WARNED_UNKNOWN.add(tuple(unknown))
    logger.warning(
        "%s: ignoring unknown key(s) %s (as torchrun, whose backend ignores keys it does not read); %s",
        origin,
        ", ".join(unknown),
        _accepted_keys(),
    )


def _accepted_keys() -> str:
    return (
        f"accepted keys: {', '.join((*_FLOAT_KEYS, 'is_host', *_OWN_KEYS, *_KEEP_ALIVE_KEYS))}; "
        f"accepted for torchrun compatibility but unused: {', '.join(EXTRA_RDZV_KEYS)}"
    )


@record(frozen=True, kw_only=True)
class AgentConfig:
    """Every torchrun flag, resolved, plus node-agent's own options.

    The defaults describe ``node-agent script.py`` after resolution except for the rendezvous
    id (``parse_config`` gives a standalone run a fresh uuid4); use ``parse_config`` for
    anything that comes from a user.
    """

    training_script: str
    training_script_args: tuple[str, ...] = ()

    # --nnodes, --nproc-per-node
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1

    # rendezvous
    standalone: bool = True
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"  # as given (or as --standalone forced it)
    rdzv_host: str = "127.0.0.1"  # parsed from rdzv_endpoint; IPv6 without brackets
    rdzv_port: int = 0  # 0: pick a free port (only for a single-node job hosting its own rendezvous)
    rdzv_id: str = "none"
    rdzv_conf: RdzvConf = field(default_factory=RdzvConf)

    # what to run and how
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"  # only used by torchrun for --run-path (function) workers
    event_log_handler: str = "null"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    python_exec: str = sys.executable  # PYTHON_EXEC, else this interpreter (as torchrun)

    # logs
    log_dir: str | None = None  # None: make a temporary directory when the run starts
    redirects: StdSpec = field(default_factory=StdSpec)
    tee: StdSpec = field(default_factory=StdSpec)
    local_ranks_filter: frozenset[int] | None = None  # None: show every rank on the console
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    log_line_prefix_template: str | None = None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    logs_specs: str | None = None  # None or "default" (torchrun's own layout, which we write)
    # LOGLEVEL for the agent's own lines; None (unset): INFO, so the round and worker lines show
    log_level: str | None = None
    log_format: LogFormat = "text"

    # torchrun's static-rendezvous flags: kept as given (None: not given)
    node_rank: int = 0
    node_rank_given: bool = False  # --node-rank/PET_NODE_RANK was given: c10d orders nodes by it
    master_addr: str | None = None
    master_port: int | None = None

    local_addr: str | None = None
    numa_binding: str | None = None  # torch's AffinityMode value (node_agent/gpu/numa.py); None: no binding
    signals_to_handle: tuple[str, ...] = DEFAULT_SIGNALS
    shutdown_timeout: float = 30.0
    virtual_local_rank: bool = False

    # node-agent's own
    hang_timeout: str = "auto"  # --hang-timeout, checked by node_agent.machine.watch.HangPolicy.parse
    hang_conf: str = ""  # --hang-conf
    pass_local_rank: str | None = None  # None | "dash" (--local-rank=N) | "underscore" (--local_rank=N)
    health_check: str | None = None
    health_check_port: int | None = None  # TORCHELASTIC_HEALTH_CHECK_PORT: serve liveness there
    # Before a restart's workers start, wait this long at most for the previous workers' GPU
    # memory to fall to gpu_release_mib per visible GPU (0: no wait); gpu/binding.py.
    gpu_release_timeout: float = 50.0
    gpu_release_mib: int = 512
    # In-memory snapshots (issue 35; node_agent/snapshots/): the bytes this node's snapshots
    # and the replicas it keeps for a peer may take (None: a quarter of /dev/shm's size; 0: no
    # snapshots), and the rate a replication may send at (bytes/s; 0: no limit).
    snapshot_memory: int | None = None
    snapshot_replication_rate: int = 256 << 20
    # --snapshot-dir: where the newest consistent snapshot is also persisted (None: nowhere);
    # snapshots/durable.py.
    snapshot_dir: str | None = None
    # --outcome-dir: where this agent writes how the job ended for it (outcome_file.py; None: nowhere)
    outcome_dir: str | None = None
    # The job's token (from --token-file, RDZV_TOKEN_FILE or RDZV_TOKEN); proven, never sent.
    token: str | None = field(default=None, repr=False)
    # TLS to the rendezvous server (--tls-ca, else RDZV_TLS_CA; None: plain TCP), and an
    # optional client certificate. Paths, checked by parse_config; the runner loads them.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # --preload: modules each local rank's warm interpreter imports before its assignment
    # (node_agent/supervisor/warm.py); empty: workers start cold.
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Cheap invariants only: parse_config has already given the user a precise message;
        # these catch a config built by hand in code.
        object.__setattr__(self, "training_script_args", tuple(self.training_script_args))
        object.__setattr__(self, "signals_to_handle", tuple(self.signals_to_handle))
        object.__setattr__(self, "duplicate_stdout_filters", tuple(self.duplicate_stdout_filters))
        object.__setattr__(self, "duplicate_stderr_filters", tuple(self.duplicate_stderr_filters))
        object.__setattr__(self, "preload", tuple(self.preload))
        for name in self.preload:
            if not is_module_name(name):
                raise ConfigError(f"preload: {name!r} is not a module name")
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ConfigError(f"nnodes {self.min_nodes}:{self.max_nodes}: need 0 < MIN <= MAX")
        if self.nproc_per_node < 1:
            raise ConfigError(f"nproc_per_node={self.nproc_per_node} must be >= 1")
        if not 0 <= self.rdzv_port <= 65535:
            raise ConfigError(f"rdzv port {self.rdzv_port} is not in 0..65535")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts} must be >= 0")
        if not self.monitor_interval > 0:
            raise ConfigError(f"monitor_interval={self.monitor_interval} must be > 0")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"start_method={self.start_method!r}: use one of {', '.join(START_METHODS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format={self.log_format!r}: use one of {', '.join(LOG_FORMATS)}")
        if self.pass_local_rank not in (None, *PASS_LOCAL_RANK_STYLES):
            raise ConfigError(
                f"pass_local_rank={self.pass_local_rank!r}: use one of {', '.join(PASS_LOCAL_RANK_STYLES)}"
            )
        if self.module and self.no_python and not self.run_path:
            raise ConfigError("--module and --no-python cannot be used together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ConfigError("tls_cert needs tls_ca: a client certificate is only sent over TLS")

    def redirect_for(self, local_rank: int) -> Std:
        """Streams of this worker to write to a file instead of the console (``--redirects``).

        As in torchrun, a stream that is tee'd is also written to the file; the file then holds
        ``redirect_for(r) | tee_for(r)`` and the console shows the tee'd part.
        """
        return self.redirects.for_rank(local_rank)

    def tee_for(self, local_rank: int) -> Std:
        """Streams of this worker to write to a file and to the console (``--tee``)."""
        return self.tee.for_rank(local_rank)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    @property
    def entrypoint_name(self) -> str:
        """What this node runs (the script, module or command as given).

        Every node of a job must report the same name; torchrun uses the same string for its
        "<entrypoint> FAILED" banner.
        """
        return self.training_script

    @property
    def hosts_rendezvous(self) -> bool:
        """Whether this agent must run the rendezvous itself rather than reach a server.

        True for --standalone, a port-0 endpoint (a free port nobody else could know), or
        ``is_host=true``; ``is_host`` unset leaves any auto-detection to ``rdzv/hosting.py``. Never
        with a backend that keeps the rendezvous itself (etcd).
        """
        traits = BACKENDS.get(self.rdzv_backend)
        if traits is not None and traits.keeps_rendezvous:
            return False
        return self.standalone or self.rdzv_port == 0 or self.rdzv_conf.is_host is True
