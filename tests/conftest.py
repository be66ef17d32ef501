"""Shared fixtures: tiny checkpoints are built once per session into a temp dir (no downloads)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tests run tiny tensors: one intra-op thread avoids OpenMP barrier stalls, which made tiny
    forwards 5-20x slower on the shared 2-core machine. Subprocesses (servers, ranks) set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_random_dir(tmp_path_factory):
    """BF16 `tiny-random` checkpoint directory (checkpoints/tiny_random.py)."""
    from m2serve.checkpoints.tiny_random import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("tiny-random") / "bf16", variant="bf16")


@pytest.fixture(scope="session")
def tiny_random_fp8_dir(tmp_path_factory):
    """The same weights in the official FP8 block format."""
    from m2serve.checkpoints.tiny_random import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("tiny-random") / "fp8", variant="fp8")
