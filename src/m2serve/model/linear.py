"""Bias-free linear layer holding its weight [out, in] (uninitialised until loaded), dense or as
stored in FP8 block form (``--weight-dequant runtime``, docs/checkpoints.md §6 execution choices).

On CPU, bf16 and FP8-block weights go through the packed-weight kernels (m2serve/kernels) when
they are built: same values as dequantise + ``F.linear``, up to the fp32 summation order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.act_quant import ActivationScheme, quantize_activations
from m2serve.formats.fp8 import PackedFP8
from m2serve.kernels.ops import PackedWeights, WeightFormat
from m2serve.kernels.ops import linear as packed_linear


class Linear(nn.Module):
    """``y = x · Wᵀ`` through F.linear; ``weight`` [out, in] (hub ``*.weight``).

    Unlike nn.Linear, construction does not initialise the (possibly huge) weight. :meth:`load`
    with a :class:`PackedFP8` replaces the (never filled) ``weight`` by buffers ``weight_q``
    float8_e4m3fn [out, in] and ``weight_scale_inv`` f32 [ceil(out/128), ceil(in/128)]; forward then
    computes straight from the codes (m2serve/kernels; elsewhere it dequantises per call) with the
    same values as dequantising at load. A bf16 weight with bf16 activations also uses the kernels.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.packed = False
        self.act_dtype = self.weight.dtype
        #: W4A4: (scheme, fp32 input scale or None) when this linear's input is quantised
        #: (docs/checkpoints.md §9; set after load by model/load.py ``set_activation_quant``)
        self.input_quant: tuple[ActivationScheme, torch.Tensor | None] | None = None

    def load(self, name: str, w: torch.Tensor | PackedFP8) -> None:
        """Copy hub tensor ``name`` into place: dense [out, in] (any float dtype, cast to the weight's), or
        a :class:`PackedFP8` (e4m3 [out, in] + f32 scales [ceil(out/128), ceil(in/128)], kept as is).

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
            n, k = self.weight.shape
            self.act_dtype, device = self.weight.dtype, self.weight.device
            del self.weight
            self.register_buffer("weight_q", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale_inv", torch.empty(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK),
                                                                   device=device))
            self.packed = True
        if tuple(w.scale.shape) != tuple(self.weight_scale_inv.shape):
            raise ValueError(f"{name}: FP8 scale grid {list(w.scale.shape)}, expected "
                             f"{list(self.weight_scale_inv.shape)}")
        self.weight_q.copy_(w.q)
        self.weight_scale_inv.copy_(w.scale)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype (a fresh dequantisation when held in FP8)."""
        if self.packed:
            return PackedFP8(self.weight_q, self.weight_scale_inv).dequantize(self.act_dtype)
        return self.weight

    def stored_weight(self) -> PackedWeights | None:
        """The weight as the kernels take it (one expert): FP8 block when packed, bf16 when dense bf16,
        else None (fp32 / fp16 weights stay on ``F.linear``)."""
        if self.packed:
            return PackedWeights(WeightFormat.FP8_BLOCK, self.weight_q[None], self.weight_scale_inv[None],
                                 None, FP8_BLOCK, FP8_BLOCK)
        if self.weight.dtype == torch.bfloat16:
            return PackedWeights(WeightFormat.BF16, self.weight[None])
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], same dtype."""
        if self.input_quant is not None:  # W4A4: quantise-dequantise the input first (§9)
            x = quantize_activations(x, *self.input_quant)
        stored = self.stored_weight() if x.dtype == self.act_dtype else None
        return F.linear(x, self.dense_weight()) if stored is None else packed_linear(x, stored)
