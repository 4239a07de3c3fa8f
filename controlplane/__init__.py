"""dynaplane control plane: Django project (API, websockets, pages) and its Celery app."""
from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
