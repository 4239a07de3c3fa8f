"""`dynaplane up --tls-cert/--tls-key` (dynaplane/stack.py tls_files): refused at once, naming the
option and the problem, unless both are given and the key fits the certificate."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from dynaplane.stack import tls_files

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl(1) makes the test's certificates")


def _pair(folder, name: str):
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_tls_files_take_a_certificate_and_its_key_or_neither(tmp_path) -> None:
    cert, key = _pair(tmp_path, "a")
    other_cert, other_key = _pair(tmp_path, "b")
    assert tls_files(None, None) is None
    assert tls_files(str(cert), str(key)) == (cert.resolve(), key.resolve())
    with pytest.raises(ValueError, match="give both --tls-cert and --tls-key"):
        tls_files(str(cert), None)
    with pytest.raises(ValueError, match=f"--tls-cert {tmp_path / 'nope.pem'} does not exist"):
        tls_files(str(tmp_path / "nope.pem"), str(key))
    with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
        tls_files(str(cert), str(other_key))  # a key that does not fit
    with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
        tls_files(str(key), str(key))
