"""Linears over weights kept as stored: ``y = x · dequant(W)ᵀ`` (docs/checkpoints.md §6), one expert or many.

Legend: E experts (1 for a plain linear), R activation rows sorted by expert, N output features,
K input features, I_loc an expert's intermediate width on this rank.

On CPU with the kernels built (build.py), every call is one ``m2serve_kernels::grouped_linear``:
each weight is decoded in registers with the spec formula in fp32, rounded once to the activation
dtype, and accumulated in fp32, so the result equals ``x · dequantize(W, x.dtype)ᵀ`` up to the order
of the fp32 summation. Elsewhere (no kernels, CUDA, fp16) the same functions dequantise with
formats/ (pure PyTorch) and call ``F.linear``: same values, same contract.

``batch_invariant=True`` (the batch-invariant mode, docs/model.md §7) makes a row's result independent
of the other rows of the call: the kernels keep every row on their GEMV path (whose fp32 summation
order per row is fixed), and where they do not run, :func:`rowwise_linear` does one GEMV per row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m2serve.config.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP
from m2serve.formats.act_quant import ActivationScheme
from m2serve.formats.finite import CopyCheck, copy_check_torch
from m2serve.formats.fp4 import (
    FP4Scheme,
    PackedFP4,
    decode_e8m0,
    dequantize_mxfp4,
    dequantize_nvfp4_ct,
    dequantize_nvfp4_modelopt,
)
from m2serve.formats.fp8 import PackedFP8, dequantize_fp8_block
from m2serve.kernels.build import GEMV_ROWS, ISA_CODES, KernelBackend, kernel_backend

TILE_N = 16  # output rows per GEMV task: E x N/TILE_N tasks keep every thread streaming at 8 rows/expert
MM_TILE_N = 4096  # weight rows decoded per at::mm of a many-row expert (bounds the temporary tile)
#: The C++ kernels take an FP8 ``block_k`` that is a multiple of this (packed_linear.cpp grouped_linear).
KERNEL_K_STEP = 16


class WeightFormat(enum.IntEnum):
    """Storage of a :class:`PackedWeights` (the C++ format codes)."""

    BF16 = 0
    FP8_BLOCK = 1
    NVFP4_MODELOPT = 2
    NVFP4_CT = 3
    MXFP4 = 4


#: The WeightFormat of each FP4 scheme (formats/fp4.py).
FP4_FORMATS = {FP4Scheme.NVFP4_MODELOPT: WeightFormat.NVFP4_MODELOPT,
               FP4Scheme.NVFP4_CT: WeightFormat.NVFP4_CT, FP4Scheme.MXFP4: WeightFormat.MXFP4}


@dataclass(slots=True)
class PackedWeights:
    """E linear weights [N, K] as stored, stacked along a leading expert dim.

    fmt BF16: q bf16 [E, N, K], scale None. FP8_BLOCK: q float8_e4m3fn [E, N, K], scale f32
    [E, ceil(N/block_n), K/block_k] (``weight_scale_inv``, multiplied; block_n x block_k is 128 x 128
    as stored, or a finer grid from formats/fp8.py ``refine_fp8_grid`` for a TP slice that splits a
    band). NVFP4_*: q uint8 [E, N, K/2] (low nibble = even column), scale float8_e4m3fn
    [E, N, K/block_k], scale_2 f32 [E] or [E, N] (per
    output row, e.g. w1 rows then w3 rows; ModelOpt ``weight_scale_2`` multiplier / compressed-tensors
    ``weight_global_scale`` divisor). MXFP4: q uint8
    [E, N, K/2], scale uint8 E8M0 [E, N, K/block_k]. block_n / block_k: the format's block (FP8) or
    group (FP4, block_n = 1) sizes from formats/.
    """

    fmt: WeightFormat
    q: torch.Tensor
    scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    block_n: int = 1
    block_k: int = 1

    @property
    def num_experts(self) -> int:
        return self.q.shape[0]

    @property
    def out_features(self) -> int:
        return self.q.shape[1]

    @property
    def in_features(self) -> int:
        packed = self.fmt in (WeightFormat.NVFP4_MODELOPT, WeightFormat.NVFP4_CT, WeightFormat.MXFP4)
        return self.q.shape[2] * (2 if packed else 1)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes + scales): what one pass over all E weights reads."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.scale_2) if t is not None)

    def dequantize(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s dense [N, K] of ``dtype`` by formats/' pure-PyTorch formulas (one rounding)."""
        q = self.q[e]
        if self.fmt is WeightFormat.BF16:
            return q.to(dtype)
        if self.fmt is WeightFormat.FP8_BLOCK:
            return dequantize_fp8_block(q, self.scale[e], dtype, (self.block_n, self.block_k))
        if self.fmt is WeightFormat.MXFP4:
            return dequantize_mxfp4(q, self.scale[e], dtype)
        fn = dequantize_nvfp4_modelopt if self.fmt is WeightFormat.NVFP4_MODELOPT else dequantize_nvfp4_ct
        s2 = self.scale_2[e]
        if s2.dim() == 0:
            return fn(q, self.scale[e], s2, dtype)
        # per-row scale_2: dequantise each run of rows sharing one value (w1 rows, then w3 rows)
        starts = [0, *(torch.nonzero(s2[1:] != s2[:-1]).flatten() + 1).tolist(), len(s2)]
        return torch.cat([fn(q[a:b], self.scale[e][a:b], s2[a], dtype) for a, b in zip(starts, starts[1:])])

    @classmethod
    def concat_rows(cls, parts: list[PackedWeights]) -> PackedWeights:
        """Stack the output rows of same-format weights, expert by expert: [E, N_1 + N_2 + ..., K]
        (w13 from w1 and w3). NVFP4 scale_2 becomes per row [E, N]. Raises ValueError naming the
        mismatch for different formats, expert counts or K, or an FP8 part whose rows do not fill
        whole scale blocks."""
        first = parts[0]
        for p in parts:
            if (p.fmt, p.num_experts, p.in_features, p.block_k) != (first.fmt, first.num_experts,
                                                                   first.in_features, first.block_k):
                raise ValueError(f"concat_rows: {p.fmt.name} [{p.num_experts}, {p.out_features}, "
                                 f"{p.in_features}] does not match {first.fmt.name} [{first.num_experts}, "
                                 f"{first.out_features}, {first.in_features}]")
            if p.fmt is WeightFormat.FP8_BLOCK and p.out_features % p.block_n:
                raise ValueError(f"concat_rows: FP8 part with {p.out_features} rows is not a multiple of "
                                 f"the {p.block_n}-row scale block")
        scale = None if first.scale is None else torch.cat([p.scale for p in parts], dim=1)
        s2 = None
        if first.scale_2 is not None:
            rows = [p.scale_2 if p.scale_2.dim() == 2 else p.scale_2[:, None].expand(-1, p.out_features)
                    for p in parts]
            s2 = torch.cat(rows, dim=1).contiguous()
        return cls(first.fmt, torch.cat([p.q for p in parts], dim=1), scale, s2, first.block_n, first.block_k)

    @classmethod
    def stack(cls, weights: list[torch.Tensor | PackedFP8 | PackedFP4]) -> PackedWeights:
        """Stack E same-format weights (each [N, K] as loaded: bf16 tensor, PackedFP8 or PackedFP4).

        Raises ValueError naming the first weight of another format, scheme or shape, for
        dense weights that are not bf16, and for an MXFP4 scale holding the E8M0 NaN code.
        """
        first = weights[0]
        for w in weights[1:]:
            if type(w) is not type(first) or tuple(w.shape) != tuple(first.shape) or (
                    isinstance(w, PackedFP4) and w.scheme is not first.scheme):
                raise ValueError(f"{getattr(w, 'name', 'weight')}: cannot stack with "
                                 f"{getattr(first, 'name', 'weight')} (format, scheme or shape differ)")
        if isinstance(first, PackedFP8):
            return cls(WeightFormat.FP8_BLOCK, torch.stack([w.q for w in weights]),
                       torch.stack([w.scale.float() for w in weights]), None, FP8_BLOCK, FP8_BLOCK)
        if isinstance(first, PackedFP4):
            fmt = FP4_FORMATS[first.scheme]
            if fmt is WeightFormat.MXFP4:
                for w in weights:
                    decode_e8m0(w.scale, f"{w.name}_scale")  # reject NaN codes at load, not mid-request
            s2 = None if fmt is WeightFormat.MXFP4 else torch.stack([w.scale_2.float().reshape(())
                                                                     for w in weights])
            group = MXFP4_GROUP if fmt is WeightFormat.MXFP4 else NVFP4_GROUP
            return cls(fmt, torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights]),
                       s2, 1, group)
        if first.dtype != torch.bfloat16:
            raise ValueError(f"dense weights must be bfloat16 to stack, found {first.dtype}")
        return cls(WeightFormat.BF16, torch.stack(list(weights)))


