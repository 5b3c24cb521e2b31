"""The in-place benchmark's reading of the step logs and its report (issue 44), without running
it: a process that restarted in place is two attempts, and the report's rows say what it ran."""

from __future__ import annotations

from pathlib import Path

from bench.inplace_lost import report
from tests.integration.workers.train_commit_log import attempts


def test_a_second_start_line_of_one_process_is_its_next_attempt(tmp_path: Path) -> None:
    (tmp_path / "A-0.log").write_text(
        "start pid=7 world=2 rank=0 restart=0 from=0 t=1.0\n"
        "step pid=7 world=2 rank=0 restart=0 step=1 sum=aa t=1.1\n"
        "start pid=7 world=2 rank=0 restart=1 from=1 t=2.0\n"
        "step pid=7 world=2 rank=0 restart=1 step=2 sum=bb t=2.1\n"
    )
    first, second = attempts(tmp_path)
    assert (first.pid, first.start_from, first.steps, first.first_t) == (7, 0, [1], 1.1)
    assert (second.pid, second.start_from, second.steps, second.first_t) == (7, 1, [2], 2.1)


def test_the_report_gives_each_failure_its_times_ratio_and_kept_processes() -> None:
    rows = {
        ("worker", "torchrun"): [{"back": 4.0, "survivor": 4.0, "lost": 23.0, "kept": 0.0}],
        ("worker", "ours"): [{"back": 0.4, "survivor": 0.3, "lost": 0.0, "kept": 1.0}],
    }
    text = report(rows, ["worker"], [], 1)
    assert "| SIGKILL of 1 of 2 ranks (1 node) | kill → every rank's first step" in text
    assert "4.00 / **4.00** / 4.00 s | 0.40 / **0.40** / 0.40 s | 0.100 |" in text
    assert "| surviving ranks that kept their process | 0 / **0** / 0 | 1 / **1** / 1 |" in text
