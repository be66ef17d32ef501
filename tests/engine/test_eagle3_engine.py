"""EAGLE-3 drafts run by the engine (issue 35, docs/serving.md §14) on the tiny-chat checkpoint.

References, none of them our own earlier output: (1) the engine's proposals against the draft run
by hand over the whole sequence (model/eagle3.py ``Eagle3Draft.forward``, itself checked against a
float64 hand-written draft step in tests/model/test_eagle3.py) on the target's aux hidden states
from one plain forward; (2) greedy output against plain decoding (speculation off, whose own
correctness tests/checkpoints/test_tiny_chat.py checks against transformers), 200 held-out prompts
at batch 1 and 16, fp32 compute and KV cache; (3) sampled output against the target's exact
distribution of the first three tokens, computed by plain forwards with temperature and top-k
applied by hand, by a chi-square test; (4) the rejection rule's own hand-derived cases are in
tests/engine/test_speculative.py. The drafts are synthetic, in the public layout, written here: a
random one (disagrees with the target) and a "skip" one (the target's last layer skipped: its
input hidden state through the target's norm and tied head, plus noise), which agrees often
enough that the tests also see drafts accepted, so they cannot pass with speculation off.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.tiny_chat import data  # noqa: E402

from m2serve.config.eagle3 import Eagle3DraftConfig  # noqa: E402
from m2serve.engine.sampling import SamplingParams  # noqa: E402
from m2serve.model.eagle3 import load_eagle3_draft, weight_shapes  # noqa: E402
from m2serve.model.load import load_model  # noqa: E402
from m2serve.model.simple_cache import SimpleKVCache  # noqa: E402
from m2serve.serve import chat_pipeline as cp  # noqa: E402
from m2serve.serve.llm import LLM  # noqa: E402

CKPT = REPO / "src/m2serve/checkpoints/tiny-chat"
H, V, HQ, HKV, D, I = 256, 1536, 4, 2, 32, 128   # tiny-chat's H and V; the draft's own dims
K = 3


def write_draft(path: Path, kind: str, seed: int = 0, noise: float = 0.02,
                vocab: list[int] | None = None, head_scale: float = 1.0) -> Path:
    """A draft in the public layout for tiny-chat: ``random`` (draft vocabulary ``vocab``, default
    512 random ids, through d2t; lm_head entries of std ``head_scale``) or ``skip`` (full
    vocabulary; fc picks the third aux block, the input of tiny-chat's last
    layer, attention and MLP add zero, norm and head are the target's plus ``noise``)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    m = "midlayer."
    Vd = (512 if vocab is None else len(vocab)) if kind == "random" else V
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "num_attention_heads": HQ,
           "num_key_value_heads": HKV, "head_dim": D, "intermediate_size": I, "vocab_size": V,
           "draft_vocab_size": Vd, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    # the layout's shapes (model/eagle3.py; tests/model/test_eagle3.py writes them out by hand)
    w = {name: 1 + r(*shape) if name.endswith("norm.weight") else r(*shape)
         for name, shape in weight_shapes(Eagle3DraftConfig.from_dict(cfg)).items()}
    if kind == "random":
        w["lm_head.weight"] = r(Vd, H, scale=head_scale)
        ids = torch.randperm(V, generator=g)[:Vd] if vocab is None else torch.tensor(vocab)
        w["d2t"] = ids.sort().values - torch.arange(Vd)
    else:
        with safe_open(str(CKPT / "model.safetensors"), "pt") as f:
            embed = f.get_tensor("model.embed_tokens.weight").float()
            norm = f.get_tensor("model.norm.weight").float()
        w["fc.weight"] = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1)
        w[m + "self_attn.o_proj.weight"].zero_()
        w[m + "mlp.down_proj.weight"].zero_()
        w["norm.weight"] = norm
        w["lm_head.weight"] = embed + r(V, H, scale=noise)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def _spec(path: Path, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


def _llm(batch: int, spec) -> LLM:
    return LLM(str(CKPT), dtype="float32", kv_cache_format="float32", max_batch_size=batch,
               num_kv_pages=128, speculative_config=spec)


# ---- the engine's proposals are the draft's -------------------------------------------------------
def _by_hand(model, draft, seq: list[int], k: int) -> list[int]:
    """Greedy drafting over the whole sequence: the target's aux states of positions [0, N - 1)
    from one plain forward, draft input at i = (token i + 1, fc(aux i)), then k passes, each
    appending the drafted token with the draft's own last hidden state."""
    cache = SimpleKVCache.create(model.config, num_pages=32, page_size=16)
    model(cache.batch([(0, seq[:-1])], return_n_logits=1), cache.storage)
    h = draft.combine(model.aux_hidden)
    t = torch.tensor(seq[1:])
    out = []
    for _ in range(k):
        logits, r2 = draft(t, torch.arange(len(t)), h)
        d = int(logits[-1].argmax())
        out.append(d)
        h = torch.cat([h, r2[-1:]])
        t = torch.cat([t, torch.tensor([d])])
    return out


@pytest.mark.parametrize("kind", ["random", "skip"])
def test_engine_proposals_are_the_draft_run_by_hand(tmp_path, kind):
    path = write_draft(tmp_path / kind, kind)
    llm = _llm(4, _spec(path))
    eng = llm.engine
    model = load_model(CKPT, dtype=torch.float32)
    draft, aux_ids = load_eagle3_draft(path, H, V, model.config.num_hidden_layers,
                                       model.model.embed_tokens.weight)
    model.set_aux_layer_ids(aux_ids)
    prompts = [[1, 5, 9, 33, 100, 7, 8, 200, 300, 12, 40, 41, 42, 43, 44, 45, 46, 47], [4, 4, 4, 5, 6, 70]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for r in list(eng.requests.values()):
            if r.draft_proposal is not None:
                assert r.draft_proposal.tokens == _by_hand(model, draft, r.all_token_ids, K), r.request_id
                assert r.draft_proposal.probs is None   # all greedy: the identity rule needs no q
                checked += 1
    assert checked >= 6 and eng.stats.spec_draft_tokens > 0


# ---- greedy identity with plain decoding ----------------------------------------------------------
def _generate(llm: LLM, examples: list[data.Example], max_tokens: int) -> list[tuple]:
    ctx = cp.TextContext.of(llm)
    accs = {}
    for i, ex in enumerate(examples):
        job = cp.ChatJob(list(ex.prompt_messages), ex.tools or None,
                         params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
        prepared = cp.prepare_blocking(ctx, job)
        [r] = cp.engine_requests(ctx, f"q{i}", [prepared.ids], prepared.params, prepared.new_parser)
        llm.add_request(r.request_id, r.prompt_token_ids, r.params, r.processor, r.constraint)
        accs[r.request_id] = cp.ChoiceAccumulator(0)
    while llm.has_unfinished_requests():
        for d in llm.step():
            accs[d.request_id].add(d)
    return [(list(x.token_ids), x.text, x.finish_reason) for x in (a.result() for a in accs.values())]


def _check_identity(tmp_path: Path, examples: list[data.Example], batch: int, max_tokens: int) -> None:
    plain = _generate(_llm(batch, None), examples, max_tokens)
    llm = _llm(batch, _spec(write_draft(tmp_path / "skip", "skip")))
    spec = _generate(llm, examples, max_tokens)
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert a == b, f"prompt {i} ({examples[i].kind}): plain {a[1]!r} != eagle3 {b[1]!r}"
    stats = llm.engine.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, "drafts never or always accepted"


def test_greedy_eagle3_equals_plain_one_prompt_per_kind(tmp_path):
    _check_identity(tmp_path, [ex for kind in data.KINDS for ex in data.eval_subset(kind, 1, seed=35)], 4, 48)


def _held_out_200() -> list[data.Example]:
    per = -(-200 // len(data.KINDS))
    return [ex for kind in data.KINDS for ex in data.eval_subset(kind, per, seed=34)][:200]


@pytest.mark.slow  # 200 prompts x 2 decodes, 16 tokens: 79 s at batch 1, 46 s at 16 (2 cores, load 2-3)
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_eagle3_equals_plain_on_200_held_out_prompts(tmp_path, batch):
    _check_identity(tmp_path, _held_out_200(), batch, 16)


# ---- sampled output follows the target's distribution ---------------------------------------------
TEMP, TOP_K, SAMPLES = 8.0, 3, 1200
CHI_PROMPT = [7, 300, 41, 1200, 88, 5, 960, 17, 402, 33]
OFF_SUPPORT = [2, 3, 500, 501, 900, 1400]   # draft tokens the target's top-k never allows here


def _exact_joint(model, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3) of plain sampling at TEMP with top-k TOP_K, by hand from plain forwards: each
    position's logits / TEMP, the TOP_K largest kept, softmax; the product along the path."""
    def dist(seq: list[int]) -> dict[int, float]:
        cache = SimpleKVCache.create(model.config, num_pages=8, page_size=16)
        logits = model(cache.batch([(0, seq)], return_n_logits=1), cache.storage)[0].double() / TEMP
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, 0).tolist()))

    joint = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
    return joint


def _chi_square_p(observed: dict, expected: dict, n: int) -> float:
    """p-value of Pearson's chi-square (cells with expectation < 5 pooled; scipy's chi2 tail)."""
    from scipy.stats import chi2

    cells = sorted(expected, key=expected.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:
        e = expected[c] * n
        if e >= 5:
            obs.append(observed.get(c, 0))
            exp.append(e)
        else:
            pool_o, pool_e = pool_o + observed.get(c, 0), pool_e + e
    if pool_e > 0:
        obs.append(pool_o + sum(v for c, v in observed.items() if c not in expected))
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, len(exp) - 1))


