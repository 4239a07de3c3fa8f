"""Settings, every one read from the environment with a safe local default.

DATABASE_URL  default: SQLite file under the var directory.
REDIS_URL     default: redis://127.0.0.1:6379/0. `dynaplane up` starts an embedded
              Valkey server and passes its URL to every process when none is given.
DYNAPLANE_VAR_DIR  where local state lives (database, logs, keys); default ./var.
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import time
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from agents import protocol

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DYNAPLANE_VAR_DIR", BASE_DIR / "var")).resolve()


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def private_files(db_path: str) -> None:
    """The SQLite database holds the API tokens and password hashes: readable by its owner
    only (created so, and tightened when an older run left it readable by all), with its
    WAL and shared-memory files alike."""
    if db_path in ("", ":memory:") or db_path.startswith("file:"):
        return
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT, 0o600))
    for path in (db_path, f"{db_path}-wal", f"{db_path}-shm"):
        try:
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
        except FileNotFoundError:
            pass
        except PermissionError:  # not ours (a shared install): leave it to its owner
            pass


def _secret_key() -> str:
    """A key from the environment, else one generated once and kept in the var dir."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = VAR_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    try:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key)
        return key
    except FileExistsError:  # another process created it first: use theirs, once written
        for _ in range(50):
            key = path.read_text().strip()
            if key:
                return key
            time.sleep(0.02)
        raise
    except OSError:  # read-only var dir: sessions last as long as the process
        return secrets.token_urlsafe(50)


SECRET_KEY = _secret_key()
DEBUG = _env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
# Served over HTTPS (`dynaplane up --tls-cert`, or behind a TLS proxy that says so): the session and
# CSRF cookies are never sent over plain HTTP.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = _env_bool("DYNAPLANE_HTTPS", False)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here: /api/docs/ works offline
    "channels",
    "controlplane.common",
    "controlplane.cluster",
    "controlplane.datasets",
    "controlplane.jobs",
    "controlplane.exports",
    "controlplane.emulation",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "controlplane.common.database_down.DatabaseDownMiddleware",  # 503 while the database restarts
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'dynaplane.sqlite3'}",
        conn_max_age=int(os.environ.get("DJANGO_CONN_MAX_AGE", "60")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes write (web, worker): wait for the lock instead of failing at once,
    # and use WAL so readers never block the writer.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    private_files(DATABASES["default"]["NAME"])
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# plotly.js comes from the plotly Python package: served locally, never from a CDN.
STATICFILES_DIRS = [("vendor/plotly", Path(importlib.util.find_spec("plotly").origin).parent / "package_data")]
# Served from the apps (finders) unless collected (the container image sets DJANGO_STATIC_ROOT).
STATIC_ROOT = os.environ.get("DJANGO_STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# --- Redis: Celery broker and Channels layer share one server --------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py 8 reads with a 5 s socket timeout by default, and channels-redis waits for
        # messages with a 5 s BZPOPMIN: an idle websocket's empty reply then races the timeout
        # and, on a busy machine, loses (the consumer dies with a TimeoutError). Give the
        # socket room beyond the blocking pop.
        # redis-py 8's asyncio pool raises "Too many connections" past 100 connections in use,
        # and every websocket that opens takes one for its group_add: 125 pages opening at once
        # (benchmarks/cluster_scale.py, 200 jobs followed) failed there. Redis allows 10,000 clients.
        # A websocket's channel holds up to 1,000 messages (channels-redis drops the newest past
        # `capacity`, 100 by default: a web process that fell behind under load dropped a page's
        # events there and the page reloaded its snapshot; they still expire after 60 s).
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30, "max_connections": 2000}],
                   "prefix": "dynaplane:channels", "capacity": 1000},
    }
}

