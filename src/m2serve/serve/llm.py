"""The offline ``LLM`` API: text in, text out, on top of the token-id engine.

``LLM`` is where the engine (token ids) and the text layer (tokenizer, chat template, parser) meet
(docs/architecture.md: only in serve/). It is a thin facade over the pieces the HTTP server uses too:
the text helpers (render, tokenise, chat sampling params, parser and output processor per request,
called by serve/chat_pipeline.py), the :class:`~m2serve.serve.output.RequestTable` (one record per
engine request, the one path into the engine; the server's AsyncEngine steps the same table from its
engine thread), and :class:`ChoiceAccumulator` / :func:`fan_out` (the n fan-out and the collection of
a choice, shared with the pipeline). The offline loops below only add requests, step and collect.

``add_request`` / ``abort_request`` may be called from any thread; one thread calls ``step``.

Example::

    llm = LLM()                                   # the embedded default checkpoint
    [r] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(r.outputs[0].text)
    msg = llm.chat([{"role": "user", "content": "Hi"}]).outputs[0]
    print(msg.reasoning, msg.content, msg.tool_calls)
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from m2serve.config.engine_args import EngineArgs, apply_num_threads
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams, TokenLogprobs
from m2serve.model.load import weights_banner
from m2serve.serve.output import OutputDelta, OutputProcessor, RequestTable
from m2serve.serve.resolve import resolve_model
from m2serve.text.constraint import GrammarCompiler
from m2serve.text.detokenizer import IncrementalDetokenizer
from m2serve.text.parser import StreamingParser, starts_in_reasoning
from m2serve.text.template import RESERVED_TEMPLATE_VARIABLES, ChatTemplate, TemplateError
from m2serve.text.tokenizer import Tokenizer
from m2serve.text.tool_format import check_tool_format

log = logging.getLogger(__name__)

TOOL_PARSERS = ("minimax_m2", "none")
REASONING_PARSERS = ("minimax_m2", "minimax_m2_append_think", "none")


@dataclass(slots=True)
class ToolCallResult:
    """One returned tool call: id ``call_<24 hex>``, function name, arguments as a JSON string."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a finished request.

    text: raw generated text (stop string excluded); reasoning / content / tool_calls: the
    parser's result (chat; without a parser content == text); token_ids: generated ids;
    logprobs: one TokenLogprobs per generated token when requested.
    """

    index: int
    text: str = ""
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallResult] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_reasoning_tokens: int = 0


@dataclass(slots=True)
class RequestResult:
    """A finished request: its prompt, the n choices and token counts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


