"""import torch, init_process_group("gloo"), one all_reduce: ``ready``; then what BENCH_MODE says.

- ``once``: exit 0.
- ``fail`` (the default): on the first attempt rank 0 exits 1 as soon as the file BENCH_GO
  exists (the driver creates it once the state it wants is reached: every rank ready, warm
  interpreters idle); the other ranks idle until their launcher stops them.
- ``loop``: an all_reduce every BENCH_STEP s (0.1); a failing collective (a lost peer) exits 1.

A replacement (the marker file BENCH_MARKER exists at its start, as in fail_once.py: torchrun
leaves TORCHELASTIC_RESTART_COUNT at 0 on a node that did not fail) exits 0 a moment after
its ``ready``, so the job ends.
"""

import time

T0 = time.time()

import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from _ev import emit, idle  # noqa: E402

marker = os.environ["BENCH_MARKER"]
replacement = os.path.exists(marker)
emit("start", T0, replacement=replacement)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

emit("imported")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
emit("init_done")
x = torch.ones(1)
dist.all_reduce(x)
emit("ready", value=float(x.item()), replacement=replacement)
mode = os.environ.get("BENCH_MODE", "fail")
if replacement or mode == "once":
    time.sleep(0.3 if replacement else 0.0)
    dist.destroy_process_group()
    sys.exit(0)
cap = time.monotonic() + float(os.environ.get("BENCH_IDLE_CAP", "120"))
if mode == "loop":
    step = float(os.environ.get("BENCH_STEP", "0.1"))
    while time.monotonic() < cap:
        time.sleep(step)
        try:
            dist.all_reduce(x)
        except Exception as exc:  # a dead peer: gloo's "Connection closed by peer"
            emit("collective_error", error=type(exc).__name__)
            os._exit(1)
elif os.environ.get("RANK") == "0":
    go = os.environ["BENCH_GO"]
    while not os.path.exists(go) and time.monotonic() < cap:
        time.sleep(0.005)
    with open(marker, "w") as f:
        f.write("failed once\n")
    emit("fail")
    os._exit(1)
else:
    idle(60.0)
