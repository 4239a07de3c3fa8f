"""Make a fresh installation usable: an admin user, its API token, optionally the demo job and
its dataset.

Prints one JSON line: {"username", "password", "token", "database", "demo", "dataset",
"agent_tokens"}; "agent_tokens" (with --agents N) maps node-1 .. node-N to fresh agent tokens for
the launcher's local agents (their earlier launcher-issued tokens revoked); "demo"
is the demo job's {"id", "state"} with --demo (`dynaplane up` then starts it once the agents are
up, when it is pending), else null; "dataset" (with --demo) is the demo's dataset
{"id", "name", "documents", "tokens", "prepared_seconds"} (prepared_seconds: null when it was
prepared before) or {"error"} when it could not be prepared (the demo job then trains on
synthetic tokens), else null. The password comes from $DYNAPLANE_ADMIN_PASSWORD, else is
generated once and kept in the var dir (0600).
"""
from __future__ import annotations

import json
import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import connection
from rest_framework.authtoken.models import Token

from parallelism.datasets.errors import DatasetError
from controlplane.cluster.agent_tokens import token_issue, token_revoke
from controlplane.cluster.models import AgentToken
from controlplane.common.errors import InvalidInput
from controlplane.datasets.demo import DEMO_DATASET, demo_dataset_ensure
from controlplane.jobs.models import Job
from controlplane.jobs.services import job_create

# Two of the four GPUs of `dynaplane up`'s default cluster: the other two stay free for a job
# made on the "New job" form, or for resizing the demo to tp=2,dp=2. It trains on the Python
# standard library's source (controlplane/datasets/demo.py), byte tokens: tiny-gpt's vocab of 512 holds them.
DEMO_JOB = {"name": "demo", "model": "tiny-gpt", "layout": "tp=2", "global_batch": 8, "seq_len": 128,
            "dataset": DEMO_DATASET, "eval_every": 25, "eval_batches": 4}
EVALUATION = ("eval_every", "eval_batches")


def _demo_job_create(user) -> Job:
    """The demo job on its dataset, evaluating its held-out split when that split is large enough
    (a small source's is not: the demo then trains without a validation curve)."""
    try:
        return job_create(**DEMO_JOB, created_by=user)
    except InvalidInput as exc:
        if set(exc.errors) != {"eval_every"}:
            raise
    return job_create(**{k: v for k, v in DEMO_JOB.items() if k not in EVALUATION}, created_by=user)


def _stored_password() -> str:
    if os.environ.get("DYNAPLANE_ADMIN_PASSWORD"):
        return os.environ["DYNAPLANE_ADMIN_PASSWORD"]
    path = settings.VAR_DIR / "admin_password"
    if path.exists():
        return path.read_text().strip()
    password = secrets.token_urlsafe(12)
    settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(password)
    return password


class Command(BaseCommand):
    help = "Create the admin user and API token (and the demo job and its dataset with --demo); print them as JSON."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default=os.environ.get("DYNAPLANE_ADMIN_USER", "admin"))
        parser.add_argument("--agents", type=int, default=0,
                            help="issue tokens for this many local agents, node-1 .. node-N")
        parser.add_argument("--demo", action="store_true",
                            help="create the demo job and its dataset if they do not exist")
        parser.add_argument("--demo-source", default=None, metavar="DIR",
                            help="the .py files the demo dataset is prepared from (default: the standard library)")

    def handle(self, *args, username: str, demo: bool, demo_source: str | None = None, agents: int = 0,
               **options) -> None:
        password = _stored_password()
        user, created = get_user_model().objects.get_or_create(
            username=username, defaults={"is_staff": True, "is_superuser": True}
        )
        if created or not user.check_password(password):
            user.set_password(password)
            user.save()
        token, _ = Token.objects.get_or_create(user=user)
        demo_job = dataset = None
        if demo:
            demo_job = Job.objects.filter(name=DEMO_JOB["name"]).first()
            dataset = _demo_dataset(demo_source, user) if demo_job is None or demo_job.dataset_id else None
            if demo_job is None and "error" not in dataset:
                try:
                    demo_job = _demo_job_create(user)
                except InvalidInput as exc:  # e.g. its data changed on disk since it was registered
                    dataset = {"error": str(exc)}
            if demo_job is None:
                # synthetic tokens: no data, and no validation split to evaluate
                synthetic = {k: v for k, v in DEMO_JOB.items() if k != "dataset" and k not in EVALUATION}
                demo_job = job_create(**synthetic, created_by=user)
        database = f"{connection.vendor} {connection.settings_dict['NAME']}"
        self.stdout.write(json.dumps({"username": username, "password": password, "token": token.key,
                                      "database": database,
                                      "demo": {"id": demo_job.pk, "state": demo_job.state} if demo_job else None,
                                      "dataset": dataset, "agent_tokens": _local_agent_tokens(agents)}))


LOCAL_ISSUER = "dynaplane up"


def _local_agent_tokens(count: int) -> dict[str, str]:
    """Fresh tokens for the launcher's agents node-1 .. node-<count>; the ones it issued them
    before are revoked (a token issued by an admin for such a node is left alone)."""
    tokens = {}
    for i in range(1, count + 1):
        node = f"node-{i}"
        for old in AgentToken.objects.filter(node=node, created_by=LOCAL_ISSUER, revoked_at=None):
            token_revoke(key_id=old.key_id)
        tokens[node] = token_issue(node=node, created_by=LOCAL_ISSUER, note="a local agent of `dynaplane up`")[1]
    return tokens


def _demo_dataset(source: str | None, user) -> dict:
    """The demo dataset, prepared and registered when it is not yet (its summary), or why not."""
    try:
        dataset, seconds = demo_dataset_ensure(source=source, created_by=user)
    except (DatasetError, OSError, InvalidInput) as exc:
        return {"error": str(exc)}
    return {"id": dataset.pk, "name": dataset.name, "documents": dataset.documents, "tokens": dataset.tokens,
            "prepared_seconds": None if seconds is None else round(seconds, 2)}
