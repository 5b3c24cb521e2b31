"""node_agent/snapshots/replica_tls.py: the replica server's ephemeral certificate, made with the
real ``openssl`` command (an EC P-256 key, a few days' validity, 0600 files in a 0700 folder,
removed once loaded), and every way making it fails as ReplicaTLSError. That a pinning client
accepts exactly this certificate is test_channel.py's (TLS section)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import ssl
import sys
from pathlib import Path

import pytest

from node_agent.snapshots.replica_tls import (
    DAYS,
    ReplicaTLSError,
    cert_sha256,
    client_context,
    make_server_tls,
)

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="no openssl command here")


def _script(path: Path, body: str) -> str:
    """An executable Python script standing in for ``openssl``."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o700)
    return str(path)


@needs_openssl
def test_a_certificate_is_made_private_loaded_and_removed(tmp_path: Path) -> None:
    """A stand-in runs the real openssl, then records what it left: the modes, and the
    certificate's key type, validity and fingerprint."""
    folder, log = tmp_path / "private", tmp_path / "log.json"
    folder.mkdir(mode=0o700)
    spy = _script(
        tmp_path / "openssl",
        f"""
import hashlib, json, os, ssl, subprocess, sys
args = sys.argv[1:]
done = subprocess.run([{OPENSSL!r}, *args])
key, cert = args[args.index("-keyout") + 1], args[args.index("-out") + 1]
show = [{OPENSSL!r}, "x509", "-noout", "-text", "-in", cert]
text = subprocess.run(show, capture_output=True, text=True).stdout
der = ssl.PEM_cert_to_DER_cert(open(cert).read())
modes = {{p: oct(os.stat(p).st_mode & 0o777) for p in (key, cert, os.path.dirname(key))}}
json.dump({{"modes": modes, "text": text, "sha": hashlib.sha256(der).hexdigest()}}, open({str(log)!r}, "w"))
sys.exit(done.returncode)
""",
    )
    tls = make_server_tls(folder, openssl=spy)
    seen = json.loads(log.read_text())
    assert sorted(seen["modes"].values()) == ["0o600", "0o600", "0o700"]
    assert "prime256v1" in seen["text"] or "P-256" in seen["text"]
    assert "Not After" in seen["text"] and tls.cert_sha256 == seen["sha"]
    assert re.fullmatch("[0-9a-f]{64}", tls.cert_sha256)
    assert list(folder.iterdir()) == []  # the key lives on in the context only
    assert isinstance(tls.context, ssl.SSLContext) and tls.context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert DAYS >= 2


@needs_openssl
def test_each_certificate_is_new(tmp_path: Path) -> None:
    assert make_server_tls(tmp_path).cert_sha256 != make_server_tls(tmp_path).cert_sha256
    assert list(tmp_path.iterdir()) == []


def test_no_openssl_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ReplicaTLSError, match="no openssl command on PATH"):
        make_server_tls(tmp_path)
    with pytest.raises(ReplicaTLSError, match="cannot run"):
        make_server_tls(tmp_path, openssl=str(tmp_path / "missing" / "openssl"))
    assert list(tmp_path.iterdir()) == []


def test_openssl_that_fails_or_writes_garbage(tmp_path: Path) -> None:
    work = tmp_path / "private"
    work.mkdir()
    failing = _script(
        tmp_path / "failing", "import sys\nprint('req: unknown option', file=sys.stderr)\nsys.exit(3)\n"
    )
    with pytest.raises(ReplicaTLSError, match=r"could not make .*unknown option"):
        make_server_tls(work, openssl=failing)
    garbage = _script(
        tmp_path / "garbage",
        "import sys\na = sys.argv\nopen(a[a.index('-out') + 1], 'w').write('not a certificate')\n",
    )
    with pytest.raises(ReplicaTLSError, match="cannot be used"):
        make_server_tls(work, openssl=garbage)
    assert list(work.iterdir()) == []  # nothing left behind, even a failed key
    with pytest.raises(ReplicaTLSError, match="private folder"):
        make_server_tls(tmp_path / "no such folder", openssl=failing)


def test_the_client_context_pins_instead_of_verifying() -> None:
    ctx = client_context()
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert client_context() is ctx
    assert cert_sha256(b"der") == hashlib.sha256(b"der").hexdigest()
