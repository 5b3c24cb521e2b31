"""``rdzv-server status`` and ``drain`` as real processes against a live server."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
import pytest

from protocol import Assignment, Drain, Restart
from protocol.auth import TokenTable
from rdzv_server.cli import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main
from rdzv_server.daemon import SafeFormatter
from rdzv_server.http_app import Access
from rdzv_server.ops_client import CommandError, base_url
from rdzv_server.service import RendezvousService

from .test_http import FakeAgent, Watch, running_job

CLI = [sys.executable, "-m", "rdzv_server.cli"]


@dataclass
class Ran:
    rc: int
    out: str
    err: str


async def run(*args: str, timeout: float = 30.0) -> Ran:
    p = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(p.communicate(), timeout)
    except TimeoutError:
        p.kill()
        await p.wait()
        raise
    return Ran(p.returncode if p.returncode is not None else -1, out.decode(), err.decode())


@pytest.fixture
async def server():
    svc = RendezvousService(http=True)
    port = await svc.start("127.0.0.1", 0)
    yield svc, f"127.0.0.1:{port}"
    await svc.close()


async def serving_process(*flags: str) -> tuple[asyncio.subprocess.Process, int]:
    """``rdzv-server --host 127.0.0.1 --port 0 [flags]`` as a real process, once it logs its port."""
    p = await asyncio.create_subprocess_exec(
        *CLI, "--host", "127.0.0.1", "--port", "0", *flags, stderr=asyncio.subprocess.PIPE
    )
    assert p.stderr is not None
    try:
        async with asyncio.timeout(20):
            while not (m := re.search(rb"listening on 127\.0\.0\.1:(\d+)", await p.stderr.readline())):
                pass
    except BaseException:
        p.kill()
        await p.wait()
        raise
    return p, int(m[1])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_forms() -> None:
    assert base_url("h:1") == "http://h:1"
    assert base_url("h") == "http://h:29500"
    assert base_url("http://10.1.2.3:80/") == "http://10.1.2.3:80"
    assert base_url("[::1]:5") == "http://[::1]:5"
    for bad in ("", "h:x", "https://h:1"):
        with pytest.raises(CommandError):
            base_url(bad)


async def test_status_of_an_empty_server(server) -> None:
    _, endpoint = server
    r = await run("status", "--endpoint", endpoint)
    assert r.rc == EXIT_OK, r.err
    assert "0 active jobs" in r.out and "no jobs" in r.out


async def test_status_lists_jobs_and_shows_one_in_detail(server) -> None:
    svc, endpoint = server
    port = int(endpoint.rsplit(":", 1)[1])
    a, b, c = await running_job(port, ["a", "b", "c"], min_nodes=2, max_nodes=3)
    c.fail(round=0, rank=4, exitcode=9, message="out of memory")
    for x in (a, b, c):
        await x.expect(Restart)
    for x in (a, b, c):
        x.rejoin()
    for x in (a, b, c):
        await x.expect(Assignment)
    await c.kill()
    await Watch(svc).until(lambda: "c" not in svc.machine.jobs["j"].members)

    r = await run("status", "--endpoint", endpoint)
    assert r.rc == EXIT_OK, r.err
    header, row = [line for line in r.out.splitlines() if line.startswith(("JOB", "j "))]
    assert header.split() == ["JOB", "PHASE", "NODES", "ROUND", "RESTARTS", "AGE", "GOODPUT"]
    assert row.split()[:5] == ["j", "gathering", "2/2:3", "2", "1/3"]

    r = await run("status", "--endpoint", endpoint, "--job", "j")
    assert r.rc == EXIT_OK, r.err
    out = r.out
    assert out.startswith("job j: gathering")
    assert "restarts 1/3" in out and "entrypoint train.py" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"^[abc] ", line)}
    assert rows["a"][1] == "waiting" and rows["c"][1] == "LOST"
    assert "connection closed" in out  # why c is gone
    cause = "rank 4 (local rank 0) on node c (127.0.0.1) failed with exit code 9"
    assert f"round 0: {cause}: out of memory" in out
    assert re.search(r"^  \d\d:\d\d:\d\d  lost +node c connection closed", out, re.M)


async def test_status_json_is_the_api(server) -> None:
    _, endpoint = server
    port = int(endpoint.rsplit(":", 1)[1])
    agents = await running_job(port, ["a", "b"])
    r = await run("status", "--endpoint", endpoint, "--json")
    assert r.rc == EXIT_OK, r.err
    doc = json.loads(r.out)
    assert [j["id"] for j in doc["jobs"]] == ["j"] and doc["server"]["agents"] == 2
    r = await run("status", "--endpoint", endpoint, "--json", "--job", "j")
    assert json.loads(r.out)["members"][0]["node_id"] == "a"
    del agents


async def test_status_unknown_job_names_it(server) -> None:
    _, endpoint = server
    r = await run("status", "--endpoint", endpoint, "--job", "nope")
    assert r.rc == EXIT_NOT_FOUND
    assert r.err.strip() == f"rdzv-server status: error: no job 'nope' on {endpoint}"


async def test_unreachable_endpoint_is_a_clear_error() -> None:
    port = closed_port()
    for cmd in (["status"], ["drain", "--job", "j", "--node", "a"]):
        r = await run(*cmd, "--endpoint", f"127.0.0.1:{port}")
        assert r.rc == EXIT_ERROR, r
        assert f"cannot reach the rendezvous server at http://127.0.0.1:{port}" in r.err
        assert "Traceback" not in r.err and r.out == ""
    r = await run("status", "--endpoint", "nowhere:xyz")
    assert r.rc == EXIT_USAGE and "bad port" in r.err


async def test_a_port_that_accepts_but_never_answers_is_named_as_such() -> None:
    """What a standby agent's reserved port does until it hosts (issue 45): the kernel takes
    the connection, nothing answers. The error says so and where to ask instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # never accepted
        port = s.getsockname()[1]
        r = await run("status", "--endpoint", f"127.0.0.1:{port}", "--timeout", "0.5")
    assert r.rc == EXIT_ERROR, r
    assert "took the connection but did not answer within 0.5 s" in r.err, r.err
    assert "this node hosts the rendezvous now, on port P" in r.err and "Traceback" not in r.err