@pytest.mark.slow  # 12 s on 2 cores (1,200 requests); in the default suite
def test_sampled_eagle3_follows_the_target_distribution(tmp_path):
    """SAMPLES seeded requests of 4 tokens (so K = 2 drafts are verified at positions 2-3 in one
    step); the first three tokens' counts against the exact joint (27 cells). The draft disagrees
    on purpose: its vocabulary is the target's possible second and third tokens plus OFF_SUPPORT
    (drafts the rule must always reject), its head random (q far from p, so the residual matters:
    resampling from p instead, or accepting every draft, fails this test)."""
    model = load_model(CKPT, dtype=torch.float32)
    expected = _exact_joint(model, CHI_PROMPT)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-9)
    support = sorted({t for cell in expected for t in cell[1:]} | set(OFF_SUPPORT))
    path = write_draft(tmp_path / "disagree", "random", seed=5, vocab=support, head_scale=2.0)
    llm = _llm(64, _spec(path, 2))
    eng = llm.engine
    for i in range(SAMPLES):
        eng.add_request(f"s{i}", CHI_PROMPT, SamplingParams(temperature=TEMP, top_k=TOP_K, top_p=1.0,
                                                            max_tokens=4, seed=i, ignore_eos=True))
    toks: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    counts: dict[tuple, int] = {}
    for t in toks.values():
        counts[tuple(t[:3])] = counts.get(tuple(t[:3]), 0) + 1
    st = eng.stats
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, "the test needs acceptances and rejections"
    assert set(counts) <= set(expected), "a token outside the target's top-k was emitted"
    p = _chi_square_p(counts, expected, SAMPLES)
    assert p > 1e-3, f"chi-square p = {p:.2e}: counts {counts} vs expected {expected}"


