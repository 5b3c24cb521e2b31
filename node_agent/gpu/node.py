"""This node's GPUs as the agent uses them: --numa-binding's CPUs per local rank (found before
any rendezvous), the visible GPUs' UUIDs (found once, in a thread of their own), the wait for the
last workers' GPU memory to be released before the next start, and ``--health-check gpu``.

Built only when a launch asks for GPU work (the runner imports this module then): a launch
without GPUs pays nothing for it. What it reads and runs is devices.py's, binding.py's and
health.py's; this module holds what the agent remembers of them between rounds.

One of the agent's parts (``parts.py``), from when it is made: each attempt gets the binding
table (:meth:`GpuNode.before_start`); a stop that reaped workers starts the wait for their GPU
memory (:meth:`GpuNode.after_exit`), which the next start follows (:meth:`GpuNode.start_wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..agent_log import AgentLog
from ..config import AgentConfig
from ..executables import which
from ..parts import RoundPart, RoundStart, StartWait

if TYPE_CHECKING:
    from ..supervisor.spec import GroupResult

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own that the agent's exit never waits for (the default
    executor's would be joined: a hung nvidia-smi must not hold the agent's exit)."""
    import threading

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="node-agent-gpus", daemon=True).start()
    return await fut


class GpuNode(RoundPart):
    """The agent's GPU state for one run (``started_us``: when the agent started, on the
    monotonic clock in microseconds; the GPU check counts the Xids after it). ``spawn`` runs
    a task in the run's task group (the wait for the GPUs' memory)."""

    name = "gpu"

    def __init__(
        self,
        config: AgentConfig,
        environ: Mapping[str, str],
        log: AgentLog,
        clock: Callable[[], float],
        started_us: int,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]] | None = None,
    ) -> None:
        self.config = config
        self.environ = environ
        self.log = log
        self.clock = clock
        self.started_us = started_us
        self.spawn = spawn or asyncio.ensure_future
        self.cpus: dict[int, frozenset[int]] = {}  # --numa-binding: each local rank's CPUs
        self.binding_table = ""  # written into each attempt's log dir
        self._uuids: list[str] | None = None
        self._xids_unread_said = False
        self._released: asyncio.Task[None] | None = None  # the wait the next start follows

    # -- the agent's part (parts.py) --------------------------------------------------------

    async def before_start(self, r: RoundStart) -> dict[int, dict[str, str]]:
        if self.binding_table:
            self.write_binding(r.attempt.numa_binding_path())
        return {}

    def after_exit(self, result: GroupResult, *, stopped: bool) -> None:
        """Workers reaped by a stop: the next start waits until their GPU memory is released."""
        waiting = self._released is not None and not self._released.done()
        if stopped and result.exits and self.config.gpu_release_timeout > 0 and not waiting:
            self._released = self.spawn(self.wait_released())

    def start_wait(self) -> StartWait | None:
        released = self._released
        if released is None or released.done():
            return None
        why = (
            "the workers start once the last ones' GPU memory is released "
            f"(at most {self.config.gpu_release_timeout:g} s, --gpu-release-timeout)"
        )
        return StartWait(released, why)

    def bind(self) -> None:
        """--numa-binding: each local rank's CPUs, found before any rendezvous (a machine we
        cannot read is the user's error to see at once, not after the job has formed);
        raises ``binding.GpuSetupError``."""
        from .binding import binding_table, bindings_for

        mode = self.config.numa_binding
        assert mode is not None
        bindings = bindings_for(mode, self.config.nproc_per_node, self.environ, log=self.log)
        for b in bindings:
            self.log(f"NUMA binding: {b.line(mode)}")
        self.cpus = {b.local_rank: b.cpus for b in bindings}
        self.binding_table = binding_table(mode, bindings)

    def write_binding(self, path: str) -> None:
        try:
            with open(path, "w") as f:
                f.write(self.binding_table)
        except OSError as e:
            self.log(f"cannot write {path}: {e}", "warning")

    async def visible_gpus(self) -> list[str]:
        """The UUIDs of the GPUs our workers see, found once (in a thread: nvidia-smi may take
        its time, and the loop must not wait with it)."""
        if self._uuids is None:
            from .binding import visible_gpu_uuids

            self._uuids = await in_daemon_thread(visible_gpu_uuids, dict(self.environ))
        return self._uuids

    async def wait_released(self) -> None:
        """Before the next workers start: the last ones' GPU memory released (a zombie CUDA
        context makes the restart die of out-of-memory), bounded by --gpu-release-timeout."""
        smi = which("nvidia-smi")
        if smi is None:
            return  # no NVIDIA driver here (or nothing to ask it with)
        uuids = await self.visible_gpus()
        if not uuids:
            return
        t0 = self.clock()
        cfg = self.config
        from .health import wait_released

        problem = await wait_released(
            uuids, smi=smi, threshold_mib=cfg.gpu_release_mib, timeout=cfg.gpu_release_timeout
        )
        waited = self.clock() - t0
        if problem is not None:
            self.log(problem, "warning")
        elif waited > 1.0:
            self.log(f"the last workers' GPU memory was released after {waited:.1f} s")

    async def check(self) -> str | None:
        """``--health-check gpu``: every visible GPU answers, reports no uncorrected ECC error
        and no fatal Xid since the agent started, and has its memory free (health.py)."""
        smi = which("nvidia-smi")
        if smi is None:
            return "gpu: nvidia-smi is not on PATH, so the GPUs cannot be checked"
        uuids = await self.visible_gpus()
        if not uuids:
            shown = self.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
            return f"gpu: no NVIDIA GPU is visible{where}"
        cfg = self.config
        from .health import gpu_problem, kmsg_readable

        if not self._xids_unread_said and not kmsg_readable():
            self._xids_unread_said = True
            self.log(
                "--health-check gpu: /dev/kmsg is not readable here, so Xid errors are not checked", "warning"
            )
        return await gpu_problem(
            uuids,
            smi=smi,
            since_us=self.started_us,
            release_mib=cfg.gpu_release_mib,
            release_timeout=cfg.gpu_release_timeout,
        )
