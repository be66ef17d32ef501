"""fp32 sigmoid router with correction bias (docs/model.md §3 step 10, precision trap 1).

Legend: T tokens, H hidden, E experts (global; the router is replicated on every rank), k top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from m2serve.kernels.ops import dense_linear


def route(h: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick k experts per token; the bias only selects, the weights are unbiased sigmoids.

    h [T, H] act, gate [E, H] f32, bias [E] f32 or None -> (weights [T, k] f32 summing to 1,
    ids [T, k] int64). ``logits = h.float() @ gateᵀ``; ``s = sigmoid(logits)``;
    ``ids = topk(s + bias)``; ``w = s[ids] / Σ s[ids]``. ``batch_invariant``: the logits one GEMV per
    row (kernels/ops.py ``dense_linear``; fp32 GEMMs of another row count differ in the last bits,
    which can flip a near tie).
    """
    scores = torch.sigmoid(dense_linear(h.float(), gate, batch_invariant))  # [T, E] f32
    choice = scores + bias if bias is not None else scores
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices  # [T, k]
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True), ids


class MiniMaxM2Router(nn.Module):
    """Router gate: ``weight`` [E, H] held in fp32 whatever the file stores (hub ``gate.weight``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.batch_invariant = False  # the batch-invariant mode (docs/model.md §7), set after load
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`route`."""
        return route(h, self.weight, bias, self.top_k, self.batch_invariant)
