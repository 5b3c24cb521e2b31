"""What a worker sees of its start (tests/integration/test_preload.py), then what $PROBE_HOW says.

Writes $DUMP_DIR/state-<RANK>-<TORCHELASTIC_RESTART_COUNT>.json and prints "probe rank R".
PROBE_HOW: "ok" (exit 0), "record" (an exception under torch's @record: the error file),
"hold" (start a grandchild in the worker's process group, write its pid, sleep),
"train" (gloo: 20 all_reduce steps; rank 1 of restart 0 dies at step 10).
"""

import json
import os
import signal
import subprocess
import sys
import time


def state() -> dict:
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
    return {
        "environ": dict(os.environ),
        "argv": sys.argv,
        "path0": sys.path[0],
        "file": g.get("__file__"),
        "spec": None if spec is None else [spec.name, spec.origin],
        "cwd": os.getcwd(),
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "signals": sigs,
        "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    }


def main() -> None:
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(os.environ["DUMP_DIR"], f"state-{rank}-{restart}.json"), "w") as f:
        json.dump(state(), f)
    print(f"probe rank {rank}", flush=True)
    how = os.environ.get("PROBE_HOW", "ok")
    if how == "record":
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def fail() -> None:
            raise RuntimeError(f"probe rank {rank} failed on purpose")

        fail()
    elif how == "hold":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(os.path.join(os.environ["DUMP_DIR"], f"hold-{rank}.pids"), "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(300)
    elif how == "train":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world = dist.get_world_size()
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


if __name__ == "__main__":
    main()
