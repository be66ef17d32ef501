"""FP4 (E2M1) weights: nibble unpacking, NVFP4 and MXFP4 dequantisation (docs/checkpoints.md §5-§6).

Legend: N output rows, K input columns (the packed tensor is [N, K/2] uint8), G = K / group.

Three conventions, never mixed (docs/checkpoints.md §4):

- NVFP4, ModelOpt names: ``weight`` U8, ``weight_scale`` e4m3 [N, K/16], ``weight_scale_2`` f32
  scalar multiplier: ``block = fp32(weight_scale) * weight_scale_2``.
- NVFP4, compressed-tensors names: ``weight_packed`` U8, ``weight_scale`` e4m3 [N, K/16],
  ``weight_global_scale`` f32 (= 1 / weight_scale_2): ``block = fp32(weight_scale) /
  weight_global_scale`` (a division, bit-equal to compressed-tensors' ``_dequantize``).
- MXFP4 (Quark, or compressed-tensors ``mxfp4-pack-quantized``): E8M0 ``weight_scale`` U8
  [N, K/32]: ``block = 2^(e - 127)``.

Every formula is ``W[n, k] = e2m1(code[n, k]) * block[n, k // group]`` in fp32, then ONE
rounding to the requested dtype. Byte ``b`` at [n, j] holds column 2j in its low nibble.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from m2serve.config.quant import MXFP4_GROUP, NVFP4_GROUP

E8M0_NAN = 255

# E2M1 code -> value (docs/checkpoints.md §5): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class FP4Scheme(enum.Enum):
    """Which scale convention a packed FP4 weight uses (docs/checkpoints.md §4, §6)."""

    NVFP4_MODELOPT = "nvfp4_modelopt"
    NVFP4_CT = "nvfp4_compressed_tensors"
    MXFP4 = "mxfp4"

    @property
    def group(self) -> int:
        return MXFP4_GROUP if self is FP4Scheme.MXFP4 else NVFP4_GROUP


def unpack_e2m1(packed: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Packed E2M1 codes uint8 [..., K/2] -> fp32 values [..., K] (exact; -0 stays -0).

    Low nibble is column 2j, high nibble column 2j+1 (docs/checkpoints.md §5, same in modelopt
    ``nvfp4_tensor.py``, compressed-tensors ``pack_fp4_to_uint8`` and Quark ``utils/pack.py``).
    Raises ValueError naming ``name`` if ``packed`` is not uint8.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed FP4 weight must be uint8, found {packed.dtype}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1)  # [256, 2] f32: (low, high)
    # one gather per byte (int32 indices): ~3x faster on CPU than decoding nibble by nibble
    out = pairs.index_select(0, packed.reshape(-1).int())  # [numel, 2] f32
    return out.view(*packed.shape[:-1], 2 * packed.shape[-1])  # [..., K] f32


def decode_e8m0(scale: torch.Tensor, name: str = "weight_scale") -> torch.Tensor:
    """E8M0 scale bytes uint8 [...] -> fp32 2^(e - 127) (exact; e = 0 gives the subnormal 2^-127).

    The bytes are reinterpreted (``float8_e8m0fnu`` view), never numerically converted
    (docs/checkpoints.md §3.4, §5). Raises ValueError naming ``name`` for a non-uint8 tensor or a
    code 255 (E8M0 NaN), with the count and the first position.
    """
    if scale.dtype != torch.uint8:
        raise ValueError(f"{name}: E8M0 scale must be uint8, found {scale.dtype}")
    nan = scale == E8M0_NAN
    if bool(nan.any()):
        first = [int(i) for i in nan.nonzero()[0]]
        raise ValueError(f"{name}: {int(nan.sum())} E8M0 scale(s) hold the NaN code 255 "
                         f"(first at index {first}); the checkpoint is corrupt")
    return scale.view(torch.float8_e8m0fnu).float()


def _check_scale(packed: torch.Tensor, scale: torch.Tensor, group: int, name: str, scale_name: str) -> None:
    n, half = packed.shape
    if (2 * half) % group:
        raise ValueError(f"{name}: K={2 * half} is not a multiple of the FP4 group size {group}")
    want = (n, 2 * half // group)
    if tuple(scale.shape) != want:
        raise ValueError(f"{scale_name}: scale shape {list(scale.shape)} does not match weight {name} "
                         f"[{n}, {2 * half}] in groups of {group} along K (expected {list(want)})")


def _apply_blocks(values: torch.Tensor, block: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    n, k = values.shape
    out = values.view(n, k // group, group) * block.unsqueeze(-1)  # [N, G, group] f32
    return out.view(n, k).to(dtype)


def dequantize_nvfp4_modelopt(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                              dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """ModelOpt NVFP4 -> dense [N, K] of ``dtype`` (docs/checkpoints.md §6 "NVFP4 (ModelOpt)").

    packed uint8 [N, K/2]; weight_scale float8_e4m3fn [N, K/16]; weight_scale_2 fp32 scalar
    (any shape with one element; a per-tensor **multiplier**). ``W = e2m1 * (fp32(ws) * ws2)``
    in fp32, one rounding; bit-equal to modelopt ``NVFP4QTensor.dequantize``. Raises ValueError
    naming the tensor for a wrong dtype or scale shape.
    """
    ws2 = _scalar(weight_scale_2, f"{name}_scale_2")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}_scale: NVFP4 (ModelOpt) block scale must be float8_e4m3fn, "
                         f"found {weight_scale.dtype}")
    _check_scale(packed, weight_scale, NVFP4_GROUP, name, f"{name}_scale")
    block = weight_scale.float() * ws2  # [N, G] f32
    return _apply_blocks(unpack_e2m1(packed, name), block, NVFP4_GROUP, dtype)


def dequantize_nvfp4_ct(packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                        dtype: torch.dtype = torch.float32, name: str = "weight_packed") -> torch.Tensor:
    """compressed-tensors NVFP4 -> dense [N, K] of ``dtype`` (docs/checkpoints.md §4 compressed-tensors row).

    packed uint8 [N, K/2]; weight_scale float8_e4m3fn [N, K/16]; weight_global_scale fp32
    scalar (= 1 / ModelOpt's weight_scale_2). ``W = e2m1 * (fp32(ws) / wgs)``: a division, as
    compressed-tensors' ``_dequantize`` computes it (a precomputed reciprocal is not bit-equal).
    Raises ValueError naming the tensor for a wrong dtype or scale shape.
    """
    prefix = name.removesuffix("_packed")
    wgs = _scalar(weight_global_scale, f"{prefix}_global_scale")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}_scale: NVFP4 (compressed-tensors) block scale must be "
                         f"float8_e4m3fn, found {weight_scale.dtype}")
    _check_scale(packed, weight_scale, NVFP4_GROUP, name, f"{prefix}_scale")
    block = weight_scale.float() / wgs  # [N, G] f32
    return _apply_blocks(unpack_e2m1(packed, name), block, NVFP4_GROUP, dtype)


def dequantize_mxfp4(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """MXFP4 (OCP MX, group 32, E8M0 scales) -> dense [N, K] of ``dtype`` (docs/checkpoints.md §6 "MXFP4").

    packed uint8 [N, K/2]; weight_scale uint8 E8M0 [N, K/32] (not transposed).
    ``W = e2m1 * 2^(e - 127)``, exact in fp32; bit-equal to Quark's ``Pack_fp4.unpack`` +
    ``dequantize_fp4_fp6_per_group``. Raises ValueError naming the tensor for a wrong scale
    shape or an E8M0 NaN code (255).
    """
    scale_name = f"{name.removesuffix('_packed')}_scale"
    _check_scale(packed, weight_scale, MXFP4_GROUP, name, scale_name)
    block = decode_e8m0(weight_scale, scale_name)  # [N, G] f32
    return _apply_blocks(unpack_e2m1(packed, name), block, MXFP4_GROUP, dtype)


def _scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.numel() != 1:
        raise ValueError(f"{name}: per-tensor scale must hold one value, found shape {list(t.shape)}")
    return t.float().reshape(())


@dataclass(slots=True)
class PackedFP4:
    """One FP4 linear weight as stored (loader dispatch; kept so by ``--weight-dequant runtime``).

    ``packed`` uint8 [N, K/2]; ``scale`` e4m3 [N, K/16] (NVFP4) or uint8 E8M0 [N, K/32]
    (MXFP4); ``scale_2`` fp32 scalar (ModelOpt multiplier or compressed-tensors global divisor;
    None for MXFP4). :meth:`dequantize` applies the scheme's formula (module docstring).
    """

    scheme: FP4Scheme
    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None = None
    name: str = "weight"

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Dense [N, K] of ``dtype``, one rounding from fp32."""
        if self.scheme is FP4Scheme.NVFP4_MODELOPT:
            return dequantize_nvfp4_modelopt(self.packed, self.scale, self.scale_2, dtype, self.name)
        if self.scheme is FP4Scheme.NVFP4_CT:
            return dequantize_nvfp4_ct(self.packed, self.scale, self.scale_2, dtype, self.name)
        return dequantize_mxfp4(self.packed, self.scale, dtype, self.name)

    def rows(self, start: int, end: int) -> PackedFP4:
        """Rows ``[start, end)`` of the weight (views): the block scales are per row, ``scale_2`` is one
        value for the whole tensor. Raises ValueError naming the tensor unless the scale fits the
        whole weight, so that a band never hides a bad scale shape."""
        _check_scale(self.packed, self.scale, self.scheme.group, self.name, f"{self.name}_scale")
        return PackedFP4(self.scheme, self.packed[start:end], self.scale[start:end], self.scale_2, self.name)
