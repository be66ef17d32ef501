"""Logit parity with transformers' native MiniMaxM2ForCausalLM (docs/model.md §6 oracle rule).

Oracle: transformers 5.23 loaded in float32 from the same directory. Tolerance (docs/model.md §6):
|Δlogit| <= 1e-4 * max(1, |logit|) elementwise. Prefill: several prompts of different lengths
in ONE ragged call, logits of every position; then 16 decode steps through our paged cache,
teacher-forced with transformers' greedy tokens, compared at every step.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers  # a test extra (pyproject.toml): missing, the oracle tests fail, not skip

from m2serve.checkpoints.tiny_random import build_tiny_random
from m2serve.model.load import load_model
from m2serve.model.simple_cache import SimpleKVCache

pytestmark = pytest.mark.slow  # transformers oracle runs over every format and step


PROMPT_LENS = (5, 11, 23)
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def second_config_dir(tmp_path_factory):
    """Other dims: odd layer count (3), 6:1 head ratio, rotary_dim = head_dim / 2, 6 experts top-3."""
    return build_tiny_random(tmp_path_factory.mktemp("second") / "ckpt", seed=7, hidden_size=384,
                             num_attention_heads=12, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                             intermediate_size=192, num_local_experts=6, num_experts_per_tok=3,
                             num_hidden_layers=3)


def _hf(path):
    # FP8 directories: transformers dequantises at load; unquantised tensors stay bf16 -> .float()
    model = transformers.MiniMaxM2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.float().eval()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * torch.clamp(ref.abs(), min=1.0)
    err = (ours - ref).abs()
    assert bool((err <= tol).all()), \
        f"max |Δlogit| {err.max().item():.3g} (max |logit| {ref.abs().max():.3g})"


def _check_parity(path, page_size: int = 4) -> None:
    ours = load_model(path, dtype=torch.float32)
    ref = _hf(path)
    vocab = ours.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
    cache = SimpleKVCache.create(ours.config, num_pages=64, page_size=page_size)
    rng.shuffle(cache.free_pages)  # pages out of order: the block tables must be honoured

    # one ragged prefill call, logits for every prompt position (prompt logprobs)
    batch = cache.batch([(i, p) for i, p in enumerate(prompts)], return_n_logits=10**6)
    logits = ours(batch, cache.storage)
    assert logits.dtype == torch.float32 and logits.shape == (sum(PROMPT_LENS), vocab)
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        refs = [ref(torch.tensor([p])).logits[0].float() for p in prompts]
    _close(logits, torch.cat(refs))

    # teacher-forced decode: feed transformers' greedy token, compare the next logits
    nxt = [r[-1].argmax().item() for r in refs]
    for _ in range(DECODE_STEPS):
        for s, t in zip(seqs, nxt):
            s.append(t)
        out = ours(cache.batch([(i, [t]) for i, t in enumerate(nxt)]), cache.storage)
        with torch.no_grad():
            ref_rows = torch.stack([ref(torch.tensor([s])).logits[0, -1].float() for s in seqs])
        _close(out, ref_rows)
        nxt = ref_rows.argmax(-1).tolist()
        assert out.argmax(-1).tolist() == nxt  # identical greedy tokens


def test_parity_tiny_random(tiny_random_dir):
    # docs/model.md §6 on tiny-random: Hq·D != H, R < D, GQA 2, 8 experts top-2, random γ and bias
    _check_parity(tiny_random_dir)


def test_parity_second_config(second_config_dir):
    # docs/model.md §6: odd layer count, 6:1 heads like the release, rotary_dim = head_dim / 2
    _check_parity(second_config_dir, page_size=8)


def test_parity_fp8(tiny_random_fp8_dir):
    # docs/checkpoints.md §6 + docs/model.md §6: FP8 block directory, fp32 dequantisation on both sides
    _check_parity(tiny_random_fp8_dir)
