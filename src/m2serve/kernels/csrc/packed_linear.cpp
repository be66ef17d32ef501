// Packed-weight CPU linears: y = x · dequant(W)ᵀ with W kept as stored (checkpoints.md §5-§6).
//
// Legend: E experts in one call (1 for a plain linear), R activation rows (sorted by expert),
// N output features, K input features, Kq stored bytes per weight row.
//
// One op, m2serve::grouped_linear, covers a dense linear (E = 1) and the grouped MoE linears:
// rows [off[e-1], off[e]) of x go through expert e's weight. Every weight element is decoded in
// registers with the spec's formula, in fp32, then rounded ONCE to the activation dtype (so the
// result equals x · dequantize(W, x.dtype)ᵀ up to the order of the fp32 summation):
//   bf16            W = bf16 value
//   FP8 block       W = fp32(e4m3 q[n, k]) * s[n / block_n, k / block_k]          (s: weight_scale_inv)
//   NVFP4 ModelOpt  W = e2m1(code) * (fp32(e4m3 ws[n, k / g]) * s2)                (s2: weight_scale_2)
//   NVFP4 c-t       W = e2m1(code) * (fp32(e4m3 ws[n, k / g]) / s2)                (s2: weight_global_scale)
//   MXFP4           W = e2m1(code) * 2^(e8m0[n, k / g] - 127)
// Block and group sizes are arguments (formats/ owns them). Small row counts stream each weight
// row once through an L1 buffer and dot it with every row (bandwidth-bound GEMV; FP8 blocks with
// fp32 dot products on AVX-512 decode each weight in registers, once for up to 8 rows); larger row
// counts decode a tile of rows to the activation dtype and hand it to at::mm. Threads split over
// (expert, output tile). On the GEMV path a row's fp32 summation order does not depend on the
// other rows of the call (the batch-invariant mode relies on it: gemv_rows >= R sends every row
// there). ISA: 0 scalar, 1 AVX2+FMA, 2 AVX-512 (F/BW/VL/DQ), chosen by the caller;
// the vector functions carry GCC target attributes, so the file builds without -march flags. With
// bf16 activations, AVX-512 also uses what the CPU has (detected here): AVX512_BF16 dot products
// (the fused GEMV), for FP8 blocks AVX512_VBMI byte lookups in per-block bf16 tables, and for
// MXFP4 a 16-bit table lookup plus an exponent add (gemv_mxfp4_avx512). ISA 3 (AVX512F) runs the
// AVX-512 kernels without the BF16 and VBMI paths, 4 (AVX512BF16) without the VBMI tables: the paths
// a CPU lacking those extensions takes, testable on one that has them. Per-call scratch lives in
// thread_local buffers that only grow (no allocation per decode step besides the output tensors).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define M2_X86 1
#define M2_AVX2 __attribute__((target("avx2,fma,f16c")))
#define M2_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define M2_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#define M2_AVX512VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma")))
#else
#define M2_X86 0
#endif

namespace {

// A buffer that only grows, 64-byte aligned (a cache line, and what at::empty gives): the decode
// tile of the at::mm path, kept per calling thread so that no call page-faults a fresh one.
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data); }
  void* get(size_t need) {
    if (need > bytes) {
      const size_t size = (need + 63) / 64 * 64;
      void* fresh = std::aligned_alloc(64, size);
      TORCH_CHECK(fresh != nullptr, "grouped_linear: cannot allocate a ", size, "-byte decode tile");
      std::free(data);
      data = fresh;
      bytes = size;
    }
    return data;
  }
};

enum Fmt : int64_t { BF16 = 0, FP8_BLOCK = 1, NVFP4_MODELOPT = 2, NVFP4_CT = 3, MXFP4 = 4 };
// AVX512F / AVX512BF16: the AVX-512 kernels without the CPU's extra paths (no BF16 dot products and no
// VBMI tables / no VBMI tables), as a CPU without those extensions runs them (tests, benchmarks).
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512F = 3, AVX512BF16 = 4 };

constexpr uint32_t QNAN = 0x7FC00000u;
// E2M1 code -> value (checkpoints.md §5): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
alignas(64) constexpr float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float bits_f(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// e4m3fn -> fp32, exact: the 7 magnitude bits placed at fp32 bit 20 give 2^(e-127)·(1+m/8) (or the
// fp32 subnormal (m/8)·2^-126 for e = 0); one multiply by 2^120 rebiases both exactly. 0x7F/0xFF NaN.
inline float e4m3_to_f(uint8_t b) {
  uint32_t em = b & 0x7Fu, sign = uint32_t(b & 0x80u) << 24;
  if (em == 0x7Fu) return bits_f(QNAN | sign);
  return bits_f(f_bits(bits_f(em << 20) * 0x1p120f) | sign);
}

// E8M0 -> fp32 2^(e-127), exact (e = 0 is the fp32 subnormal 2^-127; 255 is NaN).
inline float e8m0_to_f(uint8_t e) {
  if (e == 255) return bits_f(QNAN);
  return e == 0 ? bits_f(0x00400000u) : bits_f(uint32_t(e) << 23);
}

// fp32 -> bf16 -> fp32, round to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline float round_bf16(float f) {
  uint32_t u = f_bits(f);
  if (std::isnan(f)) return bits_f((u | 0x00400000u) & 0xFFFF0000u);
  return bits_f((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

// One grouped weight as stored, raw pointers plus strides (elements of each tensor's dtype).
struct Weight {
  int64_t fmt, N, K, block_n, block_k;
  const uint8_t* q; int64_t q_e, q_n;  // bytes: bf16 as 2 bytes, fp8 1 byte, fp4 K/2 bytes per row
  const void* s; int64_t s_e, s_n;     // fp8: f32 [E, N/bn, K/bk]; fp4: u8/e4m3 [E, N, K/g]
  const float* s2; int64_t s2_e, s2_n;  // NVFP4 only: [E] or [E, N] (per output row; stride 0 = shared)
  bool round_bf16;                      // activations are bf16: one rounding of each weight
};

// Block scale of the FP4 group g of row n of expert e.
inline float fp4_group_scale(const Weight& w, int64_t e, int64_t n, int64_t g) {
  uint8_t b = static_cast<const uint8_t*>(w.s)[e * w.s_e + n * w.s_n + g];
  if (w.fmt == MXFP4) return e8m0_to_f(b);
  float ws = e4m3_to_f(b);
  const float s2 = w.s2[e * w.s2_e + n * w.s2_n];
  return w.fmt == NVFP4_MODELOPT ? ws * s2 : ws / s2;
}

inline const float* fp8_scale_row(const Weight& w, int64_t e, int64_t n) {
  return static_cast<const float*>(w.s) + e * w.s_e + (n / w.block_n) * w.s_n;
}

// ---------------------------------------------------------------- scalar ISA (and vector tails)
void bf16_tail(const uint8_t* p, int64_t k, int64_t K, float* out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  for (; k < K; ++k) out[k] = bits_f(uint32_t(h[k]) << 16);
}

// FP4 columns [k, K) of one row (k a multiple of the group), scalar.
void fp4_tail(const Weight& w, int64_t e, int64_t n, const uint8_t* p, int64_t k, float* out) {
  for (; k < w.K; k += 2) {
    float blk = fp4_group_scale(w, e, n, k / w.block_k);
    uint8_t b = p[k / 2];
    out[k] = E2M1[b & 0xF] * blk;
    out[k + 1] = E2M1[b >> 4] * blk;
    if (w.round_bf16) { out[k] = round_bf16(out[k]); out[k + 1] = round_bf16(out[k + 1]); }
  }
}

void decode_row_scalar(const Weight& w, int64_t e, int64_t n, float* out, float*) {
  const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
  const int64_t K = w.K;
  if (w.fmt == BF16) return bf16_tail(p, 0, K, out);  // already bf16
  if (w.fmt == FP8_BLOCK) {
    const float* srow = fp8_scale_row(w, e, n);
    for (int64_t k = 0; k < K; ++k) out[k] = e4m3_to_f(p[k]) * srow[k / w.block_k];
  } else {
    return fp4_tail(w, e, n, p, 0, out);  // rounds as it goes
  }
  if (w.round_bf16)
    for (int64_t k = 0; k < K; ++k) out[k] = round_bf16(out[k]);
}

float dot_scalar(const float* a, const float* b, int64_t K) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += a[k] * b[k];
  return acc;
}

#if M2_X86
// ---------------------------------------------------------------- AVX2 + FMA
M2_AVX2 inline __m256 round_bf16_avx2(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// 8 e4m3 bytes -> 8 exact fp32 values (scalar e4m3_to_f, lane-wise).
M2_AVX2 inline __m256 e4m3x8_avx2(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(em, 20)), _mm256_set1_ps(0x1p120f));
  __m256i nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F));
  __m256i r = _mm256_blendv_epi8(_mm256_castps_si256(v), _mm256_set1_epi32(int(QNAN)), nan);
  return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

