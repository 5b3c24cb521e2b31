"""How long init_process_group("env://") takes inside a worker, one start of many (issue 21).

Writes DUMP_DIR/init-<restart>-<rank>.json: whether the store accepted a connection when the
rank arrived, the seconds init_process_group took (and when it began and ended, by the wall
clock), the store mode the agent gave
(TORCHELASTIC_USE_AGENT_STORE) and a checked all_reduce; then fails on purpose until the
restart count reaches INIT_TIMING_STARTS - 1, so that one job with --max-restarts is that many
starts. Under an interpreter without torch (the fallback), it records the store mode and, as
rank 0, binds MASTER_PORT the way torch's store would: the agent must have left the port to it.
"""

import json
import os
import socket
import time

rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {"rank": rank, "restart": restart, "use_agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}
try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = None

if torch is None:
    if rank == 0:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", int(os.environ["MASTER_PORT"])))  # raises if the agent still holds it
        record["bound_master_port"] = True
else:
    # Is the store listening when this rank arrives? Then torch's first connect succeeds and
    # no rank sleeps in its connect retry (a refused connect is the only way into it).
    try:
        with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5):
            record["store_listening"] = True
    except OSError as exc:
        record["store_listening"] = repr(exc)
    # Wall clock too: a start's ranks run on one machine here, so their times compare.
    record["init_start"], start = time.time(), time.perf_counter()
    dist.init_process_group("gloo", init_method="env://")
    record["init_s"], record["init_end"] = time.perf_counter() - start, time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    record["sum"], record["world"] = t.item(), dist.get_world_size()

with open(os.path.join(os.environ["DUMP_DIR"], f"init-{restart}-{rank}.json"), "w") as f:
    json.dump(record, f)
if torch is not None:
    dist.barrier()  # every rank wrote its record before any fails
last = int(os.environ.get("INIT_TIMING_STARTS", "1")) - 1
# No teardown: gloo can abort when ranks leave at different times (see gloo_check.py).
os._exit(0 if restart >= last else 1)
