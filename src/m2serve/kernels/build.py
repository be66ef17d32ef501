"""Build, cache and load the CPU kernels (csrc/: packed_linear.cpp, copy_check.cpp, w4a4_linear.cpp), and
pick the ISA.

The C++ is compiled once with ``torch.utils.cpp_extension`` (ninja) into a cache directory keyed
by the sources' hash and the torch / Python versions, under a file lock so that ``cpu:N`` ranks
started together build it once; later processes just load the shared library. ``m2serve
build-kernels`` does the same ahead of time. Any failure (no compiler, no headers, failed build,
a CPU without the requested ISA) leaves :func:`kernel_backend` reporting the pure-PyTorch
backend with the reason, for the start banner.

Environment: ``M2SERVE_CPU_ISA`` = ``avx512`` | ``avx2`` | ``scalar`` forces an ISA (the default
is the widest the CPU has); ``avx512f`` (AVX-512 F/BW/VL/DQ kernels without the AVX512_BF16 dot
products and VBMI tables) and ``avx512bf16`` (without the VBMI tables) run the AVX-512 paths of a CPU
that lacks those extensions on one that has them (docs/kernels.md §6); ``none`` disables the
kernels (the previous dequantise + aten path, kept as a benchmark switch). ``M2SERVE_GEMV_ROWS``
(a positive integer) overrides the row count up to which bf16 weights with bf16 activations stay on
the GEMV path
(:func:`bf16_gemv_rows`; a benchmark switch). ``M2SERVE_KERNEL_CACHE`` moves the cache (default
``~/.cache/m2serve/kernels``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / f for f in ("packed_linear.cpp", "copy_check.cpp",
                                                                  "w4a4_linear.cpp"))
LIBRARY = "m2serve_kernels"
#: ISA name -> the kernels' code (packed_linear.cpp ``Isa``), narrowest first: ``avx512f`` and
#: ``avx512bf16`` are the AVX-512 kernels without the CPU's extra paths (module docstring)
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512f": 3, "avx512bf16": 4, "avx512": 2}
ISA_ENV = "M2SERVE_CPU_ISA"
CACHE_ENV = "M2SERVE_KERNEL_CACHE"
GEMV_ROWS_ENV = "M2SERVE_GEMV_ROWS"
#: Rows up to which an expert (or a bf16 linear) stays on the kernels' GEMV path, which reads each
#: weight once for all its rows; an expert with more decodes tiles and runs at::mm, a bf16 linear
#: with more runs F.linear (docs/kernels.md §6 "Where the GEMV stops").
GEMV_ROWS = 16
#: The same for bf16 weights with bf16 activations on a CPU whose oneDNN GEMM runs AMX-BF16 tiles:
#: there at::mm beats the GEMV's AVX-512 BF16 dot products from 5 rows on (docs/kernels.md §6).
GEMV_ROWS_AMX = 4


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """Which CPU linear backend this process uses.

    name: ``cpu-avx512`` | ``cpu-avx2`` | ``cpu-scalar`` (the C++ kernels) or ``pytorch``
    (dequantise + aten); isa: the kernels' ISA code (``ISA_CODES``), None for ``pytorch``;
    reason: why this backend (for the start banner); bf16_gemv_rows: the GEMV row limit for bf16
    weights with bf16 activations (:func:`bf16_gemv_rows`; every other case uses ``GEMV_ROWS``).
    """

    name: str
    isa: int | None
    reason: str
    bf16_gemv_rows: int = GEMV_ROWS

    @property
    def available(self) -> bool:
        return self.isa is not None

    def gemv_rows(self, bf16_weight: bool, act_dtype: torch.dtype) -> int:
        """Rows up to which a weight stays on the kernels' GEMV path: ``bf16_gemv_rows`` for a bf16
        weight (ops.py ``WeightFormat.BF16``, which at::mm reads as it is) with bf16 activations,
        else ``GEMV_ROWS`` (a packed format's tile decode costs more than AMX saves)."""
        return self.bf16_gemv_rows if bf16_weight and act_dtype == torch.bfloat16 else GEMV_ROWS

    def banner(self) -> str:
        rows = f"; bf16 GEMV up to {self.bf16_gemv_rows} rows" if self.available else ""
        return f"CPU linear backend: {self.name} ({self.reason}{rows})"


def cache_dir() -> Path:
    """Build directory of these sources + torch + Python (``$M2SERVE_KERNEL_CACHE`` overrides the root)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "m2serve" / "kernels")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES)).hexdigest()[:12]
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    return root / tag.replace("+", "_")


def _library_path(build_dir: Path) -> Path:
    return build_dir / f"{LIBRARY}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels if this cache has no library yet (printing 'building CPU kernels (once)'),
    under a file lock; return the shared library's path. Raises whatever the toolchain raises
    (RuntimeError for a failed build, OSError/FileNotFoundError for a missing compiler)."""
    from filelock import FileLock  # torch's own dependency
    from torch.utils import cpp_extension

    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir / "build.lock")):
        lib = _library_path(build_dir)
        if lib.exists():
            return lib
        print("building CPU kernels (once)", file=sys.stderr, flush=True)
        cpp_extension.load(name=LIBRARY, sources=[str(f) for f in SOURCES], build_directory=str(build_dir),
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=verbose)
        return lib


