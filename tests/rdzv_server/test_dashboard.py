"""The dashboard in a real headless Chromium, against a real server and agents.

The browser is driven over the W3C WebDriver protocol by Debian's ``chromedriver``, with a few
HTTP calls (no Selenium). Install both with::

    apt-get install -y chromium chromium-driver

Without them the test is skipped. Set ``DASHBOARD_SCREENSHOT=docs/dashboard.png`` to keep the
screenshot it takes (otherwise it goes to the test's temporary directory).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from protocol import Assignment, Heartbeat, JobDone, Restart, WorkersSucceeded
from rdzv_server.service import RendezvousService

from .test_http import FakeAgent, FakeClock, Watch, last_seen

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Chromium and its driver: apt-get install -y chromium chromium-driver",
    ),
    pytest.mark.timeout(120),
]

CHROME_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """One Chromium session through chromedriver's WebDriver endpoint."""

    def __init__(self, http: aiohttp.ClientSession, session_id: str) -> None:
        self.http, self.id = http, session_id

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, f"/session/{self.id}{path}", json=body) as r:
            doc = await r.json()
        if r.status != 200:
            raise AssertionError(f"WebDriver {method} {path}: HTTP {r.status}: {doc}")
        return doc["value"]

    async def goto(self, url: str) -> None:
        await self._call("POST", "/url", {"url": url})

    async def js(self, script: str, *args: Any) -> Any:
        return await self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    async def until(self, script: str, *args: Any, timeout: float = 15.0) -> Any:
        """Poll the page (it redraws every second) until ``script`` returns something truthy."""
        last = None
        try:
            async with asyncio.timeout(timeout):
                while not (last := await self.js(script, *args)):
                    await asyncio.sleep(0.1)
        except TimeoutError:
            text = await self.js("return document.body.innerText")
            raise AssertionError(f"the page never satisfied {script!r}; it shows:\n{text}") from None
        return last

    async def screenshot(self) -> bytes:
        return base64.b64decode(await self._call("GET", "/screenshot"))


@pytest.fixture
async def browser(tmp_path: Path):
    assert CHROMEDRIVER is not None and CHROMIUM is not None
    port = free_port()
    driver = await asyncio.create_subprocess_exec(
        CHROMEDRIVER,
        f"--port={port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            async with asyncio.timeout(20):  # chromedriver is up when /status says ready
                while True:
                    try:
                        async with http.get("/status") as r:
                            if (await r.json())["value"]["ready"]:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.05)
            caps = {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": CHROMIUM,
                    "args": [*CHROME_ARGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"],
                },
            }
            async with http.post("/session", json={"capabilities": {"alwaysMatch": caps}}) as r:
                created = await r.json()
            assert r.status == 200, created
            b = Browser(http, created["value"]["sessionId"])
            try:
                yield b
            finally:
                async with http.delete(f"/session/{b.id}"):
                    pass
    finally:
        driver.terminate()
        await driver.wait()


ROW_STATE = """
const card = document.querySelector(`section.job[data-job-id="${arguments[0]}"][data-forgotten="false"]`);
const row = card && card.querySelector(`tr[data-node="${arguments[1]}"]`);
return row ? row.dataset.state : null;
"""


