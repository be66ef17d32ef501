"""The EAGLE-3 draft's math and its loader (docs/serving.md §14): one Llama-style decoder layer
whose attention input is the normed token embedding ++ the normed fused target hidden state.

Legend: T tokens (one sequence, positions given), H the draft's hidden size, Ht the target's,
Hq / Hkv heads, D head_dim, I intermediate size, V the target vocabulary, Vd the draft's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from m2serve.config.eagle3 import Eagle3DraftConfig
from m2serve.formats.finite import check_finite
from m2serve.model.attention import attend, attend_kernel, write_kv
from m2serve.model.batch import ForwardBatch, KVStorage
from m2serve.model.norm import rms_norm
from m2serve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from m2serve.model.step import RopeCache, StepContext

log = logging.getLogger(__name__)

def weight_shapes(c: Eagle3DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the public EAGLE-3 layout (d2t / t2d / embed_tokens apart): tensor name ->
    shape (element counts) from ``c`` (docs/serving.md §14). Pure; raises nothing."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    m = "midlayer."
    return {
        "fc.weight": (H, 3 * c.target_hidden_size),
        m + "input_layernorm.weight": (H,), m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H), m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H), m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (I, H), m + "mlp.up_proj.weight": (I, H),
        m + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (c.draft_vocab_size, H),
    }


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft (one midlayer), weights as in the public layout (names in ``weights``).

    config: the draft's :class:`Eagle3DraftConfig`; weights: name -> tensor (the names of
    :func:`load_eagle3_draft`, all of the compute dtype; kept as ``w`` except q/k/v and
    gate/up, held concatenated as ``qkv_weight`` [(Hq + 2 Hkv)·D, 2H] and
    ``gate_up_weight`` [2I, H]); embed_tokens [V, H]: the draft's own or the
    target's embedding; draft_to_target int64 [Vd]: target id of each draft id (``d + d2t[d]``).
    """

    def __init__(self, config: Eagle3DraftConfig, weights: dict[str, torch.Tensor],
                 embed_tokens: torch.Tensor, draft_to_target: torch.Tensor):
        super().__init__()
        self.config = config
        m = "midlayer."
        # q, k, v as one linear and gate, up as one (fewer, larger GEMMs per pass; the originals are
        # dropped from ``w``, so the draft's memory stays one copy)
        w = dict(weights)
        self.qkv_weight = torch.cat([w.pop(m + f"self_attn.{p}_proj.weight") for p in "qkv"])
        self.gate_up_weight = torch.cat([w.pop(m + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
        self.w = w
        self.embed_tokens = embed_tokens
        self.draft_to_target = draft_to_target
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, embed_tokens.device)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three auxiliary hidden states [T, 3 Ht] (concatenated in the order of the
        aux layer ids) -> the fused state [T, H] (``fc``)."""
        return F.linear(aux_hidden, self.w["fc.weight"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over T tokens of one sequence (causal attention among them; no KV cache).

        input_ids int64 [T]; positions int64 [T]; hidden [T, 3 Ht] (the target's aux states: ``fc``
        applies) or [T, H] (the draft's own previous pre-norm output). Returns (logits [T, V] in the
        compute dtype over the TARGET vocabulary, -inf off the draft vocabulary; pre-norm hidden
        [T, H] for the next draft pass). Math (vLLM's llama_eagle3 order, docs/serving.md §14):
        r = h or hidden_norm(h) (norm_before_residual); x = [input_norm(e), hidden_norm(h)];
        r1 = o_proj(attn(x)) + r; r2 = mlp(post_norm(r1)) + r1; logits = lm_head(norm(r2)).
        Raises ValueError naming ``hidden`` for another width.
        """
        T, D = input_ids.shape[0], self.config.head_dim

        cos, sin = rope_cos_sin(positions, self.inv_freq)
        kv: list[torch.Tensor] = []

        def write(k: torch.Tensor, v: torch.Tensor) -> None:
            kv[:] = [apply_rope(k, cos, sin), v]

        def causal(q: torch.Tensor) -> torch.Tensor:
            q = apply_rope(q, cos, sin)
            g = q.shape[1] // kv[0].shape[1]
            k, v = kv[0].repeat_interleave(g, dim=1), kv[1].repeat_interleave(g, dim=1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=1.0 / math.sqrt(D))
            return a.transpose(0, 1).reshape(T, -1)

        draft_logits, r2 = self._layer(input_ids, hidden, write, causal, None, False)
        logits = draft_logits.new_full((T, self.config.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft_logits
        return logits, r2

    def forward_paged(self, batch: ForwardBatch, hidden: torch.Tensor, kv: KVStorage, layer: int,
                      rope: RopeCache, kernel: Callable[..., torch.Tensor] | None = None,
                      lower_right: bool = False, query: ForwardBatch | None = None,
                      kv_only_off_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over a ragged batch (docs/serving.md §14, "Drafting in the engine"): the
        new tokens' K/V are written into layer ``layer`` of the engine's pool ``kv`` at the batch's
        slot mapping, and each request attends causally over its pages (the target's attention
        seam, model/attention.py ``attend`` / ``attend_kernel``: no per-request Python here beyond
        the torch backend's loop the target shares).

        batch: the `ForwardBatch` (tokens int64 [T] = the NEXT token of each position, positions,
        block tables, logit rows [N]); hidden [T, 3 Ht] (target aux states) or [T, H] (the draft's
        own previous output); rope: the draft's `RopeCache` (head_dim, rope_theta). With
        ``kv_only_off_rows`` only K and V are computed for all T rows, and the queries, attention,
        o_proj, MLP and head only for the N logit rows (a prompt chunk's other rows are needed for
        their K/V alone); ``query`` is then the batch of those rows alone (one row per request that
        wants logits, at its last position, same tables and context lengths as ``batch``; None when
        N = 0: nothing after the K/V write runs). Returns (logits [N, Vd] f32 over the DRAFT
        vocabulary at the logit rows; pre-norm hidden [N, H] at the same rows).
        """
        n_rows = len(batch.host.logit_rows)
        if query is not None and (not kv_only_off_rows or query.tokens.numel() != n_rows):
            raise ValueError(f"forward_paged: a query batch of {query.tokens.numel()} rows needs "
                             f"kv_only_off_rows and one row per logit row ({n_rows})")
        if kv_only_off_rows and query is None and n_rows:
            raise ValueError(f"forward_paged: kv_only_off_rows with {n_rows} logit rows needs their "
                             "query batch")
        # a K/V-only step never attends: no materialised masks for it (a lower-right bias is lazy)
        step = StepContext.build(batch, kv.page_size, rope, hidden.dtype, None, kernel,
                                 lower_right or kv_only_off_rows)
        at = step if query is None else StepContext.build(query, kv.page_size, rope, hidden.dtype, None,
                                                           kernel, lower_right)
        scale = 1.0 / math.sqrt(self.config.head_dim)

        def write(k: torch.Tensor, v: torch.Tensor) -> None:
            write_kv(kv, layer, apply_rope(k, step.cos, step.sin), v, step.slot_mapping)

        def paged(q: torch.Tensor) -> torch.Tensor:
            q = apply_rope(q, at.cos, at.sin)
            if at.kernel is not None:
                return attend_kernel(q, kv, layer, at, scale)
            return attend(q, kv, layer, at, scale)

        draft_logits, r2 = self._layer(batch.tokens, hidden, write, paged, step.logit_rows, kv_only_off_rows)
        return draft_logits.float(), r2

    def _layer(self, input_ids: torch.Tensor, hidden: torch.Tensor,
               write: Callable[[torch.Tensor, torch.Tensor], None],
               attention: Callable[[torch.Tensor], torch.Tensor],
               rows: torch.Tensor | None, kv_only_off_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The midlayer around ``write(k, v [T, Hkv, D])`` (stores them, RoPE on k) and
        ``attention(q [n, Hq, D]) -> [n, Hq·D]`` (RoPE on q). Returns (draft-vocabulary logits
        [N, Vd] at ``rows`` (None: all T), pre-norm hidden r2 at the same rows). With
        ``kv_only_off_rows`` only K and V see all T rows; q and everything after it run on ``rows``
        alone (the same values at those rows)."""
        c, w, m = self.config, self.w, "midlayer."
        if hidden.shape[-1] == 3 * c.target_hidden_size:
            hidden = self.combine(hidden)
        elif hidden.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden: width {hidden.shape[-1]}, expected 3 x target_hidden_size = "
                             f"{3 * c.target_hidden_size} or hidden_size = {c.hidden_size}")
        eps = c.rms_norm_eps
        e = rms_norm(self.embed_tokens[input_ids], w[m + "input_layernorm.weight"], eps)
        hn = rms_norm(hidden, w[m + "hidden_norm.weight"], eps)
        residual = hn if c.norm_before_residual else hidden
        x = torch.cat((e, hn), dim=-1)
        T, D, Hq, Hkv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        if kv_only_off_rows and rows is not None:
            k, v = F.linear(x, self.qkv_weight[Hq * D:]).split([Hkv * D, Hkv * D], dim=-1)
            write(k.reshape(T, Hkv, D), v.reshape(T, Hkv, D))
            if rows.numel() == 0:   # no request wants logits: the K/V were all this pass had to do
                return x.new_zeros(0, c.draft_vocab_size), x.new_zeros(0, c.hidden_size)
            x, residual = x.index_select(0, rows), residual.index_select(0, rows)
            q = F.linear(x, self.qkv_weight[:Hq * D])
        else:
            q, k, v = F.linear(x, self.qkv_weight).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            write(k.reshape(T, Hkv, D), v.reshape(T, Hkv, D))
        r1 = F.linear(attention(q.reshape(x.shape[0], Hq, D)), w[m + "self_attn.o_proj.weight"]) + residual
        n = rms_norm(r1, w[m + "post_attention_layernorm.weight"], eps)
        gate, up = F.linear(n, self.gate_up_weight).chunk(2, dim=-1)
        gated = F.silu(gate) * up
        r2 = F.linear(gated, w[m + "mlp.down_proj.weight"]) + r1
        if rows is not None and not kv_only_off_rows:
            r2 = r2.index_select(0, rows)
        return F.linear(rms_norm(r2, w["norm.weight"], eps), w["lm_head.weight"]), r2


def load_eagle3_draft(path: str | Path, hidden_size: int, vocab_size: int, num_hidden_layers: int,
                      target_embed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> tuple[Eagle3Draft, tuple[int, ...]]:
    """Load an EAGLE-3 draft in the public layout from directory ``path`` (config.json and
    ``*.safetensors``: the weights of :func:`weight_shapes`, optional ``embed_tokens.weight``
    [V, H], ``d2t`` int [Vd] (target id = draft id + d2t; required when Vd < V), ``t2d`` bool [V]
    (checked against d2t when present)) and check it against the target (hidden_size H,
    vocab_size V, num_hidden_layers L).

    Returns (the draft in ``dtype`` on ``device``, the aux layer ids to capture). Raises ValueError
    naming the field or tensor: a config mismatch (:meth:`Eagle3DraftConfig.check_target`), a
    missing weight, a weight of another shape, a d2t mapping outside [0, V) or not one-to-one, a
    t2d that disagrees, no embedding (neither ``embed_tokens.weight`` nor ``target_embed``) or an
    embedding width != the draft's hidden_size; CorruptTensorError for NaN / inf weights.
    """
    path = Path(path)
    config = Eagle3DraftConfig.from_pretrained(path)
    aux_ids = config.check_target(hidden_size, vocab_size, num_hidden_layers)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model={str(path)!r}: no *.safetensors file in that directory")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raw[name] = sf.get_tensor(name)
    shapes = weight_shapes(config)
    weights = {}
    for name, shape in shapes.items():
        if name not in raw:
            raise ValueError(f"EAGLE-3 draft {path}: weight {name!r} missing")
        t = raw[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"EAGLE-3 draft {path}: weight {name!r} has shape {list(t.shape)}, expected "
                             f"{list(shape)} from config.json")
        check_finite(t, name, where=str(path))
        weights[name] = t.to(device=device, dtype=dtype)
    V, Vd = config.vocab_size, config.draft_vocab_size
    if "d2t" in raw:
        d2t = raw["d2t"]
        if d2t.dtype.is_floating_point or tuple(d2t.shape) != (Vd,):
            raise ValueError(f"EAGLE-3 draft {path}: d2t must be integers of shape [{Vd}] "
                             f"(draft_vocab_size), got {d2t.dtype} {list(d2t.shape)}")
        targets = torch.arange(Vd) + d2t.long()
    elif Vd == V:
        targets = torch.arange(Vd)
    else:
        raise ValueError(f"EAGLE-3 draft {path}: d2t missing while draft_vocab_size={Vd} < vocab_size={V}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V
                            or targets.unique().numel() != Vd):
        raise ValueError(f"EAGLE-3 draft {path}: d2t maps draft ids outside [0, {V}) (vocab_size) "
                         "or two draft ids to one target id")
    if "t2d" in raw:
        t2d = raw["t2d"]
        expect = torch.zeros(V, dtype=torch.bool)
        expect[targets] = True
        if tuple(t2d.shape) != (V,) or not torch.equal(t2d.bool(), expect):
            raise ValueError(f"EAGLE-3 draft {path}: t2d (shape {list(t2d.shape)}) is not the mask of d2t's "
                             f"target ids over vocab_size={V}")
    embed = raw.get("embed_tokens.weight", target_embed)
    if embed is None:
        raise ValueError(f"EAGLE-3 draft {path}: no embed_tokens.weight and no target embedding given")
    if tuple(embed.shape) != (V, config.hidden_size):
        raise ValueError(f"EAGLE-3 draft {path}: embed_tokens has shape {list(embed.shape)}, expected "
                         f"[{V}, {config.hidden_size}] (vocab_size, hidden_size)")
    extra = sorted(set(raw) - set(shapes) - {"d2t", "t2d", "embed_tokens.weight"})
    if extra:
        log.warning("EAGLE-3 draft %s: ignoring %d tensor(s) outside the layout: %s", path, len(extra),
                    ", ".join(extra[:5]))
    draft = Eagle3Draft(config, weights, embed.to(device=device, dtype=dtype), targets.to(device))
    return draft, aux_ids
