"""``ServerConfig``: ``rdzv-server``'s flags and environment, checked once, before anything listens."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rdzv_server import cli
from rdzv_server.config import ConfigError, ServerConfig, build_config
from rdzv_server.parser import build_parser
from rdzv_server.service import AUTH_TIMEOUT, HELLO_TIMEOUT


def config(*argv: str, environ: dict[str, str] | None = None) -> ServerConfig:
    return build_config(build_parser().parse_args(list(argv)), environ or {})


def test_the_defaults_are_resolved() -> None:
    c = config()
    assert (c.host, c.port, c.log_level) == ("0.0.0.0", 29500, "INFO")
    assert c.tokens is None and c.read_token is None and c.tls is None and c.state_dir is None
    assert (c.hello_timeout, c.auth_timeout) == (HELLO_TIMEOUT, AUTH_TIMEOUT)
    assert c.state_min_free == 128 << 20 and c.http_hosts == ()


def test_flags_and_files_become_values(tmp_path: Path) -> None:
    tokens, reader = tmp_path / "tokens", tmp_path / "reader"
    tokens.write_text("shared\nj j-secret\n")
    reader.write_text("# the read token\nreader\n")
    c = config(
        "--host", "127.0.0.1", "--port", "0", "--token-file", str(tokens), "--read-token-file", str(reader),
        "--http-host", "a.example", "--http-host", "b.example", "--hello-timeout", "2.5",
        "--auth-timeout", "30", "--state-dir", str(tmp_path / "state"), "--state-min-free-mib", "0",
    )  # fmt: skip
    assert c.tokens is not None and c.tokens.for_job("j") == "j-secret" and c.tokens.for_job("x") == "shared"
    assert c.read_token == "reader" and c.http_hosts == ("a.example", "b.example")
    assert (c.hello_timeout, c.auth_timeout, c.state_min_free) == (2.5, 30.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.port = 1  # type: ignore[misc]


def test_tokens_come_from_the_environment_too(tmp_path: Path) -> None:
    c = config(environ={"RDZV_TOKEN": "from-env"})
    assert c.tokens is not None and c.tokens.for_job("any") == "from-env"
    f = tmp_path / "tokens"
    f.write_text("j from-file\n")
    c = config(environ={"RDZV_TOKEN_FILE": str(f), "RDZV_TOKEN": "ignored"})
    assert c.tokens is not None and c.tokens.for_job("j") == "from-file" and c.tokens.for_job("x") is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be 0..65535, got 70000"),
        (["--token-file", "/nonexistent/t"], "cannot read the token file '/nonexistent/t'"),
        (["--read-token-file", "READER"], "--read-token-file needs tokens (--token-file)"),
        (["--state-min-free-mib", "-1"], "--state-min-free-mib must be >= 0, got -1"),
        (["--metrics-jobs", "-1"], "--metrics-jobs must be in 0..10000, got -1"),
        (["--hello-timeout", "0"], "--hello-timeout must be in (0, 3600] seconds, got 0.0"),
        (["--tls-key", "k.pem"], "--tls-key needs --tls-cert: give both or neither"),
        (
            ["--tls-cert", "/nonexistent/c", "--tls-key", "k"],
            "cannot read the TLS certificate '/nonexistent/c'",
        ),
    ],
)
def test_bad_flags_are_usage_errors_that_say_why(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("RDZV_TOKEN", "RDZV_TOKEN_FILE"):  # cli.main reads the real environment
        monkeypatch.delenv(var, raising=False)
    reader = tmp_path / "reader"
    reader.write_text("reader\n")
    argv = [str(reader) if a == "READER" else a for a in argv]
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        config(*argv)
    assert cli.main(argv) == cli.EXIT_USAGE  # and nothing was started
    assert capsys.readouterr().err.startswith(f"rdzv-server: error: {message}")


def test_a_token_file_with_a_bad_line_names_it(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("a b c\n")
    with pytest.raises(
        ConfigError, match=re.escape(f"token file '{f}': line 1: expected TOKEN or 'JOB_ID TOKEN'")
    ):
        config("--token-file", str(f))
