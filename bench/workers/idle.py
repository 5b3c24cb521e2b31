"""Records its start (with WORLD_SIZE) and idles until stopped: supervision and scale-up cases."""

import time

T0 = time.time()

import os  # noqa: E402

from _ev import emit, idle  # noqa: E402

emit("start", T0)
idle(float(os.environ.get("BENCH_IDLE_CAP", "120")))
