"""The cross-rank steps of a decoder layer (docs/parallelism.md §3, §4).

Legend: T tokens of this rank's step, Tl rows a rank holds between the two TP_EP collectives
(T padded up to a multiple of P, divided by P), H hidden, k top-k, E experts, El experts per
rank, N (token, slot) pairs sent, M pairs received, P ranks.

Every function calls ``torch.distributed`` itself with ``parallel.group`` (tests count the calls
by patching ``torch.distributed``) and runs no collective on one rank. Every rank joins every
collective of every layer, also with zero local tokens (docs/parallelism.md §3: an absent
participant hangs the step).

Per layer and step (docs/parallelism.md §3 table): TP_TP 3 all_reduce; TP_EP default 1 all_reduce
+ 1 reduce_scatter + 1 all_gather + 3 all_to_all; TP_EP ep_use_allreduce 3 all_reduce; DP_EP
with EP 3 all_to_all; one rank or plain DP none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from m2serve.config.parallel import ParallelismMode, ParallelState


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: object) -> None:
    # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is its deprecated alias)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def uses_ep_exchange(parallel: ParallelState) -> bool:
    """True when the MoE dispatches tokens to the ranks owning their experts (all_to_all):
    DP_EP with ep_size > 1 and TP_EP without ``ep_use_allreduce`` (docs/parallelism.md §1, §3)."""
    if parallel.ep_size <= 1 or parallel.world_size <= 1:
        return False
    return parallel.mode is ParallelismMode.DP_EP or not parallel.ep_use_allreduce


def reduce_qk_stats(stats: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Phase 2 of the TP QK norm: ONE all_reduce(sum) of the per-token sums of squares of q and k,
    stats [T, 2] f32 (docs/parallelism.md §4). Identity without tensor parallelism."""
    if parallel.tp_size > 1:
        dist.all_reduce(stats, group=parallel.group)
    return stats


def attention_residual(x: torch.Tensor, attn: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Add the attention output to the residual (docs/parallelism.md §3 "after attention").

    x, attn [T, H] act (attn = this rank's o_proj partial sum under TP). Returns [T, H], or under
    TP_EP default the rank's [Tl, H] rows of ``x + Σ_r attn_r``: rank 0 adds the residual to its
    partial (so it is counted once), T is padded with zero rows to a multiple of P and one
    reduce_scatter leaves rank r rows [r·Tl, (r+1)·Tl).
    """
    if parallel.tp_size <= 1:
        return x + attn
    if not parallel.sequence_parallel:
        dist.all_reduce(attn, group=parallel.group)
        return x + attn
    P = parallel.world_size
    y = x + attn if parallel.rank == 0 else attn
    pad = (-y.shape[0]) % P
    if pad:
        y = torch.cat([y, y.new_zeros(pad, y.shape[1])])
    out = y.new_empty(y.shape[0] // P, y.shape[1])  # [Tl, H]
    _reduce_scatter(out, y.contiguous(), parallel.group)
    return out


def moe_residual(x: torch.Tensor, moe: torch.Tensor, parallel: ParallelState,
                 num_tokens: int) -> torch.Tensor:
    """Add the MoE output to the residual (docs/parallelism.md §3 "after MoE").

    x, moe [Tl, H] act under TP_EP default: ``x + moe`` on the rank's rows, then one all_gather back
    to [T, H] (the padding rows of :func:`attention_residual` dropped). Otherwise x, moe [T, H]
    and the result is ``x + moe`` (partial sums are reduced by :func:`reduce_moe_partial`).
    """
    y = x + moe
    if not parallel.sequence_parallel:
        return y
    out = y.new_empty(y.shape[0] * parallel.world_size, y.shape[1])  # [T + pad, H]
    _all_gather(out, y.contiguous(), parallel.group)
    return out[:num_tokens]


def reduce_moe_partial(m: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Sum MoE partial outputs m [T, H] over ranks: TP_TP (intermediate slices) and TP_EP with
    ``ep_use_allreduce`` (each rank's experts). Identity otherwise."""
    tp_partials = parallel.world_size > 1 and parallel.mode is not ParallelismMode.DP_EP
    if tp_partials and not uses_ep_exchange(parallel):
        dist.all_reduce(m, group=parallel.group)
    return m


def ep_moe(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local_experts: int,
           expert_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
           parallel: ParallelState) -> torch.Tensor:
    """Expert-parallel MoE: dispatch each (token, slot) to the rank owning its expert, run the
    experts there, send the outputs back and combine (docs/parallelism.md §3 "EP exchange").

    h [T, H] act, ids [T, k] int64 global expert ids, weights [T, k] f32. Rank r owns experts
    [r·El, (r+1)·El); ``expert_rows(x [M, H] act, local_ids [M] int64) -> [M, H] act`` runs this
    rank's experts. Three all_to_all_single: the per-rank pair counts, the dispatch (token rows
    with the local expert id appended as one extra column: exact in bf16 for El ≤ 256) and the
    combine. Returns ``Σ_slots w · y`` [T, H] f32 (docs/model.md §3 step 11; the caller casts once).

    The forward's one host read (tested in tests/parallel/test_grouped_paths.py):
    ``all_to_all_single`` takes its split sizes as Python ints, so the exchanged counts are read
    back once per layer (``send_counts`` / ``recv_counts``.tolist(), one device sync); the
    receiving rank then runs its rows grouped (``expert_rows`` = MiniMaxM2Experts.rows). A
    sync-free exchange needs a fixed-capacity buffer per rank (the planner's worst case), left
    for the GPU path.
    """
    T, k = ids.shape
    H, P, group = h.shape[1], parallel.ep_size, parallel.group
    flat = ids.reshape(-1)                                                 # [T·k]
    dest = torch.div(flat, num_local_experts, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)                               # pairs grouped by rank
    send_counts = torch.bincount(dest, minlength=P).to(torch.int64)        # [P]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    local_id = (flat[order] - dest[order] * num_local_experts).to(h.dtype)
    payload = torch.cat([h[order // k], local_id[:, None]], dim=1)         # [N, H+1]
    got = h.new_empty(sum(recv), H + 1)                                    # [M, H+1]
    dist.all_to_all_single(got, payload, recv, send, group=group)
    y = expert_rows(got[:, :H].contiguous(), got[:, H].to(torch.int64))    # [M, H] act
    back = h.new_empty(T * k, H)                                           # [N, H]
    dist.all_to_all_single(back, y.contiguous(), send, recv, group=group)
    slots = torch.empty_like(back)
    slots[order] = back                                                    # back to (token, slot)
    return (slots.view(T, k, H).float() * weights[..., None]).sum(1)       # [T, H] f32
