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
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from m2serve.config.engine_args import FP8_LINEAR_MODES
from m2serve.formats.act_quant import ActivationScheme
from m2serve.kernels.build import GEMV_ROWS, KernelBackend
from m2serve.kernels.ops import W4A4_SCHEMES, WeightFormat, w4a4_path

#: The module of the Triton FP8 linear, imported only when a module is given that choice
#: (docs/kernels.md §1: nothing imports the Triton package eagerly).
TRITON_FP8_LINEAR = "m2serve.kernels.triton.fp8_linear"
#: The module of the Triton fused MoE (docs/kernels.md §5), imported only when experts are given it.
TRITON_MOE = "m2serve.kernels.triton.moe"
#: Compute capability from which GPUs have FP8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell).
FP8_TENSOR_CORES = (8, 9)


class LinearImpl(enum.Enum):
    """How a module computes ``x · dequant(W)ᵀ``.

    CPU_PACKED: the C++ kernels (``m2serve_kernels::grouped_linear``) straight from the stored codes.
    CPU_W4A4: FP4 experts with FP4 activations (W4A4): the C++ FP4 x FP4 kernels
    (``m2serve_kernels::w4a4_linear``, docs/checkpoints.md §9.1) quantise each input row themselves.
    TRITON: the Triton GPU kernels on the stored codes (:func:`triton_formats`: FP8 block linears,
    experts in every stored format through the fused MoE).
    TORCH: the reference, dequantise on the weights' device with
    formats/' formulas then aten (``F.linear`` / ``grouped_mm``); a dense weight is used as is.
    """

    CPU_PACKED = "cpu-packed"
    CPU_W4A4 = "cpu-w4a4"
    TRITON = "triton"
    TORCH = "torch"


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One module's implementation. ``isa``: the CPU kernels' ISA code (build.py ``ISA_CODES``) for
    CPU_PACKED, the kernels/ops.py ``W4A4Path`` for CPU_W4A4, else None. ``mode``: the Triton FP8
    linear's ``w8a16`` / ``w8a8`` for TRITON, else
    None. ``label``: what the start banner prints (e.g. ``cpu-avx512``, ``triton-w8a16``, ``torch``).
    ``gemv_rows``: for CPU_PACKED, the rows up to which the kernels' GEMV path runs (build.py
    ``KernelBackend.gemv_rows`` of the format and activation dtype); more go to a GEMM."""

    impl: LinearImpl
    isa: int | None = None
    label: str = "torch"
    mode: str | None = None
    gemv_rows: int = GEMV_ROWS


TORCH_CHOICE = KernelChoice(LinearImpl.TORCH)

#: Activation dtypes the CPU kernels take (packed_linear.cpp).
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def triton_formats(device: torch.device, grouped: bool = False) -> frozenset[WeightFormat]:
    """Weight formats the Triton kernels run on ``device`` when Triton is installed, else none (the
    torch reference): on CUDA, FP8_BLOCK linears (docs/kernels.md §4) and, for a layer's experts
    (``grouped``), every stored format through the fused MoE (docs/kernels.md §5)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return frozenset()
    return frozenset(WeightFormat) if grouped else frozenset({WeightFormat.FP8_BLOCK})


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device`` (major, minor)."""
    return torch.cuda.get_device_capability(device)


def triton_fp8_linear() -> Callable[..., torch.Tensor]:
    """The Triton FP8 linear's launcher (kernels/triton/fp8_linear.py ``fp8_linear``), imported now."""
    return importlib.import_module(TRITON_FP8_LINEAR).fp8_linear


def triton_fused_moe() -> Callable[..., torch.Tensor]:
    """The Triton fused MoE's launcher (kernels/triton/moe.py ``fused_moe``), imported now."""
    return importlib.import_module(TRITON_MOE).fused_moe


def choose_impl(device: torch.device | str, fmt: WeightFormat | None, act_dtype: torch.dtype,
                backend: KernelBackend, fp8_linear: str = "w8a16", grouped: bool = False,
                act_scheme: ActivationScheme | None = None) -> KernelChoice:
    """The implementation for weights of ``fmt`` held on ``device`` with ``act_dtype`` activations.

    CPU: the C++ kernels when ``backend`` is available, the activations are bf16 or fp32 and the
    weight is one of ``WeightFormat`` (every packed format, and bf16), with the backend's GEMV row
    limit for ``fmt`` and ``act_dtype``; else the torch reference.
    Experts (``grouped``) whose inputs are quantised (``act_scheme``, W4A4, docs/checkpoints.md §9)
    with the scheme of their FP4 format (ops.py ``W4A4_SCHEMES``): the FP4 x FP4 kernels
    (CPU_W4A4, the widest ``W4A4Path`` of ``backend``'s ISA, label e.g. ``cpu-w4a4-avx512_vnni``).
    CUDA: the Triton kernels for a format :func:`triton_formats` lists with bf16 activations
    (``fp8_linear``, EngineArgs.fp8_linear: ``w8a16`` or ``w8a8``), else the torch reference;
    ``grouped`` (a layer's experts, held as stored): the Triton fused MoE (label ``triton-moe``). Any
    other device (meta, ...): the torch reference. No tensor is touched. Raises ValueError naming
    the field for an unknown ``fp8_linear``, or ``w8a8`` on a GPU without FP8 tensor cores.
    """
    if fp8_linear not in FP8_LINEAR_MODES:
        raise ValueError(f"fp8_linear={fp8_linear!r} is not supported; use one of {FP8_LINEAR_MODES}")
    device = torch.device(device)
    if fmt is None:
        return TORCH_CHOICE
    if device.type == "cpu":
        if backend.available and act_dtype in CPU_KERNEL_DTYPES and grouped and act_scheme is not None and \
                act_scheme in W4A4_SCHEMES.get(fmt, ()):
            path = w4a4_path(backend.isa)
            return KernelChoice(LinearImpl.CPU_W4A4, int(path), f"cpu-w4a4-{path.name.lower()}")
        if backend.available and act_dtype in CPU_KERNEL_DTYPES:
            return KernelChoice(LinearImpl.CPU_PACKED, backend.isa, backend.name,
                                gemv_rows=backend.gemv_rows(fmt is WeightFormat.BF16, act_dtype))
        return TORCH_CHOICE
    triton_ok = act_dtype == torch.bfloat16 and fmt in triton_formats(device, grouped)
    if device.type == "cuda" and triton_ok and grouped:
        return KernelChoice(LinearImpl.TRITON, None, "triton-moe")
    if device.type == "cuda" and triton_ok:
        if fp8_linear == "w8a8" and device_capability(device) < FP8_TENSOR_CORES:
            raise ValueError(f"fp8_linear=w8a8 needs FP8 tensor cores (compute capability >= "
                             f"{FP8_TENSOR_CORES}); {device} has {device_capability(device)}: use w8a16")
        return KernelChoice(LinearImpl.TRITON, None, f"triton-{fp8_linear}", fp8_linear)
    return TORCH_CHOICE