// 8 packed bytes -> 16 E2M1 values in column order (low nibble first), as two vectors.
M2_AVX2 inline void e2m1x16_avx2(const uint8_t* p, __m256& out0, __m256& out1) {
  const __m256 mag = _mm256_load_ps(E2M1);  // codes 0-7 (magnitudes)
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(0xF)), hi = _mm256_srli_epi32(b, 4);
  __m256 vlo = _mm256_or_ps(_mm256_permutevar8x32_ps(mag, lo),
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(lo, 3), 31)));
  __m256 vhi = _mm256_or_ps(_mm256_permutevar8x32_ps(mag, hi),
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(hi, 3), 31)));
  __m256 a = _mm256_unpacklo_ps(vlo, vhi), c = _mm256_unpackhi_ps(vlo, vhi);  // per 128-bit lane
  out0 = _mm256_permute2f128_ps(a, c, 0x20);
  out1 = _mm256_permute2f128_ps(a, c, 0x31);
}

M2_AVX2 void decode_row_avx2(const Weight& w, int64_t e, int64_t n, float* out, float*) {
  const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
  const int64_t K = w.K;
  if (w.fmt == BF16) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * k)));
      _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    bf16_tail(p, k, K, out);
    return;
  }
  if (w.fmt == FP8_BLOCK) {
    const float* srow = fp8_scale_row(w, e, n);
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += w.block_k, ++b) {
      __m256 s = _mm256_set1_ps(srow[b]);
      for (int64_t k = k0; k < k0 + w.block_k; k += 8) {
        __m256 v = _mm256_mul_ps(e4m3x8_avx2(p + k), s);
        _mm256_storeu_ps(out + k, w.round_bf16 ? round_bf16_avx2(v) : v);
      }
    }
    return;
  }
  const int64_t g = w.block_k;
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
    __m256 s = _mm256_set1_ps(fp4_group_scale(w, e, n, gi));
    for (int64_t k = k0; k < k0 + g; k += 16) {
      __m256 v0, v1;
      e2m1x16_avx2(p + k / 2, v0, v1);
      v0 = _mm256_mul_ps(v0, s);
      v1 = _mm256_mul_ps(v1, s);
      if (w.round_bf16) { v0 = round_bf16_avx2(v0); v1 = round_bf16_avx2(v1); }
      _mm256_storeu_ps(out + k, v0);
      _mm256_storeu_ps(out + k + 8, v1);
    }
  }
}

M2_AVX2 float dot_avx2(const float* a, const float* b, int64_t K) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  for (; k + 8 <= K; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
  float tail = 0.f;
  for (; k < K; ++k) tail += a[k] * b[k];
  __m256 s = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h) + tail;
}

// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ)
M2_AVX512 inline __m512 round_bf16_avx512(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u))));
}

M2_AVX512 inline __m512 e4m3x16_avx512(const uint8_t* p) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(em, 20)), _mm512_set1_ps(0x1p120f));
  __mmask16 nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F));
  __m512i r = _mm512_mask_blend_epi32(nan, _mm512_castps_si512(v), _mm512_set1_epi32(int(QNAN)));
  return _mm512_castsi512_ps(_mm512_or_si512(r, sign));
}

// 16 packed bytes -> 32 E2M1 values in column order, as two vectors (a 16-entry table lookup).
M2_AVX512 inline void e2m1x32_avx512(const uint8_t* p, __m512& out0, __m512& out1) {
  const __m512 table = _mm512_load_ps(E2M1);
  const __m512i idx0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i idx1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512 vlo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), table);
  __m512 vhi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  out0 = _mm512_permutex2var_ps(vlo, idx0, vhi);
  out1 = _mm512_permutex2var_ps(vlo, idx1, vhi);
}

// 32 e4m3 bytes -> 32 values * 2^-8, exact, through fp16: the byte's sign and 7 magnitude bits placed
// in an fp16 (sign bit 15, exponent+mantissa at bit 7) read 2^-8 * e4m3, subnormals included;
// 0x7F/0xFF become fp16 NaN. The caller multiplies by (s * 2^8), exact as long as that is finite.
M2_AVX512 inline void e4m3x32_scaled_avx512(const uint8_t* p, __m512& v0, __m512& v1) {
  __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(h, 8), 1), _mm512_set1_epi16(int16_t(0xBFFF)));
  const __m512i em = _mm512_set1_epi16(0x3F80);
  __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, em), em);
  h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7E00)));
  v0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  v1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// FP4 block scales of row n, one per 16 columns: gs16[i] = scale of group (16 i) / g. NVFP4 scales
// are decoded 16 at a time (same fp32 product / quotient as fp4_group_scale).
M2_AVX512 void fp4_scales16_avx512(const Weight& w, int64_t e, int64_t n, float* gs16) {
  const int64_t G = w.K / w.block_k, rep = w.block_k / 16;
  const uint8_t* sp = static_cast<const uint8_t*>(w.s) + e * w.s_e + n * w.s_n;
  int64_t g = 0;
  if (w.fmt == MXFP4 && rep == 2) {  // E8M0: 2^(e-127) as fp32 bits (e = 0: subnormal 2^-127; 255: NaN)
    const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dup_hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (; g + 16 <= G; g += 16) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + g)));
      __m512i bits = _mm512_slli_epi32(b, 23);
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()),
                                   _mm512_set1_epi32(0x00400000));
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(255)),
                                   _mm512_set1_epi32(int(QNAN)));
      _mm512_storeu_ps(gs16 + 2 * g, _mm512_castsi512_ps(_mm512_permutexvar_epi32(dup_lo, bits)));
      _mm512_storeu_ps(gs16 + 2 * g + 16, _mm512_castsi512_ps(_mm512_permutexvar_epi32(dup_hi, bits)));
    }
  }
  if (w.fmt != MXFP4 && rep == 1) {
    const __m512 s2 = _mm512_set1_ps(w.s2[e * w.s2_e + n * w.s2_n]);
    for (; g + 16 <= G; g += 16) {
      __m512 v = e4m3x16_avx512(sp + g);
      _mm512_storeu_ps(gs16 + g, w.fmt == NVFP4_MODELOPT ? _mm512_mul_ps(v, s2) : _mm512_div_ps(v, s2));
    }
  }
  for (int64_t i = g * rep; g < G; ++g) {
    const float v = fp4_group_scale(w, e, n, g);
    for (int64_t r = 0; r < rep; ++r) gs16[i++] = v;
  }
}

