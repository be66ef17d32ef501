"""The model's inputs for one step: a ragged batch and the paged KV storage (docs/serving.md §6).

This file is the contract between the engine (which schedules, allocates pages and builds these)
and the model (which reads and writes them). Legend: T new tokens in the step, B requests,
P pages in the pool, S page size (tokens per page), Hkv KV heads on this rank, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    """One step's ragged batch (docs/serving.md §6).

    tokens:            int64 [T]   new tokens of all requests, concatenated in request order.
    positions:         int64 [T]   cached_len[b] + i for the i-th new token of request b.
    input_row_offsets: int32 [B+1] prefix sums of new-token counts; [0] = 0, [B] = T.
    slot_mapping:      int64 [T]   where each new token's K/V is written: page * S + offset.
    block_tables:      int32 [B, max_pages] page ids of each request, in order (padding unread).
    context_lens:      int32 [B]   tokens visible to each request after this step (cached + new).
    return_n_logits:   int or int64 [B]: logits are returned for the last min(n, new tokens)
                       positions of each request (default 1 = last token; a large n = every new
                       position, for prompt logprobs). Honoured, unlike MAX (docs/serving.md §11.3).
    data_parallel_splits: int64 [dp+1] (DP only) prefix sums of requests per replica.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    input_row_offsets: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    return_n_logits: int | torch.Tensor = 1
    data_parallel_splits: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        """B."""
        return int(self.input_row_offsets.numel()) - 1

    def logit_row_indices(self) -> torch.Tensor:
        """int64 [N]: indices into [T] of the positions whose logits are returned, request order."""
        offs = self.input_row_offsets.tolist()
        n = self.return_n_logits
        ns = n.tolist() if isinstance(n, torch.Tensor) else [n] * (len(offs) - 1)
        idx: list[int] = []
        for b in range(len(offs) - 1):
            start, end = offs[b], offs[b + 1]
            idx.extend(range(max(start, end - int(ns[b])), end))
        return torch.tensor(idx, dtype=torch.int64, device=self.tokens.device)


@dataclass(slots=True)
class KVStorage:
    """Paged KV cache tensors for every layer of this rank (the engine allocates pages in it).

    k[l], v[l]: [P, S, Hkv, D] of ``dtype`` (bfloat16, float32 or float8_e4m3fn). K is stored
    after QK norm and RoPE, V raw (docs/model.md §3 step 6). For float8_e4m3fn the stored value is
    ``x / scale`` and reads multiply by the per-layer scale (k_scale[l], v_scale[l]; 1.0 unless the
    checkpoint ships k_scale / v_scale, docs/checkpoints.md §3.6).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    k_scale: list[float]
    v_scale: list[float]

    @classmethod
    def allocate(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 k_scale: list[float] | None = None, v_scale: list[float] | None = None) -> KVStorage:
        """Zero-filled pool of ``num_pages`` pages per layer. Bytes = 2·L·P·S·Hkv·D·itemsize."""
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            page_size=page_size,
            k_scale=list(k_scale) if k_scale else [1.0] * num_layers,
            v_scale=list(v_scale) if v_scale else [1.0] * num_layers,
        )

    @property
    def num_pages(self) -> int:
        """P."""
        return int(self.k[0].shape[0]) if self.k else 0

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of the pages."""
        return self.k[0].dtype

    def nbytes(self) -> int:
        """Total bytes held by the K and V pages of all layers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
