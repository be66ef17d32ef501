"""Greedy evaluation of `tiny-chat` on the held-out split: generation backends and scoring (issue 6).

Used by benchmarks/tiny_chat_eval.py (prints the rates) and tests/checkpoints/test_tiny_chat.py
(asserts floors). Rates, greedy (temperature 0):
- tool_call: tool-fitting requests whose output has well-formed calls with the right names and
  exactly the right argument values, typed by the schema;
- tool_result: answers after a tool response ``{"result": ...}`` that contain every result value;
- natural_result: answers after tool responses in natural shapes (objects of several fields, nested
  objects and lists, top-level lists, plain strings; data.natural_result) that contain every value;
- no_tool: requests with tools where none fits that make no call — not even one the parser rejects
  (a call to a tool that was not offered stays in the text; it still counts as a call here);
- reasoning_closed: outputs whose ``</think>`` comes before any content or call;
- plain: no call (same rule), and "repeat after me" phrases repeated exactly.
Every output may use up to MAX_TOKENS tokens (two calls with three arguments each take ~170).
Backends: m2serve (``LLM``: template, engine with all requests batched, streaming parser) and
transformers (``MiniMaxM2ForCausalLM`` fp32 + m2serve's ``parse_output``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    import data
else:
    from . import data

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "src/m2serve/checkpoints/tiny-chat"
MAX_TOKENS = 256


@dataclass(slots=True)
class Generation:
    """One greedy output: generated ids (eos removed), raw text, parsed reasoning / content /
    calls [(name, arguments dict)] and finish reason."""

    token_ids: list[int]
    text: str
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, Any]]
    finish_reason: str | None


def same_json(a: Any, b: Any) -> bool:
    """Equality with exact JSON types (1, 1.0 and true differ); dict key order ignored."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return a == b


