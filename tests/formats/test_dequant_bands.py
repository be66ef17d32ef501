"""The loader's band-by-band dequantisation (formats/loader.py ``dequantize_in_bands``).

Values are checked against the formulas of docs/checkpoints.md §6 written out here element by element
(e4m3 / E2M1 codes decoded by torch or by the E2M1 table, the scale looked up per element, one fp32
product, one rounding), for a partial last band, a row slice as a shard reads it, and NVFP4; the
temporaries are checked with the torch profiler's allocation records.
"""

from __future__ import annotations

import pytest
import torch

from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.formats.loader import DEQUANT_BAND_ROWS, dequantize_in_bands

# E2M1 code -> value (docs/checkpoints.md §5): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e4m3(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN codes (the reader refuses them first)
    return raw.view(torch.float8_e4m3fn)


def _fp8_reference(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W[i, j] = fp32(q[i, j]) * s[i // 128, j // 128], one rounding."""
    n, k = q.shape
    i = torch.arange(n)[:, None] // 128
    j = torch.arange(k)[None, :] // 128
    return (q.float() * s[i, j]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_partial_last_band_and_a_shard_slice(dtype):
    q = _e4m3((300, 256), 1)  # bands 0-127, 128-255, 256-299
    s = torch.rand(3, 2, generator=torch.Generator().manual_seed(2)) * 1e-2
    assert torch.equal(dequantize_in_bands(PackedFP8(q, s), dtype), _fp8_reference(q, s, dtype))
    # rows (128, 300) of the weight, as the loader reads a shard: codes q[128:300], scale rows 1-2
    assert torch.equal(dequantize_in_bands(PackedFP8(q[128:300], s[1:3]), dtype),
                       _fp8_reference(q, s, dtype)[128:300])


def test_a_scale_grid_that_does_not_fit_the_whole_weight_is_refused():
    q = _e4m3((256, 256), 3)
    with pytest.raises(ValueError, match=r"scale grid \[3, 2\] does not match weight \[256, 256\]"):
        dequantize_in_bands(PackedFP8(q, torch.ones(3, 2)), torch.bfloat16)  # a band alone would fit
    fp4 = PackedFP4(FP4Scheme.NVFP4_MODELOPT, torch.zeros(200, 32, dtype=torch.uint8),
                    torch.ones(100, 4).to(torch.float8_e4m3fn), torch.tensor(1.0), "w")
    with pytest.raises(ValueError, match=r"w_scale: scale shape \[100, 4\] does not match weight w"):
        dequantize_in_bands(fp4, torch.bfloat16)


def test_nvfp4_partial_last_band():
    # ModelOpt NVFP4: W[n, k] = e2m1(code) * (fp32(ws[n, k // 16]) * ws2); low nibble = even column
    g = torch.Generator().manual_seed(4)
    n, k = 200, 64
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    ws = (torch.rand(n, k // 16, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.037)
    values = torch.stack([E2M1[(codes & 0xF).long()], E2M1[(codes >> 4).long()]], dim=-1).reshape(n, k)
    want = (values * (ws.float() * ws2).repeat_interleave(16, dim=1)).to(torch.bfloat16)
    got = dequantize_in_bands(PackedFP4(FP4Scheme.NVFP4_MODELOPT, codes, ws, ws2), torch.bfloat16)
    assert torch.equal(got, want)


def _allocations(fn) -> list[int]:
    """Bytes of every CPU allocation made while ``fn()`` runs (torch profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), reverse=True)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_temporaries_are_one_band(fmt):
    # one [N, K] bf16 output, and nothing else larger than a band of fp32 rows: the whole-tensor
    # formula allocates [N, K] fp32 temporaries (fails this), whose fresh pages slowed FP8 loads
    n, k = 1024, 512
    g = torch.Generator().manual_seed(6)
    if fmt == "fp8":
        packed = PackedFP8(_e4m3((n, k), 7), torch.rand(n // 128, k // 128, generator=g))
    else:
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        packed = PackedFP4(FP4Scheme.MXFP4, codes, torch.randint(120, 130, (n, k // 32), generator=g,
                                                                 dtype=torch.uint8))
    sizes = _allocations(lambda: dequantize_in_bands(packed, torch.bfloat16))
    assert sizes[0] == n * k * 2  # the output
    assert max(sizes[1:]) <= DEQUANT_BAND_ROWS * k * 4, sizes[:4]
    whole = _allocations(lambda: packed.dequantize(torch.bfloat16))
    assert whole[0] >= n * k * 4  # what the bound rules out
