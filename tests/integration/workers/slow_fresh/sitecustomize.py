"""Widens the window the store race needs (tests/integration/test_store_restarts.py).

On PYTHONPATH, in every interpreter of the job: wherever stdin yields a ``fresh <n>`` line
(only the agent's store process reads such lines: node_agent/store/boot.py), it is handed on
SLOW_FRESH_S later, as if the hosting node learned of the new round that much after the
others. Another node's warm worker then connects while this node has not served the new store:
it must wait in the backlog, never reach the last round's store.
"""

import os
import sys
import time

_DELAY = float(os.environ.get("SLOW_FRESH_S", "0") or 0)


class _SlowFresh:
    def __init__(self, stream):  # type: ignore[no-untyped-def]
        self._stream = stream

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self

    def __next__(self) -> str:
        line = next(self._stream)
        if line.startswith("fresh "):
            time.sleep(_DELAY)
        return line

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._stream, name)


if _DELAY > 0 and sys.stdin is not None:
    sys.stdin = _SlowFresh(sys.stdin)