def kernels_apply(device: torch.device | str, dtype: torch.dtype,
                  backend: KernelBackend | None = None) -> bool:
    """Whether the C++ kernels run activations of ``dtype`` on ``device``: CPU, bf16 or fp32, and
    ``backend`` (default :func:`kernel_backend`) available. Every packed format (WeightFormat) has
    a kernel, so this is also where keeping quantised weights packed pays (``--weight-dequant auto``)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    return (backend if backend is not None else kernel_backend()).available


def rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] through a dense weight w [N, K] of x's dtype -> [..., N], one GEMV per row.

    ``torch.bmm`` of the rows [R, 1, K] with the weight expanded (stride 0, no copy) to [R, K, N]:
    every row is its own one-row product, so its summation order does not depend on how many rows
    the call has (``F.linear`` picks another GEMM for another row count, and its bf16 and fp32
    results then differ in the last bits). The batch-invariant mode's path where the kernels do not
    run; it reads the weight once per row.
    """
    rows = x.reshape(-1, x.shape[-1])
    y = torch.bmm(rows.unsqueeze(1), w.t().unsqueeze(0).expand(rows.shape[0], -1, -1))
    return y.view(*x.shape[:-1], w.shape[0])


def cpu_grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: PackedWeights, isa: int,
                       batch_invariant: bool = False, gemv_rows: int = GEMV_ROWS) -> torch.Tensor:
    """:func:`grouped_linear` through the C++ op with ISA code ``isa`` (build.py ``ISA_CODES``), no
    backend query: for modules whose choice (kernels/choice.py) was made once after loading. x [R, K]
    bf16/fp32 on CPU, offsets int32 [E] -> [R, N]; rows at or past offsets[-1] give 0. An expert
    with more than ``gemv_rows`` rows (the choice's ``gemv_rows``) decodes tiles and runs at::mm.
    ``batch_invariant``: every row on the kernels' GEMV path (module docstring)."""
    scale = w.scale if w.scale is not None else w.q.new_empty(0)
    gemv_rows = max(gemv_rows, x.shape[0]) if batch_invariant else gemv_rows
    return torch.ops.m2serve_kernels.grouped_linear(
        x.contiguous(), offsets.to(torch.int32), w.q, scale, w.scale_2, int(w.fmt), w.block_n, w.block_k,
        isa, TILE_N, gemv_rows, MM_TILE_N)


