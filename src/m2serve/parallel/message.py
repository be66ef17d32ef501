"""The per-step message from rank 0 to the other ranks: what changed since the previous step
(docs/serving.md §6, "step message"; the shape of vLLM v1's ``SchedulerOutput``).

Rank 0's :class:`MessageEncoder` remembers the block table each request has on the other ranks; a
step's :class:`StepMessage` carries, per scheduled request, its id, its new tokens (the prefill
chunk or the one decode token: a prompt travels once, chunk by chunk), its context length and
logit rows, and only the page ids appended since the previous step (the whole table once, when the
request first runs or after preemption re-allocated it), plus the ids of requests that finished, whose
tables the other ranks forget. Every number travels as int64 (fixed width), so outside the steps
that append a page the message is the same size at a context of 100 or 10,000 tokens. The other
ranks' :class:`MessageDecoder` rebuilds the `ForwardBatch` from it with model/batch.py
``ragged_batch``, the builder the engine's runner uses.

A static decode step (TP_TP under CUDA graphs, docs/serving.md §6.3) is the same message with
``bucket`` set: every request one new token; the other ranks load the rows into their fixed decode
buffers at that bucket (padding the rest) instead of building a batch, and the page deltas are
applied to the tables exactly as for any other step (:meth:`MessageDecoder.apply`), so an eager
step after static ones sends only what changed since.

Legend: B requests, T new tokens.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import numpy as np
import torch

from m2serve.model.batch import ForwardBatch, ragged_batch

# columns of StepMessage.counts
NEW, CONTEXT, LOGITS, PAGES, RESET = range(5)


def _i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i8").tolist()


@dataclass(slots=True)
class StepMessage:
    """One step for the other ranks.

    request_ids: [B] scheduled requests, batch order. counts: int64 [B, 5] little-endian bytes, per
    request: new tokens, context length after the step, logit rows, pages appended, reset (1: the
    appended pages replace its table). tokens: int64 [T] the new tokens, batch order. pages: int64
    the appended page ids, batch order. data_parallel_splits: [dp+1] or None.
    finished_request_ids: requests to forget (before this step's requests are applied).
    bucket: None for a step the other ranks run eagerly from its `ForwardBatch`; b for a static
    decode step padded to bucket b (every request one new token; docs/serving.md §6.3).
    """

    request_ids: list
    counts: bytes
    tokens: bytes
    pages: bytes
    data_parallel_splits: list[int] | None
    finished_request_ids: list
    bucket: int | None = None

    @property
    def nbytes(self) -> int:
        """Size of the message as pickled for ``broadcast_object_list``, in bytes."""
        return len(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass(slots=True)
class MessageEncoder:
    """Rank 0's side: the block table each request has on the other ranks (``sent``)."""

    sent: dict = field(default_factory=dict)

    def encode(self, batch: ForwardBatch) -> StepMessage:
        """The message of ``batch`` (built with request ids and token lists: engine/runner.py
        ``build_batch`` or model/simple_cache.py), from its host lists only; records the tables as
        sent. Raises ValueError for a batch without them."""
        h = batch.host
        if h.request_ids is None:
            raise ValueError("a multi-rank step needs the batch's request_ids (StepHost.request_ids)")
        if h.tokens is None:
            raise ValueError("a multi-rank step needs the batch's new tokens as a host list "
                             "(StepHost.tokens)")
        qs = h.query_starts
        return self._encode(h.request_ids, h.tokens, [qs[b + 1] - qs[b] for b in range(len(qs) - 1)],
                            h.context_lens, h.logit_counts, h.block_tables, h.data_parallel_splits,
                            list(h.finished_request_ids or []), None)

    def encode_decode(self, request_ids: list, tokens: list[int], context_lens: list[int],
                      block_tables: list[list[int]], finished_request_ids: list, bucket: int) -> StepMessage:
        """The message of a static decode step (docs/serving.md §6.3): request i decodes
        ``tokens[i]`` with ``context_lens[i]`` tokens visible over ``block_tables[i]`` (one logit
        row each), padded to ``bucket`` on every rank; forgets ``finished_request_ids`` and records
        the tables as sent, as :meth:`encode` does. Raises ValueError for lists of different
        lengths or more rows than ``bucket``."""
        k = len(request_ids)
        if not len(tokens) == len(context_lens) == len(block_tables) == k or k > bucket:
            raise ValueError(f"{k} request_ids, {len(tokens)} tokens, {len(context_lens)} context_lens, "
                             f"{len(block_tables)} block_tables for bucket {bucket}: give one of each per "
                             "row, at most bucket rows")
        return self._encode(request_ids, tokens, [1] * k, context_lens, [1] * k, block_tables, None,
                            list(finished_request_ids), bucket)

    def _encode(self, request_ids: list, tokens: list[int], new_counts: list[int], context_lens: list[int],
                logit_counts: list[int], block_tables: list[list[int]], splits: list[int] | None,
                finished: list, bucket: int | None) -> StepMessage:
        for rid in finished:
            self.sent.pop(rid, None)
        counts: list[int] = []
        pages: list[int] = []
        for b, rid in enumerate(request_ids):
            table = block_tables[b]
            old = self.sent.get(rid)
            reset = old is None or table[:len(old)] != old
            new_pages = table if reset else table[len(old):]
            self.sent[rid] = list(table)
            pages.extend(new_pages)
            counts += [new_counts[b], context_lens[b], logit_counts[b], len(new_pages), int(reset)]
        return StepMessage(list(request_ids), _i64(counts), _i64(tokens), _i64(pages), splits, finished,
                           bucket)


@dataclass(slots=True)
class MessageDecoder:
    """The other ranks' side: every live request's block table, kept in step with rank 0's."""

    tables: dict = field(default_factory=dict)

    def decode(self, msg: StepMessage, page_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
        """The step's `ForwardBatch` on ``device`` (same layout as rank 0's)."""
        new_tokens, context_lens, n_logits, tables = self.apply(msg)
        batch = ragged_batch(new_tokens, context_lens, tables, n_logits, page_size, device,
                             msg.data_parallel_splits, list(msg.request_ids))
        batch.host.finished_request_ids = list(msg.finished_request_ids)
        return batch

    def apply(self, msg: StepMessage) -> tuple[list[list[int]], list[int], list[int], list[list[int]]]:
        """Apply the step's finished ids and page deltas to the kept tables; returns per request
        (batch order) its new tokens, context length, logit rows and whole block table (the list
        the decoder keeps). A static decode step (``msg.bucket`` set) goes through here too, so the
        tables stay in step with rank 0's whichever path a step takes."""
        for rid in msg.finished_request_ids:
            self.tables.pop(rid, None)
        counts = _ints(msg.counts)
        tokens = _ints(msg.tokens)
        pages = _ints(msg.pages)
        new_tokens, context_lens, n_logits, tables = [], [], [], []
        t = p = 0
        for b, rid in enumerate(msg.request_ids):
            n, ctx, nl, k, reset = counts[5 * b:5 * b + 5]
            table = [] if reset else self.tables[rid]
            table.extend(pages[p:p + k])
            self.tables[rid] = table
            p += k
            new_tokens.append(tokens[t:t + n])
            t += n
            context_lens.append(ctx)
            n_logits.append(nl)
            tables.append(table)
        return new_tokens, context_lens, n_logits, tables
