"""The control plane's Celery app: configured from Django settings (CELERY_* names)."""
from __future__ import annotations

import os

from celery import Celery
from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
@task_postrun.connect
def _database_connections(**_) -> None:
    """Keep a worker thread's database connection across tasks, as Django keeps a web thread's
    across requests: closed when older than CONN_MAX_AGE or broken (a database restart).
    Celery's own Django fixup, which closed it before and after every task, is held off by
    CELERY_DB_REUSE_MAX (settings.py)."""
    close_old_connections()