def torch_grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: PackedWeights,
                         batch_invariant: bool = False) -> torch.Tensor:
    """:func:`grouped_linear` as the reference: each expert with rows is dequantised (formats/, on
    the weights' device) and run by ``F.linear`` (:func:`rowwise_linear` when ``batch_invariant``);
    one host read of ``offsets``. Rows at or past offsets[-1] give 0."""
    out = x.new_zeros(x.shape[0], w.out_features)
    dense = rowwise_linear if batch_invariant else F.linear
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = dense(x[start:end], w.dequantize(e, x.dtype))
        start = end
    return out


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: PackedWeights,
                   backend: KernelBackend | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """x [R, K] act, offsets int32 [E] (cumulative row ends, as F.grouped_mm's ``offs``) -> [R, N] act.

    Rows [offsets[e-1], offsets[e]) go through expert e; rows at or past offsets[-1] give 0.
    ``backend`` defaults to :func:`kernel_backend`; the kernels run when :func:`kernels_apply`, else
    :func:`torch_grouped_linear`. This asks per call (for tests and benchmarks comparing backends);
    the model's modules call :func:`cpu_grouped_linear` as chosen once. ``batch_invariant``: module
    docstring. Raises ValueError naming both widths when x's K does not match the weights.
    """
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weights' "
                         f"in_features {w.in_features}")
    backend = backend if backend is not None else kernel_backend()
    if kernels_apply(x.device, x.dtype, backend):
        rows = backend.gemv_rows(w.fmt is WeightFormat.BF16, x.dtype)
        return cpu_grouped_linear(x, offsets, w, backend.isa, batch_invariant, rows)
    return torch_grouped_linear(x, offsets, w, batch_invariant)


