"""edge.tls: contexts for both ends, and a TLSConfigError that names the file at fault."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from edge.tls import ClientFiles, TLSConfigError, client_context, client_files, server_context
from tests.pki import OPENSSL, Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_contexts(pki: Pki) -> None:
    srv = server_context(str(pki.server_cert), str(pki.server_key))
    assert srv.verify_mode == ssl.CERT_NONE
    assert srv.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert server_context(str(pki.server_cert), str(pki.server_key), str(pki.ca)).verify_mode == (
        ssl.CERT_OPTIONAL
    )
    cli = client_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    assert cli.check_hostname and cli.verify_mode == ssl.CERT_REQUIRED
    assert cli.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_only_the_given_ca_is_trusted(pki: Pki) -> None:
    # Not the system's CAs as well: a public CA must not vouch for our server or our agents.
    for ctx in (
        client_context(str(pki.ca)),
        server_context(str(pki.server_cert), str(pki.server_key), str(pki.ca)),
    ):
        assert [dict(x[0] for x in c["subject"])["commonName"] for c in ctx.get_ca_certs()] == ["test-ca"]
    assert server_context(str(pki.server_cert), str(pki.server_key)).get_ca_certs() == []


def test_each_bad_file_is_named(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TLSConfigError, match=f"cannot read the TLS certificate '{missing}'"):
        server_context(missing, str(pki.server_key))
    with pytest.raises(TLSConfigError, match=f"the TLS key '{pki.server_cert}' is not PEM"):
        server_context(str(pki.server_cert), str(pki.server_cert))
    with pytest.raises(TLSConfigError, match=f"the TLS CA file '{pki.server_key}' is not PEM"):
        client_context(str(pki.server_key))
    with pytest.raises(TLSConfigError, match="does the key belong to the certificate"):
        server_context(str(pki.server_cert), str(pki.client_key))
    with pytest.raises(TLSConfigError, match="needs both"):
        client_context(str(pki.ca), str(pki.client_cert), None)


def test_an_encrypted_key_is_refused_without_a_prompt(pki: Pki, tmp_path: Path) -> None:
    locked = tmp_path / "locked.key"
    subprocess.run(
        [
            OPENSSL,
            "pkey",
            "-in",
            str(pki.server_key),
            "-aes256",
            "-passout",
            "pass:secret",
            "-out",
            str(locked),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    with pytest.raises(TLSConfigError, match=f"the TLS key '{locked}' is encrypted"):
        server_context(str(pki.server_cert), str(locked))


def test_the_pki_helper_needs_only_openssl() -> None:
    assert shutil.which(OPENSSL) or Path(OPENSSL).exists()


def test_client_files_come_from_flags_else_the_environment() -> None:
    flags = {"ca": ("flag-ca.pem", "--tls-ca"), "cert": (None, "--tls-cert"), "key": (None, "--tls-key")}
    env = {"RDZV_TLS_CA": "env-ca.pem", "RDZV_TLS_CERT": "c.pem", "RDZV_TLS_KEY": "k.pem"}
    files = client_files(flags, env)
    assert files == ClientFiles(
        ca="flag-ca.pem", cert="c.pem", key="k.pem", origins="--tls-ca and RDZV_TLS_CERT and RDZV_TLS_KEY"
    )
    assert client_files({}, {}) is None and client_files(flags | {"ca": (None, "--tls-ca")}, {}) is None
    with pytest.raises(TLSConfigError, match=r"^RDZV_TLS_CERT: a client certificate needs --tls-ca"):
        client_files({}, {"RDZV_TLS_CERT": "c.pem"})
    with pytest.raises(
        TLSConfigError, match=r"^--tls-ca and RDZV_TLS_KEY: --tls-cert and --tls-key go together"
    ):
        client_files(flags, {"RDZV_TLS_KEY": "k.pem"})
