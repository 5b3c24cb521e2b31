"""What a worker sees of its own start, for the cold/warm parity tests: tests/node_agent/test_warm.py
(through the supervisor, as a script and with ``-m warm_probe``) and tests/integration/test_preload.py
(through node-agent, with and without --preload, and through torchrun).

With $DUMP_DIR set, it writes what it saw as JSON to
``$DUMP_DIR/state-<RANK>-<TORCHELASTIC_RESTART_COUNT>.json``; its descriptors are listed while
that file is open (a warm worker has stdio, the file and the listing: 0-4). Then it prints
"probe <how> rank <RANK>" to stdout and "probe stderr line" to stderr, and argv[1] says how to end:

- ok (the default): exit 0
- exit3: exit 3; exitmsg: exit with a message; raise: an exception; kbint: KeyboardInterrupt;
  sigterm: death by SIGTERM
- record: an exception under torch's ``@record`` (the error file)
- hold: start a grandchild in the worker's process group, write "<pid> <grandchild pid>\\n" to
  ``$DUMP_DIR/hold-<RANK>.pids``, sleep
- train: gloo, its threads' scheduling policies ("policy rank R restart C: OTHER"), then 20
  all_reduce steps printing "step S rank R restart C"; rank 1 of restart 0 dies
  at step 10
"""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def state() -> dict[str, Any]:
    g = globals()
    spec = g.get("__spec__")
    sigs = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        sigs[str(int(sig))] = (
            handler if isinstance(handler, int) else getattr(handler, "__name__", repr(handler))
        )
    streams = {}
    for name in ("stdin", "stdout", "stderr"):
        s = getattr(sys, name)
        streams[name] = (
            None
            if s is None
            else {
                "same_as_dunder": s is getattr(sys, f"__{name}__"),
                "fileno": s.fileno(),
                "isatty": s.isatty(),
                "encoding": s.encoding,
                "errors": s.errors,
                "line_buffering": s.line_buffering,
                "write_through": s.write_through,
                "mode": s.mode,
                "name": s.name,
                "buffer": type(s.buffer).__name__,
                "raw_name": getattr(getattr(s.buffer, "raw", s.buffer), "name", None),
            }
        )
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return {
        "argv": sys.argv,
        "orig_argv": getattr(sys, "orig_argv", None),
        "path0": sys.path[0],
        "file": g.get("__file__"),
        "name": __name__,
        "spec": None if spec is None else [spec.name, spec.origin],
        "loader": type(g.get("__loader__")).__name__,
        "main_keys": [k for k in g if k.startswith("__")],
        "main_is_module": sys.modules["__main__"].__dict__ is g,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "fds": fds,
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "signals": sigs,
        "streams": streams,
        "flags": repr(sys.flags),
        "executable": sys.executable,
    }


def policies() -> str:
    """The scheduling policies of this process's threads (a refill warms at SCHED_IDLE)."""
    names = {os.SCHED_OTHER: "OTHER", os.SCHED_IDLE: "IDLE", os.SCHED_BATCH: "BATCH"}
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            found.add(names.get(os.sched_getscheduler(int(tid)), "?"))
        except ProcessLookupError:
            pass
    return ",".join(sorted(found))


def train(rank: str, restart: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    print(f"policy rank {rank} restart {restart}: {policies()}", flush=True)
    for step in range(1, 21):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert int(t.item()) == world
        print(f"step {step} rank {rank} restart {restart}", flush=True)
        if restart == "0" and rank == "1" and step == 10:
            os._exit(1)
        time.sleep(0.2)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    out = os.environ.get("DUMP_DIR")
    if out:
        with open(os.path.join(out, f"state-{rank}-{restart}.json"), "w") as f:
            json.dump(state(), f, indent=1, sort_keys=True)
    how = sys.argv[1] if len(sys.argv) > 1 else "ok"
    print(f"probe {how} rank {rank}", flush=True)
    print("probe stderr line", file=sys.stderr, flush=True)

    def fail() -> None:
        raise RuntimeError(f"probe rank {rank} failed on purpose")

    if how == "ok":
        pass
    elif how == "exit3":
        sys.exit(3)
    elif how == "exitmsg":
        sys.exit("probe says bye")
    elif how == "raise":
        fail()
    elif how == "record":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(fail)()
    elif how == "kbint":
        raise KeyboardInterrupt
    elif how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    elif how == "hold":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(os.path.join(os.environ["DUMP_DIR"], f"hold-{rank}.pids"), "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(300)
    elif how == "train":
        train(rank, restart)
    else:
        sys.exit(f"warm_probe: unknown ending {how!r}")


if __name__ == "__main__":
    main()
