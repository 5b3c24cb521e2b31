"""Imports nothing heavy: isolates the launcher. Records its start and exits 0."""

import time

T0 = time.time()

from _ev import emit  # noqa: E402

emit("start", T0)
