"""Fails on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0) when RANK == FAIL_RANK.

Each start appends a line "<rank> <restart_count> <pid>" to $DUMP_DIR/attempts.txt.
"""

import os
import sys

rank = os.environ["RANK"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(os.environ["DUMP_DIR"], "attempts.txt"), "a") as f:
    f.write(f"{rank} {restart} {os.getpid()}\n")
if restart == "0" and rank == os.environ.get("FAIL_RANK", "0"):
    print(f"rank {rank} fails on attempt {restart}", file=sys.stderr, flush=True)
    sys.exit(1)
print(f"rank {rank} ok on attempt {restart}", flush=True)
