"""What an operator reads: ``rdzv-server status``'s tables, and peers' texts made safe to show.

Texts that came from peers (node and job ids, reasons, failure messages, history) are shown
with control characters escaped (``shown``): in the tables here and in the server's log
(``daemon.SafeFormatter``), so a newline or a terminal escape in a peer's text cannot forge a
line or rewrite the operator's terminal. Pure functions of the status API's JSON.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

HISTORY_SHOWN = 15  # a job's most recent history events in its detail


# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: object) -> str:
    """A peer's text, safe to print on one line: control characters become visible escapes."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], str(text))


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
            )
        )
    out = head + "\n\n" + table(("JOB", "PHASE", "NODES", "ROUND", "RESTARTS", "AGE"), rows)
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
        rows.append(
            (
                m["node_id"],
                state,
                m["addr"] or "-",
                "-" if m["nproc"] is None else m["nproc"],
                "-" if m["group_rank"] is None else m["group_rank"],
                ranks,
                beat,
                m["failures"],
                m["reason"] if departed else "",
            )
        )
    lines.append("")
    if rows:
        headers = ("NODE", "STATE", "ADDRESS", "NPROC", "RANK", "RANKS", "HEARTBEAT", "FAILURES", "NOTE")
        lines.append(table(headers, rows))
    else:
        lines.append("no nodes")
    if job["failures"]:
        lines += ["", "failures (the root cause of each restart):"]
        for f in job["failures"]:
            where = "" if f["round"] is None else f"round {f['round']}: "
            text = f["description"] + (f": {f['message']}" if f["message"] else "")
            lines.append(f"  {where}{shown(text)}")
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
