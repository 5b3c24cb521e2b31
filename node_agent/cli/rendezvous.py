"""The rendezvous part of the command line: --nnodes, the backend torchrun's flags imply
(standalone, static, ours), the endpoint, and the static backend's master."""

from __future__ import annotations

import logging

from ..config import (
    DEFAULT_RDZV_PORT,
    ConfigError,
    is_count,
)
from ..rdzv import BACKENDS
from .flags import BY_DEST, STANDALONE_ENDPOINT, random_uuid4
from .inputs import Given, Inputs

logger = logging.getLogger(__name__)


# --- the rendezvous -------------------------------------------------------------------------


def parse_nnodes(given: Given) -> tuple[int, int]:
    text = (given.value or "").strip()
    what = given.what(BY_DEST["nnodes"])
    bad = ConfigError(f"{what}={given.value!r}: expected N or MIN:MAX with 0 < MIN <= MAX, e.g. 2 or 1:4")
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(is_count(p.strip().removeprefix("+")) for p in parts):
        raise bad
    low, high = int(parts[0]), int(parts[-1])
    if not 0 < low <= high:
        raise bad
    return low, high


def implied_static(inputs: Inputs, max_nodes: int) -> bool:
    """torchrun's own backend choice when the line names no backend and no endpoint.

    torchrun defaults to ``static``, and runs a standalone rendezvous instead only on one node
    without ``--master-port``. We keep that wherever the line gives torchrun's static flags
    (``--node-rank``, ``--master-addr``, ``--master-port``, as flags or ``PET_*``): the classic
    ``--nnodes 2 --node-rank R --master-addr A --master-port P`` line, Kubeflow's ``PET_*``.
    A multi-node line without any of them is refused instead (``resolve_rendezvous``).
    """
    if inputs.given("master_port"):
        return True
    return max_nodes > 1 and (inputs.given("node_rank") or inputs.given("master_addr"))


def resolve_rendezvous(inputs: Inputs, max_nodes: int) -> tuple[bool, str, str, str]:
    """Decide standalone, backend, endpoint and id (torchrun's run() rules, adjusted)."""
    backend_given = inputs.get("rdzv_backend")
    endpoint_given = inputs.get("rdzv_endpoint")
    id_given = inputs.get("rdzv_id")
    standalone = inputs.switch("standalone")
    unnamed = backend_given.origin is None and not (endpoint_given.value or "").strip()

    if not standalone and unnamed and implied_static(inputs, max_nodes):
        return False, "static", "", id_given.value or "none"
    implicit = not standalone and max_nodes == 1 and unnamed
    if standalone or implicit:
        # As torchrun's --standalone: a private rendezvous on a free local port, and a fresh id
        # so two single-node jobs on one machine never meet.
        if max_nodes > 1:
            # torchrun accepts this and then waits for nodes that can never find the free port.
            raise ConfigError(
                f"--standalone runs a private rendezvous no other node can join, but --nnodes allows "
                f"up to {max_nodes} nodes; give --rdzv-endpoint HOST:PORT for a multi-node run"
            )
        overridden = [
            f"{g.origin}={g.value}"
            for g in (backend_given, endpoint_given, id_given)
            if g.origin is not None and (g is not endpoint_given or (g.value or "").strip())
        ]
        if overridden:
            logger.warning(
                "%s: ignoring %s (a standalone run uses its own rendezvous on a free local port "
                "and a fresh id)",
                "--standalone" if standalone else "single-node run without --rdzv-endpoint",
                ", ".join(overridden),
            )
        return True, "c10d", STANDALONE_ENDPOINT, random_uuid4()

    backend = "c10d" if backend_given.value is None else backend_given.value
    what = backend_given.what(BY_DEST["rdzv_backend"])
    if backend not in BACKENDS:
        raise ConfigError(f"{what}={backend!r} is not a rendezvous backend: use one of {', '.join(BACKENDS)}")
    endpoint = (endpoint_given.value or "").strip()
    if not endpoint and max_nodes > 1 and backend_given.origin is None:
        # torchrun would run static with every node rank 0 (none of its flags was given): both
        # nodes would wait for each other's rank 1 until a timeout.
        raise ConfigError(
            "a multi-node run needs --rdzv-endpoint HOST[:PORT], the address of the rendezvous "
            "server, or torchrun's static flags: --node-rank R --master-addr ADDR --master-port PORT"
        )
    if not id_given.value:
        raise ConfigError(
            f"{id_given.what(BY_DEST['rdzv_id'])} is empty: give the job a name shared by its nodes"
        )
    return False, backend, endpoint, id_given.value


