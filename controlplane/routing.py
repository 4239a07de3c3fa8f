"""Websocket routes (under /ws/)."""
from django.urls import path

from controlplane.cluster.consumers import ClusterConsumer
from controlplane.emulation.consumers import EmulationConsumer
from controlplane.jobs.consumers import JobConsumer

websocket_urlpatterns = [
    path("ws/cluster/", ClusterConsumer.as_asgi()),
    path("ws/emulations/", EmulationConsumer.as_asgi()),
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
]
