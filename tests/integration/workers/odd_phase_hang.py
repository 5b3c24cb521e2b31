"""Two local ranks, no collectives: local rank 0 reports a step every 20 ms inside a phase whose
name holds a tab ("load\\tdata"); local rank 1 reports 10 steps, then sleeps for ever (a hang).
"""

import os
import time

from node_agent import worker


def stuck_outside_any_collective() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    step = 0
    if local_rank == 1:
        for step in range(10):
            worker.progress(step)
            time.sleep(0.02)
        stuck_outside_any_collective()
    with worker.phase("load\tdata"):
        while True:
            worker.progress(step)
            step += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