def _register_fake() -> None:
    @torch.library.register_fake(f"{LIBRARY}::grouped_linear")
    def _(x, offsets, q, scale, scale2, fmt, block_n, block_k, isa, tile_n, gemv_rows, mm_tile_n):
        return x.new_empty(x.shape[0], q.shape[1])

    @torch.library.register_fake(f"{LIBRARY}::w4a4_linear")
    def _(x, offsets, q, scale, scale2, fmt, act, act_scale, path, tile_n):
        return x.new_empty(x.shape[0], q.shape[1])

    @torch.library.register_fake(f"{LIBRARY}::w4a4_quantize")
    def _(x, offsets, fmt, act, act_scale, path):
        return x.new_empty(x.shape, dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def load_library() -> str | None:
    """Build (if needed) and load the kernels once per process; None on success, else the reason."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"no kernels for {platform.machine()} CPUs"
    compiler = os.environ.get("CXX", "c++")
    lib = _library_path(cache_dir())
    if not lib.exists() and shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH); install g++ and rerun"
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:  # noqa: BLE001 - any toolchain failure means: fall back, say why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"kernel build failed: {first[:200]}"
    _register_fake()
    return None


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs kernels of ``isa`` (``ISA_CODES`` key). Needs the library loaded."""
    return bool(torch.ops.m2serve_kernels.isa_supported(ISA_CODES[isa]))


def supported_isas() -> list[str]:
    """ISAs of ``ISA_CODES`` this CPU runs (empty when the kernels are unavailable)."""
    if load_library() is not None:
        return []
    return [isa for isa in ISA_CODES if isa_supported(isa)]


@functools.lru_cache(maxsize=1)
def kernel_backend() -> KernelBackend:
    """The backend for packed and bf16 CPU linears in this process (cached; reads ``M2SERVE_CPU_ISA``).

    Raises ValueError naming ``M2SERVE_CPU_ISA`` and its accepted values for an unknown value.
    """
    return select_backend(os.environ.get(ISA_ENV, "").strip().lower())


def onednn_isa_allows_amx(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``) leaves
    AMX on: unset, ``ALL`` / ``DEFAULT``, or a name containing ``AMX`` (``AVX512_CORE_AMX``,
    ``AVX10_1_512_AMX_FP16``, ...; oneDNN's ``dnnl_cpu_isa_t`` names). A lower cap such as
    ``AVX512_CORE_BF16`` keeps oneDNN's GEMMs on the vector units, as on a CPU without AMX."""
    raw = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return raw in ("", "ALL", "DEFAULT") or "AMX" in raw


def amx_bf16_usable() -> bool:
    """Whether bf16 GEMMs here run on AMX-BF16 tiles: the CPU has them (CPUID through ``torch.cpu``),
    torch has oneDNN (and it is enabled), oneDNN's ISA cap allows them (:func:`onednn_isa_allows_amx`),
    and the OS lets this process use them (the ``arch_prctl`` permission request torch makes for
    oneDNN)."""
    if not onednn_isa_allows_amx():
        return False
    try:
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
        return (bool(caps.get("amx_bf16", False)) and torch.backends.mkldnn.is_available()
                and torch.backends.mkldnn.enabled and bool(torch._C._cpu._init_amx()))
    except (AttributeError, RuntimeError):  # a torch without these probes: assume no AMX
        return False


def bf16_gemv_rows(amx: bool | None = None) -> int:
    """The GEMV row limit for bf16 weights with bf16 activations: ``$M2SERVE_GEMV_ROWS`` when set, else
    ``GEMV_ROWS_AMX`` where ``amx`` (default :func:`amx_bf16_usable`), else ``GEMV_ROWS``.

    Raises ValueError naming ``M2SERVE_GEMV_ROWS`` for a value that is not a positive integer."""
    raw = os.environ.get(GEMV_ROWS_ENV, "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise ValueError(f"{GEMV_ROWS_ENV}={raw!r}: use a positive integer (rows)")
        return int(raw)
    return GEMV_ROWS_AMX if (amx_bf16_usable() if amx is None else amx) else GEMV_ROWS


def select_backend(requested: str) -> KernelBackend:
    """Backend for an ``M2SERVE_CPU_ISA`` value ('' = the widest ISA the CPU has); its bf16 GEMV row
    limit from :func:`bf16_gemv_rows`."""
    if requested not in ("", "none", *ISA_CODES):
        raise ValueError(f"{ISA_ENV}={requested!r}: use avx512, avx512bf16, avx512f, avx2, scalar or none "
                         f"(unset = widest)")
    if requested == "none":
        return KernelBackend("pytorch", None, f"{ISA_ENV}=none")
    reason = load_library()
    if reason is not None:
        return KernelBackend("pytorch", None, reason)
    if requested:
        if not isa_supported(requested):
            return KernelBackend("pytorch", None, f"{ISA_ENV}={requested} but this CPU lacks it")
        return KernelBackend(f"cpu-{requested}", ISA_CODES[requested], f"{ISA_ENV}={requested}",
                             bf16_gemv_rows())
    best = next(isa for isa in ("avx512", "avx2", "scalar") if isa_supported(isa))
    return KernelBackend(f"cpu-{best}", ISA_CODES[best], "widest ISA this CPU supports", bf16_gemv_rows())


def build_kernels_main() -> int:
    """``m2serve build-kernels``: build (or find) the kernels and print the backend; exit 1 with the
    reason when they cannot be built."""
    reason = load_library()
    if reason is not None:
        print(f"m2serve build-kernels: {reason}; CPU linears will use the pure-PyTorch path", file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {cache_dir()}")
    print(kernel_backend().banner())
    return 0
