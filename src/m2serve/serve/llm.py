"""The offline ``LLM`` API: text in, text out, on top of the token-id engine.

``LLM`` is where the engine (token ids) and the text layer (tokenizer, chat template, parser) meet
(docs/architecture.md: only in serve/). It is a thin facade over the pieces the HTTP server uses too:
serve/chat_pipeline.py (the one home of rendering, the prompt-length rule, chat sampling params,
parsers, constraints, the n fan-out and the assembly of finished choices: ``LLM.chat`` builds the
same :class:`~m2serve.serve.chat_pipeline.ChatJob` as the server's chat APIs and runs it through
``prepare_blocking`` / ``engine_requests`` / ``ChoiceCollector``) and the
:class:`~m2serve.serve.output.RequestTable` (one record per engine request, the one path into the
engine; the server's AsyncEngine steps the same table from its engine thread). The offline loops
below only add those requests, step the engine and collect.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2serve.config.engine_args import EngineArgs, apply_num_threads
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine.constraint import TokenConstraint
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams, TokenLogprobs
from m2serve.model.load import local_model, weights_banner
from m2serve.serve import chat_pipeline as cp
from m2serve.serve.chat_pipeline import CompletionOutput, ToolCallResult
from m2serve.serve.errors import APIError
from m2serve.serve.output import OutputDelta, OutputProcessor, RequestTable
from m2serve.serve.resolve import resolve_engine_args, resolve_model
from m2serve.text.constraint import GrammarCompiler
from m2serve.text.detokenizer import IncrementalDetokenizer
from m2serve.text.template import ChatTemplate
from m2serve.text.tokenizer import Tokenizer
from m2serve.text.tool_format import check_tool_format

__all__ = ["LLM", "CompletionOutput", "RequestResult", "ToolCallResult", "throughput_summary"]

log = logging.getLogger(__name__)

TOOL_PARSERS = ("minimax_m2", "none")
REASONING_PARSERS = ("minimax_m2", "minimax_m2_append_think", "none")


@dataclass(slots=True)
class RequestResult:
    """A finished request: its prompt, the n choices and token counts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Run:
    """One offline request while it runs: its result, its engine requests (the pipeline's fan-out),
    the one-call rule, their choice collector and how many are still running."""

    result: RequestResult
    requests: list[cp.EngineRequest]
    one_call: bool = False
    collector: cp.ChoiceCollector = field(init=False)
    pending: int = field(init=False)

    def __post_init__(self) -> None:
        self.collector = cp.ChoiceCollector({r.request_id: r.slot for r in self.requests})
        self.pending = len(self.requests)


