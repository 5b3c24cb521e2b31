"""Tokens: agents prove they hold the job's token over a per-connection challenge."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from protocol import Assignment, Error, Waiting, Welcome
from protocol.auth import TokenTable, proof
from rdzv_server.http_app import Access
from rdzv_server.service import RendezvousService

from .test_service import RawAgent, join

TOKENS = TokenTable(default="s3cret", per_job={"other": "other-token"})


@pytest.fixture
async def secured():
    svc = RendezvousService(tokens=TOKENS)
    port = await svc.start("127.0.0.1", 0)
    yield svc, port
    await svc.close()


async def hello(port: int) -> tuple[RawAgent, Welcome]:
    a = await RawAgent.open(port)
    w = await a.recv()
    assert isinstance(w, Welcome)
    return a, w


def signed(node: str, port: int, challenge: str, token: str = "s3cret", job: str = "j"):
    j = dataclasses.replace(join(node, port), job_id=job)
    return dataclasses.replace(j, proof=proof(token, challenge, job, node))


async def refused(a: RawAgent) -> Error:
    err = await a.recv()
    assert isinstance(err, Error) and err.code == "auth_failed"
    assert await asyncio.wait_for(a.reader.read(), timeout=5) == b""
    return err


async def test_right_token_joins_and_the_token_never_travels(secured) -> None:
    _, port = secured
    a, w = await hello(port)
    assert len(w.challenge) == 32
    msg = signed("a", 30001, w.challenge)
    assert "s3cret" not in repr(msg)
    a.send(msg)
    assert isinstance(await a.recv(), Waiting)


async def test_missing_wrong_and_replayed_proofs_are_refused_while_a_job_goes_on(secured) -> None:
    svc, port = secured
    good, w = await hello(port)
    good.send(signed("good", 30001, w.challenge))
    assert isinstance(await good.recv(), Waiting)

    nothing, _ = await hello(port)
    nothing.send(join("x", 30002))
    assert "requires a token" in (await refused(nothing)).message

    wrong, w2 = await hello(port)
    wrong.send(signed("y", 30003, w2.challenge, token="guess"))
    assert "wrong token" in (await refused(wrong)).message

    # a proof recorded on one connection is worthless on another (fresh challenge)
    seen, w3 = await hello(port)
    captured = signed("z", 30004, w3.challenge)
    replay, _ = await hello(port)
    replay.send(captured)
    assert "wrong token" in (await refused(replay)).message
    seen.send(captured)  # the genuine one still works: the real job completes with it
    ga, gz = await good.recv(), await seen.recv()
    if isinstance(gz, Waiting):
        gz = await seen.recv()
    assert isinstance(ga, Assignment) and isinstance(gz, Assignment)
    assert svc.machine.jobs["j"].order == ["good", "z"]


async def test_per_job_token(secured) -> None:
    _, port = secured
    a, w = await hello(port)
    a.send(signed("a", 30001, w.challenge, token="s3cret", job="other"))
    assert "wrong token for job 'other'" in (await refused(a)).message
    b, w = await hello(port)
    b.send(signed("b", 30002, w.challenge, token="other-token", job="other"))
    assert isinstance(await b.recv(), Waiting)


def test_token_file_format() -> None:
    t = TokenTable.parse("# c\nshared\njobA a\n")
    assert (t.for_job("jobA"), t.for_job("x")) == ("a", "shared")
    assert TokenTable.parse("jobA a").for_job("x") is None
    for bad in ("", "# only a comment", "a b c", "one\ntwo"):
        with pytest.raises(ValueError):
            TokenTable.parse(bad)


# --- over HTTP: who may read a job's detail ------------------------------------------------------


async def test_with_tokens_a_jobs_detail_needs_its_token_or_the_read_token() -> None:
    tokens = TokenTable(default="s3cret", per_job={"other": "other-token"})
    svc = RendezvousService(http=True, tokens=tokens)
    svc.http_access = Access(read_token="reader")  # type: ignore[attr-defined]
    port = await svc.start("127.0.0.1", 0)
    try:
        agents = []
        for node in ("a", "b"):
            a, w = await hello(port)
            a.send(signed(node, 30001, w.challenge))
            agents.append(a)
        for a in agents:
            while not isinstance(await a.recv(), Assignment):
                pass
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            # The summary names no node and no address: open.
            async with http.get("/v1/jobs") as r:
                assert r.status == 200
                body = await r.text()
            assert '"id": "j"' in body.replace('":"', '": "') and "127.0.0.1" not in body
            async with http.get("/v1/jobs/j") as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
                assert "needs a token" in (await r.json())["message"]
            for wrong in ("other-token", "guess"):  # another job's token reads only that job
                async with http.get("/v1/jobs/j", headers={"Authorization": f"Bearer {wrong}"}) as r:
                    assert r.status == 403, wrong
            for good in ("s3cret", "reader"):
                async with http.get("/v1/jobs/j", headers={"Authorization": f"Bearer {good}"}) as r:
                    assert r.status == 200, good
                    job = await r.json()
                assert job["master"]["addr"] == "127.0.0.1" and len(job["members"]) == 2
            # The read token reads; it does not drain.
            headers = {"Authorization": "Bearer reader"}
            async with http.post("/v1/jobs/j/nodes/a/drain", headers=headers) as r:
                assert r.status == 403
            # Counts stay open, and name nobody.
            async with http.get("/metrics") as r:
                assert r.status == 200
                metrics = await r.text()
            async with http.get("/healthz") as r:
                assert r.status == 200
            assert "127.0.0.1" not in metrics and 'job="' not in metrics and 'node="' not in metrics
    finally:
        await svc.close()
