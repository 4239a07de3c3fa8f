"""`dynaplane tokens ...`: agent tokens through a running control plane's API (staff only):
issue one for a node (printed once), list them, revoke one (issue 44)."""
from __future__ import annotations

import argparse
import json
import sys

from dynaplane.api_client import ApiError, api, api_arguments


def add_token_commands(sub: argparse._SubParsersAction) -> None:
    tokens = sub.add_parser("tokens", help="agent tokens: issue one for a node, list, revoke")
    verbs = tokens.add_subparsers(dest="tokens_command", required=True)
    p = verbs.add_parser("issue", help="issue a token for a node's agent (printed once; only a key is kept)")
    p.add_argument("node", help="the node name the agent runs as (`dynaplane agent --name`)")
    p.add_argument("--note", default="", help="a note kept with the token (e.g. where it was installed)")
    api_arguments(p)
    p.set_defaults(func=_issue)
    ls = verbs.add_parser("list", help="list the tokens (never their secrets)")
    ls.add_argument("--node", default=None, help="only this node's")
    api_arguments(ls)
    ls.set_defaults(func=_list)
    r = verbs.add_parser("revoke", help="revoke a token: its agent's messages are refused within seconds")
    r.add_argument("key_id", help="the token's key id (16 hex digits: `dynaplane tokens list`)")
    api_arguments(r)
    r.set_defaults(func=_revoke)


def _issue(args: argparse.Namespace) -> int:
    try:
        row = api(args, "POST", "api/agent-tokens", {"node": args.node, "note": args.note})
    except ApiError as exc:
        print(f"dynaplane tokens issue: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(row))
    else:
        print(f"token for node {row['node']} (key id {row['key_id']}); shown once, keep it secret:\n{row['token']}\n"
              f"on that host: DYNAPLANE_AGENT_TOKEN=<token> dynaplane agent --join <control plane URL>")
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        rows = api(args, "GET", "api/agent-tokens" + (f"?node={args.node}" if args.node else ""))
    except ApiError as exc:
        print(f"dynaplane tokens list: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no agent tokens (`dynaplane tokens issue NODE`)")
        return 0
    print(f"{'key id':16}  {'node':24} {'issued':20} {'last joined':20} {'revoked':20} note")
    for r in rows:
        print(f"{r['key_id']:16}  {r['node']:24} {r['created_at'][:19]:20} {(r['last_joined_at'] or '-')[:19]:20} "
              f"{(r['revoked_at'] or '-')[:19]:20} {r['note']}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    try:
        row = api(args, "POST", f"api/agent-tokens/{args.key_id}/revoke", {})
    except ApiError as exc:
        print(f"dynaplane tokens revoke: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(row) if args.json else f"revoked {row['key_id']} of node {row['node']} at {row['revoked_at']}")
    return 0
