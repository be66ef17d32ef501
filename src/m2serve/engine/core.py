"""`LLMEngine`: the step loop over scheduler, runner and sampler (token ids only).

``step()`` = apply queued adds/aborts (an add picks its data-parallel replica,
``choose_replica``) → ``Scheduler.schedule`` of every replica → ``ModelRunner.run`` (one batch,
replica by replica) → prompt
logprobs → sample the requests whose chunk completed their sequence (constraint bitmasks filled
first) → ``Scheduler.update_from_output`` (advance, append, finish, free) → ``RequestOutput`` per
request that produced something. With speculative decoding a drafted decode samples its K + 1
verified positions in the same draw and keeps the drafts the target's own samples confirm
(docs/serving.md §13); with an EAGLE-3 draft, sampled requests keep drafts by the rejection rule
and the draft runs after the update, proposing the next step's drafts (engine/eagle.py,
docs/serving.md §14). The engine is driven by one thread calling
``step()``; other threads may call ``add_request`` / ``abort_request`` at any time: those only
validate, register the request in the one request table and append it to the one inbox under a
lock, which ``step()`` drains first (docs/architecture.md, engine contract).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Any

import torch

from m2serve.config.eagle3 import Eagle3DraftConfig
from m2serve.config.engine_args import (
    EngineArgs,
    SpeculativeConfig,
    batch_invariant_enabled,
    dtype_bytes,
    parse_speculative_config,
    rank_devices,
)
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine.constraint import BITMASK_WORD_BITS, TokenConstraint, bitmask_words
from m2serve.engine.eagle import DraftSpan, Eagle3Drafter, is_greedy
from m2serve.engine.kv_cache import KVCacheManager
from m2serve.engine.planner import check_page_and_length, fit_max_length, plan_memory
from m2serve.engine.request import Request, RequestOutput, prompt_length_error
from m2serve.engine.runner import ModelRunner, graphs_off_reason, wants_prompt_logprobs, zeroed_kv_storage
from m2serve.engine.sampling import (
    PenaltyState,
    SamplerOutput,
    SamplingParams,
    SamplingRows,
    SamplingState,
    compute_logprobs,
    counter_uniforms,
)
from m2serve.engine.scheduler import ScheduledRequest, Scheduler, choose_replica
from m2serve.engine.speculative import ACCEPT_STREAM, accepted_length, rejection_sample_batched, stream_seed
from m2serve.model.batch import ForwardBatch, KVStorage, StepBuffers
from m2serve.model.eagle3 import load_eagle3_draft
from m2serve.model.load import load_model
from m2serve.parallel.deploy import start_distributed_model

log = logging.getLogger(__name__)

def check_speculative_target(speculative: SpeculativeConfig | None, config: MiniMaxM2Config,
                             num_devices: int = 1) -> None:
    """Refuse at start, before the target loads, an eagle3 draft that does not fit the target (a
    ValueError naming the draft's field, :meth:`Eagle3DraftConfig.check_target`) or a multi-rank
    deployment (``num_devices`` > 1: TP / EP / DP modes do not run EAGLE-3 drafts yet; the error
    names the devices). None or ngram: nothing."""
    if speculative is None or speculative.method != "eagle3":
        return
    Eagle3DraftConfig.from_pretrained(speculative.model).check_target(   # type: ignore[arg-type]
        config.hidden_size, config.vocab_size, config.num_hidden_layers)
    if num_devices > 1:
        raise ValueError(f"speculative_config.method='eagle3' with devices on {num_devices} ranks: EAGLE-3 "
                         "drafts run on one device only (TP / EP / DP modes not yet, docs/serving.md §14); "
                         "use method ngram there")


def _load_drafter(model: Any, config: MiniMaxM2Config, spec: SpeculativeConfig, storage: KVStorage,
                  args: EngineArgs, device: torch.device | str) -> Eagle3Drafter:
    """Load the eagle3 draft of ``spec`` for ``model`` (its embedding when the draft ships none),
    make the target keep the draft's aux hidden states, and give the draft its K/V layer: one
    more layer appended to ``storage`` (index num_hidden_layers; the planner counts it,
    engine/planner.py ``draft_kv_bytes_per_token``). docs/serving.md §14."""
    draft, aux_ids = load_eagle3_draft(spec.model, config.hidden_size, config.vocab_size,  # type: ignore[arg-type]
                                       config.num_hidden_layers, model.model.embed_tokens.weight,
                                       getattr(torch, args.dtype), device)
    model.set_aux_layer_ids(aux_ids)
    c = draft.config
    shape = (storage.num_pages, storage.page_size, c.num_key_value_heads, c.head_dim)
    layer = len(storage.k)
    storage.k.append(torch.zeros(shape, dtype=storage.dtype, device=device))
    storage.v.append(torch.zeros(shape, dtype=storage.dtype, device=device))
    storage.k_scale.append(1.0)
    storage.v_scale.append(1.0)
    return Eagle3Drafter(draft, layer, spec.num_speculative_tokens, getattr(model, "attention_kernel", None),
                         bool(getattr(model, "lower_right_masks", False)), StepBuffers(torch.device(device)),
                         StepBuffers(torch.device(device)))


@dataclass(slots=True)
class EngineStats:
    """Snapshot of the engine's gauges and counters (docs/architecture.md, engine contract).

    waiting counts queued adds not yet drained by ``step()`` as well as the scheduler's waiting queue;
    prefix_cache_queries / prefix_cache_hits count prompt tokens looked up / found in the prefix
    cache, prefix_cache_requests / prefix_cache_requests_hit the lookups / lookups that found at least
    one page; preemptions counts requests preempted (recomputed); chunked_prefill_steps counts steps
    in which some prompt was split; generated_tokens counts sampled tokens. Gauges and counters are
    summed over the data-parallel replicas (kv_pages_total: the deployment's pages, dp x the pages
    of one replica); ``replicas`` holds each replica's own gauges. Speculative decoding
    (docs/serving.md §13): spec_drafts counts verified drafts (one per request and step with a
    draft), spec_draft_tokens the tokens drafted, spec_accepted_tokens those accepted, and
    spec_accepted_per_pos[i] those accepted at draft position i (0-based).
    """

    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int
    kv_page_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_requests: int
    prefix_cache_requests_hit: int
    chunked_prefill_steps: int
    preemptions: int
    generated_tokens: int
    steps: int
    replicas: list[ReplicaStats] = field(default_factory=list)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ReplicaStats:
    """One data-parallel replica's gauges: requests running and waiting in its scheduler (queued adds
    not yet drained count on no replica), and its KV pool's pages."""

    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int