def cpu_linear(x: torch.Tensor, w: PackedWeights, isa: int, batch_invariant: bool = False,
               gemv_rows: int = GEMV_ROWS) -> torch.Tensor:
    """x [..., K] act (bf16/fp32, CPU) through the single weight of ``w`` (E = 1) -> [..., N] act,
    by the C++ op with ISA code ``isa``. A bf16 weight with more than ``gemv_rows`` rows of bf16
    activations goes straight to ``F.linear`` (one multithreaded GEMM; the kernels would only tile
    the same GEMM), unless ``batch_invariant`` (module docstring). Raises ValueError naming both
    widths when x's K does not match the weights."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weights' "
                         f"in_features {w.in_features}")
    rows = x.reshape(-1, x.shape[-1])
    if (w.fmt is WeightFormat.BF16 and x.dtype == torch.bfloat16 and rows.shape[0] > gemv_rows
            and not batch_invariant):
        return F.linear(x, w.q[0])
    offsets = torch.tensor([rows.shape[0]], dtype=torch.int32)
    y = cpu_grouped_linear(rows, offsets, w, isa, batch_invariant, gemv_rows)
    return y.view(*x.shape[:-1], w.out_features)


def linear(x: torch.Tensor, w: PackedWeights, backend: KernelBackend | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """x [..., K] act through the single weight of ``w`` (E = 1) -> [..., N] act: :func:`cpu_linear`
    when the kernels apply (``backend`` asked per call, default :func:`kernel_backend`), else the
    weight dequantised (on its device) and ``F.linear`` (:func:`rowwise_linear` when
    ``batch_invariant``). Raises ValueError as :func:`cpu_linear`."""
    backend = backend if backend is not None else kernel_backend()
    if kernels_apply(x.device, x.dtype, backend):
        rows = backend.gemv_rows(w.fmt is WeightFormat.BF16, x.dtype)
        return cpu_linear(x, w, backend.isa, batch_invariant, rows)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weights' "
                         f"in_features {w.in_features}")
    dense = rowwise_linear if batch_invariant else F.linear
    return dense(x, w.dequantize(0, x.dtype))


def dense_linear(x: torch.Tensor, w: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [..., K] act through a dense weight w [N, K] of x's dtype -> [..., N] act: ``F.linear``, or in
    the batch-invariant mode the kernels' GEMV path for a bf16 weight (E = 1 view, no copy) where
    they run, else :func:`rowwise_linear`."""
    if not batch_invariant:
        return F.linear(x, w)
    if w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and kernels_apply(x.device, x.dtype):
        return linear(x, PackedWeights(WeightFormat.BF16, w.contiguous()[None]), batch_invariant=True)
    return rowwise_linear(x, w)


