"""Forward math of MiniMax-M2 (docs/model.md §3) and ``load_model``."""

from m2serve.model.decoder import MiniMaxM2ForCausalLM
from m2serve.model.load import load_model

__all__ = ["MiniMaxM2ForCausalLM", "load_model"]
