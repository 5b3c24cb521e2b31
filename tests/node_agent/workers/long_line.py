"""Write argv[1] bytes of a repeating pattern to stdout with no newline at all, then exit 0."""

import sys

n = int(sys.argv[1])
pattern = b"0123456789abcdef"
data = (pattern * (n // len(pattern) + 1))[:n]
sys.stdout.buffer.write(data)
sys.stdout.buffer.flush()