M2_AVX512 void decode_row_avx512(const Weight& w, int64_t e, int64_t n, float* out, float* scratch) {
  const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
  const int64_t K = w.K;
  if (w.fmt == BF16) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * k)));
      _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    }
    bf16_tail(p, k, K, out);
    return;
  }
  if (w.fmt == FP8_BLOCK) {
    const float* srow = fp8_scale_row(w, e, n);
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += w.block_k, ++b) {
      __m512 s = _mm512_set1_ps(srow[b]);
      for (int64_t k = k0; k < k0 + w.block_k; k += 16) {
        __m512 v = _mm512_mul_ps(e4m3x16_avx512(p + k), s);
        _mm512_storeu_ps(out + k, w.round_bf16 ? round_bf16_avx512(v) : v);
      }
    }
    return;
  }
  float* gs16 = scratch;  // one scale per 16 columns (K/16 floats)
  fp4_scales16_avx512(w, e, n, gs16);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 v0, v1;
    e2m1x32_avx512(p + k / 2, v0, v1);
    v0 = _mm512_mul_ps(v0, _mm512_set1_ps(gs16[k / 16]));  // k / 16: a shift
    v1 = _mm512_mul_ps(v1, _mm512_set1_ps(gs16[k / 16 + 1]));
    if (w.round_bf16) { v0 = round_bf16_avx512(v0); v1 = round_bf16_avx512(v1); }
    _mm512_storeu_ps(out + k, v0);
    _mm512_storeu_ps(out + k + 16, v1);
  }
  fp4_tail(w, e, n, p, k, out);
}

M2_AVX512 float dot_avx512(const float* a, const float* b, int64_t K) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), acc1);
  }
  for (; k + 16 <= K; k += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
  float tail = 0.f;
  for (; k < K; ++k) tail += a[k] * b[k];
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail;
}

// FP8 block weights against R (<= 8) fp32 activation rows xf [R, K] (row stride K) -> y [R, N] f32,
// the decode fused with the dot products: each 32 weights are decoded once, in registers, to the
// values decode_row_avx512 stores (e4m3 x block scale, rounded to bf16 when the activations are
// bf16), and multiplied into R accumulator pairs in dot_avx512's order (columns k mod 32 < 16 in
// acc0, the others in acc1, a last 16 in acc0, one reduce, + 0): each row's sum is bit-equal to the
// decode + dot path's, whatever R, while a weight row is decoded once per call instead of being
// stored and re-read per activation row. The decode goes through fp16 (e4m3x32_scaled_avx512:
// (2^-8 q) x (2^8 s), the same fp32 product as q x s) when every 2^8 s of the band is finite, else
// through e4m3x16_avx512. gs16: K / 16 floats of scratch (the scale per 16 columns).
template <int R>
M2_AVX512 void gemv_fp8_f32_avx512(const Weight& w, int64_t e, int64_t n0, int64_t n1, const float* xf,
                                   float* y, int64_t N, float* gs16) {
  const int64_t K = w.K, per = w.block_k / 16;
  const float* band = nullptr;
  bool via_fp16 = true;
  for (int64_t n = n0; n < n1; ++n) {
    const float* srow = fp8_scale_row(w, e, n);
    if (srow != band) {  // a new scale band: its scales spread per 16 columns (no division per step)
      band = srow;
      via_fp16 = true;
      for (int64_t b = 0; b < K / w.block_k; ++b) via_fp16 = via_fp16 && std::isfinite(srow[b] * 0x1p8f);
      for (int64_t b = 0, j = 0; b < K / w.block_k; ++b)
        for (int64_t i = 0; i < per; ++i) gs16[j++] = via_fp16 ? srow[b] * 0x1p8f : srow[b];
    }
    const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512 w0, w1;
      if (via_fp16) {
        e4m3x32_scaled_avx512(p + k, w0, w1);
      } else {
        w0 = e4m3x16_avx512(p + k);
        w1 = e4m3x16_avx512(p + k + 16);
      }
      w0 = _mm512_mul_ps(w0, _mm512_set1_ps(gs16[k / 16]));
      w1 = _mm512_mul_ps(w1, _mm512_set1_ps(gs16[k / 16 + 1]));
      if (w.round_bf16) { w0 = round_bf16_avx512(w0); w1 = round_bf16_avx512(w1); }
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + r * K + k), acc0[r]);
        acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + r * K + k + 16), acc1[r]);
      }
    }
    if (k < K) {  // K is a multiple of 16 for FP8 blocks; gs16 holds 2^8 s on the fp16 decode
      __m512 w0 = e4m3x16_avx512(p + k);
      if (via_fp16) w0 = _mm512_mul_ps(w0, _mm512_set1_ps(0x1p-8f));   // exact: q x 2^-8
      w0 = _mm512_mul_ps(w0, _mm512_set1_ps(gs16[k / 16]));
      if (w.round_bf16) w0 = round_bf16_avx512(w0);
      for (int r = 0; r < R; ++r) acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + r * K + k), acc0[r]);
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + 0.f;
  }
}

// gemv_fp8_f32_avx512 over any number of rows, 8 at a time.
M2_AVX512 void gemv_fp8_f32_rows(const Weight& w, int64_t e, int64_t n0, int64_t n1, const float* xf,
                                 int64_t rows, float* y, int64_t N, float* gs16) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const float* xr = xf + r0 * w.K;
    float* yr = y + r0 * N;
    switch (std::min<int64_t>(8, rows - r0)) {
      case 1: gemv_fp8_f32_avx512<1>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 2: gemv_fp8_f32_avx512<2>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 3: gemv_fp8_f32_avx512<3>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 4: gemv_fp8_f32_avx512<4>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 5: gemv_fp8_f32_avx512<5>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 6: gemv_fp8_f32_avx512<6>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 7: gemv_fp8_f32_avx512<7>(w, e, n0, n1, xr, yr, N, gs16); break;
      default: gemv_fp8_f32_avx512<8>(w, e, n0, n1, xr, yr, N, gs16); break;
    }
  }
}

