"""Forward math of MiniMax-M2 (docs/model.md §3) and ``load_model``.

``load_model`` and ``MiniMaxM2ForCausalLM`` are imported on first use: importing the forward math
(model/decoder.py and below) then needs torch only, while ``load_model`` brings the safetensors
reader and its progress bar (benchmarks/gpu_check.py runs on a machine with nothing installed).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MiniMaxM2ForCausalLM", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from m2serve.model.load import load_model
        return load_model
    if name == "MiniMaxM2ForCausalLM":
        from m2serve.model.decoder import MiniMaxM2ForCausalLM
        return MiniMaxM2ForCausalLM
    raise AttributeError(f"module 'm2serve.model' has no attribute {name!r}")
