"""``--version`` for both programs: the installed distribution's version, read only when asked.

The version lives in one place, ``pyproject.toml``; a wheel or editable install records it in
the distribution's metadata, which ``importlib.metadata`` reads. That import costs a few
milliseconds, so the argparse action looks it up only when ``--version`` is on the line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["DISTRIBUTION", "VersionAction", "installed_version"]

DISTRIBUTION = "elastic-launch"


def installed_version() -> str:
    """The installed version, or ``unknown`` when run from a tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """``--version``: print ``<prog> <version>`` and exit 0, as argparse's own action does."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        kw.setdefault("help", "print the installed version and exit")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(f"{parser.prog} {installed_version()}\n")
        sys.stdout.flush()
        parser.exit(0)
