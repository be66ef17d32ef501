"""Bias-free linear layer holding its weight [out, in] (uninitialised until loaded), dense or as
stored in FP8 block form (``--weight-dequant runtime``, docs/checkpoints.md §6 execution choices).

The implementation is chosen once after loading (model/kernel_choice.py, kernels/choice.py) and
kept in ``choice``: on CPU, bf16 and FP8-block weights go through the packed-weight kernels
(m2serve/kernels) when they are built, with the same values as dequantise + ``F.linear`` up to the
fp32 summation order; elsewhere the torch reference. Until a choice is made the reference runs.
``batch_invariant`` (set once after load, docs/model.md §7): a row's result does not depend on the
other rows of the call (kernels/ops.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.act_quant import ActivationScheme, quantize_activations
from m2serve.formats.fp8 import PackedFP8, fp8_scale_grid, refine_fp8_grid
from m2serve.kernels.choice import TORCH_CHOICE, KernelChoice, LinearImpl, triton_fp8_linear
from m2serve.kernels.ops import (
    KERNEL_K_STEP,
    PackedWeights,
    WeightFormat,
    cpu_linear,
    dense_linear,
)


class Linear(nn.Module):
    """``y = x · Wᵀ`` through F.linear; ``weight`` [out, in] (hub ``*.weight``).

    Unlike nn.Linear, construction does not initialise the (possibly huge) weight. :meth:`load`
    with a :class:`PackedFP8` replaces the (never filled) ``weight`` by buffers ``weight_q``
    float8_e4m3fn [out, in] and ``weight_scale_inv`` f32 [ceil(out/128), ceil(in/128)]; forward then
    computes straight from the codes (m2serve/kernels; elsewhere it dequantises per call, on the
    weight's device) with the same values as dequantising at load. A bf16 weight with bf16
    activations also uses the kernels. A TP slice may start inside a scale band: ``row0`` / ``col0``
    (the PackedFP8's) are its offsets and the scale grid is [ceil((row0 + out)/128),
    ceil((col0 + in)/128)] (docs/checkpoints.md §6). ``choice`` (:meth:`set_choice`, made once after loading)
    says which; the forward asks nothing per call.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.packed = False
        self.act_dtype = self.weight.dtype
        self.batch_invariant = False  # the batch-invariant mode (module docstring)
        self.choice: KernelChoice = TORCH_CHOICE
        self._stored: PackedWeights | None = None
        self._triton: Callable[..., torch.Tensor] | None = None
        #: offsets of the first row / column inside their first 128-wide scale band: non-zero for a
        #: TP slice that splits a band (docs/checkpoints.md §6), taken from the PackedFP8 at load
        self.row0 = self.col0 = 0
        #: W4A4: (scheme, fp32 input scale or None) when this linear's input is quantised
        #: (docs/checkpoints.md §9; set after load by model/load.py ``set_activation_quant``)
        self.input_quant: tuple[ActivationScheme, torch.Tensor | None] | None = None

    def load(self, name: str, w: torch.Tensor | PackedFP8) -> None:
        """Copy hub tensor ``name`` into place: dense [out, in] (any float dtype, cast to the weight's), or
        a :class:`PackedFP8` (e4m3 [out, in] + f32 scales [ceil((row0 + out)/128), ceil((col0 + in)/128)],
        kept as is, with its offsets).

        Raises ValueError naming the tensor and both shapes on a mismatch, or for a dense tensor after
        an FP8 one."""
        want = (self.weight_q if self.packed else self.weight).shape
        if tuple(w.shape) != tuple(want):
            raise ValueError(f"{name}: got shape {list(w.shape)}, this rank expects {list(want)}")
        if not isinstance(w, PackedFP8):
            if self.packed:
                raise ValueError(f"{name}: dense weight for a linear held in FP8")
            self.weight.data.copy_(w)
            return
        if not self.packed:
            self.choice, self._stored, self._triton = TORCH_CHOICE, None, None  # void for the dense weight
            n, k = self.weight.shape
            self.act_dtype, device = self.weight.dtype, self.weight.device
            del self.weight
            self.register_buffer("weight_q", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale_inv", torch.empty(fp8_scale_grid(n, k, w.row0, w.col0),
                                                                   device=device))
            self.packed, self.row0, self.col0 = True, w.row0, w.col0
        if tuple(w.scale.shape) != tuple(self.weight_scale_inv.shape) or (w.row0, w.col0) != (self.row0,
                                                                                            self.col0):
            raise ValueError(f"{name}: FP8 scale grid {list(w.scale.shape)} at row0 {w.row0}, col0 {w.col0}, "
                             f"expected {list(self.weight_scale_inv.shape)} at row0 {self.row0}, "
                             f"col0 {self.col0}")
        self.weight_q.copy_(w.q)
        self.weight_scale_inv.copy_(w.scale)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype (a fresh dequantisation when held in FP8)."""
        if self.packed:
            return PackedFP8(self.weight_q, self.weight_scale_inv, "weight", self.row0,
                             self.col0).dequantize(self.act_dtype)
        return self.weight

    def stored_weight(self) -> PackedWeights | None:
        """The weight as the kernels take it (one expert): FP8 block when packed, bf16 when dense bf16,
        else None (fp32 / fp16 weights stay on ``F.linear``). A slice with an offset, or whose in
        width is not whole 128-column blocks, gets its scales on a finer grid from its first row
        (formats/fp8.py ``refine_fp8_grid``: b_n = gcd(128, row0), b_k = gcd(128, col0, in), the
        kernels take no offset; a few KiB, made once when the choice is made); None when that b_k
        is not a multiple of 16 (what the kernels decode)."""
        if self.packed:
            n, k = self.weight_q.shape
            if not (self.row0 or self.col0 or k % FP8_BLOCK):
                return PackedWeights(WeightFormat.FP8_BLOCK, self.weight_q[None], self.weight_scale_inv[None],
                                     None, FP8_BLOCK, FP8_BLOCK)
            bk = math.gcd(FP8_BLOCK, self.col0, k)
            if bk % KERNEL_K_STEP:
                return None
            s, bn, bk = refine_fp8_grid(self.weight_scale_inv, n, k, self.row0, self.col0, block_k=bk)
            return PackedWeights(WeightFormat.FP8_BLOCK, self.weight_q[None], s[None], None, bn, bk)
        if self.weight.dtype == torch.bfloat16:
            return PackedWeights(WeightFormat.BF16, self.weight[None])
        return None

    def weight_format(self) -> WeightFormat | None:
        """The weight's format for the kernel choice (kernels/choice.py): FP8_BLOCK when packed, BF16
        for a dense bf16 weight, None for another dense dtype (fp32 / fp16 stay on ``F.linear``)."""
        stored = self.stored_weight()
        return None if stored is None else stored.fmt

    def set_choice(self, choice: KernelChoice) -> None:
        """Run this linear by ``choice`` from now on (kernels/choice.py ``choose_impl`` for this weight's
        device, :meth:`weight_format` and ``act_dtype``). Raises ValueError naming the choice when it
        needs stored weights this linear does not have (CPU kernels: a stored weight and an ISA;
        Triton: FP8 codes)."""
        self._stored = self._triton = None
        if choice.impl is LinearImpl.CPU_PACKED:
            stored = self.stored_weight()
            if stored is None or choice.isa is None:
                raise ValueError(f"kernel choice {choice.label}: this linear has no stored weight or ISA")
            self._stored = stored
        elif choice.impl is LinearImpl.TRITON:
            if not self.packed:
                raise ValueError(f"kernel choice {choice.label}: this linear is not held in FP8")
            self._triton = partial(triton_fp8_linear(), row0=self.row0, col0=self.col0, mode=choice.mode)
        self.choice = choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] act -> [..., out] act, by ``choice`` (no backend query here)."""
        if self.input_quant is not None:  # W4A4: quantise-dequantise the input first (§9)
            x = quantize_activations(x, *self.input_quant)
        if self._stored is not None:
            return cpu_linear(x, self._stored, self.choice.isa, self.batch_invariant, self.choice.gemv_rows)
        if self._triton is not None:
            return self._triton(x, self.weight_q, self.weight_scale_inv)
        return dense_linear(x, self.dense_weight(), self.batch_invariant)
