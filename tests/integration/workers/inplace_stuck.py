"""A ``worker.run`` script whose rank 0 cannot leave its attempt (issue 44: the park's bound).

Each attempt appends "<rank> <pid> <restart>" to ``$DUMP_DIR/attempts``. In restart 0, rank 1
exits 1 once rank 0 is in its attempt; rank 0 blocks the park signal and sleeps (as a thread
stuck in the kernel or a C loop would: no handler runs), so the agent must stop and replace it.
In restart 1 both ranks return at once.
"""

import os
import signal
import time

from node_agent import worker
from node_agent.worker import place


def train() -> None:
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(os.environ["DUMP_DIR"], "attempts"), "a") as f:
        f.write(f"{rank} {os.getpid()} {restart}\n")
    if restart != "0":
        return
    if rank == "0":
        signal.pthread_sigmask(signal.SIG_BLOCK, {place.PARK_SIGNAL})
        open(os.path.join(os.environ["DUMP_DIR"], "stuck"), "w").close()
        time.sleep(120)
    else:
        while not os.path.exists(os.path.join(os.environ["DUMP_DIR"], "stuck")):
            time.sleep(0.01)
        os._exit(1)


if __name__ == "__main__":
    worker.run(train)
