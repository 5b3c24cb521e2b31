"""The dashboard in a real headless Chromium, against a real server and agents.

The browser is driven over the W3C WebDriver protocol by Debian's ``chromedriver``, with a few
HTTP calls (no Selenium). Install both with::

    apt-get install -y chromium chromium-driver

Without them the test is skipped. Set ``DASHBOARD_SCREENSHOT=docs/dashboard.png`` to keep the
screenshot it takes (otherwise it goes to the test's temporary directory), and
``GOODPUT_SCREENSHOT=docs/dashboard-goodput.png`` for the goodput test's picture of one job.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from protocol import (
    Assignment,
    CollectStacks,
    HangDetected,
    Heartbeat,
    JobDone,
    Progress,
    Restart,
    SnapshotsHeld,
    Stacks,
    WorkersSucceeded,
)
from rdzv_server.service import RendezvousService

from .test_http import FakeAgent, FakeClock, Watch, last_seen, running_job

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

    async def element_screenshot(self, css: str) -> bytes:
        """A picture of the first element ``css`` selects, scrolled into view."""
        found = await self._call("POST", "/element", {"using": "css selector", "value": css})
        (element,) = found.values()
        return base64.b64decode(await self._call("GET", f"/element/{element}/screenshot"))


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


TRAINING_ROW = """
const card = document.querySelector(`section.job[data-job-id="${arguments[0]}"][data-forgotten="false"]`);
const row = card && card.querySelector(`tr[data-node="${arguments[1]}"]`);
if (!row || row.dataset.step === undefined) return null;
const age = row.querySelector("td.age");
return {step: row.dataset.step, ageState: row.dataset.ageState, age: age.innerText,
        color: getComputedStyle(age).color, lag: row.querySelector("td.lag").innerText,
        phase: row.querySelector("td.phase").innerText, score: row.querySelector("td.score").innerText};
