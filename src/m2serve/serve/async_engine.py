"""The engine in its own thread, shared by all HTTP requests.

One engine thread steps the :class:`~m2serve.serve.llm.LLM`'s request table (output.py
``RequestTable``: one record per engine request, the one path into the engine). HTTP handlers (on
the asyncio loop) add and abort requests through the same table (its ``add`` / ``abort`` go straight
into the engine's inbox and wake the engine thread) and read their request's deltas from an
``asyncio.Queue`` that the engine thread fills through ``loop.call_soon_threadsafe`` (the record's
``deliver``). Many streams therefore share one continuous batch.

Backpressure: ``max_queue_size`` bounds the requests waiting for admission
(``LLMEngine.num_waiting``: queued adds + the scheduler's waiting queue); a submit beyond it raises
:class:`QueueFullError` (the server answers 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.sampling import SamplingParams
from m2serve.serve.metrics import ServerMetrics
from m2serve.serve.output import OutputDelta, OutputProcessor, RequestRecord

if TYPE_CHECKING:  # llm.py imports the chat pipeline, which imports this module
    from m2serve.serve.llm import LLM

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


class AsyncEngine:
    """Steps the LLM's request table (``llm.requests``) in a background thread; per-request async
    streams of OutputDelta.

    llm: the text-level engine; metrics: updated from the engine thread (token counts, TTFT,
    ITL, gauges); max_queue_size: None = unbounded.
    """

    def __init__(
        self, llm: LLM, metrics: ServerMetrics | None = None, max_queue_size: int | None = None
    ) -> None:
        self.llm = llm
        self.requests = llm.requests
        self.metrics = metrics or ServerMetrics()
        self.max_queue_size = max_queue_size
        self._submit_lock = threading.Lock()  # the queue bound's check and the add, as one
        self._wake = threading.Event()  # set after every add/abort: the idle engine thread waits on it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.metrics.set_engine(llm.engine.stats)  # the gauges (KV pages free ...) before the first step

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; deltas are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="m2serve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every open request and stop the engine thread."""
        for rid in self.requests.ids():
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (LLMEngine.num_waiting)."""
        return self.llm.engine.num_waiting

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

        Several requests (the n choices of one HTTP request) may share one queue. Called on the
        event loop. A request the engine rejects (prompt too long ...) puts its ValueError on the
        queue, as :meth:`stream` raises it. Raises QueueFullError / EngineDeadError.
        """
        q = q if q is not None else asyncio.Queue()
        with self._submit_lock:
            self._check_alive()
            if self.max_queue_size is not None and self.num_waiting >= self.max_queue_size:
                raise QueueFullError(
                    f"the waiting queue is full ({self.num_waiting} >= --max-queue-size "
                    f"{self.max_queue_size}); retry later"
                )
            deliver = functools.partial(self._loop.call_soon_threadsafe, q.put_nowait)
            try:
                self.requests.add(request_id, prompt_token_ids, params, processor, deliver,
                                  constraint=constraint)
            except ValueError as e:  # rejected at admission: the request's fault
                q.put_nowait(e)
                return q
        self._wake.set()
        self.metrics.count_prompt(len(prompt_token_ids))
        if not self.alive:  # the engine died while it was added: its record may have missed fail_all
            self.abort(request_id)
            self._check_alive()
        return q

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, shutdown). Idempotent."""
        if self.requests.abort(request_id):
            self.metrics.aborted.inc()
            self._wake.set()

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

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(
                f"the engine is not running ({self.error!r})" if self.error else "the engine is not running"
            )

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        """The engine loop. A step that raises ends the requests of its batch (StepFailedError to
        their clients, pages freed) and the loop goes on with the waiting ones; after
        MAX_CONSECUTIVE_STEP_FAILURES failures in a row, or after any failure of a multi-rank model
        (LLMEngine.recovers_from_step_failure), the engine is declared dead (every request fails with
        EngineDeadError and /health turns 503)."""
        table = self.requests
        failures = 0
        while not self._stop.is_set():
            self._wake.clear()  # an add after this sets it again; one before it is seen just below
            if not table.has_unfinished():
                self._wake.wait(0.5)
                continue
            try:
                outputs = table.step()
                failures = 0
            except Exception as e:  # noqa: BLE001 - a failed step must not take the server down
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                msg = f"engine step failed: {type(e).__name__}: {e}"
                if failures < MAX_CONSECUTIVE_STEP_FAILURES and self.llm.engine.recovers_from_step_failure:
                    try:
                        table.abort_running(StepFailedError(msg + "; this request was ended"))
                    except Exception:  # noqa: BLE001 - the engine state itself is broken
                        log.exception("ending the failed batch failed")
                    else:
                        self.metrics.set_engine(self.llm.engine.stats)
                        continue
                self.error = e
                table.fail_all(EngineDeadError(msg))
                return
            now = time.perf_counter()
            self.metrics.set_engine(self.llm.engine.stats)
            for rec, d in outputs:
                self._deliver(rec, d, now)

    def _deliver(self, rec: RequestRecord, d: OutputDelta, now: float) -> None:
        """Count the delta in the metrics and hand it to its consumer."""
        if d.token_ids:
            last = None if rec.last_output is None else now - rec.last_output
            self.metrics.count_output(len(d.token_ids), now - rec.arrival, last)
            rec.last_output = now
        if d.finished and d.finish_reason != "abort":
            self.metrics.count_finished(d.finish_reason, now - rec.arrival)
        parser = rec.processor.parser
        if d.finished and parser is not None:
            if parser.rejected_tool_calls:
                self.metrics.tool_calls_rejected.labels(reason="undeclared").inc(parser.rejected_tool_calls)
            if parser.parser_error:
                self.metrics.parser_errors.inc()
        if rec.deliver is not None:
            rec.deliver(d)
