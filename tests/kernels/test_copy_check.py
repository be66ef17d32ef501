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


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_every_position_of_short_runs(impl, dtype):
    # the vector body (64 bytes a step with AVX-512) and its scalar tail: a bad code at each position
    # of runs 1..3 vectors + 5 long is found, and a clean run is copied exactly
    encoding = "e4m3" if dtype == torch.uint8 else None
    bad_code = {torch.uint8: 0x7F, torch.bfloat16: 0x7FC0, torch.float32: 0x7F800000}[dtype]
    per_vector = 64 // dtype.itemsize
    for n in (1, 2, per_vector - 1, per_vector, per_vector + 1, 3 * per_vector + 5):
        clean = torch.ones(n, dtype=dtype) if dtype.is_floating_point else torch.full((n,), 0x38, dtype=dtype)
        hit, copy = _check(impl, clean, encoding)
        assert not hit and torch.equal(copy, clean.view(copy.dtype)), n
        for i in range(n):
            t = clean.clone()
            t.view(INTS[dtype.itemsize])[i] = bad_code
            assert _check(impl, t, encoding)[0], (n, i)


def test_short_strided_rows(impl):
    # column slices narrower than a vector (the per-row branch): every position inside is found, a
    # bad code just outside is not, and the copy is exact
    full = torch.ones(7, 64, dtype=torch.bfloat16)
    for width in (1, 5, 33):
        sl = full[:, 3:3 + width]
        hit, copy = _check(impl, sl)
        assert not hit and torch.equal(copy, sl.contiguous().view(torch.int16)), width
        for r in range(7):
            for c in (2, 3 + width):  # just left and just right of the slice
                t = full.clone()
                t[r, c] = float("nan")
                assert not _check(impl, t[:, 3:3 + width])[0], (width, r, c)
            for c in range(3, 3 + width):
                t = full.clone()
                t[r, c] = float("inf")
                assert _check(impl, t[:, 3:3 + width])[0], (width, r, c)


def test_kernel_refuses_overlapping_src_and_dst():
    assert kernel_backend().available
    buf = torch.zeros(128, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="src and dst overlap"):
        _copy_check_kernel(buf[0:64].view(1, 64), buf[32:96].view(1, 64), 0x7F80)
    assert not _copy_check_kernel(buf[0:64].view(1, 64), buf[64:128].view(1, 64), 0x7F80)  # adjacent


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
