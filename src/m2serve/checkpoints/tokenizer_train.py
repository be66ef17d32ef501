"""Train the tiny checkpoints' byte-level BPE tokenizer with the ``tokenizers`` library.

Special tokens follow docs/parsers.md §1 (MiniMax's own strings); they are added
after the learned vocabulary, as in the release (where they start at id 200000).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from m2serve.text.tokenizer import add_minimax_tokens

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
You are a helpful assistant. How can I help you today? Let me think about this step by step.
What is the capital of France? The capital of France is Paris. What is 2 + 2? 2 + 2 = 4.
Hello, world! Hi there. Thanks, that was useful. Please summarise the following text in one sentence.
The weather today is sunny with a light breeze; tomorrow it will rain in the afternoon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 3.14159 2026-11-30 12:30.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>
The model reads the prompt, thinks, and then answers. It may call a tool and read the result.
Mixture-of-experts models route each token to a few experts chosen by a router.
Attention lets every token look at the tokens before it; the cache keeps their keys and values.
Ünïcödé text: café, naïve, Straße, 東京, 你好, こんにちは, 🙂.
"""


def train_tokenizer(vocab_size: int = 1000) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus, then the MiniMax special tokens appended.

    Deterministic (single corpus, fixed trainer settings). Returns a ``tokenizers.Tokenizer``
    whose size is at most ``vocab_size + len(m2serve.text.tokenizer.ADDED_TOKENS)``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([_CORPUS] * 3, trainer=trainer)
    add_minimax_tokens(tok)
    return tok
