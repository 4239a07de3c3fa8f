"""An agent's credentials (issue 44): its token (--token, else $DYNAPLANE_AGENT_TOKEN), and with
--join, the broker URL and node name the control plane gives for it (POST /api/agents/join)."""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from agents.seal import AgentKey, SealError, key_of_token

TOKEN_ENV = "DYNAPLANE_AGENT_TOKEN"


class EnrolError(ValueError):
    """The agent cannot take part: no token, a malformed one, or the control plane refused it."""


@dataclass(frozen=True, slots=True)
class Enrolment:
    key: AgentKey
    node: str | None  # the node the control plane says the token speaks for (None: not asked)
    broker_url: str | None  # the broker the control plane gives joining agents (None: not asked)


def agent_token(given: str | None) -> str:
    """The token from the command line or the environment; the environment's copy is removed so
    that no rank process inherits it (ranks get the derived key only)."""
    token = given or os.environ.pop(TOKEN_ENV, "")
    os.environ.pop(TOKEN_ENV, None)
    if not token:
        raise EnrolError(f"no agent token: pass --token (or set ${TOKEN_ENV}); an admin issues one with "
                         f"`dynaplane tokens issue NODE` (or POST /api/agent-tokens as staff)")
    return token


def enrol(token: str, join_url: str | None, node: str | None, timeout: float = 15.0) -> Enrolment:
    try:
        key = key_of_token(token)
    except SealError as exc:
        raise EnrolError(str(exc)) from None
    if not join_url:
        return Enrolment(key, None, None)
    url = urllib.parse.urljoin(join_url.rstrip("/") + "/", "api/agents/join")
    request = urllib.request.Request(url, data=json.dumps({"token": token, "node": node or ""}).encode(),
                                     method="POST", headers={"Content-Type": "application/json",
                                                             "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read())
        except ValueError:
            detail = {}
        words = "; ".join(f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in detail.items()) \
            if isinstance(detail, dict) else ""
        raise EnrolError(f"{url} refused to enrol this agent (HTTP {exc.code}): {words or 'no reason given'}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        hint = (" (a certificate this host does not trust: give the control plane's certificate, or its CA's, in "
                "SSL_CERT_FILE)") if isinstance(reason, ssl.SSLCertVerificationError) else ""
        raise EnrolError(f"cannot reach the control plane at {url}: {reason}{hint}") from None
    if not isinstance(answer, dict) or not {"node", "broker_url"} <= set(answer):
        raise EnrolError(f"{url} did not answer as a dynaplane control plane")
    return Enrolment(key, str(answer["node"]), str(answer["broker_url"]))
