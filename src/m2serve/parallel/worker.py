"""Rank 0 drives the model on every rank; the other ranks run :func:`worker_loop` (docs/parallelism.md §1, §3;
docs/serving.md §6).

Per step, outside the layers: ONE ``broadcast_object_list`` of the step message from rank 0
(parallel/message.py: what changed since the previous step; torch sends it as a size broadcast plus
a payload broadcast) and, under DP_EP with dp > 1 only, ONE gather to rank 0: of the replicas'
draws (``gather_object`` of token ids and logprobs, when the engine hands down each replica's
sampler rows) or else of their logit rows (``gather``). Under TP_TP / TP_EP every rank ends the step
with the full hidden states (replicated lm_head), so rank 0 already holds all logits.

DP_EP replicas (``data_parallel_splits``, docs/serving.md §6): the engine holds one scheduler and one
KV page allocator per replica (engine/core.py) and hands over a batch ordered replica by replica
whose page ids are replica-local; rank r runs the contiguous slice of replica r, sized from the
batch's host lists (no device read), against its own pool (every rank allocates a pool of the
same geometry, which holds only its replica's pages).

TP_TP static decode (docs/serving.md §6.3): rank 0 sends one "graphs" message at start-up (the
pool's spec, the buckets, max_length, the padding page, capture or not), after which every rank
builds its model/cuda_graphs.py ``CUDAGraphRunner`` over its own shard and pool at the same time
(on CUDA each captures its buckets in the same order: the forward's all-reduces are recorded on
the one communicator every rank shares). A decode step is then a step message with ``bucket`` set:
rank 0 chose the bucket (the padding follows from it: bucket - rows padding rows into the padding
page), every rank applies the page deltas (parallel/message.py ``MessageDecoder.apply``), loads
the same rows into its fixed buffers and runs (replays) that bucket. EP modes and DP replicas
stay eager (:attr:`DistributedModel.static_decode_off`).

Legend: B requests, T new tokens, N returned logit rows, V vocab.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelismMode, ParallelState, dp_attention
from m2serve.model.batch import ForwardBatch, KVStorage, StepHost, host_tensor
from m2serve.model.collectives import uses_ep_exchange
from m2serve.model.cuda_graphs import CUDAGraphRunner, bucket_for
from m2serve.model.load import load_model
from m2serve.parallel.launch import WorkerError, WorkerGroup
from m2serve.parallel.message import MessageDecoder, MessageEncoder, StepMessage
from m2serve.parallel.shard import make_shard_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Geometry of rank 0's KV pool; every rank allocates the same pages with its own KV heads."""

    num_layers: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    k_scale: tuple[float, ...]
    v_scale: tuple[float, ...]

    @classmethod
    def of(cls, kv: KVStorage) -> KVSpec:
        """The spec of an allocated pool."""
        return cls(len(kv.k), kv.num_pages, kv.page_size, kv.dtype, tuple(kv.k_scale), tuple(kv.v_scale))

    def allocate(self, num_kv_heads: int, head_dim: int, device: torch.device | str) -> KVStorage:
        """A zeroed pool of this geometry with ``num_kv_heads`` heads of ``head_dim``."""
        return KVStorage.allocate(self.num_layers, self.num_pages, self.page_size, num_kv_heads, head_dim,
                                  self.dtype, device, list(self.k_scale), list(self.v_scale))

    def fit(self, kv: KVStorage | None, num_kv_heads: int, head_dim: int,
            device: torch.device | str) -> KVStorage:
        """``kv`` grown to this spec's pages (rank 0 appended the padding page of the static decode
        path after steps had run: the pages already written keep their contents), or a new pool
        when ``kv`` is None. Raises ValueError when ``kv`` has more pages than the spec."""
        if kv is None:
            return self.allocate(num_kv_heads, head_dim, device)
        if kv.num_pages > self.num_pages:
            raise ValueError(f"this rank's KV pool has {kv.num_pages} pages, rank 0's {self.num_pages}")
        if kv.num_pages < self.num_pages:
            kv.append_pages(self.num_pages - kv.num_pages)
        return kv


