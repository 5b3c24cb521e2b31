"""What an operator reads: ``rdzv-server status``'s tables, and peers' texts made safe to show.

Texts that came from peers (node and job ids, reasons, failure messages, history) are shown
with control characters escaped (``shown``): in the tables here and in the server's log
(``daemon.SafeFormatter``), so a newline or a terminal escape in a peer's text cannot forge a
line or rewrite the operator's terminal. A failure's message (a worker's error, a hang report)
is the one text shown on several lines (``shown_lines``): each escaped, every line after its
first indented under it, so it cannot pass for a line of the table. Pure functions of the
status API's JSON.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from typing import Any

HISTORY_SHOWN = 15  # a job's most recent history events in its detail
STRAGGLER_LINES = 10  # flagged ranks listed under a job (the rest are counted)
HANG_GROUPS_SHOWN = 8  # stack groups of a hang report listed (odd ones out first)
HANG_FRAMES_SHOWN = 3  # innermost frames shown per group
HANG_RANKS_SHOWN = 16  # ranks named per line


# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: object) -> str:
    """A peer's text, safe to print on one line: control characters become visible escapes."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], str(text))


def shown_lines(text: str, first: str, indent: str) -> list[str]:
    """A peer's multi-line text (a failure's message with its hang report) as lines, each
    escaped as ``shown`` does: the first after ``first``, the others after ``indent``."""
    lines = text.rstrip("\n").split("\n")
    return [first + shown(lines[0]), *(indent + shown(line) if line else "" for line in lines[1:])]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *([("" if c is None else shown(c)) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _clock(t: float | None, with_date: bool = False) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S", time.localtime(t))


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _range(settings: dict[str, Any]) -> str:
    lo, hi = settings["min_nodes"], settings["max_nodes"]
    return str(lo) if lo == hi else f"{lo}:{hi}"


def _nodes(job: dict[str, Any]) -> str:
    text = f"{job['nodes']}/{_range(job['settings'])}"
    return text + (f" +{job['spares']} spare" if job["spares"] else "")


def format_jobs(doc: dict[str, Any]) -> str:
    srv = doc["server"]
    head = (
        f"{srv['software']}: {_n(srv['active_jobs'], 'active job')}, {_n(srv['agents'], 'agent')}, "
        f"{_n(srv['connections'], 'connection')}"
    )
    if not doc["jobs"]:
        return head + "\nno jobs"
    rows = []
    for j in doc["jobs"]:
        phase = j["phase"] + (" (forgotten)" if j["forgotten"] else "")
        rows.append(
            (
                j["id"],
                phase,
                _nodes(j),
                j["round"],
                f"{j['restart_count']}/{j['max_restarts']}",
                _age(j["age"]),
                _percent(j.get("goodput")),
            )
        )
    out = head + "\n\n" + table(("JOB", "PHASE", "NODES", "ROUND", "RESTARTS", "AGE", "GOODPUT"), rows)
    lines = [f"{shown(j['id'])}: {shown(j['goodput']['text'])}" for j in doc["jobs"] if j.get("goodput")]
    if lines:
        out += "\n\n" + "\n".join(lines)
    if doc.get("truncated"):
        out += (
            f"\n({len(doc['jobs'])} of {doc['jobs_total']} jobs shown: the active ones first, newest first)"
        )
    return out


def format_job(job: dict[str, Any]) -> str:
    s = job["settings"]
    lines = [
        f"job {shown(job['id'])}: {job['phase']}"
        + (" (forgotten: every node has left)" if job["forgotten"] else ""),
        f"  round {job['round']} ({job['rounds_completed']} completed), "
        f"restarts {job['restart_count']}/{job['max_restarts']}, nodes {_nodes(job)}"
        + (f", world size {job['world_size']}" if job["world_size"] is not None else "")
        + (f", master {shown(job['master']['addr'])}:{job['master']['port']}" if job["master"] else ""),
        f"  entrypoint {shown(s['entrypoint'])}; "
        f"created {_clock(job['created_at'], True)} ({_age(job['age'])} ago)",
    ]
    if job["outcome"]:
        lines.append(f"  outcome: {shown(job['outcome'])}")
    if job.get("goodput"):
        lines.append(f"  {shown(job['goodput']['text'])}")
    rows = []
    for m in job["members"]:
        departed = m["role"] == "departed"
        state = m["state"].upper() if m["state"] in ("lost", "excluded") else m["state"]
        if m["role"] == "spare":
            state += " (spare)"
        ranks = "-"
        if m["rank_offset"] is not None and m["nproc"]:
            first, last = m["rank_offset"], m["rank_offset"] + m["nproc"] - 1
            ranks = str(first) if first == last else f"{first}-{last}"
        beat = "-" if m["last_heartbeat_ago"] is None else _age(m["last_heartbeat_ago"]) + " ago"
        step, age, note = _node_progress(m.get("progress"))
        rows.append(
            (
                m["node_id"],
                state,
                m["addr"] or "-",
                "-" if m["nproc"] is None else m["nproc"],
                "-" if m["group_rank"] is None else m["group_rank"],
                ranks,
                step,
                age,
                beat,
                m["failures"],
                m["reason"] if departed else note,
            )
        )
    progress = job.get("progress")
    if progress:
        lines.append("  " + _job_progress(progress))
    loop = job.get("crash_loop")
    if loop and loop["restarts_without_progress"]:
        limit = f"/{loop['limit']}" if loop["limit"] else " (no limit)"
        best = "" if loop["best_step"] is None else f" past step {loop['best_step']}"
        n = loop["restarts_without_progress"]
        lines.append(f"  crash loop: {n}{limit} restarts in a row made no progress{best}")
    commit = job.get("commit")
    if commit:
        if commit["state"] == "arming":
            what = f"{commit['armed']}/{commit['nodes']} nodes acknowledged"
        else:
            what = f"{commit['committed']}/{commit['nodes']} nodes stopped"
        lines.append(
            f"  commit point: every rank stops at step {commit['step']} for: {shown(commit['reason'])} "
            f"({what}; a hard restart in {max(0.0, commit['deadline_in_s']):.0f} s otherwise)"
        )
    snap = job.get("snapshot")
    if snap:
        kept = snap.get("kept_step")
        lines.append(
            f"  snapshots: every rank can restore step {snap['step']} (newest since {_age(snap['age_s'])}); "
            + (f"step {kept} is on two nodes for every rank" if kept is not None else "none on two nodes yet")
        )
    lines.append("")
    if rows:
        headers = (
            "NODE",
            "STATE",
            "ADDRESS",
            "NPROC",
            "RANK",
            "RANKS",
            "STEP",
            "AGE",
            "HEARTBEAT",
            "FAILURES",
            "NOTE",
        )
        lines.append(table(headers, rows))
    else:
        lines.append("no nodes")
    lines += _hang_lines(job.get("hang"))
    lines += _straggler_lines(job.get("stragglers"))
    if job["failures"]:
        lines += ["", "failures (the root cause of each restart):"]
        for f in job["failures"]:
            where = "" if f["round"] is None else f"round {f['round']}: "
            text = f["description"] + (f": {f['message']}" if f["message"] else "")
            lines += shown_lines(text, f"  {where}", "      ")
    if job["excluded"]:
        lines += ["", "excluded:"] + [
            f"  {shown(x['node_id'])}: {shown(x['reason'])}" for x in job["excluded"]
        ]
    recent = job["history"][-HISTORY_SHOWN:]
    if recent:
        part = f"last {len(recent)} of {len(job['history'])}" if len(job["history"]) > len(recent) else ""
        lines += ["", f"history{' (' + part + ')' if part else ''}:"]
        width = max(len(e["kind"]) for e in recent)
        lines += [
            f"  {_clock(e['time'])}  {shown(e['kind']).ljust(width)}  {shown(e['text'])}" for e in recent
        ]
    return "\n".join(lines)


def _percent(g: dict[str, Any] | None) -> str:
    """A job's goodput as ``97.3 %`` (``-``: unknown)."""
    if not g or g.get("goodput") is None:
        return "-"
    # As machine/goodput.py's percent (not imported: this module is the status command's, which
    # loads nothing of the server).
    return f"{math.floor(g['goodput'] * 1000 + 0.5) / 10:.1f} %"


# --- training -------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 10_000 else _age(value / 1000)


def _node_progress(p: dict[str, Any] | None) -> tuple[str, str, str]:
    """A member's STEP and AGE cells, and its note (lag, phase, a late age, a straggler)."""
    if not p:
        return "-", "-", ""
    step = "-" if p["step"] is None else str(p["step"])
    if p["min_step"] is not None and p["step"] is not None and p["min_step"] != p["step"]:
        step = f"{p['min_step']}-{p['step']}"
    age = _age(p["age_s"]) + (
        "!" if p["age_state"] == "late" else "!!" if p["age_state"] == "stalled" else ""
    )
    notes = []
    if p["lag"]:
        notes.append(f"{p['lag']} behind")
    if p["phase"]:
        notes.append(f"in {p['phase']}")
    if p["age_state"] in ("late", "stalled"):
        notes.append(f"no progress: {p['age_state']} (p90 step {_ms(p['step_p90_ms'])})")
    s = p["straggler"]
    if s is not None and s["flagged"]:
        notes.append(f"straggler: rank {s['rank']} at {s['score']:.2f}")
    return step, age, "; ".join(notes)


def _job_progress(p: dict[str, Any]) -> str:
    parts = [f"step {'-' if p['step'] is None else p['step']}"]
    if p["min_step"] is not None and p["step"] is not None and p["min_step"] != p["step"]:
        parts[0] += f" (slowest rank at {p['min_step']})"
    if p["best_step"] is not None and p["best_step"] != p["step"]:
        parts.append(f"best {p['best_step']}")
    if p["steps_per_s"] is not None:
        parts.append(f"{p['steps_per_s']:.3g} steps/s")
    if p["last_progress_age_s"] is not None:
        where = f" (in {shown(p['phase'])})" if p["phase"] else ""
        parts.append(f"last progress {_age(p['last_progress_age_s'])} ago{where}")
    return "training: " + ", ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    text = ",".join(map(str, ranks[:HANG_RANKS_SHOWN]))
    return text + (f" (+{len(ranks) - HANG_RANKS_SHOWN} more)" if len(ranks) > HANG_RANKS_SHOWN else "")


def _straggler_lines(st: dict[str, Any] | None) -> list[str]:
    if not st or not st["flagged"]:
        return []
    out = ["", f"stragglers (compute speed below {st['threshold']:g} of the job's median):"]
    for f in st["flagged"][:STRAGGLER_LINES]:
        out.append(
            f"  rank {f['rank']} (local rank {f['local_rank']}) on {shown(f['node_id'])}: "
            f"score {f['score']:.2f}, {_ms(f['compute_ms'])} compute per step"
        )
    if st["flagged_total"] > STRAGGLER_LINES:
        out.append(f"  ... and {st['flagged_total'] - STRAGGLER_LINES} more")
    return out


def _hang_lines(hang: dict[str, Any] | None) -> list[str]:
    """The job's latest hang: who reported it, the hung ranks, and the merged stacks."""
    if not hang:
        return []
    step = "no step reported" if hang["step"] is None else f"step {hang['step']}"
    phase = f", phase {shown(hang['phase'])}" if hang["phase"] else ""
    out = [
        "",
        f"hang in round {hang['round']} ({_age(hang['ago'])} ago): "
        + (f"ranks {_ranks(hang['ranks'])}" if hang["ranks"] else "a rank")
        + f" made no progress for {_age(hang['silent_s'])} ({step}{phase}); "
        f"first reported by {shown(hang['node_id'])}",
    ]
    out += _report_lines(hang)
    return out


def _report_lines(hang: dict[str, Any]) -> list[str]:
    """The suspects, then each group of ranks with the same stack (odd ones out first), with
    its innermost frames; the whole stacks are in ``--json`` and on the dashboard."""
    report = hang["report"]
    if report is None:
        return ["  no stacks received yet"]
    suspects = _ranks(report["suspects"]) if report["suspects"] else "none named"
    dropped = f", {hang['nodes_dropped']} not kept" if hang["nodes_dropped"] else ""
    out = [f"  suspects: rank {suspects} (stacks from {_n(hang['nodes_reported'], 'node')}{dropped})"]
    for g in report["groups"][:HANG_GROUPS_SHOWN]:
        label = "odd one out: " if g["odd"] else ""
        count = f" ({g['ranks_total']} ranks)" if g["ranks_total"] > 1 else ""
        out.append(f"  {label}rank{'s' if g['ranks_total'] > 1 else ''} {_ranks(g['ranks'])}{count}:")
        out += [f"      {shown(f)}" for f in g["frames"][:HANG_FRAMES_SHOWN]]
        if len(g["frames"]) > HANG_FRAMES_SHOWN:
            out.append(f"      ... {len(g['frames']) - HANG_FRAMES_SHOWN} more frames")
    hidden = report["groups_total"] - min(len(report["groups"]), HANG_GROUPS_SHOWN)
    if hidden > 0:
        out.append(f"  ... and {_n(hidden, 'more group')} (rdzv-server status --json has them)")
    return out
