"""Wire helpers shared by the OpenAI routes: usage, token logprobs, tool-call deltas, SSE lines."""

from __future__ import annotations

from m2serve.engine.sampling import TokenLogprobs
from m2serve.serve import protocol as P
from m2serve.serve.chat_pipeline import TokenUsage
from m2serve.serve.context import ServeContext
from m2serve.serve.errors import APIError, openai_error_body
from m2serve.serve.protocol import sse
from m2serve.text.parser import ToolCallDelta


def usage(u: TokenUsage, with_reasoning: bool = True) -> P.Usage:
    """OpenAI usage; reasoning_tokens (chat) and cached prompt tokens (prefix cache)."""
    details = P.CompletionTokensDetails(reasoning_tokens=u.reasoning) if with_reasoning else None
    return P.Usage(
        prompt_tokens=u.prompt,
        completion_tokens=u.output,
        total_tokens=u.prompt + u.output,
        completion_tokens_details=details,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=u.cached) if with_reasoning else None,
    )


def chat_logprobs(ctx: ServeContext, lps: list[TokenLogprobs] | None) -> list[P.TokenLogprob]:
    """Chat-style logprobs (token text, bytes, top alternatives) of generated tokens."""
    llm, raw = ctx.llm, ctx.llm.tokenizer.token_bytes
    return [
        P.TokenLogprob(
            token=llm.token_text(lp.token_id),
            logprob=lp.logprob,
            bytes=list(raw(lp.token_id)),
            top_logprobs=[P.TopLogprob(token=llm.token_text(t), logprob=v, bytes=list(raw(t)))
                          for t, v in lp.top],
        )
        for lp in lps or []
    ]


def tool_delta(tc: ToolCallDelta) -> P.ToolCallDelta:
    """A parser tool-call fragment as a chat-completions tool_calls delta."""
    if tc.name is not None:
        return P.ToolCallDelta(index=tc.index, id=tc.id, type="function",
                               function=P.FunctionCallDelta(name=tc.name, arguments=tc.arguments))
    return P.ToolCallDelta(index=tc.index, function=P.FunctionCallDelta(arguments=tc.arguments))


def sse_error(e: APIError) -> str:
    """An error inside an OpenAI stream (the status line has already been sent)."""
    return sse(openai_error_body(e))
