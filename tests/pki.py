"""A throw-away PKI for TLS tests, made with the ``openssl`` command line (no Python packages).

``make_pki(folder)`` writes two CAs (the second one signs nothing we trust, for "wrong CA"
cases), a server certificate for 127.0.0.1 and localhost, one for another name, and client
certificates from each CA. EC P-256
keys: each takes milliseconds to make, where RSA would take a noticeable fraction of a second.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


@dataclass(frozen=True)
class Pki:
    ca: Path  # signs the server and client certificates
    other_ca: Path  # a CA that signed neither
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from other_ca
    stranger_key: Path
    misnamed_cert: Path  # a server certificate from ca for another name (rdzv.invalid)
    misnamed_key: Path


def _run(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=30)


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _run(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def _leaf(folder: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, csr, ext = (folder / f"{name}.{x}" for x in ("pem", "key", "csr", "ext"))
    _run(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
    )  # fmt: skip
    ext.write_text("basicConstraints=CA:FALSE\n" + extensions)
    _run(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-set_serial", "0x" + name.encode().hex(),
        "-days", "2", "-out", cert, "-extfile", ext,
    )  # fmt: skip
    return cert, key


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = _ca(folder, "test-ca"), _ca(folder, "other-ca")
    server = _leaf(
        folder, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    client = _leaf(folder, "agent", ca, "extendedKeyUsage=clientAuth\n")
    stranger = _leaf(folder, "stranger", other, "extendedKeyUsage=clientAuth\n")
    misnamed = _leaf(folder, "misnamed", ca, "subjectAltName=DNS:rdzv.invalid\nextendedKeyUsage=serverAuth\n")
    return Pki(ca[0], other[0], *server, *client, *stranger, *misnamed)
