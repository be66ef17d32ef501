"""Shared by the constrained-decoding tests and benchmark: the two tokenizers and a batched sampler.

The sampler is an independent reference for how an engine uses a ``TokenConstraint``: random logits
``[B, V]`` (seeded, temperature 1.0), the rows' allowed-token bitmask unpacked with plain tensor ops
(not llguidance's kernel), forbidden logits set to -inf, one token per row drawn from softmax(logits)
by the Gumbel-max trick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import m2serve.checkpoints
from m2serve.checkpoints.tokenizer_train import train_tokenizer
from m2serve.text.constraint import GrammarCompiler
from m2serve.text.tokenizer import Tokenizer

TOKENIZERS = ("tiny-random", "tiny-chat")
TINY_CHAT = Path(m2serve.checkpoints.__file__).parent / "tiny-chat"


def make_compiler(name: str) -> GrammarCompiler:
    """tiny-chat from its committed directory; tiny-random from the same trained tokenizer the builder
    writes (checkpoints/tiny_random.py), with its vocab rounded up to a multiple of 128."""
    if name == "tiny-chat":
        return GrammarCompiler.from_pretrained(TINY_CHAT)
    backend = train_tokenizer()
    return GrammarCompiler(Tokenizer(backend), backend.to_str(), -(-backend.get_vocab_size() // 128) * 128)


@dataclass
class Sampled:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"
    error: str | None = None
    reasoning_tokens: int = 0


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] -> bool [B, V]: bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def sample_batch(compiler: GrammarCompiler, constraints: list, max_tokens: int, seed: int) -> list[Sampled]:
    """Run every constraint to end of turn or ``max_tokens``; returns one ``Sampled`` per constraint.

    Raises AssertionError if a bitmask row allows nothing (the engine would sample from NaN)."""
    gen = torch.Generator().manual_seed(seed)
    n, vocab = len(constraints), compiler.vocab_size
    outs = [Sampled() for _ in range(n)]
    active = list(range(n))
    eos = set(compiler.eos_token_ids)
    bitmask = torch.zeros(n, compiler.words, dtype=torch.int32)
    for _ in range(max_tokens):
        if not active:
            break
        for row, i in enumerate(active):
            constraints[i].fill_bitmask(bitmask, row)
        allowed = unpack_bitmask(bitmask[: len(active)], vocab)
        assert allowed.any(dim=1).all(), "a bitmask row allows no token"
        logits = torch.randn(len(active), vocab, generator=gen).masked_fill(~allowed, float("-inf"))
        # temperature-1.0 sampling by the Gumbel-max trick (exact; cheaper than multinomial on CPU)
        gumbel = -torch.log(-torch.log(torch.rand(len(active), vocab, generator=gen).clamp_min(1e-20)))
        tokens = (logits + gumbel).argmax(dim=-1).tolist()
        still = []
        for i, token in zip(active, tokens):
            constraints[i].accept_token(token)
            if token in eos:
                outs[i].finish = "stop"
            else:
                outs[i].token_ids.append(token)
                still.append(i)
        active = still
    for out, constraint in zip(outs, constraints):
        out.text = compiler.tokenizer.decode(out.token_ids)
        out.error = constraint.error
        out.reasoning_tokens = constraint.reasoning_tokens
    return outs



