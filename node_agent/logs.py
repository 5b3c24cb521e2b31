"""Where worker logs go: torchrun's directory layout, minus its overwriting.

    <log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/{stdout.log,stderr.log,error.json}
    <log_dir>/<run_id>_<random>/attempt_<k>/{hang_report.txt,nccl_trace_rank_<rank>}  (a hang)
    <log_dir>/<run_id>_<random>/attempt_<k>/numa_binding.txt  (--numa-binding)

What is not a log stays out: the progress pages and torch's flight-recorder pipes live in the
agent's private, node-local folder (``runtime_dir.py``), so that a run with nothing to report
leaves exactly torchrun's tree. The hang report and torch's flight-recorder dumps (files torch
writes only after a hang, named as torch's own default ``nccl_trace_rank_``) are what a user
looks for after a hang: they land in the attempt's folder.

torchrun names the attempt directory after TORCHELASTIC_RESTART_COUNT and ``rmtree``s it when a
membership change restarts the workers with the same count, so the logs of the attempt that
failed are lost.  Here every ``new_attempt()`` takes the next free ``k`` instead; the directory
name therefore counts attempts on this node, not restarts.

Nothing here opens log files: the supervisor does, when it starts the workers.  Directories are
created eagerly (the run directory at init, the attempt directory in ``new_attempt``, a rank's
directory when one of its paths is asked for) because the worker itself writes ``error.json``
and torch's error handler does not create missing directories.
"""

from __future__ import annotations

import os

from .runtime_dir import RuntimeDir, make_temp_dir, temp_root

__all__ = ["Attempt", "RunLogs", "make_temp_dir"]


class Attempt:
    """One attempt's directory; paths for each local rank inside it. ``private``: the
    attempt's folder in the agent's private directory (pages and pipes, not logs)."""

    def __init__(self, index: int, dir: str, private: str) -> None:
        self.index = index
        self.dir = dir
        self.private = private

    def rank_dir(self, local_rank: int) -> str:
        """``<attempt>/<local_rank>``, created on first use."""
        path = os.path.join(self.dir, str(local_rank))
        os.makedirs(path, exist_ok=True)
        return path

    def error_file(self, local_rank: int) -> str:
        return os.path.join(self.rank_dir(local_rank), "error.json")

    def stdout_path(self, local_rank: int) -> str:
        return os.path.join(self.rank_dir(local_rank), "stdout.log")

    def stderr_path(self, local_rank: int) -> str:
        return os.path.join(self.rank_dir(local_rank), "stderr.log")

    def page_path(self, local_rank: int) -> str:
        """The rank's progress page (``node_agent.worker`` writes it; ``<page>.stacks`` beside
        it), in the private folder."""
        folder = os.path.join(self.private, str(local_rank))
        os.makedirs(folder, 0o700, exist_ok=True)
        return os.path.join(folder, "progress.page")

    def place_dir(self, local_rank: int) -> str:
        """The rank's place folder (``worker.run``: restarts in place, ``worker/place.py``), in
        the private directory beside the attempts: the same for every attempt, as a survivor
        keeps the one it was started with."""
        folder = os.path.join(os.path.dirname(self.private), "place", str(local_rank))
        os.makedirs(folder, 0o700, exist_ok=True)
        return folder

    def numa_binding_path(self) -> str:
        """--numa-binding: each local rank's CPUs, GPU and NUMA node (gpu/binding.py)."""
        return os.path.join(self.dir, "numa_binding.txt")

    def hang_report_path(self) -> str:
        return os.path.join(self.dir, "hang_report.txt")

    def flight_recorder_stem(self, kind: str) -> str:
        """torch's flight recorder: the stem its dumps (``trace``) or its dump FIFOs (``pipe``)
        are named after (torch appends the rank, and ``.pipe`` to a FIFO). Dumps are written
        only after a hang, into the attempt's folder; the FIFOs, made at every start, stay in
        the private folder."""
        if kind == "pipe":
            return os.path.join(self.private, "fr_pipe_rank_")
        return os.path.join(self.dir, "nccl_trace_rank_")

    def filtered_stdout_path(self) -> str:
        """--duplicate-stdout-filters' lines of every rank of the attempt (torchrun's name and place)."""
        return os.path.join(self.dir, "filtered_stdout.log")

    def filtered_stderr_path(self) -> str:
        return os.path.join(self.dir, "filtered_stderr.log")

    def __repr__(self) -> str:
        return f"Attempt(index={self.index}, dir={self.dir!r})"


class RunLogs:
    """The log directory of one run on this node (see the module header for the layout)."""

    def __init__(self, log_dir: str | None, run_id: str, runtime: RuntimeDir) -> None:
        self.runtime = runtime
        if log_dir is None:
            # torchrun's default: a fresh temporary base, so concurrent runs never collide.
            base = make_temp_dir("torchelastic_", temp_root())
        else:
            if os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir {log_dir!r} is a file")
            os.makedirs(log_dir, exist_ok=True)
            base = log_dir
        # A run id is user input; a path separator in it must not create nested directories.
        safe_id = run_id.replace(os.sep, "_") or "run"
        self.root: str = make_temp_dir(f"{safe_id}_", base)
        self._next = 0

    def new_attempt(self) -> Attempt:
        """Create ``attempt_<k>`` for the smallest ``k`` not used before in this run."""
        k = self._next
        while True:
            path = os.path.join(self.root, f"attempt_{k}")
            try:
                os.mkdir(path)
            except FileExistsError:  # someone made it behind our back: skip it, never reuse it
                k += 1
                continue
            self._next = k + 1
            return Attempt(k, path, self.runtime.attempt(k))
