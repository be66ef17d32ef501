"""Engine-test fixtures: a one-layer paged-attention toy model with the model contract.

The toy model (``model(batch, kv) -> logits [N, V] fp32``, docs/architecture.md) writes K/V through
``slot_mapping`` and reads them back through ``block_tables``, so scheduler / allocator / runner
bugs (wrong slots, wrong positions, stale pages) change its logits. It makes the engine's own
plumbing testable in milliseconds; the numerical must-show tests use the real model on tiny-random.
"""

from __future__ import annotations

import math

import pytest
import torch

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.model.batch import ForwardBatch, KVStorage

TOY_CONFIG = dict(architectures=["MiniMaxM2ForCausalLM"], hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=8,
                  vocab_size=64, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8,
                  max_position_embeddings=4096)


class ToyModel(torch.nn.Module):
    """Embedding-only attention: q/k/v = table[token] + sinusoid(position); one layer, fp32."""

    def __init__(self, config: MiniMaxM2Config, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        V, Hkv, D = config.vocab_size, config.num_key_value_heads, config.head_dim
        self.Hkv, self.D = Hkv, D
        self.wq, self.wk, self.wv = (torch.randn(V, Hkv, D, generator=g) for _ in range(3))
        self.out = torch.randn(Hkv * D, V, generator=g)
        self.calls: list[ForwardBatch] = []

    def pos(self, positions: torch.Tensor) -> torch.Tensor:
        f = torch.exp(-math.log(1000.0) * torch.arange(self.D) / self.D)
        return torch.sin(positions[:, None].double() * f).float()[:, None, :]   # [T, 1, D]

    def forward(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        self.calls.append(batch)
        S = kv.page_size
        q = self.wq[batch.tokens] + self.pos(batch.positions)                     # [T, Hkv, D]
        k = self.wk[batch.tokens] + self.pos(batch.positions)
        v = self.wv[batch.tokens]
        kv.k[0].view(-1, self.Hkv, self.D)[batch.slot_mapping] = (k / kv.k_scale[0]).to(kv.dtype)
        kv.v[0].view(-1, self.Hkv, self.D)[batch.slot_mapping] = (v / kv.v_scale[0]).to(kv.dtype)
        outs = []
        offs = batch.input_row_offsets.tolist()
        for b in range(batch.num_requests):
            ctx = int(batch.context_lens[b])
            pages = batch.block_tables[b, :-(-ctx // S)].long()
            K = kv.k[0][pages].float().reshape(-1, self.Hkv, self.D)[:ctx] * kv.k_scale[0]
            Vv = kv.v[0][pages].float().reshape(-1, self.Hkv, self.D)[:ctx] * kv.v_scale[0]
            qb = q[offs[b]:offs[b + 1]]                                               # [n, Hkv, D]
            scores = torch.einsum("nhd,chd->hnc", qb, K) / math.sqrt(self.D)
            mask = torch.arange(ctx)[None, :] > batch.positions[offs[b]:offs[b + 1], None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            outs.append(torch.einsum("hnc,chd->nhd", scores.softmax(-1), Vv).reshape(-1, self.Hkv * self.D))
        h = torch.cat(outs)                                                          # [T, Hkv*D]
        return (h[batch.logit_row_indices()] @ self.out).float()


@pytest.fixture()
def toy_config() -> MiniMaxM2Config:
    return MiniMaxM2Config.from_dict(dict(TOY_CONFIG))


@pytest.fixture()
def toy_model(toy_config) -> ToyModel:
    return ToyModel(toy_config)

