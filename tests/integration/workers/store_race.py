"""One start of many back-to-back failures (issue 29): init_process_group, a checked
all_reduce, a record, then rank 0 fails at once so the next round starts while the last one
ends (after STORE_RACE_TRAIN_S of "training"); rank 1 waits to be stopped. Under --preload
torch the replacements are warm and connect to MASTER_PORT within milliseconds of the new
round: none may reach the old round's store.

Writes DUMP_DIR/race-<restart>-<rank>.json (init's seconds, the sum, the store mode); the
last start (STORE_RACE_STARTS - 1) ends every rank with 0.
"""

import json
import os
import sys
import time

warm = "torch" in sys.modules  # --preload torch: this worker is a warm interpreter

import torch  # noqa: E402 (after the warm check)
import torch.distributed as dist  # noqa: E402

rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
start = time.perf_counter()
dist.init_process_group("gloo", init_method="env://")
init_s = time.perf_counter() - start
t = torch.ones(1)
dist.all_reduce(t)
record = {"rank": rank, "restart": restart, "init_s": init_s, "sum": t.item(), "warm": warm}
record["use_agent_store"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
with open(os.path.join(os.environ["DUMP_DIR"], f"race-{restart}-{rank}.json"), "w") as f:
    json.dump(record, f)
dist.barrier()  # every rank wrote its record before rank 0 fails
# "Training" long enough for the agents to warm the next interpreters (an import of torch in
# the background), so that the replacements start warm, at once, as on a real job.
time.sleep(float(os.environ.get("STORE_RACE_TRAIN_S", "0")))
if restart >= int(os.environ["STORE_RACE_STARTS"]) - 1:
    os._exit(0)
if rank == 0:
    os._exit(1)
time.sleep(60)  # stopped by the agent once rank 0's failure restarts the round
os._exit(0)
