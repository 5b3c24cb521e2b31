"""Tokens from files and the environment, the same way for the server, its clients and agents.

``--token-file`` (else ``RDZV_TOKEN_FILE``) holds ``TOKEN`` or ``JOB_ID TOKEN`` lines
(``protocol.auth.TokenTable``); without a file, ``RDZV_TOKEN`` is the one token of every job.
The read token (``--read-token-file``) is a file of exactly one token. Every problem is a
``TokenFileError`` (a ``ValueError``) that names the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.auth import TokenTable

__all__ = ["TokenFileError", "job_token", "load_read_token", "load_tokens"]


class TokenFileError(ValueError):
    """A token file that cannot be read or used; the message names it."""


def _read(path: str, what: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise TokenFileError(f"cannot read the {what} {path!r}: {exc.strerror or exc}") from None


def load_tokens(path: str | None, environ: Mapping[str, str]) -> TokenTable | None:
    """``path`` (a --token-file), else RDZV_TOKEN_FILE, else RDZV_TOKEN; None: no token."""
    # Imported here: `rdzv-server status` without tokens need not load the protocol package.
    from protocol.auth import TokenTable

    path = path or environ.get("RDZV_TOKEN_FILE") or None
    if path is None:
        token = environ.get("RDZV_TOKEN")
        return TokenTable(default=token) if token else None
    text = _read(path, "token file")
    try:
        return TokenTable.parse(text, origin=f"token file {path!r}")
    except ValueError as exc:
        raise TokenFileError(str(exc)) from None


def job_token(path: str | None, environ: Mapping[str, str], job_id: str) -> str | None:
    """One job's token, as ``load_tokens`` finds it; a file without one for the job is an error
    (an agent must not join unauthenticated because of a typo in the job id)."""
    tokens = load_tokens(path, environ)
    if tokens is None:
        return None
    token = tokens.for_job(job_id)
    if token is None:
        where = path or environ.get("RDZV_TOKEN_FILE")
        raise TokenFileError(f"token file {where!r} has no token for job {job_id!r}")
    return token


def load_read_token(path: str) -> str:
    """--read-token-file: one token, alone on its line (comments and blank lines aside)."""
    text = _read(path, "read-token file")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise TokenFileError(f"read-token file {path!r}: want one token on one line")
    return lines[0]
