"""POST /v1/chat/completions: request -> :class:`ChatJob`, pipeline deltas -> chat chunks
(docs/serving.md §10, docs/parsers.md §3)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from m2serve.serve import chat_pipeline as cp
from m2serve.serve import protocol as P
from m2serve.serve.context import ServeContext
from m2serve.serve.errors import APIError
from m2serve.serve.openai.common import chat_logprobs, sse, sse_error, tool_delta, usage

router = APIRouter()


def chat_job(ctx: ServeContext, req: P.ChatCompletionRequest) -> cp.ChatJob:
    """The chat job of a chat-completions request; ``tool_choice``, ``parallel_tool_calls``,
    ``response_format`` and vLLM's ``structured_outputs`` become its constraint fields."""
    rf = req.response_format
    output = cp.chat_output(rf.model_dump() if rf is not None else None, req.structured_outputs)
    named = req.tool_choice.function.name if isinstance(req.tool_choice, P.NamedToolChoice) else None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = cp.sampling_params(ctx, **_sampling_fields(req), logprobs=logprobs,
                                thinking_temperature=req.thinking_temperature)
    return cp.ChatJob(
        messages=[m.model_dump(exclude_unset=True) for m in req.messages],
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        tool_choice=req.tool_choice if req.tool_choice in ("none", "required") else "auto",
        tool_name=named,
        output=output,
        params=params,
        reasoning_split=req.reasoning_split,
        reasoning_budget=cp.effort_budget(req.reasoning_effort, "reasoning_effort"),
        one_call=req.parallel_tool_calls is False,
        chat_template_kwargs=req.chat_template_kwargs,
        skip_special_tokens=req.skip_special_tokens,
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )


def _sampling_fields(req: P._SamplingFields) -> dict:
    """The SamplingParams fields shared by chat and completions requests."""
    return dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.logit_bias,
        seed=req.seed,
        stop=tuple(req.stop_list()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        max_tokens=req.token_limit(),
        n=req.n,
    )


@router.post("/v1/chat/completions")
async def chat(req: P.ChatCompletionRequest, request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    job = chat_job(ctx, req)
    prepared = await cp.prepare(ctx, job)
    base = P.new_id("chatcmpl")
    sub = cp.submit(ctx, request, base, [prepared.ids], prepared.params, prepared.new_parser,
                    job.skip_special_tokens, job.one_call, prepared.new_constraint)
    model = ctx.settings.served_model_name
    if not req.stream:
        choices = await cp.collect(ctx, request, sub)
        resp = chat_response(ctx, base, model, choices, sub.usage(), req.logprobs)
        return JSONResponse(resp.model_dump(mode="json"))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    gen = chat_stream(ctx, base, model, sub, include_usage, req.logprobs)
    return StreamingResponse(gen, media_type="text/event-stream")


def chat_response(ctx: ServeContext, base: str, model: str, choices: list[cp.Choice], u: cp.TokenUsage,
                  want_logprobs: bool) -> P.ChatCompletionResponse:
    """The chat completion of the finished choices: content, reasoning_content and the complete tool
    calls (docs/serving.md §10.1: a call cut by the limit is content, P18)."""
    out = []
    for c in choices:
        o = c.output
        msg = P.AssistantMessage(
            content=o.content,
            reasoning_content=o.reasoning,
            tool_calls=[P.ToolCall(id=t.id, function=P.FunctionCall(name=t.name, arguments=t.arguments))
                        for t in o.tool_calls] or None,
        )
        lp = P.ChoiceLogprobs(content=chat_logprobs(ctx, o.logprobs)) if want_logprobs else None
        out.append(P.ChatChoice(index=c.index, message=msg, logprobs=lp, finish_reason=o.finish_reason,
                                stop_reason=o.stop_reason))
    return P.ChatCompletionResponse(id=base, model=model, choices=out, usage=usage(u))


async def chat_stream(ctx: ServeContext, base: str, model: str, sub: cp.Submission, include_usage: bool,
                      want_logprobs: bool) -> AsyncIterator[str]:
    def chunk(i: int, delta: P.DeltaMessage, finish: str | None = None, lps=None,
              stop_reason: int | str | None = None) -> str:
        lp = P.ChoiceLogprobs(content=chat_logprobs(ctx, lps)) if want_logprobs and lps else None
        choice = P.ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=finish,
                                    stop_reason=stop_reason)
        c = P.ChatCompletionChunk(id=base, model=model, choices=[choice])
        return sse(c.model_dump(mode="json", exclude_none=True))

    for i in range(len(sub.request_ids)):
        yield chunk(i, P.DeltaMessage(role="assistant", content=""))
    try:
        async for d in cp.stream(ctx, sub):
            for piece in d.pieces():
                if piece.kind == "reasoning":
                    delta = P.DeltaMessage(reasoning_content=piece.text)
                elif piece.kind == "content":
                    delta = P.DeltaMessage(content=piece.text)
                elif piece.kind == "tool_calls":
                    delta = P.DeltaMessage(tool_calls=[tool_delta(tc) for tc in piece.tool_calls])
                else:
                    delta = P.DeltaMessage(content="")
                yield chunk(d.index, delta, lps=piece.logprobs)
            if d.choice is not None:  # the finished choice (docs/serving.md §10.1)
                yield chunk(d.index, P.DeltaMessage(), finish=d.choice.output.finish_reason,
                            stop_reason=d.choice.output.stop_reason)
    except APIError as e:
        yield sse_error(e)
    if include_usage:
        c = P.ChatCompletionChunk(id=base, model=model, choices=[], usage=usage(sub.usage()))
        yield sse(c.model_dump(mode="json", exclude_none=True))
    yield "data: [DONE]\n\n"
