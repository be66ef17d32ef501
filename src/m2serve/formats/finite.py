"""Non-finite values in checkpoint tensors, found on the stored bytes at load.

A NaN or inf in any weight, norm or scale makes every answer garbage ("!!!!…") while the server
looks healthy, so the loader refuses such a checkpoint with the tensor named. Each check is one or
two reductions over the tensor as read from the file, before any dequantisation:

- floating tensors (bf16 / fp16 / fp32 weights, norms, fp32 scales): ``aminmax`` — NaN propagates
  into both results and ±inf shows as one of them;
- FP8 e4m3 (``float8_e4m3fn`` weights, NVFP4 block scales): the NaN codes 0x7F and 0xFF (e4m3fn has
  no inf), found on the raw bytes as ``max(uint8) == 0xFF`` or ``max(int8) == 0x7F``;
- E8M0 (MXFP4 block scales, uint8): the NaN code 0xFF;
- packed E2M1 nibbles (uint8) have no non-finite code and are not checked.
"""

from __future__ import annotations

from typing import Literal

import torch

Encoding = Literal["float", "e4m3", "e8m0"]


class CorruptTensorError(ValueError):
    """A checkpoint tensor holds NaN / inf values (or NaN codes); the message names the tensor."""


def find_nonfinite(t: torch.Tensor, encoding: Encoding | None = None) -> tuple[int, list[int]] | None:
    """(count, index of the first) of the non-finite elements of ``t`` as stored; None if clean.

    ``encoding`` overrides what the dtype says: ``"e4m3"`` for e4m3 codes held in uint8,
    ``"e8m0"`` for E8M0 scales; None = from the dtype (float8_e4m3fn -> e4m3, other floating
    dtypes -> float, integer dtypes -> nothing to check). The clean path allocates nothing;
    the mask is built only after a reduction has found a bad value.
    """
    encoding = _encoding(t, encoding)
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


def _encoding(t: torch.Tensor, encoding: Encoding | None) -> Encoding | None:
    if encoding is not None:
        return encoding
    if t.dtype == torch.float8_e4m3fn:
        return "e4m3"
    return "float" if t.dtype.is_floating_point else None


_WHAT = {"e4m3": "FP8 e4m3 value(s) hold a NaN code (0x7F/0xFF)",
         "e8m0": "E8M0 scale(s) hold the NaN code 255", "float": "value(s) are NaN or inf"}


def check_finite(t: torch.Tensor, name: str, encoding: Encoding | None = None, where: str = "") -> None:
    """Raise CorruptTensorError naming ``name`` (after ``where``, e.g. the file), the count and the
    first position when ``t`` holds non-finite values; see :func:`find_nonfinite` for ``encoding``."""
    found = find_nonfinite(t, encoding)
    if found is not None:
        count, first = found
        raise CorruptTensorError(f"{where + ': ' if where else ''}{name}: {count} "
                                 f"{_WHAT[_encoding(t, encoding) or 'float']} (first at index {first}); "
                                 "the checkpoint is corrupt: re-download or re-convert it")
