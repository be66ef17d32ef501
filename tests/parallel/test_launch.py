"""Process launch, gloo groups, collective timeouts and crash detection (serving.md §1, issue 8 item 2)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from m2serve.parallel.launch import WorkerError, run_ranks


def _sum_ranks(rank: int, world: int) -> tuple[float, int, str, int]:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t), torch.get_num_threads(), dist.get_backend(), dist.get_world_size()


def test_gloo_group_one_thread_per_rank():  # 4 ranks: tests/parallel/test_modes.py
    out = run_ranks(_sum_ranks, 2, timeout_s=30)
    assert out == [(3.0, 1, "gloo", 2)] * 2  # 1 + 2


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