// ---------------------------------------------------------------- AVX-512 + BF16, bf16 activations
// Rows [n0, n1) of expert e against R activation rows xb [R, K] bf16 (row stride K) -> y [R, N] f32.
// Each group of 32 weights is decoded in fp32 (the formula), rounded once (RNE) to bf16 by
// vcvtne2ps2bf16 - which flushes fp32-subnormal values (|W| < 2^-126) to zero, as oneDNN's bf16 GEMM
// does with such products - and multiplied into fp32 accumulators by vdpbf16ps.
template <int R>
M2_AVX512BF16 void gemv_bf16_avx512(const Weight& w, int64_t e, int64_t n0, int64_t n1, const uint16_t* xb,
                                    float* y, int64_t N, float* gs16) {
  const int64_t K = w.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
// (a macro: lambdas do not inherit the function's target attribute)
#define M2_DOT32(wv, k)                                                                       \
  do {                                                                                        \
    const __m512bh w32 = (wv);                                                                \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r] =                              \
        _mm512_dpbf16_ps(acc[r], w32, (__m512bh)_mm512_loadu_si512(xb + r * K + (k)));       \
  } while (0)
    if (w.fmt == BF16) {  // K not a multiple of 64 (gemv_bf16w_rows takes the others)
      for (int64_t k = 0; k < K; k += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(p + w.q_n + 2 * k), _MM_HINT_T0);  // the next row
        M2_DOT32((__m512bh)_mm512_loadu_si512(p + 2 * k), k);
      }
    } else if (w.fmt == FP8_BLOCK) {
      const float* srow = fp8_scale_row(w, e, n);
      for (int64_t k0 = 0, b = 0; k0 < K; k0 += w.block_k, ++b) {
        const float s8 = srow[b] * 256.0f;  // exact unless it overflows: then 2^8 and s one at a time
        const __m512 s = _mm512_set1_ps(std::isinf(s8) ? srow[b] : s8);
        const __m512 pre = _mm512_set1_ps(std::isinf(s8) ? 256.0f : 1.0f);
        for (int64_t k = k0; k < k0 + w.block_k; k += 32) {
          __m512 v0, v1;
          e4m3x32_scaled_avx512(p + k, v0, v1);
          if (std::isinf(s8)) { v0 = _mm512_mul_ps(v0, pre); v1 = _mm512_mul_ps(v1, pre); }
          M2_DOT32(_mm512_cvtne2ps_pbh(_mm512_mul_ps(v1, s), _mm512_mul_ps(v0, s)), k);  // i < 16: v0
        }
      }
    } else {
      fp4_scales16_avx512(w, e, n, gs16);
      for (int64_t k = 0; k < K; k += 32) {
        __m512 v0, v1;
        e2m1x32_avx512(p + k / 2, v0, v1);
        v0 = _mm512_mul_ps(v0, _mm512_set1_ps(gs16[k / 16]));
        v1 = _mm512_mul_ps(v1, _mm512_set1_ps(gs16[k / 16 + 1]));
        M2_DOT32(_mm512_cvtne2ps_pbh(v1, v0), k);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n] = _mm512_reduce_add_ps(acc[r]);
  }
}
#undef M2_DOT32

// MXFP4 straight to bf16, 64 columns (two 32-column groups) at a time: a 2^(e-127) scale only moves
// the exponent, so for group exponents e in [MXFP4_FAST_LO, MXFP4_FAST_HI] every nonzero product
// e2m1 x 2^(e-127) is a normal, finite bf16 (|e2m1| in [0.5, 6]) whose bits are the bf16 bits of the
// E2M1 value plus (e - 127) << 7: exactly the fp32 product rounded once (exact here). Zero codes
// keep ±0. A 16-bit table lookup (vpermw) replaces the fp32 decode, multiply and rounding of the
// general path (e2m1x32_avx512); groups outside the range take that path.
constexpr int MXFP4_FAST_LO = 2, MXFP4_FAST_HI = 252;
alignas(64) constexpr uint16_t E2M1_BF16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
// MXFP4 split order: the low nibbles of a 64-column block's 32 bytes are its even columns, the high
// nibbles its odd ones; the kernel keeps them in two registers (no interleaving permute) and the
// activations are laid out to match once per call: within each 64 columns, position j < 32 holds
// column 2 j and position 32 + j column 2 j + 1. Positions 0-15 / 32-47 are group a (columns 0-31),
// 16-31 / 48-63 group b.
inline int64_t mx_order_column(int64_t i) { return (i & ~int64_t(63)) + 2 * (i & 31) + ((i & 63) >> 5); }
inline bool mxfp4_split_order(const Weight& w) { return w.fmt == MXFP4 && w.block_k == 32 && w.K % 64 == 0; }

// 32 packed bytes (64 columns) with group exponents ea (columns 0-31) and eb (32-63) -> 64 bf16 weights
// in split order: even columns in wa, odd ones in wb. Both exponents in the fast range: the table
// lookup plus exponent add; otherwise the fp32 decode (e2m1 * 2^(e-127), rounded once, RNE).
M2_AVX512BF16 inline void mxfp4x64_split(const uint8_t* p, int ea, int eb, __m512i& wa, __m512i& wb) {
  if (ea >= MXFP4_FAST_LO && ea <= MXFP4_FAST_HI && eb >= MXFP4_FAST_LO && eb <= MXFP4_FAST_HI) {
    const __m512i table = _mm512_load_si512(E2M1_BF16), nib = _mm512_set1_epi16(0xF), mag = _mm512_set1_epi16(7);
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_srli_epi16(b, 4);
    const __m512i v0 = _mm512_permutexvar_epi16(lo, table), v1 = _mm512_permutexvar_epi16(hi, table);
    const __m512i add = _mm512_inserti64x4(_mm512_set1_epi16(int16_t((ea - 127) * 128)),
                                           _mm256_set1_epi16(int16_t((eb - 127) * 128)), 1);
    wa = _mm512_mask_add_epi16(v0, _mm512_test_epi16_mask(lo, mag), v0, add);
    wb = _mm512_mask_add_epi16(v1, _mm512_test_epi16_mask(hi, mag), v1, add);
    return;
  }
  const __m512 table = _mm512_load_ps(E2M1), nib = _mm512_castsi512_ps(_mm512_set1_epi32(0xF));
  const __m512 sa = _mm512_set1_ps(e8m0_to_f(uint8_t(ea))), sb = _mm512_set1_ps(e8m0_to_f(uint8_t(eb)));
  const __m512i ba = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m512 lo_a = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_castps_si512(_mm512_and_ps(_mm512_castsi512_ps(ba), nib)), table), sa);
  const __m512 lo_b = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_castps_si512(_mm512_and_ps(_mm512_castsi512_ps(bb), nib)), table), sb);
  const __m512 hi_a = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(ba, 4), table), sa);
  const __m512 hi_b = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bb, 4), table), sb);
  wa = (__m512i)_mm512_cvtne2ps_pbh(lo_b, lo_a);  // words 0-15: lo_a (group a), 16-31: lo_b
  wb = (__m512i)_mm512_cvtne2ps_pbh(hi_b, hi_a);
}

// MXFP4 rows [n0, n1) of expert e against R activation rows xm [R, K] bf16 in split order (K a multiple
// of 64, group 32) -> y [R, N] f32: mxfp4x64_split, two independent vdpbf16ps chains per activation
// row (even columns, odd columns), the next weight row prefetched.
template <int R>
M2_AVX512BF16 void gemv_mxfp4_avx512(const Weight& w, int64_t e, int64_t n0, int64_t n1, const uint16_t* xm,
                                     float* y, int64_t N) {
  const int64_t K = w.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
    const uint8_t* sp = static_cast<const uint8_t*>(w.s) + e * w.s_e + n * w.s_n;
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + w.q_n + k / 2), _MM_HINT_T0);  // the next row
      __m512i wa, wb;
      mxfp4x64_split(p + k / 2, sp[k / 32], sp[k / 32 + 1], wa, wb);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)wa, (__m512bh)_mm512_loadu_si512(xm + r * K + k));
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)wb, (__m512bh)_mm512_loadu_si512(xm + r * K + k + 32));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
}

