"""Decode at fixed shapes and addresses, captured in one CUDA graph per batch-size bucket
(docs/serving.md §6.2, §6.3).

Legend: b a bucket (the requests, and so the tokens, of a decode step padded to it), Bmax the
largest bucket, W the most pages one sequence holds (ceil(max_length / S)), S page size, V vocab.

A CUDA graph replays the kernels it recorded on the addresses and shapes it recorded, so
everything a decode step reads must sit at the same address on every step of a bucket and have
the bucket's shape: :class:`StaticDecodeBuffers` holds one int64 device buffer (and a pinned host
twin on CUDA) in which bucket b's fields sit at offsets that depend on b only — tokens, positions
and KV slots (int64 [b] each), then, viewed as int32 with no cast, the context lengths [b] and
the block table [b, W] padded to the full width W; the query starts (0..b, a decode row is one
token) are a constant. A step writes its rows and padding rows into the host buffer and copies
the bucket's prefix to the device in one copy. Padding rows decode token 0 at position 0 into a
page of their own (``pad_page``, outside every allocator) and their logits are dropped.

:class:`CUDAGraphRunner` runs ``MiniMaxM2ForCausalLM.forward_decode`` on those views: on CUDA it
captures it once per bucket at start-up and replays it; elsewhere (CPU) it runs the same static
forward eagerly, which is how the static path is tested without a GPU. The RoPE table is
computed once for max_length positions and never replaced (a graph would keep reading a freed
table), the attention kernel's split count follows the bucket and max_length only, so nothing a
captured kernel reads changes between replays but the buffers' contents.

Under TP_TP every rank holds one :class:`CUDAGraphRunner` over its own shard and pool, built and
captured in the same order (the all-reduces inside the forward are recorded on every rank), and
every step runs the bucket rank 0 chose on every rank (parallel/worker.py; docs/serving.md §6.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m2serve.model.batch import KVStorage, token_slot

DECODE_BUCKET_STEP = 16  # decode batch-size buckets: 1, 2, 4, 8, 16, then steps of this
GRAPH_WARMUP_RUNS = 2  # eager runs of a bucket before its capture (Triton compiles, libraries pick kernels)


def decode_buckets(max_batch_size: int) -> list[int]:
    """The decode batch sizes a CUDA graph is captured for (docs/serving.md §6.2): 1, 2, 4, 8, 16,
    then every multiple of DECODE_BUCKET_STEP, up to ``max_batch_size`` (always the last bucket)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    out += list(range(DECODE_BUCKET_STEP, max_batch_size, DECODE_BUCKET_STEP))
    return out + [max_batch_size]


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``batch_size`` (None when the batch exceeds every bucket)."""
    return next((b for b in buckets if b >= batch_size), None)


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """Bucket b's device views, at the same addresses on every step (docs/serving.md §6.3).

    tokens:       int64 [b] the token each row decodes (0 on padding rows).
    positions:    int64 [b] its position (context length - 1; 0 on padding rows).
    slot_mapping: int64 [b] where its K/V go: ``page * S + offset`` (the padding page's slot 0).
    context_lens: int32 [b] tokens visible after the step (1 on padding rows).
    block_tables: int32 [b, W] page ids; entries past a row's context are never read.
    query_starts: int32 [b+1] 0, 1, ..., b (one new token per row).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_starts: torch.Tensor

    @property
    def batch_size(self) -> int:
        """b."""
        return int(self.tokens.shape[0])


class StaticDecodeBuffers:
    """The decode steps' inputs at fixed addresses, one layout per bucket (module docstring).

    ``host`` int64 [n(Bmax)] (pinned on CUDA) and ``dev`` int64 [n(Bmax)] on ``device``, with
    n(b) = 3b + ceil((b + b·W) / 2) elements; bucket b's views (:attr:`views`) are made once here.
    Raises ValueError naming the argument for an empty bucket list or a non-positive width.
    """

    def __init__(self, buckets: Sequence[int], max_pages: int, page_size: int, pad_page: int,
                 device: torch.device | str):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets={list(buckets)}: give batch sizes >= 1")
        if max_pages < 1:
            raise ValueError(f"max_pages={max_pages} must be >= 1")
        self.buckets = sorted(buckets)
        self.width, self.page_size, self.pad_page = max_pages, page_size, pad_page
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        n = self.size(self.buckets[-1])
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(n, dtype=torch.int64, device=self.device)
        starts = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=self.device)
        self.views = {b: self._views(b, starts) for b in self.buckets}
        self.copied: object | None = None  # torch.cuda.Event after the last copy (CUDA only)
        self.loads = 0

    def size(self, b: int) -> int:
        """n(b): int64 elements bucket b's fields occupy."""
        return 3 * b + -(-(b + b * self.width) // 2)

    def _views(self, b: int, starts: torch.Tensor) -> DecodeInputs:
        d = self.dev
        low = d[3 * b:self.size(b)].view(torch.int32)
        return DecodeInputs(tokens=d[:b], positions=d[b:2 * b], slot_mapping=d[2 * b:3 * b],
                            context_lens=low[:b], block_tables=low[b:b + b * self.width].view(b, self.width),
                            query_starts=starts[:b + 1])

    def load(self, b: int, tokens: Sequence[int], context_lens: Sequence[int],
             block_tables: Sequence[Sequence[int]]) -> DecodeInputs:
        """Write ``len(tokens)`` decode rows (row i: ``tokens[i]`` at position ``context_lens[i] - 1``
        over ``block_tables[i]``) and b - len(tokens) padding rows, copy bucket b's prefix once,
        return its views. Raises ValueError naming the row for a context < 1, a table shorter
        than its context needs or a context wider than W pages, for more rows than b, and for
        lists of different lengths."""
        k, S, W = len(tokens), self.page_size, self.width
        if b not in self.views or k > b:
            raise ValueError(f"bucket {b} (of {self.buckets}) for {k} rows")
        if len(context_lens) != k or len(block_tables) != k:
            raise ValueError(f"{k} tokens, {len(context_lens)} context_lens, {len(block_tables)} "
                             "block_tables: give one of each per row")
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has read the host buffer
        h = self.host.numpy()
        low = h[3 * b:self.size(b)].view(np.int32)
        tables = low[b:b + b * W].reshape(b, W)
        for i, (L, table) in enumerate(zip(context_lens, block_tables, strict=True)):
            pages = -(-L // S)
            if L < 1 or pages > len(table) or pages > W:
                raise ValueError(f"row {i}: context_lens={L} needs {pages} pages of {S}; its block table "
                                 f"has {len(table)}, the static width is {W}")
            tables[i, :pages] = table[:pages]
            h[2 * b + i] = token_slot(table, L - 1, S)
        h[:k] = tokens
        h[k:b] = 0
        h[b:b + k] = context_lens
        h[b:b + k] -= 1
        h[b + k:2 * b] = 0
        h[2 * b + k:3 * b] = token_slot([self.pad_page], 0, S)
        low[:k] = context_lens
        low[k:b] = 1
        tables[k:, 0] = self.pad_page
        n = self.size(b)
        cuda = self.device.type == "cuda"
        self.dev[:n].copy_(self.host[:n], non_blocking=cuda)
        if cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))
        self.loads += 1
        return self.views[b]


