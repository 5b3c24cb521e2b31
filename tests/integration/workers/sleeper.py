"""Writes "<rank> <world_size> <pid> <restart>" to $DUMP_DIR/started.txt, traps SIGTERM into
$DUMP_DIR/sigterm-<pid>, and sleeps until killed, $SLEEP_EXIT seconds pass, or the file
$EXIT_WHEN_FILE appears (then it exits 0)."""

import os
import signal
import sys
import time

out = os.environ["DUMP_DIR"]
pid = os.getpid()


def on_term(signum, frame):
    with open(os.path.join(out, f"sigterm-{pid}"), "w") as f:
        f.write(os.environ.get("RANK", "?"))
    if os.environ.get("IGNORE_TERM"):
        return
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
if os.environ.get("FAIL_ALWAYS"):
    print(f"rank {os.environ['RANK']} fails at once", file=sys.stderr, flush=True)
    sys.exit(1)
line = f"{os.environ['RANK']} {os.environ['WORLD_SIZE']} {pid} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n"
with open(os.path.join(out, "started.txt"), "a") as f:
    f.write(line)
print(f"started {line.strip()}", flush=True)
deadline = time.monotonic() + float(os.environ.get("SLEEP_EXIT", "120"))
stop_file = os.environ.get("EXIT_WHEN_FILE")
while time.monotonic() < deadline and not (stop_file and os.path.exists(stop_file)):
    time.sleep(0.05)
