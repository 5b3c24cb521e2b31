"""A worker's error file is the user's: one the agent cannot use is reported, not obeyed.

A worker writes its ``TORCHELASTIC_ERROR_FILE`` 2,000 levels deep (json's parser once raised
``RecursionError`` in the agent, which no one caught: the agent died with a traceback), or
larger than the agent reads; the agent must report the failure as for a worker without an
error file (exit code, stderr tail), say why the file was not used, and write the launcher's
own error file from that failure (node_agent/error_file.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = """\
import os, sys
path = os.environ["TORCHELASTIC_ERROR_FILE"]
if sys.argv[1] == "deep":
    with open(path, "w") as f:
        f.write('{"message": ' + "[" * 2000 + "]" * 2000 + "}")
else:
    with open(path, "wb") as f:
        f.truncate(64 << 20)  # sparse
print("boom on stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("deep", "JSON nested more than 32 levels deep"),
        ("large", f"{64 << 20} bytes, over the {1 << 20} bytes read of an error file"),
    ],
)
def test_an_unusable_worker_error_file_is_reported_not_obeyed(tmp_path: Path, kind: str, why: str) -> None:
    (tmp_path / "w.py").write_text(WORKER)
    launcher_file = tmp_path / "launcher.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["TORCHELASTIC_ERROR_FILE"] = str(launcher_file)
    p = subprocess.run(
        [sys.executable, "-m", "node_agent", "--standalone", "--nproc-per-node", "1", "w.py", kind],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "RecursionError" not in p.stderr, p.stderr
    assert "exitcode  : 3" in p.stderr, p.stderr
    assert "boom on stderr" in p.stderr
    assert f"is not used: {why})" in p.stderr, p.stderr
    assert "error_file: <N/A>" in p.stderr  # as torch's for a worker that wrote none
    record = json.loads(launcher_file.read_text())["message"]
    assert record["errorCode"] == 3
    assert record["message"].endswith("failed with exit code 3")  # as for a worker without one
    assert record["extraInfo"]["py_callstack"].startswith("boom on stderr\n")
    assert f"is not used: {why})" in record["extraInfo"]["py_callstack"]
