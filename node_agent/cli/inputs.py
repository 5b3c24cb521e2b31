"""The raw value of each flag and where it came from (command line, ``PET_*``, default), and
the readers that turn one into a checked value whose error names what the user wrote."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Literal, overload

from protocol.records import record

from ..config import (
    ConfigError,
    StdSpec,
    parse_float,
    parse_int,
    parse_size,
)
from .flags import BY_DEST, SWITCH, Flag


@record(frozen=True)
class Given:
    value: str | None
    origin: str | None  # "--flag" or "PET_X"; None when the default applies

    def what(self, flag: Flag) -> str:
        return self.origin or flag.display


class Inputs:
    """The raw value of every flag and where it came from: command line, PET_*, or default."""

    def __init__(self, namespace: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._ns = vars(namespace)
        self._env = environ

    def get(self, dest: str) -> Given:
        flag = BY_DEST[dest]
        if dest in self._ns:
            value = self._ns[dest]
            return Given("1" if flag.kind == SWITCH else value, flag.display)
        if flag.env and flag.env_name in self._env:
            return Given(self._env[flag.env_name], flag.env_name)
        return Given(flag.default, None)

    def switch(self, dest: str) -> bool:
        given = self.get(dest)
        if given.origin is None:
            return False
        if given.origin.startswith("PET_"):
            # torchrun: bool(int(PET_X)); anything but an integer fails there too
            try:
                return int(given.value or "") != 0
            except ValueError:
                raise ConfigError(
                    f"{given.origin}={given.value!r}: expected an integer (0 = off, non-zero = on)"
                ) from None
        return True

    def text(self, dest: str) -> str:
        value = self.get(dest).value
        return "" if value is None else value

    def given(self, dest: str) -> bool:
        return self.get(dest).origin is not None


# --- single values --------------------------------------------------------------------------


def read_int(inputs: Inputs, dest: str, *, minimum: int) -> int:
    given = inputs.get(dest)
    what = given.what(BY_DEST[dest])
    value = parse_int(given.value or "", what=what)
    if value < minimum:
        raise ConfigError(f"{what}={given.value!r} must be >= {minimum}")
    return value


def read_size(inputs: Inputs, dest: str, *, auto: bool) -> int | None:
    """A byte count (K, M, G, T suffixes); None for "auto" where ``auto`` allows it."""
    given = inputs.get(dest)
    text = (given.value or "").strip()
    if auto and text.lower() == "auto":
        return None
    return parse_size(text, what=given.what(BY_DEST[dest]))


def read_seconds(inputs: Inputs, dest: str, *, positive: bool) -> float:
    given = inputs.get(dest)
    what = given.what(BY_DEST[dest])
    value = parse_float(given.value or "", what=what)
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{what}={given.value!r} must be {'> 0' if positive else '>= 0'} seconds")
    return value


def read_port(inputs: Inputs, dest: str) -> int | None:
    given = inputs.get(dest)
    if given.value is None:
        return None
    what = given.what(BY_DEST[dest])
    port = parse_int(given.value, what=what)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what}={given.value!r}: a port must be in 1..65535")
    return port


@overload
def read_choice(
    inputs: Inputs, dest: str, choices: Sequence[str], *, optional: Literal[False] = ...
) -> str: ...
@overload
def read_choice(inputs: Inputs, dest: str, choices: Sequence[str], *, optional: bool) -> str | None: ...


def read_choice(inputs: Inputs, dest: str, choices: Sequence[str], *, optional: bool = False) -> str | None:
    given = inputs.get(dest)
    if given.value is None and optional:
        return None
    if given.value not in choices:
        what = given.what(BY_DEST[dest])
        raise ConfigError(f"{what}={given.value!r} is not valid: use one of {', '.join(choices)}")
    return given.value


def _folder(inputs: Inputs, dest: str) -> str | None:
    """A directory flag's value (None: not given, or empty); never an existing file."""
    given = inputs.get(dest)
    if not given.value:
        return None
    if os.path.exists(given.value) and not os.path.isdir(given.value):
        raise ConfigError(f"{given.what(BY_DEST[dest])}={given.value!r} is a file, not a directory")
    return given.value


def read_log_dir(inputs: Inputs) -> str | None:
    return _folder(inputs, "log_dir")  # torchrun: an empty value also means a fresh temporary one


def read_outcome_dir(inputs: Inputs) -> str | None:
    """--outcome-dir: an absolute path; not a file (the agent makes the folder at its end)."""
    folder = _folder(inputs, "outcome_dir")
    return None if folder is None else os.path.abspath(folder)


def read_snapshot_dir(inputs: Inputs, snapshot_memory: int | None) -> str | None:
    """--snapshot-dir: an absolute path (the agent makes it, private, at start); it persists
    in-memory snapshots, so it needs them on; a directory every user may write, or a symlink,
    is refused (snapshots/durable.py ``refuse_root``)."""
    folder = _folder(inputs, "snapshot_dir")
    if folder is None:
        return None
    given = inputs.get("snapshot_dir")
    what = given.what(BY_DEST["snapshot_dir"])
    if snapshot_memory == 0:
        raise ConfigError(
            f"{what}={given.value!r} persists in-memory snapshots, which --snapshot-memory 0 turns off"
        )
    path = os.path.abspath(folder)
    from ..snapshots.durable import refuse_root  # only with --snapshot-dir

    why = refuse_root(path)
    if why:
        raise ConfigError(f"{what}={given.value!r} {why}")
    return path


def read_std(inputs: Inputs, dest: str) -> StdSpec:
    given = inputs.get(dest)
    return StdSpec.parse(given.value or "", origin=given.what(BY_DEST[dest]))


def read_filters(text: str) -> tuple[str, ...]:
    """torchrun's comma list with ',,' for a literal comma.

    Empty items are dropped: torchrun would keep "" (from "" or a trailing comma), which
    matches every line and so duplicates the whole stream; nobody means that.
    """
    placeholder = "\0"
    items = text.replace(",,", placeholder).split(",")
    return tuple(item.replace(placeholder, ",") for item in items if item)