def test_the_pool_and_the_plan_hold_the_drafts_layer_and_sampled_features_run(tmp_path):
    """One more K/V layer of the draft's shape (2 x Hkv x D x 4 bytes per token in the plan); sampled
    requests with penalties, logprobs and min_tokens run with drafts, each logprobs entry naming its
    token (the rejection path's entries: log p of the emitted token)."""
    from m2serve.config.engine_args import EngineArgs, parse_speculative_config
    from m2serve.engine.planner import draft_kv_bytes_per_token

    path = write_draft(tmp_path / "skip", "skip")
    spec = _spec(path)
    assert parse_speculative_config(spec).describe().startswith("eagle3 k=3 draft ")
    with_draft = EngineArgs(model=str(CKPT), speculative_config=spec)
    assert draft_kv_bytes_per_token(with_draft, 4) == 2 * HKV * D * 4
    assert draft_kv_bytes_per_token(EngineArgs(model=str(CKPT)), 4) == 0
    eng = _llm(8, spec).engine
    kv = eng.runner.kv_storage
    L = eng.config.num_hidden_layers
    assert len(kv.k) == L + 1 and kv.k[L].shape == (kv.num_pages, kv.page_size, HKV, D)
    for i in range(4):
        eng.add_request(f"p{i}", [7, 300, 41, 1200, 88, 5, 960, 17, 402, 33][i:],
                        SamplingParams(temperature=1.5, top_k=5, repetition_penalty=1.2,
                                       frequency_penalty=0.3, logprobs=2, min_tokens=4, max_tokens=16,
                                       seed=i, ignore_eos=True))
    toks: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.new_logprobs)
    assert eng.stats.spec_drafts > 0
    for rid, t in toks.items():
        assert len(t) == 16 and [e.token_id for e in lps[rid]] == t
        bad = [e for e in lps[rid] if not (e.logprob <= 0 and 1 <= len(e.top) <= 2)]   # -inf not listed
        assert not bad, bad