def cpu_grouped_expert_ffn(x_sorted: torch.Tensor, offsets: torch.Tensor, packed_w13: PackedWeights,
                           packed_w2: PackedWeights, isa: int, batch_invariant: bool = False,
                           gemv_rows: int = GEMV_ROWS) -> torch.Tensor:
    """:func:`grouped_expert_ffn` by the C++ op with ISA code ``isa`` and GEMV row limit
    ``gemv_rows`` (no backend query)."""
    gate, up = cpu_grouped_linear(x_sorted, offsets, packed_w13, isa, batch_invariant,
                                  gemv_rows).chunk(2, dim=-1)
    return cpu_grouped_linear(F.silu(gate) * up, offsets, packed_w2, isa, batch_invariant, gemv_rows)


def grouped_expert_ffn(x_sorted: torch.Tensor, offsets: torch.Tensor, packed_w13: PackedWeights,
                       packed_w2: PackedWeights, backend: KernelBackend | None = None,
                       batch_invariant: bool = False) -> torch.Tensor:
    """SwiGLU of every active expert of a layer in two grouped calls (docs/model.md §3 step 11).

    x_sorted [R, H] act (rows sorted by local expert), offsets int32 [E_loc] cumulative row ends,
    packed_w13 [E_loc, 2·I_loc, H] (w1 rows then w3 rows), packed_w2 [E_loc, H, I_loc] -> [R, H] act:
    ``w2 · (silu(w1·x) ⊙ (w3·x))`` per expert, with the same roundings to the activation dtype as
    model/experts.py's ``expert_ffn`` on dequantised weights. ``backend`` and ``batch_invariant`` as
    for :func:`grouped_linear`.
    """
    gate, up = grouped_linear(x_sorted, offsets, packed_w13, backend, batch_invariant).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, offsets, packed_w2, backend, batch_invariant)


class W4A4Path(enum.IntEnum):
    """The FP4 x FP4 kernels' instruction paths (csrc/w4a4_linear.cpp; docs/checkpoints.md §9.1)."""

    SCALAR = 0
    AVX2 = 1  # vpmaddubsw + vpmaddwd
    AVX512_VNNI = 2  # vpdpbusd (AVX512_VNNI with F/BW/VL)


#: The activation schemes the W4A4 kernel quantises an FP4 weight format's input with (same group).
W4A4_SCHEMES = {WeightFormat.MXFP4: (ActivationScheme.MXFP4,),
                WeightFormat.NVFP4_MODELOPT: (ActivationScheme.NVFP4, ActivationScheme.NVFP4_CT),
                WeightFormat.NVFP4_CT: (ActivationScheme.NVFP4, ActivationScheme.NVFP4_CT)}
#: The kernel's code of each activation rule (csrc/w4a4_linear.cpp ``Act``).
W4A4_ACT_CODES = {ActivationScheme.MXFP4: 0, ActivationScheme.NVFP4: 1, ActivationScheme.NVFP4_CT: 2}


def w4a4_path(isa: int) -> W4A4Path:
    """The widest W4A4 path for the CPU kernels' ISA code ``isa`` (build.py ``ISA_CODES``) on this
    CPU: AVX-512 with VNNI, else AVX2, else scalar (``avx512f``, the AVX-512 kernels without the
    CPU's extensions, takes the AVX2 path). Needs the library loaded (build.py)."""
    supported = torch.ops.m2serve_kernels.w4a4_path_supported
    vnni_isas = (ISA_CODES["avx512"], ISA_CODES["avx512bf16"])
    if isa in vnni_isas and supported(int(W4A4Path.AVX512_VNNI)):
        return W4A4Path.AVX512_VNNI
    if isa >= 1 and supported(int(W4A4Path.AVX2)):
        return W4A4Path.AVX2
    return W4A4Path.SCALAR


