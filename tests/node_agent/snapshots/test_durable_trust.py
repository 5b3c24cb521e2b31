"""--snapshot-dir trusts only what this user made, for this command line (issue 42, item 4):
a directory every user may write is refused when the flag is parsed and at start; a folder or
file below it that another uid owns, or that others may write, or a symlink, is never read
(said once); the agent's folders are 0700 whatever the umask; a standalone job's folder is
its command line's; a folder recorded for another command line is neither restored nor
written. The tests run as root: a planted folder is one chown'ed to another uid."""

from __future__ import annotations

import asyncio
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.agent_log import AgentLog
from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig, ConfigError
from node_agent.snapshots.durable import (
    COMMAND_FILE,
    DurableDir,
    Offer,
    Refused,
    command_of,
    refuse_root,
    standalone_job,
)
from node_agent.snapshots.holdings import Holdings, snap_name
from node_agent.snapshots.node import SnapshotNode, start_snapshots

OTHER_UID = 12345

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plants files of another uid (needs root)")


def _persist(d: DurableDir, tmp_path: Path, world: int, rank: int, step: int, data: bytes = b"state") -> None:
    src = tmp_path / f"src-{rank}-{step}"
    src.write_bytes(data)
    fd = os.open(src, os.O_RDONLY)
    try:
        d.persist(world, rank, step, fd)
    finally:
        os.close(fd)


def _complete(tmp_path: Path, warned: list[str] | None = None) -> DurableDir:
    """A 2-rank job's folder with steps 5 and 6 complete."""
    d = DurableDir(tmp_path / "dir", "job", warn=None if warned is None else warned.append)
    for rank in (0, 1):
        for step in (5, 6):
            _persist(d, tmp_path, 2, rank, step, f"r{rank}s{step}".encode())
    assert d.offer() == Offer(2, (6, 5))
    return d


def _fresh(d: DurableDir, warned: list[str]) -> DurableDir:
    """The same folder as a relaunch sees it."""
    return DurableDir(d.root, "job", warn=warned.append)


# -- the directory itself ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o703])
def test_a_directory_every_user_may_write_is_refused_at_parse_and_at_start(tmp_path: Path, mode: int) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)  # 01777: sticky, as /tmp
    with pytest.raises(ConfigError, match=r"--snapshot-dir=.*is writable by every user"):
        parse_config(["--snapshot-dir", str(root), str(script)], {"PATH": os.defpath})
    assert "writable by every user" in refuse_root(root)
    with pytest.raises(Refused, match="writable by every user"):
        DurableDir(root, "job").claim()
    assert os.listdir(root) == []  # nothing made in it
    # A group-writable directory (a team's) is not refused: what is below it is checked.
    os.chmod(root, 0o2770)
    assert refuse_root(root) == ""
    assert parse_config(["--snapshot-dir", str(root), str(script)], {"PATH": os.defpath}).snapshot_dir


def test_a_symlink_as_the_directory_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ConfigError, match="is a symlink: give the directory itself"):
        parse_config(["--snapshot-dir", str(tmp_path / "link"), str(script)], {"PATH": os.defpath})
    with pytest.raises(Refused, match="is a symlink"):
        DurableDir(tmp_path / "link", "job").claim()


def test_a_refused_directory_at_start_is_said_and_neither_read_nor_written(tmp_path: Path) -> None:
    """Made world-writable after the flag was parsed: the agent's start says so and the job
    runs without it (no restore, no persist, no removal at success)."""

    async def go() -> None:
        d = _complete(tmp_path)
        os.chmod(d.root, 0o777)
        out = io.StringIO()
        node = SnapshotNode(
            str(tmp_path / "mem"), memory=1 << 20, nproc=2, rate=0, log=AgentLog(out),
            replicate=False, durable=DurableDir(d.root, "job"),
        )  # fmt: skip
        await node.start(lambda _read: None, "127.0.0.1")
        assert "is writable by every user" in out.getvalue(), out.getvalue()
        assert "nothing restored from it, nothing persisted to it" in out.getvalue()
        assert node.durable is None and node.join_fields() == {}
        await node.close(succeeded=True)
        assert sorted(os.listdir(d.rank_dir(2, 0))) == [snap_name(5), snap_name(6)]

    asyncio.run(go())


