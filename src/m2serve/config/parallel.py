"""Parallelism modes and the one function that selects them (docs/parallelism.md §1).

Pure: no torch.distributed here. The model, every block, shard plans and the memory planner all
consult :func:`select_parallelism_mode`; nobody re-derives the rule inline.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.quant import MXFP4_GROUP, NVFP4_GROUP

log = logging.getLogger(__name__)


class ParallelismMode(enum.Enum):
    """How attention and MoE are split across devices (docs/parallelism.md §1)."""

    TP_TP = "TP_TP"  # heads split; every expert's intermediate dim split
    TP_EP = "TP_EP"  # heads split; whole experts per rank
    DP_EP = "DP_EP"  # attention replicated, each device its own requests; EP inside the MoE


def select_parallelism_mode(num_devices: int, data_parallel_degree: int, ep_size: int) -> ParallelismMode:
    """Select the parallelism mode (docs/parallelism.md §1, conditions checked in order).

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
    """True iff the batch is split across devices (docs/parallelism.md §1)."""
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
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank is (0 unless the batch is split, docs/parallelism.md §1)."""
        return self.rank if dp_attention(self.mode, self.world_size) else 0

    @property
    def sequence_parallel(self) -> bool:
        """TP_EP default: hidden states are reduce-scattered over tokens between attention and MoE."""
        return self.mode is ParallelismMode.TP_EP and self.world_size > 1 and not self.ep_use_allreduce


# --- what slice of the model one rank holds (docs/parallelism.md §2) ------------------------------


@dataclass(frozen=True, slots=True)
class ShardRanges:
    """Half-open ranges of the global model one rank holds (docs/parallelism.md §2).

    q_heads / kv_heads: attention heads [start, end) of Hq / Hkv (whole heads; q_norm / k_norm
    gamma and o_proj columns follow the same heads). experts: [start, end) of E held by this rank.
    intermediate: [start, end) of every held expert's I (split only under TP_TP).
    The model sizes its modules from these; parallel/shard.py reads the same slices from disk.
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    experts: tuple[int, int]
    intermediate: tuple[int, int]


def shard_ranges(config: MiniMaxM2Config, state: ParallelState) -> ShardRanges:
    """The slices of ``config``'s tensors that rank ``state.rank`` holds (docs/parallelism.md §2).

    Assumes a deployment accepted by :func:`validate_deployment` (divisibility is not re-checked).
    """
    tp, r = state.tp_size, state.tp_rank
    hq, hkv = config.num_attention_heads // tp, config.num_key_value_heads // tp
    E, I = config.num_local_experts, config.intermediate_size
    if state.ep_size > 1:
        e = E // state.ep_size
        experts = (state.ep_rank * e, (state.ep_rank + 1) * e)
    else:
        experts = (0, E)
    if state.mode is ParallelismMode.TP_TP and tp > 1:
        i = I // tp
        inter = (r * i, (r + 1) * i)
    else:
        inter = (0, I)
    return ShardRanges(q_heads=(r * hq, (r + 1) * hq), kv_heads=(r * hkv, (r + 1) * hkv),
                       experts=experts, intermediate=inter)


# --- startup validation (docs/parallelism.md §5) ---------------------------------------------------

# Quantised-expert group widths along I that a TP split must keep whole (docs/parallelism.md §5 V7).
# FP8 block experts are not listed: a slice may split a 128-row band (docs/checkpoints.md §6).
_EXPERT_BLOCK = {"nvfp4": ("NVFP4-quantised", NVFP4_GROUP), "mxfp4": ("MXFP4-quantised", MXFP4_GROUP)}


