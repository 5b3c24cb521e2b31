"""TLS end to end: a real server, real agents and workers, and a throw-away CA made by openssl."""

from __future__ import annotations

import json
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pki import Pki, make_pki

from .procs import WORKERS, Proc, agent_cmd, read_env_dumps, server_cmd, start_server

DUMP = str(WORKERS / "dump_env.py")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[tuple[Proc, int]]:
    srv, port = start_server("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    try:
        yield srv, port
    finally:
        srv.kill()


def job(port: int, rdzv_id: str, *extra: str, nnodes: int = 1, host: str = "127.0.0.1") -> list[str]:
    args = ("--nnodes", str(nnodes), "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", rdzv_id)
    return agent_cmd(*args, *extra, DUMP)


def run(argv: list[str], out: Path, timeout: float = 60.0) -> Proc:
    p = Proc(argv, env={"DUMP_DIR": str(out)})
    try:
        p.wait(timeout=timeout)
    finally:
        p.kill()
    return p


def test_a_tls_agent_runs_a_job_and_https_shares_the_port(
    tmp_path: Path, pki: Pki, tls_server: tuple[Proc, int]
) -> None:
    srv, port = tls_server
    srv.wait_for_line(r"TLS on: .* client certificates not asked for", timeout=10)
    # localhost, not the address: the certificate names both, and the check is by name here.
    a = run(job(port, "tls-job", "--tls-ca", str(pki.ca), host="localhost"), tmp_path)
    assert a.p.returncode == 0, a.stderr
    assert [e["TORCHELASTIC_RUN_ID"] for e in read_env_dumps(tmp_path)] == ["tls-job"]

    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=10, context=ctx) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    status = run(server_cmd("status", "--endpoint", f"127.0.0.1:{port}", "--tls-ca", str(pki.ca)), tmp_path)
    assert status.p.returncode == 0, status.stderr
    assert "tls-job" in status.stdout


def test_a_plain_agent_is_refused_and_the_server_keeps_serving_a_tls_job(
    tmp_path: Path, pki: Pki, tls_server: tuple[Proc, int]
) -> None:
    srv, port = tls_server
    tls = ("--tls-ca", str(pki.ca))
    first = Proc(job(port, "shared", *tls, nnodes=2), env={"DUMP_DIR": str(tmp_path)})
    try:
        srv.wait_for_line(r"job shared: node .* joined \(1 of 2\)")
        # The same job, without TLS: refused at once, with a message that names the fix.
        plain = run(job(port, "shared", nnodes=2), tmp_path)
        assert plain.p.returncode == 1
        assert "closed the connection during the hello" in plain.stderr
        assert "give --tls-ca" in plain.stderr and "Traceback" not in plain.stderr
        status = run(server_cmd("status", "--endpoint", f"127.0.0.1:{port}"), tmp_path)
        assert status.p.returncode == 1 and "give --tls-ca" in status.stderr
        # The job the first agent waits in is untouched: a second TLS node completes it.
        second = run(job(port, "shared", *tls, nnodes=2), tmp_path)
        assert second.p.returncode == 0, second.stderr
        assert first.wait(timeout=60) == 0, first.stderr
    finally:
        first.kill()
    assert sorted(e["RANK"] for e in read_env_dumps(tmp_path)) == ["0", "1"]


def test_a_tls_agent_refuses_a_server_it_cannot_verify_or_that_is_plain(
    tmp_path: Path, pki: Pki, tls_server: tuple[Proc, int]
) -> None:
    _, port = tls_server
    wrong = run(job(port, "wrong-ca", "--tls-ca", str(pki.other_ca)), tmp_path)
    assert wrong.p.returncode == 1
    assert "cannot verify the rendezvous server" in wrong.stderr
    assert "unable to get local issuer certificate" in wrong.stderr and "Traceback" not in wrong.stderr
    plain_srv, plain_port = start_server()
    try:
        to_plain = run(job(plain_port, "to-plain", "--tls-ca", str(pki.ca)), tmp_path)
        plain_srv.wait_for_line("it speaks TLS, but this server has no --tls-cert", timeout=10)
    finally:
        plain_srv.kill()
    assert to_plain.p.returncode == 1
    assert "during the TLS handshake: it does not speak TLS" in to_plain.stderr
    assert not read_env_dumps(tmp_path)


def test_client_certificates_when_the_server_requires_them(tmp_path: Path, pki: Pki) -> None:
    srv, port = start_server(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)
    )
    tls = ("--tls-ca", str(pki.ca))
    theirs = ("--tls-cert", str(pki.stranger_cert), "--tls-key", str(pki.stranger_key))
    ours = ("--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key))
    try:
        missing = run(job(port, "mtls", *tls), tmp_path)
        stranger = run(job(port, "mtls", *tls, *theirs), tmp_path)
        ok = run(job(port, "mtls", *tls, *ours), tmp_path)
        drain = ("drain", "--endpoint", f"127.0.0.1:{port}", "--job", "mtls", "--node", "nobody", *tls)
        drain_bare = run(server_cmd(*drain), tmp_path)
        drain_ours = run(server_cmd(*drain, *ours), tmp_path)
        srv.wait_for_line("TLS on: .* client certificates required", timeout=10)
        srv.wait_for_line("no client certificate", timeout=10)
    finally:
        srv.kill()
    assert missing.p.returncode == 1
    assert "requires a client certificate" in missing.stderr and "--tls-cert" in missing.stderr
    assert stranger.p.returncode == 1
    assert "did not accept our client certificate" in stranger.stderr
    assert ok.p.returncode == 0, ok.stderr
    assert drain_bare.p.returncode == 1 and "requires a client certificate" in drain_bare.stderr
    assert drain_ours.p.returncode == 3, drain_ours.stderr  # through TLS to the API: no such node


def test_the_server_names_a_bad_certificate_file(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "nope.pem"
    srv = Proc(server_cmd("--port", "0", "--tls-cert", str(missing), "--tls-key", str(pki.server_key)))
    try:
        assert srv.wait(timeout=30) == 2
    finally:
        srv.kill()
    assert f"cannot read the TLS certificate {str(missing)!r}" in srv.stderr
    assert "Traceback" not in srv.stderr


def test_a_tls_agent_never_hosts_a_plain_c10d_rendezvous(tmp_path: Path, pki: Pki) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = run(job(port, "no-host", "--tls-ca", str(pki.ca), "--rdzv-conf", "join_timeout=0.3"), tmp_path)
    assert a.p.returncode == 1
    assert "no rendezvous server answered" in a.stderr
    assert "this agent hosts it" not in a.stderr
