"""GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize (docs/serving.md §10). /tokenize
refuses a text longer than the context can hold before tokenising it, as the generation routes do."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from m2serve.serve import chat_pipeline as cp
from m2serve.serve import protocol as P
from m2serve.serve.context import ServeContext

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> P.ModelList:
    ctx: ServeContext = request.app.state.ctx
    card = P.ModelCard(id=ctx.settings.served_model_name, max_model_len=ctx.caps.max_length)
    return P.ModelList(data=[card])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> P.ModelCard:
    """The served model's card under its name or an alias (``--model`` value, checkpoint path); 404
    naming the served model otherwise."""
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(model_id)
    return P.ModelCard(id=ctx.settings.served_model_name, max_model_len=ctx.caps.max_length)


@router.post("/tokenize")
async def tokenize(req: P.TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)

    def work() -> list[int]:
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            messages = [m.model_dump(exclude_unset=True) for m in req.messages]
            text = cp.render_prompt(ctx, messages, tools, req.chat_template_kwargs, req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message)
            return cp.encode(ctx, text, "messages", check_length=True, tools=tools)
        return cp.encode(ctx, req.prompt or "", "prompt", check_length=True)

    ids = await run_in_threadpool(work)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": ctx.caps.max_length}
    if req.return_token_strs:
        out["token_strs"] = [ctx.llm.tokenizer.id_to_token(i) for i in ids]
    return out


@router.post("/detokenize")
async def detokenize(req: P.DetokenizeRequest, request: Request) -> dict[str, Any]:
    ctx: ServeContext = request.app.state.ctx
    ctx.check_model(req.model)
    cp.check_token_ids(ctx, req.tokens, "tokens")
    return {"prompt": ctx.llm.decode(req.tokens, skip_special_tokens=False)}
