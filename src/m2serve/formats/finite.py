"""Non-finite values in checkpoint tensors, found on the stored bytes at load.

A NaN or inf in any weight, norm or scale makes every answer garbage ("!!!!…") while the server
looks healthy, so the loader refuses such a checkpoint with the tensor named. The test is on the
stored bits, before any dequantisation: a code is non-finite when every bit of its mask is set
(:func:`nonfinite_mask`):

- floating tensors (bf16 / fp16 / fp32 weights, norms, fp32 scales): the exponent field all ones
  (inf or NaN), masks 0x7F80 / 0x7C00 / 0x7F800000;
- FP8 e4m3 (``float8_e4m3fn`` weights, NVFP4 block scales): the NaN codes 0x7F and 0xFF (e4m3fn has
  no inf), mask 0x7F;
- E8M0 (MXFP4 block scales, uint8): the NaN code 0xFF;
- packed E2M1 nibbles (uint8) have no non-finite code and are not checked.

The loader runs the test inside the copy out of the file (:func:`copy_finite`), so the data is
tested while it is in registers / cache instead of in a second pass over memory: the C++ op
``m2serve_kernels::copy_check`` when the kernels are built (kernels/ops.py), else
:func:`copy_check_torch`. :func:`find_nonfinite` counts and locates the bad values for the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

Encoding = Literal["float", "e4m3", "e8m0"]

#: (dst [R, C], src [R, C], mask) -> whether any copied element has every bit of ``mask`` set; dst is
#: contiguous, src rows are contiguous, both hold the stored codes as uint8 / int16 / int32.
CopyCheck = Callable[[torch.Tensor, torch.Tensor, int], bool]

_FLOAT_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
_CODE_MASK = {"e4m3": 0x7F, "e8m0": 0xFF}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_CHUNK_BYTES = 256 * 1024  # copy_check_torch: copied and tested while in L2


class CorruptTensorError(ValueError):
    """A checkpoint tensor holds NaN / inf values (or NaN codes); the message names the tensor."""


def find_nonfinite(t: torch.Tensor, encoding: Encoding | None = None) -> tuple[int, list[int]] | None:
    """(count, index of the first) of the non-finite elements of ``t`` as stored; None if clean.

    ``encoding`` overrides what the dtype says: ``"e4m3"`` for e4m3 codes held in uint8,
    ``"e8m0"`` for E8M0 scales; None = from the dtype (float8_e4m3fn -> e4m3, other floating
    dtypes -> float, integer dtypes -> nothing to check). The clean path allocates nothing;
    the mask is built only after a reduction has found a bad value.
    """
    encoding = _encoding(t.dtype, encoding)
    if t.numel() == 0 or encoding is None:
        return None
    if encoding == "e4m3":
        u = t.view(torch.uint8)
        if int(u.amax()) != 0xFF and int(u.view(torch.int8).amax()) != 0x7F:
            return None
        bad = (u & 0x7F) == 0x7F
    elif encoding == "e8m0":
        u = t.view(torch.uint8)
        if int(u.amax()) != 0xFF:
            return None
        bad = u == 0xFF
    else:
        v = t.float() if t.dtype.itemsize == 1 else t  # other 8-bit floats: no native reductions
        lo, hi = torch.aminmax(v)
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return None
        bad = ~torch.isfinite(v)
    first = torch.nonzero(bad)[0].tolist()
    return int(bad.sum()), first


def _encoding(dtype: torch.dtype, encoding: Encoding | None) -> Encoding | None:
    if encoding is not None:
        return encoding
    if dtype == torch.float8_e4m3fn:
        return "e4m3"
    return "float" if dtype.is_floating_point else None


def nonfinite_mask(dtype: torch.dtype, encoding: Encoding | None = None) -> int | None:
    """The bits all set in a non-finite code of ``dtype`` (``encoding`` as for :func:`find_nonfinite`);
    None when the codes have no non-finite value. Raises ValueError naming the dtype for a float
    dtype whose exponent field is not known here (only the checkpoint header dtypes are)."""
    encoding = _encoding(dtype, encoding)
    if encoding is None:
        return None
    if encoding in _CODE_MASK:
        return _CODE_MASK[encoding]
    if dtype not in _FLOAT_EXPONENT:
        raise ValueError(f"no non-finite test for stored dtype {dtype} (bf16, fp16, fp32, e4m3, e8m0 only)")
    return _FLOAT_EXPONENT[dtype]


def copy_check_torch(dst: torch.Tensor, src: torch.Tensor, mask: int) -> bool:
    """:data:`CopyCheck` in PyTorch ops: copy ~256 KiB of rows, then ``amax(rows & mask) == mask`` on
    them while they are in cache. Stops copying at the first chunk with a hit."""
    rows = max(1, _CHUNK_BYTES // max(1, src.shape[1] * src.element_size()))
    scratch = torch.empty((min(rows, src.shape[0]), src.shape[1]), dtype=src.dtype)
    for r in range(0, src.shape[0], rows):
        d = dst[r:r + rows]
        d.copy_(src[r:r + rows])
        s = scratch[:d.shape[0]]
        torch.bitwise_and(d, mask, out=s)
        if int(s.amax()) == mask:
            return True
    return False


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() <= 1 else t.flatten(1)  # [R, C]; a view for our slices


def copy_finite(src: torch.Tensor, name: str, copy_check: CopyCheck, encoding: Encoding | None = None,
                where: str = "") -> torch.Tensor:
    """A contiguous copy of ``src`` (a stored tensor or a dim-0 / dim-1 slice of one, e.g. a view of the
    file), tested for non-finite codes by ``copy_check`` in the same pass. Raises CorruptTensorError
    as :func:`check_finite` does (``name``, ``where``, count, first index) on a hit."""
    out = torch.empty(src.shape, dtype=src.dtype)
    mask = nonfinite_mask(src.dtype, encoding)
    if mask is None or src.numel() == 0:
        return out.copy_(src)
    ints = _INT_OF_WIDTH[src.element_size()]
    if copy_check(_rows(out.view(ints)), _rows(src.view(ints)), mask):
        check_finite(src, name, encoding, where)
    return out


_WHAT = {"e4m3": "FP8 e4m3 value(s) hold a NaN code (0x7F/0xFF)",
         "e8m0": "E8M0 scale(s) hold the NaN code 255", "float": "value(s) are NaN or inf"}


def check_finite(t: torch.Tensor, name: str, encoding: Encoding | None = None, where: str = "") -> None:
    """Raise CorruptTensorError naming ``name`` (after ``where``, e.g. the file), the count and the
    first position when ``t`` holds non-finite values; see :func:`find_nonfinite` for ``encoding``."""
    found = find_nonfinite(t, encoding)
    if found is not None:
        count, first = found
        what = _WHAT[_encoding(t.dtype, encoding) or "float"]
        raise CorruptTensorError(f"{where + ': ' if where else ''}{name}: {count} {what} (first at index "
                                 f"{first}); the checkpoint is corrupt: re-download or re-convert it")
