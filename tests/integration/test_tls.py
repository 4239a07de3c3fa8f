"""HTTPS for the web server is one setting (issue 44): `dynaplane up --tls-cert C --tls-key K`
serves the API and pages over TLS only, and an agent elsewhere joins over https:// when it trusts
the certificate (SSL_CERT_FILE for a self-signed one), and is told clearly why not when it does
not. The certificate is made here with openssl(1)."""
from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.support.stack import ROOT, StackProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl(1) makes the test's certificate")]


@pytest.fixture
def certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_the_stack_over_https_and_an_agent_that_joins_over_it(tmp_path, certificate) -> None:
    stack = StackProcess(tmp_path / "var", agents=0, env={"DATABASE_URL": None, "REDIS_URL": None}, tls=certificate)
    stack.start()
    agents = []
    try:
        stack.wait_ready(timeout=180)
        assert stack.url.startswith("https://127.0.0.1:"), stack.url
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):  # no plain HTTP there
            urllib.request.urlopen(stack.url.replace("https://", "http://") + "api/health", timeout=5).read()
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # nor for who does not trust it
            urllib.request.urlopen(stack.url + "api/health", timeout=5)
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SSL_CERT_FILE")}
        env["DYNAPLANE_VAR_DIR"] = str(stack.var_dir)
        argv = [sys.executable, "-m", "dynaplane", "agent", "--join", stack.url, "--gpus", "1"]
        token = stack.post("api/agent-tokens", {"node": "tls-1"})["token"]
        refused = subprocess.run(argv, env={**env, "DYNAPLANE_AGENT_TOKEN": token}, cwd=ROOT, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr
        assert "give the control plane's certificate, or its CA's, in SSL_CERT_FILE" in refused.stderr
        log = open(tmp_path / "agent.log", "wb")
        agents.append(subprocess.Popen(argv, env={**env, "DYNAPLANE_AGENT_TOKEN": token,
                                                  "SSL_CERT_FILE": str(certificate[0])},
                                       cwd=ROOT, stdout=log, stderr=log))
        node, _ = wait_for(lambda: next((n for n in stack.get("api/nodes", token=True)["results"]
                                         if n["name"] == "tls-1" and n["state"] == "healthy"), None), timeout=90)
        assert len(node["gpus"]) == 1, node
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(timeout=30)
        stack.stop()
