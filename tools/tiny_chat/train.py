"""Resumable training of `tiny-chat`, a small MiniMax-M2 model trained on the synthetic chats (issue 6).

Commands of the committed checkpoint (each line resumes where the previous one stopped; ~4.5 h in all
with two threads on an otherwise idle 2-core machine)::

    A="--out RUN --examples 20000 --max-tokens 2400 --threads 2 --arith two_digit --no-verdict"
    python tools/tiny_chat/train.py $A --steps 3000 --stop-at 905
    python tools/tiny_chat/train.py $A --steps 3000 --drill-rows 16 --stop-at 1239
    python tools/tiny_chat/train.py $A --steps 2600 --drill-rows 48 --stop-at 1437
    python tools/tiny_chat/train.py $A --steps 2400 --drill-rows 24
    python tools/tiny_chat/train.py $A --steps 3300 --drill-rows 24
    python tools/tiny_chat/train.py $A --steps 4100 --drill-rows 24
    B="--out RUN --examples 24000 --max-tokens 2400 --threads 2 --arith two_digit --no-verdict --data-seed 1
       --two-call-rate 0.5 --wide-words 0.5 --drill-vocab-frac 0.5 --kind-weights 0.40,0.30,0.10,0.06,0.14
       --lr 1e-3 --decay-frac 0.6 --drill-rows 16"
    python tools/tiny_chat/train.py $B --steps 7600 --stop-at 4286
    python tools/tiny_chat/train.py $B --steps 9000
    C="--examples 24000 --max-tokens 2400 --threads 2 --two-call-rate 0.5 --wide-words 0.5
       --drill-vocab-frac 0.5 --kind-weights 0.38,0.28,0.12,0.08,0.14 --decay-frac 0.5 --drill-rows 8
       --no-verdict"
    python tools/tiny_chat/train.py $C --out RUN2 --init-from RUN/ckpt.pt --data-seed 4 --arith-rows 16 \
        --lr 5e-4 --steps 600
    python tools/tiny_chat/train.py $C --out RUN3 --init-from RUN2/ckpt.pt --data-seed 5 --arith-rows 24 \
        --arith-chat --lr 3e-4 --steps 400
    D="--max-tokens 2400 --threads 2 --two-call-rate 0.5 --wide-words 0.5 --drill-vocab-frac 0.5
       --decay-frac 0.5 --drill-rows 8"
    python tools/tiny_chat/train.py $D --out RUN4 --init-from RUN3/ckpt.pt --examples 12000 --data-seed 6 \
        --kind-weights 0.36,0.28,0.16,0.06,0.14 --arith-rows 16 --arith-chat --verdict-rows 4 --lr 5e-4 \
        --steps 500
    python tools/tiny_chat/train.py $D --out RUN5 --init-from RUN4/ckpt.pt --examples 8000 --data-seed 7 \
        --kind-weights 0.36,0.28,0.16,0.06,0.14 --arith-rows 16 --arith-chat --verdict-rows 2 --lr 2e-4 \
        --steps 200
    python tools/tiny_chat/train.py $D --out RUN6 --init-from RUN5/ckpt.pt --examples 8000 --data-seed 8 \
        --kind-weights 0.34,0.34,0.14,0.06,0.12 --verdict-rows 2 --lr 2e-4 --steps 150
    python tools/tiny_chat/train.py $D --out RUN7 --init-from RUN6/ckpt.pt --examples 8000 --data-seed 9 \
        --kind-weights 0.32,0.38,0.14,0.06,0.10 --suffix-words 0.3 --verdict-rows 2 --lr 2e-4 --steps 200
    python tools/tiny_chat/export.py RUN7 src/m2serve/checkpoints/tiny-chat

(the schedule was changed by hand while watching the run: copying did not emerge from the chats
alone, so copy drills were added; once the drill accuracy jumped (the induction-head phase change,
~step 1350) fewer drills were enough. Step 3300 was the checkpoint committed first (held-out exact
tool calls 69%). Its misses were held-out real words (``Munich`` -> ``Mun`` + garbage): their BPE
pieces were rare in training, so their embeddings were barely trained. ``$B`` fixes that with made-up
values over the whole alphabet (``--wide-words``, data.wide_word) and drills of random letter tokens
(``--drill-vocab-frac``), on a fresh corpus with twice the two-call requests: exact tool calls 100%.
Its arithmetic answers were guesses (two-digit operands held out: "29 plus 48 is 38"), near-ties that
re-quantisation flipped (issue 7's bound), so ``$C`` moves arithmetic to one-digit operands shared by
both splits (``--arith one_digit``, the default) and drills the 155 facts (``--arith-rows``), first as
lines, then as one-turn chats. Until then the model called a requested tool that was not offered
(held-out no-tool rate 47%): it had never needed to read the tool list. ``$D`` changes the
tool-request reasoning to the ``verdict`` format (data.verdict_reasoning, ``--verdict``, the default):
``I need "get_weather"`` is followed by ``", which is offered.`` only when the schema holds the same
tokens, so the deciding token is a copy from the tool list, which the model's induction heads already
do; verdict drills (``--verdict-rows``: the same request with its tool offered and not, loss on that
token) reached 100% held-out verdict accuracy within ~50 steps, where a verdict that was not a copy
had stayed at chance. RUN4 met every target but broke the Paris weather demo: ``Paris`` is ``P`` +
``ar`` + ``is``, and after the value the model answered "The weather in Paris 9 C." (the arithmetic
"is " -> digit habit; RUN3 had a 12-nat margin there, RUN4 a near-tie). RUN5 (a lower LR) and RUN6 (no
arithmetic drills, more tool results) did not restore it; RUN7's made-up words ending in template words
(``--suffix-words``, data.TEMPLATE_WORDS) did (margin >= 6.8 nats on "cloudy, 17/18/19 C").)

RUN8 (the natural_result kind; tried, not committed) started from the committed export itself
(``--init-from`` a checkpoint directory: export.train_state dequantises it, and re-exporting those
weights is bit-identical; the run dir gets the checkpoint's tokenizer, because tokenizer.py trains on
data.py's corpus, which this kind changed). The model before it answered only from
``{"result": "..."}``: an object gave "The weather in Paris is Paris.", a plain string an empty answer
(0/20 held-out natural results). RUN8's answers rephrased a result (``Here is the result of NAME: city
Paris, temperature_c 18``, an answer format since replaced): after 300 steps (one thread on a shared
machine, lr 3e-4, 30% natural results, then ``--bare-calls 0.3``) 97% of those target tokens were right
but whole answers were not (held-out 1/20): dropping the quotes and separators between copied tokens is
a new skill for this 4-layer model. So data.natural_answer restates the content as it came, which is
token-for-token copying. RUN9 to RUN11 train it (two threads on an idle machine, ~2.5 s a step;
RUN9 and RUN10 with the answer format ``NAME returned: CONTENT.``)::

    R="--examples 6000 --max-tokens 2400 --threads 2 --two-call-rate 0.5 --wide-words 0.5
       --drill-vocab-frac 0.5 --decay-frac 0.5 --drill-rows 4 --verdict-rows 2 --suffix-words 0.3
       --lr 3e-4 --bare-calls 0.3"
    N="--kind-weights 0.28,0.18,0.12,0.06,0.06,0.30 --natural-answer returned"
    python tools/tiny_chat/train.py $R $N --out RUN9 --init-from src/m2serve/checkpoints/tiny-chat \
        --data-seed 11 --steps 400
    python tools/tiny_chat/train.py $R $N --out RUN10 --init-from RUN9/ckpt.pt --data-seed 12 \
        --result-rows 8 --no-result-twins --steps 600 --stop-at 316
    M="--result-rows 8 --kind-weights 0.24,0.16,0.12,0.06,0.06,0.36"
    python tools/tiny_chat/train.py $R $M --out RUN11 --init-from RUN10/ckpt.pt --data-seed 13 --steps 800
    python tools/tiny_chat/train.py $R $M --out RUN12 --init-from RUN11/ckpt.pt --data-seed 14 \
        --lr 1.5e-4 --decay-frac 0.7 --steps 300
    python tools/tiny_chat/train.py $R $M --out RUN14 --init-from RUN12/ckpt.pt --data-seed 16 \
        --lr 2e-4 --decay-frac 0.6 --threads 1 --steps 300
    python tools/tiny_chat/export.py RUN14 src/m2serve/checkpoints/tiny-chat

(``--bare-calls``: call turns without reasoning, as the Agents SDK sends history back; no loss on
them; ``--init-from`` a run's ``ckpt.pt`` takes that run's tokenizer.) RUN9 alone reached 20/40
held-out natural results: the copy often jumped to another match of its last token (``{"``, the keys
and ``": `` also occur in the prompt's tool schemas and in the request). RUN10 adds tool-result copy
drills (``--result-rows``, data.result_drill: distractor schemas and responses, then the latest
response restated, the loss on the restatement): 37/60 at step 267, skipping or re-entering fields
(``"currency":"JPY02","gate"`` for ``"currency":"JPY02","time":"10:00","gate"``), and one reasoning in
60 ended with the answer's end of turn (``The tool returned a text.[e~[``: the answer's ``returned``
also ends the reasoning's ``The tool returned``). RUN11 answers ``Result of NAME: CONTENT.`` instead
(data.NATURAL_FORMATS), its drills' distractors are mostly twins of the content (the same keys, shape
and serialisation with other values), and natural results are 36% of the chats: 52% of 60 held out
at step 234, 63% at 428, then, once the rate decayed, 87/100 with every other rate at or above the
previous checkpoint's and reasoning closed 600/600. RUN12 (a second, lower decay): on
``benchmarks/tiny_chat_eval.py --per-kind 200`` natural results 179/200 (89.5%, the target is 90%),
exact calls 97.0%, tool results 99.0%, no-tool 100%, reasoning closed 1200/1200 (the previous
checkpoint: 0.5%, 96.5%, 98.5%, 99.0%, 1000/1000). RUN13 (RUN12 + 150 steps at lr 6e-5, ``--warmup
10``, data seed 15; not kept) gave 177/200. RUN14 (one thread, beside a CI run), the committed
checkpoint: natural results 182/200 (91.0%), exact calls 96.5%, tool results 98.0%, no-tool 100%,
reasoning closed 1200/1200: every target met; the natural rate moves by a few answers between runs.
Misses: a field skipped or a value bent in a long restatement (``"currency":"402"`` for ``"JPY02"``),
two-call turns. The weather sentence lost a word: "The weather in Paris cloudy, 18 C." (RUN12 kept
"is" when the call turn came back with its reasoning, not without; RUN14 drops it either way; the
values stay).

What did not work (kept out of the code): column-by-column arithmetic reasoning on two-digit held-out
operands (99% on training operands, 0% on held-out ones: the model memorises a number's digits rather
than reading them); and for the no-tool gap, reasoning that names the needed tool unquoted and then
says ``It is offered.`` / ``It is not offered.``, with dense drills of that verdict: 300 steps left
the verdict at chance (the verdict word is not a copy of anything in the prompt).

What made copying learnable, after a first attempt (2000 steps, o200k-style tokenizer, untied
embeddings) learned the format but copied nothing:

- the tokenizer's split rule (tokenizer.py): a value has the same token ids in the request and in
  ``<parameter ...>value</parameter>``, so copying is token-identity copying;
- tied embeddings (``--tie-embeddings``, tie_word_embeddings=true): a copied token's embedding is its
  output direction;
- copy drills (``--drill-rows``, data.drill_text): ``text \n text`` rows with the loss on the repeat,
  a dense signal for the induction mechanism, in a second forward pass each step.

Re-running the same command continues from ``OUT/ckpt.pt`` (saved every ``--save-every`` seconds and
at the end): the model, optimiser, load-balancing bias, step and data order all resume, so an
interrupted run ends where an uninterrupted one would. Everything is seeded (``--seed``).

The model is the MiniMax-M2 forward pass of docs/model.md §3 in plain PyTorch (fp32), at the issue's
dimensions: hidden 256, 8 heads, 4 KV heads, head_dim 128, rotary_dim 64, intermediate 512, 8 experts
top-2, 4 layers. Parameter names follow the hub layout (docs/checkpoints.md §2) with the experts stacked
(``experts.w1`` [E, I, H] …) for speed; export.py unstacks them. The router bias
``e_score_correction_bias`` is not trained by gradient: it follows the auxiliary-loss-free balancing
rule of DeepSeek-V3 (§2.1.2: after each step, bias += γ·sign(mean load − expert load)), so the
exported checkpoint exercises the bias path with real, non-zero values.

Loss: next-token cross-entropy on assistant tokens only — for each assistant turn after the last user
message, the tokens after the generation prompt ``]~b]ai\\n<think>\\n`` up to and including ``[e~[``.
Each drill kind adds a forward of its own rows and its loss: ``--drill-rows``, the copy drills' loss on
their repeated half (weight ``--drill-weight``); ``--arith-rows``, the arithmetic rows' loss on their
answers; ``--result-rows``, the tool-result drills' loss on the restated content; ``--verdict-rows``,
the verdict drills' loss on their verdict token. Drill batches are seeded by ``--seed`` and the step
(not ``--data-seed``), so a run that starts from another run's checkpoint replays its drills.

Shape legend: B batch, T tokens per row, N valid tokens, H hidden, Hq/Hkv heads, D head_dim,
E experts, K top-k, I intermediate, V vocab.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import data  # noqa: I001
    import tokenizer as tok_mod
else:
    from . import data
    from . import tokenizer as tok_mod


@dataclass(slots=True)
class Dims:
    """Model dimensions (fixed by issue 6; every quantised dimension a multiple of 128)."""

    vocab_size: int = tok_mod.VOCAB_PADDED
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    intermediate_size: int = 512
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    tie_word_embeddings: bool = False


# ---------------------------------------------------------------------------------------------
# Model (docs/model.md §3; fp32 training copy of the architecture)
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, HF order (docs/model.md §3): normalise in fp32, cast, multiply by γ."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    """Partial NeoX RoPE on dims [0, r) (rotate-half pairs (j, j + r/2)); x [B, h, T, D], cos/sin [T, r/2]."""
    a, b, rest = x[..., : r // 2], x[..., r // 2: r], x[..., r:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class Layer(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
        self.d = d
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Parameter(torch.empty(q, h))
        self.k_proj = nn.Parameter(torch.empty(kv, h))
        self.v_proj = nn.Parameter(torch.empty(kv, h))
        self.o_proj = nn.Parameter(torch.empty(h, q))
        self.q_norm = nn.Parameter(torch.ones(q))
        self.k_norm = nn.Parameter(torch.ones(kv))
        self.gate = nn.Parameter(torch.empty(d.num_local_experts, h))
        self.register_buffer("e_score_correction_bias", torch.zeros(d.num_local_experts))
        self.w1 = nn.Parameter(torch.empty(d.num_local_experts, d.intermediate_size, h))
        self.w3 = nn.Parameter(torch.empty(d.num_local_experts, d.intermediate_size, h))
        self.w2 = nn.Parameter(torch.empty(d.num_local_experts, h, d.intermediate_size))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.d
        bsz, t, _ = x.shape
        q = rms_norm(F.linear(x, self.q_proj), self.q_norm, d.rms_norm_eps)  # [B, T, Hq·D] (cross-head norm)
        k = rms_norm(F.linear(x, self.k_proj), self.k_norm, d.rms_norm_eps)  # [B, T, Hkv·D]
        v = F.linear(x, self.v_proj)
        q = q.view(bsz, t, d.num_attention_heads, d.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(bsz, t, d.num_key_value_heads, d.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(bsz, t, d.num_key_value_heads, d.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin, d.rotary_dim), rope(k, cos, sin, d.rotary_dim)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d.head_dim ** -0.5, enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(bsz, t, -1), self.o_proj)

    def moe(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] -> (out [N, H], tokens per expert [E]); router in fp32, unbiased weights
        (docs/model.md §3)."""
        d = self.d
        s = torch.sigmoid(F.linear(h.float(), self.gate))  # [N, E]
        idx = torch.topk(s + self.e_score_correction_bias, d.num_experts_per_tok, dim=-1).indices  # [N, K]
        w = s.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)  # [N, K]
        out = torch.zeros_like(h)
        flat = idx.reshape(-1)  # [N·K]
        order = torch.argsort(flat)
        counts = torch.bincount(flat, minlength=d.num_local_experts)
        tok = order // d.num_experts_per_tok
        wt = w.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            ti = tok[start: start + c]
            xe = h[ti]  # [c, H]
            ye = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
            out.index_add_(0, ti, ye * wt[start: start + c, None])
            start += c
        return out, counts

    def forward(self, x, cos, sin, valid):
        x = x + self.attention(rms_norm(x, self.input_layernorm, self.d.rms_norm_eps), cos, sin)
        h = rms_norm(x, self.post_attention_layernorm, self.d.rms_norm_eps)
        hv = h[valid]  # [N, H] (padding is not routed)
        m, counts = self.moe(hv)
        out = torch.zeros_like(h)
        out[valid] = m
        return x + out, counts


