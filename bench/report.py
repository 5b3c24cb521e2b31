"""Rows of results, their targets, and the two outputs: docs/benchmarks.md and the scale plot."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Target:
    """A goal for our median: at most a fraction of torchrun's median, or an absolute bound."""

    text: str
    ratio_max: float | None = None
    abs_max: float | None = None

    def holds(self, ours: float | None, theirs: float | None) -> bool | None:
        if ours is None:
            return None
        if self.ratio_max is not None:
            if theirs is None or theirs <= 0:
                return None
            return ours / theirs <= self.ratio_max
        if self.abs_max is not None:
            return ours <= self.abs_max
        return None


def ratio(frac: float, text: str | None = None) -> Target:
    return Target(text or f"<= 1/{round(1 / frac)} of torchrun", ratio_max=frac)


def at_most(bound: float, text: str) -> Target:
    return Target(text, abs_max=bound)


@dataclass
class Row:
    case: str
    label: str
    unit: str
    target: Target | None = None
    torchrun: list[float] | None = field(default_factory=list)  # None: not applicable
    ours: list[float] = field(default_factory=list)
    failures: dict[str, list[str]] = field(default_factory=dict)

    def med(self, who: str) -> float | None:
        vals = self.ours if who == "ours" else self.torchrun
        return statistics.median(vals) if vals else None

    @property
    def ratio(self) -> float | None:
        a, b = self.med("ours"), self.med("torchrun")
        if a is None or b is None or b == 0:
            return None
        return a / b

    @property
    def holds(self) -> bool | None:
        if self.target is None:
            return None
        return self.target.holds(self.med("ours"), self.med("torchrun"))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["median_ours"] = self.med("ours")
        d["median_torchrun"] = self.med("torchrun")
        d["ratio"] = self.ratio
        d["holds"] = self.holds
        return d


NA = "\u2013"  # an en dash: not applicable


def _num(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f}"
    if unit in ("MB", "%", "ms"):
        return f"{v:.1f}"
    if unit == "s CPU":
        return f"{v:.3f}"
    return f"{v:,.0f}"


def _cell(vals: list[float] | None, unit: str, failures: list[str]) -> str:
    if vals is None:
        return NA
    if not vals:
        return f"failed ({len(failures)})" if failures else "none seen"
    lo, mid, hi = min(vals), statistics.median(vals), max(vals)
    text = f"{_num(lo, unit)} / **{_num(mid, unit)}** / {_num(hi, unit)}"
    if len(vals) > 1 or failures:
        text += f" (n={len(vals)}"
        text += f", {len(failures)} failed)" if failures else ")"
    return text


def _ratio_cell(r: float | None) -> str:
    if r is None:
        return NA
    if r >= 1:
        return f"{r:.2f}"
    return f"{r:.3f} (1/{1 / r:.0f})" if r > 0 else "0"


def _holds_cell(row: Row) -> str:
    if row.target is None:
        return ""
    h = row.holds
    mark = "yes" if h else "**no**" if h is False else "?"
    return f"{row.target.text}: {mark}"


def markdown_table(rows: list[Row]) -> str:
    out = [
        "| case | metric | unit | torchrun min / **median** / max | ours min / **median** / max "
        "| ours / torchrun | target |",
        "|---|---|---|---|---|---|---|",
    ]
    last_case = None
    for r in rows:
        case = r.case if r.case != last_case else ""
        last_case = r.case
        theirs = _cell(r.torchrun, r.unit, r.failures.get("torchrun", []))
        ours = _cell(r.ours, r.unit, r.failures.get("ours", []))
        cells = (case, r.label, r.unit, theirs, ours, _ratio_cell(r.ratio), _holds_cell(r))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def failure_notes(rows: list[Row]) -> list[str]:
    """One line per failed trial: what was awaited, and the first error line of the logs."""
    notes, seen = [], set()
    for r in rows:
        for who, msgs in r.failures.items():
            for m in msgs:
                if m in seen:
                    continue  # every metric row of a case carries its trials' failures
                seen.add(m)
                lines = [x.strip() for x in m.strip().splitlines()] or [""]
                cause = next((x for x in lines[1:] if "Error" in x or "error" in x), "")
                text = lines[0] + (f"; log: `{cause[:200]}`" if cause else "")
                notes.append(f"- {r.case}, {who}: {text}")
    return notes


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    rows = []
    for d in data["rows"]:
        t = d.get("target")
        rows.append(
            Row(
                case=d["case"],
                label=d["label"],
                unit=d["unit"],
                target=Target(**t) if t else None,
                torchrun=d["torchrun"],
                ours=d["ours"],
                failures=d.get("failures", {}),
            )
        )
    return rows


