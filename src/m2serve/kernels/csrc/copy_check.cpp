// Copy checkpoint bytes and look for non-finite codes in the same pass (formats/finite.py).
//
// m2serve_kernels::copy_check(dst, src, mask) copies src [R, C] into the contiguous dst [R, C]
// (same integer dtype: uint8, int16 or int32, the stored element's width) and returns whether any
// element has every bit of `mask` set (the exponent field of bf16 / fp16 / fp32, 0x7F for the FP8
// e4m3 NaN codes 0x7F / 0xFF, 0xFF for the E8M0 NaN code). src may be a column slice: its rows are
// contiguous (stride(1) == 1), row stride anything; src and dst must not overlap. One loop loads each
// vector, stores it and folds it into a running minimum while it is in a register, so the check adds
// two ALU ops per vector (and-not, min) to the copy and no pass over memory (a memcpy followed by a
// test of each block while in L1 was slower than torch's own copy in benchmarks/load_check.py's reads
// column; this loop matches it); threads split the rows (or the elements of a contiguous src) with
// at::parallel_for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per parallel task

// Copies s[0, n) to d and returns min over i of (~s[i] & mask): 0 exactly when some element has
// every bit of mask set. Load, store and a min reduction: the loop vectorises (pminub / pminuw /
// pminud). The body is compiled once per ISA through target attributes and picked by a run-time CPU
// check, as packed_linear.cpp does (no -march flags, and no ifunc / target_clones, which some C
// libraries, e.g. musl, lack).
template <typename U>
__attribute__((always_inline)) inline U copy_min_body(const U* __restrict__ s, U* __restrict__ d, int64_t n,
                                                      U mask) {
  U m = mask;
  for (int64_t i = 0; i < n; ++i) {
    const U x = s[i];
    d[i] = x;
    const U y = static_cast<U>(~x & mask);
    m = y < m ? y : m;
  }
  return m;
}

template <typename U>
__attribute__((target("avx512f,avx512bw"))) U copy_min_avx512(const U* s, U* d, int64_t n, U mask) {
  return copy_min_body(s, d, n, mask);
}

template <typename U>
__attribute__((target("avx2"))) U copy_min_avx2(const U* s, U* d, int64_t n, U mask) {
  return copy_min_body(s, d, n, mask);
}

enum class Isa { kAvx512, kAvx2, kBaseline };

Isa cpu_isa() {
  static const Isa isa = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                             ? Isa::kAvx512
                             : (__builtin_cpu_supports("avx2") ? Isa::kAvx2 : Isa::kBaseline);
  return isa;
}

// Copy n elements; true when one of them has every bit of mask set.
template <typename U>
bool copy_run(const U* s, U* d, int64_t n, U mask) {
  switch (cpu_isa()) {
    case Isa::kAvx512: return copy_min_avx512(s, d, n, mask) == 0;
    case Isa::kAvx2: return copy_min_avx2(s, d, n, mask) == 0;
    default: return copy_min_body(s, d, n, mask) == 0;
  }
}

template <typename U>
bool copy_check_impl(const at::Tensor& dst, const at::Tensor& src, int64_t mask64) {
  const U mask = static_cast<U>(mask64);
  const int64_t R = src.size(0), C = src.size(1), row_stride = src.stride(0);
  const U* s = static_cast<const U*>(src.const_data_ptr());
  U* d = static_cast<U*>(dst.mutable_data_ptr());
  std::atomic<bool> bad{false};
  if (row_stride == C || R == 1) {  // contiguous: split the flat range
    at::parallel_for(0, R * C, kGrain, [&](int64_t b, int64_t e) {
      if (copy_run(s + b, d + b, e - b, mask)) bad.store(true, std::memory_order_relaxed);
    });
  } else {
    at::parallel_for(0, R, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        if (copy_run(s + r * row_stride, d + r * C, C, mask)) bad.store(true, std::memory_order_relaxed);
      }
    });
  }
  return bad.load();
}

bool copy_check(at::Tensor dst, const at::Tensor& src, int64_t mask) {
  TORCH_CHECK(src.dim() == 2 && dst.dim() == 2 && src.sizes() == dst.sizes(),
              "copy_check: src and dst must both be [R, C] of one shape");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "copy_check: src and dst dtypes differ");
  TORCH_CHECK(dst.is_contiguous() && (src.size(1) <= 1 || src.stride(1) == 1),
              "copy_check: dst must be contiguous and src rows contiguous");
  if (src.numel() > 0) {  // the copy loop assumes disjoint ranges (__restrict__)
    const char* s0 = static_cast<const char*>(src.const_data_ptr());
    const char* s1 = s0 + ((src.size(0) - 1) * src.stride(0) + src.size(1)) * src.element_size();
    const char* d0 = static_cast<const char*>(dst.const_data_ptr());
    const char* d1 = d0 + dst.nbytes();
    TORCH_CHECK(d1 <= s0 || s1 <= d0, "copy_check: src and dst overlap");
  }
  switch (src.scalar_type()) {
    case at::kByte: return copy_check_impl<uint8_t>(dst, src, mask);
    case at::kShort: return copy_check_impl<uint16_t>(dst, src, mask);
    case at::kInt: return copy_check_impl<uint32_t>(dst, src, mask);
    default: TORCH_CHECK(false, "copy_check: src must be uint8, int16 or int32, got ", src.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(m2serve_kernels, m) { m.def("copy_check(Tensor(a!) dst, Tensor src, int mask) -> bool"); }

TORCH_LIBRARY_IMPL(m2serve_kernels, CPU, m) { m.impl("copy_check", &copy_check); }