async def test_drain_sends_the_node_a_drain(server) -> None:
    svc, endpoint = server
    port = int(endpoint.rsplit(":", 1)[1])
    a, b = await running_job(port, ["a", "b"])
    r = await run("drain", "--endpoint", endpoint, "--job", "j", "--node", "b", "--reason", "new disk")
    assert r.rc == EXIT_OK, r.err
    assert r.out.strip() == (
        "asked node b of job j to drain (new disk): its agent stops its workers and leaves the job"
    )
    assert (await b.expect(Drain)).reason == "new disk"
    assert svc.machine.jobs["j"].history[-1].text == "node b asked to drain: new disk"
    del a


async def test_drain_unknown_job_or_node_names_what_is_missing(server) -> None:
    _, endpoint = server
    port = int(endpoint.rsplit(":", 1)[1])
    agents = await running_job(port, ["a", "b"])
    r = await run("drain", "--endpoint", endpoint, "--job", "j", "--node", "zz")
    assert r.rc == EXIT_NOT_FOUND
    assert r.err.strip() == "rdzv-server drain: error: cannot drain: job 'j' has no node 'zz'"
    r = await run("drain", "--endpoint", endpoint, "--job", "nope", "--node", "a")
    assert r.rc == EXIT_NOT_FOUND and "no job 'nope'" in r.err
    del agents


async def test_drain_with_tokens_sends_the_jobs_token_from_the_token_file(tmp_path) -> None:
    svc = RendezvousService(http=True, tokens=TokenTable(per_job={"j": "j-secret"}))
    port = await svc.start("127.0.0.1", 0)
    try:
        base = ("drain", "--endpoint", f"127.0.0.1:{port}", "--job", "j", "--node", "a")
        r = await run(*base)
        assert r.rc == EXIT_ERROR
        assert "needs the job's token" in r.err and "(see --token-file)" in r.err
        wrong = tmp_path / "wrong"
        wrong.write_text("j not-it\n")
        r = await run(*base, "--token-file", str(wrong))
        assert r.rc == EXIT_ERROR and "not this job's token" in r.err
        right = tmp_path / "right"
        right.write_text("# the job's line wins\nother x\nj j-secret\n")
        r = await run(*base, "--token-file", str(right))
        assert r.rc == EXIT_NOT_FOUND and "no job 'j'" in r.err  # authorised; the job is not there
    finally:
        await svc.close()


async def test_status_with_tokens_sends_the_jobs_token_or_the_read_token(tmp_path) -> None:
    svc = RendezvousService(
        http=True, tokens=TokenTable(per_job={"j": "j-secret"}), http_access=Access(read_token="reader")
    )
    port = await svc.start("127.0.0.1", 0)
    try:
        base = ("status", "--endpoint", f"127.0.0.1:{port}")
        r = await run(*base)
        assert r.rc == EXIT_OK and "no jobs" in r.out  # the summary is open
        r = await run(*base, "--job", "j")
        assert r.rc == EXIT_ERROR and "HTTP 401" in r.err and "--read-token-file" in r.err
        right = tmp_path / "right"
        right.write_text("j j-secret\n")
        reader = tmp_path / "reader"
        reader.write_text("reader\n")
        for flag, path in (("--token-file", right), ("--read-token-file", reader)):
            r = await run(*base, "--job", "j", flag, str(path))
            assert r.rc == EXIT_NOT_FOUND and "no job 'j'" in r.err, (flag, r.err)  # let in; no job yet
    finally:
        await svc.close()


