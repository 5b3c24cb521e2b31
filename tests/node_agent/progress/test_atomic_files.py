"""The agent's whole files (stack reports, progress pages) are written through
edge.atomic_write: a link planted at the names once used for their temporaries
(``<path>.<pid>.tmp``, ``<path>.<pid>.new``) is neither followed nor in the way."""

from __future__ import annotations

import os
from pathlib import Path

from node_agent.progress.pages import create_page, page_bytes
from node_agent.progress.stacks import write_report


def _plant(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / name)
    return victim


def test_a_stack_report_is_written_past_a_planted_link(tmp_path: Path) -> None:
    path = tmp_path / "stacks.txt"
    victim = _plant(tmp_path, f"stacks.txt.{os.getpid()}.tmp")
    assert write_report(str(path), "Thread 1\n")  # was refused (O_NOFOLLOW): no report at all
    assert path.read_text() == "Thread 1\n" and not path.is_symlink()
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["stacks.txt", f"stacks.txt.{os.getpid()}.tmp", "victim"]


def test_a_page_is_created_past_a_planted_link(tmp_path: Path) -> None:
    path = tmp_path / "rank0.page"
    victim = _plant(tmp_path, f"rank0.page.{os.getpid()}.new")
    create_page(str(path))  # raised (ELOOP): the worker could not start
    assert path.read_bytes() == page_bytes() and (path.stat().st_mode & 0o777) == 0o600
    assert victim.read_text() == "precious"
    create_page(str(path))  # an existing page is replaced, not rewritten
    assert sorted(os.listdir(tmp_path)) == ["rank0.page", f"rank0.page.{os.getpid()}.new", "victim"]
