"""TEST-ONLY entry point: the real ``m2serve serve`` with a model that replays a fixed token sequence.

Used only by tests/serve/test_tool_calls_server.py to push a known reasoning + tool-call output
through the real server (engine, scheduler, KV cache, sampler, detokeniser, parser, HTTP). Nothing
in src/ knows about it: this script replaces ``LLMEngine.from_args`` in its own process so the engine
is built around :class:`TestOnlyReplayModel` instead of the checkpoint's weights.

    python tests/serve/replay_server.py REPLAY_TEXT_FILE serve --model DIR --kv-cache-format float32 ...

The replay model stores each token id in the first K element of its KV slot (so it needs
``--kv-cache-format float32``), reads the sequence back through the block table, counts the tokens
generated after the last ``<think>\\n`` of the generation prompt, and puts all the probability mass on
the next token of the replay text (then on the end-of-turn token).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine import core
from m2serve.model.batch import ForwardBatch, KVStorage
from m2serve.serve import cli
from m2serve.text.tokenizer import Tokenizer


class TestOnlyReplayModel:
    """``model(batch, kv) -> logits [N, V] f32`` that replays ``script`` after the generation prompt."""

    __test__ = False  # not a pytest class

    def __init__(self, script: list[int], marker: list[int], eos: int, vocab_size: int) -> None:
        self.script, self.marker, self.eos, self.vocab_size = script, marker, eos, vocab_size

    def __call__(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        S = kv.page_size
        store = kv.k[0]  # [P, S, Hkv, D] float32: slot s holds token id at [s // S, s % S, 0, 0]
        store[batch.slot_mapping // S, batch.slot_mapping % S, 0, 0] = batch.tokens.to(store.dtype)
        rows = batch.logit_row_indices().tolist()
        offs = batch.input_row_offsets.tolist()
        out = torch.full((len(rows), self.vocab_size), -30.0)
        for n, t in enumerate(rows):
            b = next(i for i in range(len(offs) - 1) if offs[i] <= t < offs[i + 1])
            length = int(batch.positions[t]) + 1
            slots = [int(batch.block_tables[b, p // S]) * S + p % S for p in range(length)]
            history = [int(store[s // S, s % S, 0, 0]) for s in slots]
            out[n, self._next(history)] = 30.0
        return out

    def _next(self, history: list[int]) -> int:
        m = len(self.marker)
        start = max(
            (i + m for i in range(len(history) - m + 1) if history[i : i + m] == self.marker), default=None
        )
        if start is None:
            return self.eos
        g = len(history) - start
        return self.script[g] if g < len(self.script) else self.eos


def main(argv: list[str]) -> int:
    replay_file, serve_argv = argv[0], argv[1:]
    text = Path(replay_file).read_text(encoding="utf-8")

    def from_args(cls, args):  # replaces LLMEngine.from_args in this process only
        tok = Tokenizer.from_pretrained(args.model)
        config = MiniMaxM2Config.from_pretrained(args.model)
        model = TestOnlyReplayModel(
            tok.encode(text), tok.encode("<think>\n"), tok.eos_token_id, config.vocab_size
        )
        return cls.from_model(model, config, args)

    core.LLMEngine.from_args = classmethod(from_args)
    return cli.main(serve_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
