"""The `dynaplane` commands that talk to a running control plane's API (`data register`, `data
list`, `export`): where it is and its token (--url/--token, else $DYNAPLANE_URL/$DYNAPLANE_TOKEN,
else the `dynaplane up` running from the var dir: its stack.json), one request, and its refusal as
a clear error in the API's words."""
from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


def api_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="the control plane (default: $DYNAPLANE_URL, else the url of the "
                                               "`dynaplane up` running from the var dir)")
    p.add_argument("--token", default=None, help="an API token (default: $DYNAPLANE_TOKEN, else the running "
                                                 "`dynaplane up`'s admin token)")
    p.add_argument("--var-dir", default=None, help="where `dynaplane up` runs (default: $DYNAPLANE_VAR_DIR or ./var)")
    p.add_argument("--json", action="store_true", help="print the API's answer as JSON")


class ApiError(Exception):
    """The control plane could not be asked, or refused: the message says which and why."""


def api(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One request to the control plane's API: its JSON answer, or ApiError with its words."""
    state: dict = {}
    state_path = Path(args.var_dir or os.environ.get("DYNAPLANE_VAR_DIR") or "var") / "stack.json"
    if not (args.url or os.environ.get("DYNAPLANE_URL")) or not (args.token or os.environ.get("DYNAPLANE_TOKEN")):
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            state = {}
    url = args.url or os.environ.get("DYNAPLANE_URL") or state.get("url")
    token = args.token or os.environ.get("DYNAPLANE_TOKEN") or state.get("token")
    if not url:
        raise ApiError(f"no control plane to ask: pass --url (or set DYNAPLANE_URL), or run `dynaplane up` "
                       f"({state_path} names none)")
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(urllib.parse.urljoin(url.rstrip("/") + "/", path), data=data, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            answer = json.loads(exc.read())
        except ValueError:
            answer = {}
        raise ApiError(refusal(exc.code, answer, bool(token))) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ApiError(f"cannot reach the control plane at {url}: {getattr(exc, 'reason', exc)} (is `dynaplane up` "
                       f"running? --url names another)") from None


def refusal(code: int, answer: dict, token: bool) -> str:
    if code in (401, 403):
        return (f"HTTP {code}: {answer.get('detail', 'not allowed')} "
                f"({'the token was refused' if token else 'no token: pass --token or set DYNAPLANE_TOKEN'})")
    if isinstance(answer, dict) and answer and "detail" not in answer:
        return "; ".join(f"{field}: {' '.join(map(str, v)) if isinstance(v, list) else v}"
                         for field, v in answer.items())
    return f"HTTP {code}: {answer.get('detail', 'refused') if isinstance(answer, dict) else answer}"