def _arguments(text: str) -> Any:
    """A call's arguments object; the raw text if it is not JSON (a call cut off by max_tokens keeps
    its partially streamed arguments, spec P26), which then never equals an expected object."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def reasoning_closed(text: str) -> bool:
    """``</think>`` is present and precedes any tool-call block (content can only follow it)."""
    end = text.find("</think>")
    block = text.find("<minimax:tool_call>")
    return end >= 0 and (block < 0 or end < block)


def made_call(g: Generation) -> bool:
    """A call was made: parsed, or attempted (a tool-call block the parser rejected, e.g. a call to a
    tool that was not offered, is left in the text)."""
    return bool(g.calls) or "<minimax:tool_call>" in g.text


def score(ex: data.Example, g: Generation) -> bool:
    """Success of one example by its kind (see module docstring)."""
    if ex.kind == "tool_call":
        return (len(g.calls) == len(ex.calls) and "<minimax:tool_call>" not in (g.content or "")
                and all(n == en and same_json(a, ea) for (n, a), (en, ea) in zip(g.calls, ex.calls)))
    if ex.kind in ("tool_result", "natural_result"):
        return not made_call(g) and g.content is not None and all(v in g.content for v in ex.result_values)
    if ex.kind == "no_tool":
        return not made_call(g)
    user = ex.messages[-2]["content"]  # plain / repeat
    answer = ex.messages[-1]["content"]
    if user.startswith(("Repeat after me:", "Say exactly this:")):
        return not made_call(g) and (g.content or "").strip() == answer
    return not made_call(g)


def held_out(per_kind: int, kinds: tuple[str, ...] = data.KINDS) -> list[data.Example]:
    """The fixed eval examples: the first ``per_kind`` of each of ``kinds`` (data.eval_subset).

    Raises ValueError naming an unknown kind."""
    unknown = [k for k in kinds if k not in data.KINDS]
    if unknown:
        raise ValueError(f"kinds: unknown {unknown}; choose from {data.KINDS}")
    return [ex for kind in kinds for ex in data.eval_subset(kind, per_kind)]


def generate_m2serve(model: Path, examples: list[data.Example], max_tokens: int = MAX_TOKENS,
                     **engine_args: Any) -> list[Generation]:
    """Greedy through m2serve's LLM and chat pipeline (template, engine with all requests batched,
    streaming parser); each example has its own tools, so its chat job is prepared here."""
    from m2serve.engine.sampling import SamplingParams
    from m2serve.serve import chat_pipeline as cp
    from m2serve.serve.llm import LLM

    llm = LLM(str(model), **engine_args)
    ctx = cp.TextContext.of(llm)
    base = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    accs = {}
    for i, ex in enumerate(examples):
        job = cp.ChatJob(list(ex.prompt_messages), ex.tools or None, params=base)
        prepared = cp.prepare_blocking(ctx, job)
        [r] = cp.engine_requests(ctx, f"eval-{i}", [prepared.ids], prepared.params, prepared.new_parser)
        llm.add_request(r.request_id, r.prompt_token_ids, r.params, r.processor)
        accs[r.request_id] = cp.ChoiceAccumulator(0)
    while llm.has_unfinished_requests():
        for d in llm.step():
            accs[d.request_id].add(d)
    out = []
    for acc in accs.values():  # in example order
        r = acc.result()
        ids = list(r.token_ids)
        if ids and ids[-1] in llm.config.eos_token_ids:
            ids.pop()
        out.append(Generation(ids, r.text, r.reasoning, r.content,
                              [(c.name, _arguments(c.arguments)) for c in r.tool_calls], r.finish_reason))
    return out


def generate_transformers(model: Path, examples: list[data.Example], max_tokens: int = MAX_TOKENS,
                          batch_size: int = 16) -> list[Generation]:
    """Greedy through transformers' MiniMaxM2ForCausalLM (dtype=float32, FP8 dequantised at load) and
    m2serve's parser; prompts rendered with the checkpoint's template, left-padded batches."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from m2serve.text.parser import parse_output

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    eos, pad = gen_cfg["eos_token_id"], gen_cfg["pad_token_id"]
    # FP8 linears are dequantised at load; the unquantised bf16 tensors stay bf16 -> .float()
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).float().eval()
    tpl = data.load_template(model / "chat_template.jinja")
    prompts = [data.render(tpl, ex.prompt_messages, ex.tools, add_generation_prompt=True) for ex in examples]
    out = []
    for b in range(0, len(examples), batch_size):
        ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts[b: b + batch_size]]
        t = max(map(len, ids))
        x = torch.tensor([[pad] * (t - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (t - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad():
            y = hf.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                            eos_token_id=eos, pad_token_id=pad)
        for j, row in enumerate(y[:, t:].tolist()):
            ex = examples[b + j]
            stopped = eos in row
            row = row[: row.index(eos)] if stopped else row
            text = tok.decode(row, skip_special_tokens=False)
            p = parse_output(text, ex.tools, "split", prompt_tail=prompts[b + j][-64:])
            calls = [(c.name, json.loads(c.arguments)) for c in p.tool_calls]
            out.append(Generation(row, text, p.reasoning, p.content, calls,
                                  p.finish_reason(stopped_by_length=not stopped)))
    return out


def rates(examples: list[data.Example], gens: list[Generation]) -> dict[str, tuple[int, int]]:
    """{metric: (successes, total)}: one rate per example kind, tool_names (tool_call examples whose
    closed calls name exactly the expected tools, values not compared) and reasoning_closed."""
    r: dict[str, list[int]] = {k: [0, 0] for k in (*data.KINDS, "tool_names", "reasoning_closed")}
    for ex, g in zip(examples, gens):
        r[ex.kind][0] += score(ex, g)
        r[ex.kind][1] += 1
        if ex.kind == "tool_call":  # well-formed calls to the right tools, values not compared
            r["tool_names"][0] += [n for n, _ in g.calls] == [n for n, _ in ex.calls]
            r["tool_names"][1] += 1
        r["reasoning_closed"][0] += reasoning_closed(g.text)
        r["reasoning_closed"][1] += 1
    return {k: (a, b) for k, (a, b) in r.items() if b}
