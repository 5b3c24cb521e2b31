"""node-agent's flags: one table (:data:`FLAGS`) of every torchrun flag, in each spelling, with
its default and its ``PET_*`` variable, the argparse parser built from it, and the split of a
command line into the launcher's part and the script's own arguments."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from edge.version import VersionAction
from protocol.records import record

from ..config import (
    DEFAULT_RDZV_PORT,
    PASS_LOCAL_RANK_STYLES,
)

# torch's registered event handlers: "null" and "dynamic_rendezvous" discard events, "console"
# prints them to stderr; any other name fails in torchrun at the first event.
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
STANDALONE_ENDPOINT = "127.0.0.1:0"


def random_uuid4() -> str:
    """A random (version 4) UUID, as torchrun's standalone run id; without importing ``uuid``,
    which costs ~9 ms of start-up here (it imports ``platform``)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


DEFAULT_SHUTDOWN_TIMEOUT = 30.0

SWITCH = "switch"  # store_true; PET_X=<int>, non-zero = on
VALUE = "value"  # takes one value
OPTIONAL = "optional"  # takes an optional value (--pass-local-rank [dash|underscore])


@record(frozen=True)
class Flag:
    dest: str
    names: tuple[str, ...]
    kind: str
    default: str | None  # torchrun's default as text; None: not given
    help: str
    env: bool = True  # torchrun reads PET_<DEST> for this flag
    metavar: str | None = None

    @property
    def env_name(self) -> str:
        return f"PET_{self.dest.upper()}"

    @property
    def display(self) -> str:
        return next(name for name in self.names if name.startswith("--"))


def _f(
    dest: str,
    *names: str,
    kind: str = VALUE,
    default: str | None = None,
    help: str,
    env: bool = True,
    metavar: str | None = None,
) -> Flag:
    return Flag(dest=dest, names=names, kind=kind, default=default, help=help, env=env, metavar=metavar)


def _both(flag: str) -> tuple[str, str]:
    return flag, flag.replace("-", "_").replace("__", "--", 1)


