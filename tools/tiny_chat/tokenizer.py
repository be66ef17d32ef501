"""Train the `tiny-chat` byte-level BPE tokenizer on the synthetic training corpus .

Layout (docs/parsers.md §1, scaled down): a byte-level BPE learns ``BPE_VOCAB`` ids from the
rendered training conversations; the MiniMax special tokens follow
(ids ``BPE_VOCAB`` …), each a single token; the embedding is padded to ``VOCAB_PADDED`` (a multiple of
128 for the FP8 block format). Which added tokens are special is the one rule of
``m2serve.text.tokenizer.add_minimax_tokens`` (shared with tiny-random's trainer): ``]~!b[``, ``]~b]``,
``[e~[``, pad and unk are special; the four parser tags are non-special added tokens, so decoding with
``skip_special_tokens`` still yields them as text.

**Split rule (``SPLIT``), chosen for copying.** The o200k regex of the real tokenizer glues a leading
space to a word (`` Paris``), so a value tokenises differently in the user's request (after a space) and
inside ``<parameter name="city">Paris</parameter>`` (after ``">``): the model would have to learn a
per-token map between the two spellings, which cannot generalise to held-out values. Here a word is
letters only (the space before it is its own token), every digit is one token, and a punctuation run
keeps at most one trailing space (JSON's ``": "``). A value therefore has the same token ids wherever
it appears, and copying it is pure token-identity copying (an induction head). The smaller vocabulary
keeps the pieces of unseen words frequent in training. Cost: ~1.35x the tokens of the o200k split.

Usage: ``python tools/tiny_chat/tokenizer.py OUT_DIR`` writes OUT_DIR/tokenizer.json and
OUT_DIR/tokenizer_config.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from m2serve.text.tokenizer import ADDED_TOKENS, add_minimax_tokens

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import data  # noqa: I001
else:
    from . import data

BPE_VOCAB = 1500
VOCAB_PADDED = 1536
CORPUS_EXAMPLES = 6000
CORPUS_SEED = 100

# Pre-tokenisation (see "Split rule" above): letter runs, single digits, punctuation runs with at
# most one trailing space, whitespace runs.
SPLIT = r"[\p{L}\p{M}]+|\p{N}|[^\s\p{L}\p{N}]+ ?|\s+"



def corpus(n: int = CORPUS_EXAMPLES, seed: int = CORPUS_SEED) -> list[str]:
    """Rendered training conversations (train split only, so eval values do not shape the vocab)."""
    tpl = data.load_template()
    return [data.render(tpl, e.messages, e.tools, add_generation_prompt=False)
            for e in data.make_examples("train", n, seed, arith="two_digit", verdict=False)]


def train_tokenizer() -> Tokenizer:
    """BPE over the corpus, then the special tokens; deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = corpus()
    # Special strings must not be learned as BPE pieces: train on text with them removed.
    def strip(t: str) -> str:
        for s in ADDED_TOKENS:
            t = t.replace(s, "\n")
        return t
    tok.train_from_iterator((strip(t) for t in texts), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} ids, expected {BPE_VOCAB}")
    add_minimax_tokens(tok)
    for s in ADDED_TOKENS:
        if len(tok.encode(s, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"{s!r} is not a single token")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json (docs/parsers.md §1)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "]~!b[",
        "eos_token": "[e~[",
        "unk_token": "]!d~[",
        "pad_token": "]!p~[",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }


def save(out_dir: Path) -> Tokenizer:
    """Train and write tokenizer.json + tokenizer_config.json into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return tok


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/tiny_chat/tokenizer.py OUT_DIR")
    t = save(Path(sys.argv[1]))
    print(f"vocab {t.get_vocab_size()} (padded to {VOCAB_PADDED})")
