"""Prints "hold: rank R of W started (restart N)", then runs until $RELEASE_FILE exists and
exits 0; exits 3 if it is not released within $HOLD_TIMEOUT seconds (default 60).

A test holds the job open for exactly as long as it needs (a fuzz campaign against the
server) instead of guessing a duration."""

import os
import sys
import time

release = os.environ["RELEASE_FILE"]
rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"hold: rank {rank} of {world} started (restart {restart})", flush=True)
deadline = time.monotonic() + float(os.environ.get("HOLD_TIMEOUT", "60"))
while not os.path.exists(release):
    if time.monotonic() > deadline:
        print(f"hold: rank {rank} was never released", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(0.02)  # no event to wait on: the release is a file another process makes
print(f"hold: rank {rank} released", flush=True)
