"""node_agent.run (torch.distributed.run's Python surface) against torch's own, in this process,
as ``accelerate launch`` and ``tune run`` call it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch_run = pytest.importorskip("torch.distributed.run")
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

import node_agent.run as na_run  # noqa: E402
from node_agent import LaunchConfig  # noqa: E402

DUMP = (
    "import json, os, sys\n"
    "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'ROLE_NAME', 'GROUP_RANK', 'LOCAL_WORLD_SIZE')\n"
    "out = {k: os.environ.get(k) for k in keys}\n"
    "out['argv'] = sys.argv[1:]\n"
    "open(os.path.join(os.environ['DUMP_TO'], os.environ['RANK'] + '.json'), 'w').write(json.dumps(out))\n"
)
FAIL = "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"


def _dumps(folder: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def test_the_parser_takes_torchs_spellings_and_gives_torchs_namespace() -> None:
    line = [
        "--nnodes=1",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--max_restarts=1",
        "--monitor-interval",
        "0.5",
        "-r",
        "3",
        "--duplicate-stdout-filters",
        "a,,b,c",
        "--standalone",
        "-m",
        "pkg.train",
        "--nproc_per_node",
        "9",
    ]
    assert vars(na_run.parse_args(line)) == vars(torch_run.parse_args(line))
    assert vars(na_run.get_args_parser().parse_args(["x.py"])) == vars(
        torch_run.get_args_parser().parse_args(["x.py"])
    )
    ours = na_run.parse_args(["--hang-timeout", "off", "--preload=json", "x.py"])  # and our own flags
    config, cmd, cmd_args = na_run.config_from_args(ours)
    assert isinstance(config, LaunchConfig)
    assert config.agent_args == ("--hang-timeout=off", "--preload=json")
    assert (cmd, cmd_args) == (sys.executable, ["-u", "x.py"])
    assert config.rdzv_endpoint == "" and config.max_restarts == 0 and config.role == "default"


def test_run_of_torchs_namespace_gives_workers_what_torch_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    line = ["--nproc-per-node", "2", "--role", "trainer", str(script), "--lr", "1"]
    seen = {}
    for name, module in (("torch", torch_run), ("ours", na_run)):
        out = tmp_path / name
        out.mkdir()
        monkeypatch.setenv("DUMP_TO", str(out))
        # accelerate's way: torch's own parser's namespace, handed to run()
        assert module.run(torch_run.get_args_parser().parse_args(line)) is None
        seen[name] = _dumps(out)
    assert seen["ours"] == seen["torch"]
    assert [d["ROLE_NAME"] for d in seen["ours"]] == ["trainer", "trainer"]
    assert seen["ours"][1]["argv"] == ["--lr", "1"]


def test_main_raises_on_a_failing_script_for_torch_and_for_us(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    line = ["--nproc-per-node", "2", "--monitor-interval", "0.05", str(script)]
    for main in (torch_run.main, na_run.main):
        with pytest.raises(ChildFailedError) as caught:
            main(line)
        assert set(caught.value.failures) == {1}
        assert caught.value.failures[1].exitcode == 3
        assert caught.value.failures[1].local_rank == 1


def test_install_replaces_torchs_run_in_this_process_only_until_uninstall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    originals = (torch_run.run, torch_run.main)
    na_run.install()
    try:
        assert (torch_run.run, torch_run.main) == (na_run.run, na_run.main)
        na_run.install()  # twice: harmless
    finally:
        na_run.uninstall()
    assert (torch_run.run, torch_run.main) == originals


def test_a_wrapper_run_through_inprocess_launches_with_node_agent(tmp_path: Path) -> None:
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(
        "import sys\n"
        "from torch.distributed.run import get_args_parser, run\n"  # torchtune's import
        "import node_agent.run\n"
        "assert run is node_agent.run.run, run\n"
        "run(get_args_parser().parse_args(sys.argv[1:]))\n"
    )
    env = {**os.environ, "DUMP_TO": str(tmp_path)}
    cmd = [sys.executable, "-m", "node_agent.inprocess", str(wrapper), "--nproc-per-node", "2", str(script)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[node-agent]" in done.stderr
    assert [d["RANK"] for d in _dumps(tmp_path)] == ["0", "1"]
