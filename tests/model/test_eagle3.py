"""EAGLE-3 drafts (docs/serving.md §14): the default aux layer ids, the config's parse, a synthetic
draft in the public layout written to disk (safetensors + config.json), its forward against a
hand-written reference of the draft step, and the refusal of drafts that do not fit the target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from m2serve.config.eagle3 import Eagle3DraftConfig, default_aux_layer_ids
from m2serve.config.engine_args import EngineArgs, parse_speculative_config
from m2serve.engine.core import LLMEngine
from m2serve.model.eagle3 import load_eagle3_draft

TINY_CHAT = Path(__file__).parents[2] / "src" / "m2serve" / "checkpoints" / "tiny-chat"

# target: H=16, V=40, L=8; draft: Hq=4, Hkv=2, D=6 (so Hq*D != H), I=24, Vd=10
H, V, L, HQ, HKV, D, I, VD = 16, 40, 8, 4, 2, 6, 24, 10
IDS = "eagle_aux_hidden_state_layer_ids"


def _config(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "intermediate_size": I,
           "vocab_size": V, "draft_vocab_size": VD, "num_hidden_layers": 1, "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 500.0, "max_position_embeddings": 256,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}
    cfg.update(over)
    return cfg


def _weights(seed: int = 0, d2t: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    m = "midlayer."
    w = {"fc.weight": r(H, 3 * H), m + "input_layernorm.weight": 1 + r(H), m + "hidden_norm.weight": 1 + r(H),
         m + "self_attn.q_proj.weight": r(HQ * D, 2 * H), m + "self_attn.k_proj.weight": r(HKV * D, 2 * H),
         m + "self_attn.v_proj.weight": r(HKV * D, 2 * H), m + "self_attn.o_proj.weight": r(H, HQ * D),
         m + "post_attention_layernorm.weight": 1 + r(H), m + "mlp.gate_proj.weight": r(I, H),
         m + "mlp.up_proj.weight": r(I, H), m + "mlp.down_proj.weight": r(H, I), "norm.weight": 1 + r(H),
         "lm_head.weight": r(VD, H), "embed_tokens.weight": r(V, H, scale=1.0)}
    targets = torch.randperm(V, generator=g)[:VD].sort().values
    w["d2t"] = targets - torch.arange(VD) if d2t is None else d2t
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(VD) + w["d2t"]] = True
    w["t2d"] = t2d
    return w


def _write(path: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def _reference(w: dict, ids: torch.Tensor, pos: torch.Tensor, aux: torch.Tensor, eps: float, theta: float,
               norm_before_residual: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 draft step written out by hand in float64 (vLLM llama_eagle3 order): per-head
    loops, an explicit causal mask, RoPE as complex rotation of (x_j, x_{j+D/2}) pairs."""
    w = {k: v.double() for k, v in w.items()}
    m = "midlayer."

    def norm(x, g):
        return g * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x, p):   # x [D]
        half = D // 2
        freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
        z = torch.complex(x[:half], x[half:]) * torch.exp(1j * p * freq)
        return torch.cat((z.real, z.imag))

    T = ids.shape[0]
    h = aux.double() @ w["fc.weight"].T
    hn = norm(h, w[m + "hidden_norm.weight"])
    res = hn if norm_before_residual else h
    x = torch.cat((norm(w["embed_tokens.weight"][ids], w[m + "input_layernorm.weight"]), hn), -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(T, HQ, D)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(T, HKV, D)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(T, HKV, D)
    out = torch.zeros(T, HQ, D, dtype=torch.float64)
    for t in range(T):
        for hq in range(HQ):
            kv = hq // (HQ // HKV)
            qr = rope(q[t, hq], float(pos[t]))
            s = torch.tensor([qr @ rope(k[u, kv], float(pos[u])) / math.sqrt(D) for u in range(t + 1)])
            out[t, hq] = torch.softmax(s, 0) @ v[: t + 1, kv]
    r1 = out.reshape(T, HQ * D) @ w[m + "self_attn.o_proj.weight"].T + res
    n = norm(r1, w[m + "post_attention_layernorm.weight"])
    gate = n @ w[m + "mlp.gate_proj.weight"].T
    up = n @ w[m + "mlp.up_proj.weight"].T
    r2 = (gate * torch.sigmoid(gate) * up) @ w[m + "mlp.down_proj.weight"].T + r1
    dl = norm(r2, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((T, V), float("-inf"), dtype=torch.float64)
    for d in range(VD):
        logits[:, d + int(w["d2t"][d])] = dl[:, d]
    return logits, r2


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(62) == (2, 31, 59)   # MiniMax-M2: vLLM's (2, L/2, L-3)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    assert default_aux_layer_ids(7) == (2, 3, 4)
    assert default_aux_layer_ids(6) == (1, 3, 4)      # (2, 3, 3) collides: quartiles
    assert default_aux_layer_ids(4) == (1, 2, 3)      # tiny-chat: (2, 2, 1) collides
    assert default_aux_layer_ids(3) == (0, 1, 2)
    for n in range(3, 100):
        ids = default_aux_layer_ids(n)
        assert 0 <= ids[0] < ids[1] < ids[2] < n
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        default_aux_layer_ids(2)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_synthetic_draft_loads_and_matches_the_reference(tmp_path, norm_before_residual):
    w = _weights()
    path = _write(tmp_path / "draft", _config(norm_before_residual=norm_before_residual), w)
    draft, aux_ids = load_eagle3_draft(path, hidden_size=H, vocab_size=V, num_hidden_layers=L)
    assert aux_ids == (1, 4, 6)
    g = torch.Generator().manual_seed(1)
    T = 7
    ids = torch.randint(0, V, (T,), generator=g)
    pos = torch.arange(5, 5 + T)
    aux = torch.randn(T, 3 * H, generator=g)
    logits, prenorm = draft(ids, pos, aux)
    ref_logits, ref_prenorm = _reference(w, ids, pos, aux, 1e-5, 500.0, norm_before_residual)
    assert logits.shape == (T, V) and logits.dtype == torch.float32
    on = torch.isfinite(ref_logits)
    assert on.sum() == T * VD and torch.equal(torch.isfinite(logits), on)   # -inf off the draft vocabulary
    torch.testing.assert_close(logits[on].double(), ref_logits[on], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prenorm.double(), ref_prenorm, rtol=1e-4, atol=1e-4)
    # the second draft pass takes the draft's own pre-norm output ([T, H]): no fc
    logits2, _ = draft(ids, pos, prenorm)
    assert torch.isfinite(logits2).sum() == T * VD


def test_draft_without_layer_ids_or_embedding_uses_the_defaults_and_the_targets(tmp_path):
    w = _weights()
    embed = w.pop("embed_tokens.weight")
    cfg = _config()
    del cfg["eagle_config"]
    path = _write(tmp_path / "d", cfg, w)
    with pytest.raises(ValueError, match="no embed_tokens.weight"):
        load_eagle3_draft(path, H, V, L)
    draft, aux_ids = load_eagle3_draft(path, H, V, L, target_embed=embed)
    assert aux_ids == default_aux_layer_ids(L)
    assert torch.equal(draft.embed_tokens, embed)


@pytest.mark.parametrize("cfg, weights, target, field", [
    ({}, {}, dict(hidden_size=32), "hidden_size=16"),
    ({"target_hidden_size": 32}, {"fc.weight": torch.zeros(H, 96)}, {}, "target_hidden_size=32"),
    ({}, {}, dict(vocab_size=50), "vocab_size=40"),
    ({"eagle_config": {IDS: [1, 4, 8]}}, {}, {}, IDS),   # L = 8: out of range
    ({"eagle_config": {IDS: [1, 4, 4]}}, {}, {}, IDS),   # repeated
    ({"eagle_config": {IDS: [1, 4]}}, {}, {}, IDS),      # two ids
    ({"num_hidden_layers": 2}, {}, {}, "num_hidden_layers=2"),
    ({"draft_vocab_size": 41}, {}, {}, "draft_vocab_size=41"),
    ({}, {"midlayer.self_attn.q_proj.weight": torch.zeros(HQ * D, H)}, {}, "q_proj.weight"),
    ({}, {"lm_head.weight": None}, {}, "lm_head.weight"),
    ({}, {"d2t": torch.full((VD,), V, dtype=torch.long)}, {}, "d2t"),
    ({}, {"t2d": torch.ones(V, dtype=torch.bool)}, {}, "t2d"),
    ({}, {"embed_tokens.weight": torch.zeros(V, 8)}, {}, "embed_tokens"),
])
def test_mismatched_drafts_are_refused_naming_the_field(tmp_path, cfg, weights, target, field):
    w = _weights()
    for k, v in weights.items():
        if v is None:
            del w[k]
        else:
            w[k] = v
    path = _write(tmp_path / "d", _config(**cfg), w)
    t = dict(hidden_size=H, vocab_size=V, num_hidden_layers=L) | target
    with pytest.raises(ValueError, match=field):
        load_eagle3_draft(path, **t)


def test_config_parse_for_eagle3(tmp_path):
    path = _write(tmp_path / "d", _config(), _weights())
    c = parse_speculative_config({"method": "eagle3", "model": str(path), "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle3", str(path), 3)
    assert c.prompt_lookup_min is None and c.prompt_lookup_max is None
    assert parse_speculative_config(c) == c
    assert c.describe() == f"eagle3 k=3 draft {path}"
    for value, field in [({"method": "eagle3", "num_speculative_tokens": 3}, "speculative_config.model"),
                         ({"method": "eagle3", "model": str(tmp_path / "none"), "num_speculative_tokens": 3},
                          "speculative_config.model="),
                         ({"method": "eagle3", "model": str(path), "num_speculative_tokens": 3,
                           "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
                         ({"method": "ngram", "model": str(path), "num_speculative_tokens": 3},
                          "speculative_config.model")]:
        with pytest.raises(ValueError, match=field):
            parse_speculative_config(value)
    assert Eagle3DraftConfig.from_pretrained(path).draft_vocab_size == VD


def test_engine_refuses_a_mismatched_draft_before_loading_and_a_multi_rank_deployment(tmp_path, monkeypatch):
    target = json.loads((TINY_CHAT / "config.json").read_text())
    Ht, Vt = target["hidden_size"], target["vocab_size"]
    good = _write(tmp_path / "good", _config(hidden_size=Ht, vocab_size=Vt, head_dim=Ht // HQ,
                                             eagle_config={}), {})
    bad = _write(tmp_path / "bad", _config(hidden_size=Ht, vocab_size=Vt + 1, eagle_config={}), {})
    spec = {"method": "eagle3", "num_speculative_tokens": 2}

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the draft was refused")

    monkeypatch.setattr("m2serve.engine.core.load_model", no_load)
    monkeypatch.setattr("m2serve.engine.core.start_distributed_model", no_load)
    with pytest.raises(ValueError, match="vocab_size"):
        LLMEngine.from_args(EngineArgs(model=str(TINY_CHAT), speculative_config=spec | {"model": str(bad)}))
    with pytest.raises(ValueError, match="2 ranks"):
        LLMEngine.from_args(EngineArgs(model=str(TINY_CHAT), devices="cpu:2", num_kv_pages=8,
                                       speculative_config=spec | {"model": str(good)}))


def test_paged_draft_forward_equals_the_unpaged_forward(tmp_path):
    """forward_paged (the engine's: K/V in a layer of the paged pool, two requests in one ragged
    batch, a chunk after cached positions) gives forward's logits and hidden states (forward is
    checked against the float64 hand reference above)."""
    from m2serve.model.batch import KVStorage, ragged_batch
    from m2serve.model.step import RopeCache

    w = _weights(seed=2)
    draft, _ = load_eagle3_draft(_write(tmp_path / "d", _config(), w), hidden_size=H, vocab_size=V,
                                 num_hidden_layers=L)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (9, 6)]
    auxs = [torch.randn(n, 3 * H, generator=g) for n in (9, 6)]
    kv = KVStorage.allocate(2, 16, 4, HKV, D, torch.float32)   # layer 1: the draft's
    rope = RopeCache(D, 500.0)
    tables = [[3, 7, 1], [5, 2]]
    cut = [5, 2]   # first pass: positions [0, cut), second: [cut, n)
    for first in (True, False):
        spans = [(0, c) if first else (c, len(s)) for s, c in zip(seqs, cut)]
        batch = ragged_batch([s[a:b].tolist() for s, (a, b) in zip(seqs, spans)], [b for _, b in spans],
                             tables, [b - a for a, b in spans], 4)
        hidden = torch.cat([x[a:b] for x, (a, b) in zip(auxs, spans)])
        logits, r2 = draft.forward_paged(batch, hidden, kv, 1, rope)
        o = 0
        for s, x, (a, b) in zip(seqs, auxs, spans):
            ref_logits, ref_r2 = draft(s[:b], torch.arange(b), x[:b])
            torch.testing.assert_close(r2[o:o + b - a], ref_r2[a:b], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logits[o:o + b - a], ref_logits[a:b][:, draft.draft_to_target],
                                       rtol=1e-5, atol=1e-5)
            o += b - a


def test_paged_draft_forward_computing_kv_only_off_the_logit_rows(tmp_path):
    """forward_paged with ``kv_only_off_rows`` (a prompt chunk: K/V for every row, the rest at the
    logit rows only, through a query batch of those rows): the logit rows' logits and hidden states
    are forward's, the pool holds forward's K/V for every row (read back against a full paged pass
    into a second pool), and a pass with no logit row writes the K/V alone."""
    from m2serve.model.batch import KVStorage, ragged_batch
    from m2serve.model.step import RopeCache

    w = _weights(seed=4)
    draft, _ = load_eagle3_draft(_write(tmp_path / "d", _config(), w), hidden_size=H, vocab_size=V,
                                 num_hidden_layers=L)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (11, 7, 8)]
    auxs = [torch.randn(n, 3 * H, generator=g) for n in (11, 7, 8)]
    rope = RopeCache(D, 500.0)
    tables = [[3, 7, 1], [5, 2], [0, 4]]
    split, full = (KVStorage.allocate(2, 16, 4, HKV, D, torch.float32) for _ in range(2))
    for spans, want in (([(0, 6), (0, 3), (0, 8)], [0, 0, 0]), ([(6, 11), (3, 7), (8, 8)], [1, 1, 0])):
        new = [s[a:b].tolist() for s, (a, b) in zip(seqs, spans)]
        ctx = [b for _, b in spans]
        keep = [i for i, n in enumerate(want) if n]
        hidden = torch.cat([x[a:b] for x, (a, b) in zip(auxs, spans)])
        query = ragged_batch([new[i][-1:] for i in keep], [ctx[i] for i in keep], [tables[i] for i in keep],
                             [1] * len(keep), 4) if keep else None
        logits, r2 = draft.forward_paged(ragged_batch(new, ctx, tables, want, 4), hidden, split, 1, rope,
                                         query=query, kv_only_off_rows=True)
        every = ragged_batch(new, ctx, tables, [b - a for a, b in spans], 4)
        draft.forward_paged(every, hidden, full, 1, rope)
        assert logits.shape == (len(keep), draft.config.draft_vocab_size) and r2.shape == (len(keep), H)
        for o, i in enumerate(keep):
            b = spans[i][1]
            ref_logits, ref_r2 = draft(seqs[i][:b], torch.arange(b), auxs[i][:b])
            torch.testing.assert_close(r2[o], ref_r2[b - 1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logits[o], ref_logits[b - 1][draft.draft_to_target],
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(split.k[1], full.k[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(split.v[1], full.v[1], rtol=1e-5, atol=1e-6)
    assert full.k[1].abs().sum() > 0
    one = ragged_batch([seqs[0][:3].tolist()], [3], tables[:1], [1], 4)
    with pytest.raises(ValueError, match="needs their query batch"):
        draft.forward_paged(one, auxs[0][:3], split, 1, rope, kv_only_off_rows=True)
    with pytest.raises(ValueError, match="needs kv_only_off_rows"):
        draft.forward_paged(one, auxs[0][:3], split, 1, rope, query=one)


def test_target_aux_hidden_states_are_transformers_hidden_states(tmp_path):
    """Id i = the residual stream entering layer i = transformers' ``hidden_states[i]``
    (output_hidden_states: the embedding output, then each layer's), from the same forward."""
    import transformers

    from m2serve.checkpoints.tiny_random import build_tiny_random
    from m2serve.model.load import load_model
    from m2serve.model.simple_cache import SimpleKVCache

    path = build_tiny_random(tmp_path / "t4", seed=3, num_hidden_layers=4)
    ours = load_model(path, dtype=torch.float32)
    ref = transformers.MiniMaxM2ForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()
    with pytest.raises(ValueError, match="aux_layer_ids"):
        ours.set_aux_layer_ids((1, 4, 2))
    ids = (3, 0, 1)   # out of order, the embedding included: blocks follow the ids
    ours.set_aux_layer_ids(ids)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    cache = SimpleKVCache.create(ours.config, num_pages=16, page_size=4)
    logits = ours(cache.batch(list(enumerate(prompts)), return_n_logits=10**6), cache.storage)
    with torch.no_grad():
        outs = [ref(torch.tensor([p]), output_hidden_states=True) for p in prompts]
    expect = torch.cat([torch.cat([o.hidden_states[i][0] for i in ids], -1) for o in outs])
    assert ours.aux_hidden.shape == (14, 3 * ours.config.hidden_size)
    torch.testing.assert_close(ours.aux_hidden, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, torch.cat([o.logits[0] for o in outs]), rtol=1e-4, atol=1e-4)
    assert default_aux_layer_ids(4) == (1, 2, 3)
