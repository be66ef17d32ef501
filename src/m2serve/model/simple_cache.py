"""A minimal paged-KV allocator that builds ForwardBatches (tests, benchmarks, simple callers).

The engine's real manager (engine/kv_cache.py: prefix hashes, preemption) replaces it; this one
hands out pages first-free and never evicts. Legend as in model/batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.model.batch import ForwardBatch, KVStorage, StepHost, host_tensor


@dataclass(slots=True)
class SimpleKVCache:
    """Pages of a KVStorage plus, per sequence id, its page list and cached token count.

    Build with :meth:`create`; each :meth:`batch` call appends the new tokens of the named
    sequences (allocating pages as needed) and returns the ForwardBatch for that step.
    """

    storage: KVStorage
    free_pages: list[int]
    pages: dict[object, list[int]] = field(default_factory=dict)
    lengths: dict[object, int] = field(default_factory=dict)

    @classmethod
    def create(cls, cfg: MiniMaxM2Config, num_pages: int, page_size: int = 16,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               num_kv_heads: int | None = None,
               kv_scales: tuple[list[float], list[float]] | None = None) -> SimpleKVCache:
        """Allocate ``num_pages`` pages of ``page_size`` tokens for every layer.

        ``num_kv_heads`` defaults to the config's (pass the rank's local count under TP).
        """
        k_scale, v_scale = kv_scales if kv_scales else (None, None)
        storage = KVStorage.allocate(cfg.num_hidden_layers, num_pages, page_size,
                                     num_kv_heads or cfg.num_key_value_heads, cfg.head_dim, dtype,
                                     device, k_scale, v_scale)
        return cls(storage, list(range(num_pages)))

    def batch(self, requests: list[tuple[object, list[int]]], return_n_logits: int = 1,
              replica_sizes: list[int] | None = None) -> ForwardBatch:
        """ForwardBatch appending ``new token ids`` to each ``(sequence id, ids)``, in that order.

        ``replica_sizes`` (a DP_EP step): how many of ``requests``, in order, each data-parallel
        replica runs; the batch then carries ``data_parallel_splits`` (docs/serving.md §6). Page ids
        come from this one pool either way (each rank writes only its own requests' pages).
        Raises RuntimeError when the pool has too few free pages (naming both counts), ValueError
        when ``replica_sizes`` does not add up to the requests.
        """
        splits = None
        if replica_sizes is not None:
            if sum(replica_sizes) != len(requests):
                raise ValueError(f"replica_sizes {replica_sizes} add up to {sum(replica_sizes)}, "
                                 f"not the {len(requests)} requests")
            splits = [0]
            for k in replica_sizes:
                splits.append(splits[-1] + k)
        S = self.storage.page_size
        device = self.storage.k[0].device
        tokens, positions, slots, offsets, ctx = [], [], [], [0], []
        for seq, new in requests:
            start = self.lengths.get(seq, 0)
            end = start + len(new)
            pages = self.pages.setdefault(seq, [])
            need = -(-end // S) - len(pages)
            if need > len(self.free_pages):
                raise RuntimeError(f"KV cache full: sequence {seq!r} needs {need} more pages, "
                                   f"{len(self.free_pages)} free")
            pages.extend(self.free_pages.pop(0) for _ in range(need))
            tokens.extend(new)
            positions.extend(range(start, end))
            slots.extend(pages[p // S] * S + p % S for p in range(start, end))
            offsets.append(offsets[-1] + len(new))
            ctx.append(end)
            self.lengths[seq] = end
        width = max(len(self.pages[s]) for s, _ in requests)
        table = [self.pages[s] + [0] * (width - len(self.pages[s])) for s, _ in requests]
        host = StepHost.build(offsets, ctx, [self.pages[s] for s, _ in requests], return_n_logits, splits)
        host.request_ids, host.tokens = [s for s, _ in requests], list(tokens)
        return ForwardBatch(
            tokens=host_tensor(tokens, torch.int64, device),
            positions=host_tensor(positions, torch.int64, device),
            input_row_offsets=host_tensor(offsets, torch.int32, device),
            slot_mapping=host_tensor(slots, torch.int64, device),
            block_tables=host_tensor(table, torch.int32, device),
            context_lens=host_tensor(ctx, torch.int32, device),
            return_n_logits=return_n_logits,
            data_parallel_splits=host_tensor(splits, torch.int64, device) if splits else None,
            host=host)

    def free(self, seq: object) -> None:
        """Return a sequence's pages to the pool."""
        self.free_pages.extend(self.pages.pop(seq, []))
        self.lengths.pop(seq, None)
