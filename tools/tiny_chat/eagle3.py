"""EAGLE-3 draft for `tiny-chat`: a trainable, batched twin of m2serve's draft math, the target data
it learns from, the training-time-test unroll, and the offline acceptance measurement (issue 35;
docs/serving.md §15).

Used by tools/tiny_chat/train_eagle3.py (training, export) and tests/checkpoints/test_tiny_chat_eagle3.py.
The math is the one of src/m2serve/model/eagle3.py (``Eagle3Draft.forward``, docs/serving.md §14),
written for a padded batch [B, N] so that the draft can be trained; the test checks the two agree on
the shipped weights.

Indexing (one sequence t_0 .. t_{n-1}; the target's aux states a_i and logits z_i at index i, z_i
predicting t_{i+1}). Unroll step j = 0, 1, ... at index i: input token t_{i+1+j} (step 0 always the
real next token; later steps the target's greedy token when teacher-forced, the draft's own previous
argmax when free-running), hidden = fc(a_i) at step 0, else the draft's own pre-norm output of step
j - 1 at i; RoPE position i + j; attention over the step-0 keys at indices <= i and the step-1..j keys
at index i itself (the draft KV an engine holds when it drafts j + 1 tokens after index i: the
"training-time test" of EAGLE-3). The step-j output at i is scored against the target's distribution
z_{i+1+j} (the token after t_{i+1+j}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.eagle3 import Eagle3DraftConfig
from m2serve.model.eagle3 import weight_shapes
from m2serve.model.norm import rms_norm
from m2serve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "src/m2serve/checkpoints/tiny-chat"
DRAFT = REPO / "src/m2serve/checkpoints/tiny-chat-eagle3"
# Held-out measurement prompts: data.eval_subset(kind, n, seed=EVAL_SEED), a seed used by no other
# consumer (tiny_chat_eval / tests use 1234, 34, 99; benchmarks/speculative.py 4034).
EVAL_SEED = 3535

M = "midlayer."




class DraftNet(nn.Module):
    """The draft (full draft vocabulary = the target's) with trainable weights under their public
    names and the target's frozen embedding [V, H].

    config: Eagle3DraftConfig (draft_vocab_size == vocab_size); embed [V, H] f32; init: name ->
    tensor for weights to start from (e.g. the target's final norm and tied head), the rest drawn
    from ``generator`` (normal, std 1 / sqrt(fan_in); norms 1).
    """

    def __init__(self, config: Eagle3DraftConfig, embed: torch.Tensor,
                 init: dict[str, torch.Tensor] | None = None, generator: torch.Generator | None = None):
        super().__init__()
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError("draft_vocab_size: DraftNet trains the full vocabulary only")
        self.config = config
        self.register_buffer("embed", embed.float(), persistent=False)
        self.params = nn.ParameterDict()
        init = init or {}
        for name, shape in weight_shapes(config).items():
            if name in init:
                t = init[name].float().clone()
            elif len(shape) == 1:
                t = torch.ones(shape)
            else:
                t = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
            self.params[name.replace(".", "__")] = nn.Parameter(t)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def state(self) -> dict[str, torch.Tensor]:
        """Public-layout name -> detached weight."""
        return {k.replace("__", "."): v.detach() for k, v in self.params.items()}

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int, free_running: bool = False,
               q_start: int = 0) -> list[torch.Tensor]:
        """The training-time-test unroll (module docstring) over a right-padded batch.

        tokens int64 [B, N] (the target's sequence; padding any id); aux [B, N, 3 Ht] f32 (the
        target's aux states); steps S >= 1; free_running: later steps read the draft's own argmax
        instead of t_{i+1+j}; q_start: outputs only for indices i >= q_start (the step-0 keys still
        cover every index; the draft has one layer, so earlier queries are not needed). Returns S
        logits tensors [B, N - q_start, V] f32 (step j at index i predicts t_{i+2+j}; entries whose
        input runs past N are garbage, mask them).
        """
        c = self.config
        B, N = tokens.shape
        W = N - q_start
        Hq, Hkv, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        g, scale = Hq // Hkv, 1.0 / math.sqrt(D)
        wq, wk, wv = (self.w(M + f"self_attn.{n}_proj.weight") for n in "qkv")
        idx = torch.arange(N)
        causal = idx[None, :] <= idx[q_start:, None]  # [W(query), N(key)]
        h = F.linear(aux, self.w("fc.weight"))  # [B, N, H]
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        out = []
        prev = None
        for j in range(steps):
            if j > 0 and free_running:
                inp = prev
            else:
                inp = shift(tokens, j)[:, q_start:] if j else shift(tokens, 0)
            e = rms_norm(self.embed[inp], self.w(M + "input_layernorm.weight"), eps)
            hn = rms_norm(h, self.w(M + "hidden_norm.weight"), eps)
            residual = hn if c.norm_before_residual else h
            x = torch.cat((e, hn), -1)
            n_rows = x.shape[1]
            pos = (idx[N - n_rows:] + j).repeat(B)
            cos, sin = rope_cos_sin(pos, self.inv_freq)
            k = apply_rope(F.linear(x, wk).view(B * n_rows, Hkv, D), cos, sin).view(B, n_rows, Hkv, D)
            v = F.linear(x, wv).view(B, n_rows, Hkv, D)
            k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)   # [B, rows, Hq, D]
            if j == 0:
                k0, v0 = k, v
                x, residual = x[:, q_start:], residual[:, q_start:]
                cos, sin = rope_cos_sin((idx[q_start:]).repeat(B), self.inv_freq)
            else:
                diag_k.append(k)
                diag_v.append(v)
            q = apply_rope(F.linear(x, wq).view(B * W, Hq, D), cos, sin).view(B, W, Hq, D)
            s0 = torch.einsum("bihd,bkhd->bhik", q, k0) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = [(q * dk).sum(-1).transpose(1, 2)[..., None] * scale for dk in diag_k]  # [B, Hq, W, 1]
            p = torch.softmax(torch.cat([s0, *sd], -1), -1)
            a = torch.einsum("bhik,bkhd->bihd", p[..., :N], v0)
            for t, dv in enumerate(diag_v):
                a = a + p[..., N + t].transpose(1, 2)[..., None] * dv
            r1 = F.linear(a.reshape(B, W, Hq * D), self.w(M + "self_attn.o_proj.weight")) + residual
            n = rms_norm(r1, self.w(M + "post_attention_layernorm.weight"), eps)
            gated = (F.silu(F.linear(n, self.w(M + "mlp.gate_proj.weight")))
                     * F.linear(n, self.w(M + "mlp.up_proj.weight")))
            r2 = F.linear(gated, self.w(M + "mlp.down_proj.weight")) + r1
            logits = F.linear(rms_norm(r2, self.w("norm.weight"), eps), self.w("lm_head.weight"))
            out.append(logits)
            h = r2
            prev = logits.argmax(-1)
        return out


@dataclass(slots=True)
class TargetSeq:
    """One target sequence: ids int64 [n] (prompt ++ the target's greedy continuation, eos kept);
    prompt_len; aux [n, 3 Ht] (bf16 to save memory); logits [n - prompt_len + 1, V] (bf16): the
    target's logits at indices prompt_len - 1 .. n - 1 (the ones that predict generated tokens)."""

    ids: torch.Tensor
    prompt_len: int
    aux: torch.Tensor
    logits: torch.Tensor


def load_target(path: Path = TARGET):
    """tiny-chat in fp32 on the CPU (FP8 dequantised at load)."""
    from m2serve.model.load import load_model
    return load_model(path, dtype=torch.float32)


@torch.no_grad()
def target_pass(model, seqs: list[list[int]], aux_ids: tuple[int, ...]
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the target once over whole sequences (one ragged forward): per sequence (aux [n, 3 Ht] f32,
    logits [n, V] f32), aux from ``MiniMaxM2ForCausalLM.aux_hidden`` (docs/serving.md §14)."""
    from m2serve.model.simple_cache import SimpleKVCache

    model.set_aux_layer_ids(aux_ids)
    page = 16
    pages = sum(-(-len(s) // page) for s in seqs) + 1
    cache = SimpleKVCache.create(model.config, num_pages=pages, page_size=page)
    logits = model(cache.batch(list(enumerate(seqs)), return_n_logits=10**9), cache.storage)
    aux = model.aux_hidden
    out, o = [], 0
    for s in seqs:
        out.append((aux[o: o + len(s)].clone(), logits[o: o + len(s)].clone()))
        o += len(s)
    return out


def greedy_continuations(prompts: list[list[int]], max_tokens: int, path: Path = TARGET,
                         batch: int = 64) -> list[list[int]]:
    """The target's greedy continuations (eos kept when emitted) through m2serve's LLM, fp32."""
    from m2serve.engine.sampling import SamplingParams
    from m2serve.serve.llm import LLM

    llm = LLM(str(path), dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = []
    for b in range(0, len(prompts), batch):
        out += [list(r.outputs[0].token_ids) for r in llm.generate(prompts[b: b + batch], sp)]
    return out


def chat_prompts(examples, path: Path = TARGET) -> list[list[int]]:
    """Chat-template token ids (generation prompt added) of examples' prompt messages, as the
    server renders them (serve/chat_pipeline)."""
    from m2serve.engine.sampling import SamplingParams
    from m2serve.serve import chat_pipeline as cp
    from m2serve.serve.llm import LLM

    llm = LLM(str(path), dtype="float32")
    ctx = cp.TextContext.of(llm)
    return [cp.prepare_blocking(ctx, cp.ChatJob(list(ex.prompt_messages), ex.tools or None,
                                                params=SamplingParams(max_tokens=16))).ids
            for ex in examples]


def pad_batch(seqs: list[TargetSeq]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad: (tokens [B, N] int64, aux [B, N, 3Ht] f32, target logits [B, N, V] f32,
    lengths [B], prompt_lens [B]); logits zero outside each sequence's response region."""
    N = max(len(s.ids) for s in seqs)
    B = len(seqs)
    tok = torch.zeros(B, N, dtype=torch.long)
    aux = torch.zeros(B, N, seqs[0].aux.shape[-1])
    lg = torch.zeros(B, N, seqs[0].logits.shape[-1])
    for b, s in enumerate(seqs):
        n = len(s.ids)
        tok[b, :n], aux[b, :n], lg[b, s.prompt_len - 1: n] = s.ids, s.aux.float(), s.logits.float()
    return (tok, aux, lg, torch.tensor([len(s.ids) for s in seqs]),
            torch.tensor([s.prompt_len for s in seqs]))


def step_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, N: int, j: int) -> torch.Tensor:
    """[B, N] bool: step j at index i is scored: its target index m = i + 1 + j predicts a generated
    token inside the sequence (prompt_len - 1 <= m <= n - 2)."""
    m = torch.arange(N)[None, :] + 1 + j
    return (m >= prompt_lens[:, None] - 1) & (m <= lengths[:, None] - 2)


def query_start(prompt_lens: torch.Tensor, steps: int) -> int:
    """First index any of ``steps`` unroll steps scores in a batch (step_mask): min prompt_len - 1 - steps."""
    return max(0, int(prompt_lens.min()) - 1 - steps)


def shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """x [B, N, ...] -> y with y[:, i] = x[:, i + 1 + j] (zeros past the end)."""
    k = 1 + j
    pad = x.new_zeros(x.shape[0], k, *x.shape[2:])
    return torch.cat((x[:, k:], pad), 1)[:, : x.shape[1]]


@torch.no_grad()
def acceptance(net: DraftNet, seqs: list[TargetSeq], k: int, batch: int = 8
               ) -> dict[str, list[float] | float]:
    """Offline acceptance of the draft against the target on ``seqs`` (greedy, response region).

    Returns {"teacher_forced": [rate at step 1..k] (draft argmax == target argmax at each step, the
    inputs being the target's tokens: ``unroll`` teacher-forced), "free_running": [same, the draft fed
    its own tokens], "accepted": mean accepted drafts per verification when drafting k tokens from
    every response index (the longest prefix of the free-running chain that equals the target's greedy
    argmax chain), "mean_accepted_length": 1 + accepted (the bonus token; vLLM's figure), "positions":
    count of start indices}. Start index i counts when all k targets lie inside the response.
    """
    tf_hit = [0.0] * k
    fr_hit = [0.0] * k
    cnt = [0.0] * k
    acc_sum, starts = 0.0, 0.0
    for b in range(0, len(seqs), batch):
        tok, aux, lg, lens, plens = pad_batch(seqs[b: b + batch])
        N = tok.shape[1]
        q0 = query_start(plens, k)
        tf = net.unroll(tok, aux, k, q_start=q0)
        fr = net.unroll(tok, aux, k, free_running=True, q_start=q0)
        all_ok = torch.ones_like(tok[:, q0:], dtype=torch.bool)
        run = torch.ones_like(all_ok)
        acc = torch.zeros(all_ok.shape)
        for j in range(k):
            mask = step_mask(lens, plens, N, j)[:, q0:]
            want = shift(lg.argmax(-1), j)[:, q0:]
            ht, hf = tf[j].argmax(-1) == want, fr[j].argmax(-1) == want
            tf_hit[j] += float((ht & mask).sum())
            fr_hit[j] += float((hf & mask).sum())
            cnt[j] += float(mask.sum())
            all_ok &= mask
            run &= hf
            acc += run.float()
        acc_sum += float((acc * all_ok).sum())
        starts += float(all_ok.sum())
    accepted = acc_sum / max(starts, 1.0)
    return {"teacher_forced": [h / max(c, 1.0) for h, c in zip(tf_hit, cnt)],
            "free_running": [h / max(c, 1.0) for h, c in zip(fr_hit, cnt)],
            "accepted": accepted, "mean_accepted_length": 1.0 + accepted, "positions": starts}


def load_state(path: Path = DRAFT) -> dict[str, torch.Tensor]:
    """The public-layout weights of a draft directory (``model.safetensors``; d2t / t2d dropped)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