class LLM:
    """Offline text-level inference, and the model's text pieces the chat pipeline reads (tokenizer,
    chat template, parser settings, grammar compiler, output processors; chat_pipeline.TextContext).

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
        engine_args = resolve_engine_args(engine_args)   # the draft first: a typo fails before the target
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
        runner = getattr(self.engine, "runner", None)
        log.info("%s", weights_banner(self.args, local_model(getattr(runner, "model", None))))
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
        continue_final_message: bool = False,
    ) -> str:
        """Render a conversation with the checkpoint's template (docs/parsers.md §2), as the chat
        pipeline does (chat_pipeline.render_template; ``continue_final_message``: the prompt ends right
        after the last, assistant, message's content).

        Raises the text layer's TemplateError (the server answers 400) for invalid messages and
        for chat_template_kwargs that would replace render's own arguments.
        """
        return cp.render_template(self, messages, tools, chat_template_kwargs, add_generation_prompt,
                                  continue_final_message)

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
            stop_token_ids=params.stop_token_ids,
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
        *,
        structured_outputs: dict[str, Any] | None = None,
    ) -> list[RequestResult]:
        """Complete prompts (strings or token-id lists); returns results in prompt order.

        ``sampling_params`` None = the checkpoint's generation_config defaults; one per prompt or
        one for all. Raw text out, no parser (like /v1/completions). ``structured_outputs``: vLLM's
        ``{"json" | "regex" | "choice" | "grammar": ..., "json_object": true}`` constrains every
        completion from its first token, as /v1/completions does (docs/constrained-decoding.md).
        Raises ValueError with the server's 400 message for a format that does not compile or fails
        while decoding.
        """
        items = _prompt_list(prompts)
        plist = _params_list(sampling_params, len(items))
        ctx = cp.TextContext.of(self)
        try:
            spec = cp.spec_or_400(cp.ChatJob([], output=cp.structured_outputs(structured_outputs)))
            new_constraint = cp.constraint_factory(ctx, spec, "off", None)
        except APIError as e:
            raise _value_error(e) from e
        runs = []
        for prompt, params in zip(items, plist):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"req-{next(self._ids)}"
            text = prompt if isinstance(prompt, str) else None
            requests = list(cp.engine_requests(ctx, rid, [ids], params, new_constraint=new_constraint))
            runs.append(_Run(RequestResult(rid, text, ids, []), requests))
        return self._run(runs, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        reasoning_split: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        *,
        tool_choice: str | dict[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        response_format: dict[str, Any] | None = None,
        structured_outputs: dict[str, Any] | None = None,
        reasoning_budget: int | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> RequestResult | list[RequestResult]:
        """Chat completion for one conversation (returns one result) or a list of them (a list).

        Each conversation becomes the same chat job as a ``/v1/chat/completions`` request
        (chat_pipeline.ChatJob) and goes through the same preparation (template, tokenise, length
        rule, sampling params, parser, constraint) and choice assembly, so a greedy request gives the
        same tokens here and on the server. The parser splits reasoning, content and tool calls
        (docs/parsers.md §3); ``sampling_params.n`` choices per conversation (outputs by index).

        messages: OpenAI-style dicts (``role``, ``content``, ``reasoning_content``, ``tool_calls``,
        ``tool_call_id``), or a list of such conversations; tools: OpenAI function tools
        (``{"type": "function", "function": {"name", "description", "parameters"}}``); reasoning_split:
        True split reasoning, False passthrough (``<think>`` + text in content), None the LLM's
        reasoning_parser; tool_choice: ``auto``, ``none`` (tools rendered, a call can never be
        generated), ``required`` (1 to N calls of the declared tools, N = the number of tools) or
        ``{"type": "function", "function": {"name": ...}}`` (exactly one call of that tool; the cap:
        docs/constrained-decoding.md, "Tool-call cap"); parallel_tool_calls False: at most one call
        per choice; response_format: OpenAI's
        ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``;
        structured_outputs: vLLM's ``{"json" | "regex" | "choice" | "grammar": ..., "json_object": true}``
        (one of the two);
        reasoning_budget: the most reasoning tokens before ``</think>`` is forced
        (docs/constrained-decoding.md); add_generation_prompt / continue_final_message: vLLM's
        (``continue_final_message``: the reply continues the last message, an assistant's, whose text
        the outputs do not repeat; ``add_generation_prompt`` is then ignored).

        Raises ValueError naming the field and the fix for what the server answers with a 400: a
        template error, a prompt longer than the context (engine/request.py prompt_length_error),
        ``max_tokens`` beyond the room left, a format that does not compile or fails while decoding
        (raised when that choice ends; the batch's other requests are aborted), a bad tool_choice.
        """
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        choice, tool_name = _tool_choice(tool_choice)
        ctx = cp.TextContext.of(self)
        runs = []
        for conv in convs:
            job = cp.ChatJob(
                messages=list(conv),  # type: ignore[arg-type]
                tools=list(tools) if tools else None,
                tool_choice=choice,
                tool_name=tool_name,
                params=sampling_params or SamplingParams(),
                reasoning_split=reasoning_split,
                one_call=not parallel_tool_calls,
                chat_template_kwargs=chat_template_kwargs,
                reasoning_budget=reasoning_budget,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            try:
                job.output = cp.chat_output(response_format, structured_outputs)
                prepared = cp.prepare_blocking(ctx, job)
            except APIError as e:
                raise _value_error(e) from e
            rid = f"req-{next(self._ids)}"
            requests = list(cp.engine_requests(ctx, rid, [prepared.ids], prepared.params, prepared.new_parser,
                                               job.skip_special_tokens, prepared.new_constraint))
            runs.append(_Run(RequestResult(rid, prepared.prompt, prepared.ids, []), requests,
                             one_call=job.one_call))
        results = self._run(runs, use_tqdm)
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

    def _run(self, runs: list[_Run], use_tqdm: bool) -> list[RequestResult]:
        """Add every run's engine requests, step until all finish, return the results in order."""
        owner: dict[str, _Run] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(runs), desc="requests", unit="req")
        try:
            for run in runs:
                for r in run.requests:
                    self.add_request(r.request_id, r.prompt_token_ids, r.params, r.processor, r.constraint)
                    owner[r.request_id] = run
            constraints = {r.request_id: r.constraint for run in runs for r in run.requests}
            while self.has_unfinished_requests():
                for d in self.step():
                    run = owner[d.request_id]
                    failure = cp.grammar_failure(constraints[d.request_id]) if d.finished else None
                    if failure is not None:
                        raise ValueError(failure)
                    run.collector.add(cp.choice_delta(run.collector.slots, run.one_call, d))
                    if d.finished:
                        run.pending -= 1
                        if run.pending == 0 and bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in owner:
                self.abort_request(rid)
        for run in runs:
            choices = run.collector.choices()
            run.result.outputs = [c.output for c in choices]
            run.result.prompt_logprobs = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
            run.result.num_cached_tokens = run.collector.num_cached_tokens
        return [run.result for run in runs]


def _tool_choice(value: str | dict[str, Any]) -> tuple[Any, str | None]:
    """``LLM.chat``'s tool_choice as the chat job's (tool_choice, tool_name)."""
    if value in ("auto", "none", "required"):
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return "auto", fn["name"]
    raise ValueError(f"tool_choice={value!r}: use auto, none, required or "
                     '{"type": "function", "function": {"name": TOOL}}')


def _value_error(e: APIError) -> ValueError:
    """A 400 of the chat pipeline as the offline API's ValueError (naming the field)."""
    if e.param and not e.message.startswith(e.param):
        return ValueError(f"{e.param}: {e.message}")
    return ValueError(e.message)


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