async def test_dashboard_shows_jobs_live_and_marks_a_lost_node(browser: Browser, tmp_path: Path) -> None:
    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    watch = Watch(svc)
    agents: list[FakeAgent] = []
    try:
        await browser.goto(f"http://127.0.0.1:{port}/")
        await browser.until("return document.body.innerText.includes('No active jobs')")

        # a short job that ran and is over, for the "recently finished" list
        ev = await FakeAgent.connect(port, "eval-0")
        agents.append(ev)
        ev.join("eval", min_nodes=1, max_nodes=1, nproc=1, addr="10.0.0.20", heartbeat_timeout=600.0)
        await ev.expect(Assignment)
        clock.now += 30
        ev.send(WorkersSucceeded(round=0))
        await ev.expect(JobDone)
        await ev.kill()
        await watch.until(lambda: "eval" not in svc.machine.jobs)

        # three nodes of an elastic job
        nodes = {}
        for i, name in enumerate(["node-a", "node-b", "node-c"]):
            a = await FakeAgent.connect(port, name)
            agents.append(a)
            nodes[name] = a
            a.join(
                "train",
                min_nodes=2,
                max_nodes=3,
                nproc=4,
                addr=f"10.0.0.{11 + i}",
                master_port=29500,
                max_restarts=3,
                last_call_timeout=60.0,
                heartbeat_timeout=600.0,
                entrypoint="train.py --epochs 90",
            )
            clock.now += 2
        for a in nodes.values():
            await a.expect(Assignment)
        await browser.until(ROW_STATE, "train", "node-c")
        assert await browser.js(ROW_STATE, "train", "node-a") == "running"
        assert await browser.js("return document.querySelectorAll('section.job tr[data-node]').length") >= 3

        # node-c's worker fails: everyone restarts, round 1 runs
        clock.now += 45
        nodes["node-c"].fail(round=0, rank=9, exitcode=1, message="RuntimeError: NCCL timeout")
        for a in nodes.values():
            await a.expect(Restart)
        clock.now += 3
        for a in nodes.values():
            a.rejoin()
        for a in nodes.values():
            await a.expect(Assignment)
        await browser.until(
            "return document.querySelector('section.job[data-job-id=\"train\"] .restarts')"
            "?.textContent === '1 / 3'"
        )

        # node-c is killed: the page marks it lost, in red
        clock.now += 60
        await nodes["node-c"].kill()
        await watch.until(lambda: "node-c" not in svc.machine.jobs["train"].members)
        state = await browser.until(
            "const s = (() => {" + ROW_STATE + "})(); return s === 'lost' ? s : null;", "train", "node-c"
        )
        assert state == "lost"
        badge = await browser.js(
            """
            const card = document.querySelector('section.job[data-job-id="train"][data-forgotten="false"]');
            const b = card.querySelector('tr[data-node="node-c"] .badge.b-lost');
            return b && {text: b.textContent, color: getComputedStyle(b).backgroundColor};
            """
        )
        assert badge == {"text": "lost", "color": "rgb(198, 40, 40)"}
        # its failure is shown with the root cause
        failures = await browser.js(
            "return document.querySelector('section.job[data-job-id=\"train\"] ul.failures').innerText"
        )
        assert "round 0: rank 9 (local rank 0) on node node-c" in failures and "NCCL timeout" in failures

        # the survivors go on in round 2; the finished job is listed
        clock.now += 2
        for name in ("node-a", "node-b"):
            nodes[name].rejoin()
        for name in ("node-a", "node-b"):
            await nodes[name].expect(Assignment)
        clock.now += 20
        segments = "section.job[data-job-id='train'] .timeline .seg"
        await browser.until("return document.querySelectorAll(arguments[0]).length === 3", segments)
        assert await browser.js(ROW_STATE, "train", "node-a") == "running"
        assert await browser.until(
            "return document.querySelector('#finished details[data-job-id=\"eval\"]')?.innerText"
        )
        # an open history panel stays open across redraws
        await browser.js("document.querySelector('section.job[data-job-id=\"train\"] details').open = true")
        polls = int(await browser.js("return document.body.dataset.polls"))
        await browser.until("return Number(document.body.dataset.polls) >= arguments[0] + 2", polls)
        info = await browser.js(
            "const d = document.querySelectorAll('section.job[data-job-id=\"train\"] details');"
            "return Array.from(d).map(x => [x.open, x.querySelector('summary').innerText]);"
        )
        assert info and info[0][0], info

        for name in ("node-a", "node-b"):
            nodes[name].send(Heartbeat())
        await watch.until(lambda: last_seen(svc, "node-b", "train") == clock.now)
        clock.now += 0.4
        await browser.until(
            "return document.querySelector('tr[data-node=\"node-b\"]').innerText.includes('now')"
        )
        png = await browser.screenshot()
        assert png.startswith(b"\x89PNG")
        (tmp_path / "dashboard.png").write_bytes(png)
        keep = os.environ.get("DASHBOARD_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(png)

        # the server goes away: the page says so instead of showing stale data as live
        await svc.close()
        await browser.until("return document.getElementById('live').className === 'down'")
    finally:
        for a in agents:
            await a.kill()
        await svc.close()