// bf16 weights, K a multiple of 64: W weight rows from n (1, or 2 = a pair) against R <= 4 activation
// rows. One (weight row, activation row) fp32 sum is always the even 32-column steps in one accumulator,
// the odd ones in another, added at the end (so a row's result does not depend on how many rows share the
// call, nor on W). Each activation vector is loaded once for the W weight rows (W = 2 measured 1.2x one
// row at a time at 4 rows, 1.6x for 8 rows in two passes). Prefetches go to L2 (_MM_HINT_T1), one line
// per 128 bytes of the next W weight rows: measured on an AVX-512 BF16 EPYC, one row streamed 1.9x faster
// than two rows prefetched into L1, whose 32 KB the prefetched rows, the current rows and the activations
// overfill.
template <int W, int R>
M2_AVX512BF16 void gemv_bf16w_block(const Weight& w, int64_t e, int64_t n, const uint16_t* xb, float* y, int64_t N) {
  const int64_t K = w.K;
  const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
  __m512 a[W][R][2];
#pragma GCC unroll 2
  for (int j = 0; j < W; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[j][r][0] = a[j][r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    __m512bh w0[W], w1[W];
#pragma GCC unroll 2
    for (int j = 0; j < W; ++j) {
      const uint8_t* pj = p + j * w.q_n;
      _mm_prefetch(reinterpret_cast<const char*>(pj + W * w.q_n + 2 * k), _MM_HINT_T1);  // the next W rows
      w0[j] = (__m512bh)_mm512_loadu_si512(pj + 2 * k);
      w1[j] = (__m512bh)_mm512_loadu_si512(pj + 2 * k + 64);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xb + r * K + k);
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xb + r * K + k + 32);
#pragma GCC unroll 2
      for (int j = 0; j < W; ++j) {
        a[j][r][0] = _mm512_dpbf16_ps(a[j][r][0], w0[j], x0);
        a[j][r][1] = _mm512_dpbf16_ps(a[j][r][1], w1[j], x1);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < W; ++j) y[r * N + n + j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j][r][0], a[j][r][1]));
}

// bf16 weights with K a multiple of 64: passes of up to 4 activation rows over the task's weight rows
// (a task's rows stay in L2 between passes); 1-2 rows one weight row at a time, 3-4 two at a time.
M2_AVX512BF16 void gemv_bf16w_rows(const Weight& w, int64_t e, int64_t n0, int64_t n1, const uint16_t* xb,
                                   int64_t rows, float* y, int64_t N) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const uint16_t* xr = xb + r0 * w.K;
    float* yr = y + r0 * N;
    const int64_t m = std::min<int64_t>(4, rows - r0);
    int64_t n = n0;
    if (m >= 3) {
      for (; n + 2 <= n1; n += 2) {
        if (m == 3) gemv_bf16w_block<2, 3>(w, e, n, xr, yr, N);
        else gemv_bf16w_block<2, 4>(w, e, n, xr, yr, N);
      }
    }
    for (; n < n1; ++n) {
      switch (m) {
        case 1: gemv_bf16w_block<1, 1>(w, e, n, xr, yr, N); break;
        case 2: gemv_bf16w_block<1, 2>(w, e, n, xr, yr, N); break;
        case 3: gemv_bf16w_block<1, 3>(w, e, n, xr, yr, N); break;
        default: gemv_bf16w_block<1, 4>(w, e, n, xr, yr, N); break;
      }
    }
  }
}

// Up to 8 rows per pass over the weights (more rows: more passes, each decoding again).
M2_AVX512BF16 void gemv_bf16_rows(const Weight& w, int64_t e, int64_t n0, int64_t n1, const uint16_t* xb,
                                  int64_t rows, float* y, int64_t N, float* gs16) {
  if (w.fmt == BF16 && w.K % 64 == 0) return gemv_bf16w_rows(w, e, n0, n1, xb, rows, y, N);
  const bool mx = mxfp4_split_order(w);  // then xb is in split order (grouped_linear)
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const uint16_t* xr = xb + r0 * w.K;
    float* yr = y + r0 * N;
    if (mx) {
      switch (std::min<int64_t>(8, rows - r0)) {
        case 1: gemv_mxfp4_avx512<1>(w, e, n0, n1, xr, yr, N); break;
        case 2: gemv_mxfp4_avx512<2>(w, e, n0, n1, xr, yr, N); break;
        case 3: gemv_mxfp4_avx512<3>(w, e, n0, n1, xr, yr, N); break;
        case 4: gemv_mxfp4_avx512<4>(w, e, n0, n1, xr, yr, N); break;
        case 5: gemv_mxfp4_avx512<5>(w, e, n0, n1, xr, yr, N); break;
        case 6: gemv_mxfp4_avx512<6>(w, e, n0, n1, xr, yr, N); break;
        case 7: gemv_mxfp4_avx512<7>(w, e, n0, n1, xr, yr, N); break;
        default: gemv_mxfp4_avx512<8>(w, e, n0, n1, xr, yr, N); break;
      }
      continue;
    }
    switch (std::min<int64_t>(8, rows - r0)) {
      case 1: gemv_bf16_avx512<1>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 2: gemv_bf16_avx512<2>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 3: gemv_bf16_avx512<3>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 4: gemv_bf16_avx512<4>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 5: gemv_bf16_avx512<5>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 6: gemv_bf16_avx512<6>(w, e, n0, n1, xr, yr, N, gs16); break;
      case 7: gemv_bf16_avx512<7>(w, e, n0, n1, xr, yr, N, gs16); break;
      default: gemv_bf16_avx512<8>(w, e, n0, n1, xr, yr, N, gs16); break;
    }
  }
}

// ---------------------------------------------------------------- FP8 block through bf16 tables
// Within one block every weight is fp32(e4m3 code) * s, and the code's sign bit only flips the sign
// of that product (sign(q) xor sign(s), zeros and NaN included), so the block's bf16 weights are a
// 128-entry table of the spec formula, T[m] = bf16(fp32(e4m3 m) * s) for the magnitudes m = 0..127,
// evaluated once per block with the same fp32 product and RNE rounding (fp32 subnormals, infinities
// and NaN included). A table is 256 bytes (low bytes of T, then high bytes) held in four registers;
// vpermi2b (AVX-512 VBMI) looks up 64 codes per instruction and two byte unpacks give 64 bf16
// weights in a lane-interleaved order (FP8 order, below) in which the activations are laid out once
// per call, so that vdpbf16ps pairs them. vdpbf16ps flushes bf16-subnormal weights (|W| < 2^-126)
// to zero, as in the fused path above.

// E4M3 magnitudes 0..127 as exact fp32 (127: NaN).
const float* e4m3_magnitudes() {
  static const std::array<float, 128> table = [] {
    std::array<float, 128> t{};
    for (int m = 0; m < 128; ++m) t[m] = e4m3_to_f(uint8_t(m));
    return t;
  }();
  return table.data();
}