# -- what is below it ---------------------------------------------------------------------------


def test_a_rank_folder_of_another_uid_is_not_restored_and_said_once(tmp_path: Path) -> None:
    d = _complete(tmp_path)
    os.chown(d.rank_dir(2, 1), OTHER_UID, OTHER_UID)
    warned: list[str] = []
    again = _fresh(d, warned)
    assert again.offer() == Offer()
    assert again.offer() == Offer()
    assert len(warned) == 1 and f"belongs to uid {OTHER_UID}" in warned[0], warned
    assert str(d.rank_dir(2, 1)) in warned[0] and "not read" in warned[0]
    with pytest.raises(Refused):
        again.read_into(Holdings(tmp_path / "mem", memory=1 << 20, file_limit=1 << 10), 2, 1, 6)


@pytest.mark.parametrize("level", ["world", "rank", "file"])
@pytest.mark.parametrize("how", ["uid", "group", "other"])
def test_a_planted_or_open_folder_or_file_is_not_restored(tmp_path: Path, level: str, how: str) -> None:
    d = _complete(tmp_path)
    path = {
        "world": d.job / "w2",
        "rank": d.rank_dir(2, 0),
        "file": d.rank_dir(2, 0) / snap_name(6),
    }[level]
    if how == "uid":
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        os.chmod(
            path, stat.S_IMODE(os.stat(path).st_mode) | (stat.S_IWGRP if how == "group" else stat.S_IWOTH)
        )
    warned: list[str] = []
    again = _fresh(d, warned)
    offer = again.offer()
    assert 6 not in offer.steps, offer
    assert warned and str(path) in warned[0], warned
    h = Holdings(tmp_path / "mem", memory=1 << 20, file_limit=1 << 10)
    with pytest.raises(Refused):
        again.read_into(h, 2, 0, 6)
    assert h.path(0, 6) is None


def test_a_job_folder_of_another_uid_is_refused_whole(tmp_path: Path) -> None:
    d = _complete(tmp_path)
    os.chown(d.job, OTHER_UID, OTHER_UID)
    with pytest.raises(Refused, match=f"belongs to uid {OTHER_UID}"):
        _fresh(d, []).claim()
    with pytest.raises(Refused):
        _fresh(d, []).offer()
    _fresh(d, []).forget()  # not ours: not removed either
    assert d.rank_dir(2, 0).is_dir()


def test_a_planted_command_record_is_refused(tmp_path: Path) -> None:
    d = _complete(tmp_path)
    os.chown(d.job / COMMAND_FILE, OTHER_UID, OTHER_UID)
    with pytest.raises(Refused, match=f"belongs to uid {OTHER_UID}"):
        _fresh(d, []).claim()


def test_symlinked_folders_are_not_followed(tmp_path: Path) -> None:
    """A rank folder replaced by a link to a folder of ours with snapshots: not read."""
    d = _complete(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    d.rank_dir(2, 1).rename(elsewhere)
    os.symlink(elsewhere, d.rank_dir(2, 1))
    warned: list[str] = []
    again = _fresh(d, warned)
    assert again.offer() == Offer()
    assert warned and "not a folder" in warned[0], warned
    with pytest.raises(Refused):
        again.read_into(Holdings(tmp_path / "mem", memory=1 << 20, file_limit=1 << 10), 2, 1, 6)
    with pytest.raises(Refused):
        _persist(again, tmp_path, 2, 1, 7)  # nor written through
    assert sorted(os.listdir(elsewhere)) == [snap_name(5), snap_name(6)]


# -- the folders the agent makes ------------------------------------------------------------------


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o277])
def test_folders_are_made_0700_level_by_level_whatever_the_umask(
    tmp_path: Path, umask: None, mask: int
) -> None:
    os.umask(mask)
    d = DurableDir(tmp_path / "a" / "b" / "dir", "job")
    d.claim()
    _persist(d, tmp_path, 2, 1, 3)
    for level in (tmp_path / "a", tmp_path / "a" / "b", d.root, d.job, d.job / "w2", d.rank_dir(2, 1)):
        st = os.lstat(level)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, (level, oct(st.st_mode))
    assert stat.S_IMODE(os.stat(d.job / COMMAND_FILE).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(d.rank_dir(2, 1) / snap_name(3)).st_mode) & 0o077 == 0


