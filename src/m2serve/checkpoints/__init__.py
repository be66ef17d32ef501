"""Checkpoints shipped with m2serve.

- ``tiny-chat/``: a small trained MiniMax-M2 (FP8 block format), the embedded default model of
  ``m2serve serve`` / ``m2serve generate``; made by tools/tiny_chat (train.py, export.py).
- ``tiny_random.py``: the builder of ``tiny-random`` (random weights, other dimensions; tests).
- ``CHAT_TEMPLATE``: the repository's one chat template, kept in ``tiny-chat/`` and copied into every
  checkpoint the builders write (tiny-random, tools/tiny_chat/export.py).
- ``tokenizer_train.py``, ``hub_configs/`` (public configs for planning).
"""

from __future__ import annotations

from pathlib import Path

TINY_CHAT = Path(__file__).resolve().with_name("tiny-chat")
CHAT_TEMPLATE = TINY_CHAT / "chat_template.jinja"
#: The shipped checkpoints by the names ``--model`` (and ``speculative_config.model``) accept for them:
#: ``m2serve serve tiny-chat`` serves the embedded default, as the API names it.
EMBEDDED_MODELS = {"tiny-chat": TINY_CHAT, "tiny-chat-eagle3": TINY_CHAT.with_name("tiny-chat-eagle3")}


def default_model_path() -> Path:
    """The embedded default model: the committed ``tiny-chat`` directory (no download, no build).

    Raises FileNotFoundError naming the directory if the installed package lacks it.
    """
    if not (TINY_CHAT / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing: {TINY_CHAT}/config.json "
                                "(reinstall m2serve, or pass --model)")
    return TINY_CHAT
