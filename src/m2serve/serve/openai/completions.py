"""POST /v1/completions: raw prompts (text or token ids) through the chat pipeline's submit/stream/collect
without a template or parser (docs/serving.md §10)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from m2serve.engine.sampling import TokenLogprobs
from m2serve.serve import chat_pipeline as cp
from m2serve.serve import protocol as P
from m2serve.serve.context import ServeContext
from m2serve.serve.errors import APIError
from m2serve.serve.openai.chat import _sampling_fields
from m2serve.serve.openai.common import sse, sse_error, usage

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: P.CompletionRequest, request: Request) -> Response:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of is not supported (use n)", param="best_of")
    raw = _completion_prompts(req.prompt)
    if len(raw) * req.n > P.MAX_SEQUENCES:
        raise APIError(400, f"n: {len(raw)} prompts x n={req.n} = {len(raw) * req.n} sequences in one "
                            f"request; the limit is {P.MAX_SEQUENCES} (lower n or send fewer prompts)",
                       param="n")
    texts = [p for p in raw if isinstance(p, str)]
    encoded = iter(
        await run_in_threadpool(lambda: [cp.encode(ctx, p, "prompt", check_length=True) for p in texts])
    )
    prompts: list[tuple[str, list[int]]] = []
    for p in raw:
        if isinstance(p, str):
            prompts.append((p, next(encoded)))
        else:
            cp.check_token_ids(ctx, p, "prompt", "prompt token id")
            prompts.append((ctx.llm.decode(p, skip_special_tokens=False), list(p)))
    params = cp.sampling_params(
        ctx, **_sampling_fields(req), logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if (req.echo and req.logprobs is not None) else None,
    )
    for _, ids in prompts:
        cp.check_length(ctx, ids, "prompt", params.max_tokens)
    spec = cp.spec_or_400(cp.ChatJob([], output=cp.structured_outputs(req.structured_outputs)))
    new_constraint = await run_in_threadpool(cp.constraint_factory, ctx, spec, "off", None)
    base = P.new_id("cmpl")
    sub = cp.submit(ctx, request, base, [ids for _, ids in prompts], params, None, req.skip_special_tokens,
                    new_constraint=new_constraint)
    model = ctx.settings.served_model_name
    if not req.stream:
        choices = await cp.collect(ctx, request, sub)
        resp = _response(ctx, base, model, choices, prompts, req, sub.usage())
        return JSONResponse(resp.model_dump(mode="json"))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_stream(ctx, base, model, sub, prompts, req, include_usage),
                             media_type="text/event-stream")


def _gen_logprobs(ctx: ServeContext, lps: list[TokenLogprobs | None], offset: int) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for lp in lps:
        if lp is None:  # the first prompt token has no logprob
            continue
        text = ctx.llm.token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({ctx.llm.token_text(t): v for t, v in lp.top} or None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _echo_logprobs(ctx: ServeContext, ids: list[int], prompt_lps: list[TokenLogprobs | None] | None
                   ) -> P.CompletionLogprobs:
    out, offset = P.CompletionLogprobs(), 0
    for pos, tid in enumerate(ids):
        text = ctx.llm.token_text(tid)
        lp = prompt_lps[pos] if prompt_lps and pos < len(prompt_lps) else None
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else {ctx.llm.token_text(t): v for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _extend(a: P.CompletionLogprobs, b: P.CompletionLogprobs) -> P.CompletionLogprobs:
    a.tokens += b.tokens
    a.token_logprobs += b.token_logprobs
    a.top_logprobs += b.top_logprobs
    a.text_offset += b.text_offset
    return a


def _response(ctx: ServeContext, base: str, model: str, choices: list[cp.Choice],
              prompts: list[tuple[str, list[int]]], req: P.CompletionRequest, u: cp.TokenUsage
              ) -> P.CompletionResponse:
    out = []
    for c in choices:
        o = c.output
        prompt_text, ids = prompts[c.prompt_index]
        lp = None
        if req.logprobs is not None:
            lp = _echo_logprobs(ctx, ids, c.prompt_logprobs) if req.echo else P.CompletionLogprobs()
            _extend(lp, _gen_logprobs(ctx, o.logprobs or [], len(prompt_text) if req.echo else 0))
        text = (prompt_text if req.echo else "") + o.text
        out.append(P.CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason))
    return P.CompletionResponse(id=base, model=model, choices=out, usage=usage(u, with_reasoning=False))


async def _stream(ctx: ServeContext, base: str, model: str, sub: cp.Submission,
                  prompts: list[tuple[str, list[int]]], req: P.CompletionRequest, include_usage: bool
                  ) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    try:
        async for cd in cp.stream(ctx, sub):
            d = cd.delta
            prompt_text, ids = prompts[cd.prompt_index]
            text, lp = d.text, None
            if req.echo and cd.index not in echoed:
                echoed.add(cd.index)
                text = prompt_text + text
                if req.logprobs is not None:
                    lp = _echo_logprobs(ctx, ids, d.prompt_logprobs)
                offsets[cd.index] = len(prompt_text)
            if req.logprobs is not None:
                gen = _gen_logprobs(ctx, d.logprobs or [], offsets.get(cd.index, 0))
                offsets[cd.index] = offsets.get(cd.index, 0) + sum(len(t) for t in gen.tokens)
                lp = gen if lp is None else _extend(lp, gen)
            if text or lp is not None or d.finished:
                choice = P.CompletionChoice(index=cd.index, text=text, logprobs=lp,
                                            finish_reason=d.finish_reason if d.finished else None,
                                            stop_reason=d.stop_reason if d.finished else None)
                c = P.CompletionResponse(id=base, model=model, choices=[choice])
                yield sse(c.model_dump(mode="json", exclude_none=True))
    except APIError as e:
        yield sse_error(e)
    if include_usage:
        u = usage(sub.usage(), with_reasoning=False)
        c = P.CompletionResponse(id=base, model=model, choices=[], usage=u)
        yield sse(c.model_dump(mode="json", exclude_none=True))
    yield "data: [DONE]\n\n"


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt: {len(prompt)} prompts in one request; the limit is {P.MAX_PROMPTS}",
                       param="prompt")
    return list(prompt)
