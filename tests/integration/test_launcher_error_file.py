"""The launcher's own ``TORCHELASTIC_ERROR_FILE``, under torchrun and under node-agent.

torchrun's ``main`` is wrapped in torch's ``@record``: a failed launch leaves its root cause in
the file named by the launcher's environment (TorchX's local scheduler sets it per replica). The
same failing lines run under both launchers and the JSON files are compared: the same keys, the
same message and error code, a timestamp of the run. Where torchrun writes nothing (the failing
worker wrote no error file) ours writes the failure it reports, in the same shape (README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .procs import free_port

pytest.importorskip("torch")

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "ours": [sys.executable, "-m", "node_agent"],
}

RECORD_WORKER = """\
import os
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")

main()
"""

PLAIN_WORKER = """\
import os
if os.environ["RANK"] == "1":
    raise ValueError("boom from rank 1")
"""

OK_WORKER = "print('fine')\n"


@pytest.fixture
def workers(tmp_path: Path) -> Path:
    for name, text in (("rec.py", RECORD_WORKER), ("plain.py", PLAIN_WORKER), ("ok.py", OK_WORKER)):
        (tmp_path / name).write_text(text)
    return tmp_path


def launch(launcher: str, args: list[str], cwd: Path, error_file: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [*LAUNCHERS[launcher], *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=90
    )


def read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def shape(data: Any) -> Any:
    """The nested keys of a record, its values left out."""
    return {k: shape(v) for k, v in data.items()} if isinstance(data, dict) else type(data).__name__


def assert_stamp(record: dict[str, Any], since: float) -> None:
    stamp = record["message"]["extraInfo"]["timestamp"]
    assert isinstance(stamp, str) and stamp.isdigit()
    assert since - 1 <= int(stamp) <= time.time() + 1


def test_record_worker_error_file_is_copied_as_torchrun_does(workers: Path) -> None:
    since = time.time()
    files = {}
    for launcher in LAUNCHERS:
        path = workers / f"{launcher}.json"
        p = launch(launcher, ["--standalone", "--nproc-per-node", "2", "rec.py"], workers, path)
        assert p.returncode == 1, p.stderr
        files[launcher] = read(path)
    theirs, ours = files["torchrun"], files["ours"]
    assert shape(ours) == shape(theirs)
    assert set(ours["message"]) == {"message", "extraInfo", "errorCode"}
    assert ours["message"]["message"] == theirs["message"]["message"] == "ValueError: boom from rank 1"
    assert ours["message"]["errorCode"] == theirs["message"]["errorCode"] == 1
    for record in (ours, theirs):
        assert record["message"]["extraInfo"]["py_callstack"].endswith("ValueError: boom from rank 1\n")
        assert_stamp(record, since)


def test_worker_without_record(workers: Path) -> None:
    """torchrun writes nothing (its root cause has no error file); ours writes the failure it
    reports, in the shape of a copied record: which rank, how, its stderr tail."""
    since = time.time()
    paths = {launcher: workers / f"{launcher}.json" for launcher in LAUNCHERS}
    for launcher, path in paths.items():
        p = launch(launcher, ["--standalone", "--nproc-per-node", "2", "plain.py"], workers, path)
        assert p.returncode == 1, p.stderr
    assert not paths["torchrun"].exists()
    ours = read(paths["ours"])
    assert shape(ours) == {
        "message": {
            "message": "str",
            "extraInfo": {"py_callstack": "str", "timestamp": "str"},
            "errorCode": "int",
        }
    }
    assert ours["message"]["message"].startswith("rank 1 (local rank 1) on node ")
    assert ours["message"]["message"].endswith("failed with exit code 1")
    assert ours["message"]["errorCode"] == 1
    assert "ValueError: boom from rank 1" in ours["message"]["extraInfo"]["py_callstack"]
    assert_stamp(ours, since)


def test_launcher_failure_records_its_own_error(workers: Path) -> None:
    """A rendezvous that never completes: torchrun records its RendezvousTimeoutError and its
    traceback, ours the reason it printed; neither has an errorCode."""
    since = time.time()
    files = {}
    for launcher in LAUNCHERS:
        path = workers / f"{launcher}.json"
        args = [
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"lone-{launcher}",
            "--rdzv-conf", "join_timeout=2", "ok.py",
        ]  # fmt: skip
        p = launch(launcher, args, workers, path)
        assert p.returncode == 1, p.stderr
        files[launcher] = read(path)
    theirs, ours = files["torchrun"], files["ours"]
    assert shape(ours) == shape(theirs)
    assert set(ours["message"]) == {"message", "extraInfo"}
    assert theirs["message"]["message"].startswith("RendezvousTimeoutError")
    assert "waiting for the rendezvous" in ours["message"]["message"]
    assert "join_timeout" in ours["message"]["extraInfo"]["py_callstack"]
    for record in (ours, theirs):
        assert_stamp(record, since)


def test_a_run_that_succeeds_leaves_the_file_alone(workers: Path) -> None:
    for launcher in LAUNCHERS:
        path = workers / f"{launcher}.json"
        path.write_text("left by someone else")
        p = launch(launcher, ["--standalone", "--nproc-per-node", "1", "ok.py"], workers, path)
        assert p.returncode == 0, p.stderr
        assert path.read_text() == "left by someone else"


def test_an_existing_file_is_replaced_and_a_usage_error_recorded(workers: Path) -> None:
    path = workers / "ours.json"
    path.write_text("stale")
    p = launch(
        "ours",
        ["--standalone", "--nproc-per-node", "1", "--rdzv-conf", "join_timeout=soon", "ok.py"],
        workers,
        path,
    )
    assert p.returncode == 2
    record = read(path)
    assert shape(record) == {
        "message": {"message": "str", "extraInfo": {"py_callstack": "str", "timestamp": "str"}}
    }
    assert record["message"]["message"].startswith("ConfigError: ")
    assert "join_timeout='soon' is not a number" in record["message"]["message"]
    assert "Traceback (most recent call last)" in record["message"]["extraInfo"]["py_callstack"]


TWO_NODE_WORKER = """\
import os
import time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)  # stopped when the job fails

