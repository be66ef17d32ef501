"""m2serve: a readable PyTorch inference and serving engine for the MiniMax-M2 family.

Layers (imports point down only): config <- formats <- model <- parallel <- engine <- serve,
and config <- text <- serve. See README.md for the map.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:   # what type checkers see of the lazy names below
    from m2serve.engine.sampling import SamplingParams
    from m2serve.serve.llm import LLM


def __getattr__(name: str) -> object:
    """``from m2serve import LLM, SamplingParams`` (vLLM's import shape), loaded on first use: importing
    the package alone loads no torch."""
    if name == "LLM":
        from m2serve.serve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from m2serve.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'm2serve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
