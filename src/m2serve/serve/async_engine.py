"""The engine in its own thread, shared by all HTTP requests.

One engine thread owns the :class:`~m2serve.serve.llm.LLM` (engine + text pipeline). HTTP handlers
(on the asyncio loop) never touch it: they put ``add`` / ``abort`` commands into a thread-safe
inbox and read their request's deltas from a per-request ``asyncio.Queue`` that the engine thread
fills through ``loop.call_soon_threadsafe``. Many streams therefore share one continuous batch.

Backpressure: ``max_queue_size`` bounds the requests waiting for admission (engine waiting queue +
inbox); a submit beyond it raises :class:`QueueFullError` (the server answers 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.sampling import SamplingParams
from m2serve.serve.llm import LLM
from m2serve.serve.metrics import EngineGauges, ServerMetrics
from m2serve.serve.output import OutputDelta, OutputProcessor
from m2serve.text.parser import StreamingParser

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is full (``--max-queue-size``); retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down."""


class StepFailedError(EngineDeadError):
    """An engine step raised; the requests of that batch were ended, the engine runs on."""


# Consecutive failed steps after which the engine thread gives up (each failure ends the running
# batch, so a failure that repeats with a new batch is the engine's, not a request's).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(slots=True)
class _Tracked:
    queue: asyncio.Queue
    arrival: float
    last: float | None = None
    parser: StreamingParser | None = None
    finished: bool = False


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    processor: OutputProcessor
    constraint: TokenConstraint | None = None