def load_rank_model(path: str, state: ParallelState, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", weight_dequant: str = "load",
                    fp8_linear: str = "w8a16", batch_invariant: bool = False,
                    activation_quant: str = "auto", quantize_unquantized: str = "none",
                    attention_backend: str = "auto") -> Any:
    """Load this rank's share of the checkpoint at ``path``: only the slices of its shard plan
    are read from disk (``safe_open(...).get_slice``), so resident weights are about its share.
    ``weight_dequant`` as for model/load.py ``load_model`` (``"runtime"`` keeps quantised weights
    packed on every rank, which is what the planner counts); ``fp8_linear``, ``batch_invariant``,
    ``activation_quant`` (W4A4 inputs) and ``quantize_unquantized`` as for ``load_model``."""
    config = MiniMaxM2Config.from_pretrained(path)
    return load_model(path, dtype=dtype, device=device, parallel=state, shard=make_shard_plan(config, state),
                      weight_dequant=weight_dequant, fp8_linear=fp8_linear, batch_invariant=batch_invariant,
                      activation_quant=activation_quant, quantize_unquantized=quantize_unquantized,
                      attention_backend=attention_backend)


def replica_batch(batch: ForwardBatch, replica: int) -> ForwardBatch:
    """Replica ``replica``'s requests [splits[r], splits[r+1]) of a DP batch (docs/serving.md §6):
    contiguous slices of the tensors, sized from the host lists (no device read). Raises ValueError
    when the batch carries no ``data_parallel_splits``."""
    h = batch.host
    if h.data_parallel_splits is None:
        raise ValueError("a data-parallel step needs data_parallel_splits (requests ordered replica by "
                         "replica, docs/serving.md §6); build it with engine/runner.py build_batch")
    b0, b1 = h.data_parallel_splits[replica], h.data_parallel_splits[replica + 1]
    t0, t1 = h.query_starts[b0], h.query_starts[b1]
    starts = [q - t0 for q in h.query_starts[b0:b1 + 1]]
    counts = h.logit_counts[b0:b1]
    dev = batch.tokens.device
    n = batch.return_n_logits
    return ForwardBatch(
        tokens=batch.tokens[t0:t1], positions=batch.positions[t0:t1],
        input_row_offsets=host_tensor(starts, batch.input_row_offsets.dtype, dev),
        slot_mapping=batch.slot_mapping[t0:t1], block_tables=batch.block_tables[b0:b1],
        context_lens=batch.context_lens[b0:b1],
        return_n_logits=n[b0:b1] if isinstance(n, torch.Tensor) and n.dim() > 0 else n,
        host=StepHost.build(starts, h.context_lens[b0:b1], h.block_tables[b0:b1], counts))


def run_rank_step(model: Any, state: ParallelState, batch: ForwardBatch, kv: KVStorage,
                  sampling: list[Any] | None = None, held: dict | None = None) -> Any:
    """One rank's part of a step. Returns logits [N, V] f32 of the whole batch on rank 0 (None
    on the other ranks under DP_EP, whose rows went to rank 0 in one gather). Under DP_EP every
    rank runs its replica's slice, also an empty one (its model still joins the EP exchange);
    the gather's sizes come from the host lists.

    ``sampling`` (DP_EP only): per replica, an object whose ``sample(logits [N_r, V])`` draws the
    replica's rows (engine/sampling.py `SamplingRows`, handed down by the engine); each rank draws
    its own and rank 0 returns the list of every replica's draws (one ``gather_object``: token ids
    and logprobs, no logits), None elsewhere. ``held``: this rank's sampling states by request id
    (the rows' ``sample`` adds new ones; the batch's finished requests are dropped first)."""
    if not dp_attention(state.mode, state.world_size):
        return model(batch, kv)
    logits = model(replica_batch(batch, state.dp_rank), kv)  # [N_r, V]
    held = {} if held is None else held
    for rid in batch.host.finished_request_ids or []:
        held.pop(rid, None)
    if sampling is not None:
        rows = sampling[state.dp_rank]
        drawn = rows.sample(logits.float(), held=held) if rows.num_rows else None
        bins = [None] * state.world_size if state.rank == 0 else None
        dist.gather_object(drawn, bins, dst=0, group=state.group)
        return bins
    splits, counts = batch.host.data_parallel_splits, batch.host.logit_counts
    per = [sum(counts[splits[r]:splits[r + 1]]) for r in range(state.world_size)]
    width = max(per)
    if width == 0:
        return logits if state.rank == 0 else None
    V = logits.shape[1]
    padded = logits.new_zeros(width, V)
    padded[: logits.shape[0]] = logits
    bins = [torch.empty_like(padded) for _ in per] if state.rank == 0 else None
    dist.gather(padded, bins, dst=0, group=state.group)
    if state.rank != 0:
        return None
    return torch.cat([b[:n] for b, n in zip(bins, per, strict=True)])


