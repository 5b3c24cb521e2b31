"""Reports progress up to step $STUCK_STEP, then fails (exit 1), on every attempt: a crash loop."""

import os
import sys

from node_agent import worker

for step in range(int(os.environ.get("STUCK_STEP", "5")) + 1):
    worker.progress(step)
print(
    f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} failing at step {step}", file=sys.stderr, flush=True
)
sys.exit(1)