"""


async def test_dashboard_shows_step_age_stragglers_and_a_hang_report(
    browser: Browser, tmp_path: Path
) -> None:
    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    watch = Watch(svc)
    agents: list[FakeAgent] = []
    try:
        agents = await running_job(port, ["node-a", "node-b"], job="train", heartbeat_timeout=600.0)
        a, b = agents
        await browser.goto(f"http://127.0.0.1:{port}/")
        await browser.until(ROW_STATE, "train", "node-b")
        a.send(
            Progress(
                round=0,
                min_step=120,
                max_step=120,
                step_p50_ms=480.0,
                step_p90_ms=500.0,
                phase="compute",
                compute_ms=(100.0, 100.0),
            )
        )
        jobs = svc.machine.jobs
        await watch.until(lambda: "node-a" in jobs["train"].progress.nodes)
        clock.now += 1.5  # stragglers are scored at most once a second
        b.send(
            Progress(
                round=0,
                min_step=117,
                max_step=118,
                step_p50_ms=490.0,
                step_p90_ms=500.0,
                phase="\u202eckpt",
                age_ms=300.0,
                compute_ms=(100.0, 210.0),
            )
        )
        jobs = svc.machine.jobs
        await watch.until(lambda: len(jobs["train"].progress.nodes) == 2)
        clock.now += 2.0  # node-a moves on 4 steps in 3.5 s
        a.send(
            Progress(
                round=0,
                min_step=124,
                max_step=124,
                step_p50_ms=480.0,
                step_p90_ms=500.0,
                compute_ms=(100.0, 100.0),
            )
        )
        await watch.until(lambda: jobs["train"].progress.nodes["node-a"].max_step == 124)
        rate = await browser.until(
            "return document.querySelector('section.job[data-job-id=\"train\"] .job-rate')?.innerText"
        )
        assert rate == "1.14"
        row_b = await browser.until(TRAINING_ROW, "train", "node-b")
        assert (row_b["step"], row_b["lag"]) == ("118", "6")
        assert row_b["phase"] == "\\u202eckpt"  # a worker's text, its control shown escaped
        assert row_b["ageState"] == "ok" and row_b["color"] == "rgb(31, 138, 76)"  # green
        assert row_b["score"] == "0.48 straggler"
        straggler = await browser.js(
            "return document.querySelector('section.job[data-job-id=\"train\"] ul.stragglers').innerText"
        )
        assert "rank 3 (local 1) on node-b: score 0.48" in straggler
        # time passes with no progress: node-a's age goes amber, then red
        clock.now += 30.0
        a.send(Heartbeat())
        await watch.until(lambda: last_seen(svc, "node-a", "train") == clock.now)
        row_a = await browser.until(
            "const r = (() => {" + TRAINING_ROW + "})(); return r && r.ageState === 'late' ? r : null;",
            "train",
            "node-a",
        )
        assert row_a["color"] == "rgb(183, 121, 31)" and row_a["age"] == "30s ago"
        clock.now += 60.0
        a.send(Heartbeat())
        await watch.until(lambda: last_seen(svc, "node-a", "train") == clock.now)
        row_a = await browser.until(
            "const r = (() => {" + TRAINING_ROW + "})(); return r && r.ageState === 'stalled' ? r : null;",
            "train",
            "node-a",
        )
        assert row_a["color"] == "rgb(198, 40, 40)" and row_a["step"] == "124"
        head = await browser.js(
            "return document.querySelector('section.job[data-job-id=\"train\"] .job-step').innerText"
        )
        assert head == "124"
        # Each node holds its own ranks' snapshots of step 120 (a node's word about another's
        # ranks is not believed unless it was asked to hold their copies): the job's newest
        # consistent snapshot, and its age
        for node in (a, b):
            node.send(SnapshotsHeld(world_size=4, ranks=(0, 1, 2, 3), steps=(120, 120, 120, 120)))
        await watch.until(lambda: jobs["train"].snapshot_step == 120)
        clock.now += 7.0
        snap = await browser.until(
            "const e = document.querySelector('section.job[data-job-id=\"train\"] .snapshot');"
            " return e && e.innerText.includes('7s ago') ? e.innerText : null;"
        )
        assert snap == "snapshot step 120 (7s ago)"
        await hang_and_check(svc, watch, browser, a, b, tmp_path)
    finally:
        for x in agents:
            await x.kill()
        await svc.close()


SLEEPING = (
    "Current thread 0x00007f3a2d4e6740 (most recent call first):\n"
    '  File "/job/train.py", line 41 in stuck\n'
    '  File "/job/train.py", line 60 in main\n'
    "  \u202e<script>alert(1)</script>\n"
)
ALL_REDUCE = (
    "Current thread 0x00007f3a2d4e6740 (most recent call first):\n"
    '  File "/venv/torch/distributed/distributed_c10d.py", line 2501 in all_reduce\n'
    '  File "/job/train.py", line 55 in main\n'
)


async def hang_and_check(
    svc: RendezvousService, watch: Watch, browser: Browser, a: FakeAgent, b: FakeAgent, tmp_path: Path
) -> None:
    """Rank 3 (node-b) hangs; both nodes send their stacks: the page shows the report."""
    b.send(HangDetected(round=0, ranks=(3,), step=118, phase="compute", silent_s=95.0))
    for x in (a, b):
        await x.expect(CollectStacks)
    hang_box = "section.job[data-job-id='train'] .hang"
    headline = await browser.until(
        "return document.querySelector(arguments[0] + ' .headline')?.innerText", hang_box
    )
    assert "Hang in round 0: rank 3 made no progress for 1m 35s (step 118, phase compute)" in headline
    assert "reported by node-b" in headline
    n = 2
    a.send(
        Stacks(
            round=0,
            ranks=(0, 1),
            steps=(120,) * n,
            phases=("",) * n,
            silent_s=(1.0,) * n,
            stacks=(ALL_REDUCE,) * n,
        )
    )
    b.send(
        Stacks(
            round=0,
            ranks=(2, 3),
            steps=(118,) * n,
            phases=("",) * n,
            silent_s=(1.0, 95.0),
            stacks=(ALL_REDUCE, SLEEPING),
        )
    )
    job = svc.machine.jobs["train"]
    await watch.until(lambda: job.hang is not None and len(job.hang.stacks) == 2)
    suspects = await browser.until(
        "return document.querySelector(arguments[0] + ' .suspects')?.innerText", hang_box
    )
    assert "Suspects: rank 3" in suspects and "stacks from 2 nodes" in suspects
    groups = await browser.js(
        """
        return Array.from(document.querySelectorAll(arguments[0] + ' details.group')).map((d) => ({
          ranks: d.dataset.ranks, odd: d.classList.contains('odd'), open: d.open,
          summary: d.querySelector('summary').innerText, stack: d.querySelector('pre').textContent}));
        """,
        hang_box,
    )
    odd, rest = groups
    # the odd one out comes first, open, with its stack; the others' group is collapsed
    assert (odd["ranks"], odd["odd"], odd["open"]) == ("3", True, True)
    assert odd["summary"].startswith("odd one out: rank 3") and "stuck (/job/train.py:41)" in odd["summary"]
    assert 'line 41 in stuck\n  File "/job/train.py", line 60 in main' in odd["stack"]
    # a peer's text is text: no element made of it, and its bidi override is shown escaped
    assert "\\u202e<script>" in odd["stack"] and "\u202e" not in odd["stack"]
    assert await browser.js("return document.querySelectorAll('.hang script').length") == 0
    assert (rest["ranks"], rest["odd"], rest["open"]) == ("0,1,2", False, False)
    # collapsible: opening the group shows its stack, and it stays open across redraws
    await browser.js(
        "document.querySelectorAll(arguments[0] + ' details.group')[1].querySelector('summary').click()",
        hang_box,
    )
    polls = int(await browser.js("return document.body.dataset.polls"))
    await browser.until("return Number(document.body.dataset.polls) >= arguments[0] + 2", polls)
    still_open = await browser.js(
        "const d = document.querySelectorAll(arguments[0] + ' details.group')[1];"
        "return d.open && d.querySelector('pre').getBoundingClientRect().height > 0;",
        hang_box,
    )
    assert still_open
    png = await browser.screenshot()
    (tmp_path / "dashboard-training.png").write_bytes(png)


async def test_one_jobs_odd_numbers_never_blank_the_dashboard_for_the_others(
    browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdzv_server.machine import progress

    from .test_untrusted_values import two_jobs

    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    agents: list[FakeAgent] = []
    try:
        # Job "odd": ranks computing in 5e-324 ms beside ranks taking 1e10 ms (both valid).
        agents = await two_jobs(svc, port, clock)
        await browser.goto(f"http://127.0.0.1:{port}/")
        for job, node in (("odd", "a"), ("fine", "c")):
            assert await browser.until(ROW_STATE, job, node) == "running"
        # Past every bound at the source (lifted here), the page still draws the other job.
        monkeypatch.setattr(progress, "SCORE_MAX", math.inf)
        note = await browser.until(
            "return document.querySelector('section.job[data-job-id=\"odd\"] .note')?.innerText"
        )
        assert note.startswith("Details cannot be shown"), note
        assert await browser.js(ROW_STATE, "fine", "c") == "running"
        assert await browser.js("return document.getElementById('live').className") == "ok"
    finally:
        for a in agents:
            await a.kill()
        await svc.close()


GOODPUT = """
const card = document.querySelector('section.job[data-job-id="train"][data-forgotten="false"]');
const g = card && card.querySelector('.goodput');
if (!g) return null;
const lines = Array.from(g.querySelectorAll('polyline.gp-steps'));
return {
  text: g.querySelector('.goodput-text').innerText,
  goodput: g.dataset.goodput,
  parts: Array.from(g.querySelectorAll('.gp-seg')).map((s) => [s.dataset.part, Number(s.dataset.seconds),
    s.getBoundingClientRect().width]),
  bar: g.querySelector('.gp-bar').getBoundingClientRect().width,
  legend: g.querySelector('.gp-legend').innerText,
  lines: lines.map((l) => l.getAttribute('points').trim().split(/\\s+/).length),
  marks: Array.from(g.querySelectorAll('line.gp-mark')).map((m) => [m.dataset.kind, Number(m.dataset.count)]),
  gaps: g.querySelectorAll('rect.gp-gap').length,
};
"""


async def test_dashboard_shows_where_a_jobs_time_went_with_its_two_failures(
    browser: Browser, tmp_path: Path
) -> None:
    """Issue 47: a job that reports its steps fails twice (a worker crash, then a node's
    worker again) and goes on: the page shows the server's goodput line, a bar of where the
    time went, and the steps chart with both failures and the three rounds marked."""
    from rdzv_server.machine import goodput

    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    watch = Watch(svc)
    agents: list[FakeAgent] = []
    kw: dict[str, Any] = dict(max_restarts=3, heartbeat_timeout=3600.0, last_call_timeout=60.0)
    try:
        a, b = [await FakeAgent.connect(port, n) for n in ("node-a", "node-b")]
        agents = [a, b]
        a.join("train", **kw)
        await watch.until(lambda: "train" in svc.machine.jobs)
        clock.now += 3.0  # rendezvous: 3 s
        b.join("train", **kw)
        for x in agents:
            await x.expect(Assignment)
        jobs = svc.machine.jobs
        step = 0

        async def train(rnd: int, seconds: float, first: int) -> None:
            """Both nodes report steps (2 a second) for ``seconds``, from ``first``."""
            nonlocal step
            step = first
            for _ in range(int(seconds / 5)):
                for x in agents:
                    x.send(Progress(round=rnd, min_step=step, max_step=step, step_p50_ms=500.0,
                                    step_p90_ms=520.0, phase="compute"))  # fmt: skip
                await watch.until(lambda at=step: reported(jobs["train"].progress.nodes, at))
                clock.now += 5.0
                step += 10

        async def restart(rnd: int, failing: FakeAgent) -> None:
            failing.fail(round=rnd, rank=2 if failing is b else 0, exitcode=1, message="RuntimeError: boom")
            for x in agents:
                await x.expect(Restart)
            clock.now += 4.0  # the re-rendezvous
            for x in agents:
                x.rejoin()
            for x in agents:
                await x.expect(Assignment)
            clock.now += 6.0  # the workers start again

        clock.now += 8.0  # start-up: 8 s
        await train(0, 100.0, 0)  # steps 0..190 in 100 s
        await restart(0, b)
        await train(1, 60.0, 151)  # resumed from a checkpoint of step 150: 40 steps lost
        await restart(1, a)
        await train(2, 80.0, 251)  # reached 261, resumed from 250: 11 steps lost
        job = jobs["train"]
        expected = goodput.line(job, clock.now)
        # 240 s of rounds training less 51 steps of 0.5 s done again, over 271 s; each failure
        # cost 10 s to the next step and its lost steps' time.
        assert expected == (
            "goodput 79.2 % over 4 min 31 s: 2 failures cost 46 s and 51 steps; start-up 8 s; rendezvous 3 s"
        )

        await browser.goto(f"http://127.0.0.1:{port}/")
        shown = await browser.until(
            f"const g = (() => {{{GOODPUT}}})(); return g && g.text === {expected!r} ? g : null;"
        )
        parts = dict((p[0], p[1]) for p in shown["parts"])
        assert set(parts) == {"training", "startup", "rendezvous", "worker_crash"}
        assert (parts["startup"], parts["rendezvous"], parts["worker_crash"]) == (8.0, 3.0, 45.5)
        assert sum(p[2] for p in shown["parts"]) == pytest.approx(shown["bar"], abs=2)  # it fills the bar
        assert float(shown["goodput"]) == job_goodput(svc)
        assert "worker crash \u00d72 46s, 51 steps lost" in shown["legend"]
        # One line per round, every point of the series drawn: 20, 12 and 16 summaries a round.
        assert shown["lines"] == [20, 12, 16] and len(job.goodput.series_t) == 48
        marks = [kind for kind, _ in shown["marks"]]
        assert marks.count("failure") == 2 and marks.count("round") == 3, shown["marks"]
        assert shown["gaps"] == 3  # the first rendezvous and the two re-rendezvous, shaded
        png = await browser.element_screenshot('section.job[data-job-id="train"] .goodput')
        assert png.startswith(b"\x89PNG")
        (tmp_path / "dashboard-goodput.png").write_bytes(png)
        keep = os.environ.get("GOODPUT_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(png)
    finally:
        for x in agents:
            await x.kill()
        await svc.close()


def reported(nodes: dict[str, Any], step: int) -> bool:
    """Both nodes' latest summaries (of the round) say ``step``."""
    return len(nodes) == 2 and all(n.max_step == step for n in nodes.values())


def job_goodput(svc: RendezvousService) -> float:
    from rdzv_server.machine import goodput

    ratio = goodput.figures(svc.machine.jobs["train"], svc.clock())["goodput"]
    assert ratio is not None
    return ratio