// FP8 order: within each 64 columns, position i < 32 holds column 16 (i / 8) + i % 8 and position
// 32 + i holds column 16 (i / 8) + 8 + i % 8 (what unpacklo/unpackhi_epi8 of 64 lookups produce).
inline int64_t fp8_order_column(int64_t i) { return (i & ~int64_t(63)) + 16 * ((i & 31) / 8) + 8 * ((i & 63) / 32) + i % 8; }

// tab [256] bytes: the low bytes of the block's T[0..127], then the high bytes.
M2_AVX512 void fp8_block_table(float s, uint8_t* tab) {
  const float* mag = e4m3_magnitudes();
  const __m512 vs = _mm512_set1_ps(s);
  for (int i = 0; i < 8; ++i) {
    __m512i u = _mm512_castps_si512(round_bf16_avx512(_mm512_mul_ps(_mm512_loadu_ps(mag + 16 * i), vs)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tab + 16 * i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tab + 128 + 16 * i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 24)));
  }
}

// Weight rows n .. n+NR-1 of expert e (one scale band, whose tables are tabs [K/block_k][256]) against
// R activation rows xp [R, K] bf16 in FP8 order -> y[r * N + n + j] f32. Two accumulators per (row,
// weight row) and NR weight rows at a time keep several independent vdpbf16ps chains in flight.
template <int R, int NR>
M2_AVX512VBMI void gemv_fp8_table(const Weight& w, int64_t e, int64_t n, const uint16_t* xp, float* y, int64_t N,
                                  const uint8_t* tabs) {
  const int64_t K = w.K, bk = w.block_k;
  const uint8_t* p[NR];
  __m512 acc[NR][R][2];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    p[j] = w.q + e * w.q_e + (n + j) * w.q_n;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = _mm512_setzero_ps();
  }
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  for (int64_t k0 = 0; k0 < K; k0 += bk, tabs += 256) {
    const __m512i lo0 = _mm512_loadu_si512(tabs), lo1 = _mm512_loadu_si512(tabs + 64);
    const __m512i hi0 = _mm512_loadu_si512(tabs + 128), hi1 = _mm512_loadu_si512(tabs + 192);
    for (int64_t k = k0; k < k0 + bk; k += 64) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m512i c = _mm512_loadu_si512(p[j] + k);
        _mm_prefetch(reinterpret_cast<const char*>(p[j] + NR * w.q_n + k), _MM_HINT_T1);  // next rows
        const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);  // index bits 6-0: the magnitude
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0x78);  // ^ (c & 0x80)
        const __m512bh wa = (__m512bh)_mm512_unpacklo_epi8(lo, hi), wb = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[j][r][0] = _mm512_dpbf16_ps(acc[j][r][0], wa, (__m512bh)_mm512_loadu_si512(xp + r * K + k));
          acc[j][r][1] = _mm512_dpbf16_ps(acc[j][r][1], wb, (__m512bh)_mm512_loadu_si512(xp + r * K + k + 32));
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][r][0], acc[j][r][1]));
}

// Rows [n0, n1) (one scale band) of expert e against `rows` activation rows xp (FP8 order): the
// band's tables once, then up to 8 activation rows per pass over the weights; one or two activation
// rows take two weight rows at a time.
M2_AVX512VBMI void gemv_fp8_band(const Weight& w, int64_t e, int64_t n0, int64_t n1, const uint16_t* xp,
                                 int64_t rows, float* y, int64_t N, uint8_t* tabs) {
  const float* srow = fp8_scale_row(w, e, n0);
  for (int64_t b = 0; b < w.K / w.block_k; ++b) fp8_block_table(srow[b], tabs + 256 * b);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const uint16_t* xr = xp + r0 * w.K;
    float* yr = y + r0 * N;
    const int64_t m = std::min<int64_t>(8, rows - r0);
    int64_t n = n0;
    if (m <= 2) {
      for (; n + 2 <= n1; n += 2) {
        if (m == 1) gemv_fp8_table<1, 2>(w, e, n, xr, yr, N, tabs);
        else gemv_fp8_table<2, 2>(w, e, n, xr, yr, N, tabs);
      }
    }
    for (; n < n1; ++n) {
      switch (m) {
        case 1: gemv_fp8_table<1, 1>(w, e, n, xr, yr, N, tabs); break;
        case 2: gemv_fp8_table<2, 1>(w, e, n, xr, yr, N, tabs); break;
        case 3: gemv_fp8_table<3, 1>(w, e, n, xr, yr, N, tabs); break;
        case 4: gemv_fp8_table<4, 1>(w, e, n, xr, yr, N, tabs); break;
        case 5: gemv_fp8_table<5, 1>(w, e, n, xr, yr, N, tabs); break;
        case 6: gemv_fp8_table<6, 1>(w, e, n, xr, yr, N, tabs); break;
        case 7: gemv_fp8_table<7, 1>(w, e, n, xr, yr, N, tabs); break;
        default: gemv_fp8_table<8, 1>(w, e, n, xr, yr, N, tabs); break;
      }
    }
  }
}

// Rows [n0, n1) of expert e decoded to bf16 in column order (dst row stride K) through the tables
// (exact: no flushing here), for the many-row path's tile; tabs as in gemv_fp8_band.
M2_AVX512VBMI void fp8_rows_to_bf16(const Weight& w, int64_t e, int64_t n0, int64_t n1, uint16_t* dst, uint8_t* tabs) {
  const int64_t K = w.K, bk = w.block_k;
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t n = n0, band = -1; n < n1; ++n, dst += K) {
    if (n / w.block_n != band) {
      band = n / w.block_n;
      const float* srow = fp8_scale_row(w, e, n);
      for (int64_t b = 0; b < K / bk; ++b) fp8_block_table(srow[b], tabs + 256 * b);
    }
    const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
    const uint8_t* t = tabs;
    for (int64_t k0 = 0; k0 < K; k0 += bk, t += 256) {
      const __m512i lo0 = _mm512_loadu_si512(t), lo1 = _mm512_loadu_si512(t + 64);
      const __m512i hi0 = _mm512_loadu_si512(t + 128), hi1 = _mm512_loadu_si512(t + 192);
      for (int64_t k = k0; k < k0 + bk; k += 64) {
        const __m512i c = _mm512_loadu_si512(p + k);
        const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0x78);
        const __m512i wa = _mm512_unpacklo_epi8(lo, hi), wb = _mm512_unpackhi_epi8(lo, hi);  // FP8 order
        _mm512_storeu_si512(dst + k, _mm512_permutex2var_epi64(wa, first, wb));
        _mm512_storeu_si512(dst + k + 32, _mm512_permutex2var_epi64(wa, second, wb));
      }
    }
  }
}
#endif

bool cpu_has_avx512vbmi() {
#if M2_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if M2_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool isa_supported(int64_t isa) {
  if (isa == SCALAR) return true;
#if M2_X86
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == AVX2) return avx2;
  if (isa == AVX512BF16) return isa_supported(AVX512) && cpu_has_avx512bf16();
  if (isa == AVX512 || isa == AVX512F)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  return false;
}


using DecodeFn = void (*)(const Weight&, int64_t, int64_t, float*, float*);  // scratch: K/16 floats
using DotFn = float (*)(const float*, const float*, int64_t);

