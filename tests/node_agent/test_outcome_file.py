"""--outcome-dir (outcome_file.py): each agent that sees the end says how the job ended for it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import ConfigError
from node_agent.outcome_file import outcome_text, write_outcome


def test_each_ending_has_its_line() -> None:
    assert outcome_text(0, True) == "succeeded"
    assert outcome_text(0, False) == "left"  # a drained node: the job goes on without it
    assert outcome_text(1, False) == "failed 1"
    assert outcome_text(130, False) == "failed 130"


def test_the_file_is_named_by_host_and_pid_and_written_whole(tmp_path: Path) -> None:
    folder = tmp_path / "made" / "here"
    assert write_outcome(str(folder), 0, True) == ""
    assert [p.name for p in folder.iterdir()] == [f"{socket.gethostname()}-{os.getpid()}"]
    assert (folder / f"{socket.gethostname()}-{os.getpid()}").read_text() == "succeeded\n"
    assert write_outcome(str(folder), 1, False) == ""  # written again: replaced, not appended
    assert (folder / f"{socket.gethostname()}-{os.getpid()}").read_text() == "failed 1\n"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert "could not write the job's outcome" in write_outcome(str(blocked / "x"), 0, True)


def test_the_flag_and_its_variable(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    c = parse_config(["--standalone", "--outcome-dir", "rel", str(script)], env)
    assert c.outcome_dir == os.path.abspath("rel")
    c = parse_config(["--standalone", str(script)], {**env, "PET_OUTCOME_DIR": str(tmp_path)})
    assert c.outcome_dir == str(tmp_path)
    assert parse_config(["--standalone", str(script)], env).outcome_dir is None
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        parse_config(["--standalone", "--outcome-dir", str(script), str(script)], env)
