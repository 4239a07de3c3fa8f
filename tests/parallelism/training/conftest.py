"""One intra-op thread for these tiny models: with more, OpenMP threads spin against each other on a busy
2-core machine and a 1-second training test takes minutes; one thread is as fast when the machine is idle."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
