"""The tier lists in tests/conftest.py name real files, and every test lands in exactly one tier."""

from __future__ import annotations

from tests.conftest import E2E_TOP, GROUPS, HERE, PROC, SOAK, tier_of


def test_every_listed_file_exists() -> None:
    """A renamed test file must not fall silently into another tier."""
    missing = sorted(rel for rel in PROC | SOAK | E2E_TOP | set(GROUPS) if not (HERE / rel).is_file())
    assert missing == []


def test_tiers_by_place() -> None:
    assert tier_of("protocol/test_codec.py") == "unit"
    assert tier_of("node_agent/supervisor/test_supervisor.py") == "proc"
    assert tier_of("integration/test_dropin.py") == "e2e"
    assert tier_of("test_fresh_install.py") == "e2e"
    assert tier_of("integration/test_chaos.py") == "soak"
