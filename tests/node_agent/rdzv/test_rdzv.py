"""``node_agent.rdzv.open_backend``: the one place that reads ``--rdzv-backend``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig
from node_agent.rdzv import BACKENDS, RendezvousBackend, RendezvousError, open_backend


def config(tmp_path: Path, *flags: str) -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return parse_config([*flags, "--rdzv-id=job", str(script)], {})


def opened(cfg: AgentConfig) -> RendezvousBackend:
    async def scenario() -> RendezvousBackend:
        backend = await open_backend(cfg, node_id="n", log=lambda *a: None, clock=lambda: 0.0)
        await backend.close(linger=False)
        return backend

    return asyncio.run(scenario())


OPENS = [
    (("--rdzv-backend=c10d", "--rdzv-endpoint=10.255.255.1:29400"), "ServerBackend", True, False),
    (("--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29400"), "StaticBackend", False, False),
    (("--rdzv-backend=etcd", "--rdzv-endpoint=etcd.invalid:2379"), "EtcdBackend", True, True),
    (("--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd.invalid:2379"), "EtcdBackend", True, True),
]


def test_every_backend_of_the_table_is_opened_below() -> None:
    """A row added to ``BACKENDS`` (what the command line admits) comes with its case here."""
    assert sorted(flags[0].removeprefix("--rdzv-backend=") for flags, *_ in OPENS) == sorted(BACKENDS)


@pytest.mark.parametrize(("flags", "kind", "reconnects", "shares_joins"), OPENS)
def test_each_backend_name_opens_its_backend(
    tmp_path: Path, flags: tuple[str, ...], kind: str, reconnects: bool, shares_joins: bool
) -> None:
    backend = opened(config(tmp_path, *flags))
    assert (type(backend).__name__, backend.reconnects, backend.shares_joins) == (
        kind,
        reconnects,
        shares_joins,
    )


def test_a_standalone_agent_hosts_the_rendezvous_it_connects_to(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--standalone")

    async def scenario() -> tuple[str, str]:
        backend = await open_backend(cfg, node_id="n", log=lambda *a: None, clock=lambda: 0.0)
        try:
            link = await backend.connect(asyncio.get_running_loop().time() + 10)
            await link.close()
            return type(backend).__name__, link.local_ip
        finally:
            await backend.close(linger=False)

    assert asyncio.run(scenario()) == ("ServerBackend", "127.0.0.1")


def test_a_port_the_agent_must_host_on_but_cannot_is_a_rendezvous_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = config(tmp_path, f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=true")
        with pytest.raises(RendezvousError, match=f"cannot host the rendezvous on 127.0.0.1:{port}"):
            opened(cfg)


def test_the_agent_imports_no_backend_it_does_not_use() -> None:
    code = (
        "import sys, node_agent.runner, node_agent.rdzv\n"
        "print(sorted(m for m in sys.modules if m.startswith('node_agent.rdzv.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
