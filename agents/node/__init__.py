"""The node agent: a Celery worker on node.<name> that reports inventory and heartbeats."""
