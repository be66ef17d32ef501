"""Every ISA of the CPU kernels this CPU runs, chosen the way a deployment chooses it — the
``M2SERVE_CPU_ISA`` environment variable read by ``kernel_backend`` when a model loads — for every
weight format, through the whole model (issue 32: the AVX2, scalar and AVX-512-without-extensions
paths run in CI, not only the widest one).

Per (format, activation dtype, ISA): the tiny-random weights in that format load with
``weight_dequant="runtime"`` under ``M2SERVE_CPU_ISA=<isa>``, every linear and expert group must
held in a kernel format must report ``cpu-<isa>`` (the kernel choice took the variable; dense fp32
weights stay on aten), and the logits of a ragged prefill
(1 to 40 tokens per sequence: GEMV rows and the decoded-tile GEMM) plus two teacher-forced decode
steps are compared with the same checkpoint under ``M2SERVE_CPU_ISA=none``: the pure-PyTorch path
(formats/' dequantisers, bit for bit the producers' formulas, then aten), the kernels' oracle.
fp32 activations: the kernels decode each weight exactly and sum in fp32, so only the summation
order differs (1e-4 relative, the bound of tests/formats' oracle comparisons). bf16 activations:
the same bf16 weights (one rounding each, both paths), but each linear's output is rounded to bf16
from a differently ordered fp32 sum, and those one-ulp differences pass through two layers; the
bound is 2% of the largest |logit| (measured here: at most 0.5%). The kernels' exact per-ISA bounds are
tests/kernels/test_packed_linear.py's; this checks that each ISA is reachable and right end to end.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from m2serve.kernels import build
from m2serve.model.load import load_model
from m2serve.model.simple_cache import SimpleKVCache

ROOT = Path(__file__).resolve().parents[2]
ISAS = build.supported_isas()
PROMPTS = [[(37 * i + 11 * s) % 97 + 3 for i in range(n)] for s, n in enumerate((1, 5, 40))]
DECODE = [[7, 19, 23], [31, 2, 64]]  # teacher-forced tokens of the two decode steps


@pytest.fixture(scope="module")
def fp4_dirs(tiny_random_dir, tmp_path_factory):
    """The tiny-random experts quantised to NVFP4 (ModelOpt) and MXFP4 (Quark) by
    benchmarks/formats.py ``build_fp4`` (any codes do: the reference reads the same checkpoint)."""
    spec = importlib.util.spec_from_file_location("bench_formats", ROOT / "benchmarks" / "formats.py")
    formats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(formats)
    root = tmp_path_factory.mktemp("isa-fp4")
    return {enc: formats.build_fp4(tiny_random_dir, root / enc, enc) for enc in ("nvfp4", "mxfp4")}


@pytest.fixture
def isa_env(monkeypatch):
    """Set ``M2SERVE_CPU_ISA`` for one load (the backend is cached per process: cleared around it)."""
    def use(isa: str) -> None:
        monkeypatch.setenv(build.ISA_ENV, isa)
        build.kernel_backend.cache_clear()
    yield use
    build.kernel_backend.cache_clear()  # before monkeypatch restores the variable: the next call rereads it


def _logits(path: Path, dtype: torch.dtype) -> tuple[torch.Tensor, set[str]]:
    model = load_model(path, dtype=dtype, weight_dequant="runtime", activation_quant="none")
    labels = {label for (_, fmt, label) in model.kernel_summary.counts if not fmt.startswith("dense")}
    cache = SimpleKVCache.create(model.config, num_pages=32, page_size=4, dtype=dtype)
    with torch.inference_mode():
        out = [model(cache.batch(list(enumerate(PROMPTS)), return_n_logits=10**6), cache.storage)]
        for toks in DECODE:
            out.append(model(cache.batch([(i, [t]) for i, t in enumerate(toks)]), cache.storage))
    return torch.cat(out).float(), labels


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("encoding", "dtype"), [("bf16", torch.bfloat16), ("fp8", torch.float32),
                                                 ("fp8", torch.bfloat16), ("nvfp4", torch.float32),
                                                 ("nvfp4", torch.bfloat16), ("mxfp4", torch.float32),
                                                 ("mxfp4", torch.bfloat16)])
def test_each_isa_through_the_environment_matches_the_torch_path(isa, encoding, dtype, isa_env,
                                                                  tiny_random_dir, tiny_random_fp8_dir,
                                                                  fp4_dirs):
    path = {"bf16": tiny_random_dir, "fp8": tiny_random_fp8_dir, **fp4_dirs}[encoding]
    isa_env("none")
    want, ref_labels = _logits(path, dtype)
    assert ref_labels == {"torch"}
    isa_env(isa)
    got, labels = _logits(path, dtype)
    assert labels == {f"cpu-{isa}"}, labels  # every kernel-format module took the variable's ISA
    err = (got - want).abs()
    if dtype == torch.float32:
        assert bool((err <= 1e-4 * want.abs().clamp(min=1.0)).all()), f"max |Δlogit| {err.max():.3g}"
    else:
        assert err.max() <= 0.02 * want.abs().max(), f"max |Δlogit| {err.max():.3g} of {want.abs().max():.3g}"
