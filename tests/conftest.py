"""Shared fixtures: tiny checkpoints are built once per session into a temp dir (no downloads)."""

from __future__ import annotations

import pytest


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
