"""A seeded chaos campaign against one elastic job (``chaos.py`` has the faults and invariants).

``CHAOS_SECONDS`` (default 60) bounds the campaign, ``CHAOS_SEED`` replays one (the seed is
printed at the start and in any failure), ``CHAOS_FAULTS`` narrows the fault kinds,
``CHAOS_REPORT`` writes the whole timeline to a file, ``CHAOS_KEEP=1`` keeps the temporary
directory of a failed campaign. A failure's message holds the seed and the whole timeline.
"""

from __future__ import annotations

import os

import pytest

from .chaos import FAULT_KINDS, Config, run_campaign

_SECONDS = float(os.environ.get("CHAOS_SECONDS", "60") or "60")


# Set-up (~2 s), the campaign, its last recovery (<= 20 s), the end (<= 60 s) and clean-up.
@pytest.mark.timeout(int(_SECONDS) + 240)
def test_seeded_chaos_campaign_keeps_every_invariant() -> None:
    cfg = Config.from_env()
    result = run_campaign(cfg)
    # The campaign did something: a minute holds a dozen episodes or more on two slow cores.
    if cfg.faults == frozenset(FAULT_KINDS):
        assert sum(result.counts.values()) >= min(3, int(cfg.seconds // 10)), result.summary
        if cfg.seconds >= 60:
            assert len(result.counts) >= 4, result.summary  # several kinds, not one over and over
