"""Which implementation runs a linear (or a layer's experts): chosen once, after loading
(docs/checkpoints.md §6 "Execution choices").

A module learns its weight format only when its weights are loaded, so the choice cannot be made at
construction, and making it per call would put a backend query (and the Python around it) in every
forward. model/kernel_choice.py walks the loaded model once and gives every linear and expert group
the :class:`KernelChoice` of :func:`choose_impl`; the forward then just runs it.

Inputs of the choice: the device the weights live on, the weight format (ops.py ``WeightFormat``;
None for a dense weight that is not bf16), the activation dtype, the CPU kernels' backend
(build.py) and the formats the Triton GPU kernels cover. Another input (such as a batch-invariant
mode) is another argument here, not a test in the forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from m2serve.kernels.build import KernelBackend
from m2serve.kernels.ops import WeightFormat


class LinearImpl(enum.Enum):
    """How a module computes ``x · dequant(W)ᵀ``.

    CPU_PACKED: the C++ kernels (``m2serve_kernels::grouped_linear``) straight from the stored codes.
    TRITON: the Triton GPU kernels on the stored codes (the slot of the GPU kernels: no format has
    one yet, see :func:`triton_formats`). TORCH: the reference, dequantise on the weights' device with
    formats/' formulas then aten (``F.linear`` / ``grouped_mm``); a dense weight is used as is.
    """

    CPU_PACKED = "cpu-packed"
    TRITON = "triton"
    TORCH = "torch"


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One module's implementation. ``isa``: the CPU kernels' ISA code (build.py ``ISA_CODES``) for
    CPU_PACKED, else None. ``label``: what the start banner prints (e.g. ``cpu-avx512``, ``torch``)."""

    impl: LinearImpl
    isa: int | None = None
    label: str = "torch"


TORCH_CHOICE = KernelChoice(LinearImpl.TORCH)

#: Activation dtypes the CPU kernels take (packed_linear.cpp).
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def triton_formats(device: torch.device) -> frozenset[WeightFormat]:
    """Weight formats the Triton kernels run on ``device``: none yet (the block-scaled FP8 GPU linear
    fills this slot); every GPU linear takes the torch reference until then."""
    return frozenset()


def choose_impl(device: torch.device | str, fmt: WeightFormat | None, act_dtype: torch.dtype,
                backend: KernelBackend) -> KernelChoice:
    """The implementation for weights of ``fmt`` held on ``device`` with ``act_dtype`` activations.

    CPU: the C++ kernels when ``backend`` is available, the activations are bf16 or fp32 and the
    weight is one of ``WeightFormat`` (every packed format, and bf16), else the torch reference.
    CUDA: the Triton kernels for a format :func:`triton_formats` lists, else the torch reference.
    Any other device (meta, ...): the torch reference. Pure: no tensor is touched.
    """
    device = torch.device(device)
    if fmt is None:
        return TORCH_CHOICE
    if device.type == "cpu":
        if backend.available and act_dtype in CPU_KERNEL_DTYPES:
            return KernelChoice(LinearImpl.CPU_PACKED, backend.isa, backend.name)
        return TORCH_CHOICE
    if device.type == "cuda" and fmt in triton_formats(device):
        return KernelChoice(LinearImpl.TRITON, None, "triton")
    return TORCH_CHOICE