def test_a_draft_named_by_hub_id_resolves_through_the_hf_cache(tmp_path, monkeypatch):
    """``"model": "org/name"`` (issue 35 item 1, docs/serving.md §14): resolved by LLM to its snapshot in
    a fake Hugging Face cache (the hub's models--org--name/snapshots/<rev> + refs/main layout, offline,
    no network), then the same greedy tokens as plain decoding with drafts accepted; a hub id in no
    cache is refused naming speculative_config.model, by LLM and by the CLI's check before loading."""
    import huggingface_hub
    import huggingface_hub.constants

    from m2serve.config.engine_args import parse_speculative_config
    from m2serve.serve.cli import build_parser, check_engine_options, resolve_options, run_plan
    from m2serve.serve.resolve import ModelNotFoundError, resolve_engine_args

    repo = tmp_path / "hf" / "models--test-org--draft"
    snap = repo / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    for f in (REPO / "src/m2serve/checkpoints/tiny-chat-eagle3").iterdir():   # the shipped, trained draft
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = {"method": "eagle3", "model": "test-org/draft", "num_speculative_tokens": K}
    assert parse_speculative_config(hub).model == "test-org/draft"   # the shape is accepted below serve
    examples = [data.eval_subset(kind, 1, seed=35)[0] for kind in ("tool_result", "plain")]
    plain = _generate(_llm(2, None), examples, 24)
    llm = _llm(2, hub)
    assert Path(llm.engine.speculative.model).resolve() == snap.resolve()
    assert _generate(llm, examples, 24) == plain
    assert llm.engine.stats.spec_accepted_tokens > 0
    d = llm.engine.drafter   # every pass's metadata went through its persistent buffers, once
    assert d.buffers.loads == d.passes > 0
    assert 0 < d.query_buffers.loads < d.passes   # prompt passes: K/V-only rows, a query batch of last rows
    monkeypatch.setenv("HOME", str(tmp_path))
    tilde = "~/" + str(snap.relative_to(tmp_path))
    home = resolve_engine_args({"speculative_config": {**hub, "model": tilde}})["speculative_config"]
    assert home["model"] == str(snap)   # ~ expanded before the engine sees it
    assert parse_speculative_config({**hub, "model": tilde}).model == str(snap)   # and by the parser

    absent = {**hub, "model": "test-org/absent"}
    with pytest.raises(ModelNotFoundError,
                       match=r"speculative_config\.model 'test-org/absent'.*HF_HUB_OFFLINE"):
        _llm(1, absent)
    parser = build_parser()
    opts = resolve_options(parser.parse_args(["serve", "--model", str(CKPT), "--speculative-config",
                                              json.dumps(absent)]), parser, {})
    problem = check_engine_options("serve", opts)
    assert problem is not None and problem.startswith("--speculative-config: speculative_config.model "
                                                      "'test-org/absent'")
    opts["speculative_config"] = json.dumps({**hub, "model": str(CKPT)})   # the target given as its own draft
    problem = check_engine_options("serve", opts)   # before the port binds: a usage error naming the flag
    assert problem is not None and problem.startswith("--speculative-config: ")
    assert "num_hidden_layers" in problem
    with pytest.raises(ValueError, match=r"speculative_config\.model='a/b/c': not a directory"):
        parse_speculative_config({**hub, "model": "a/b/c"})   # a path that does not exist, not a hub id
    fetched = []   # `m2serve plan` fetches the draft's config.json alone (a stand-in hub records the call)

    def snapshot_download(repo_id, **kw):
        fetched.append((repo_id, kw.get("allow_patterns")))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    opts["speculative_config"] = json.dumps(hub)
    assert check_engine_options("plan", opts) is None and run_plan(opts) == 0
    assert fetched == [("test-org/draft", ["config.json"])] * 2


