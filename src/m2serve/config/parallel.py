"""Parallelism modes and the one function that selects them (spec/serving.md §1).

Pure: no torch.distributed here. The model, every block, shard plans and the memory planner all
consult :func:`select_parallelism_mode`; nobody re-derives the rule inline.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ParallelismMode(enum.Enum):
    """How attention and MoE are split across devices (spec/serving.md §1)."""

    TP_TP = "TP_TP"  # heads split; every expert's intermediate dim split
    TP_EP = "TP_EP"  # heads split; whole experts per rank
    DP_EP = "DP_EP"  # attention replicated, each device its own requests; EP inside the MoE


def select_parallelism_mode(num_devices: int, data_parallel_degree: int, ep_size: int) -> ParallelismMode:
    """Select the parallelism mode (spec/serving.md §1, conditions checked in order).

    ``num_devices`` is the world size: all ranks on all nodes. One device -> DP_EP (local MoE,
    no collectives); data_parallel_degree > 1 -> DP_EP; num_devices > 1 and ep_size > 1 -> TP_EP;
    otherwise TP_TP.
    """
    if num_devices <= 1:
        return ParallelismMode.DP_EP
    if data_parallel_degree > 1:
        return ParallelismMode.DP_EP
    if ep_size > 1:
        return ParallelismMode.TP_EP
    return ParallelismMode.TP_TP


def dp_attention(mode: ParallelismMode, num_devices: int) -> bool:
    """True iff the batch is split across devices (spec/serving.md §1)."""
    return mode is ParallelismMode.DP_EP and num_devices > 1


@dataclass(frozen=True, slots=True)
class ParallelState:
    """What one rank knows about the deployment; passed to the model as an argument.

    ``tp_size``/``tp_rank`` split attention heads (and expert intermediate dims under TP_TP);
    ``ep_size``/``ep_rank`` split whole experts. ``group`` is the torch.distributed process group
    (None = default group); the model calls ``torch.distributed`` functions with it directly.
    A single process is ``ParallelState()``: world 1, mode DP_EP, no collectives.
    """

    mode: ParallelismMode = ParallelismMode.DP_EP
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    data_parallel_degree: int = 1
    ep_use_allreduce: bool = False
    group: Any = None

    @property
    def distributed(self) -> bool:
        """True when collectives run (more than one rank)."""
        return self.world_size > 1
