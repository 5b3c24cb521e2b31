"""Rank 0 fails once, BENCH_FAIL_AFTER s after it starts; its replacement and the others run on.

Whether this start is a replacement is decided by a marker file, not by
TORCHELASTIC_RESTART_COUNT: torchrun leaves the count at 0 on the node that did not fail.
A replacement exits 0 after a moment, so the job ends; a first-attempt survivor idles until
its launcher stops it.
"""

import time

T0 = time.time()

import os  # noqa: E402

from _ev import emit, idle  # noqa: E402

marker = os.environ["BENCH_MARKER"]
replacement = os.path.exists(marker)
emit("start", T0, replacement=replacement)
if replacement:
    time.sleep(0.3)
elif os.environ.get("RANK") == "0":
    time.sleep(float(os.environ.get("BENCH_FAIL_AFTER", "1.0")))
    with open(marker, "w") as f:
        f.write("failed once\n")
    emit("fail")
    os._exit(1)
else:
    idle(60.0)
