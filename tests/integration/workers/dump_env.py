"""Writes this worker's environment to $DUMP_DIR/env-<RANK>.json, then exits $EXIT_CODE (if this rank).

With $FAIL_AFTER_ALL_DUMPED the failing rank first waits (up to 30 s) until every rank of the
world has written its dump, so that a launcher stopping the others cannot race their dumps.
"""

import json
import os
import sys
import time

out = os.environ["DUMP_DIR"]
rank = os.environ.get("RANK", "x")
env = dict(os.environ)
env["_argv"] = json.dumps(sys.argv[1:])
env["_pid"] = str(os.getpid())
tmp = os.path.join(out, f".env-{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(env, f)
os.replace(tmp, os.path.join(out, f"env-{rank}.json"))
print(f"worker rank {rank} of {os.environ.get('WORLD_SIZE')} done", flush=True)
fail_rank = os.environ.get("FAIL_RANK")
if fail_rank is not None and fail_rank == rank:
    if os.environ.get("FAIL_AFTER_ALL_DUMPED"):
        world, deadline = int(os.environ["WORLD_SIZE"]), time.monotonic() + 30
        while (
            len([n for n in os.listdir(out) if n.startswith("env-")]) < world and time.monotonic() < deadline
        ):
            time.sleep(0.01)  # no event to await: the other ranks are separate processes
    print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("EXIT_CODE", "3")))
