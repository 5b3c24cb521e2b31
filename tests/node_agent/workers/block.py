"""A worker that sets itself up as told, prints "ready <pid>" on stdout, then blocks (or exits).

--trap FILE      on SIGTERM write "SIGTERM" to FILE and exit 7
--ignore-term    ignore SIGTERM (only SIGKILL ends it)
--child KIND     start a `sleep 1000` grandchild: "plain" (in our process group),
                 "ignore-term" (in our group, ignores SIGTERM), "escape" (its own session,
                 holding our stdout); may repeat
--pidfile FILE   write "<pid> <child pid>..." to FILE before announcing ready
--exit CODE      exit with CODE right after announcing ready instead of blocking
"""

import argparse
import os
import signal
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("--trap")
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--child", action="append", default=[])
p.add_argument("--pidfile")
p.add_argument("--exit", type=int)
args = p.parse_args()

if args.trap:

    def on_term(signum, frame):
        with open(args.trap, "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

children = []
for kind in args.child:
    if kind == "plain":
        cmd, session = ["sleep", "1000"], False
    elif kind == "ignore-term":
        cmd, session = ["sh", "-c", "trap '' TERM; exec sleep 1000"], False
    elif kind == "escape":
        cmd, session = ["sleep", "1000"], True
    else:
        raise SystemExit(f"unknown child kind {kind}")
    children.append(subprocess.Popen(cmd, start_new_session=session))

if args.pidfile:
    with open(args.pidfile + ".tmp", "w") as f:
        f.write(" ".join(str(pid) for pid in [os.getpid(), *(c.pid for c in children)]))
    os.rename(args.pidfile + ".tmp", args.pidfile)

print(f"ready {os.getpid()}", flush=True)
if args.exit is not None:
    os._exit(args.exit)  # leave the children behind, as a crashing worker would
while True:
    signal.pause()