# The table every flag, its default and its environment variable come from. The order is
# torchrun's (run.py get_args_parser), then ours.
FLAGS: tuple[Flag, ...] = (
    _f("nnodes", "--nnodes", default="1:1", metavar="N|MIN:MAX", help="number of nodes, or a range MIN:MAX"),
    _f(
        "nproc_per_node",
        *_both("--nproc-per-node"),
        default="1",
        metavar="N|auto|cpu|gpu",
        help="workers per node: a number, 'cpu' (usable CPUs), 'gpu' (visible NVIDIA GPUs) "
        "or 'auto' (GPUs if any, else CPUs)",
    ),
    _f(
        "rdzv_backend",
        *_both("--rdzv-backend"),
        default=None,
        help="rendezvous backend (default c10d: node-agent's rendezvous server; torchrun: static)",
    ),
    _f(
        "rdzv_endpoint",
        *_both("--rdzv-endpoint"),
        default="",
        metavar="HOST[:PORT]",
        help=f"rendezvous server address; [v6addr]:PORT for IPv6 (default port {DEFAULT_RDZV_PORT})",
    ),
    _f("rdzv_id", *_both("--rdzv-id"), default="none", help="job id; nodes with the same id form one job"),
    _f(
        "rdzv_conf",
        *_both("--rdzv-conf"),
        default="",
        metavar="K=V,...",
        help="rendezvous settings: join_timeout, last_call_timeout, close_timeout, heartbeat_interval, "
        "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout, is_host, "
        "exit_barrier_timeout",
    ),
    _f(
        "standalone",
        "--standalone",
        kind=SWITCH,
        help="run the rendezvous inside this agent on a free port (the default for a single node)",
    ),
    _f("max_restarts", *_both("--max-restarts"), default="0", help="worker group restarts before failing"),
    _f("monitor_interval", *_both("--monitor-interval"), default="0.1", help="seconds between worker checks"),
    _f(
        "start_method",
        *_both("--start-method"),
        default="spawn",
        metavar="{spawn,fork,forkserver}",
        help="accepted for compatibility; workers are always new processes",
    ),
    _f(
        "event_log_handler",
        *_both("--event-log-handler"),
        default="null",
        metavar="{null,console,dynamic_rendezvous}",
        help="where agent events go: null (nowhere) or console (stderr)",
    ),
    _f("role", "--role", default="default", help="worker role name (ROLE_NAME)"),
    _f("module", "-m", "--module", kind=SWITCH, help="run the script as a module, like 'python -m'"),
    _f("no_python", *_both("--no-python"), kind=SWITCH, help="run the script as a command, without python"),
    _f(
        "run_path",
        *_both("--run-path"),
        kind=SWITCH,
        help="run the script file with runpy.run_path (takes precedence over --no-python)",
    ),
    _f(
        "log_dir",
        *_both("--log-dir"),
        default=None,
        help="base directory for log files (default: a temp dir)",
    ),
    _f(
        "redirects",
        "-r",
        "--redirects",
        default="0",
        metavar="STD|RANK:STD,...",
        help="send worker streams to files: 0 none, 1 stdout, 2 stderr, 3 both; or per rank, 0:1,1:2",
    ),
    _f(
        "tee",
        "-t",
        "--tee",
        default="0",
        metavar="STD|RANK:STD,...",
        help="like --redirects, and also console",
    ),
    _f(
        "local_ranks_filter",
        *_both("--local-ranks-filter"),
        default="",
        metavar="R,R,...",
        help="show only these local ranks on the console (files keep everything)",
    ),
    _f(
        "duplicate_stdout_filters",
        *_both("--duplicate-stdout-filters"),
        default="",
        metavar="S,S,...",
        help="copy stdout lines containing any of these strings to a file (',,' is a literal comma)",
    ),
    _f(
        "duplicate_stderr_filters",
        *_both("--duplicate-stderr-filters"),
        default="",
        metavar="S,S,...",
        help="copy stderr lines containing any of these strings to a file (',,' is a literal comma)",
    ),
    _f("node_rank", *_both("--node-rank"), default="0", help="node rank; static rendezvous only"),
    _f(
        "master_addr",
        *_both("--master-addr"),
        default=None,
        help="static rendezvous only (torchrun: 127.0.0.1)",
    ),
    _f("master_port", *_both("--master-port"), default=None, help="static rendezvous only (torchrun: 29500)"),
    _f(
        "local_addr",
        *_both("--local-addr"),
        default=None,
        help="the address other nodes reach this node at (default: the interface routing to the rendezvous)",
    ),
    _f(
        "logs_specs",
        *_both("--logs-specs"),
        default=None,
        env=False,
        help="only 'default' (torchrun's own log layout, which node-agent writes)",
    ),
    _f(
        "numa_binding",
        *_both("--numa-binding"),
        default=None,
        env=False,
        metavar="{node,socket,exclusive,core-complex}",
        help="bind each worker to the CPUs near its GPU (torch's modes; applied when every local rank "
        "has one visible GPU)",
    ),
    _f(
        "signals_to_handle",
        *_both("--signals-to-handle"),
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        metavar="SIG,SIG,...",
        help="signals the agent forwards to the workers before stopping",
    ),
    _f(
        "shutdown_timeout",
        *_both("--shutdown-timeout"),
        default=None,
        metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    ),
    _f(
        "virtual_local_rank",
        *_both("--virtual-local-rank"),
        kind=SWITCH,
        help="LOCAL_RANK=0 in every worker, each seeing only its own GPU through CUDA_VISIBLE_DEVICES",
    ),
    # node-agent's own
    _f(
        "pass_local_rank",
        *_both("--pass-local-rank"),
        kind=OPTIONAL,
        default=None,
        metavar="{dash,underscore}",
        help="append --local-rank=N (dash, the default) or --local_rank=N to the script's arguments, "
        "for torch.distributed.launch scripts; torchrun never does",
    ),
    _f("log_format", *_both("--log-format"), default="text", metavar="{text,json}", help="agent log format"),
    _f(
        "hang_timeout",
        *_both("--hang-timeout"),
        default="auto",
        metavar="auto|SECONDS|off",
        help="a rank that reports progress (node_agent.worker) and then makes none for this long is "
        "hung: its stacks and every rank's are collected, then the job restarts; auto (the default) "
        "calibrates the budget from the step times seen",
    ),
    _f(
        "hang_conf",
        *_both("--hang-conf"),
        default="",
        metavar="KEY=VALUE,...",
        help="the hang budgets: first_step, floor, factor, warmup, checkpoint (seconds, except factor "
        "and warmup) and phase.NAME=SECONDS for any phase",
    ),
    _f(
        "health_check",
        *_both("--health-check"),
        default=None,
        metavar="CMD",
        help="command that checks this node's health before each rendezvous, or 'gpu' for the built-in "
        "check of the visible NVIDIA GPUs",
    ),
    _f(
        "gpu_release_timeout",
        "--gpu-release-timeout",
        default="50",
        metavar="SECONDS",
        help="before a restart, wait up to this long for the previous workers' GPU memory to be "
        "released; 0: do not wait",
    ),
    _f(
        "snapshot_memory",
        "--snapshot-memory",
        default="auto",
        metavar="SIZE",
        help="memory (e.g. 16G) for this node's in-memory snapshots (node_agent.worker.snapshot) "
        "and the replicas it keeps for a peer; auto: a quarter of /dev/shm; 0: no snapshots",
    ),
    _f(
        "snapshot_replication_rate",
        "--snapshot-replication-rate",
        default="256M",
        metavar="BYTES_PER_S",
        help="the most a snapshot's replication to the peer node sends per second (e.g. 256M), "
        "so that it takes a bounded share of the training's network; 0: no limit",
    ),
    _f(
        "snapshot_dir",
        "--snapshot-dir",
        default=None,
        metavar="DIR",
        help="also persist each job's newest consistent in-memory snapshot here, in the background "
        "(a directory the nodes share, like a checkpoint directory), so that a job lost whole "
        "resumes from it; removed when the job succeeds",
    ),
    _f(
        "outcome_dir",
        "--outcome-dir",
        default=None,
        metavar="DIR",
        help="when the job ends, write how it ended for this agent to DIR/<host>-<pid> ('succeeded', "
        "'left' or 'failed CODE'; a killed agent writes none): a batch script tells a finished "
        "elastic job that lost a node from a failed one",
    ),
    _f(
        "gpu_release_mib",
        "--gpu-release-mib",
        default="512",
        metavar="MIB",
        help="GPU memory still in use (MiB per GPU) that counts as released",
    ),
    _f(
        "preload",
        "--preload",
        default="",
        metavar="MODULE,...",
        help="keep one Python per local rank that has imported these modules (e.g. torch) and "
        "becomes the next worker: restarts skip the imports; off when empty",
    ),
    _f(
        "token_file",
        *_both("--token-file"),
        default=None,
        env=False,
        metavar="PATH",
        help="file with the rendezvous token (TOKEN, or 'JOB_ID TOKEN' lines); also RDZV_TOKEN_FILE "
        "or RDZV_TOKEN",
    ),
    _f(
        "tls_ca",
        *_both("--tls-ca"),
        default=None,
        env=False,
        metavar="FILE",
        help="reach the rendezvous server over TLS, trusting this PEM CA; its certificate must name "
        "the --rdzv-endpoint host; also RDZV_TLS_CA",
    ),
    _f(
        "tls_cert",
        *_both("--tls-cert"),
        default=None,
        env=False,
        metavar="FILE",
        help="client certificate for a server with --tls-client-ca (needs --tls-key); also RDZV_TLS_CERT",
    ),
    _f(
        "tls_key",
        *_both("--tls-key"),
        default=None,
        env=False,
        metavar="FILE",
        help="the client certificate's unencrypted PEM key; also RDZV_TLS_KEY",
    ),
)
BY_DEST = {flag.dest: flag for flag in FLAGS}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, sized without ``shutil``, which it would import (~10 ms, with zlib,
    bz2 and lzma) on every launch just to read the terminal's width."""

    def __init__(self, prog: str) -> None:
        try:
            width = int(os.environ["COLUMNS"])
        except (KeyError, ValueError):
            try:
                # sys.__stdout__ is None without a stdout: the AttributeError below.
                width = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
            except (AttributeError, ValueError, OSError):
                width = 80
        super().__init__(prog, width=max(width - 2, 20))


