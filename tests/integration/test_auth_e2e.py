"""Tokens end to end: the right token runs the job, a wrong or missing one is refused."""

from __future__ import annotations

from pathlib import Path

from .procs import WORKERS, Proc, agent_cmd, read_env_dumps, start_server

DUMP = str(WORKERS / "dump_env.py")


def test_tokens_gate_the_job(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secure-job s3cret\n")
    srv, port = start_server("--token-file", str(tokens))
    common = ("--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "secure-job")
    out = tmp_path / "out"
    out.mkdir()
    try:
        ok = Proc(agent_cmd(*common, DUMP), env={"DUMP_DIR": str(out), "RDZV_TOKEN": "s3cret"})
        assert ok.wait(timeout=60) == 0, ok.stderr
        assert len(read_env_dumps(out)) == 1
        # The token never reaches a worker (nor its children, nor a crash dump of its env).
        assert all("s3cret" not in v for v in read_env_dumps(out)[0].values())
        wrong = Proc(agent_cmd(*common, DUMP), env={"DUMP_DIR": str(out), "RDZV_TOKEN": "guess"})
        assert wrong.wait(timeout=60) == 1
        assert "wrong token for job 'secure-job'" in wrong.stderr
        none = Proc(agent_cmd(*common, DUMP), env={"DUMP_DIR": str(out)})
        assert none.wait(timeout=60) == 1
        assert "requires a token" in none.stderr
    finally:
        srv.kill()
    assert "refused" in srv.stderr