class CUDAGraphRunner:
    """Decode steps of ``model`` (a ``MiniMaxM2ForCausalLM`` on the triton attention backend: one
    rank, or one TP_TP rank's shard) at the buckets' fixed shapes (docs/serving.md §6.3).

    ``capture=True`` (CUDA only) records one ``torch.cuda.CUDAGraph`` per bucket now, largest first,
    in one shared memory pool, after GRAPH_WARMUP_RUNS eager runs on a side stream; :meth:`run`
    then replays. ``capture=False`` runs the same static forward eagerly (the CPU test path). The
    KV pools of ``kv`` must not be reallocated afterwards (the graphs hold their addresses), and
    ``pad_page`` must be a page of them no allocator hands out. Raises ValueError for a model on
    the torch attention backend (its per-request loop cannot be recorded) or capture off CUDA
    (:meth:`check`). Under TP_TP the ranks' forwards all-reduce, so every rank must construct its
    runner at the same time with the same buckets (the capture records the collectives).
    """

    def __init__(self, model, kv: KVStorage, buckets: Sequence[int], max_length: int, pad_page: int,
                 capture: bool):
        self.check(model, kv, capture)
        device = kv.k[0].device
        self.model, self.kv, self.max_length = model, kv, max_length
        self.buffers = StaticDecodeBuffers(buckets, -(-max_length // kv.page_size), kv.page_size, pad_page,
                                           device)
        self.cos, self.sin = model.rope_table(max_length, device)  # once, never replaced
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @staticmethod
    def check(model, kv: KVStorage, capture: bool) -> None:
        """Raise ValueError when ``model`` is not on the triton attention backend or ``capture`` is
        asked off CUDA (what the constructor refuses; rank 0 of a TP_TP model asks before it tells
        the other ranks to build theirs)."""
        if getattr(model, "attention_kernel", None) is None:
            raise ValueError("CUDA-graph decode needs attention_backend='triton' (the torch backend "
                             "loops over the requests on the host)")
        device = kv.k[0].device
        if capture and device.type != "cuda":
            raise ValueError(f"capture=True: CUDA graphs need a CUDA device, the KV pool is on {device}")

    @property
    def buckets(self) -> list[int]:
        """The captured (or statically run) batch sizes, ascending."""
        return self.buffers.buckets

    def forward(self, b: int) -> torch.Tensor:
        """The static forward of bucket b on its current buffer contents -> logits [b, V] fp32."""
        return self.model.forward_decode(self.buffers.views[b], self.kv, self.cos, self.sin, self.max_length)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.kv.k[0].device)
        for b in reversed(self.buckets):
            self.buffers.load(b, [], [], [])  # padding rows only: valid inputs, writes the padding page
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(GRAPH_WARMUP_RUNS):
                    self.forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()  # no warm-up collective in flight when the capture begins
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, tokens: Sequence[int], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]], bucket: int | None = None) -> torch.Tensor:
        """One decode step of ``len(tokens)`` rows (:meth:`StaticDecodeBuffers.load`) -> their
        logits [len(tokens), V] fp32, a view of the bucket's output valid until the next step.
        ``bucket``: the bucket to run (the other TP_TP ranks pass rank 0's choice), default the
        smallest that holds the rows. Raises ValueError for more rows than the largest bucket (or
        than ``bucket``) and for a ``bucket`` that is not one of :attr:`buckets`."""
        b = bucket_for(len(tokens), self.buckets) if bucket is None else bucket
        if b is None:
            raise ValueError(f"{len(tokens)} decode rows: the largest bucket is {self.buckets[-1]}")
        self.buffers.load(b, tokens, context_lens, block_tables)
        graph = self.graphs.get(b)
        if graph is None:
            return self.forward(b)[:len(tokens)]
        graph.replay()
        return self.outputs[b][:len(tokens)]

    def run_step(self, tokens: Sequence[int], context_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], request_ids: Sequence[str],
                 finished_request_ids: Sequence[str]) -> torch.Tensor:
        """The engine's call (engine/runner.py): :meth:`run` at the smallest bucket. The request ids
        (and those finished since the last step) are for a multi-rank runner, which sends them to
        the other ranks (parallel/worker.py ``TPStaticDecode``); one rank has none to tell."""
        return self.run(tokens, context_lens, block_tables)