def cpu_w4a4_grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: PackedWeights, path: int,
                            act_scale: torch.Tensor | None = None,
                            scheme: ActivationScheme | None = None) -> torch.Tensor:
    """W4A4: x [R, K] bf16/fp32 (CPU) quantised in the kernel per row to FP4 by ``scheme`` (default:
    the first of :data:`W4A4_SCHEMES` for ``w``'s format; docs/checkpoints.md §9), times the FP4
    weights ``w`` (MXFP4 or NVFP4, [E, N, K/2]) as int8 dot products per group
    (csrc/w4a4_linear.cpp, §9.1) -> [R, N] in x's dtype; offsets int32 [E] as :func:`grouped_linear`
    (rows past offsets[-1] give 0). ``act_scale`` f32 [E]: each expert's NVFP4 input scale (NVFP4_CT:
    its input global scale; None for MXFP4). ``path``: a :class:`W4A4Path` (chosen once). Equals
    ``quantize_activations(x)`` in fp32 times the fp32 dequantised weight up to the fp32 summation
    order. Raises RuntimeError (the op's check) for a non-FP4 format, a scheme that does not fit it,
    a missing NVFP4 scale or K not a multiple of the group."""
    scheme = scheme if scheme is not None else W4A4_SCHEMES.get(w.fmt, (ActivationScheme.MXFP4,))[0]
    return torch.ops.m2serve_kernels.w4a4_linear(
        x.contiguous(), offsets.to(torch.int32).contiguous(), w.q, w.scale, w.scale_2, int(w.fmt),
        W4A4_ACT_CODES[scheme], act_scale, int(path), TILE_N)


def cpu_w4a4_expert_ffn(x_sorted: torch.Tensor, offsets: torch.Tensor, packed_w13: PackedWeights,
                        packed_w2: PackedWeights, path: int,
                        act_scales: tuple[torch.Tensor | None, ...] = (None, None),
                        scheme: ActivationScheme | None = None) -> torch.Tensor:
    """:func:`grouped_expert_ffn` with both products W4A4 (:func:`cpu_w4a4_grouped_linear`): the
    input of w13 and the SwiGLU output feeding w2 are each quantised in the kernel by ``scheme``.
    ``act_scales``: NVFP4 (w13's, w2's) per-expert input (global) scales f32 [E_loc], else Nones."""
    gate, up = cpu_w4a4_grouped_linear(x_sorted, offsets, packed_w13, path, act_scales[0],
                                       scheme).chunk(2, dim=-1)
    return cpu_w4a4_grouped_linear(F.silu(gate) * up, offsets, packed_w2, path, act_scales[1], scheme)


def w4a4_quantized_inputs(x: torch.Tensor, offsets: torch.Tensor, fmt: WeightFormat,
                          act_scale: torch.Tensor | None = None, path: int = W4A4Path.SCALAR,
                          scheme: ActivationScheme | None = None) -> torch.Tensor:
    """The activations as the W4A4 kernel of ``path`` quantises and lays them out, read back and
    dequantised: x [R, K] -> fp32 [R, K] (code / 2 · group scale; rows past offsets[-1] give 0).
    For tests: it equals formats/act_quant.py's quantise-dequantise of x in fp32 bit for bit."""
    scheme = scheme if scheme is not None else W4A4_SCHEMES[fmt][0]
    return torch.ops.m2serve_kernels.w4a4_quantize(x.contiguous(), offsets.to(torch.int32).contiguous(),
                                                   int(fmt), W4A4_ACT_CODES[scheme], act_scale, int(path))


def _copy_check_kernel(dst: torch.Tensor, src: torch.Tensor, mask: int) -> bool:
    return bool(torch.ops.m2serve_kernels.copy_check(dst, src, mask))


def checkpoint_copy_check(backend: KernelBackend | None = None) -> CopyCheck:
    """The copy-and-test of checkpoint reads (formats/finite.py ``CopyCheck``): the C++ op
    ``m2serve_kernels::copy_check`` (one pass, the test on the value in a register) when the kernels
    are available (``backend``, default :func:`kernel_backend`), else formats/finite.py's
    ``copy_check_torch`` (chunked PyTorch ops)."""
    backend = backend if backend is not None else kernel_backend()
    return _copy_check_kernel if backend.available else copy_check_torch