CELERY_BROKER_URL = REDIS_URL
# The broker URL an agent that joins (`dynaplane agent --join URL --token T`) is told to use, its
# password included: the address other hosts reach the broker on (`dynaplane up --host` sets it).
DYNAPLANE_AGENT_BROKER_URL = os.environ.get("DYNAPLANE_AGENT_BROKER_URL") or REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = protocol.CONTROL_QUEUE
CELERY_TASK_ROUTES = {  # (exact names before patterns: Celery's MapRoute)
    **{task: {"queue": protocol.CONTROL_FLOWS_QUEUE} for task in protocol.CONTROL_FLOW_TASKS},
    "control.*": {"queue": protocol.CONTROL_QUEUE},
    "emulate.*": {"queue": protocol.EMULATE_QUEUE},
    "exports.*": {"queue": "exports"},  # DYNAPLANE_EXPORTS_QUEUE: the control worker takes it too
    # node.* tasks go to one agent's queue, chosen when sent (protocol.node_queue).
}
# Exports of a job's checkpoints as Hugging Face directories (controlplane/exports) run on this
# queue, which the control worker consumes beside `control` (`dynaplane up`, docker-compose.yml):
# never in the web process; one at a time (the worker's threads also take the agents' reports).
DYNAPLANE_EXPORTS_QUEUE = "exports"
# Celery's Django fixup closes a worker thread's database connection before and after every task
# unless this is set: every report batch opened a new PostgreSQL connection (a backend process
# each; 7-8% of a control worker's time at 200 jobs reporting, benchmarks/cluster_scale.py). With
# it, the fixup closes them every this many tasks, and controlplane/celery.py closes the old and
# the broken ones as Django does between requests (CONN_MAX_AGE, health checks).
CELERY_DB_REUSE_MAX = 1000
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Back within a second of the broker after an outage (Celery's own waits up to 30 s between tries).
CELERY_WORKER_CONSUMER = "agents.celery_consumer:QuickReconnectConsumer"
CELERY_BROKER_CONNECTION_MAX_RETRIES = None  # however long it is away (Celery's default: give up after 100 tries)
CELERY_BEAT_SCHEDULE = {
    "take-heartbeats": {  # controlplane/cluster/heartbeat_intake.py: what the agents posted to Redis
        "task": protocol.CONTROL_TAKE_HEARTBEATS,
        "schedule": 1.0,
        "options": {"expires": 2.0},
    },
    "sweep-lost-nodes": {
        "task": protocol.CONTROL_SWEEP_LOST_NODES,
        "schedule": float(os.environ.get("DYNAPLANE_SWEEP_SECONDS", "1.0")),
        "options": {"expires": 5.0},
    },
    "sweep-stuck-transitions": {
        "task": protocol.CONTROL_SWEEP_STUCK_TRANSITIONS,
        "schedule": 5.0,
        "options": {"expires": 10.0},
    },
    "sweep-preflights": {  # controlplane/jobs/preflight.py: the pre-flights a node never answered
        "task": protocol.CONTROL_SWEEP_PREFLIGHTS,
        "schedule": 2.0,
        "options": {"expires": 5.0},
    },
    "sweep-reconcile": {  # controlplane/jobs/reconcile.py
        "task": protocol.CONTROL_SWEEP_RECONCILE,
        "schedule": 5.0,
        "options": {"expires": 10.0},
    },
    "sweep-emulations": {  # controlplane/emulation/services.py, emulations_reconcile
        "task": protocol.CONTROL_SWEEP_EMULATIONS,
        "schedule": 5.0,
        "options": {"expires": 10.0},
    },
    "sweep-elastic": {  # controlplane/jobs/elastic_apply.py: the elastic scheduler's decisions, carried out
        "task": protocol.CONTROL_SWEEP_ELASTIC,
        "schedule": float(os.environ.get("DYNAPLANE_ELASTIC_SWEEP_SECONDS", "5.0")),
        "args": ["beat"],
        "options": {"expires": 10.0},
    },
}

# A node whose last heartbeat is older than this is lost (heartbeats come every
# protocol.HEARTBEAT_SECONDS; the sweep runs every second).
DYNAPLANE_NODE_LOST_AFTER_SECONDS = float(os.environ.get("DYNAPLANE_NODE_LOST_AFTER_SECONDS", "6.0"))
# How long a rank's collective in a training step waits for a peer before the rank counts it
# lost (checkpoints, switches and start-up wait the orders' timeout_seconds): docs/hosts.md.
DYNAPLANE_STEP_TIMEOUT_SECONDS = float(os.environ.get("DYNAPLANE_STEP_TIMEOUT_SECONDS",
                                                      str(protocol.STEP_TIMEOUT_SECONDS)))
# Pre-flight before a start or a grow (controlplane/jobs/preflight.py, docs/hosts.md): "hosts"
# (when the ranks span more than one host), "always", or "off"; and how long the nodes of one wait
# for each other (the control plane waits twice that + 10 s for their reports).
DYNAPLANE_PREFLIGHT = os.environ.get("DYNAPLANE_PREFLIGHT", "hosts").strip().lower()
if DYNAPLANE_PREFLIGHT not in ("hosts", "always", "off"):
    raise ImproperlyConfigured(f"DYNAPLANE_PREFLIGHT={DYNAPLANE_PREFLIGHT!r}: give hosts, always or off")
DYNAPLANE_PREFLIGHT_SECONDS = float(os.environ.get("DYNAPLANE_PREFLIGHT_SECONDS", str(protocol.PREFLIGHT_SECONDS)))
# Reconciliation (controlplane/jobs/reconcile.py, emulation/services.emulations_reconcile):
# a job or emulation run no agent reports is settled only once every agent concerned has
# reported this long after the record last changed (orders still on their way, processes
# still starting are not lost ones).
DYNAPLANE_RECONCILE_GRACE_SECONDS = float(os.environ.get("DYNAPLANE_RECONCILE_GRACE_SECONDS", "15"))
# A resize that no report has moved for this long is ended by the control plane
# (controlplane/jobs/timeouts.py): above the ranks' own timeouts (a joining rank's 120 s to
# get ready, then the union world's 120 s rendezvous), since they end most stuck switches
# themselves and report it; this one catches rank 0 or its agent never answering.
DYNAPLANE_TRANSITION_TIMEOUT_SECONDS = float(os.environ.get("DYNAPLANE_TRANSITION_TIMEOUT_SECONDS", "600"))
# The elastic scheduler (docs/elastic.md, part 3): every DYNAPLANE_ELASTIC_SWEEP_SECONDS (beat),
# and DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS after a change that may alter its answer (a job created,
# started, stopped or finished, a resize committed or aborted, a node joined or lost), it decides
# (parallelism/layout/elastic_policy.py) and carries the changes out through the resize and start
# paths users click. Off (DYNAPLANE_ELASTIC=0): it never acts (GET /api/elastic still shows the plan).
DYNAPLANE_ELASTIC = _env_bool("DYNAPLANE_ELASTIC", True)
DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS = float(os.environ.get("DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS", "0.5"))
# No job is resized (or started and then resized) twice within this interval.
DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = float(os.environ.get("DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS", "300"))
# After a failed resize the scheduler leaves the job alone this long, doubling per failure in a
# row, up to the maximum.
DYNAPLANE_ELASTIC_BACKOFF_SECONDS = float(os.environ.get("DYNAPLANE_ELASTIC_BACKOFF_SECONDS", "60"))
DYNAPLANE_ELASTIC_BACKOFF_MAX_SECONDS = float(os.environ.get("DYNAPLANE_ELASTIC_BACKOFF_MAX_SECONDS", "3600"))
# A grow must pay for its pause within this much training: time saved per step x steps > pause.
DYNAPLANE_ELASTIC_GROW_HORIZON_SECONDS = float(os.environ.get("DYNAPLANE_ELASTIC_GROW_HORIZON_SECONDS", "3600"))
# Every checkpoint folder a job names (checkpoint_dir, resume_from) lies under this root; on a
# cluster, shared storage every node mounts at the same path.
DYNAPLANE_CHECKPOINT_ROOT = os.environ.get("DYNAPLANE_CHECKPOINT_ROOT") or str(VAR_DIR / "checkpoints")
# Every registered dataset directory lies under this root (docs/datasets.md); on a cluster, shared
# storage every node mounts at the same path: the ranks read the data from there.
DYNAPLANE_DATA_ROOT = os.environ.get("DYNAPLANE_DATA_ROOT") or str(VAR_DIR / "data")
# Every Hugging Face model directory a job starts from (`init_from`) lies under this root
# (docs/hf-weights.md); on a cluster, shared storage every node mounts at the same path: each rank
# reads its boxes of the weights from there.
DYNAPLANE_WEIGHTS_ROOT = os.environ.get("DYNAPLANE_WEIGHTS_ROOT") or str(VAR_DIR / "weights")
# Where POST /api/jobs/{id}/export writes a job's checkpoint as a Hugging Face directory
# (<root>/<job name>-step-<N>/), from the control worker (the `exports` queue).
DYNAPLANE_EXPORTS_ROOT = os.environ.get("DYNAPLANE_EXPORTS_ROOT") or str(VAR_DIR / "exports")
# Ports ("first-last") from which each live job gets the lowest unused one for its
# torch.distributed rendezvous on rank 0's node (docs/elastic.md).
DYNAPLANE_RENDEZVOUS_PORTS = os.environ.get("DYNAPLANE_RENDEZVOUS_PORTS", "29400-29599")

# --- API ---------------------------------------------------------------------------
# Whether anyone who reaches the web server may read the API (jobs, nodes, schema) without
# signing in. On for a stack on this machine only; `dynaplane up --host ADDRESS` (other hosts
# reach it) turns it off: then every read needs a token or a session, and /api/health tells the
# unauthenticated only whether it is up (issue 44).
DYNAPLANE_OPEN_READS = _env_bool("DYNAPLANE_OPEN_READS", True)
_READ_PERMISSION = ("rest_framework.permissions.IsAuthenticatedOrReadOnly" if DYNAPLANE_OPEN_READS
                    else "rest_framework.permissions.IsAuthenticated")
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [_READ_PERMISSION],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "controlplane.common.api_inputs.BoundedPagination",
    # The API speaks JSON only (the pages post JSON too); a form body is a 415. (Twisted, under
    # daphne, answers a malformed multipart body with an empty 400 before any view sees it.)
    "DEFAULT_PARSER_CLASSES": ["controlplane.common.api_inputs.BoundedJSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "PAGE_SIZE": 200,
    "EXCEPTION_HANDLER": "controlplane.common.errors.api_exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "dynaplane control plane API",
    "DESCRIPTION": "GPU inventory, training jobs, layout history and emulation runs.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": [_READ_PERMISSION],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "controlplane.common.schema_errors.add_error_responses",
                             "controlplane.common.schema_security.open_operations_need_no_security"],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("DYNAPLANE_LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}
