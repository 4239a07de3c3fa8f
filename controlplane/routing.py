"""Websocket routes (under /ws/)."""
from django.urls import path

from controlplane.cluster.consumers import ClusterConsumer

websocket_urlpatterns = [
    path("ws/cluster/", ClusterConsumer.as_asgi()),
]