SCALE_SERIES = {
    "cold join storm": "cold join storm (M:M)",
    "join storm into an elastic job": "join storm, elastic job (1:M)",
    "1 % close their sockets": "re-rendezvous after 1 % drop",
    "floor: plain socket.send": "floor: M plain sends (no protocol)",
}


def _scale_m(case: str) -> int | None:
    """M of a case-7 row's case title ("7. scale: 1,000 simulated agents ..."); None: another case."""
    if not case.startswith("7. scale:"):
        return None
    return int("".join(ch for ch in case.split("scale:")[1].split("simulated")[0] if ch.isdigit()))


def scale_series(rows: list[Row]) -> dict[str, dict[int, list[float]]]:
    """The plot's data, from the case-7 rows (the case title carries M)."""
    series: dict[str, dict[int, list[float]]] = {name: {} for name in SCALE_SERIES.values()}
    for r in rows:
        m = _scale_m(r.case)
        if m is None:
            continue
        for prefix, name in SCALE_SERIES.items():
            if r.label.startswith(prefix):
                series[name][m] = r.ours
    return series


# Case 7's load phases: the labels of their rows begin with these (bench/__main__.py).
LOAD_SUMMARIES = "heartbeats + summaries"
LOAD_HANG = "one hang"
# The side-by-side table: (column, the label its rows begin with, unit).
SCALE_LOAD_COLUMNS = (
    ("heartbeats only: server CPU", "server CPU, all M heartbeating", "%"),
    ("with summaries: server CPU", f"{LOAD_SUMMARIES}: server CPU", "%"),
    ("heartbeats only: RSS", "server RSS with M agents joined", "MB"),
    ("with summaries: RSS", f"{LOAD_SUMMARIES}: server RSS", "MB"),
    ("hang → verdict at every node", f"{LOAD_HANG}:", "s"),
    ("hang: server CPU", "hang: server CPU time", "s CPU"),
    ("hang: peak RSS", "hang: server peak RSS", "MB"),
)


def scale_load_table(rows: list[Row]) -> str:
    """Case 7's server load by M, medians side by side: heartbeats alone, with the training
    summaries real agents add, and one hang ("" without such rows)."""
    by_m: dict[int, dict[str, float]] = {}
    for r in rows:
        m = _scale_m(r.case)
        med = r.med("ours")
        if m is None or med is None:
            continue
        for column, prefix, _ in SCALE_LOAD_COLUMNS:
            if r.label.startswith(prefix):
                by_m.setdefault(m, {})[column] = med
    by_m = {m: cols for m, cols in by_m.items() if "with summaries: server CPU" in cols}
    if not by_m:
        return ""
    head = " | ".join(f"{column} ({unit})" for column, _, unit in SCALE_LOAD_COLUMNS)
    out = [
        "Case 7, the server's load side by side (medians): heartbeats alone, with what the agents "
        "of a training job add (one Progress per 8-rank node a second), and one hang.",
        "",
        f"| M | {head} |",
        "|---" * (len(SCALE_LOAD_COLUMNS) + 1) + "|",
    ]
    for m in sorted(by_m):
        cells = [_num(by_m[m][c], unit) if c in by_m[m] else NA for c, _, unit in SCALE_LOAD_COLUMNS]
        out.append(f"| {m:,} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_json(path: Path, meta: dict[str, Any], rows: list[Row], extra: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": [r.to_json() for r in rows], **extra}, indent=1) + "\n")


def plot_scale(path: Path, series: dict[str, dict[int, list[float]]], title: str) -> None:
    """Rendezvous time against M, log-log, with min-max bars; needs the bench extra (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    x0 = min((m for by_m in series.values() for m, v in by_m.items() if v), default=100)
    for label, by_m in series.items():
        ms = sorted(m for m, v in by_m.items() if v)
        if not ms:
            continue
        med = [statistics.median(by_m[m]) for m in ms]
        lo = [med[i] - min(by_m[m]) for i, m in enumerate(ms)]
        hi = [max(by_m[m]) - med[i] for i, m in enumerate(ms)]
        ax.errorbar(ms, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.axhline(3.0, color="grey", ls="--", lw=0.8)
    ax.text(x0, 3.0 * 1.08, "storm target 3 s", fontsize=8, color="grey")
    ax.axhline(0.5, color="grey", ls=":", lw=0.8)
    ax.text(x0, 0.5 * 1.08, "one-round target 0.5 s", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("simulated agents M (one rdzv-server process)")
    ax.set_ylabel("seconds (median, min-max bars)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
