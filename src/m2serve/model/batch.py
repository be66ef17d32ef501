"""The model's inputs for one step: a ragged batch and the paged KV storage (docs/serving.md §6).

This file is the contract between the engine (which schedules, allocates pages and builds these)
and the model (which reads and writes them). Legend: T new tokens in the step, B requests,
N returned logit rows, P pages in the pool, S page size (tokens per page), Hkv KV heads on this
rank, D head_dim.

A batch carries its layout twice: as tensors (on the model's device) and as Python lists
(:class:`StepHost`), so the model sizes and indexes everything from the host copy and never reads
a device tensor back (no host sync inside ``model.forward``). Builders that
have the lists (engine/runner.py, model/simple_cache.py) pass them; otherwise the lists are read
from the tensors once, when the batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

BUFFER_GROWTH = 1.5  # over-allocation when the persistent step buffers grow


def host_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A Python list as a tensor on ``device``; on CUDA through pinned host memory with
    ``non_blocking=True`` (the copy is queued, the host does not wait)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class StepHost:
    """The step's ragged layout as Python ints (what the model sizes and indexes from).

    query_starts: [B+1] prefix sums of new-token counts (= input_row_offsets).
    context_lens: [B] tokens visible to each request after the step (cached + new).
    block_tables: [B] lists of page ids (at least ceil(context_lens[b] / S) each).
    logit_rows:   [N] indices into [T] of the returned logit rows, request order.
    logit_counts: [B] how many of those rows each request returns.
    data_parallel_splits: [dp+1] prefix sums of requests per data-parallel replica (requests in
                  replica order, docs/serving.md §6), or None when the batch is not split.
    request_ids:  [B] the engine's request ids (None when the builder has none): the multi-rank step
                  message sends each request's pages once and then only appends
                  (parallel/message.py); finished_request_ids: requests finished since the previous
                  step, whose pages the other ranks forget; tokens: [T] the new tokens (None when
                  the builder did not keep them).
    """

    query_starts: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    logit_counts: list[int]
    data_parallel_splits: list[int] | None = None
    request_ids: list[str] | None = None
    finished_request_ids: list[str] | None = None
    tokens: list[int] | None = None
    checked_page_size: int | None = None  # set by :meth:`check` (the forward does not check twice)

    @classmethod
    def build(cls, query_starts: list[int], context_lens: list[int], block_tables: list[list[int]],
              return_n_logits: int | list[int], data_parallel_splits: list[int] | None = None) -> StepHost:
        """From the lists; ``return_n_logits`` per request (or one int for all): the last
        min(n, new tokens) positions of each request return logits."""
        B = len(query_starts) - 1
        ns = [return_n_logits] * B if isinstance(return_n_logits, int) else return_n_logits
        rows: list[int] = []
        counts: list[int] = []
        for b in range(B):
            start, end = query_starts[b], query_starts[b + 1]
            k = min(int(ns[b]), end - start)
            rows.extend(range(end - k, end))
            counts.append(k)
        splits = list(data_parallel_splits) if data_parallel_splits is not None else None
        return cls(list(query_starts), list(context_lens), [list(t) for t in block_tables], rows, counts,
                   splits)

    @property
    def query_lens(self) -> list[int]:
        """[B] new tokens of each request."""
        q = self.query_starts
        return [q[b + 1] - q[b] for b in range(len(q) - 1)]

    def check(self, page_size: int) -> None:
        """Raise ValueError naming the request if its context is shorter than its new tokens or
        its block table holds fewer pages than its context needs. Runs once per page size: the
        runner checks while it builds the step, so the forward does not loop over the requests."""
        if self.checked_page_size == page_size:
            return
        for b, (n, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if c < n:
                raise ValueError(f"request {b}: context_lens={c} is shorter than its {n} new tokens")
            if -(-c // page_size) > len(self.block_tables[b]):
                raise ValueError(f"request {b}: context_lens={c} needs {-(-c // page_size)} pages of "
                                 f"{page_size}, its block table has {len(self.block_tables[b])}")
        self.checked_page_size = page_size


@dataclass(slots=True)
class StepBuffers:
    """Persistent buffers of a step's integer metadata, reused every step (docs/serving.md §6.1).

    ``host``: int64 [capacity], pinned on CUDA; ``dev``: int64 [capacity] on ``device``. A step
    writes all its fields into ``host`` (through a numpy view: no torch op per field), copies the
    used prefix to ``dev`` in ONE copy (``non_blocking`` from pinned memory on CUDA) and hands out
    views of ``dev``; int32 fields get one device-side cast of their section. Both grow by
    BUFFER_GROWTH when a step needs more. Views are valid until the next :meth:`load`. On CUDA
    the copy is queued (the host does not wait for it); a CUDA event recorded after it is waited
    on before the next load rewrites the host buffer (a step without logit rows reads nothing back,
    so its copy may still be in flight then).
    """

    device: torch.device
    host: torch.Tensor | None = None
    dev: torch.Tensor | None = None
    loads: int = field(default=0)  # steps loaded (tests)
    copied: object | None = None  # torch.cuda.Event recorded after the last copy (CUDA only)

    def load(self, int64_fields: list[list[int]], int32_fields: list[list[int]],
             f32_fields: tuple[list[float], ...] | list[list[float]] = ()) -> list[torch.Tensor]:
        """Write ``int64_fields``, ``int32_fields`` and ``f32_fields`` (flat lists) into the host
        buffer, copy once, return the device views in the same order (int64, int32, then float32,
        each 1-D of its list's length). float32 values sit two to an int64 slot (a view, no cast)."""
        sizes = [len(f) for f in int64_fields] + [len(f) for f in int32_fields]
        n_flat = sum(sizes)
        n_f32 = sum(len(f) for f in f32_fields)
        n = n_flat + (n_f32 + 1) // 2
        cuda = torch.device(self.device).type == "cuda"
        if self.host is None or self.host.numel() < n:
            cap = max(int(n * BUFFER_GROWTH), 64)
            self.host = torch.empty(cap, dtype=torch.int64, pin_memory=cuda)
            self.dev = torch.empty(cap, dtype=torch.int64, device=self.device)
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has read the host buffer
        h = self.host.numpy()
        o = 0
        for f in (*int64_fields, *int32_fields):
            h[o:o + len(f)] = f
            o += len(f)
        hf = h[n_flat:n].view(np.float32)
        o = 0
        for f in f32_fields:
            hf[o:o + len(f)] = f
            o += len(f)
        dev = self.dev[:n]
        dev.copy_(self.host[:n], non_blocking=cuda)
        if cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))
        self.loads += 1
        n64 = sum(sizes[:len(int64_fields)])
        low = dev[n64:n_flat].to(torch.int32)
        out, o = [], 0
        for i, k in enumerate(sizes):
            out.append(dev[o:o + k] if i < len(int64_fields) else low[o - n64:o - n64 + k])
            o += k
        floats, o = dev[n_flat:].view(torch.float32), 0
        for f in f32_fields:
            out.append(floats[o:o + len(f)])
            o += len(f)
        return out


