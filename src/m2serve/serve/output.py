"""Output processor: token ids from the engine -> text deltas (docs/parsers.md §1, §3).

One :class:`OutputProcessor` per request (per choice when n > 1). Each engine output goes through,
in order:

1. the incremental detokeniser (text layer; holds back incomplete UTF-8, keeps the four parser
   tags as text, drops other special tokens);
2. stop strings, matched on the raw decoded text (docs/parsers.md §1) by the same detokeniser: the match and
   everything after it is never emitted, also when it is split across tokens (a suffix that may
   still become a stop string is held back until it is decided). A match finishes the request
   with ``finish_reason="stop"``; the caller aborts it in the engine (``stop_hit``);
3. for chat, the streaming reasoning / tool-call parser (docs/parsers.md §3), fed the text that
   survived step 2.

Finish reasons follow P19: ``length`` when the token limit stopped generation, else ``tool_calls``
when at least one call was returned, else ``stop``.

Above the engine, each engine request has one :class:`RequestRecord` (its processor, where its
deltas go, its timings), held in one :class:`RequestTable`, which is also the one way into the
engine: ``add`` / ``abort`` go straight to ``LLMEngine.add_request`` / ``abort_request`` (the
engine's inbox, drained by its next step). The offline ``LLM`` and the server's ``AsyncEngine`` share
the table; only the thread that steps the engine calls :meth:`RequestTable.step`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams, TokenLogprobs
from m2serve.text.detokenizer import IncrementalDetokenizer
from m2serve.text.parser import StreamingParser, ToolCallDelta


@dataclass(slots=True)
class OutputDelta:
    """What one engine step produced for one request, as text.

    text: raw new text after stop-string handling (what /v1/completions returns);
    reasoning / content / tool_calls: the parser's split of that text (chat only; without a
    parser ``content == text``); token_ids / logprobs: the new tokens (logprobs None unless
    requested); prompt_logprobs: once, in the first delta of a request that asked for them;
    tail: the end of ``content`` that the parser's finish step added (held-back text, the raw text of
    a call cut by the limit, P18): it follows this delta's tool-call fragments in the stream;
    stop_reason (finished deltas, vLLM's field): the stop string that ended the output, or the
    ``stop_token_ids`` id it ended on; None for an end of turn, the length limit or an abort.
    """

    request_id: str
    text: str = ""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_hit: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    tail: str = ""


class OutputProcessor:
    """Detokenise, apply stop strings and (optionally) parse one request's output.

    decoder: the text layer's incremental detokeniser for this request, built with the request's
    stop strings (it holds back possible stop prefixes and sets ``stopped`` on a match);
    parser: a text-layer ``StreamingParser`` (chat) or None (raw text);
    reasoning_end_ids: token ids that end reasoning (``</think>``, ``<minimax:tool_call>``) and
    start_in_reasoning: whether the prompt ends inside ``<think>`` (P1) — used only to count
    ``reasoning_tokens`` for usage.
    """

    def __init__(
        self,
        request_id: str,
        decoder: IncrementalDetokenizer,
        parser: StreamingParser | None = None,
        reasoning_end_ids: tuple[int, ...] = (),
        start_in_reasoning: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.stop_token_ids = set(stop_token_ids)
        self.decoder = decoder
        self.parser = parser
        self.reasoning_end_ids = set(reasoning_end_ids)
        self.in_reasoning = start_in_reasoning
        self.finished = False
        self.num_output_tokens = 0
        self.num_reasoning_tokens = 0

    def process(
        self,
        new_token_ids: list[int],
        finished: bool = False,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
        num_prompt_tokens: int = 0,
        num_cached_tokens: int = 0,
    ) -> OutputDelta:
        """Turn one engine output into an :class:`OutputDelta` (see the module docstring).

        After a stop string (or a finished output) the processor is finished and further calls
        return empty finished deltas.
        """
        out = OutputDelta(
            self.request_id,
            token_ids=list(new_token_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=num_cached_tokens,
        )
        if self.finished:
            out.token_ids, out.logprobs = [], None
            return self._stamp(out)
        if len(new_token_ids) > 1 and self.decoder.has_stops:
            # several tokens in one step (speculative decoding, docs/serving.md §13): pushed one at a
            # time, as plain decoding would, so a stop string ends the output at the token that
            # completed it and the tokens after it are dropped
            emit, kept = "", 0
            for t in new_token_ids:
                emit += self.decoder.push([t])
                kept += 1
                if self.decoder.stopped:
                    break
            out.token_ids = out.token_ids[:kept]
            if out.logprobs is not None:
                out.logprobs = out.logprobs[:kept]
            self._count(out.token_ids)
        else:
            self._count(new_token_ids)
            emit = self.decoder.push(list(new_token_ids))
        if finished and not self.decoder.stopped:
            emit += self.decoder.flush()
        if self.decoder.stopped:
            finished, finish_reason, out.stop_hit = True, "stop", True
        out.text = emit
        self._parse(out, emit, finished)
        if finished:
            self.finished = True
            out.finished = True
            out.finish_reason = self._finish_reason(finish_reason)
            if out.stop_hit:
                out.stop_reason = self.decoder.stop_matched
            elif finish_reason == "stop" and new_token_ids and new_token_ids[-1] in self.stop_token_ids:
                out.stop_reason = new_token_ids[-1]
        return self._stamp(out)

    def _count(self, token_ids: list[int]) -> None:
        self.num_output_tokens += len(token_ids)
        for t in token_ids:
            if not self.in_reasoning:
                break
            self.num_reasoning_tokens += 1
            if t in self.reasoning_end_ids:
                self.in_reasoning = False

    def _parse(self, out: OutputDelta, text: str, finished: bool) -> None:
        if self.parser is None:
            out.content = text
            return
        deltas = [self.parser.feed(text)] if text else []
        if finished:
            deltas.append(self.parser.finish())
            out.tail = deltas[-1].content
        for d in deltas:
            out.reasoning += d.reasoning
            out.content += d.content
            out.tool_calls.extend(d.tool_calls)

    def _finish_reason(self, engine_reason: str | None) -> str:
        if engine_reason == "abort":
            return "abort"
        if self.parser is not None:
            return self.parser.finish_reason(stopped_by_length=engine_reason == "length")
        return "length" if engine_reason == "length" else "stop"

    def _stamp(self, out: OutputDelta) -> OutputDelta:
        out.num_output_tokens = self.num_output_tokens
        out.num_reasoning_tokens = self.num_reasoning_tokens
        return out


@dataclass(slots=True)
class RequestRecord:
    """Everything above the engine about one engine request.

    processor: its output processor (detokeniser, stop strings, parser; the parser's counters
    ``rejected_tool_calls`` / ``parser_error`` are read when it finishes); deliver: where its deltas,
    or the exception that ended it, go (the server: onto the HTTP request's asyncio queue through
    the event loop; None offline, where the caller reads :meth:`RequestTable.step`'s result);
    arrival / last_output: ``time.perf_counter()`` seconds at submission / at its last delta with
    tokens (TTFT and inter-token latency).
    """

    request_id: str
    processor: OutputProcessor
    deliver: Callable[[OutputDelta | BaseException], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    last_output: float | None = None


class RequestTable:
    """The records of the engine requests not yet finished, and the one path into the engine.

    engine: the token-id engine. ``add`` / ``abort`` / ``ids`` / ``has_unfinished`` may be called
    from any thread (under a lock held across the engine call, so a record exists exactly while its
    engine request is live); ``step`` / ``abort_running`` / ``fail_all`` only from the thread that
    steps the engine.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: dict[str, RequestRecord] = {}
        self._lock = threading.Lock()

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        processor: OutputProcessor,
        deliver: Callable[[OutputDelta | BaseException], None] | None = None,
        constraint: TokenConstraint | None = None,
    ) -> RequestRecord:
        """Queue one engine request (n = 1; ``constraint``: its own constrained-decoding matcher or
        None) and register its record. Raises ValueError (prompt too long, bad params,
        ``request_id`` in use) with nothing registered."""
        with self._lock:
            if request_id in self.records:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.engine.add_request(request_id, list(prompt_token_ids), params, constraint=constraint)
            rec = self.records[request_id] = RequestRecord(request_id, processor, deliver)
        return rec

    def abort(self, request_id: str) -> bool:
        """Drop the record and abort the engine request (its pages are freed at the next step; no
        further delta is produced). Returns whether it was still open; unknown ids are ignored."""
        with self._lock:
            rec = self.records.pop(request_id, None)
            if rec is not None:
                self.engine.abort_request(request_id)
        return rec is not None

    def ids(self) -> list[str]:
        """The ids of the open records."""
        with self._lock:
            return list(self.records)

    def has_unfinished(self) -> bool:
        """True while a record is open or the engine still has work (an abort not applied yet)."""
        with self._lock:
            if self.records:
                return True
        return self.engine.has_unfinished_requests()

    def step(self) -> list[tuple[RequestRecord, OutputDelta]]:
        """One engine step; one (record, delta) per open request that produced output. A finished
        delta closes its record; a stop-string match finishes the request here and aborts it in
        the engine."""
        out = []
        for o in self.engine.step():
            with self._lock:
                rec = self.records.get(o.request_id)
            if rec is None:
                continue  # aborted above the engine (client gone or stop string)
            d = rec.processor.process(
                o.new_token_ids,
                o.finished,
                o.finish_reason,
                o.new_logprobs,
                o.prompt_logprobs,
                o.num_prompt_tokens,
                o.num_cached_tokens,
            )
            if d.finished:
                with self._lock:
                    self.records.pop(o.request_id, None)
                if d.stop_hit and not o.finished:
                    self.engine.abort_request(o.request_id)
            out.append((rec, d))
        return out

    def abort_running(self, error: BaseException | None = None) -> list[str]:
        """After a failed step: end the engine's running requests (``LLMEngine.abort_running``) and
        close their records, and those of requests the engine already finished in the failed step
        (their outputs were lost with it); ``error`` goes to each closed record's ``deliver``.
        Returns all their ids (no final delta is produced for them)."""
        ids = self.engine.abort_running()
        with self._lock:
            ids += [rid for rid in self.records if rid not in ids and not self.engine.has_request(rid)]
            ended = [self.records.pop(rid) for rid in ids if rid in self.records]
        _deliver_all(ended, error)
        return ids

    def fail_all(self, error: BaseException) -> None:
        """Close every record, sending ``error`` to each (the engine is dead)."""
        with self._lock:
            ended, self.records = list(self.records.values()), {}
        _deliver_all(ended, error)


def _deliver_all(records: list[RequestRecord], error: BaseException | None) -> None:
    for rec in records:
        if error is not None and rec.deliver is not None:
            rec.deliver(error)