// x [R, K] bf16/f32 contiguous; offsets int32 [E] cumulative row ends (F.grouped_mm's offs);
// q [E, N, Kq] as stored; scale per format; scale2 f32 [E] or [E, N] (NVFP4) -> y [R, N] in x's dtype.
// Rows at or past offsets[E-1] get 0. Parallel tasks: (expert, tile of tile_n output rows); experts
// with more than gemv_rows rows take the decode-tile + at::mm path in tiles of mm_tile_n rows.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& q,
                          const at::Tensor& scale, const std::optional<at::Tensor>& scale2, int64_t fmt,
                          int64_t block_n, int64_t block_k, int64_t isa, int64_t tile_n, int64_t gemv_rows,
                          int64_t mm_tile_n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "grouped_linear: x must be a contiguous [R, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "grouped_linear: activations must be bfloat16 or float32, found ", x.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kInt, "grouped_linear: offsets must be int32 [E]");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "grouped_linear: q must be a contiguous [E, N, Kq] tensor");
  TORCH_CHECK(isa_supported(isa), "grouped_linear: ISA ", isa, " is not supported by this CPU");
  TORCH_CHECK(tile_n > 0 && mm_tile_n > 0 && block_k > 0 && block_n > 0, "grouped_linear: tile and block sizes must be positive");
  const int64_t E = q.size(0), N = q.size(1), K = x.size(1), R = x.size(0);
  TORCH_CHECK(offsets.size(0) == E, "grouped_linear: offsets has ", offsets.size(0), " entries for ", E, " experts");
  TORCH_CHECK(scale.is_contiguous(), "grouped_linear: scale must be contiguous");
  Weight w{fmt, N, K, block_n, block_k, static_cast<const uint8_t*>(q.data_ptr()), 0, 0,
           scale.data_ptr(), 0, 0, nullptr, 0, 0, x.scalar_type() == at::kBFloat16};
  w.q_e = q.stride(0) * q.element_size();
  w.q_n = q.stride(1) * q.element_size();
  switch (fmt) {
    case BF16:
      TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(2) == K, "grouped_linear: bf16 weight must be [E, N, K] bf16");
      break;
    case FP8_BLOCK:
      TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn && q.size(2) == K, "grouped_linear: fp8 weight must be e4m3 [E, N, K]");
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 3 && scale.size(0) == E &&
                  scale.size(1) == (N + block_n - 1) / block_n && scale.size(2) == K / block_k,
                  "grouped_linear: fp8 scale must be f32 [E, ceil(N/block_n), K/block_k]");
      TORCH_CHECK(K % block_k == 0 && block_k % 16 == 0,
                  "grouped_linear: fp8 needs K a multiple of block_k and block_k a multiple of 16");
      break;
    case NVFP4_MODELOPT: case NVFP4_CT: case MXFP4:
      TORCH_CHECK(q.scalar_type() == at::kByte && 2 * q.size(2) == K, "grouped_linear: fp4 weight must be uint8 [E, N, K/2]");
      TORCH_CHECK(scale.element_size() == 1 && scale.dim() == 3 && scale.size(0) == E && scale.size(1) == N &&
                  scale.size(2) == K / block_k, "grouped_linear: fp4 scale must be one byte per group [E, N, K/group]");
      TORCH_CHECK(block_k % 16 == 0 && K % block_k == 0,
                  "grouped_linear: fp4 needs K a multiple of the group and the group a multiple of 16");
      if (fmt != MXFP4) {
        TORCH_CHECK(scale2.has_value() && scale2->scalar_type() == at::kFloat && scale2->size(0) == E &&
                    (scale2->dim() == 1 || (scale2->dim() == 2 && scale2->size(1) == N)),
                    "grouped_linear: NVFP4 needs an f32 scale2 [E] or [E, N]");
        w.s2 = scale2->data_ptr<float>();
        w.s2_e = scale2->stride(0);
        w.s2_n = scale2->dim() == 2 ? scale2->stride(1) : 0;
      }
      break;
    default:
      TORCH_CHECK(false, "grouped_linear: unknown format code ", fmt);
  }
  w.s_e = scale.dim() == 3 ? scale.stride(0) : 0;
  w.s_n = scale.dim() == 3 ? scale.stride(1) : 0;

  DecodeFn decode = decode_row_scalar;
  DotFn dot = dot_scalar;
#if M2_X86
  if (isa == AVX2) { decode = decode_row_avx2; dot = dot_avx2; }
  const bool avx512 = isa == AVX512 || isa == AVX512F || isa == AVX512BF16;
  if (avx512) { decode = decode_row_avx512; dot = dot_avx512; }
#endif

  std::vector<int64_t> ends(E);
  auto off = offsets.contiguous();
  for (int64_t e = 0; e < E; ++e) {
    ends[e] = off.data_ptr<int32_t>()[e];
    TORCH_CHECK(ends[e] >= (e ? ends[e - 1] : 0) && ends[e] <= R, "grouped_linear: offsets must be non-decreasing and <= R");
  }
  // AVX-512 with BF16 dot products, bf16 activations, whole 32-column steps: the fused GEMV
  const bool fused = (isa == AVX512 || isa == AVX512BF16) && w.round_bf16 && cpu_has_avx512bf16() && K % 32 == 0 &&
                     (fmt != FP8_BLOCK || block_k % 32 == 0);
  // FP8 block on that path: per-block bf16 tables (needs VBMI), 64-column steps; a task is one scale
  // band of block_n weight rows, so that each table serves a whole block
  const bool fp8_table = fused && isa == AVX512 && fmt == FP8_BLOCK && block_k % 64 == 0 && cpu_has_avx512vbmi();
  // GEMV task height: tile_n rows; on the table path a whole scale band (each table then serves
  // block_n rows), halved while there are fewer than kTasksPerThread tasks per thread and the half
  // still divides the band (a task never straddles two bands) and is >= tile_n: with a few bands
  // (a 1,024-row linear has 8) most threads would otherwise idle, since at::parallel_for hands each
  // thread one contiguous share of the tasks. Each sub-band builds its band's tables (256 bytes
  // per block, a few hundred instructions) again. Per-row sums do not depend on the task height.
  constexpr int64_t kTasksPerThread = 4;
  int64_t gemv_experts = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = ends[e] - (e ? ends[e - 1] : 0);
    gemv_experts += rows > 0 && rows <= gemv_rows;
  }
  // FP8 block on the fp32 GEMV path (fp32 activations, or bf16 ones without the fused path) with
  // AVX-512: decode fused with the dot products, R rows at a time (gemv_fp8_f32_avx512)
#if M2_X86
  const bool fp8_f32 = avx512 && !fused && fmt == FP8_BLOCK;
#else
  const bool fp8_f32 = false;
