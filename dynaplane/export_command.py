"""`dynaplane export JOB [--step N] [--name NAME] [--no-wait]`: export one of a job's checkpoints
as a Hugging Face directory through a running control plane's API (POST /api/jobs/{id}/export),
then follow it (GET /api/exports/{id}) until the control worker has written it."""
from __future__ import annotations

import argparse
import json
import sys
import time

from dynaplane.api_client import ApiError, api, api_arguments

POLL_SECONDS = 1.0
JOBS_PAGE = 1000


def add_export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a job's checkpoint as a Hugging Face directory (safetensors + "
                                      "config.json) under the control plane's exports root")
    p.add_argument("job", metavar="JOB", help="the job: its name or id")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest complete one)")
    p.add_argument("--name", default="", help="the directory's name under the exports root (default "
                                              "<job>-step-<N>)")
    p.add_argument("--no-wait", action="store_true", help="print the queued export and return at once")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the export (default 3600)")
    api_arguments(p)
    p.set_defaults(func=_export)


def job_id(args: argparse.Namespace, job: str) -> int:
    """The id of the job named `job` (its id, or its name, looked up in the job list)."""
    if job.isascii() and job.isdigit():
        return int(job)
    offset = 0
    while True:
        page = api(args, "GET", f"api/jobs?limit={JOBS_PAGE}&offset={offset}")
        for row in page.get("results", []):
            if row.get("name") == job:
                return int(row["id"])
        offset += JOBS_PAGE
        if not page.get("next") or offset >= page.get("count", 0):
            raise ApiError(f"no job named {job!r} (GET /api/jobs lists them)")


def progress_line(row: dict) -> str:
    where = f"{row['path']} under the exports root"
    if row["state"] == "pending":
        return f"export {row['id']} of {row['job_name']} step {row['checkpoint_step']} -> {where}: queued"
    if row["state"] == "running":
        total = row["files_total"] if row["files_total"] is not None else "?"
        return f"export {row['id']}: {row['files_written']}/{total} files written ({row['bytes']:,} bytes)"
    if row["state"] == "done":
        return (f"exported {row['job_name']} step {row['checkpoint_step']} to {where}: {row['files_written']} "
                f"files, {row['bytes']:,} bytes in {row['seconds']:.1f} s")
    return f"export {row['id']} failed: {row['error']}"


def _export(args: argparse.Namespace) -> int:
    body: dict = {}
    if args.step is not None:
        body["checkpoint_step"] = args.step
    if args.name:
        body["name"] = args.name
    try:
        row = api(args, "POST", f"api/jobs/{job_id(args, args.job)}/export", body)
        shown = None
        deadline = time.monotonic() + args.timeout
        while not args.no_wait and row["state"] in ("pending", "running"):
            line = progress_line(row)
            if line != shown and not args.json:
                print(line, flush=True)
                shown = line
            if time.monotonic() > deadline:
                print(f"dynaplane export: still {row['state']} after {args.timeout:g} s (GET /api/exports/"
                      f"{row['id']} follows it)", file=sys.stderr)
                return 1
            time.sleep(POLL_SECONDS)
            row = api(args, "GET", f"api/exports/{row['id']}")
    except (ApiError, KeyError, TypeError) as exc:
        print(f"dynaplane export: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(row))
    else:
        print(progress_line(row))
    return 1 if row["state"] == "failed" else 0
