"""A gloo all_reduce every 0.5 s, so a lost peer surfaces as a failing collective (exit 1)."""

import time

T0 = time.time()

import datetime  # noqa: E402
import os  # noqa: E402

from _ev import emit  # noqa: E402

emit("start", T0)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
emit("ready")
deadline = time.monotonic() + float(os.environ.get("BENCH_IDLE_CAP", "120"))
x = torch.ones(1)
while time.monotonic() < deadline:
    try:
        dist.all_reduce(x)
    except Exception as exc:  # a dead peer: gloo's "Connection closed by peer"
        emit("collective_error", error=type(exc).__name__)
        os._exit(1)
    time.sleep(0.5)
dist.destroy_process_group()