def kv_cache_dtype(name: str) -> torch.dtype:
    """torch dtype for ``kv_cache_format``; ValueError naming the choices."""
    dtype_bytes("kv_cache_format", name)
    return getattr(torch, name)


@dataclass(slots=True)
class LLMEngine:
    """Token-ids-in, token-ids-out engine over one model (one or more data-parallel replicas).

    Build with :meth:`from_args` (loads the checkpoint) or :meth:`from_model` (an already built
    ``model(batch, kv) -> logits [N, V] fp32``). ``max_length`` is the max context in tokens.

    schedulers: one `Scheduler` (each over its own `KVCacheManager`) per data-parallel replica,
    replica i's at index i (docs/serving.md §8); one when the model has no DP replicas.
    replica_held: per replica, the ids of the requests whose sampling state its rank holds (sent
    once, docs/serving.md §6).
    speculative: the speculative decoding config (docs/serving.md §13), None = off.
    drafter: the EAGLE-3 draft run after every step (engine/eagle.py, docs/serving.md §14), None
    unless speculative.method is eagle3.
    requests: the one table of requests added and not finished, keyed by id (filled by
    ``add_request``, so an id is in use from then until its final output); inbox: the one queue of
    adds and aborts into the step loop; both guarded by ``lock``.
    """

    config: MiniMaxM2Config
    schedulers: list[Scheduler]
    runner: ModelRunner
    max_length: int
    generator: torch.Generator
    requests: dict[str, Request] = field(default_factory=dict)
    inbox: list[tuple[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrivals: int = 0
    steps: int = 0
    replica_held: list[set[str]] = field(default_factory=list)
    speculative: SpeculativeConfig | None = None
    drafter: Eagle3Drafter | None = None

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """Load ``args.model`` and size the KV pool (planner unless ``num_kv_pages`` is set).
        Raises ValueError for a bad ``args.speculative_config`` before loading anything, and for an
        eagle3 draft that does not fit the target or a multi-rank deployment
        (:func:`check_speculative_target`) once the target's config is read, before its weights."""
        if args.model is None:
            raise ValueError("EngineArgs.model is None: pass a checkpoint directory")
        dtype_bytes("dtype", args.dtype)
        speculative = parse_speculative_config(args.speculative_config)   # a bad config fails before the load
        devices = rank_devices(args.devices)
        config = MiniMaxM2Config.from_pretrained(args.model)
        check_speculative_target(speculative, config, len(devices))
        if args.num_kv_pages is None:   # plan before loading: free memory still includes the weights'
            plan = plan_memory(config, args)
            args = replace(args, num_kv_pages=plan.num_pages, max_length=plan.max_length)
        if len(devices) > 1:
            model = start_distributed_model(args)
        else:
            model = load_model(args.model, dtype=getattr(torch, args.dtype), device=devices[0],
                               weight_dequant=args.weight_dequant, attention_backend=args.attention_backend,
                               fp8_linear=args.fp8_linear,
                               batch_invariant=batch_invariant_enabled(args),
                               activation_quant=args.activation_quant,
                               quantize_unquantized=args.quantize_unquantized)
        return cls.from_model(model, config, args, device=devices[0])

    @classmethod
    def from_model(cls, model: Callable[[ForwardBatch, KVStorage], torch.Tensor], config: MiniMaxM2Config,
                   args: EngineArgs, device: torch.device | str = "cpu",
                   kv_scales: tuple[list[float], list[float]] | None = None) -> LLMEngine:
        """Engine around a built model. ``kv_scales`` = per-layer (k_scale, v_scale) for fp8 KV;
        by default taken from ``model.kv_scales`` when the model has it, else 1.0.

        A multi-rank model (parallel/worker.py ``DistributedModel``) tells the pool's KV heads per
        rank (``num_kv_heads``) and its data-parallel replicas (``data_parallel_degree``): the
        engine then holds one scheduler and one pool of ``num_kv_pages`` pages per replica, each
        with its own token budget and prefix cache (page ids are replica-local; rank 0's
        ``runner.kv_storage`` is replica 0's pool). Without ``args.num_kv_pages`` the planner sizes
        each pool from the memory
        free now (the model already loaded, so this under-counts; :meth:`from_args` plans before
        loading). ``max_length`` defaults to max_position_embeddings, lowered to the pool's
        capacity with a warning; an explicit ``args.max_length`` larger than the pool is a
        ValueError, as is a non-positive max_length, an unknown kv_cache_format, a non-positive
        page size or a bad ``args.speculative_config`` (naming the field). On one CUDA device (or
        TP_TP CUDA ranks: every rank at once) with the triton attention backend and without
        ``args.enforce_eager`` the decode graphs are captured here, one per batch-size bucket
        (docs/serving.md §6.3); ``runner.graphs_off`` says why not otherwise. An eagle3
        ``speculative_config`` loads the draft here (one more K/V layer in the pool, the target's aux
        layer ids set, decode graphs off; docs/serving.md §14); ValueError for a multi-rank or
        data-parallel model or a draft that does not fit the target (naming the field)."""
        dtype = kv_cache_dtype(args.kv_cache_format)
        speculative = parse_speculative_config(args.speculative_config)
        replicas = getattr(model, "data_parallel_degree", 1)
        eagle = speculative is not None and speculative.method == "eagle3"
        if eagle and (replicas > 1 or not hasattr(model, "set_aux_layer_ids")):
            raise ValueError("speculative_config.method='eagle3': the model is multi-rank or does not expose "
                             "aux hidden states (set_aux_layer_ids); EAGLE-3 drafts run on one device "
                             "with MiniMaxM2ForCausalLM only (docs/serving.md §14)")
        check_speculative_target(speculative, config)
        S = check_page_and_length(args)
        num_pages = args.num_kv_pages
        if num_pages is None:
            num_pages = plan_memory(config, args).num_pages
        max_length = fit_max_length(args.max_length, config.max_position_embeddings, num_pages, S)
        if kv_scales is None:
            kv_scales = getattr(model, "kv_scales", None)
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        num_kv_heads = getattr(model, "num_kv_heads", config.num_key_value_heads)
        graphs_off = graphs_off_reason(model, device, args.enforce_eager, replicas)
        if eagle and graphs_off is None:
            graphs_off = "eagle3 drafting runs eagerly"
        pad = int(graphs_off is None)   # the graphs' padding page, allocated with the pool (no regrowth)
        storage = zeroed_kv_storage(config.num_hidden_layers, num_pages + pad, S, num_kv_heads,
                                    config.head_dim, dtype, device, k_scale, v_scale)
        drafter = None
        if eagle:
            drafter = _load_drafter(model, config, speculative, storage, args, device)  # type: ignore[arg-type]
        penalties = PenaltyState(config.vocab_size, device)   # rank 0 samples every replica's rows
        schedulers = [Scheduler(KVCacheManager(num_pages, S, args.enable_prefix_caching, int(eagle)),
                                args.max_batch_input_tokens, args.max_batch_size, penalties, speculative)
                      for _ in range(replicas)]
        runner = ModelRunner(model, storage, device, buffers=StepBuffers(torch.device(device)),
                             sampling_buffers=StepBuffers(torch.device(device)), graphs_off=graphs_off)
        if graphs_off is None:   # decode under CUDA graphs, captured now (docs/serving.md §6.3)
            runner.pad_page = num_pages
            # the scheduler's max_batch_size (clamped to the token budget): no bucket no step reaches
            runner.enable_graphs(schedulers[0].max_batch_size, max_length, capture=True)
        return cls(config=config, schedulers=schedulers, runner=runner, drafter=drafter,
                   replica_held=[set() for _ in schedulers], speculative=speculative,
                   max_length=max_length, generator=torch.Generator().manual_seed(args.seed))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *,
                    constraint: TokenConstraint | None = None) -> None:
        """Queue a request; thread-safe. It joins the batch at the next ``step()``.

        ``constraint``: an optional `TokenConstraint` (engine/constraint.py) that masks every draw
        of this request and is told each drawn token. An unseeded request draws its stream seed
        from the engine's generator (EngineArgs.seed) here, in call order.

        Raises ValueError for an empty prompt, a token id outside the vocabulary (prompt or
        params), a prompt longer than the max context (stating both numbers), n != 1, or a
        request_id already in use.
        """
        params = (sampling_params or SamplingParams()).resolved(self.config.generation)
        params.check_token_ids(self.config.vocab_size)
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: the engine runs n=1 sequences (got n={params.n}); "
                             "fan out above it with params.child(i)")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        V = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: prompt token id {bad} is outside the "
                             f"vocabulary [0, {V})")
        too_long = prompt_length_error(len(ids), self.max_length)
        if too_long:
            raise ValueError(f"request {request_id!r}: {too_long}")
        with self.lock:
            if request_id in self.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            state = SamplingState.new(params, self.config.eos_token_ids, self.generator)
            req = Request(request_id, ids, state, arrival=self.arrivals, max_length=self.max_length,
                          constraint=constraint)
            self.arrivals += 1
            self.requests[request_id] = req
            self.inbox.append(("add", req))

    def abort_request(self, request_id: str) -> None:
        """Abort a request (thread-safe); its pages are freed at the start of the next step, which
        returns its final output with finish_reason "abort". Unknown ids are ignored."""
        with self.lock:
            self.inbox.append(("abort", request_id))

    @property
    def recovers_from_step_failure(self) -> bool:
        """Whether a failed ``step()`` can be followed by ``abort_running()`` and more steps: True for
        a single-process model, False for a multi-rank one (``DistributedModel``: its ranks may be out
        of step after a failure)."""
        return getattr(self.runner.model, "recovers_from_step_failure", True)

    def abort_running(self) -> list[str]:
        """Finish every running request at once (reason "abort", pages freed) and return their ids.

        The recovery after a failed ``step()``: the requests of the failed batch may hold half-updated
        state (tokens appended, pages partly written), so they end; waiting requests (no computed
        tokens, no pages) and queued adds are untouched and run in the next steps."""
        victims = [r for s in self.schedulers for r in s.running]
        for r in victims:
            self._finish(r, "abort")
        return [r.request_id for r in victims]

    def has_unfinished_requests(self) -> bool:
        """Any request queued, waiting or running."""
        with self.lock:
            return bool(self.inbox) or any(s.has_unfinished() for s in self.schedulers)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` was added and has not finished (its final output not yet returned);
        thread-safe."""
        with self.lock:
            return request_id in self.requests

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: queued adds + the scheduler's waiting queue; thread-safe
        (the server's queue bound reads it from the event loop)."""
        with self.lock:
            return (sum(kind == "add" for kind, _ in self.inbox)
                    + sum(len(s.waiting) for s in self.schedulers))

    @property
    def scheduler(self) -> Scheduler:
        """Replica 0's scheduler (the only one without data parallelism)."""
        return self.schedulers[0]

    @property
    def stats(self) -> EngineStats:
        """Current gauges and counters, summed over the replicas, with each replica's gauges."""
        ss = self.schedulers
        kvs = [s.kv for s in ss]
        replicas = [ReplicaStats(len(s.running), len(s.waiting), s.kv.num_pages, s.kv.num_used_pages,
                                 s.kv.num_free_pages) for s in ss]
        return EngineStats(
            running=sum(r.running for r in replicas), waiting=self.num_waiting,
            kv_pages_total=sum(r.kv_pages_total for r in replicas),
            kv_pages_used=sum(r.kv_pages_used for r in replicas),
            kv_pages_free=sum(r.kv_pages_free for r in replicas), kv_page_size=kvs[0].page_size,
            prefix_cache_queries=sum(kv.stats.queries for kv in kvs),
            prefix_cache_hits=sum(kv.stats.hits for kv in kvs),
            prefix_cache_requests=sum(kv.stats.requests for kv in kvs),
            prefix_cache_requests_hit=sum(kv.stats.requests_hit for kv in kvs),
            chunked_prefill_steps=sum(s.stats.chunked_prefill_steps for s in ss),
            preemptions=sum(s.stats.preemptions for s in ss),
            generated_tokens=sum(s.stats.generated_tokens for s in ss), steps=self.steps, replicas=replicas,
            spec_drafts=sum(s.stats.spec_drafts for s in ss),
            spec_draft_tokens=sum(s.stats.spec_draft_tokens for s in ss),
            spec_accepted_tokens=sum(s.stats.spec_accepted_tokens for s in ss),
            spec_accepted_per_pos=[sum(v) for v in zip_longest(*(s.stats.spec_accepted_per_pos for s in ss),
                                                                fillvalue=0)])

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that produced tokens or finished."""
        outputs = self._drain_inbox()
        parts = [s.schedule().scheduled for s in self.schedulers]   # replica by replica
        scheduled = [x for part in parts for x in part]
        if not scheduled:
            return outputs
        self.steps += 1
        kvs = [s.kv for s in self.schedulers]
        completing = [[s for s in part if s.completes] for part in parts]
        accepted: list[list[int] | None] = [None] * len(parts)
        if self.runner.samples_on_replicas and not any(wants_prompt_logprobs(s) for s in scheduled) \
                and not any(s.request.state.needs_penalties for done in completing for s in done) \
                and not any(s.draft_token_ids for s in scheduled):
            # each replica draws its own rows; only token ids and logprobs come back
            rows = [self._sampling_rows(done, self.replica_held[i])[0] for i, done in enumerate(completing)]
            drawn = self.runner.run_sampled(scheduled, kvs, rows)
        else:   # speculative steps draw here (rank 0): their K + 1 rows per request
            drawn, accepted = self._run_and_sample(scheduled, kvs, completing)
        before = [(s.request.num_computed_tokens, s.completes) for s in scheduled]
        for sched, part, mine, acc in zip(self.schedulers, parts, drawn, accepted, strict=True):
            for r in sched.update_from_output(part, mine, acc):
                if r.is_finished:
                    self._forget(r)
                outputs.append(self._output(r))
        if self.drafter is not None:
            self._draft(scheduled, before)
        return outputs

    def _draft(self, scheduled: list[ScheduledRequest], before: list[tuple[int, bool]]) -> None:
        """Run the EAGLE-3 draft over the positions the step kept (engine/eagle.py, docs/serving.md
        §14). ``before``: per scheduled request, its computed tokens before the step and whether its
        chunk completed the sequence (read before the update moved them)."""
        spans, row = [], 0
        for s, (c, completes) in zip(scheduled, before, strict=True):
            r = s.request
            if not r.is_finished:
                spans.append(DraftSpan(r, c, r.num_computed_tokens - c, row, completes))
            row += s.num_new_tokens
        aux = self.runner.model.aux_hidden   # type: ignore[attr-defined]
        self.drafter.run(spans, aux, self.runner.kv_storage, self.scheduler.kv)   # type: ignore[union-attr]

    def _run_and_sample(self, scheduled: list[ScheduledRequest], kvs: list[KVCacheManager],
                        completing: list[list[ScheduledRequest]]
                        ) -> tuple[list[SamplerOutput], list[list[int] | None]]:
        """Run the step, record prompt logprobs and draw every replica's rows here, from the
        logits (on rank 0 for a multi-rank model); per replica a `SamplerOutput` and the accepted
        drafts of each completing request (docs/serving.md §13: its accepted drafts and the
        target's next token are its tokens in the output). ``completing``: per replica, the
        scheduled requests whose chunk completes."""
        plans = [self._sampling_rows(done) for done in completing]   # constraints filled before the run
        keep = iter([k for _, ks in plans for k in ks])
        logits = self.runner.run(scheduled, kvs)
        last: list[torch.Tensor] = []
        for s, lg in zip(scheduled, logits, strict=True):
            if wants_prompt_logprobs(s):
                self._add_prompt_logprobs(s.request, lg)
            if s.completes:   # rows of positions num_tokens - 1 .. (+ the drafts kept)
                first = lg.shape[0] - 1 - len(s.draft_token_ids)
                last.extend(lg[first:first + 1 + next(keep)])
        out: list[SamplerOutput] = []
        accepted: list[list[int] | None] = []
        for done, (rows, kept) in zip(completing, plans, strict=True):
            mine, last = last[:rows.num_rows], last[rows.num_rows:]
            drawn = (rows.sample(torch.stack(mine), self.scheduler.penalties,
                                 buffers=self.runner.sampling_buffers)
                     if mine else SamplerOutput([], []))
            if not any(s.draft_token_ids for s in done):
                out.append(drawn)
                accepted.append(None)
                continue
            # drafts with their own q (EAGLE-3, sampled): the rejection rule, all such requests at once
            rule = [j for j, (s, k) in enumerate(zip(done, kept, strict=True))
                    if self.drafter is not None and k and not is_greedy(s.request.state)]
            logp, verdicts = None, {}
            if rule:
                logp = rows.probs(torch.stack(mine), self.scheduler.penalties, log=True)   # [rows, V] log p
                verdicts = self._rejection(done, kept, rule, logp)
            toks: list[int] = []
            lps: list = []
            acc: list[int] = []
            o = 0
            for j, (s, k) in enumerate(zip(done, kept, strict=True)):
                if j in verdicts:
                    a, last_token = verdicts[j]
                    emitted = s.draft_token_ids[:a] + [last_token]
                    toks += emitted
                    n = s.request.sampling_params.logprobs
                    lps += ([None] * (a + 1) if n is None else   # type: ignore[index]
                            compute_logprobs(logp[o:o + a + 1], torch.tensor(emitted, device=logp.device),
                                             [n] * (a + 1)))
                else:
                    samples = drawn.token_ids[o:o + k + 1]
                    a = accepted_length(s.draft_token_ids[:k], samples)
                    toks += samples[:a + 1]
                    lps += drawn.logprobs[o:o + a + 1]
                acc.append(a)
                o += k + 1
            out.append(SamplerOutput(toks, lps))
            accepted.append(acc)
        return out, accepted

    @staticmethod
    def _rejection(done: list[ScheduledRequest], kept: list[int], rule: list[int],
                   logp: torch.Tensor) -> dict[int, tuple[int, int]]:
        """The rejection rule (engine/speculative.py ``rejection_sample_batched``) for the requests
        ``done[j]``, j in ``rule``, each verifying its first ``kept[j]`` drafts: p from ``logp``
        [rows, V] (log of the target's p, each request's kept[j] + 1 rows in ``done`` order), q the
        rows of its proposal; accept uniforms from the request's ACCEPT_STREAM, the residual / bonus
        draw's from its own stream, both keyed by output position (docs/serving.md §14). One host
        copy. Returns j -> (accepted drafts a, the token after them)."""
        starts = [0]
        for k in kept:
            starts.append(starts[-1] + k + 1)
        dev, V = logp.device, logp.shape[1]
        K = max(kept[j] for j in rule)
        row_idx, drafts, nd, q, seeds_a, seeds_r, pos = [], [], [], [], [], [], []
        for j in rule:
            s, k = done[j], kept[j]
            r = s.request
            row_idx.append([starts[j] + min(i, k) for i in range(K + 1)])   # padding repeats row k
            drafts.append(s.draft_token_ids[:k] + [0] * (K - k))
            nd.append(k)
            q.append(torch.nn.functional.pad(r.draft_proposal.probs[:k], (0, 0, 0, K - k)))
            seeds_a.append(stream_seed(r.state.seed, ACCEPT_STREAM))
            seeds_r.append(stream_seed(r.state.seed, 0))
            pos.append(r.num_output_tokens)
        B = len(rule)
        at = torch.tensor(pos, dtype=torch.int64, device=dev).unsqueeze(1) + torch.arange(K + 1, device=dev)
        sa = torch.tensor(seeds_a, dtype=torch.int64, device=dev).unsqueeze(1).expand(B, K + 1)
        sr = torch.tensor(seeds_r, dtype=torch.int64, device=dev).unsqueeze(1).expand(B, K + 1)
        ua = counter_uniforms(sa.reshape(-1), at.reshape(-1)).view(B, K + 1)[:, :K]
        ur = counter_uniforms(sr.reshape(-1), at.reshape(-1)).view(B, K + 1)
        p = logp.index_select(0, torch.tensor(row_idx, device=dev).view(-1)).view(B, K + 1, V).exp()
        a, token = rejection_sample_batched(torch.tensor(drafts, device=dev), torch.tensor(nd, device=dev),
                                            torch.stack(q).to(dev), p, ua, ur)
        out = torch.stack([a, token]).tolist()   # the one host copy
        return {j: (out[0][b], out[1][b]) for b, j in enumerate(rule)}

    def _sampling_rows(self, done: list[ScheduledRequest], held: set[str] | None = None
                       ) -> tuple[SamplingRows, list[int]]:
        """The sampler's rows for the completing requests ``done`` and, per request, how many of its
        drafts are verified. A plain request has one row; a speculative decode with K drafts has
        K + 1 (docs/serving.md §13), row i drawn as if drafts 1..i had been generated: output
        position + i, the reasoning state after them, the drafts counted for the penalties, and
        its constraint's bitmask after them (the matcher advances over each draft it allows and
        is rolled back after; the drafts stop before the first one the grammar forbids or that
        ends it). Constraints fill the allowed-token bitmask (all bits set for rows without one).
        ``held``: ids of the requests whose state the drawing replica holds already (updated)."""
        V = self.config.vocab_size
        W = bitmask_words(V)
        ids: list[str] = []
        states: list[SamplingState] = []
        positions: list[int] = []
        reasoning: list[bool] = []
        ends: list[bool] = []
        masks: list[torch.Tensor | None] = []
        draft_rows: list[int] = []
        draft_ids: list[int] = []
        kept: list[int] = []
        for s in done:
            r, drafts, c = s.request, s.draft_token_ids, s.request.constraint
            sim = replace(r.state) if drafts else r.state   # reasoning state along the drafts
            k, advanced = len(drafts), 0
            for i in range(len(drafts) + 1):
                b = len(ids)
                ids.append(r.request_id)
                states.append(r.state)
                positions.append(r.num_output_tokens + i)
                reasoning.append(sim.in_reasoning)
                if r.state.penalty_row and i:
                    draft_rows += [b] * i
                    draft_ids += drafts[:i]
                mask = None
                if c is not None:
                    mask = torch.full((1, W), -1, dtype=torch.int32)   # [1, ceil(V/32)], host
                    c.fill_bitmask(mask, 0)
                masks.append(mask)
                ends.append(c.only_end_of_turn() if c is not None else False)
                if i == len(drafts):
                    break
                d = drafts[i]
                if c is not None:
                    if not (int(mask[0, d // BITMASK_WORD_BITS]) >> (d % BITMASK_WORD_BITS)) & 1:  # type: ignore[index]
                        k = i
                        break
                    c.accept_token(d)
                    advanced += 1
                    if c.is_terminated():
                        k = i
                        break
                sim.observe(d)
            if advanced:
                c.rollback(advanced)  # type: ignore[union-attr]
            kept.append(k)
        allowed = None
        if any(m is not None for m in masks):
            allowed = torch.cat([m if m is not None else torch.full((1, W), -1, dtype=torch.int32)
                                 for m in masks])   # [rows, ceil(V/32)], host
        rows = SamplingRows.of(ids, states, positions, ends, allowed, V, held, reasoning,
                               (draft_rows, draft_ids))
        return rows, kept

    def _drain_inbox(self) -> list[RequestOutput]:
        with self.lock:
            inbox, self.inbox = self.inbox, []
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                item.replica = choose_replica(self.schedulers, item)
                self.schedulers[item.replica].add(item)
            else:
                with self.lock:
                    r = self.requests.get(item)
                if r is not None:
                    self._finish(r, "abort")
                    outputs.append(self._output(r))
        return outputs

    def _finish(self, r: Request, reason: str) -> None:
        self.schedulers[r.replica].finish(r, reason)
        self._forget(r)

    def _forget(self, r: Request) -> None:
        """Drop a finished request from the request table (its id becomes free again)."""
        with self.lock:
            del self.requests[r.request_id]
        self.runner.finished_request_ids.append(r.request_id)   # the other ranks forget its pages
        for held in self.replica_held:                            # and its sampling state
            held.discard(r.request_id)

    def _output(self, r: Request) -> RequestOutput:
        new = r.output_token_ids[r.num_sent_tokens:]
        p = r.sampling_params
        first = r.num_sent_tokens == 0
        out = RequestOutput(
            request_id=r.request_id, new_token_ids=new, finished=r.is_finished,
            finish_reason=r.finish_reason,
            new_logprobs=r.logprobs[r.num_sent_tokens:] if p.logprobs is not None else None,
            prompt_logprobs=r.prompt_logprobs if first and p.prompt_logprobs is not None else None,
            num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=max(r.num_cached_tokens, 0),
            num_reasoning_tokens=r.state.num_reasoning_tokens)
        r.num_sent_tokens = r.num_output_tokens
        return out

    def _add_prompt_logprobs(self, r: Request, logits: torch.Tensor) -> None:
        """Prompt logprobs of the chunk: row i (position c + i) scores prompt token c + i + 1.
        Entry 0 is None (the first token has no logprob); rows already recorded before a
        preemption are skipped."""
        if not r.prompt_logprobs:
            r.prompt_logprobs.append(None)
        c = r.num_computed_tokens
        first = max(len(r.prompt_logprobs) - 1 - c, 0)           # first new row to keep
        last = min(logits.shape[0], r.num_prompt_tokens - 1 - c)  # rows that score prompt tokens
        if last <= first:
            return
        nxt = torch.tensor(r.prompt_token_ids[c + 1 + first:c + 1 + last], dtype=torch.int64)
        k = r.sampling_params.prompt_logprobs
        r.prompt_logprobs.extend(compute_logprobs(logits[first:last], nxt.to(logits.device), [k] * len(nxt)))

