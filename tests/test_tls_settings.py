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


def test_several_web_processes_are_refused_with_tls_and_outside_1_to_32(tmp_path) -> None:
    """`dynaplane up --web N` (processes sharing the port): one serves TLS; the count is bounded."""
    from dynaplane.cli import build_parser
    from dynaplane.stack import StackOptions

    cert, key = _pair(tmp_path, "a")
    parse = build_parser().parse_args
    assert StackOptions.from_args(parse(["up", "--port", "0", "--web", "3"])).web == 3
    with pytest.raises(ValueError, match="--web 2 with --tls-cert: one web process serves TLS"):
        StackOptions.from_args(parse(["up", "--port", "0", "--web", "2", "--tls-cert", str(cert), "--tls-key", str(key)]))
    for bad in ("0", "33"):
        with pytest.raises(ValueError, match=f"--web {bad}: give 1 to 32 web server processes"):
            StackOptions.from_args(parse(["up", "--port", "0", "--web", bad]))
