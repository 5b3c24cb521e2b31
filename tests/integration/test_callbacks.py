"""The Lightning and Hugging Face callbacks report progress and phases with one line in the
script (``callbacks=[ProgressCallback()]``), with the real libraries on CPU (tiny models built
in the scripts: no download, no network).

Each script runs twice: as a plain process given a page by the test, and as the worker of a
real ``node-agent --standalone``, whose page the test finds in the attempt's log dir. Each
prints the phase its page showed inside the library's hooks (the model's forward, backward,
checkpoint save ...), which the test compares with what the callback promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.progress.pages import RankSample, create_page, read_page

from .procs import ROOT, WORKERS, Proc, agent_cmd

pytest.importorskip("lightning")
pytest.importorskip("transformers")

STEPS = 12
PAGE_VAR = "NODE_AGENT_PROGRESS_PAGE"

LIGHTNING_PHASES = {
    ("setup", "setup"),
    ("training_step", "compute"),
    ("backward", "backward"),
    ("after optimizer_step", "compute"),
    ("validation_step", "eval"),
    ("on_save_checkpoint", "checkpoint"),
}
HF_PHASES = {
    ("forward, training", "compute"),
    ("forward, evaluating", "eval"),
    ("save_pretrained", "checkpoint"),
}
LIGHTNING = (LIGHTNING_PHASES, {"setup", "compute", "backward", "eval", "checkpoint"})
CASES = {
    "lightning": ("lightning_train.py", {}, *LIGHTNING),
    "pytorch_lightning": ("lightning_train.py", {"LIGHTNING": "pytorch_lightning"}, *LIGHTNING),
    "hf": ("hf_train.py", {}, HF_PHASES, {"setup", "compute", "eval", "checkpoint"}),
}


def slot_names(page: Path) -> set[str]:
    data = page.read_bytes()
    return {data[256 + 32 * s : 288 + 32 * s].rstrip(b"\0").decode() for s in range(1, 16)} - {""}


def check_run(out: str, page: Path, phases: set[tuple[str, str]], names: set[str]) -> RankSample:
    assert f"done {STEPS}" in out, out
    seen = {tuple(x) for x in json.loads(out.split("phases ", 1)[1].splitlines()[0])}
    assert seen == phases, seen
    assert slot_names(page) == names
    s = read_page(str(page))
    assert s is not None, "the worker never attached its page"
    assert (s.step, s.count, s.phase) == (STEPS, STEPS, "")
    assert s.compute_ns > 0 and s.progress_ns >= s.attached_ns > 0
    return s


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_script_with_the_callback_reports_steps_and_phases(tmp_path: Path, case: str) -> None:
    script, env_extra, phases, names = CASES[case]
    page = tmp_path / "progress.page"
    create_page(str(page))
    env = {**os.environ, **env_extra, PAGE_VAR: str(page), "STEPS": str(STEPS)}
    proc = subprocess.run(
        [sys.executable, str(WORKERS / script), str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = check_run(proc.stdout, page, phases, names)
    assert s.pid > 0 and s.stack_signal > 0


@pytest.mark.parametrize("case", ["lightning", "hf"])
def test_the_callback_reports_to_a_real_node_agent(tmp_path: Path, case: str) -> None:
    script, env_extra, phases, names = CASES[case]
    logs = tmp_path / "logs"
    agent = Proc(
        agent_cmd(
            "--standalone", "--nproc-per-node", "1", "--log-dir", str(logs),
            str(WORKERS / script), str(tmp_path / "out"),
        ),
        env={**env_extra, "STEPS": str(STEPS), "PAGE_COPY": str(tmp_path / "page.copy")},
    )  # fmt: skip
    try:
        assert agent.wait(timeout=240) == 0, agent.stderr[-4000:]
    finally:
        agent.kill()
    # The page was the agent's (in its private folder, gone with it), not the log folder's.
    assert not list(logs.rglob("progress.page*")), sorted(str(p) for p in logs.rglob("*"))
    check_run(agent.stdout, tmp_path / "page.copy", phases, names)