# -- whose snapshots -------------------------------------------------------------------------------


def _config(tmp_path: Path, *args: str, standalone: bool = True, rdzv_id: str = "none") -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return AgentConfig(
        training_script=str(script), training_script_args=args, standalone=standalone,
        rdzv_id=rdzv_id, snapshot_dir=str(tmp_path / "dir"), snapshot_memory=1 << 20,
    )  # fmt: skip


async def _start(config: AgentConfig, tmp_path: Path, name: str) -> tuple[SnapshotNode, io.StringIO]:
    out = io.StringIO()
    node = await start_snapshots(config, str(tmp_path / name), "127.0.0.1", AgentLog(out), lambda _r: None)
    assert node is not None
    await asyncio.sleep(0)  # the warnings said from the reading thread
    return node, out


def _persist_node(node: SnapshotNode, tmp_path: Path, step: int) -> None:
    assert node.durable is not None
    _persist(node.durable, tmp_path, 1, 0, step)


def test_two_standalone_command_lines_in_one_directory_never_see_each_others_snapshots(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        lr1, lr2 = _config(tmp_path, "--lr", "0.1"), _config(tmp_path, "--lr", "0.2")
        first, _ = await _start(lr1, tmp_path, "run1")
        _persist_node(first, tmp_path, 7)
        await first.close()

        other, out = await _start(lr2, tmp_path, "run2")
        assert other.offer == Offer(), out.getvalue()  # another sweep point: starts afresh
        assert other.durable is not None and first.durable is not None
        assert other.durable.job != first.durable.job
        assert other.durable.job.name == standalone_job(command_of(lr2))
        assert other.durable.job.name.startswith("standalone-")
        _persist_node(other, tmp_path, 3)
        await other.close()

        again, out = await _start(lr1, tmp_path, "run3")  # a relaunch of the first line
        assert again.offer == Offer(1, (7,)), out.getvalue()
        await again.close(succeeded=True)
        assert first.durable.job.exists() is False and other.durable.job.is_dir()

    asyncio.run(go())


def test_the_same_rdzv_id_with_another_command_line_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        first, _ = await _start(
            _config(tmp_path, "--lr", "0.1", standalone=False, rdzv_id="sweep"), tmp_path, "a"
        )
        _persist_node(first, tmp_path, 7)
        await first.close()

        changed = _config(tmp_path, "--lr", "0.2", standalone=False, rdzv_id="sweep")
        node, out = await _start(changed, tmp_path, "b")
        text = out.getvalue()
        assert "holds the snapshots of another command line" in text, text
        assert "--lr 0.1" in text and "--lr 0.2" in text
        assert "nothing restored from it, nothing persisted to it" in text
        assert node.durable is None and node.join_fields() == {}
        await node.close(succeeded=True)  # the other line's folder stays
        assert (tmp_path / "dir" / "sweep" / "w1" / "r0" / snap_name(7)).exists()

        same, out = await _start(
            _config(tmp_path, "--lr", "0.1", standalone=False, rdzv_id="sweep"), tmp_path, "c"
        )
        assert same.offer == Offer(1, (7,)), out.getvalue()
        await same.close()

    asyncio.run(go())


def test_a_job_folder_with_snapshots_but_no_record_is_refused(tmp_path: Path) -> None:
    d = _complete(tmp_path)
    (d.job / COMMAND_FILE).unlink()  # as an older agent left it, or someone else's
    with pytest.raises(Refused, match="no record of the command line"):
        _fresh(d, []).claim()
    # A folder with nothing in it yet gets this job's record.
    e = DurableDir(tmp_path / "dir", "new", command=("x.py", "--a"))
    (e.job).mkdir(mode=0o700)
    e.claim()
    assert DurableDir(tmp_path / "dir", "new", command=("x.py", "--a")).offer() == Offer()
    with pytest.raises(Refused, match="another command line"):
        DurableDir(tmp_path / "dir", "new", command=("x.py", "--b")).claim()
