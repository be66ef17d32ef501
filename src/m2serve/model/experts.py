"""Grouped SwiGLU experts over an expert range (spec/model.md §3 step 11, precision trap 2).

Legend: T tokens, k top-k, H hidden, E_loc experts held on this rank ([start, start + E_loc)
of the global E), I_loc this rank's intermediate size, N pairs routed to one expert.

(token, expert) pairs are sorted by expert and each ACTIVE expert runs one
:func:`expert_ffn` on its gathered tokens: no loop over all experts, no dense product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: ``w2 · (silu(w1·x) ⊙ (w3·x))``.

    x [N, H] act, w13 [2·I_loc, H] (w1 rows then w3 rows), w2 [H, I_loc] -> [N, H] act.
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class MiniMaxM2Experts(nn.Module):
    """Experts ``[start, start + E_loc)`` of the global E, intermediate slice of width I_loc.

    Parameters: ``w13`` [E_loc, 2·I_loc, H] (hub w1 rows then w3 rows), ``w2`` [E_loc, H, I_loc].
    Hub tensors are placed with :meth:`load_expert`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, start: int, num_local: int,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.start, self.num_local, self.intermediate_size = start, num_local, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype),
                               requires_grad=False)

    def load_expert(self, expert: int, which: str, w: torch.Tensor) -> None:
        """Copy hub tensor ``experts.{expert}.{which}.weight`` (global expert id) into place.

        Raises ValueError naming the expert and shapes if it is not held here or does not fit.
        """
        e = expert - self.start
        I = self.intermediate_size
        if not 0 <= e < self.num_local:
            raise ValueError(f"expert {expert} is not in this rank's range "
                             f"[{self.start}, {self.start + self.num_local})")
        dst = {"w1": self.w13.data[e, :I], "w3": self.w13.data[e, I:], "w2": self.w2.data[e]}[which]
        if dst.shape != w.shape:
            raise ValueError(f"expert {expert} {which}: got shape {list(w.shape)}, "
                             f"expected {list(dst.shape)}")
        dst.copy_(w)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H] act, ids [T, k] global expert ids, weights [T, k] f32 -> [T, H] f32.

        Combine: ``Σ_slots w_slot · y_slot`` in fp32 (no cast here; the caller reduces across
        ranks, then casts once). Slots routed to experts outside this rank's range add 0.
        """
        T, k = ids.shape
        flat = ids.reshape(-1) - self.start  # [T·k]
        pairs = torch.nonzero((flat >= 0) & (flat < self.num_local)).squeeze(1)
        y = h.new_zeros(T * k, h.shape[1])  # [T·k, H] act
        y[pairs] = self.rows(h[pairs // k], flat[pairs])
        return (y.view(T, k, h.shape[1]).float() * weights[..., None]).sum(1)

    def rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H] act, local_ids [N] int64 in [0, E_loc) -> [N, H] act: row n through expert
        ``start + local_ids[n]``; rows grouped by expert, one :func:`expert_ffn` per ACTIVE expert
        (also the receiving side of the EP exchange, model/collectives.py)."""
        order = torch.argsort(local_ids, stable=True)
        experts, counts = torch.unique_consecutive(local_ids[order], return_counts=True)
        out = torch.empty_like(x)
        s = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            sel = order[s: s + c]
            out[sel] = expert_ffn(x[sel], self.w13[e], self.w2[e])
            s += c
        return out
