"""Model runner: turns a scheduled step into a ragged `ForwardBatch` and runs the model.

Layout of the batch is docs/serving.md §6. One step may mix prefill chunks and decodes: request b
contributes tokens [c_b, c_b + n_b) of its sequence (c_b = num_computed_tokens), at positions
c_b + i, written to slots ``table[p // S] * S + p % S``; attention sees its cached pages plus the
causal part of its own chunk (context_lens = c_b + n_b).

With data-parallel replicas the batch is ordered replica by replica (the engine passes each
replica's scheduled requests in turn), each request's page ids index its own replica's pool, and
``data_parallel_splits`` (prefix sums of requests per replica) comes from the same host lists
(docs/serving.md §6).

The batch is built once per step on the host from the scheduler's Python lists: the tensors are
copied to the device through pinned memory with ``non_blocking=True`` on CUDA, and the same
lists travel with the batch (model/batch.py ``StepHost``), so the model sizes and indexes the
step without reading anything back from the device.

Legend: T new tokens in the step, B requests, N logit rows returned, V vocab, S page size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.sampling import SamplerOutput, SamplingRows
from m2serve.engine.scheduler import ScheduledRequest
from m2serve.model.batch import ForwardBatch, KVStorage, ragged_batch


def wants_prompt_logprobs(s: ScheduledRequest) -> bool:
    """True while a request that asked for prompt logprobs still computes prompt positions."""
    r = s.request
    return (r.sampling_params.prompt_logprobs is not None
            and r.num_computed_tokens < r.num_prompt_tokens - 1
            and len(r.prompt_logprobs) < r.num_prompt_tokens)


def logits_rows(s: ScheduledRequest) -> int:
    """How many of the chunk's last positions need logits: all of them for prompt logprobs,
    the last one when the chunk completes the sequence (it samples), else none."""
    if wants_prompt_logprobs(s):
        return s.num_new_tokens
    return 1 if s.completes else 0


def build_batch(scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager],
                device: torch.device | str = "cpu",
                finished_request_ids: list[str] | None = None) -> ForwardBatch:
    """The `ForwardBatch` of one step (docs/serving.md §6); request order = ``scheduled`` order.

    ``kvs[i]`` is replica i's page allocator; a request's pages come from ``kvs[request.replica]``.
    With more than one replica the batch carries ``data_parallel_splits`` [len(kvs)+1]; ValueError
    if ``scheduled`` is not in replica order. The batch's host lists carry the request ids and
    ``finished_request_ids`` (for the multi-rank step message, parallel/message.py).
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
        c, n = r.num_computed_tokens, s.num_new_tokens
        new_tokens.append(r.all_token_ids[c:c + n])
        context_lens.append(c + n)
        tables.append(kvs[r.replica].block_table(r.request_id))
    splits = None
    if len(kvs) > 1:
        splits = [0]
        for k in per_replica:
            splits.append(splits[-1] + k)
    batch = ragged_batch(new_tokens, context_lens, tables, [logits_rows(s) for s in scheduled],
                         kvs[0].page_size, device, splits, [s.request.request_id for s in scheduled])
    batch.host.finished_request_ids = list(finished_request_ids or [])
    return batch


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

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest], kvs: Sequence[KVCacheManager]) -> list[torch.Tensor]:
        """Run one step (``scheduled`` replica by replica, ``kvs`` one allocator per replica); returns
        each scheduled request's logit rows, [n_b, V] fp32 (n_b may be 0)."""
        batch = build_batch(scheduled, kvs, self.device, self._take_finished())
        counts = batch.host.logit_counts
        if sum(counts) == 0:
            self.model(batch, self.kv_storage)
            return [torch.empty(0) for _ in scheduled]
        logits = self.model(batch, self.kv_storage).float()   # [N, V]
        return list(torch.split(logits, counts))

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
        batch = build_batch(scheduled, kvs, self.device, self._take_finished())
        drawn = self.model(batch, self.kv_storage, rows)
        return [d if d is not None else SamplerOutput([], []) for d in drawn]
