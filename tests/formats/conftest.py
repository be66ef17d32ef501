"""Model tests run single-threaded: on the shared 2-core machine intra-op threads spin-wait
and make the tiny forwards ~20x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
