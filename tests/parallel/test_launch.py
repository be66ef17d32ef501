"""Collective timeouts and crash detection of spawned ranks (issue 8 item 2); the gloo group itself
(one thread per rank, 4 ranks) is checked in test_modes.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from m2serve.parallel.launch import WorkerError, run_ranks

pytestmark = pytest.mark.slow  # starts several rank processes


def _rank1_killed(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone


def _rank1_stalls(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def test_killed_rank_is_reported_quickly():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died without a result \(killed by signal 9\)"):
        run_ranks(_rank1_killed, 2, timeout_s=30)
    assert time.monotonic() - t0 < 25


def test_collective_timeout_turns_a_stall_into_an_error():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0 failed:(.|\n)*(Timed out|timeout|timed out)"):
        run_ranks(_rank1_stalls, 2, timeout_s=3)
    assert time.monotonic() - t0 < 30