@dataclass(frozen=True, slots=True)
class Deployment:
    """A validated deployment: the mode and degrees every rank uses (docs/parallelism.md §1, §5).

    tp_size: attention heads split this many ways (world size under TP_TP / TP_EP, 1 under DP_EP).
    ep_size: whole experts split this many ways (1 = every rank holds every expert).
    max_batch_size: clamped to max_batch_input_tokens (V9).
    """

    mode: ParallelismMode
    world_size: int
    tp_size: int
    ep_size: int
    data_parallel_degree: int
    ep_use_allreduce: bool
    max_batch_size: int

    def state(self, rank: int, group: Any = None) -> ParallelState:
        """The :class:`ParallelState` of ``rank`` (0 ≤ rank < world_size) with process group ``group``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of {self.world_size} ranks")
        return ParallelState(
            mode=self.mode, world_size=self.world_size, rank=rank, tp_size=self.tp_size,
            tp_rank=rank if self.tp_size > 1 else 0, ep_size=self.ep_size,
            ep_rank=rank if self.ep_size > 1 else 0, data_parallel_degree=self.data_parallel_degree,
            ep_use_allreduce=self.ep_use_allreduce, group=group)


def _encoding_key(encoding: str) -> str:
    e = encoding.lower()
    for key in ("nvfp4", "mxfp4", "fp8"):
        if key in e:
            return key
    return "dense"


def validate_deployment(config: MiniMaxM2Config, num_devices: int, data_parallel_degree: int = 1,
                        ep_size: int = 1, *, encoding: str = "bf16", ep_use_allreduce: bool = False,
                        device_memory_utilization: float = 0.9, max_batch_size: int = 256,
                        max_batch_input_tokens: int = 8192, num_nodes: int = 1) -> Deployment:
    """Check the startup rules V1–V10 of docs/parallelism.md §5 before any weight is read.

    num_devices: the world size (devices per node × nodes). encoding: the checkpoint's weight
    format ("bf16"/"dense", "fp8", "nvfp4", "mxfp4"; any string containing those keys).
    num_nodes only shapes messages (V10: nothing is refused for being multi-node).

    Returns the :class:`Deployment` (mode from :func:`select_parallelism_mode`). Raises
    ValueError naming the numbers and the fix for V1–V5, V7, V8 and for non-positive degrees.
    V6 (plain data parallelism with ep_size 1) is accepted; whether it fits is the planner's call.
    V9 clamps max_batch_size to max_batch_input_tokens with an info log.
    """
    P, dp = num_devices, data_parallel_degree
    for name, val in (("num_devices", P), ("data_parallel_degree", dp), ("ep_size", ep_size),
                      ("num_nodes", num_nodes), ("max_batch_input_tokens", max_batch_input_tokens),
                      ("max_batch_size", max_batch_size)):
        if val < 1:
            raise ValueError(f"{name}={val} must be a positive integer")
    # V8
    if not 0 < device_memory_utilization <= 1:
        raise ValueError(f"device_memory_utilization={device_memory_utilization} must be in (0, 1]")
    # V1
    if dp not in (1, P):
        raise ValueError(f"data_parallel_degree={dp} must be 1 or the number of devices ({P}); "
                         f"set data_parallel_degree={P} for data parallelism or 1 for tensor parallelism")
    # V4: one EP group over the whole world
    if ep_size > 1 and ep_size != P:
        per_node = (f"{P // num_nodes} per node × {num_nodes} nodes" if num_nodes > 1
                    else "devices per node × nodes")
        raise ValueError(f"ep_size={ep_size} does not match the {P} devices of this deployment "
                         f"({per_node}); set ep_size={P}")
    E, I = config.num_local_experts, config.intermediate_size
    # V5
    if ep_size > 1 and E % ep_size:
        raise ValueError(f"num_local_experts={E} is not divisible by ep_size={ep_size}; "
                         f"every rank must own the same number of whole experts")
    mode = select_parallelism_mode(P, dp, ep_size)
    tp = P if mode is not ParallelismMode.DP_EP else 1
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads

    def ok_tp(t: int) -> bool:  # every rule below, so that a suggested degree is never refused
        return (Hq % t == 0 and Hkv % t == 0
                and (mode is not ParallelismMode.TP_TP or _expert_split_ok(I, t, encoding)))

    fits = [t for t in range(1, P + 1) if ok_tp(t)]
    hint = f"use a tensor parallel degree in {fits} or data_parallel_degree={P}"
    # V3
    if Hq % tp:
        raise ValueError(f"Number of attention heads ({Hq}) must be divisible by the tensor parallel "
                         f"degree ({tp}); {hint}")
    # V2 (KV heads are never replicated)
    if Hkv % tp:
        raise ValueError(f"Number of KV heads ({Hkv}) must be divisible by the tensor parallel degree "
                         f"({tp}); {hint}")
    if mode is ParallelismMode.TP_TP and tp > 1:
        if I % tp:
            raise ValueError(f"intermediate_size={I} is not divisible by the tensor parallel degree "
                             f"({tp}); use ep_size={P} or {hint}")
        # V7
        kind = _EXPERT_BLOCK.get(_encoding_key(encoding))
        if kind is not None and (I // tp) % kind[1]:
            smaller = [t for t in fits if t < tp]
            alt = f" or tp ≤ {max(smaller)}" if smaller and max(smaller) > 1 else ""
            raise ValueError(f"{kind[0]} experts cannot be split {tp} ways ({I // tp} per rank is not a "
                             f"multiple of {kind[1]}); use ep_size={P}{alt}")
    # V10: ep_use_allreduce is allowed on any number of nodes; it only changes TP_EP.
    if ep_use_allreduce and mode is not ParallelismMode.TP_EP:
        log.warning("ep_use_allreduce has no effect in %s (it only changes TP_EP)", mode.value)
    # V9
    if max_batch_size > max_batch_input_tokens:
        log.info("max_batch_size=%d clamped to max_batch_input_tokens=%d", max_batch_size,
                 max_batch_input_tokens)
        max_batch_size = max_batch_input_tokens
    return Deployment(mode=mode, world_size=P, tp_size=tp, ep_size=ep_size if ep_size > 1 else 1,
                      data_parallel_degree=dp, ep_use_allreduce=ep_use_allreduce,
                      max_batch_size=max_batch_size)


def _expert_split_ok(I: int, tp: int, encoding: str) -> bool:
    kind = _EXPERT_BLOCK.get(_encoding_key(encoding))
    return I % tp == 0 and (kind is None or (I // tp) % kind[1] == 0)
