"""Quantisation facts every layer shares, defined once (docs/checkpoints.md §4–§6).

The FP8 block side and the FP4 group sizes are properties of the checkpoint formats; config/ (V7),
formats/ (detection, dequantisation), parallel/ (shard plans), engine/ (planner) and the tiny
checkpoint builder all import them from here instead of writing the numbers again.
"""

from __future__ import annotations

#: FP8 block quantisation: one fp32 ``weight_scale_inv`` per FP8_BLOCK x FP8_BLOCK block of e4m3
#: values (``weight_block_size: [128, 128]``).
FP8_BLOCK = 128
#: NVFP4: one e4m3 scale per 16 FP4 values along K.
NVFP4_GROUP = 16
#: MXFP4: one E8M0 scale per 32 FP4 values along K.
MXFP4_GROUP = 32

#: ``quantization_config.quant_method`` values refused outright (as MAX does), with the name the
#: NotImplementedError uses: "GPTQ MiniMax-M2 checkpoints are not supported". An unknown method is
#: a ValueError instead (formats/detect.py).
REFUSED_QUANT_METHODS = {"gptq": "GPTQ", "awq": "AWQ", "gguf": "GGUF", "bitsandbytes": "bitsandbytes",
                         "hqq": "HQQ", "aqlm": "AQLM", "exl2": "EXL2", "eetq": "EETQ"}
