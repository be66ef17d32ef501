"""The pass after loading that fixes every linear's and expert group's implementation
(docs/checkpoints.md §6 "Execution choices", kernels/choice.py).

``choose_kernels`` visits each :class:`~m2serve.model.linear.Linear` and
:class:`~m2serve.model.experts.MiniMaxM2Experts` once, asks kernels/choice.py ``choose_impl`` with the
module's device, weight format and activation dtype, and stores the answer on the module: the
forward never asks again. The returned :class:`KernelSummary` is what the start banner lists.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from m2serve.kernels.build import KernelBackend, kernel_backend
from m2serve.kernels.choice import TORCH_CHOICE, LinearImpl, choose_impl
from m2serve.model.experts import MiniMaxM2Experts
from m2serve.model.linear import Linear


@dataclass(slots=True)
class KernelSummary:
    """How many modules got each implementation: ``counts[(kind, format, label)]``, kind ``linear``
    or ``experts``, format a WeightFormat name or the dense dtype (``dense float32``)."""

    counts: Counter = field(default_factory=Counter)

    def banner(self) -> str:
        """e.g. ``kernels: linear FP8_BLOCK cpu-avx512 x8, linear BF16 cpu-avx512 x1, experts
        FP8_BLOCK cpu-avx512 x2`` (sorted, so equal models print equal lines)."""
        parts = [f"{kind} {fmt} {label} x{n}" for (kind, fmt, label), n in sorted(self.counts.items())]
        return "kernels: " + (", ".join(parts) if parts else "none")


def _device(module: nn.Module) -> torch.device:
    return next(t.device for t in (*module.parameters(), *module.buffers()))


def choose_kernels(model: nn.Module, backend: KernelBackend | None = None,
                   fp8_linear: str = "w8a16") -> KernelSummary:
    """Give every Linear and MiniMaxM2Experts under ``model`` (``model`` itself included) its
    implementation, once, from (device, weight format, activation dtype, ``backend``; default
    :func:`kernel_backend`; ``fp8_linear``, EngineArgs.fp8_linear). Call after the weights are
    loaded (a module learns its format then) and after the W4A4 activation quantisation is set
    (experts with FP4 inputs get the FP4 x FP4 kernels on CPU); returns the summary for the
    banner, also kept as ``model.kernel_summary``. Raises ValueError as kernels/choice.py ``choose_impl``."""
    backend = backend if backend is not None else kernel_backend()
    summary = KernelSummary()
    for module in model.modules():
        if isinstance(module, Linear):
            kind, act = "linear", module.act_dtype
        elif isinstance(module, MiniMaxM2Experts):
            kind, act = "experts", module.act_dtype
        else:
            continue
        fmt = module.weight_format()
        choice = choose_impl(_device(module), fmt, act, backend, fp8_linear, grouped=kind == "experts",
                             act_scheme=getattr(module, "act_scheme", None))
        if choice.impl is LinearImpl.TRITON and getattr(module, "act_scheme", None) is not None:
            # W4A4 experts: the fused MoE does not quantise its inputs yet (docs/checkpoints.md §9,
            # the seam formats/act_quant.py quantize_activations), so they keep the torch reference
            choice = TORCH_CHOICE
        module.set_choice(choice)
        name = fmt.name if fmt is not None else f"dense {str(act).removeprefix('torch.')}"
        summary.counts[(kind, name, choice.label)] += 1
    model.kernel_summary = summary
    return summary
