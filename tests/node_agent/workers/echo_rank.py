"""Print one LOCAL_RANK-specific line on each stream, then exit with argv[1] (default 0)."""

import os
import sys

rank = os.environ["LOCAL_RANK"]
print(f"out from rank {rank}")
print(f"err from rank {rank}", file=sys.stderr)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
