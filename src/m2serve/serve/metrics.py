"""Prometheus metrics for the server (docs/serving.md §10).

One :class:`ServerMetrics` per server, on its own ``CollectorRegistry`` (no process-global
registry, so tests can run several apps in one process). Units: seconds for latencies.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from m2serve.engine.core import EngineStats

# The engine's cumulative counters: (EngineStats field, metric name, help); vLLM's where it has one.
_ENGINE_COUNTERS = (
    ("preemptions", "vllm:num_preemptions", "Cumulative number of preemptions"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens"),
    ("prefix_cache_requests", "m2serve_prefix_cache_requests",
     "Prefix cache lookups (one per admitted prompt)"),
    ("prefix_cache_requests_hit", "m2serve_prefix_cache_requests_hit",
     "Prefix cache lookups that found at least one page"),
    ("spec_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts"),
    ("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens"),
    ("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens"),
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's counters, histograms and gauges.

    - ``m2serve_requests_total{endpoint, status}``: HTTP requests to the /v1 generation routes by
      status code;
    - ``m2serve_prompt_tokens_total``, ``m2serve_generation_tokens_total``;
    - ``m2serve_time_to_first_token_seconds``, ``m2serve_inter_token_latency_seconds`` (histograms);
    - ``m2serve_num_requests_running`` / ``_waiting``, ``m2serve_kv_pages_used`` / ``_free``,
      ``m2serve_prefix_cache_hit_rate`` (hits / queried tokens) (gauges, the deployment's totals);
    - ``m2serve_replica_num_requests_running{replica}`` / ``_waiting{replica}``,
      ``m2serve_replica_kv_pages_used{replica}`` / ``_free{replica}``: the same gauges, one series per
      data-parallel replica (one replica, "0", without data parallelism; docs/serving.md §8);
    - ``m2serve_tool_calls_rejected_total{reason}``, ``m2serve_parser_errors_total``;
    - ``m2serve_requests_aborted_total`` (client disconnects, shutdown, stop strings excluded);
    - the engine's counters under vLLM's names (v1 ``PrometheusStatLogger``):
      ``vllm:num_preemptions_total`` (requests preempted), ``vllm:prefix_cache_queries_total`` /
      ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / found in the prefix cache), and
      ``m2serve_prefix_cache_requests_total`` / ``m2serve_prefix_cache_requests_hit_total`` (lookups /
      lookups that found a page; vLLM counts these but does not export them);
    - speculative decoding under vLLM's names (docs/serving.md §13): ``vllm:spec_decode_num_drafts_total``
      (drafts verified: one per request and step with a draft), ``vllm:spec_decode_num_draft_tokens_total``
      (tokens drafted), ``vllm:spec_decode_num_accepted_tokens_total`` (drafted tokens accepted) and
      ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` (accepted at draft position
      ``position``, 0-based); all 0 with speculation off;
    - vLLM's gauges ``vllm:num_requests_running`` / ``_waiting`` and ``vllm:kv_cache_usage_perc`` (pages
      held / all pages, 0..1), the same values as m2serve's; vLLM's ``vllm:prompt_tokens_total``,
      ``vllm:generation_tokens_total``, ``vllm:time_to_first_token_seconds``,
      ``vllm:inter_token_latency_seconds`` (the same counts and times as m2serve's),
      ``vllm:e2e_request_latency_seconds`` and ``vllm:request_success_total{finished_reason}`` (requests
      that finished, not aborted).

    Every ``vllm:`` series carries vLLM's ``model_name`` label, the served model name (``model_name``,
    set by api.py ``install``), which vLLM's dashboards select on.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "m2serve_requests",
            "HTTP generation requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("m2serve_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("m2serve_generation_tokens", "Tokens generated", registry=r)
        self.aborted = Counter("m2serve_requests_aborted", "Requests aborted before finishing", registry=r)
        self.ttft = Histogram(
            "m2serve_time_to_first_token_seconds",
            "Time from arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "m2serve_inter_token_latency_seconds",
            "Time between consecutive outputs of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # vLLM's names carry vLLM's model_name label (its dashboards select on it): the served model
        # name, set when the engine is installed (api.py install); no series before that
        self.model_name = ""
        m = ["model_name"]
        self.vllm_gauges = {
            "running": Gauge("vllm:num_requests_running", "Number of requests in model execution batches",
                             m, registry=r),
            "waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed",
                             m, registry=r),
            "kv_usage": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                              m, registry=r),
        }
        # vLLM's request counters and latency histograms, updated with m2serve's (count_prompt, count_output,
        # count_finished)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed", m,
                                          registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens",
                                              "Number of generation tokens processed", m, registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                  "seconds", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                  "seconds", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests",
                                    ["model_name", "finished_reason"], registry=r)
        self.running = Gauge("m2serve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("m2serve_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_used = Gauge("m2serve_kv_pages_used", "KV cache pages held by requests", registry=r)
        self.kv_free = Gauge(
            "m2serve_kv_pages_free", "KV cache pages free (including evictable cached pages)", registry=r
        )
        self.replica_gauges = {
            name: Gauge(f"m2serve_replica_{metric}", f"{text}, per data-parallel replica", ["replica"],
                        registry=r)
            for name, metric, text in (
                ("running", "num_requests_running", "Requests in the running batch"),
                ("waiting", "num_requests_waiting", "Requests waiting for admission in the scheduler"),
                ("kv_pages_used", "kv_pages_used", "KV cache pages held by requests"),
                ("kv_pages_free", "kv_pages_free", "KV cache pages free (including evictable cached pages)"),
            )
        }
        self.prefix_hit_rate = Gauge(
            "m2serve_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried prompt tokens since start",
            registry=r,
        )
        self.tool_calls_rejected = Counter(
            "m2serve_tool_calls_rejected", "Tool calls not returned", ["reason"], registry=r
        )
        self.tool_calls_rejected.labels(reason="undeclared")  # exported as 0 before the first rejection (P13)
        self.parser_errors = Counter("m2serve_parser_errors", "Internal parser errors (P20)", registry=r)
        # EngineStats field -> counter following it (the engine's counts are cumulative); vLLM's names
        # carry the model_name label
        self.engine_counters = {
            field: Counter(name, text, m if name.startswith("vllm:") else [], registry=r)
            for field, name, text in _ENGINE_COUNTERS
        }
        self._labelled = {field for field, name, _ in _ENGINE_COUNTERS if name.startswith("vllm:")}
        self._engine_counts = dict.fromkeys(self.engine_counters, 0)
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position", ["model_name", "position"], registry=r,
        )
        self._per_pos: list[int] = []

    def set_engine(self, g: EngineStats) -> None:
        """Update the gauges and the engine's counters from an engine snapshot (LLMEngine.stats)."""
        for name, counter in self.engine_counters.items():
            value = getattr(g, name)
            series = counter.labels(model_name=self.model_name) if name in self._labelled else counter
            series.inc(value - self._engine_counts[name])
            self._engine_counts[name] = value
        for i, value in enumerate(g.spec_accepted_per_pos):
            if i == len(self._per_pos):
                self._per_pos.append(0)
            self.spec_accepted_per_pos.labels(model_name=self.model_name, position=str(i)).inc(
                value - self._per_pos[i])
            self._per_pos[i] = value
        self.running.set(g.running)
        self.waiting.set(g.waiting)
        for name, value in (("running", g.running), ("waiting", g.waiting),
                            ("kv_usage", g.kv_pages_used / g.kv_pages_total if g.kv_pages_total else 0.0)):
            self.vllm_gauges[name].labels(model_name=self.model_name).set(value)
        self.kv_used.set(g.kv_pages_used)
        self.kv_free.set(g.kv_pages_free)
        for i, rep in enumerate(g.replicas):
            for name, gauge in self.replica_gauges.items():
                gauge.labels(replica=str(i)).set(getattr(rep, name))
        self.prefix_hit_rate.set(
            g.prefix_cache_hits / g.prefix_cache_queries if g.prefix_cache_queries else 0.0
        )

    def count_prompt(self, num_tokens: int) -> None:
        """A request's prompt admitted (``num_tokens`` tokens)."""
        self.prompt_tokens.inc(num_tokens)
        self.vllm_prompt_tokens.labels(model_name=self.model_name).inc(num_tokens)

    def count_output(self, num_tokens: int, since_arrival: float, since_last: float | None) -> None:
        """One delta of ``num_tokens`` tokens: seconds since the request arrived, and since its previous
        delta (None for its first: a time to first token, else an inter-token latency)."""
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.labels(model_name=self.model_name).inc(num_tokens)
        if since_last is None:
            self.ttft.observe(since_arrival)
            self.vllm_ttft.labels(model_name=self.model_name).observe(since_arrival)
        else:
            self.itl.observe(since_last)
            self.vllm_itl.labels(model_name=self.model_name).observe(since_last)

    def count_finished(self, finish_reason: str | None, since_arrival: float) -> None:
        """A request finished, not aborted: vLLM's success counter by its finished_reason (vLLM's engine
        reasons: ``length``, else ``stop``; a chat's ``tool_calls`` is a stop) and end-to-end latency."""
        reason = "length" if finish_reason == "length" else "stop"
        self.vllm_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.vllm_e2e.labels(model_name=self.model_name).observe(since_arrival)

    def label_model(self, name: str, g: EngineStats) -> None:
        """Use ``name`` as vLLM's ``model_name`` label from now on: the ``vllm:`` series under the old
        name are dropped and ``g``'s counts (cumulative) published under the new one."""
        self.model_name = name
        for metric in (*self.vllm_gauges.values(), self.spec_accepted_per_pos):   # (request series: none yet)
            metric.clear()
        for key in self._labelled:
            self.engine_counters[key].clear()
            self._engine_counts[key] = 0
        self._per_pos = []
        self.set_engine(g)

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
