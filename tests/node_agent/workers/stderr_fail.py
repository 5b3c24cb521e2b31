"""Write 30 numbered lines to stderr, then exit 2: its failure message is the stderr tail."""

import sys

for i in range(30):
    print(f"stderr line {i}", file=sys.stderr)
sys.exit(2)
