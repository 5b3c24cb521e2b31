"""A rank asked for its stacks through its whole life once armed, its exit included (issue 48).

It imports torch (whose teardown keeps the process alive for many milliseconds after the
interpreter's finalization let faulthandler's signal go), arms its stack signal with one
``worker.progress(0)``, writes ``$STACKS_DIR/armed-<restart>-<rank>`` (its pid) and waits for
``$STACKS_DIR/go-<restart>``; then it exits 1 on the first attempt (a restart follows) and 0 on
the next.
"""

import os
import sys
import time

import torch  # noqa: F401  (its libraries' teardown is the window)

from node_agent import worker

out = os.environ["STACKS_DIR"]
rank = os.environ["RANK"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
worker.progress(0)  # attached: the page says the stack signal is armed
path = os.path.join(out, f"armed-{restart}-{rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, f"go-{restart}")):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.01)
sys.exit(1 if restart == "0" else 0)
