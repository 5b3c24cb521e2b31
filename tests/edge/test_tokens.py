"""edge.tokens: the one way the server, its clients and agents find their tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge.tokens import TokenFileError, job_token, load_read_token, load_tokens


def test_a_file_then_its_variable_then_the_token_variable(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# comment\n\nshared\nj j-secret\n")
    env = {"RDZV_TOKEN_FILE": "/nonexistent", "RDZV_TOKEN": "plain"}
    table = load_tokens(str(f), env)  # the flag wins over both variables
    assert table is not None and table.for_job("j") == "j-secret" and table.for_job("x") == "shared"
    table = load_tokens(None, {"RDZV_TOKEN_FILE": str(f), "RDZV_TOKEN": "plain"})
    assert table is not None and table.for_job("j") == "j-secret"
    table = load_tokens(None, {"RDZV_TOKEN": "plain"})
    assert table is not None and table.for_job("any") == "plain"
    assert load_tokens(None, {}) is None and load_tokens(None, {"RDZV_TOKEN": ""}) is None


def test_problems_name_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(TokenFileError, match=re.escape(f"cannot read the token file '{missing}'")):
        load_tokens(None, {"RDZV_TOKEN_FILE": missing})
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(TokenFileError, match=re.escape(f"token file '{empty}': holds no token")):
        load_tokens(str(empty), {})


def test_an_agents_job_must_have_a_token_in_its_file(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("other o\n")
    assert job_token(None, {"RDZV_TOKEN": "t"}, "j") == "t"
    assert job_token(None, {}, "j") is None
    assert job_token(str(f), {}, "other") == "o"
    for path, env in ((str(f), {}), (None, {"RDZV_TOKEN_FILE": str(f)})):
        with pytest.raises(TokenFileError, match=re.escape(f"token file '{f}' has no token for job 'j'")):
            job_token(path, env, "j")


def test_the_read_token_is_one_token_on_one_line(tmp_path: Path) -> None:
    f = tmp_path / "reader"
    f.write_text("# who may read\n reader \n")
    assert load_read_token(str(f)) == "reader"
    for bad in ("a\nb\n", "a b\n", "# none\n"):
        f.write_text(bad)
        with pytest.raises(TokenFileError, match="want one token on one line"):
            load_read_token(str(f))
    with pytest.raises(TokenFileError, match="cannot read the read-token file"):
        load_read_token(str(tmp_path / "missing"))
