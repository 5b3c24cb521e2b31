"""Says where it may run: each worker writes its CPU affinity (and that of a thread it starts,
and under --preload affinity_at_import the one its interpreter had at that import) to
DUMP_DIR/affinity-<local rank>-<restart>.json; with PROBE_FAIL_FIRST=1 the first attempt's
rank 0 then fails, so that the agent restarts the workers."""

import json
import os
import sys
import threading

seen: dict[str, object] = {}


def _thread() -> None:
    seen["thread"] = sorted(os.sched_getaffinity(0))


t = threading.Thread(target=_thread)
t.start()
t.join()
local_rank = os.environ["LOCAL_RANK"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
state = {"main": sorted(os.sched_getaffinity(0)), **seen, "argv0": sys.argv[0]}
preloaded = sys.modules.get("affinity_at_import")  # --preload affinity_at_import
if preloaded is not None:
    state["at_import"] = preloaded.CPUS
path = os.path.join(os.environ["DUMP_DIR"], f"affinity-{local_rank}-{restart}.json")
with open(path, "w") as f:
    json.dump(state, f)
print(f"affinity probe local_rank {local_rank} restart {restart}: {state['main']}", flush=True)
if os.environ.get("PROBE_FAIL_FIRST") == "1" and restart == "0" and local_rank == "0":
    sys.exit(3)
