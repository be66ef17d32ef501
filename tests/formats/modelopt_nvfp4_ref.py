"""Run nvidia-modelopt's ``fp4_fake_quant_block`` on CPU under the Triton interpreter (a script).

Usage: ``python modelopt_nvfp4_ref.py IN.pt OUT.pt``; IN holds ``{"x": {dtype name: [R, K]},
"amax": [floats]}``; OUT gets ``{(dtype name, amax): result}``. TRITON_INTERPRET must be set before
triton is first imported, hence a separate process (tests/formats/test_act_quant.py explains the
two interpreter casts replaced by torch's round-to-nearest-even ones and the no-op CUDA guard).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_convert = interpreter._convert_float


def _rne(data, src, dst, rounding_mode):
    if src == tl.float32 and dst in (tl.float8e4nv, tl.bfloat16):
        t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
        if dst == tl.float8e4nv:
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return _convert(data, src, dst, rounding_mode)


interpreter._convert_float = _rne
torch.cuda.device = lambda _device: contextlib.nullcontext()

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel_hopper import fp4_fake_quant_block  # noqa: E402


def main(src: str, dst: str) -> None:
    spec = torch.load(src)
    out = {}
    for name, x in spec["x"].items():
        for amax in spec["amax"]:
            out[(name, amax)] = fp4_fake_quant_block(x, torch.tensor(amax))
    torch.save(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