class AsyncEngine:
    """Runs ``llm.step()`` in a background thread; per-request async streams of OutputDelta.

    llm: the text-level engine; metrics: updated from the engine thread (token counts, TTFT,
    ITL, gauges); max_queue_size: None = unbounded.
    """

    def __init__(
        self, llm: LLM, metrics: ServerMetrics | None = None, max_queue_size: int | None = None
    ) -> None:
        self.llm = llm
        self.metrics = metrics or ServerMetrics()
        self.max_queue_size = max_queue_size
        self._inbox: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._waiting = 0  # engine's waiting queue after the last step
        self._inbox_adds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; deltas are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="m2serve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request still tracked and stop the engine thread."""
        with self._lock:
            ids = list(self._tracked)
        for rid in ids:
            self.abort(rid)
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: engine waiting queue + not yet consumed adds."""
        return self._waiting + self._inbox_adds

    # ------------------------------------------------------------------ requests (asyncio side)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        processor: OutputProcessor,
        q: asyncio.Queue | None = None,
        constraint: TokenConstraint | None = None,
    ) -> asyncio.Queue:
        """Queue a request (``constraint``: its own constrained-decoding matcher, or None); its deltas
        go to ``q`` (a new queue if None), which is returned.

        Several requests (the n choices of one HTTP request) may share one queue.
        Raises QueueFullError / EngineDeadError.
        """
        if not self.alive:
            raise EngineDeadError(
                f"the engine is not running ({self.error!r})" if self.error else "the engine is not running"
            )
        with self._lock:
            if self.max_queue_size is not None and self.num_waiting >= self.max_queue_size:
                raise QueueFullError(
                    f"the waiting queue is full ({self.num_waiting} >= --max-queue-size "
                    f"{self.max_queue_size}); retry later"
                )
            q = q if q is not None else asyncio.Queue()
            self._tracked[request_id] = _Tracked(q, time.perf_counter(), parser=processor.parser)
            self._inbox_adds += 1
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, processor, constraint))
        return q

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, shutdown). Idempotent."""
        with self._lock:
            t = self._tracked.pop(request_id, None)
        if t is not None and not t.finished:
            self.metrics.aborted.inc()
            self._inbox.put(("abort", request_id))

    async def stream(self, request_ids: list[str], q: asyncio.Queue) -> AsyncIterator[OutputDelta]:
        """Yield the deltas of ``request_ids`` (sharing ``q``) until each has finished.

        Aborts the unfinished ones if the consumer goes away (client disconnect cancels the
        consumer) or one of them fails. Raises ValueError when the engine rejected a request at
        admission and EngineDeadError when the engine failed.
        """
        open_ids = set(request_ids)
        try:
            while open_ids:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    open_ids.discard(item.request_id)
                yield item
        finally:
            for rid in open_ids:
                self.abort(rid)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        """The engine loop. A step that raises ends the requests of its batch (StepFailedError to
        their clients, pages freed) and the loop goes on with the waiting ones; after
        MAX_CONSECUTIVE_STEP_FAILURES failures in a row, or after any failure of a multi-rank model
        (LLMEngine.recovers_from_step_failure), the engine is declared dead (every request fails with
        EngineDeadError and /health turns 503)."""
        llm = self.llm
        failures = 0
        while not self._stop.is_set():
            block = not llm.has_unfinished_requests()
            try:
                self._drain(block)
                if self._stop.is_set():
                    break
                if not llm.has_unfinished_requests():
                    continue
                deltas = llm.step()
                failures = 0
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                msg = f"engine step failed: {type(e).__name__}: {e}"
                if failures < MAX_CONSECUTIVE_STEP_FAILURES and llm.engine.recovers_from_step_failure:
                    try:
                        ended = llm.abort_running()
                    except Exception:  # noqa: BLE001 - the engine state itself is broken
                        log.exception("ending the failed batch failed")
                    else:
                        for rid in ended:
                            self._finish_with(rid, StepFailedError(msg + "; this request was ended"))
                        self._update_gauges()
                        continue
                self.error = e
                self._fail_all(EngineDeadError(msg))
                return
            now = time.perf_counter()
            self._update_gauges()
            for d in deltas:
                self._deliver(d, now)

    def _drain(self, block: bool) -> None:
        """Apply queued adds/aborts; waits for one when idle."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item: Any) -> None:
        if item is None:
            return
        if isinstance(item, _Add):
            with self._lock:
                self._inbox_adds -= 1
                tracked = item.request_id in self._tracked
            if not tracked:
                return  # aborted before it reached the engine
            try:
                self.llm.add_request(item.request_id, item.prompt_token_ids, item.params, item.processor,
                                     item.constraint)
            except ValueError as e:  # rejected at admission (prompt too long ...): the request's fault
                self._finish_with(item.request_id, e)
                return
            except Exception as e:  # noqa: BLE001 - one request must not take the engine thread down
                log.exception("adding request %s failed", item.request_id)
                self._finish_with(item.request_id, EngineDeadError(f"{type(e).__name__}: {e}"))
                return
            self.metrics.prompt_tokens.inc(len(item.prompt_token_ids))
            self._waiting += 1  # visible to submit() until the next step refreshes it
        else:
            self.llm.abort_request(item[1])

    def _deliver(self, d: OutputDelta, now: float) -> None:
        with self._lock:
            t = self._tracked.get(d.request_id)
            if t is not None and d.finished:
                t.finished = True
                del self._tracked[d.request_id]
        if t is None:
            return
        if d.token_ids:
            self.metrics.generation_tokens.inc(len(d.token_ids))
            if t.last is None:
                self.metrics.ttft.observe(now - t.arrival)
            else:
                self.metrics.itl.observe(now - t.last)
            t.last = now
        if d.finished and t.parser is not None:
            rejected = t.parser.rejected_tool_calls
            if rejected:
                self.metrics.tool_calls_rejected.labels(reason="undeclared").inc(rejected)
            if t.parser.parser_error:
                self.metrics.parser_errors.inc()
        self._loop.call_soon_threadsafe(t.queue.put_nowait, d)

    def _finish_with(self, request_id: str, err: BaseException) -> None:
        with self._lock:
            t = self._tracked.pop(request_id, None)
        if t is not None:
            self._loop.call_soon_threadsafe(t.queue.put_nowait, err)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            ids = list(self._tracked)
        for rid in ids:
            self._finish_with(rid, err)

    def _update_gauges(self) -> None:
        g = engine_gauges(self.llm.engine)
        self._waiting = g.waiting
        self.metrics.set_engine(g)


def engine_gauges(engine: Any) -> EngineGauges:
    """Snapshot the engine's ``stats`` (running, waiting, KV pages, prefix-cache counters)."""
    s = engine.stats
    s = s() if callable(s) else s
    get = s.get if isinstance(s, dict) else (lambda k, d=0: getattr(s, k, d))
    return EngineGauges(
        running=int(get("running", 0) or get("num_running", 0) or 0),
        waiting=int(get("waiting", 0) or get("num_waiting", 0) or 0),
        kv_pages_used=int(get("kv_pages_used", 0) or 0),
        kv_pages_free=int(get("kv_pages_free", 0) or 0),
        prefix_cache_queries=int(get("prefix_cache_queries", 0) or 0),
        prefix_cache_hits=int(get("prefix_cache_hits", 0) or 0),
    )
