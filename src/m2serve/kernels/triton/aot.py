"""Ahead-of-time compile of every registered kernel variant for sm_90, without a GPU
(docs/kernels.md §2).

A *variant* is one specialisation a launcher can produce: the kernel, the types of its runtime
arguments and the values of its constexprs. The interpreter runs none of Triton's compiler, so it
accepts kernels the real compiler refuses (Triton 3.6 refuses a K = 8 ``tl.dot`` the interpreter
runs); compiling every variant for the target GPU (``GPUTarget("cuda", 90, 32)``: H100 / H200,
warp 32; Triton bundles ptxas) is the check. tests/kernels/test_triton_compile.py compiles them all.

How a kernel module registers its variants (the one pattern):

1. add the module's dotted name to :data:`KERNEL_MODULES`;
2. at import, the module calls :func:`register` once per variant, e.g.::

       register(Variant("paged_attention/bf16-kv/page16", _kernel,
                        signature={"q": "*bf16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"},
                        constexprs={"BLOCK": 64}, options={"num_warps": 4}))

   ``signature`` names EVERY parameter of the ``@triton.jit`` function: pointers as ``*fp32`` /
   ``*bf16`` / ``*fp8e4nv`` / ``*i32``, scalars as ``i32`` / ``i64`` / ``fp32``, constexprs as
   ``constexpr`` with their values in ``constexprs``; ``options`` are launch options
   (``num_warps``, ``num_stages``). Register the variants the launcher really chooses.

Compiling needs ``@triton.jit`` functions, not the interpreter's: run it in a process started
with ``TRITON_INTERPRET=0`` (the package keeps an explicit setting).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNEL_MODULES: tuple[str, ...] = ("m2serve.kernels.triton.attention", "m2serve.kernels.triton.moe",
                                   "m2serve.kernels.triton.fp8_linear")
SM90 = GPUTarget("cuda", 90, 32)

_REGISTRY: dict[str, Variant] = {}


@dataclass(frozen=True, slots=True)
class Variant:
    """One compile unit: ``name`` (unique, "kernel/choice/choice"), the ``@triton.jit`` function,
    the type string of every parameter, the constexpr values and the launch options."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


def register(variant: Variant) -> Variant:
    """Add ``variant`` to the registry. Raises ValueError on a duplicate name or a signature that
    does not name exactly the kernel's parameters (a constexpr without a value included)."""
    if variant.name in _REGISTRY:
        raise ValueError(f"kernel variant {variant.name!r} registered twice")
    params = list(getattr(variant.fn, "arg_names", []))
    if params and list(variant.signature) != params:
        raise ValueError(f"variant {variant.name!r}: signature names {list(variant.signature)}, "
                         f"kernel parameters are {params}")
    missing = [k for k, t in variant.signature.items() if t == "constexpr" and k not in variant.constexprs]
    if missing:
        raise ValueError(f"variant {variant.name!r}: constexprs {missing} have no value")
    _REGISTRY[variant.name] = variant
    return variant


def all_variants() -> list[Variant]:
    """Every variant of every module in :data:`KERNEL_MODULES` (importing them registers them)."""
    for mod in KERNEL_MODULES:
        importlib.import_module(mod)
    return list(_REGISTRY.values())


def compile_sm90(variant: Variant):
    """Compile ``variant`` for sm_90 -> Triton's CompiledKernel (``.asm["cubin"]``, ``.metadata``).

    Raises TypeError when the kernel is the interpreter's (``TRITON_INTERPRET=1``) and whatever
    Triton raises for a kernel it cannot compile (CompilationError, ptxas errors).
    """
    if not isinstance(variant.fn, triton.runtime.jit.JITFunction):
        raise TypeError(f"{variant.name}: {type(variant.fn).__name__} is not compilable; import the "
                        "kernels with TRITON_INTERPRET=0")
    src = ASTSource(variant.fn, variant.signature, variant.constexprs)
    return triton.compile(src, target=SM90, options=dict(variant.options))
