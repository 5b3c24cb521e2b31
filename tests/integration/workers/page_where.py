"""Reports progress once, prints "page: <its progress page's path>", then holds until
$RELEASE_FILE exists (exits 3 past $HOLD_TIMEOUT, default 60 s)."""

import os
import sys
import time

from node_agent import worker

worker.progress(1)
print(f"page: {os.environ['NODE_AGENT_PROGRESS_PAGE']}", flush=True)
deadline = time.monotonic() + float(os.environ.get("HOLD_TIMEOUT", "60"))
while not os.path.exists(os.environ["RELEASE_FILE"]):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.02)  # no event to wait on: the release is a file another process makes