def warn_unused_static_flags(inputs: Inputs, backend: str, standalone: bool, node_rank: int) -> None:
    """Say which of torchrun's static flags this rendezvous does not use (as torchrun warns)."""
    standalone = standalone and inputs.switch("standalone")  # else torchrun's single-node c10d
    unused = [BY_DEST[d].display for d in ("master_addr", "master_port") if inputs.given(d)]
    if unused:
        logger.warning(
            "%s: ignored, as torchrun ignores %s with %s; workers get MASTER_ADDR/MASTER_PORT "
            "from the rendezvous",
            " and ".join(unused),
            "it" if len(unused) == 1 else "them",
            "--standalone" if standalone else f"--rdzv-backend={backend}",
        )
    if inputs.given("node_rank") and (standalone or not BACKENDS[backend].takes_node_rank):
        logger.warning(
            "--node-rank=%d: ignored with %s (torchrun too); the rendezvous assigns node ranks",
            node_rank,
            "--standalone" if standalone else f"--rdzv-backend={backend}",
        )


def static_master(
    inputs: Inputs,
    endpoint: str,
    endpoint_host: str,
    endpoint_port: int,
    master_addr: str | None,
    master_port: int | None,
    min_nodes: int,
    max_nodes: int,
    node_rank: int,
) -> tuple[str, int]:
    """torchrun's static rendezvous: ranks come from --node-rank; the master from the flags.

    The master is --rdzv-endpoint when given, else --master-addr:--master-port (torchrun's
    127.0.0.1:29500). Worker rank 0 hosts torch's TCPStore on that port.
    """
    if min_nodes != max_nodes:
        raise ConfigError(
            "the static rendezvous (--rdzv-backend=static, or torchrun's --node-rank/--master-addr/"
            f"--master-port without --rdzv-endpoint) needs a fixed node count (--nnodes N), not "
            f"{min_nodes}:{max_nodes}; give --rdzv-endpoint HOST:PORT for an elastic job"
        )
    if node_rank >= max_nodes:
        raise ConfigError(f"--node-rank={node_rank} must be below --nnodes={max_nodes} (ranks count from 0)")
    if endpoint:
        if not inputs.given("rdzv_endpoint") or ":" in endpoint.rsplit("]", 1)[-1]:
            return endpoint_host, endpoint_port
        return endpoint_host, master_port or DEFAULT_RDZV_PORT
    return master_addr or "127.0.0.1", master_port or DEFAULT_RDZV_PORT


def parse_endpoint(
    endpoint: str, given: Given, max_nodes: int, default_port: int = DEFAULT_RDZV_PORT
) -> tuple[str, int]:
    """Split HOST[:PORT] / [V6]:PORT / [V6]; an empty endpoint means 127.0.0.1 (torchrun: localhost).
    ``default_port``: the backend's, where none is written."""
    what = given.what(BY_DEST["rdzv_endpoint"])
    text = endpoint.strip()
    if not text:
        return "127.0.0.1", default_port
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what}={endpoint!r}: write an IPv6 endpoint as [ADDR]:PORT, e.g. [::1]:29500")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ConfigError(
            f"{what}={endpoint!r}: put an IPv6 address in brackets, e.g. [{text}] or [::1]:29500"
        )
    else:
        host, colon, port_text_ = text.partition(":")
        port_text = port_text_ if colon else None
    if not host or not all(c.isalnum() or c in "_.:-" for c in host):
        raise ConfigError(f"{what}={endpoint!r}: the host must be a hostname, an IPv4 or an IPv6 address")
    if port_text is None:
        return host, default_port
    if not is_count(port_text) or int(port_text) > 65535:
        raise ConfigError(f"{what}={endpoint!r}: the port must be a number in 1..65535")
    port = int(port_text)
    if port == 0 and max_nodes > 1:
        raise ConfigError(
            f"{what}={endpoint!r}: port 0 (a free port) only works for a single-node run; "
            "other nodes could not find it. Give the rendezvous server's port"
        )
    return host, port
