"""Shared fixtures: tiny checkpoints are built once per session into a temp dir (no downloads)."""

from __future__ import annotations

import os

# Triton's interpreter must be chosen before anything imports triton (a library under test may, e.g.
# nvidia-modelopt or torch.nn.attention.bias): its own @jit helpers are built at import and cannot run
# in the interpreter otherwise (docs/kernels.md §1). No GPU device node: run Triton kernels interpreted.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tests run tiny tensors: one intra-op thread avoids OpenMP barrier stalls, which made tiny
    forwards 5-20x slower on the shared 2-core machine. Subprocesses (servers, ranks) set their own.
    OMP_NUM_THREADS=1 (unless set) keeps an in-process ``LLM``, whose thread rule respects it
    (config/engine_args.py choose_num_threads), on one thread too."""
    before = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