def test_greedy_eagle3_equals_plain_through_preemption(tmp_path):
    """A pool too small for the batch: requests are preempted and recomputed (their proposals
    dropped, the draft's K/V recomputed with the target's); tokens still equal plain decoding's."""
    prompts = [[7, 300, 41, 1200, 88, 5, 960, 17, 402, 33][i:] + [i + 1] * 20 for i in range(6)]

    def run(spec):
        llm = LLM(str(CKPT), dtype="float32", kv_cache_format="float32", max_batch_size=6,
                  num_kv_pages=9, kv_cache_page_size=16, speculative_config=spec)
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        toks: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        return toks, eng.stats

    plain, _ = run(None)
    spec, st = run(_spec(write_draft(tmp_path / "skip", "skip")))
    assert st.preemptions > 0 and st.spec_draft_tokens > 0
    assert spec == plain


def test_target_probs_is_the_distribution_written_by_hand():
    """engine/sampling.py target_probs (the rejection rule's p) on a toy row: logits / T, the top-k
    kept, softmax; with logit_bias first; a greedy row one-hot at its argmax."""
    from m2serve.engine.sampling import SamplingRows, SamplingState

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5], [0.0, 1.0, 4.0, 2.0, 3.0]])
    states = [SamplingState(SamplingParams(temperature=2.0, top_k=3, top_p=1.0, logit_bias={0: 2.5}), seed=1),
              SamplingState(SamplingParams(temperature=0.0, top_k=0, top_p=1.0), seed=2)]
    rows = SamplingRows.of(["a", "b"], states, [0, 0], [False, False], None, 5)
    p = rows.probs(logits)
    # row 0: biased logits [3.5, 3, 2, 0.5, 2.5] / 2 -> top 3 are ids 0, 1, 4: e^1.75, e^1.5, e^1.25
    w = [math.exp(1.75), math.exp(1.5), 0.0, 0.0, math.exp(1.25)]
    torch.testing.assert_close(p[0], torch.tensor([x / sum(w) for x in w]))
    torch.testing.assert_close(p[1], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(rows.probs(logits, log=True).exp(), p)


def test_batched_rejection_rule_equals_the_per_request_rule():
    """rejection_sample_batched (the engine's) against rejection_sample (the rule step by step, whose
    hand-derived cases are in tests/engine/test_speculative.py): random p, q (some q = p rows, some
    one-hot), drafts drawn from q, padded requests of fewer drafts, the same uniforms."""
    from m2serve.engine.speculative import rejection_sample, rejection_sample_batched

    g = torch.Generator().manual_seed(7)
    B, K, V = 64, 4, 6
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    q[::5] = p[::5, :K]                                                         # q = p: all accepted
    q[1::7] = torch.nn.functional.one_hot(q[1::7].argmax(-1), V).float()       # a greedy-like draft
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    nd = torch.randint(1, K + 1, (B,), generator=g)
    ua, ur = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    a, tok = rejection_sample_batched(drafts, nd, q, p, ua, ur)
    seen = set()
    for b in range(B):
        k = int(nd[b])
        ref = rejection_sample(drafts[b, :k].tolist(), q[b, :k], p[b, :k + 1], ua[b, :k].tolist(),
                               ur[b, :k + 1].tolist())
        got = drafts[b, :int(a[b])].tolist() + [int(tok[b])]
        assert got == ref, b
        seen.add(int(a[b]) == k)
    assert seen == {True, False}   # both all-accepted and rejected rows
