"""Model runner: turns a scheduled step into a ragged `ForwardBatch` and runs the model.

Layout of the batch is docs/serving.md §6. One step may mix prefill chunks and decodes: request b
contributes tokens [c_b, c_b + n_b) of its sequence (c_b = num_computed_tokens), at positions
c_b + i, written to slots ``table[p // S] * S + p % S``; attention sees its cached pages plus the
causal part of its own chunk (context_lens = c_b + n_b).

With data-parallel replicas the batch is ordered replica by replica (the engine passes each
replica's scheduled requests in turn), each request's page ids index its own replica's pool, and
``data_parallel_splits`` (prefix sums of requests per replica) comes from the same host lists
(docs/serving.md §6).

The batch is built once per step on the host from the scheduler's Python lists, written into the
runner's persistent buffers (model/batch.py ``StepBuffers``: one int64 host buffer, pinned on CUDA)
and copied to the device in one copy (``non_blocking`` on CUDA); the same lists travel with the
batch (model/batch.py ``StepHost``), so the model sizes and indexes the step without reading
anything back from the device, and the forward has no per-request work (docs/serving.md §6.1).
With :meth:`ModelRunner.enable_graphs` (the engine on one CUDA device, or on TP_TP CUDA ranks)
every all-decode step instead takes the static path of model/cuda_graphs.py: fixed-address
buffers, one CUDA graph per batch-size bucket replayed (docs/serving.md §6.3; a TP_TP model
brings its own, parallel/worker.py ``TPStaticDecode``, which tells the other ranks the bucket);
every other step stays on this path.

Legend: T new tokens in the step, B requests, N logit rows returned, V vocab, S page size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.sampling import SamplerOutput, SamplingRows
from m2serve.engine.scheduler import ScheduledRequest
from m2serve.model.batch import ForwardBatch, KVStorage, StepBuffers, ragged_batch
from m2serve.model.cuda_graphs import CUDAGraphRunner, bucket_for, decode_buckets


def wants_prompt_logprobs(s: ScheduledRequest) -> bool:
    """True while a request that asked for prompt logprobs still computes prompt positions."""
    r = s.request
    return (r.sampling_params.prompt_logprobs is not None
            and r.num_computed_tokens < r.num_prompt_tokens - 1
            and len(r.prompt_logprobs) < r.num_prompt_tokens)


def logits_rows(s: ScheduledRequest) -> int:
    """How many of the chunk's last positions need logits: all of them for prompt logprobs,
    the last one when the chunk completes the sequence (it samples), plus one per drafted token
    of a speculative decode (docs/serving.md §13: K + 1 verified positions), else none."""
    if wants_prompt_logprobs(s):
        return s.num_new_tokens
    return 1 + len(s.draft_token_ids) if s.completes else 0


def build_batch(scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager],
                device: torch.device | str = "cpu",
                finished_request_ids: list[str] | None = None,
                buffers: StepBuffers | None = None, pad_to: int | None = None,
                pad_page: int | None = None) -> ForwardBatch:
    """The `ForwardBatch` of one step (docs/serving.md §6); request order = ``scheduled`` order.

    ``kvs[i]`` is replica i's page allocator; a request's pages come from ``kvs[request.replica]``.
    With more than one replica the batch carries ``data_parallel_splits`` [len(kvs)+1]; ValueError
    if ``scheduled`` is not in replica order. The batch's host lists carry the request ids and
    ``finished_request_ids`` (for the multi-rank step message, parallel/message.py). With
    ``buffers`` the tensors are views of the persistent step buffers (valid until the next step).
    ``pad_to`` (a decode bucket, one replica only) appends ``pad_to - len(scheduled)`` padding
    requests (docs/serving.md §6.2): one token 0 at position 0, its K/V written to page
    ``pad_page`` (a page no allocator hands out), no logit rows; their request ids are "".
    """
    per_replica = [0] * len(kvs)
    new_tokens: list[list[int]] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    for s in scheduled:
        r = s.request
        if any(per_replica[r.replica + 1:]):
            raise ValueError(f"request {r.request_id!r} of replica {r.replica} follows a later "
                             "replica's request: pass the scheduled requests replica by replica")
        per_replica[r.replica] += 1
        c, n, k = r.num_computed_tokens, s.num_new_tokens, len(s.draft_token_ids)
        new_tokens.append(r.all_token_ids[c:c + n - k] + s.draft_token_ids)
        context_lens.append(c + n)
        tables.append(kvs[r.replica].block_table(r.request_id))
    ids = [s.request.request_id for s in scheduled]
    n_logits = [logits_rows(s) for s in scheduled]
    if pad_to is not None and pad_to > len(scheduled):
        if len(kvs) > 1 or pad_page is None:
            raise ValueError("decode padding takes one replica and a padding page")
        k = pad_to - len(scheduled)
        new_tokens += [[0]] * k
        context_lens += [1] * k
        tables += [[pad_page]] * k
        n_logits += [0] * k
        ids += [""] * k
    splits = None
    if len(kvs) > 1:
        splits = [0]
        for k in per_replica:
            splits.append(splits[-1] + k)
    batch = ragged_batch(new_tokens, context_lens, tables, n_logits, kvs[0].page_size, device, splits, ids,
                         buffers)
    batch.host.finished_request_ids = list(finished_request_ids or [])
    return batch


def graphs_off_reason(model: object, device: torch.device | str, enforce_eager: bool,
                      replicas: int) -> str | None:
    """Why decode steps run eager instead of under CUDA graphs (docs/serving.md §6.3), or None when
    they are captured, first match: ``--enforce-eager``; a multi-rank mode other than TP_TP (the
    model's ``static_decode_off``, parallel/worker.py: EP reads the exchange's counts on the host),
    data-parallel replicas or a model with no static decode path; a device other than CUDA (rank
    0's, ``device``); the torch attention backend (its per-request loop reads host lists)."""
    if enforce_eager:
        return "--enforce-eager"
    off = getattr(model, "static_decode_off", None)
    if off is not None:
        return off
    if replicas > 1 or not (hasattr(model, "forward_decode") or hasattr(model, "static_decode")):
        return "no static decode path: data-parallel replicas and EP modes run eager"
    if torch.device(device).type != "cuda":
        return "CUDA only"
    if getattr(model, "attention_kernel", None) is None:
        return "torch attention backend"
    return None


def zeroed_kv_storage(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str,
                      k_scale: list[float] | None, v_scale: list[float] | None) -> KVStorage:
    """A `KVStorage` of zero-filled pages: the whole pool is resident from the start.

    On CPU the pool is a fixed size (engine/planner.py), so filling it up front makes the server's
    RSS flat from start-up on, as a GPU engine's pool is (vLLM zero-fills its KV cache too); a pool
    touched page by page instead grew RSS for as long as the prefix cache kept new pages. The fill
    costs one write pass over the pool at start (the default 4 GiB: 5.8 s on a shared 2-core box
    at load average 9). Zeros also mean the model never reads uninitialised memory (padding reads
    of page 0 included).
    """
    shape = (num_pages, page_size, num_kv_heads, head_dim)   # [P, S, Hkv, D]
    return KVStorage(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     page_size=page_size,
                     k_scale=list(k_scale) if k_scale else [1.0] * num_layers,
                     v_scale=list(v_scale) if v_scale else [1.0] * num_layers)


@dataclass(slots=True)
class ModelRunner:
    """Runs ``model(batch, kv) -> logits [N, V] fp32`` (docs/architecture.md, model contract)."""

    model: Callable[[ForwardBatch, KVStorage], torch.Tensor]
    kv_storage: KVStorage
    device: torch.device | str = "cpu"
    finished_request_ids: list[str] = field(default_factory=list)   # since the last step (engine fills)
    buffers: StepBuffers | None = None   # persistent step buffers (None: one copy per field)
    sampling_buffers: StepBuffers | None = None   # the sampler's inputs, likewise
    buckets: list[int] | None = None     # decode batch-size buckets when decodes are padded, else None
    pad_page: int | None = None          # the padding rows' KV page (outside every allocator)
    graphs: Any = None                   # static decode path (CUDAGraphRunner or a TP_TP model's), else None
    graph_steps: int = 0                 # steps run through ``graphs`` (tests)
    graphs_off: str | None = "not enabled"  # why decode runs eager (graphs_off_reason), None when on

    def _add_pad_page(self) -> int:
        """The padding rows' page: ``pad_page`` when the pool was allocated with it (the engine on
        CUDA), else one page appended to every layer's pools now."""
        if self.pad_page is None:
            self.pad_page = self.kv_storage.num_pages
            self.kv_storage.append_pages(1)
        return self.pad_page

    def enable_decode_padding(self, max_batch_size: int) -> None:
        """Pad every all-decode step of one replica to its bucket (:func:`decode_buckets`), the
        batch shapes CUDA graphs are captured for (docs/serving.md §6.2). Appends one page to every
        layer's K/V pool for the padding rows to write into; no allocator hands it out."""
        self._add_pad_page()
        self.buckets = decode_buckets(max_batch_size)

    def enable_graphs(self, max_batch_size: int, max_length: int, capture: bool) -> None:
        """Run every all-decode step of one replica through the static decode path
        (model/cuda_graphs.py ``CUDAGraphRunner``, docs/serving.md §6.3) at the buckets of
        ``max_batch_size``, block tables ``ceil(max_length / S)`` pages wide: recorded as one CUDA
        graph per bucket now and replayed when ``capture`` (CUDA), run eagerly otherwise (the CPU
        test path). The padding page is ``pad_page`` when already set (the engine allocates it with
        the pool), else appended now, before anything records the pools' addresses; prefill,
        mixed and multi-token steps stay eager. A model with a ``static_decode`` method (a TP_TP
        ``DistributedModel``) builds the path on every rank. Raises ValueError (from
        ``CUDAGraphRunner.check``) for a model on the torch attention backend or capture off CUDA,
        and for a multi-rank mode other than TP_TP."""
        pad = self._add_pad_page()
        make = getattr(self.model, "static_decode", None)
        if make is None:
            self.graphs = CUDAGraphRunner(self.model, self.kv_storage, decode_buckets(max_batch_size),
                                          max_length, pad, capture)
        else:
            self.graphs = make(self.kv_storage, decode_buckets(max_batch_size), max_length, pad, capture)
        self.graphs_off = None if capture else "static decode path run eagerly (no capture)"

    def _pad_to(self, scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager]) -> int | None:
        if self.buckets is None or len(kvs) > 1 or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        return bucket_for(len(scheduled), self.buckets)

    def _run_static(self, scheduled: list[ScheduledRequest],
                    kvs: Sequence[KVCacheManager]) -> list[torch.Tensor]:
        kv = kvs[0]
        tokens, ctx, tables = [], [], []
        for s in scheduled:
            r = s.request
            c = r.num_computed_tokens
            tokens.append(r.all_token_ids[c])
            ctx.append(c + 1)
            tables.append(kv.block_table(r.request_id))
        ids = [s.request.request_id for s in scheduled]
        self.graph_steps += 1
        logits = self.graphs.run_step(tokens, ctx, tables, ids, self._take_finished())   # [B, V] f32
        return [logits[i:i + logits_rows(s)] for i, s in enumerate(scheduled)]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager]) -> list[torch.Tensor]:
        """Run one step (``scheduled`` replica by replica, ``kvs`` one allocator per replica); returns
        each scheduled request's logit rows, [n_b, V] fp32 (n_b may be 0). With :meth:`enable_graphs`
        an all-decode step of one replica takes the static path (its rows are views of the
        bucket's output, valid until the next step)."""
        g = self.graphs
        if (g is not None and scheduled and len(kvs) == 1 and len(scheduled) <= g.buckets[-1]
                and all(s.num_new_tokens == 1 for s in scheduled)):
            return self._run_static(scheduled, kvs)
        batch = build_batch(scheduled, kvs, self.device, self._take_finished(), self.buffers,
                            self._pad_to(scheduled, kvs), self.pad_page)
        counts = batch.host.logit_counts
        if sum(counts) == 0:
            self.model(batch, self.kv_storage)
            return [torch.empty(0) for _ in scheduled]
        logits = self.model(batch, self.kv_storage).float()   # [N, V]
        return list(torch.split(logits, counts))[:len(scheduled)]   # padding rows return none

    def _take_finished(self) -> list[str]:
        finished, self.finished_request_ids = self.finished_request_ids, []
        return finished

    @property
    def samples_on_replicas(self) -> bool:
        """Whether the model draws each data-parallel replica's rows where its logits are (its
        ``samples_on_replicas``: a multi-rank DP_EP model), so :meth:`run_sampled` applies."""
        return bool(getattr(self.model, "samples_on_replicas", False))

    @torch.inference_mode()
    def run_sampled(self, scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager],
                    rows: list[SamplingRows]) -> list[SamplerOutput]:
        """Run one step and draw on the replicas: ``rows[i]`` (engine/sampling.py `SamplingRows`)
        are replica i's rows, the requests of ``scheduled`` whose chunk completes, in order; returns
        each replica's `SamplerOutput`. No logits leave their rank. Only without prompt logprobs
        (every request returns at most its last row)."""
        batch = build_batch(scheduled, kvs, self.device, self._take_finished(), self.buffers)
        drawn = self.model(batch, self.kv_storage, rows)
        return [d if d is not None else SamplerOutput([], []) for d in drawn]