main()
"""


def test_a_root_cause_on_another_node_is_written_on_every_node(workers: Path) -> None:
    """Ours only (torchrun's other node has no failure of its own: it writes nothing, or its
    own workers' later errors): the node whose worker failed copies its error file, the other
    writes the same failure as the server reported it."""
    from .procs import Proc, agent_cmd, start_server

    (workers / "two.py").write_text(TWO_NODE_WORKER)
    since = time.time()
    srv, port = start_server()
    agents: list[Proc] = []
    try:
        for node_rank in (0, 1):
            args = [
                "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", str(workers / "two.py"),
            ]  # fmt: skip
            env = {"TORCHELASTIC_ERROR_FILE": str(workers / f"node{node_rank}.json")}
            agents.append(Proc(agent_cmd(*args), env=env))
        for a in agents:
            assert a.wait(timeout=60) == 1, a.stderr
    finally:
        for a in agents:
            a.kill()
        srv.kill()
    here, there = read(workers / "node1.json"), read(workers / "node0.json")
    assert here["message"]["message"] == "ValueError: boom from rank 1"
    assert shape(there) == shape(here)
    assert there["message"]["message"].startswith("rank 1 (local rank 0) on node ")
    assert there["message"]["message"].endswith("failed with exit code 1: ValueError: boom from rank 1")
    assert there["message"]["errorCode"] == here["message"]["errorCode"] == 1
    # the worker's own time there; here the time its agent saw it exit (within a second or so)
    assert (
        abs(int(there["message"]["extraInfo"]["timestamp"]) - int(here["message"]["extraInfo"]["timestamp"]))
        <= 2
    )
    assert_stamp(there, since)
    callstack = there["message"]["extraInfo"]["py_callstack"]
    assert (
        "Traceback (most recent call last)" in callstack
        and 'raise ValueError("boom from rank 1")' in callstack
    )