def run_static_step(graphs: CUDAGraphRunner, decoder: MessageDecoder, step: StepMessage) -> torch.Tensor:
    """A TP_TP rank's part of a static decode step (``step.bucket`` set, docs/serving.md §6.3): apply
    the page deltas to ``decoder``'s tables, load the rows into ``graphs``' buffers at rank 0's
    bucket and run (replay) it. Returns this rank's logits [rows, V] f32 (every rank ends with the
    full hidden states; rank 0's are the step's). Raises ValueError for a multi-token row."""
    new_tokens, context_lens, _, tables = decoder.apply(step)
    if any(len(t) != 1 for t in new_tokens):
        raise ValueError(f"static decode step of bucket {step.bucket}: every request decodes one token, "
                         f"got {[len(t) for t in new_tokens]}")
    return graphs.run([t[0] for t in new_tokens], context_lens, tables, bucket=step.bucket)


def worker_loop(model: Any, state: ParallelState, device: torch.device | str = "cpu") -> None:
    """Serve steps from rank 0 until it sends "stop" (ranks 1…P−1). Allocates the rank's KV pool
    from the first step's :class:`KVSpec` and rebuilds each step's batch from its
    :class:`~m2serve.parallel.message.StepMessage` (a new pool starts a new decoder). A "graphs"
    message builds the rank's static decode path (module docstring); a step with ``bucket`` set
    runs it (:func:`run_static_step`)."""
    kv: KVStorage | None = None
    cfg: MiniMaxM2Config = model.config
    decoder = MessageDecoder()
    held: dict = {}   # sampling states of this replica's requests (sent once)
    graphs: CUDAGraphRunner | None = None
    while True:
        msg = _receive(state)
        if msg["kind"] == "stop":
            return
        if msg["kind"] == "graphs":
            if msg["new_pool"]:
                kv, decoder, held = None, MessageDecoder(), {}
            kv = msg["kv"].fit(kv, model.dims.num_kv_heads, cfg.head_dim, device)
            graphs = CUDAGraphRunner(model, kv, msg["buckets"], msg["max_length"], msg["pad_page"],
                                     msg["capture"])
            continue
        if msg["kv"] is not None:
            kv = msg["kv"].allocate(model.dims.num_kv_heads, cfg.head_dim, device)
            decoder, held, graphs = MessageDecoder(), {}, None
        step = msg["step"]
        if step.bucket is not None:
            if graphs is None:
                raise ValueError(f"rank {state.rank}: a static decode step (bucket {step.bucket}) before "
                                 "the graphs message")
            run_static_step(graphs, decoder, step)
            continue
        run_rank_step(model, state, decoder.decode(step, kv.page_size, device), kv, msg["sampling"], held)


def _receive(state: ParallelState) -> dict[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=state.group)
    return box[0]


def _send(state: ParallelState, msg: dict[str, Any]) -> None:
    dist.broadcast_object_list([msg], src=0, group=state.group)