def token_slot(block_table: list[int], position: int, page_size: int) -> int:
    """The KV slot of the token at ``position`` of a sequence whose pages are ``block_table``:
    ``table[p // S] * S + p % S`` (docs/serving.md §6; the one home of that arithmetic)."""
    return block_table[position // page_size] * page_size + position % page_size


def ragged_batch(new_tokens: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                 n_logits: list[int], page_size: int, device: torch.device | str = "cpu",
                 data_parallel_splits: list[int] | None = None,
                 request_ids: list[str] | None = None, buffers: StepBuffers | None = None) -> ForwardBatch:
    """The `ForwardBatch` of one step from host lists (docs/serving.md §6), request b computing
    ``new_tokens[b]`` at positions [context_lens[b] - n_b, context_lens[b]) into the slots
    ``table[p // S] * S + p % S`` of its ``block_tables[b]``, returning logits for its last
    ``n_logits[b]`` positions. Block tables are padded with page 0 (never read: context_lens bounds
    every read). The one home of the step layout arithmetic (engine/runner.py and the other ranks'
    parallel/message.py build through it).

    With ``buffers`` (the runner's :class:`StepBuffers`) every field, the logit rows included, is
    written into the persistent host buffer and reaches the device in one copy; the host lists are
    checked here (:meth:`StepHost.check`, ValueError naming the request), not in the forward.
    Without, each field is its own :func:`host_tensor` copy (other builders, tests)."""
    S = page_size
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    offsets = [0]
    for new in new_tokens:
        offsets.append(offsets[-1] + len(new))
    splits = data_parallel_splits
    host = StepHost.build(offsets, context_lens, block_tables, n_logits, splits)
    if buffers is not None:
        host.check(S)
    for new, L, table in zip(new_tokens, context_lens, block_tables, strict=True):
        pos = range(L - len(new), L)
        tokens.extend(new)
        positions.extend(pos)
        slots.extend(token_slot(table, p, S) for p in pos)
    width = max(max((len(t) for t in block_tables), default=0), 1)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    host.request_ids = list(request_ids) if request_ids is not None else None
    host.tokens = tokens
    if buffers is not None:
        flat_tables = [p for t in padded for p in t]
        tok, pos, slot, rows, n_log, *rest = buffers.load(
            [tokens, positions, slots, host.logit_rows, list(n_logits), *([splits] if splits else [])],
            [offsets, list(context_lens), flat_tables])
        offs, ctx, tables = rest[-3:]
        return ForwardBatch(tokens=tok, positions=pos, input_row_offsets=offs, slot_mapping=slot,
                            block_tables=tables.view(len(padded), width), context_lens=ctx,
                            return_n_logits=n_log, data_parallel_splits=rest[0] if splits else None,
                            host=host, logit_rows=rows)
    return ForwardBatch(
        tokens=host_tensor(tokens, torch.int64, device),                # [T]
        positions=host_tensor(positions, torch.int64, device),          # [T]
        input_row_offsets=host_tensor(offsets, torch.int32, device),    # [B+1]
        slot_mapping=host_tensor(slots, torch.int64, device),           # [T]
        block_tables=host_tensor(padded, torch.int32, device),          # [B, max_pages]
        context_lens=host_tensor(context_lens, torch.int32, device),    # [B]
        return_n_logits=host_tensor(n_logits, torch.int64, device),     # [B]
        data_parallel_splits=host_tensor(splits, torch.int64, device) if splits else None,  # [dp+1]
        host=host,
    )


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
    data_parallel_splits: int64 [dp+1] (DP only) prefix sums of requests per replica; its host copy
                       is ``host.data_parallel_splits``.
    host:              the same layout as Python lists (:class:`StepHost`); read from the tensors
                       at construction when not given (one device read, outside the model).
    logit_rows:        int64 [N] ``host.logit_rows`` on the device when the builder copied them
                       (the runner's persistent buffers), else None (the forward copies them).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    input_row_offsets: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    return_n_logits: int | torch.Tensor = 1
    data_parallel_splits: torch.Tensor | None = None
    host: StepHost | None = None
    logit_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.host is None:
            n = self.return_n_logits
            self.host = StepHost.build(
                self.input_row_offsets.tolist(), self.context_lens.tolist(), self.block_tables.tolist(),
                n.tolist() if isinstance(n, torch.Tensor) and n.dim() > 0 else int(n),
                self.data_parallel_splits.tolist() if self.data_parallel_splits is not None else None)

    @property
    def num_requests(self) -> int:
        """B."""
        return len(self.host.query_starts) - 1

    def logit_row_indices(self) -> torch.Tensor:
        """int64 [N]: indices into [T] of the positions whose logits are returned, request order."""
        return host_tensor(self.host.logit_rows, torch.int64, self.tokens.device)


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

    def append_pages(self, n: int) -> None:
        """Grow every layer's K and V pool by ``n`` zeroed pages at the end (the existing pages keep
        their contents; the pools get new addresses, so nothing may have recorded them yet)."""
        for pools in (self.k, self.v):
            for i, t in enumerate(pools):
                pools[i] = torch.cat([t, t.new_zeros((n, *t.shape[1:]))])

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
