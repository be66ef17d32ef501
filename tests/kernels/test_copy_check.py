"""The copy-and-test of checkpoint reads (formats/finite.py, kernels/csrc/copy_check.cpp).

Both implementations (the C++ op and the chunked PyTorch fallback) are checked against torch's own
decoding of every code (``isfinite`` of the value, ``isnan`` of each e4m3 byte): every non-finite
code is found, no finite code is, and the copy is exact, for whole tensors, column slices and
tensors spanning many chunks / parallel tasks. The reader is checked against safetensors' own
``load_file``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from m2serve.formats.finite import CorruptTensorError, copy_check_torch, copy_finite, nonfinite_mask
from m2serve.formats.safetensors_io import CheckpointReader
from m2serve.kernels.build import kernel_backend
from m2serve.kernels.ops import _copy_check_kernel, checkpoint_copy_check

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(params=["kernel", "torch"])
def impl(request):
    """The C++ op (what the loader uses by default here) and the PyTorch fallback."""
    if request.param == "torch":
        return copy_check_torch
    assert kernel_backend().available  # this machine builds them (tests/kernels/test_packed_linear.py)
    assert checkpoint_copy_check() is _copy_check_kernel
    return _copy_check_kernel


def _check(impl, t: torch.Tensor, encoding=None) -> tuple[bool, torch.Tensor]:
    """(hit, copy) of impl over ``t`` viewed as its stored integer codes ([R, C]); the copy comes
    back in ``t``'s shape, as those integer codes."""
    ints = INTS[t.element_size()]
    src = t.view(ints).reshape(1, -1) if t.dim() <= 1 else t.view(ints).flatten(1)
    dst = torch.empty(src.shape, dtype=ints)
    return impl(dst, src, nonfinite_mask(t.dtype, encoding)), dst.view(t.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_code(impl, dtype):
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    bad = ~torch.isfinite(codes.view(dtype).float())
    assert int(bad.sum()) == 2 * (2 ** (7 if dtype == torch.bfloat16 else 10))  # inf + NaNs, both signs
    finite = codes[~bad].view(dtype)
    hit, copy = _check(impl, finite)
    assert not hit and torch.equal(copy, finite.view(torch.int16))
    for code in codes[bad].tolist():
        t = finite[:4096].clone()
        t.view(torch.int16)[1234] = code
        assert _check(impl, t)[0], hex(code & 0xFFFF)


def test_float32(impl):
    t = torch.randn(300, 70)
    t[0, 0], t[1, 1] = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    hit, copy = _check(impl, t)
    assert not hit and torch.equal(copy, t.view(torch.int32))
    payload_nan = torch.tensor([0x7FC00001, -0x00400001], dtype=torch.int32).view(torch.float32)
    for value in (float("nan"), float("inf"), -float("inf"), *payload_nan.tolist()):
        u = t.clone()
        u[299, 69] = value
        assert not torch.isfinite(u[299, 69])
        assert _check(impl, u)[0], value


@pytest.mark.parametrize("encoding", ["e4m3", "e8m0"])
def test_every_byte_code(impl, encoding):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if encoding == "e4m3":  # torch decodes e4m3fn; docs/checkpoints.md §6
        bad = torch.isnan(codes.view(torch.float8_e4m3fn).float())
    else:  # E8M0: 2^(code - 127), 0xFF is NaN (OCP MX spec)
        bad = codes == 0xFF
    for c in range(256):
        t = torch.full((40, 33), 0x38, dtype=torch.uint8)
        t[39, 32] = c
        hit, copy = _check(impl, t, encoding)
        assert hit == bool(bad[c]), c
        if not hit:
            assert torch.equal(copy, t)


def test_column_slice_and_many_chunks(impl):
    full = torch.randn(700, 2048).to(torch.bfloat16)  # 2.8 MB: many chunks / parallel tasks
    full[5, 100] = float("nan")  # outside the slice below
    sl = full[:, 512:1024]
    hit, copy = _check(impl, sl)
    assert not hit and torch.equal(copy, sl.view(torch.int16))
    full[699, 1023] = float("inf")  # the slice's very last element
    assert _check(impl, full[:, 512:1024])[0]
    whole = torch.randn(3_000_000).to(torch.bfloat16)
    whole[-1] = float("nan")
    assert _check(impl, whole)[0]


def test_copy_finite_names_the_tensor(impl):
    t = torch.randn(8, 16)
    t[3, 5] = float("inf")
    with pytest.raises(CorruptTensorError, match=r"^f\.safetensors: w: 1 value\(s\) are NaN or inf "
                                                 r"\(first at index \[3, 5\]\)"):
        copy_finite(t, "w", impl, where="f.safetensors")


def test_reader_matches_safetensors(tiny_random_fp8_dir, impl):
    with CheckpointReader(tiny_random_fp8_dir, impl) as r:
        ref: dict[str, torch.Tensor] = {}
        for f in r.files:
            ref.update(load_file(f))
        assert set(ref) == set(r.tensors)
        def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # dtype, shape and every byte
            return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                      b.contiguous().view(torch.uint8))

        for name, want in ref.items():
            assert same(r.read(name), want), name
            if want.dim() == 2 and want.shape[0] > 2 and want.shape[1] > 2:
                assert same(r.read(name, rows=(1, want.shape[0] - 1)), want[1:-1]), name
                cols = r.read(name, cols=(1, want.shape[1] - 1))
                assert cols.is_contiguous() and same(cols, want[:, 1:-1]), name
