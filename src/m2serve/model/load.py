"""``load_model``: config + strict streaming load into a MiniMaxM2ForCausalLM (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelState
from m2serve.formats.loader import ShardPlan, iter_weights, open_checkpoint, read_kv_scales
from m2serve.model.decoder import MiniMaxM2ForCausalLM


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               parallel: ParallelState | None = None, shard: ShardPlan | None = None,
               progress: bool | None = None, weight_dequant: str = "load") -> MiniMaxM2ForCausalLM:
    """Load a MiniMax-M2 checkpoint directory (BF16 or FP8 block) for inference.

    ``dtype`` is the activation/weight dtype (router stays fp32; FP8 weights are dequantised at
    load, one rounding). ``shard`` is the rank's slice hook (formats/loader.py); with the default
    ParallelState the whole model is loaded. The headers are checked before any data is read
    (CheckpointMismatchError / CheckpointFormatError, both ValueError). Parameters are allocated
    uninitialised and filled tensor by tensor, so peak memory stays near the final size.
    ``model.kv_scales`` holds per-layer (k_scale, v_scale) if the checkpoint ships them, else None.
    ``weight_dequant`` (EngineArgs.weight_dequant): ``"load"`` dequantises every quantised weight
    now; ``"runtime"`` keeps quantised weights as stored — every FP8 block linear, and the FP4
    (NVFP4 / MXFP4) expert weights — and dequantises them when used: a linear per forward, an
    expert only when a step activates it (same values, less memory; other weights as with ``"load"``).
    Raises ValueError for another value.
    """
    if weight_dequant not in ("load", "runtime"):
        raise ValueError(f"weight_dequant={weight_dequant!r} is not supported; use 'load' or 'runtime'")
    cfg = MiniMaxM2Config.from_pretrained(path)
    plan = open_checkpoint(path, cfg)
    parallel = parallel or ParallelState()
    with torch.device(device):
        model = MiniMaxM2ForCausalLM(cfg, parallel, dtype)
    for layer in model.model.layers:  # bias = 0 unless the file has one (docs/model.md §1 use_routing_bias)
        layer.block_sparse_moe.e_score_correction_bias.data.zero_()
    try:
        for name, tensor in iter_weights(plan, dtype, shard, progress,
                                         packed=weight_dequant == "runtime"):
            model.load_weight(name, tensor)
        model.kv_scales = read_kv_scales(plan)
    finally:
        plan.reader.close()
    return model.eval()