#endif
  int64_t gemv_tile = fp8_table ? block_n : tile_n;
  const int64_t want_tasks = kTasksPerThread * at::get_num_threads();
  while (fp8_table && gemv_tile % 2 == 0 && gemv_tile / 2 >= tile_n &&
         gemv_experts * ((N + gemv_tile - 1) / gemv_tile) < want_tasks)
    gemv_tile /= 2;
  struct Task { int64_t e, r0, r1, n0, n1; };
  std::vector<Task> tasks, gemm;  // GEMV tiles (threads split over them); experts with many rows
  for (int64_t e = 0; e < E; ++e) {
    int64_t r0 = e ? ends[e - 1] : 0, r1 = ends[e];
    if (r1 == r0) continue;
    if (r1 - r0 > gemv_rows) {
      for (int64_t n0 = 0; n0 < N; n0 += mm_tile_n) gemm.push_back({e, r0, r1, n0, std::min(N, n0 + mm_tile_n)});
      continue;
    }
    for (int64_t n0 = 0; n0 < N; n0 += gemv_tile) tasks.push_back({e, r0, r1, n0, std::min(N, n0 + gemv_tile)});
  }
  at::Tensor y32 = at::empty({R, N}, x.options().dtype(at::kFloat));
  if (ends.empty() || ends.back() < R) y32.narrow(0, E ? ends.back() : 0, R - (E ? ends.back() : 0)).zero_();
  at::Tensor xf = (fused || tasks.empty() || x.scalar_type() == at::kFloat) ? x : x.to(at::kFloat);
  // activations of the GEMV rows in FP8 order (fp8_order_column) or MXFP4 split order
  // (mx_order_column), once per call, into a buffer this thread keeps (it only grows: no
  // allocation per decode step)
  thread_local std::vector<uint16_t> x_fp8;
#if M2_X86
  const bool mx_split = fused && mxfp4_split_order(w);
  if ((fp8_table || mx_split) && !tasks.empty()) {
    if (x_fp8.size() < size_t(R * K)) x_fp8.resize(R * K);
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = e ? ends[e - 1] : 0, r1 = ends[e];
      if (r1 - r0 > gemv_rows) continue;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < K; ++i)
          x_fp8[r * K + i] = xs[r * K + (fp8_table ? fp8_order_column(i) : mx_order_column(i))];
    }
  }
#else
  const bool mx_split = false;
#endif
  float* yp = y32.data_ptr<float>();
  const uint16_t* xfp = x_fp8.data();  // the caller's buffer (a thread_local name in the lambda would
                                       // be each worker's own)
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    // per-thread scratch kept across calls (grown on demand; never freed while the thread lives)
    thread_local std::vector<float> buf, scratch;
    thread_local std::vector<uint8_t> tabs;
    if (buf.size() < size_t(K)) buf.resize(K);
    if (scratch.size() < size_t(K / 16 + 1)) scratch.resize(K / 16 + 1);
    if (fp8_table && tabs.size() < size_t(256 * (K / block_k))) tabs.resize(256 * (K / block_k));
    for (int64_t t = t0; t < t1; ++t) {
      const Task& tk = tasks[t];
      const int64_t rows = tk.r1 - tk.r0;
      if (fp8_table) {
#if M2_X86
        gemv_fp8_band(w, tk.e, tk.n0, tk.n1, xfp + tk.r0 * K, rows, yp + tk.r0 * N, N, tabs.data());
#endif
        continue;
      }
      if (fused) {
#if M2_X86
        const uint16_t* xb = (mx_split ? xfp : reinterpret_cast<const uint16_t*>(x.data_ptr())) + tk.r0 * K;
        gemv_bf16_rows(w, tk.e, tk.n0, tk.n1, xb, rows, yp + tk.r0 * N, N, scratch.data());
#endif
        continue;
      }
      const float* xp = static_cast<const float*>(xf.data_ptr());
      if (fp8_f32) {
#if M2_X86
        gemv_fp8_f32_rows(w, tk.e, tk.n0, tk.n1, xp + tk.r0 * K, rows, yp + tk.r0 * N, N, scratch.data());
#endif
        continue;
      }
      for (int64_t n = tk.n0; n < tk.n1; ++n) {
        decode(w, tk.e, n, buf.data(), scratch.data());
        for (int64_t r = tk.r0; r < tk.r1; ++r) yp[r * N + n] = dot(buf.data(), xp + r * K, K);
      }
    }
  });
  // Experts with many rows: decode a tile of mm_tile_n weight rows to the activation dtype (values
  // already rounded; threads split over its rows), then one at::mm outside any parallel region so
  // that it runs with all threads and the best GEMM (bf16 weights are used as they are). The tile
  // lives in a buffer this thread keeps (it only grows, to at most mm_tile_n x K activation
  // elements): a fresh one per expert would be page-faulted in on every call.
  thread_local AlignedBuffer tile_bytes;
  for (const Task& tk : gemm) {
    const int64_t rows = tk.r1 - tk.r0, nt = tk.n1 - tk.n0;
    at::Tensor tile;
    if (fmt == BF16 && w.round_bf16) {
      tile = q.select(0, tk.e).narrow(0, tk.n0, nt);
    } else {
      char* base = static_cast<char*>(tile_bytes.get(size_t(nt * K) * x.element_size()));
      tile = at::from_blob(base, {nt, K}, x.options());
      at::parallel_for(tk.n0, tk.n1, fp8_table ? block_n : 16, [&](int64_t a, int64_t b) {
        // per-thread scratch kept across calls, as in the GEMV tasks above
        thread_local std::vector<uint8_t> tabs;
        thread_local std::vector<float> buf, scratch;
        if (fp8_table) {
#if M2_X86
          if (tabs.size() < size_t(256 * (K / block_k))) tabs.resize(256 * (K / block_k));
          fp8_rows_to_bf16(w, tk.e, a, b, reinterpret_cast<uint16_t*>(base) + (a - tk.n0) * K, tabs.data());
#endif
          return;
        }
        if (buf.size() < size_t(K)) buf.resize(K);
        if (scratch.size() < size_t(K / 16 + 1)) scratch.resize(K / 16 + 1);
        for (int64_t n = a; n < b; ++n) {
          decode(w, tk.e, n, buf.data(), scratch.data());
          if (w.round_bf16) {
            uint16_t* dst = reinterpret_cast<uint16_t*>(base) + (n - tk.n0) * K;
            for (int64_t k = 0; k < K; ++k) dst[k] = uint16_t(f_bits(buf[k]) >> 16);
          } else {
            std::memcpy(reinterpret_cast<float*>(base) + (n - tk.n0) * K, buf.data(), K * sizeof(float));
          }
        }
      });
    }
    if (x.scalar_type() == at::kFloat && nt == N) {  // whole rows of y32: the GEMM writes them
      at::Tensor dst = y32.narrow(0, tk.r0, rows);
      at::mm_out(dst, x.narrow(0, tk.r0, rows), tile.t());
      continue;
    }
    at::Tensor part = at::mm(x.narrow(0, tk.r0, rows), tile.t());  // [rows, nt] act dtype
    y32.narrow(0, tk.r0, rows).narrow(1, tk.n0, nt).copy_(part);
  }
  return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(m2serve_kernels, m) {
  m.def("isa_supported(int isa) -> bool");
  m.def("grouped_linear(Tensor x, Tensor offsets, Tensor q, Tensor scale, Tensor? scale2, int fmt, int block_n, "
        "int block_k, int isa, int tile_n, int gemv_rows, int mm_tile_n) -> Tensor");
}

TORCH_LIBRARY_IMPL(m2serve_kernels, CPU, m) { m.impl("grouped_linear", &grouped_linear); }

TORCH_LIBRARY_IMPL(m2serve_kernels, CompositeExplicitAutograd, m) { m.impl("isa_supported", &isa_supported); }
