"""TLS on the server's one port, in process: the agent's connect() and HTTPS against the service."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from edge.tls import client_context, server_context
from node_agent.rdzv import NotARendezvousServer, RendezvousRefused
from node_agent.rdzv.server import Connection, TLSFailed, connect
from rdzv_server.cli import EXIT_USAGE, main
from rdzv_server.config import load_server_tls
from rdzv_server.ops_client import CommandError, base_url
from rdzv_server.service import RendezvousService
from tests.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def services() -> AsyncIterator[Callable[..., object]]:
    """Start services on free loopback ports; all are closed after the test."""
    started: list[RendezvousService] = []

    async def start(tls: ssl.SSLContext | None) -> int:
        svc = RendezvousService(http=True, tls=tls)
        started.append(svc)
        return await svc.start("127.0.0.1", 0)

    yield start
    for svc in started:
        await svc.close()


async def dial(port: int, tls: ssl.SSLContext | None, host: str = "127.0.0.1") -> Connection:
    conn = await connect(
        host, port, deadline=time.monotonic() + 5, handshake_timeout=5, log=lambda _: None, tls=tls
    )
    await conn.close()
    return conn


def get(url: str, ctx: ssl.SSLContext) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_agents_and_https_share_the_tls_port(pki: Pki, services) -> None:
    port = await services(server_context(str(pki.server_cert), str(pki.server_key)))
    ca = client_context(str(pki.ca))
    assert (await dial(port, ca)).version >= 1
    assert (await dial(port, ca, host="localhost")).version >= 1
    status, doc = await asyncio.to_thread(get, f"https://127.0.0.1:{port}/healthz", ca)
    assert status == 200 and doc["status"] == "ok"


async def test_a_plain_hello_to_a_tls_server_is_told_to_use_tls(pki: Pki, services) -> None:
    port = await services(server_context(str(pki.server_cert), str(pki.server_key)))
    with pytest.raises(NotARendezvousServer, match=r"closed the connection during the hello.*give --tls-ca"):
        await dial(port, None)
    assert (await dial(port, client_context(str(pki.ca)))).version >= 1  # still serving


async def test_a_tls_hello_to_a_plain_server(pki: Pki, services) -> None:
    port = await services(None)
    with pytest.raises(NotARendezvousServer, match="during the TLS handshake: it does not speak TLS"):
        await dial(port, client_context(str(pki.ca)))


async def test_the_server_certificate_must_verify_and_name_the_host(pki: Pki, services) -> None:
    port = await services(server_context(str(pki.server_cert), str(pki.server_key)))
    with pytest.raises(TLSFailed, match="unable to get local issuer certificate"):
        await dial(port, client_context(str(pki.other_ca)))
    misnamed = await services(server_context(str(pki.misnamed_cert), str(pki.misnamed_key)))
    ca = client_context(str(pki.ca))
    with pytest.raises(TLSFailed, match=r"IP address mismatch.*'127\.0\.0\.1'"):
        await dial(misnamed, ca)
    with pytest.raises(TLSFailed, match=r"Hostname mismatch.*'localhost'"):
        await dial(misnamed, ca, host="localhost")


async def test_client_certificates(pki: Pki, services) -> None:
    port = await services(server_context(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    bare = client_context(str(pki.ca))
    ours = client_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    theirs = client_context(str(pki.ca), str(pki.stranger_cert), str(pki.stranger_key))
    with pytest.raises(RendezvousRefused, match=r"requires a client certificate.*--tls-cert and --tls-key"):
        await dial(port, bare)
    with pytest.raises(NotARendezvousServer, match="did not accept our client certificate"):
        await dial(port, theirs)
    assert (await dial(port, ours)).version >= 1
    url = f"https://127.0.0.1:{port}/healthz"
    status, doc = await asyncio.to_thread(get, url, bare)
    assert status == 403 and doc["error"] == "client_certificate_required"
    assert (await asyncio.to_thread(get, url, ours))[0] == 200


def test_server_flags(pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_server_tls(None, None, None) is None
    ctx = load_server_tls(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_OPTIONAL  # the service refuses, with words
    with pytest.raises(ValueError, match="--tls-cert needs --tls-key"):
        load_server_tls(str(pki.server_cert), None, None)
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        load_server_tls(None, None, str(pki.ca))
    missing = str(tmp_path / "missing.pem")
    assert main(["--port", "0", "--tls-cert", missing, "--tls-key", str(pki.server_key)]) == EXIT_USAGE
    assert f"cannot read the TLS certificate {missing!r}" in capsys.readouterr().err


def test_status_and_drain_endpoints_with_tls() -> None:
    assert base_url("h:1", tls=True) == "https://h:1"
    assert base_url("https://h:1", tls=True) == "https://h:1"
    with pytest.raises(CommandError, match="give --tls-ca"):
        base_url("https://h:1")
    with pytest.raises(CommandError):
        base_url("http://h:1", tls=True)
