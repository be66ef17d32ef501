"""FP4 activation quantisation, W4A4 as the checkpoints declare it (docs/checkpoints.md §9).

Legend: R rows, K features (the linear's input width), G = K / group.

Quantise-then-dequantise ("fake quantisation") of a linear's input, row by row in groups along K,
with the rules of the library that produced each release, bit for bit:

- MXFP4 (Quark ``input_tensors``: fp4, per_group 32, e8m0, dynamic, scale mode "even"):
  :func:`qdq_mxfp4`. No state: the shared E8M0 scale comes from each group's own amax.
- NVFP4 (ModelOpt ``input_scale``): :func:`qdq_nvfp4`, per-16 E4M3 block scales under the linear's
  calibrated per-tensor input scale.
- NVFP4 (compressed-tensors ``input_global_scale``): :func:`qdq_nvfp4_ct`, the same format with
  compressed-tensors' own arithmetic (it differs from ModelOpt's in the last bit of some elements).

:func:`quantize_activations` is THE seam: every quantised linear (model/linear.py, the experts in
model/experts.py) calls it on its input before the product, and a fused GPU path must give the same
values. Everything is elementwise or a per-group reduction (no host sync; capturable).
"""

from __future__ import annotations

import enum
import functools

import torch

from m2serve.config.quant import MXFP4_GROUP, NVFP4_GROUP

#: E2M1 magnitudes by code 0..7 (docs/checkpoints.md §5) and the rounding bounds between them:
#: a magnitude exactly on a bound goes to the neighbour with the even code (§9 rounding rules).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_TIES = (0.75, 1.75, 3.5)  # ties whose upper neighbour has the even code
E4M3_MAX = 448.0
#: ModelOpt's floor on a dequantised NVFP4 block scale: a smaller one is replaced by 1.0.
NVFP4_MIN_BLOCK_SCALE = 1e-5
#: ModelOpt's stand-in for a non-positive global input scale.
NVFP4_MIN_INPUT_SCALE = 1e-12


class ActivationScheme(enum.Enum):
    """How a quantised linear's input is quantised (docs/checkpoints.md §9)."""

    MXFP4 = "mxfp4"  # per 32: E8M0 scale from the group's amax (Quark "even"), E2M1 elements
    NVFP4 = "nvfp4"  # per 16: E4M3 scale under a per-linear fp32 input scale (ModelOpt), E2M1 elements
    NVFP4_CT = "nvfp4_ct"  # per 16: E4M3 scale under the input global scale (compressed-tensors' rules)

    @property
    def group(self) -> int:
        return MXFP4_GROUP if self is ActivationScheme.MXFP4 else NVFP4_GROUP

    @property
    def numerics(self) -> str:
        """The banner's words for it."""
        if self is ActivationScheme.MXFP4:
            return "W4A4 MXFP4 (dynamic E8M0 per 32, Quark rounding)"
        if self is ActivationScheme.NVFP4:
            return "W4A4 NVFP4 (E4M3 per 16 under the input scale, ModelOpt rounding)"
        return "W4A4 NVFP4 (E4M3 per 16 under the input global scale, compressed-tensors rounding)"


