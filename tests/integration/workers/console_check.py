"""A worker for the console tests: what a person at the launcher's terminal sees of it.

info     print what stdout and stderr are ("tty" and the terminal's size, or "not a tty")
partial  write "prompt> " to stdout and "progress 1/3\r" to stderr, no newline, then wait for a
         line on stdin (the launcher's, inherited); then finish both lines and exit 0
fail     write lines to stderr (the first says whether stderr is a tty) and exit 3
"""

import os
import sys


def what(fd: int) -> str:
    if not os.isatty(fd):
        return "not a tty"
    size = os.get_terminal_size(fd)
    return f"tty {size.columns}x{size.lines}"


mode = sys.argv[1]
if mode == "info":
    print(f"stdout: {what(1)}; stderr: {what(2)}", flush=True)
elif mode == "partial":
    sys.stdout.write("prompt> ")
    sys.stdout.flush()
    sys.stderr.write("progress 1/3\r")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip()
    sys.stdout.write(f"answered {answer}\n")
    sys.stdout.flush()
    sys.stderr.write("progress 3/3\n")
elif mode == "fail":
    sys.stderr.write(f"stderr is a tty: {sys.stderr.isatty()}\n")
    for i in range(3):
        sys.stderr.write(f"detail {i}\n")
    sys.stderr.write("fatal: boom\n")
    sys.exit(3)
else:
    raise SystemExit(f"unknown mode {mode!r}")