USAGE = """node-agent [OPTIONS] [--] TRAINING_SCRIPT [SCRIPT ARGS ...]
  one machine:    node-agent --standalone --nproc-per-node 4 train.py --epochs 3
  several nodes:  node-agent --nnodes 2:8 --nproc-per-node 8 --rdzv-endpoint head:29500 train.py"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for torchrun's flags (plus ours); values are kept as strings.

    Defaults are not argparse's business here: an option absent from the command line is
    absent from the namespace, and ``parse_config`` fills it from ``PET_*`` or the default.
    """
    parser = argparse.ArgumentParser(
        prog="node-agent",
        usage=USAGE,
        description="A drop-in for torchrun: starts this node's workers and keeps them in a job. "
        "Everything after the training script is the script's own arguments, never read by "
        "node-agent; '--' before the script also ends node-agent's options "
        "(node-agent --nproc-per-node 2 -- train.py --nnodes 3).",
        epilog="Every option can also be set as PET_<NAME>, e.g. PET_NPROC_PER_NODE=4; "
        "a command-line flag wins.",
        formatter_class=_HelpFormatter,
    )
    for flag in FLAGS:
        shown_default = "" if flag.default in (None, "") else f" (default: {flag.default})"
        common: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": flag.help + shown_default,
        }
        if flag.kind == SWITCH:
            parser.add_argument(*flag.names, action="store_true", **common)
        elif flag.kind == OPTIONAL:
            parser.add_argument(*flag.names, nargs="?", const="dash", metavar=flag.metavar, **common)
        else:
            parser.add_argument(*flag.names, metavar=flag.metavar, **common)
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("training_script", help="the training script (or module, or command) to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def split_script(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the command line into the launcher's part (up to and including the script) and
    the script's own arguments, which argparse never sees.

    argparse would otherwise match words after the script against our flags: ``train.py
    --token hf_x`` fails as an ambiguous prefix of ``--token-file``. We walk the launcher's part
    with the flag table (a flag that takes a value skips it; ``--`` ends the flags); the first
    word that is not a flag is the script. A bare ``--pass-local-rank`` becomes
    ``--pass-local-rank=dash``, since argparse would give that optional-value flag the next word
    whatever it is. An unknown flag stops the walk and argparse reports it.
    """
    out = list(argv)
    long_names = {name: flag for flag in FLAGS for name in flag.names if name.startswith("--")}
    short_names = {name: flag for flag in FLAGS for name in flag.names if not name.startswith("--")}
    i = 0
    while i < len(out):
        token = out[i]
        if token == "--":
            return out[: i + 2], out[i + 2 :]  # the script follows
        if token == "-" or not token.startswith("-"):
            return out[: i + 1], out[i + 1 :]
        if token.startswith("--"):
            name, has_value, _ = token.partition("=")
            flag = long_names.get(name)
            if flag is None:  # argparse also accepts unambiguous prefixes
                candidates = {f.dest: f for n, f in long_names.items() if n.startswith(name)}
                flag = next(iter(candidates.values())) if len(candidates) == 1 else None
        else:
            flag = short_names.get(token[:2])
            has_value = "=" if len(token) > 2 else ""  # "-r3"
            if flag is not None and flag.kind == SWITCH and has_value:
                break  # a cluster such as "-mr3": leave it to argparse
        if flag is None:
            break  # unknown: argparse will report it
        if flag.kind == VALUE and not has_value:
            i += 1  # skip its value
        elif flag.kind == OPTIONAL and not has_value:
            following = out[i + 1] if i + 1 < len(out) else None
            if following in PASS_LOCAL_RANK_STYLES:
                i += 1
            else:
                out[i] = f"{flag.names[0]}=dash"
        i += 1
    return out, []
