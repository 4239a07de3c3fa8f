"""Websocket /ws/cluster/: the cluster stream's events, live, to signed-in users."""
from __future__ import annotations

from controlplane.cluster.events import GROUP, STREAM
from controlplane.common.consumers import StreamConsumer


class ClusterConsumer(StreamConsumer):
    group, stream = GROUP, STREAM
