"""Prints the descriptors this worker was started with (not the listing's own): "FDS 0,1,2"."""

import os

fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
mine = [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]  # the listing's fd is gone now
# One write: two ranks share the launcher's stdout, and print() under PYTHONUNBUFFERED writes
# the text and its newline separately.
os.write(1, ("FDS " + ",".join(str(fd) for fd in mine) + "\n").encode())