async def test_peers_texts_are_escaped_in_status_tables(server) -> None:
    svc, endpoint = server
    port = int(endpoint.rsplit(":", 1)[1])
    a, b = await running_job(port, ["a", "b"])
    a.fail(round=0, message="oom\n  round 9: forged line\x1b[2J\x1b]0;title\x07\u202eevil")
    await Watch(svc).until(lambda: svc.machine.jobs["j"].restart_count == 1)
    r = await run("status", "--endpoint", endpoint, "--job", "j")
    assert r.rc == EXIT_OK, r.err
    assert not any(ch in r.out for ch in "\x1b\x07\u202e")
    # A failure's message prints as lines (issue 30), each indented under the failure, so a
    # forged line never sits where the table's own "  round N" lines do.
    forged = [line for line in r.out.splitlines() if "round 9: forged line" in line]
    assert forged and all(line.startswith("      ") for line in forged), r.out
    assert not [line for line in r.out.splitlines() if line.startswith(("round 9", "  round 9"))]
    assert "forged line\\x1b[2J" in r.out and "\\u202eevil" in r.out
    del b


def test_the_servers_log_lines_escape_control_characters() -> None:
    import logging

    fmt = SafeFormatter("%(levelname)s %(name)s: %(message)s")
    rec = logging.LogRecord(
        "rdzv_server",
        logging.WARNING,
        __file__,
        1,
        "refused %s: %s",
        ("n", "x\nINFO rdzv_server: fake\x1b[31m"),
        None,
    )
    line = fmt.format(rec)
    assert line == "WARNING rdzv_server: refused n: x\\nINFO rdzv_server: fake\\x1b[31m"
    try:
        raise ValueError("ours")
    except ValueError:
        import sys as _sys

        rec.exc_info = _sys.exc_info()
    assert "\nTraceback" in fmt.format(rec)  # our own traceback keeps its lines


async def test_serving_is_still_the_default_and_answers_status() -> None:
    """``rdzv-server --host --port`` serves exactly as before: no subcommand, same log line."""
    p, port = await serving_process()
    try:
        endpoint = f"127.0.0.1:{port}"
        agent = await FakeAgent.connect(port, "solo")
        agent.join("live", min_nodes=1, max_nodes=1)
        await agent.expect(Assignment)
        r = await run("status", "--endpoint", endpoint)
        assert r.rc == EXIT_OK and re.search(r"^live +running +1/1 ", r.out, re.M), r.out
        await agent.kill()
    finally:
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(p.wait(), 20) == EXIT_OK


async def test_every_serving_flag_reaches_the_server(tmp_path) -> None:
    """Tokens, the read token and the Host names go from the command line to the service that
    serves (``ServerConfig``, given at construction), as an operator sees them."""
    tokens, reader = tmp_path / "tokens", tmp_path / "reader"
    tokens.write_text("j j-secret\n")
    reader.write_text("reader\n")
    p, port = await serving_process(
        "--token-file", str(tokens), "--read-token-file", str(reader), "--http-host", "rdzv.example"
    )
    try:
        endpoint = f"127.0.0.1:{port}"
        r = await run("status", "--endpoint", endpoint, "--job", "j")
        assert r.rc == EXIT_ERROR and "HTTP 401" in r.err, r  # tokens are on
        r = await run("status", "--endpoint", endpoint, "--job", "j", "--read-token-file", str(reader))
        assert r.rc == EXIT_NOT_FOUND and "no job 'j'" in r.err, r  # the read token lets it in
        async with aiohttp.ClientSession(f"http://{endpoint}") as http:
            async with http.get("/v1/jobs", headers={"Host": "rdzv.example"}) as resp:
                assert resp.status == 200
            async with http.get("/v1/jobs", headers={"Host": "other.example"}) as resp:
                assert resp.status == 421
    finally:
        p.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(p.wait(), 20) == EXIT_OK
    assert p.stderr is not None
    log = (await p.stderr.read()).decode()
    assert "stopped" in log and "no token" not in log


def test_status_and_drain_never_load_the_server() -> None:
    # They start fast: neither the HTTP server's aiohttp, nor asyncio, nor the machine.
    code = (
        "import sys, rdzv_server.cli, rdzv_server.ops_client\n"
        "heavy = ('aiohttp', 'asyncio', 'msgpack', 'rdzv_server.service', 'rdzv_server.daemon')\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_client_certificate_without_the_ca_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same words as an agent's (edge/tls.py), naming where each file was given.
    for var in ("RDZV_TLS_CA", "RDZV_TLS_CERT", "RDZV_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RDZV_TLS_KEY", "k.pem")
    assert main(["status", "--tls-cert", "c.pem"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() == (
        "rdzv-server status: error: --tls-cert and RDZV_TLS_KEY: "
        "a client certificate needs --tls-ca (the CA of the server)"
    )
    assert (
        main(["drain", "--job", "j", "--node", "n", "--tls-ca", "ca.pem", "--tls-key", "k.pem"]) == EXIT_USAGE
    )
    assert "go together" in capsys.readouterr().err
