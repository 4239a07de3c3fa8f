"""Channel-layer sends from sync code (the workers' threads, views) on one event loop kept for
the life of the process.

asgiref's async_to_sync, called from a thread with no event loop of its own, runs every call in
a new loop on a new executor thread, and channels-redis keeps its connection pool per loop: each
live event paid for a loop, a thread and a fresh Redis connection (12% of a control worker's time
at 200 jobs reporting, benchmarks/cluster_scale.py). Here one daemon thread runs one loop; sends
are handed to it and waited for, so its pool's connections are reused.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from channels.layers import get_channel_layer

SEND_TIMEOUT_SECONDS = 10.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def _sending_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="channel-layer-sends", daemon=True)
            _thread.start()
        return _loop


def group_send(group: str, message: dict, timeout: float = SEND_TIMEOUT_SECONDS) -> None:
    """channel_layer.group_send(group, message) from sync code; raises what the send raised, or
    TimeoutError after `timeout` s (the send is then cancelled)."""
    future = asyncio.run_coroutine_threadsafe(get_channel_layer().group_send(group, message), _sending_loop())
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the channel layer took more than {timeout:.0f} s") from None
