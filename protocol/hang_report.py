"""A hang report: every rank's stacks merged, the odd ones out, the suspects (pure, no I/O).

The agent builds one for its node (``<attempt dir>/hang_report.txt``, its failure banner) and
the server one for the job, from the ``Stacks`` every node sent. Both go through here, so a
reader sees the same report everywhere.

1. :func:`parse_stacks` reads one rank's dump, in faulthandler's format (what the worker
   module's stack signal writes) or py-spy's (``py-spy dump``), into threads of frames,
   innermost first. Text that is neither is kept whole, as one opaque thread.
2. :func:`merge` groups the ranks whose main thread has the same frames (file, function and
   line: never addresses or thread ids; a file is compared by its base name, since py-spy
   shortens paths and nodes may install to different places). The largest groups are the
   crowd; every smaller group is an odd one out, the rank that never reached the collective
   the others wait in.
3. Suspects: the hung ranks that are odd ones out; if none is, the ranks of the smallest odd
   groups (a node sees its own ranks pass their deadline, blocked in a collective, while the
   culprit is another node's); with no odd one out, the hung ranks.
4. :func:`render` writes the text; :meth:`HangReport.to_dict` the plain data for a status API.

Everything is bounded whatever the input: threads and frames per rank, groups kept, frames
shown per group, ranks named, and the rendered text (:data:`MAX_REPORT_CHARS`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from protocol.records import record

__all__ = [
    "Entry",
    "Group",
    "HangReport",
    "Thread",
    "compact",
    "group_key",
    "merge",
    "parse_stacks",
    "ranges",
    "render",
    "render_raw",
]

MAX_PARSE_CHARS = 256 * 1024  # of one rank's dump; the rest is ignored
MAX_THREADS = 64  # per rank
MAX_FRAMES = 64  # per thread
MAX_FRAME_CHARS = 300
MAX_OPAQUE_CHARS = 2048
MAX_GROUPS = 32  # kept in a report; the rest are counted
MAX_SHOWN_FRAMES = 30  # per group in the text
MAX_SHOWN_THREADS = 8  # other threads shown per group
MAX_SHOWN_THREAD_FRAMES = 6
MAX_NAMED = 16  # suspects and hung ranks detailed in a report
MAX_REPORT_CHARS = 64 * 1024

# faulthandler: 'Thread 0x00007f.. (most recent call first):', 'Current thread 0x.. (...):',
# 'Stack (most recent call first):' and '  File "path", line 12 in func'.
_FH_THREAD = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):\s*$"
)
_FH_STACK = re.compile(r"^Stack \(most recent call first\):\s*$")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?{3}) in (?P<func>.*?)\s*$')
# py-spy: 'Thread 12345 (idle): "MainThread"' and '    func (file.py:12)'.
_PS_THREAD = re.compile(r'^Thread (?:0x[0-9a-fA-F]+|\d+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?\s*$')
_PS_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)\s*$")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _clean(text: str, limit: int) -> str:
    """Printable text (a peer's bytes reach a terminal) of at most ``limit`` characters."""
    text = _CONTROL.sub("?", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@record(frozen=True, slots=True, kw_only=True)
class Thread:
    """One thread's stack, innermost frame first (``opaque``: text that did not parse)."""

    name: str  # "MainThread", "Thread 0x7f.." (faulthandler names none), "" when opaque
    main: bool
    frames: tuple[str, ...]  # "func (file:line)"
    keys: tuple[tuple[str, str, str], ...]  # (base name of file, func, line) per frame
    more: int = 0  # frames left out past MAX_FRAMES
    opaque: str = ""


def parse_stacks(text: str) -> tuple[Thread, ...]:
    """The threads of one rank's dump (faulthandler's or py-spy's format); the main thread
    is marked. Text with no thread in it is one opaque thread (empty text: none)."""
    text = text[:MAX_PARSE_CHARS]
    threads: list[tuple[str, list[tuple[str, str, str]], int, bool]] = []  # name, frames, more, faulthandler
    ids: set[str] = set()  # thread ids of the current dump: one seen again starts a new dump
    for raw in text.splitlines():
        line = raw.rstrip()
        header: tuple[str, str, bool] | None = None  # thread id, name, faulthandler's
        if m := _FH_THREAD.match(line):
            header = (m.group(2), m.group("name") or f"{m.group(1)} {m.group(2)}", True)
        elif _FH_STACK.match(line):
            header = ("stack", "Stack", True)
        elif m := _PS_THREAD.match(line):
            header = (line.split(" ")[1], m.group("name") or line.split(" (")[0], False)
        if header is not None or line.startswith("Process "):
            if header is None or header[0] in ids:  # two dumps in one file: the last is the newest
                threads, ids = [], set()
        if header is not None:
            ids.add(header[0])
            threads.append((header[1], [], 0, header[2]))
        elif threads and ((m := _FH_FRAME.match(line)) or (m := _PS_FRAME.match(line))):
            name, frames, more, is_fh = threads[-1]
            if len(frames) < MAX_FRAMES:
                frames.append((m.group("file"), m.group("func"), m.group("line") or "?"))
            else:
                threads[-1] = (name, frames, more + 1, is_fh)
    if not threads:
        stripped = text.strip()
        if not stripped:
            return ()
        return (Thread(name="", main=True, frames=(), keys=(), opaque=_clean(stripped, MAX_OPAQUE_CHARS)),)
    main = _main_index(threads)
    # At most MAX_THREADS, the main thread always among them.
    out = []
    for i, (name, frames, more, _fh) in enumerate(threads):
        if i >= MAX_THREADS - 1 and i != main:
            continue
        out.append(
            Thread(
                name=_clean(name, 80),
                main=i == main,
                frames=tuple(
                    _clean(f"{func} ({file}:{line})", MAX_FRAME_CHARS) for file, func, line in frames
                ),
                keys=tuple((_base(file), func, line) for file, func, line in frames),
                more=more,
            )
        )
    return tuple(out)


def compact(text: str, limit: int) -> str:
    """One rank's dump rewritten to fit ``limit`` characters (a ``Stacks`` message's bound)
    and still parse the same: py-spy's format, the main thread first, innermost frames first,
    each thread cut from its outer end. Text that does not parse is cut at its end."""
    threads = parse_stacks(text)
    if not threads or threads[0].opaque:
        body = text.strip()
        return body if len(body) <= limit else body[: limit - 4] + "\n..."
    ordered = sorted(threads, key=lambda t: not t.main)
    out: list[str] = []
    size = 0
    for i, t in enumerate(ordered):
        # 'Thread <n>' with a number: py-spy's header; the name carries the original one.
        header = f'Thread {i} (main): "MainThread"' if t.main else f'Thread {i} (other): "{t.name}"'
        if size + len(header) + 1 > limit:
            break
        out.append(header)
        size += len(header) + 1
        for frame in t.frames:
            line = f"    {frame}"
            if size + len(line) + 1 > limit:
                break
            out.append(line)
            size += len(line) + 1
    return "\n".join(out)


def _base(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _main_index(threads: Sequence[tuple[str, list[tuple[str, str, str]], int, bool]]) -> int:
    """Which thread is the main one: py-spy names it; faulthandler lists threads newest first,
    so the main thread is the last one that did not start in threading.py."""
    for i, (name, _frames, _more, fh) in enumerate(threads):
        if not fh and name == "MainThread":
            return i
    for i in range(len(threads) - 1, -1, -1):
        frames = threads[i][1]
        if not frames or _base(frames[-1][0]) != "threading.py":
            return i
    return len(threads) - 1


@record(frozen=True, slots=True, kw_only=True)
class Entry:
    """One rank's part of a report: what the watch knew and the stacks collected."""

    rank: int
    step: int  # its last step (-1: none)
    phase: str
    silent_s: float  # since its last progress
    text: str  # the dump (faulthandler or py-spy format), or why there is none
    hung: bool = False  # past its deadline
    source: str = ""  # what produced the stacks: "py-spy", "signal", "" (none)
    node: str = ""


@record(frozen=True, slots=True, kw_only=True)
class Group:
    """Ranks whose main threads have the same frames."""

    ranks: tuple[int, ...]  # sorted
    frames: tuple[str, ...]  # the main thread's, innermost first, at most MAX_SHOWN_FRAMES
    more: int  # frames not shown
    opaque: str  # the text, when the stacks did not parse
    odd: bool  # smaller than the largest group
    threads: tuple[tuple[str, tuple[str, ...]], ...]  # other threads of its first rank
    sources: tuple[str, ...]


@record(frozen=True, slots=True, kw_only=True)
class HangReport:
    ranks: int  # ranks with stacks in the report
    groups: tuple[Group, ...]  # odd ones out first (smallest first), then the largest
    dropped_groups: int  # groups past MAX_GROUPS
    dropped_ranks: int  # the ranks in them
    suspects: tuple[Entry, ...]  # without stacks; at most MAX_NAMED
    hung: tuple[Entry, ...]  # without stacks; at most MAX_NAMED
    n_suspects: int
    n_hung: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, str, int, float) for a JSON status."""

        def who(e: Entry) -> dict[str, Any]:
            return {"rank": e.rank, "node": e.node, "step": e.step, "phase": e.phase, "silent_s": e.silent_s}

        return {
            "ranks": self.ranks,
            "suspects": [who(e) for e in self.suspects],
            "suspect_count": self.n_suspects,
            "hung": [who(e) for e in self.hung],
            "hung_count": self.n_hung,
            "groups": [
                {
                    "ranks": ranges(g.ranks),
                    "size": len(g.ranks),
                    "odd": g.odd,
                    "frames": list(g.frames),
                    "more_frames": g.more,
                    "opaque": g.opaque,
                    "threads": [{"name": n, "frames": list(f)} for n, f in g.threads],
                    "sources": list(g.sources),
                }
                for g in self.groups
            ],
            "dropped_groups": self.dropped_groups,
            "dropped_ranks": self.dropped_ranks,
        }


EntryTuple = tuple[int, int, str, float, str]  # rank, step, phase, silent_s, text


def group_key(threads: Sequence[Thread]) -> tuple[Any, ...]:
    """What :func:`merge` groups a rank's stacks by (``threads``: ``parse_stacks``'s): its main
    thread's frames (base name of file, function, line), or its text if that did not parse."""
    main = next((t for t in threads if t.main), None)
    if main is None:
        return ("none",)
    if main.opaque:
        return ("opaque", _ADDRESS.sub("0x?", main.opaque))
    return ("frames", main.keys, main.more)


def merge(entries: Iterable[Entry | EntryTuple], hung: Collection[int] = ()) -> HangReport:
    """The report of ``entries`` (one per rank, an :class:`Entry` or a tuple (rank, step,
    phase, silent_s, text); a rank given twice counts once, the last); ``hung``: ranks past
    their deadline beside those whose entry says so."""
    by_rank: dict[int, Entry] = {}
    for item in entries:
        e = (
            item
            if isinstance(item, Entry)
            else Entry(rank=item[0], step=item[1], phase=item[2], silent_s=item[3], text=item[4])
        )
        by_rank[e.rank] = e
    hung_ranks = {r for r, e in by_rank.items() if e.hung or r in hung}
    buckets: dict[tuple[Any, ...], list[tuple[Entry, tuple[Thread, ...]]]] = {}
    for rank in sorted(by_rank):
        e = by_rank[rank]
        threads = parse_stacks(e.text)
        buckets.setdefault(group_key(threads), []).append((e, threads))
    largest = max((len(v) for v in buckets.values()), default=0)
    # Odd ones out first, smallest first (a singleton is the likeliest culprit); then the crowd.
    ordered = sorted(buckets.values(), key=lambda v: (len(v) == largest, len(v), v[0][0].rank))
    groups = tuple(_group(members, odd=len(members) < largest) for members in ordered[:MAX_GROUPS])
    dropped = ordered[MAX_GROUPS:]  # never the crowd: it sorts last only past MAX_GROUPS odd ones
    odd_ranks = {e.rank for v in ordered if len(v) < largest for e, _ in v}
    suspects = hung_ranks & odd_ranks
    if not suspects and odd_ranks:
        smallest = min(len(v) for v in ordered if len(v) < largest)
        suspects = {e.rank for v in ordered if len(v) == smallest for e, _ in v}
    if not suspects:
        suspects = set(hung_ranks)

    def bare(ranks: set[int]) -> tuple[Entry, ...]:
        chosen = sorted(ranks)[:MAX_NAMED]
        return tuple(_bare(by_rank[r]) for r in chosen if r in by_rank)

    return HangReport(
        ranks=len(by_rank),
        groups=groups,
        dropped_groups=len(dropped),
        dropped_ranks=sum(len(v) for v in dropped),
        suspects=bare(suspects),
        hung=bare(hung_ranks),
        n_suspects=len(suspects),
        n_hung=len(hung_ranks),
    )


def _bare(e: Entry) -> Entry:
    return Entry(
        rank=e.rank,
        step=e.step,
        phase=_clean(e.phase, 64),
        silent_s=e.silent_s,
        text="",
        hung=e.hung,
        source=_clean(e.source, 32),
        node=_clean(e.node, 128),
    )


def _group(members: list[tuple[Entry, tuple[Thread, ...]]], *, odd: bool) -> Group:
    threads = members[0][1]
    main = next((t for t in threads if t.main), None)
    if main is None:
        frames: tuple[str, ...] = ()
        more, opaque = 0, "(no stacks)"
    else:
        frames = main.frames[:MAX_SHOWN_FRAMES]
        more = len(main.frames) - len(frames) + main.more
        opaque = main.opaque
    others = tuple((t.name, t.frames[:MAX_SHOWN_THREAD_FRAMES]) for t in threads if not t.main)[
        :MAX_SHOWN_THREADS
    ]
    return Group(
        ranks=tuple(e.rank for e, _ in members),
        frames=frames,
        more=more,
        opaque=opaque,
        odd=odd,
        threads=others,
        sources=tuple(sorted({_clean(e.source, 32) or "none" for e, _ in members}))[:4],
    )


def ranges(ranks: Sequence[int], limit: int = 40) -> str:
    """``0-3,5,7,8`` for sorted ranks (a run of three or more as a range); past ``limit``
    pieces, ``... (N ranks)``."""
    pieces: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            pieces.append(f"{ranks[i]}-{ranks[j]}")
        else:
            pieces.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    if len(pieces) > limit:
        return ",".join(pieces[:limit]) + f",... ({len(ranks)} ranks)"
    return ",".join(pieces)


def _who(e: Entry) -> str:
    step = f"last step {e.step}" if e.step >= 0 else "no step reported"
    phase = f", phase {e.phase}" if e.phase else ""
    node = f" on {e.node}" if e.node else ""
    return f"rank {e.rank}{node} ({step}{phase}, no progress for {e.silent_s:.0f} s)"


def render(report: HangReport) -> str:
    """The report as text (at most MAX_REPORT_CHARS): the suspects, then each group."""
    lines: list[str] = []
    if report.suspects:
        more = (
            f" and {report.n_suspects - len(report.suspects)} more"
            if report.n_suspects > len(report.suspects)
            else ""
        )
        lines.append("hang: suspect " + "; ".join(_who(e) for e in report.suspects) + more)
    else:
        lines.append("hang: no suspect (no rank is hung and all stacks agree)")
    suspect_ranks = {e.rank for e in report.suspects}
    others = [e for e in report.hung if e.rank not in suspect_ranks]
    if others:
        left = report.n_hung - len(report.hung)
        lines.append(
            "also past their deadline: "
            + "; ".join(_who(e) for e in others)
            + (f" and {left} more" if left > 0 else "")
        )
    lines.append(
        f"stacks of {report.ranks} ranks in {len(report.groups) + report.dropped_groups} groups "
        "(main thread, innermost frame first):"
    )
    for g in report.groups:
        mark = "  <- odd one out" if g.odd else ""
        lines.append("")
        lines.append(
            f"ranks {ranges(g.ranks)} ({len(g.ranks)} of {report.ranks}; "
            f"stacks by {', '.join(g.sources)}){mark}"
        )
        if g.opaque:
            lines.extend("    " + line for line in g.opaque.splitlines()[:MAX_SHOWN_FRAMES])
        lines.extend(f"    {f}" for f in g.frames)
        if g.more:
            lines.append(f"    ... {g.more} more frames")
        for name, frames in g.threads:
            lines.append(f"  thread {name}: " + (" <- ".join(frames) if frames else "(no Python frame)"))
    if report.dropped_groups:
        lines.append("")
        lines.append(f"... {report.dropped_groups} more groups ({report.dropped_ranks} ranks) not shown")
    return _bound("\n".join(lines) + "\n", MAX_REPORT_CHARS)


def render_raw(entries: Iterable[Entry], limit: int = MAX_REPORT_CHARS) -> str:
    """Each rank's own dump, as collected (for the node's report file), at most ``limit``."""
    parts = []
    for e in sorted(entries, key=lambda e: e.rank):
        parts.append(
            f"--- rank {e.rank} (stacks by {_clean(e.source, 32) or 'none'}) ---\n"
            f"{_CONTROL.sub('?', e.text).rstrip()}\n"
        )
    return _bound("\n".join(parts), limit)


def _bound(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    tail = "\n... (cut)\n"
    return text[: limit - len(tail)] + tail