@dataclass(slots=True)
class DistributedModel:
    """Rank 0's handle on the model of all ranks: ``model(batch, kv) -> logits [N, V] f32``, the
    same contract as the single-process model (docs/architecture.md), so the engine runs unchanged.

    ``kv`` is rank 0's pool (allocate it with :attr:`num_kv_heads`); the workers allocate the same
    pages from the first step's message. ``workers`` (when rank 0 spawned them) is checked before
    every step; a failed collective is reported as WorkerError naming the dead rank if one died.
    """

    # a step that failed on rank 0 may leave the other ranks inside a collective: the engine must not
    # run another step (serve/async_engine.py gives up at once instead of ending the batch)
    recovers_from_step_failure: ClassVar[bool] = False

    model: Any
    state: ParallelState
    workers: WorkerGroup | None = None
    kv_seen: KVStorage | None = None
    closed: bool = False
    encoder: MessageEncoder = field(default_factory=MessageEncoder)
    last_message: tuple[Any, Any] | None = None   # (step message, sampling rows) of the last step
    replica_sampled_steps: int = 0   # steps whose rows were drawn on the replicas (tests read it)
    held: dict = field(default_factory=dict)   # sampling states of replica 0's requests

    @property
    def message_bytes(self) -> int:
        """Size in bytes of the last step's message (step message + sampling rows, pickled;
        benchmarks/parallel.py reports it); 0 before the first step. Measured on demand, so a step
        never pickles its message a second time just to size it."""
        if self.last_message is None:
            return 0
        step, sampling = self.last_message
        return step.nbytes + (len(pickle.dumps(sampling)) if sampling is not None else 0)

    @property
    def config(self) -> MiniMaxM2Config:
        """The model's config."""
        return self.model.config

    @property
    def num_kv_heads(self) -> int:
        """KV heads held on each rank (Hkv / tp)."""
        return self.model.dims.num_kv_heads

    @property
    def data_parallel_degree(self) -> int:
        """Data-parallel replicas the engine schedules for: the world size under DP_EP on more than
        one rank (each rank one replica with its own KV pool), else 1."""
        return self.state.world_size if dp_attention(self.state.mode, self.state.world_size) else 1

    @property
    def samples_on_replicas(self) -> bool:
        """True with data-parallel replicas: a call with ``sampling`` draws each replica's rows on its
        rank (:func:`run_sampled_step`)."""
        return self.data_parallel_degree > 1

    @property
    def kv_scales(self) -> tuple[list[float], list[float]] | None:
        """Checkpoint fp8 KV scales (as the single-process model)."""
        return self.model.kv_scales

    @property
    def attention_kernel(self) -> Any:
        """Rank 0's attention kernel (None on the torch backend; every rank loads the same backend)."""
        return getattr(self.model, "attention_kernel", None)

    @property
    def static_decode_off(self) -> str | None:
        """Why this mode has no static decode path (docs/serving.md §6.3), None under TP_TP: the EP
        exchange reads its counts on the host (TP_EP, DP_EP with ep_size > 1); the other EP and DP
        configurations are not built."""
        s = self.state
        if s.mode is ParallelismMode.TP_TP:
            return None
        if uses_ep_exchange(s):
            return f"{s.mode.value} runs eager: the EP exchange reads its counts on the host"
        what = "data-parallel replicas" if s.mode is ParallelismMode.DP_EP else "TP_EP with ep_use_allreduce"
        return f"{s.mode.value} runs eager: static decode is built for one rank and TP_TP, not {what}"

    def static_decode(self, kv: KVStorage, buckets: list[int], max_length: int, pad_page: int,
                      capture: bool) -> TPStaticDecode:
        """Build the static decode path on every rank (module docstring; docs/serving.md §6.3): one
        "graphs" message (the workers fit their pools to ``kv``'s spec: a new pool, or rank 0's
        grown by the padding page), then rank 0's ``CUDAGraphRunner`` here while the workers build
        theirs (on CUDA all ranks capture the buckets in the same order). Arguments as for
        ``CUDAGraphRunner``. Raises ValueError, before any rank is told, for a mode other than
        TP_TP (:attr:`static_decode_off`), the torch attention backend or capture off CUDA."""
        off = self.static_decode_off
        if off is not None:
            raise ValueError(f"static decode: {off}")
        CUDAGraphRunner.check(self.model, kv, capture)
        self._check_open()
        first = self._see(kv)
        self._send_or_name_dead({"kind": "graphs", "kv": KVSpec.of(kv), "new_pool": first,
                                 "buckets": list(buckets), "max_length": max_length, "pad_page": pad_page,
                                 "capture": capture})
        try:
            local = CUDAGraphRunner(self.model, kv, buckets, max_length, pad_page, capture)
        except RuntimeError:
            self.raise_if_worker_died()
            raise
        return TPStaticDecode(self, local)

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerError("the distributed model was shut down")
        if self.workers is not None:
            self.workers.check()

    def _see(self, kv: KVStorage) -> bool:
        """Record ``kv`` as the pool in use; True (and a new encoder) when it is a new one."""
        first = kv is not self.kv_seen
        self.kv_seen = kv
        if first:
            self.encoder, self.held = MessageEncoder(), {}
        return first

    def raise_if_worker_died(self) -> None:
        """After a failed collective: raise WorkerError naming a dead worker if one died (else return,
        and the caller re-raises the collective's error)."""
        if self.workers is not None:
            self.workers.check(wait_s=2.0)  # a dead worker is the cause: name it

    def _send_or_name_dead(self, msg: dict[str, Any]) -> None:
        try:
            _send(self.state, msg)
        except RuntimeError:
            self.raise_if_worker_died()
            raise

    def send_step(self, step: StepMessage, sampling: list[Any] | None, spec: KVSpec | None) -> None:
        """Send one step's message to the other ranks (after checking they are alive)."""
        self._check_open()
        self.last_message = (step, sampling)
        self._send_or_name_dead({"kind": "step", "step": step, "sampling": sampling, "kv": spec})

    def __call__(self, batch: ForwardBatch, kv: KVStorage, sampling: list[Any] | None = None) -> Any:
        """Broadcast the step, run rank 0's part, return the logits of all requests in order.
        Under DP_EP ``batch`` must carry ``data_parallel_splits`` (engine/runner.py builds it) and
        ``kv`` is replica 0's pool; ValueError otherwise. With ``sampling`` (DP_EP, one entry per
        replica, see :func:`run_rank_step`) the replicas draw their rows and the call returns each
        replica's draws (None for a replica without rows) instead of logits."""
        self._check_open()
        dp = self.data_parallel_degree
        splits = batch.host.data_parallel_splits
        if dp > 1 and (splits is None or len(splits) != dp + 1):
            raise ValueError(f"this DP_EP model has {dp} replicas: the batch needs data_parallel_splits "
                             f"of {dp + 1} entries (requests replica by replica, docs/serving.md §6), "
                             f"got {splits}")
        first = self._see(kv)  # a new pool: the workers allocate theirs alike
        step = self.encoder.encode(batch)
        self.replica_sampled_steps += sampling is not None
        self.send_step(step, sampling, KVSpec.of(kv) if first else None)
        try:
            return run_rank_step(self.model, self.state, batch, kv, sampling, self.held)
        except RuntimeError:
            self.raise_if_worker_died()
            raise

    def stop(self) -> None:
        """Tell the workers to leave :func:`worker_loop` (the process group stays up)."""
        if self.closed:
            return
        self.closed = True
        if self.workers is None or all(p.exitcode is None for p in self.workers.procs):
            _send(self.state, {"kind": "stop"})

    def shutdown(self) -> None:
        """Stop the workers, leave the process group and join spawned workers."""
        try:
            self.stop()
        except RuntimeError as e:  # a dead worker cannot be told; it is joined / killed below
            log.warning("could not send stop to the workers: %s", e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.workers is not None:
                self.workers.shutdown()


@dataclass(slots=True)
class TPStaticDecode:
    """Rank 0's static decode path of a TP_TP model (module docstring; docs/serving.md §6.3): per
    step it picks the bucket, sends the step message with it (page deltas as any step's) and runs
    its own ``CUDAGraphRunner`` at that bucket while the other ranks run theirs. Built by
    :meth:`DistributedModel.static_decode`."""

    owner: DistributedModel
    local: CUDAGraphRunner

    @property
    def buckets(self) -> list[int]:
        """The buckets every rank holds, ascending."""
        return self.local.buckets

    def run_step(self, tokens: list[int], context_lens: list[int], block_tables: list[list[int]],
                 request_ids: list[str], finished_request_ids: list[str]) -> torch.Tensor:
        """One decode step (engine/runner.py): request i decodes ``tokens[i]`` with
        ``context_lens[i]`` tokens visible over ``block_tables[i]``. Returns logits [rows, V] f32, a
        view of the bucket's output valid until the next step. Raises ValueError for more rows than
        the largest bucket (before any rank is told)."""
        b = bucket_for(len(tokens), self.buckets)
        if b is None:
            raise ValueError(f"{len(tokens)} decode rows: the largest bucket is {self.buckets[-1]}")
        o = self.owner
        o.send_step(o.encoder.encode_decode(request_ids, tokens, context_lens, block_tables,
                                            finished_request_ids, b), None, None)
        try:
            return self.local.run(tokens, context_lens, block_tables, bucket=b)
        except RuntimeError:
            o.raise_if_worker_died()
            raise

