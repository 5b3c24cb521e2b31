"""Case 12's cost script, run alone under ``node-agent --standalone --nproc-per-node 1``: what a
snapshot of a large state costs, and what reading 1 GiB back costs from tmpfs and from disk.

Environment: ``SNAP_COST_OUT`` (the JSON file of results), ``SNAP_COST_DISK`` (a folder on disk),
``SNAP_COST_SIZES`` (MiB per state, comma-separated, default ``100,1024``), ``SNAP_COST_REPS``
(default 3), ``SNAP_COST_WARMUP`` (saves not counted before them, default 2). Every figure is
the median of the reps, each ``time.perf_counter()`` around one call.

- ``save_<MiB>``: ``snapshot_torch.save(step, model=m)`` of a module whose parameters hold that
  many MiB (4 float32 tensors), into the agent's tmpfs (``NODE_AGENT_SNAPSHOT_DIR``: required),
  after the warm-up saves: on this VM the first writes into memory the guest never touched are two to
  four times slower (probably the hypervisor backing each page at its first touch); a job that
  snapshots every few steps reuses the pages its pruned snapshots freed.
- For the largest size, its newest ``.snap`` file: ``torch.load`` (``restore_tmpfs``),
  ``torch.load(mmap=True)`` (``restore_mmap``), the same followed by ``load_state_dict`` into the
  module (``restore_mmap_copy``: a complete restore, the bytes copied once). Then the same bytes
  copied to a file in ``SNAP_COST_DISK``, fsynced, and before each rep dropped from the page
  cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``: ``torch.load`` (``restore_disk_cold``), and
  without the drop (``restore_disk_warm``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from node_agent.worker import snapshot_torch

MIB = 1 << 20


class State(torch.nn.Module):
    def __init__(self, mib: int) -> None:
        super().__init__()
        n = mib * MIB // 4 // 4  # float32s per tensor, 4 tensors
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for _ in range(4))


def timed(fn: Any, reps: int, before: Any = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        del out
    return statistics.median(times)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    snap_dir = os.environ.get("NODE_AGENT_SNAPSHOT_DIR", "")
    if not snap_dir or not os.path.isdir(snap_dir):
        raise SystemExit("snap_cost.py: no NODE_AGENT_SNAPSHOT_DIR (run it under node-agent)")
    out_path = Path(os.environ["SNAP_COST_OUT"])
    disk = Path(os.environ["SNAP_COST_DISK"])
    sizes = [int(x) for x in os.environ.get("SNAP_COST_SIZES", "100,1024").split(",")]
    reps = int(os.environ.get("SNAP_COST_REPS", "3"))
    warmup = int(os.environ.get("SNAP_COST_WARMUP", "2"))
    torch.set_num_threads(1)
    res: dict[str, float] = {}
    step = 0
    state: State | None = None
    for mib in sizes:
        state = None  # free the previous one first
        state = State(mib)

        def save(model: State = state) -> None:
            nonlocal step
            step += 1
            snapshot_torch.save(step, model=model)

        for _ in range(warmup):
            save()
        res[f"save_{mib}"] = timed(save, reps)
    assert state is not None
    newest = max(Path(snap_dir).glob("*.snap"))
    res["file_mib"] = newest.stat().st_size / MIB
    res["restore_tmpfs"] = timed(lambda: torch.load(newest, weights_only=True), reps)
    res["restore_mmap"] = timed(lambda: torch.load(newest, weights_only=True, mmap=True), reps)

    def mmap_copy() -> None:
        loaded = torch.load(newest, weights_only=True, mmap=True)
        assert state is not None
        state.load_state_dict(loaded["model"])

    res["restore_mmap_copy"] = timed(mmap_copy, reps)
    disk.mkdir(parents=True, exist_ok=True)
    on_disk = disk / "state.pt"
    shutil.copyfile(newest, on_disk)
    try:
        res["restore_disk_cold"] = timed(
            lambda: torch.load(on_disk, weights_only=True), reps, lambda: drop_cache(on_disk)
        )
        res["restore_disk_warm"] = timed(lambda: torch.load(on_disk, weights_only=True), reps)
    finally:
        on_disk.unlink()
    out_path.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