def fan_out(base_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The n fan-out of one prompt, for the server and the offline API alike: engine request
    ``{base_id}-{c}`` with ``params.child(c)`` (n = 1, seed + c) for each choice c < n."""
    return [(f"{base_id}-{c}", params.child(c)) for c in range(params.n)]


class ChoiceAccumulator:
    """Collects the :class:`OutputDelta` stream of one choice into a :class:`CompletionOutput`."""

    def __init__(self, index: int) -> None:
        self.out = CompletionOutput(index=index)
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, list[Any]] = {}
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def add(self, d: OutputDelta) -> None:
        """Append one delta (in stream order)."""
        self._text.append(d.text)
        self._reasoning.append(d.reasoning)
        self._content.append(d.content)
        for tc in d.tool_calls:
            slot = self._calls.setdefault(tc.index, [None, None, []])
            if tc.id is not None:
                slot[0] = tc.id
            if tc.name is not None:
                slot[1] = tc.name
            slot[2].append(tc.arguments)
        self.out.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.out.logprobs is None:
                self.out.logprobs = []
            self.out.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = list(d.prompt_logprobs)
        self.num_prompt_tokens = d.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = d.num_cached_tokens or self.num_cached_tokens
        self.out.num_reasoning_tokens = d.num_reasoning_tokens
        if d.finished:
            self.out.finish_reason = d.finish_reason

    def result(self) -> CompletionOutput:
        """The accumulated choice; empty reasoning/content are None (docs/parsers.md P7)."""
        o = self.out
        o.text = "".join(self._text)
        o.reasoning = "".join(self._reasoning) or None
        o.content = "".join(self._content) or None
        o.tool_calls = [
            ToolCallResult(id=s[0], name=s[1], arguments="".join(s[2]))
            for _, s in sorted(self._calls.items())
        ]
        return o


class LLM:
    """Offline text-level inference (and the server's per-request text pipeline).

    model: local checkpoint directory, hub id, or None for the embedded default (resolve.py);
    chat_template: a template file overriding the checkpoint's; tool_parser: ``minimax_m2`` or
    ``none`` (tool calls stay text); reasoning_parser: ``minimax_m2`` (split reasoning_content),
    ``minimax_m2_append_think`` (passthrough: ``<think>`` + raw text in content) or ``none`` (raw
    text in content, no reasoning parsing); thinking_temperature: default for chat requests that
    do not set it; engine: an already built engine (e.g. rank 0 of a torchrun deployment),
    None = ``LLMEngine.from_args``; engine_args: any :class:`EngineArgs` field
    (``max_batch_size=8`` ...).

    Raises ModelNotFoundError, ValueError (bad arguments, bad config) and what the engine and
    the text layer raise while loading.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        chat_template: str | None = None,
        tool_parser: str = "minimax_m2",
        reasoning_parser: str = "minimax_m2",
        thinking_temperature: float | None = None,
        engine: LLMEngine | None = None,
        **engine_args: Any,
    ) -> None:
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser={tool_parser!r}: choose one of {', '.join(TOOL_PARSERS)}")
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={reasoning_parser!r}: choose one of {', '.join(REASONING_PARSERS)}"
            )
        unknown = sorted(set(engine_args) - set(EngineArgs.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"LLM: unknown engine argument(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(EngineArgs.__dataclass_fields__))}"
            )
        path = resolve_model(model)
        self.model_path = Path(path)
        self.args = EngineArgs(model=str(path), **engine_args)
        self.threads = apply_num_threads(self.args)  # docs/serving.md §12, before any weight loads
        self.served_model_name = self.args.served_model_name or (model or self.model_path.name)
        self.config = MiniMaxM2Config.from_pretrained(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        tok = self.tokenizer
        self.template = (
            ChatTemplate.from_file(chat_template, tok.bos_token, tok.eos_token, tok.unk_token)
            if chat_template
            else ChatTemplate.from_pretrained(path)
        )
        self.tool_parser = tool_parser
        check_tool_format(self.template, tool_parser, strict=self.args.strict_tool_format)
        self.reasoning_parser = reasoning_parser
        self.thinking_temperature = thinking_temperature
        self.requests = RequestTable(engine if engine is not None else LLMEngine.from_args(self.args))
        log.info("%s", weights_banner(self.args))
        self.max_length = self.engine.max_length
        self.reasoning_end_ids = (tok.think_end_id, tok.tool_call_id)
        self._ids = itertools.count()
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar(self) -> GrammarCompiler:
        """The checkpoint's grammar compiler for constrained decoding (docs/constrained-decoding.md),
        built on first use (it reads tokenizer.json and scans the vocabulary once)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.from_pretrained(self.model_path, self.config.vocab_size)
            return self._grammar

    # ------------------------------------------------------------------ text helpers

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no added special tokens; special-token strings map to their ids)."""
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as it appears in output (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render a conversation with the checkpoint's template (docs/parsers.md §2).

        Raises the text layer's TemplateError (the server answers 400) for invalid messages and
        for chat_template_kwargs that would replace render's own arguments.
        """
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & set(RESERVED_TEMPLATE_VARIABLES))
        if clash:
            raise TemplateError(
                f"chat_template_kwargs may not set {', '.join(clash)} (reserved template variables)"
            )
        return self.template.render(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def reasoning_mode(self, reasoning_split: bool | None) -> str | None:
        """Parser mode for a chat request: ``split`` / ``passthrough``, or None for no reasoning parsing."""
        if reasoning_split is not None:
            return "split" if reasoning_split else "passthrough"
        return {"minimax_m2": "split", "minimax_m2_append_think": "passthrough"}.get(self.reasoning_parser)

    def chat_params(self, params: SamplingParams, prompt: str) -> SamplingParams:
        """Add the reasoning-state fields the sampler needs for thinking_temperature (docs/serving.md §10)."""
        thinking = params.thinking_temperature
        if thinking is None:
            thinking = self.thinking_temperature
        return replace(
            params,
            thinking_temperature=thinking,
            start_in_reasoning=starts_in_reasoning(prompt),
            reasoning_end_token_ids=self.reasoning_end_ids,
        )

    def new_parser(
        self, prompt: str, tools: Sequence[dict[str, Any]] | None, mode: str | None, request_id: str = ""
    ) -> StreamingParser | None:
        """A streaming parser for one chat choice, or None when nothing is to be parsed.

        mode None (``--reasoning-parser none``): reasoning is not parsed; if tools are on, the
        parser runs in passthrough mode from the CONTENT state, so only tool blocks are extracted.
        """
        use_tools = bool(tools) and self.tool_parser != "none"
        if mode is None and not use_tools:
            return None
        return StreamingParser(
            tools=list(tools) if use_tools else None,
            mode=mode or "passthrough",
            prompt_tail=prompt[-64:] if mode is not None else "",
            request_id=request_id,
        )

    def new_processor(
        self, request_id: str, params: SamplingParams, parser: Any = None, skip_special_tokens: bool = True
    ) -> OutputProcessor:
        """The output processor of one engine request (detokeniser + stop strings + parser)."""
        decoder = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=skip_special_tokens, stop=params.stop
        )
        return OutputProcessor(
            request_id,
            decoder,
            parser=parser,
            reasoning_end_ids=self.reasoning_end_ids,
            start_in_reasoning=params.start_in_reasoning,
        )

    # ------------------------------------------------------------------ engine requests

    @property
    def engine(self) -> LLMEngine:
        """The token-id engine (the request table's; assignable, e.g. to wrap it)."""
        return self.requests.engine

    @engine.setter
    def engine(self, engine: LLMEngine) -> None:
        self.requests.engine = engine

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        processor: OutputProcessor,
        constraint: TokenConstraint | None = None,
    ) -> None:
        """Queue one engine request (n = 1; ``constraint``: its own matcher or None). Raises ValueError
        (prompt too long, bad params)."""
        self.requests.add(request_id, prompt_token_ids, params, processor, constraint=constraint)

    def abort_request(self, request_id: str) -> None:
        """Abort a request: its pages are freed by the engine; no further deltas are produced."""
        self.requests.abort(request_id)

    def abort_running(self) -> list[str]:
        """End the running requests after a failed step and close their records
        (RequestTable.abort_running); returns their ids."""
        return self.requests.abort_running()

    def has_unfinished_requests(self) -> bool:
        """True while a request added here has not finished, or the engine still has work
        (an abort it has not applied yet)."""
        return self.requests.has_unfinished()

    def step(self) -> list[OutputDelta]:
        """One engine step; returns one delta per request that produced output (RequestTable.step)."""
        return [d for _, d in self.requests.step()]

    # ------------------------------------------------------------------ offline API

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestResult]:
        """Complete prompts (strings or token-id lists); returns results in prompt order.

        ``sampling_params`` None = the checkpoint's generation_config defaults; one per prompt or
        one for all. Raw text out, no parser (like /v1/completions).
        """
        items = _prompt_list(prompts)
        plist = _params_list(sampling_params, len(items))
        requests = []
        for prompt, params in zip(items, plist):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            requests.append((prompt if isinstance(prompt, str) else None, ids, params, None, None))
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        reasoning_split: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> RequestResult | list[RequestResult]:
        """Chat completion for one conversation (returns one result) or a list of them (a list).

        The template renders ``messages`` and ``tools``; the parser splits reasoning, content and
        tool calls (docs/parsers.md §3).
        """
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        base = sampling_params or SamplingParams()
        mode = self.reasoning_mode(reasoning_split)
        requests = []
        for conv in convs:
            prompt = self.render_chat(conv, tools, chat_template_kwargs)  # type: ignore[arg-type]
            params = self.chat_params(base, prompt)
            requests.append((prompt, self.encode(prompt), params, tools, mode))
        results = self._run(requests, use_tqdm, chat=True)
        return results[0] if single else results

    def stream(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
    ) -> Iterator[OutputDelta]:
        """Yield the deltas of all prompts (n = 1 each, raw text) as the engine produces them.

        ``delta.request_id`` is ``stream-<k>-<i>`` for the i-th prompt. Leaving the loop early
        aborts what is still running.
        """
        params = sampling_params or SamplingParams()
        base = f"stream-{next(self._ids)}"
        open_ids = set()
        try:
            for i, prompt in enumerate(_prompt_list(prompts)):
                ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"{base}-{i}"
                self.add_request(rid, ids, params, self.new_processor(rid, params))
                open_ids.add(rid)
            while open_ids:
                for d in self.step():
                    if d.request_id in open_ids:
                        if d.finished:
                            open_ids.discard(d.request_id)
                        yield d
        finally:
            for rid in open_ids:
                self.abort_request(rid)

    def _run(self, requests: list[tuple], use_tqdm: bool, chat: bool = False) -> list[RequestResult]:
        """Add every request (n fanned out), step until all finish, return results in order."""
        accs: dict[str, ChoiceAccumulator] = {}
        results: list[RequestResult] = []
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        pending: dict[int, int] = {}
        owner: dict[str, int] = {}
        try:
            for i, (prompt, ids, params, tools, mode) in enumerate(requests):
                rid = f"req-{next(self._ids)}"
                results.append(RequestResult(rid, prompt, list(ids), []))
                pending[i] = params.n
                for c, (sub, child) in enumerate(fan_out(rid, params)):
                    parser = self.new_parser(prompt, tools, mode, sub) if chat else None
                    self.add_request(sub, ids, child, self.new_processor(sub, child, parser))
                    accs[sub] = ChoiceAccumulator(c)
                    owner[sub] = i
            while self.has_unfinished_requests():
                for d in self.step():
                    accs[d.request_id].add(d)
                    if d.finished:
                        i = owner[d.request_id]
                        pending[i] -= 1
                        if pending[i] == 0 and bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for sub in accs:
                self.abort_request(sub)
        for sub, acc in accs.items():
            r = results[owner[sub]]
            r.outputs.append(acc.result())
            if acc.prompt_logprobs is not None:
                r.prompt_logprobs = acc.prompt_logprobs
            r.num_cached_tokens = max(r.num_cached_tokens, acc.num_cached_tokens)
        for r in results:
            r.outputs.sort(key=lambda o: o.index)
        return results


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items


def _params_list(p: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if p is None:
        return [SamplingParams()] * n
    if isinstance(p, SamplingParams):
        return [p] * n
    plist = list(p)
    if len(plist) != n:
        raise ValueError(f"sampling_params: got {len(plist)} for {n} prompts (give one, or one per prompt)")
    return plist


def throughput_summary(results: list[RequestResult], seconds: float) -> str:
    """One line: requests, prompt/output tokens and tokens/s over ``seconds`` of wall time."""
    n_in = sum(len(r.prompt_token_ids) for r in results)
    n_out = sum(len(o.token_ids) for r in results for o in r.outputs)
    return (
        f"{len(results)} requests in {seconds:.2f} s: {n_in} prompt + {n_out} output tokens, "
        f"{n_out / max(seconds, 1e-9):.1f} output tok/s, "
        f"{(n_in + n_out) / max(seconds, 1e-9):.1f} total tok/s"
    )