class TinyM2(nn.Module):
    """The MiniMax-M2 decoder (docs/model.md §3) for training; ``forward`` returns final hidden states."""

    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.embed_tokens = nn.Parameter(torch.empty(d.vocab_size, d.hidden_size))
        self.layers = nn.ModuleList(Layer(d) for _ in range(d.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(d.hidden_size))
        if not d.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(d.vocab_size, d.hidden_size))
        inv = 1.0 / d.rope_theta ** (torch.arange(0, d.rotary_dim, 2, dtype=torch.float32) / d.rotary_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.d.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            s = out_std if name.endswith(("o_proj", "w2")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    @property
    def unembed(self) -> torch.Tensor:
        """The output projection [V, H]: ``lm_head``, or the embedding when tied."""
        return self.embed_tokens if self.d.tie_word_embeddings else self.lm_head

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [B, T] int64, valid [B, T] bool (right padding) -> hidden [B, T, H], loads per layer [E]."""
        t = ids.shape[1]
        phi = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq  # [T, R/2]
        cos, sin = phi.cos(), phi.sin()
        x = F.embedding(ids, self.embed_tokens)
        loads = []
        for layer in self.layers:
            x, c = layer(x, cos, sin, valid)
            loads.append(c)
        return rms_norm(x, self.norm, self.d.rms_norm_eps), loads


# ---------------------------------------------------------------------------------------------
# Data: rendered, tokenised, assistant-only loss mask
# ---------------------------------------------------------------------------------------------

def encode_example(tok, tpl, ex: data.Example) -> tuple[list[int], list[bool]]:
    """Token ids of the whole chat and a mask of the target tokens (assistant turns after the last user,
    except a call turn without reasoning_content: data.make_example ``bare_calls``)."""
    full = data.render(tpl, ex.messages, ex.tools, add_generation_prompt=False)
    enc = tok.encode(full, add_special_tokens=False)
    last_user = max(i for i, m in enumerate(ex.messages) if m["role"] == "user")
    spans = []
    for j, m in enumerate(ex.messages):
        bare_call = bool(m.get("tool_calls")) and "reasoning_content" not in m
        if m["role"] != "assistant" or j < last_user or bare_call:
            continue
        start = len(data.render(tpl, ex.messages[:j], ex.tools, add_generation_prompt=True))
        end_text = data.render(tpl, ex.messages[: j + 1], ex.tools, add_generation_prompt=False)
        if not full.startswith(end_text) or not end_text.endswith("[e~[\n"):
            raise RuntimeError("rendered turns are not prefixes of the whole chat")
        spans.append((start, len(end_text) - 1))
    mask = []
    for a, b in enc.offsets:
        inside = any(s <= a and b <= e for s, e in spans)
        if not inside and any(a < s < b or a < e < b for s, e in spans):
            raise RuntimeError(f"a token straddles a target boundary at chars {a}-{b}")
        mask.append(inside)
    return enc.ids, mask


def build_corpus(tok, n: int, seed: int, weights: tuple[float, ...],
                 two_call_rate: float = data.TWO_CALL_RATE, wide: float = 0.0, arith: str = "one_digit",
                 verdict: bool = True, suffix: float = 0.0, bare_calls: float = 0.0,
                 natural: str = "result_of") -> list[tuple[list[int], list[bool]]]:
    tpl = data.load_template()
    return [encode_example(tok, tpl, ex) for ex in data.make_examples(
        "train", n, seed, weights, two_call_rate, wide, arith, verdict, suffix, bare_calls, natural)]


def batches_for_epoch(lengths: list[int], epoch: int, seed: int, max_tokens: int) -> list[list[int]]:
    """Example indices grouped into batches of similar length (padding ≤ max_tokens per batch)."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out: list[list[int]] = []
    chunk = 512
    for c in range(0, len(order), chunk):
        part = sorted(order[c: c + chunk], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in part:
            if cur and (len(cur) + 1) * max(lengths[i], max(lengths[k] for k in cur)) > max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def collate(items: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ids [B, T], valid [B, T], labels [B, T] (-100 off target; label of position t is token t+1)."""
    t = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), t, dtype=torch.long)
    valid = torch.zeros(len(items), t, dtype=torch.bool)
    labels = torch.full((len(items), t), -100, dtype=torch.long)
    for b, (x, m) in enumerate(items):
        n = len(x)
        ids[b, :n] = torch.tensor(x)
        valid[b, :n] = True
        tgt = torch.tensor(x[1:])
        keep = torch.tensor(m[1:])
        labels[b, : n - 1] = torch.where(keep, tgt, torch.full_like(tgt, -100))
    return ids, valid, labels


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------

def letter_token_ids(tok) -> list[int]:
    """Ids of the BPE tokens made of ASCII letters only (the pieces of words)."""
    return sorted(i for s, i in tok.get_vocab().items()
                  if i < tok_mod.BPE_VOCAB and s.isascii() and s.isalpha())


def vocab_drill_ids(rng: random.Random, letters: list[int], space: list[int]) -> list[int]:
    """2–6 'words' of 1–3 random letter tokens each, space-separated: a drill that reaches every letter
    token, rare ones included (the pieces of unseen real words)."""
    out: list[int] = []
    for w in range(rng.randint(2, 6)):
        out += (space if w else []) + [rng.choice(letters) for _ in range(rng.randint(1, 3))]
    return out


def drill_batch(tok, rows: int, seed: int, step: int, wide: float = 0.0, vocab_frac: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` copy drills for ``step``: ids of ``text \n text`` -> ids [R, T], valid [R, T],
    labels [R, T] (targets: the second copy). ``text`` is data.drill_text, or with probability
    ``vocab_frac`` vocab_drill_ids. Deterministic in (seed, step)."""
    rng = random.Random(f"drill:{seed}:{step}")
    nl = tok.encode("\n", add_special_tokens=False).ids
    space = tok.encode(" ", add_special_tokens=False).ids
    letters = letter_token_ids(tok) if vocab_frac else []
    items = []
    for _ in range(rows):
        if vocab_frac and rng.random() < vocab_frac:
            t = vocab_drill_ids(rng, letters, space)
        else:
            t = tok.encode(data.drill_text(rng, wide), add_special_tokens=False).ids
        x = t + nl + t
        items.append((x, [False] * (len(t) + len(nl)) + [True] * len(t)))
    return collate(items)


def result_batch(tok, rows: int, seed: int, step: int, wide: float = 0.0, twins: bool = True,
                 natural: str = "result_of") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` tool-result copy drills (data.result_drill, ``twins`` and ``natural`` as there), the loss
    on the tokens that start at or after the restated content -> ids [R, T], valid [R, T], labels [R, T].
    Deterministic in (seed, step)."""
    rng = random.Random(f"result:{seed}:{step}")
    items = []
    for _ in range(rows):
        text, start, _ = data.result_drill(rng, wide, twins, natural)
        enc = tok.encode(text, add_special_tokens=False)
        items.append((enc.ids, [a >= start for a, _ in enc.offsets]))
    return collate(items)


def arith_batch(tok, rows: int, seed: int, step: int, chat: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` arithmetic drills (data.arith_drill), the loss on the answer after each question, or
    with ``chat`` one-turn arithmetic chats (data.arith_chat, the loss on the assistant turn)
    -> ids [R, T], valid [R, T], labels [R, T]. Deterministic in (seed, step)."""
    rng = random.Random(f"arith:{seed}:{step}")
    if chat:
        tpl = data.load_template()
        return collate([encode_example(tok, tpl, data.arith_chat(rng)) for _ in range(rows)])
    items = []
    for _ in range(rows):
        ids: list[int] = []
        mask: list[bool] = []
        for q, a in data.arith_drill(rng):
            qi, ai = tok.encode(q, add_special_tokens=False).ids, tok.encode(a, add_special_tokens=False).ids
            ids, mask = ids + qi + ai, mask + [False] * len(qi) + [True] * len(ai)
        items.append((ids, mask))
    return collate(items)


def verdict_batch(tok, pairs: int, seed: int, step: int, wide: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pairs`` verdict drills (data.verdict_prompt) for ``step``: each tool request with its tool
    offered (target ``", ``) and not offered (target ``". ``), the loss on that one verdict token
    -> ids [2P, T], valid [2P, T], labels [2P, T]. Deterministic in (seed, step).

    Raises RuntimeError if a verdict is not one token of ``tok``."""
    rng = random.Random(f"verdict:{seed}:{step}")
    s = data.Sampler(rng, "train", wide)
    tpl = data.load_template()
    targets = []
    for text in ('", x', '". x'):
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) != 2:
            raise RuntimeError(f"verdict {text[:-1]!r} is not one token: {ids}")
        targets.append(ids[0])
    items = []
    for _ in range(pairs):
        *texts, _name = data.verdict_prompt(s, tpl)
        for text, target in zip(texts, targets):
            ids = tok.encode(text, add_special_tokens=False).ids + [target]
            items.append((ids, [False] * (len(ids) - 1) + [True]))
    return collate(items)


def lr_at(step: int, total: int, peak: float, warmup: int, decay_frac: float) -> float:
    """Warmup, constant, then linear decay to 10% over the last ``decay_frac`` of the steps (so --steps
    can change on resume without disturbing the schedule until the decay starts)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = int((1.0 - decay_frac) * total)
    if step < decay_start:
        return peak
    p = (step - decay_start) / max(1, total - decay_start)
    return peak * (1.0 - 0.9 * min(1.0, p))


def save_ckpt(path: Path, model, opt, step: int, args_dict: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "args": args_dict,
                "dims": asdict(model.d)}, tmp)
    os.replace(tmp, path)


def init_state(path: Path, dims: Dims) -> dict[str, torch.Tensor]:
    """Weights to start from: a run's ``ckpt.pt`` (its ``model`` state dict) or an exported checkpoint
    directory (export.train_state: FP8 dequantised, bf16 widened; the committed tiny-chat).

    Raises ValueError if the directory's dims differ from the model's (``--tie-embeddings`` must match)."""
    if not path.is_dir():
        return torch.load(path, weights_only=False)["model"]
    if __package__ in (None, ""):
        import export
    else:
        from . import export
    state, found = export.train_state(path)
    if found != asdict(dims):
        raise ValueError(f"--init-from {path}: dims {found} differ from the model's {asdict(dims)}; "
                         "pass the matching --tie-embeddings")
    return state


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run dir: tokenizer/, ckpt.pt, train.log")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--examples", type=int, default=12000, help="training corpus size")
    ap.add_argument("--max-tokens", type=int, default=1200, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--decay-frac", type=float, default=0.4, help="final fraction of steps with linear decay")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=None,
                    help="seed of the training corpus (default: --seed); a new one on resume: fresh examples")
    ap.add_argument("--two-call-rate", type=float, default=data.TWO_CALL_RATE,
                    help="share of tool requests asking for two calls in the training corpus")
    ap.add_argument("--wide-words", type=float, default=0.0,
                    help="probability that a made-up word or name in the corpus/drills is data.wide_word")
    ap.add_argument("--suffix-words", type=float, default=0.0,
                    help="probability that a made-up word in the corpus ends in a template word "
                         "(data.TEMPLATE_WORDS: 'Lomoris')")
    ap.add_argument("--bare-calls", type=float, default=0.0,
                    help="probability that a tool-result example's call turn has no reasoning_content, as "
                         "API clients send it back (no loss on that turn; data.make_example)")
    ap.add_argument("--drill-vocab-frac", type=float, default=0.0,
                    help="share of drill rows made of random letter tokens (vocab_drill_ids)")
    ap.add_argument("--arith", choices=("one_digit", "two_digit"), default="one_digit",
                    help="arithmetic turns of the corpus (data.Sampler): one-digit operands, or two-digit "
                         "operands of the training split (the committed checkpoint's first phases)")
    ap.add_argument("--verdict", action=argparse.BooleanOptionalAction, default=True,
                    help="tool requests reason 'I need \"NAME\", which is offered.' / '... not offered' "
                         "(data.verdict_reasoning); --no-verdict: the first phases' reasoning")
    ap.add_argument("--verdict-rows", type=int, default=0,
                    help="verdict drill pairs per step (verdict_batch: offered and not, loss on the verdict "
                         "token)")
    ap.add_argument("--kind-weights", type=lambda v: tuple(float(x) for x in v.split(",")),
                    default=data.KIND_WEIGHTS, help=f"corpus mix of {','.join(data.KINDS)} (comma-separated)")
    ap.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="γ of the load-balancing bias update")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="phase 2: start from the weights of another run's ckpt.pt, or of an exported "
                         "checkpoint directory (export.train_state; fresh optimiser)")
    ap.add_argument("--loss-on", choices=("assistant", "all"), default="assistant",
                    help="target tokens: assistant turns (issue 6), or every token (an LM pretraining phase)")
    ap.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True,
                    help="tie lm_head to embed_tokens (tie_word_embeddings): a copied token's embedding is "
                         "directly its output direction, which makes copying unseen values learnable")
    ap.add_argument("--drill-rows", type=int, default=0,
                    help="copy-drill rows per step (data.drill_text, loss on the repeat), second forward")
    ap.add_argument("--result-rows", type=int, default=0,
                    help="tool-result copy drills per step (data.result_drill), loss on the restated content")
    ap.add_argument("--natural-answer", choices=tuple(data.NATURAL_FORMATS), default="result_of",
                    help="answer format of natural tool results (data.NATURAL_FORMATS)")
    ap.add_argument("--result-twins", action=argparse.BooleanOptionalAction, default=True,
                    help="result drills with twin distractors (data.result_drill twins)")
    ap.add_argument("--arith-rows", type=int, default=0,
                    help="arithmetic drill rows per step (arith_batch, loss on the answers), third forward")
    ap.add_argument("--arith-chat", action="store_true",
                    help="arithmetic rows are one-turn chats (arith_batch)")
    ap.add_argument("--drill-weight", type=float, default=1.0, help="weight of the drill loss")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop (and save) at this step without changing the schedule of --steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: on a shared machine OpenMP threads spin-wait)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        # the tokenizer of what we start from: an exported checkpoint's, or a run's ckpt.pt's run dir's
        src = None if args.init_from is None else (
            args.init_from if args.init_from.is_dir() else args.init_from.parent / "tokenizer")
        if src is not None:
            if not (src / "tokenizer.json").exists():  # a fresh tokenizer would not fit the weights
                raise SystemExit(f"--init-from {args.init_from}: no tokenizer at {src}")
            tok_dir.mkdir(parents=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(src / name, tok_dir / name)
        else:  # trained on data.py's corpus: a change to data.py changes it
            tok_mod.save(tok_dir)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    t0 = time.time()
    data_seed = args.seed if args.data_seed is None else args.data_seed
    corpus = build_corpus(tok, args.examples, data_seed, args.kind_weights, args.two_call_rate,
                          args.wide_words, args.arith, args.verdict, args.suffix_words, args.bare_calls,
                          args.natural_answer)
    if args.loss_on == "all":
        corpus = [(x, [True] * len(x)) for x, _ in corpus]
    lengths = [len(x) for x, _ in corpus]
    print(f"corpus: {len(corpus)} examples, {sum(lengths)} tokens, "
          f"{sum(sum(m) for _, m in corpus)} target tokens ({time.time() - t0:.0f} s)", flush=True)

    torch.manual_seed(args.seed)
    model = TinyM2(Dims(tie_word_embeddings=args.tie_embeddings))
    model.init_weights(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=True)
    ckpt = args.out / "ckpt.pt"
    step = 0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        print(f"resumed from {ckpt} at step {step}", flush=True)
    elif args.init_from is not None:
        model.load_state_dict(init_state(args.init_from, model.d))
        print(f"initialised from {args.init_from}", flush=True)
    args_dict = {k: str(v) for k, v in vars(args).items()}

    epoch_batches: dict[int, list[list[int]]] = {}

    def batch_at(i: int) -> list[int]:
        """Global batch i: walk epochs (each a seeded permutation) so resuming needs only the step."""
        e = 0
        while True:
            if e not in epoch_batches:
                epoch_batches[e] = batches_for_epoch(lengths, e, args.seed, args.max_tokens)
            if i < len(epoch_batches[e]):
                return epoch_batches[e][i]
            i -= len(epoch_batches[e])
            e += 1

    log = open(args.out / "train.log", "a")
    bar = tqdm(total=args.steps, initial=step, dynamic_ncols=True, mininterval=5)
    last_save = time.time()
    ema_loss = ema_acc = None
    tokens_done, t_start = 0, time.time()
    end = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    while step < end:
        ids, valid, labels = collate([corpus[i] for i in batch_at(step)])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup, args.decay_frac)
        hidden, loads = model(ids, valid)
        sel = labels != -100
        logits = F.linear(hidden[sel], model.unembed)  # [M, V] target positions only
        tgt = labels[sel]
        loss = F.cross_entropy(logits, tgt)
        # extra forwards (drills are short: padding them to the chat rows would waste compute)
        extras = {}  # name -> (weight, (ids, valid, labels))
        if args.drill_rows:
            extras["drill"] = (args.drill_weight, drill_batch(tok, args.drill_rows, args.seed, step,
                                                              args.wide_words, args.drill_vocab_frac))
        if args.arith_rows:
            extras["arith"] = (1.0, arith_batch(tok, args.arith_rows, args.seed, step, args.arith_chat))
        if args.result_rows:
            extras["result"] = (1.0, result_batch(tok, args.result_rows, args.seed, step, args.wide_words,
                                                   args.result_twins, args.natural_answer))
        if args.verdict_rows:
            extras["verdict"] = (1.0, verdict_batch(tok, args.verdict_rows, args.seed, step, args.wide_words))
        loss_total, extra_stats = loss, {}
        for name, (weight, (e_ids, e_valid, e_labels)) in extras.items():
            e_hidden, e_loads = model(e_ids, e_valid)
            e_sel = e_labels != -100
            e_logits = F.linear(e_hidden[e_sel], model.unembed)
            e_loss = F.cross_entropy(e_logits, e_labels[e_sel])
            loss_total = loss_total + weight * e_loss
            loads = [a + b for a, b in zip(loads, e_loads)]
            e_acc = (e_logits.argmax(-1) == e_labels[e_sel]).float().mean().item()
            extra_stats |= {f"{name}_loss": round(e_loss.item(), 4), f"{name}_acc": round(e_acc, 4)}
        opt.zero_grad(set_to_none=True)
        loss_total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for layer, c in zip(model.layers, loads):
                c = c.float()
                layer.e_score_correction_bias += args.bias_rate * torch.sign(c.mean() - c)
            acc = (logits.argmax(-1) == tgt).float().mean().item()
        step += 1
        tokens_done += int(valid.sum())
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        tps = tokens_done / (time.time() - t_start)
        bar.set_postfix(loss=f"{ema_loss:.3f}", acc=f"{ema_acc:.3f}", tok_s=f"{tps:.0f}")
        bar.update(1)
        rec = {"step": step, "loss": round(loss.item(), 4), "acc": round(acc, 4),
               **extra_stats,
               "lr": opt.param_groups[0]["lr"], "tok_s": round(tps), "time": time.time()}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if time.time() - last_save > args.save_every or step == end:
            save_ckpt(ckpt, model, opt, step, args_dict)
            last_save = time.time()
    bar.close()
    print(f"done: step {step}, loss {ema_loss}, acc {ema_acc}", flush=True)


if __name__ == "__main__":
    main()