def round_e2m1(mag: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes (>= 0, finite or not) -> the nearest E2M1 magnitude, ties to the even code,
    saturating at 6 (docs/checkpoints.md §9). NaN and inf give 6 here; callers decide."""
    bounds, table = _tables(mag.device)
    code = torch.bucketize(mag, bounds)  # mag == bound -> the lower code
    for tie in _ROUND_UP_TIES:
        code = code + (mag == tie).to(code.dtype)
    code = torch.where(mag.isnan(), len(_BOUNDS), code)
    return table[code]


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding bounds and the magnitude table on ``device``, made once (no copy per call)."""
    return (torch.tensor(_BOUNDS, dtype=torch.float32, device=device),
            torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device))


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"activation width {k} is not a multiple of the FP4 group size {group}")
    return x.float().reshape(-1, k // group, group)  # [R, G, group] f32


def mxfp4_scale(amax: torch.Tensor) -> torch.Tensor:
    """Group amax fp32 [...] -> the shared E8M0 scale as fp32 2^e (docs/checkpoints.md §9, Quark's
    "even" mode, OCP MX v1.0 §6.3): amax rounded to 2 significant bits (a mantissa of 0.75 or more
    carries into the exponent), e = floor(log2(that)) - 2 (E2M1's largest exponent), clamped to
    [-127, 127]. amax 0 or subnormal -> 2^-127; inf or a value rounding past fp32 -> 2^127; NaN -> NaN."""
    bits = amax.contiguous().view(torch.int32)
    rounded = (bits + (1 << 21)) & 0x7F800000  # carry at mantissa >= 0.75, keep the exponent field
    biased = rounded >> 23  # 0 (zero / subnormal) .. 255 (inf)
    e = torch.where(biased == 255, 127, biased - 127 - 2).clamp(-127, 127)
    scale = torch.where(e >= -126, (e + 127) << 23, 1 << 22).view(torch.float32)  # 1 << 22: 2^-127
    return torch.where(amax.isnan(), float("nan"), scale)


def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> the same shape and dtype: every 32-element group along K
    quantised to MXFP4 and back, bit-equal to amd-quark's dynamic ``PerBlockMXObserver`` fake
    quantisation (docs/checkpoints.md §9): scale = :func:`mxfp4_scale` (amax), element =
    ``round_e2m1(|x| / scale)`` with x's sign (a zero result is +0), times the scale in fp32, one
    rounding to x's dtype (exact for bf16 and fp32). An inf or NaN element stays inf / NaN; a NaN makes
    the whole group NaN. Raises ValueError naming the width when K is not a multiple of 32."""
    g = _groups(x, MXFP4_GROUP)
    scale = mxfp4_scale(g.abs().amax(-1, keepdim=True))  # [R, G, 1] f32
    v = g / scale
    q = round_e2m1(v.abs())
    q = torch.where(q == 0, 0.0, torch.where(v < 0, -q, q))  # +0 for a zero result, as Quark
    q = torch.where(v.isfinite(), q, v)  # inf / NaN pass through
    return (q * scale).reshape(x.shape).to(x.dtype)


def qdq_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [R, K] (K a multiple of 16), input_scale fp32: a scalar, or [R, 1] (one per row: the row's
    expert's value) -> x's shape and dtype: every 16-element group quantised to NVFP4 and back,
    bit-equal to nvidia-modelopt's dynamic-block NVFP4 fake quantisation of a calibrated input
    (``fp4_fake_quant_block``; docs/checkpoints.md §9). Per group: ``s = e4m3(min(amax / (6 ·
    input_scale), 448)) · input_scale``, 1.0 when below 1e-5; element ``round_e2m1(|x| / s) · s``
    with x's sign taken as ``x >= 0`` and applied as ``0 - y`` (so every zero is +0). The amax
    ignores NaN (GPU max semantics); a NaN element gives -6·s; inf gives ±6·s (s = 448 ·
    input_scale). Raises ValueError naming the width when K is not a multiple of 16."""
    g = _groups(x, NVFP4_GROUP)
    gs = input_scale.float()
    gs = gs.reshape(-1, 1, 1) if gs.dim() else gs
    gs = torch.where(gs > 0, gs, NVFP4_MIN_INPUT_SCALE)
    amax = torch.where(g.isnan(), 0.0, g.abs()).amax(-1, keepdim=True)  # [R, G, 1]; NaN ignored
    block = (amax / (6.0 * gs)).clamp(max=E4M3_MAX)
    s = block.to(torch.float8_e4m3fn).float() * gs
    s = torch.where(s >= NVFP4_MIN_BLOCK_SCALE, s, 1.0)
    y = round_e2m1(g.abs() / s) * s
    return torch.where(g >= 0, y, 0.0 - y).reshape(x.shape).to(x.dtype)  # 0 - y: a zero is +0


#: compressed-tensors' stand-in for a zero NVFP4 block scale (its e4m3 "eps").
NVFP4_CT_ZERO_BLOCK_SCALE = 0.125


def qdq_nvfp4_ct(x: torch.Tensor, global_scale: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [R, K] (K a multiple of 16), global_scale fp32 (compressed-tensors ``input_global_scale`` = 1 /
    ModelOpt's input scale): a scalar, or [R, 1] one per row -> x's shape and dtype: every 16-element
    group quantised to NVFP4 and back, bit-equal to compressed-tensors' dynamic ``tensor_group`` input
    fake quantisation (docs/checkpoints.md §9, compressed-tensors rules). Per group: ``amax`` (of the
    group's min and max, each taken with 0, in x's dtype) divided by 6 in x's dtype, times the global
    scale in fp32, clamped to ±448 and rounded to e4m3 (0 -> 0.125), then divided by the global
    scale: ``s``. Element: ``x / s`` clamped to [-6, 6], the nearest E2M1 magnitude (ties to the even
    code) times ``sign(x / s)``, times ``s`` (fp32), one rounding to x's dtype (``dtype`` instead when
    given: float32 keeps the fp32 values the FP4 x FP4 kernel multiplies). NaN stays NaN (and a
    NaN in a group makes its scale NaN); inf becomes ±6·s. Raises ValueError naming the width when
    K is not a multiple of 16."""
    k = x.shape[-1]
    if k % NVFP4_GROUP:
        raise ValueError(f"activation width {k} is not a multiple of the FP4 group size {NVFP4_GROUP}")
    g = x.reshape(-1, k // NVFP4_GROUP, NVFP4_GROUP)  # [R, G, 16] in x's dtype
    gsc = global_scale.float().reshape(-1, 1, 1)  # never 0-dim: a 0-dim fp32 would compute in bf16
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    lo = torch.minimum(g.amin(-1, keepdim=True), zero)
    hi = torch.maximum(g.amax(-1, keepdim=True), zero)
    amax = torch.maximum(lo.abs(), hi.abs())
    block = (gsc * (amax / torch.tensor(6.0, dtype=x.dtype, device=x.device))).clamp(-E4M3_MAX, E4M3_MAX)
    block = block.to(torch.float8_e4m3fn).float()
    s = torch.where(block == 0, NVFP4_CT_ZERO_BLOCK_SCALE, block) / gsc
    v = (g / s).clamp(-6.0, 6.0)
    mag = v.abs()
    q = torch.where(mag.isnan(), mag, round_e2m1(mag)) * torch.sign(v)
    return (q * s).reshape(x.shape).to(dtype or x.dtype)


def quantize_activations(x: torch.Tensor, scheme: ActivationScheme | None,
                         input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """THE activation seam of W4A4 (docs/checkpoints.md §9): a quantised linear's input x [R, K] act
    -> quantised-then-dequantised x, same shape and dtype. ``scheme`` None returns x itself (W4A16);
    MXFP4 ignores ``input_scale``; NVFP4 needs it (fp32 scalar or [R, 1], ValueError otherwise);
    NVFP4_CT takes the linear's input *global* scale there (compressed-tensors ``input_global_scale``)."""
    if scheme is None:
        return x
    if scheme is ActivationScheme.MXFP4:
        return qdq_mxfp4(x)
    if input_scale is None:
        raise ValueError("NVFP4 activation quantisation needs the linear's input_scale")
    if scheme is ActivationScheme.NVFP4_CT:
        return qdq_nvfp4_ct(x, input_scale)
    return qdq_nvfp4(x, input_scale)
