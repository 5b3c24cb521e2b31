"""The one training script of the wrapper tests (tests/integration/test_wrappers.py): what
``accelerate launch``, ``fabric run`` and TorchX's ``dist.ddp`` start, and, copied as
``recipe.py``, the tiny torchtune recipe ``tune run`` starts (``--config`` is read and
ignored).

The mode is the first argument that names one:

* ``ok``: one gloo all-reduce over the job; prints ``result {json}``: what the worker sees
  (its ranks, the world size, OMP_NUM_THREADS) and the sum;
* ``env``: the same line without torch (no sum), where a wrapper's store path is already
  trained over by another test;
* ``fail``: rank 1 exits with 3, without a word or an error file;
* ``raise``: rank 1 raises ValueError under torch's ``@record`` (its error file is the root
  cause a scheduler shows);
* ``hang``: touches ``$READY_DIR/<rank>`` and sleeps, for the signal tests;
* ``stop``: rank 0 sends SIGTERM to its launcher (its parent), and every rank sleeps.

Only ``ok`` and ``raise``'s rank 1 import torch: the others cost a worker some 30 ms.
"""

import json
import os
import sys
import time

MODES = ("ok", "env", "fail", "raise", "hang", "stop")
mode = next((arg for arg in sys.argv[1:] if arg in MODES), "ok")
rank = int(os.environ["RANK"])

seen = {
    "rank": rank,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}
if mode == "ok":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen["sum"] = total.item()
    dist.destroy_process_group()
if mode in ("ok", "env"):
    print("result " + json.dumps(seen, sort_keys=True), flush=True)
elif mode == "fail":
    sys.exit(3 if rank == 1 else 0)
elif mode == "raise" and rank == 1:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        raise ValueError("rank one is broken")

    main()
elif mode == "hang":
    with open(os.path.join(os.environ["READY_DIR"], str(rank)), "w"):
        pass
    time.sleep(120)
elif mode == "stop":
    if rank == 0:
        os.kill(os.getppid(), 15)
    time.sleep(120)
