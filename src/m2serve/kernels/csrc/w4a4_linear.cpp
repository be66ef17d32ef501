// FP4 x FP4 CPU linears (W4A4): y = fp4(x) · dequant(W)ᵀ with both operands as E2M1 codes
// (docs/checkpoints.md §9 for the activation rounding rules, §9.1 for this kernel).
//
// Legend: E experts in one call (1 for a plain linear), R activation rows (sorted by expert),
// N output features, K input features, g the FP4 group (32 MXFP4, 16 NVFP4), G = K / g.
//
// Every E2M1 value times 2 is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, so a group's dot
// product of E2M1 codes is an int8 dot product D (exact in int32), and the group contributes
//   D · (s_x / 4) · s_w
// with s_x the activation group's scale (MXFP4: E8M0 2^e from the group's amax, Quark's rule;
// NVFP4: e4m3 block · the expert's input scale, ModelOpt's rule, or e4m3 block / the expert's input
// global scale, compressed-tensors' rule) and s_w the weight group's
// (MXFP4 2^(e8m0 - 127); NVFP4 ModelOpt e4m3 · scale_2, compressed-tensors e4m3 / scale_2).
// Activations are quantised once per call per row (the pre-pass, bit-equal to formats/act_quant.py
// qdq_mxfp4 / qdq_nvfp4 / qdq_nvfp4_ct) into unsigned codes a + 12 in [0, 24] (the unsigned side of u8 x s8 dot
// products; Σ 12·w per lane is subtracted once per weight chunk, shared by every row) laid out per
// 128-column chunk as [64 even columns][64 odd columns], the order of the weight's low and high
// nibbles. A 4-byte int32 lane of a chunk then covers 8 consecutive columns, so one group is 4
// (MXFP4) or 2 (NVFP4) lanes: each lane is converted to fp32 and multiplied by its group's scale
// product, the lanes are summed in fp32. Columns past the last whole chunk (K mod 128, whole
// groups) are done per group in scalar code. A row whose quantisation holds inf or NaN (MXFP4: a
// group with inf or NaN; NVFP4: a non-finite (or zero) block scale) is computed instead as the fp32 sum of
// the dequantised values (the reference's own values, so NaN and inf come out as there).
//
// Paths (chosen by the caller once, never per call): 0 scalar, 1 AVX2 (vpmaddubsw + vpmaddwd),
// 2 AVX-512 VNNI (vpdpbusd). A row's fp32 summation order does not depend on the other rows of
// the call (batch invariant). The result equals quantise-then-matmul in fp32 up to that order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define W4_X86 1
#define W4_AVX2 __attribute__((target("avx2,fma")))
#define W4_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#else
#define W4_X86 0
#endif

namespace {

enum Fmt : int64_t { NVFP4_MODELOPT = 2, NVFP4_CT = 3, MXFP4 = 4 };  // packed_linear.cpp's codes
enum Path : int64_t { SCALAR = 0, AVX2 = 1, AVX512_VNNI = 2 };
// Activation rules (docs/checkpoints.md §9): Quark MXFP4, ModelOpt NVFP4, compressed-tensors NVFP4.
enum Act : int64_t { ACT_MX = 0, ACT_NV = 1, ACT_NV_CT = 2 };

constexpr int64_t CH = 128;     // columns per chunk (64 weight bytes)
constexpr int64_t LANES = 16;   // int32 lanes per chunk, 8 columns each
constexpr int64_t ROW_BLOCK = 8;  // activation rows per micro-kernel call
constexpr int OFF = 12;         // stored activation code = 2·e2m1 + 12

// 2·E2M1 by 4-bit code (bit 3 sign), as int8: the table the nibbles index.
alignas(16) constexpr int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// Group (within a chunk) of each int32 lane: 8 columns a lane, 32 (MXFP4) or 16 (NVFP4) a group.
alignas(64) constexpr int32_t LANE_GROUP_MX[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
alignas(64) constexpr int32_t LANE_GROUP_NV[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
// Block transposes (AVX-512): lane l of vector v takes int32 lane 4(l%4)+v (MXFP4) / 2(l%8)+v (NVFP4)
// of weight vector l/4 (MXFP4: pairs 0-1 and 2-3 each give 8 lanes) / l/8 (NVFP4), as vpermt2d indices.
alignas(64) constexpr int32_t BLOCK_IDX_MX[4][16] = {
    {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28},
    {1, 5, 9, 13, 17, 21, 25, 29, 1, 5, 9, 13, 17, 21, 25, 29},
    {2, 6, 10, 14, 18, 22, 26, 30, 2, 6, 10, 14, 18, 22, 26, 30},
    {3, 7, 11, 15, 19, 23, 27, 31, 3, 7, 11, 15, 19, 23, 27, 31}};
alignas(64) constexpr int32_t BLOCK_IDX_NV[2][16] = {
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
constexpr float E2M1_MAG[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float NV_MIN_BLOCK_SCALE = 1e-5f;  // formats/act_quant.py NVFP4_MIN_BLOCK_SCALE
constexpr float NV_MIN_INPUT_SCALE = 1e-12f;  // formats/act_quant.py NVFP4_MIN_INPUT_SCALE
constexpr float NV_CT_ZERO_BLOCK_SCALE = 0.125f;  // formats/act_quant.py NVFP4_CT_ZERO_BLOCK_SCALE
constexpr float E4M3_MAX = 448.0f;

inline float bits_f(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Nearest E2M1 magnitude code 0..7 of m >= 0, ties to the even code, saturating; NaN -> 7
// (formats/act_quant.py round_e2m1: bucketize counts the bounds strictly below m).
inline int e2m1_code(float m) {
  if (std::isnan(m)) return 7;
  int c = (m > 0.25f) + (m > 0.75f) + (m > 1.25f) + (m > 1.75f) + (m > 2.5f) + (m > 3.5f) + (m > 5.0f);
  return c + ((m == 0.75f) | (m == 1.75f) | (m == 3.5f));
}

// MXFP4 shared scale of a group amax (formats/act_quant.py mxfp4_scale, Quark "even").
inline float mx_scale(float amax) {
  if (std::isnan(amax)) return amax;
  const uint32_t rounded = (f_bits(amax) + (1u << 21)) & 0x7F800000u;
  const int biased = int(rounded >> 23);
  const int e = std::clamp(biased == 255 ? 127 : biased - 129, -127, 127);
  return e >= -126 ? bits_f(uint32_t(e + 127) << 23) : bits_f(1u << 22);
}

// fp32 v in [0, 448] or NaN -> the nearest e4m3fn value (ties to even, subnormals kept).
inline float round_e4m3(float v) {
  if (std::isnan(v)) return v;
  if (v < 0x1p-6f) return std::nearbyint(v * 0x1p9f) * 0x1p-9f;  // subnormal step 2^-9
  int e;
  std::frexp(v, &e);  // v = m · 2^e, m in [0.5, 1): step 2^(e - 1 - 3)
  const float step = std::ldexp(1.0f, e - 4);
  return std::nearbyint(v / step) * step;
}

// fp32 -> bf16 -> fp32, round to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline float round_bf16(float f) {
  const uint32_t u = f_bits(f);
  if (std::isnan(f)) return f;
  return bits_f((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

inline float load_x(const void* x, bool bf16, int64_t i) {
  if (bf16) return bits_f(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16);
  return static_cast<const float*>(x)[i];
}

// Activations of one call in the kernel's layout (module comment). Three regions along K:
// - blocks (AVX-512 VNNI only): nblk blocks of 16 groups (16·g columns); in a block, vector v
//   (v < g/8) is [64 even][64 odd] bytes where int32 lane l holds columns 8v..8v+7 of group l, so
//   that g/8 vpdpbusd leave each group's whole dot product in its own lane (the weight bytes are
//   transposed to match in registers);
// - chunks: nch chunks of 128 columns, [64 even][64 odd], lane l = columns 8l..8l+7;
// - tail: the remaining whole groups, in column order.
struct Acts {
  int64_t K, g, nblk, nch, tail_groups, sa_row;  // sa_row: floats of sa per row
  std::vector<uint8_t> codes;    // [R, K] stored codes (2·e2m1 + 12), in the layout above
  std::vector<float> sa;         // [R, sa_row] s_x / 4: per block group, per chunk lane, per tail group
  std::vector<uint8_t> special;  // [R]: 1 when the row is computed from its fp32 values
  std::vector<int32_t> posmap;   // [K] pos(k), made once per call
  std::vector<int32_t> samap;    // [K/8] sa_index(8j)
  int64_t kb() const { return nblk * LANES * g; }  // first column after the blocks
  int64_t kc() const { return kb() + nch * CH; }   // first tail column
  int64_t sa_chunk0() const { return nblk * LANES; }
  int64_t sa_tail0() const { return (nblk + nch) * LANES; }
  int64_t pos(int64_t k) const {  // position of column k in a row's codes
    if (k < kb()) {
      const int64_t kk = k % (LANES * g), w = kk % g, j = w % 8;
      return (k - kk) + (w / 8) * CH + (j & 1) * 64 + (kk / g) * 4 + j / 2;
    }
    if (k < kc()) {
      const int64_t kk = (k - kb()) % CH;
      return k - kk + (kk & 1) * 64 + kk / 2;
    }
    return k;
  }
  int64_t sa_index(int64_t k) const {  // where column k's s_x / 4 is in a row's sa
    if (k < kb()) return k / g;
    if (k < kc()) return sa_chunk0() + ((k - kb()) / CH) * LANES + ((k - kb()) % CH) / 8;
    return sa_tail0() + (k - kc()) / g;
  }
};

inline float clamp6(float v) { return v < -6.0f ? -6.0f : (v > 6.0f ? 6.0f : v); }  // NaN stays NaN

// The reference's dequantised value of x in a group of scale s (formats/act_quant.py, fp32).
inline float qdq_value(float x, float s, int64_t act) {
  if (act == ACT_NV_CT) {
    const float v = clamp6(x / s), m = std::fabs(v);
    const float q = std::isnan(m) ? m : E2M1_MAG[e2m1_code(m)];
    const float sign = v > 0 ? 1.0f : (v < 0 ? -1.0f : (v == 0 ? 0.0f : v));
    return q * sign * s;
  }
  if (act == ACT_MX) {
    const float v = x / s;
    float q = E2M1_MAG[e2m1_code(std::fabs(v))];
    q = q == 0.0f ? 0.0f : (v < 0 ? -q : q);
    if (!std::isfinite(v)) q = v;
    return q * s;
  }
  const float y = E2M1_MAG[e2m1_code(std::fabs(x) / s)] * s;
  return x >= 0 ? y : 0.0f - y;
}

// Group scale of row values xs[0, g): returns s (MXFP4: 2^e; NVFP4: the block scale under gs) and
// sets `special` when the row must take the fp32 path.
// bf16: the row is bf16 (compressed-tensors divides its amax by 6 in the input's dtype).
inline float group_scale(const float* xs, int64_t g, int64_t act, float gs, bool bf16, bool& special) {
  if (act == ACT_NV_CT) {
    float lo = 0.0f, hi = 0.0f;  // min(group, 0), max(group, 0), NaN propagating
    bool nan = false;
    for (int64_t i = 0; i < g; ++i) {
      nan |= std::isnan(xs[i]);
      lo = xs[i] < lo ? xs[i] : lo;
      hi = xs[i] > hi ? xs[i] : hi;
    }
    const float amax = nan ? NAN : std::max(std::fabs(lo), std::fabs(hi));
    const float a6 = bf16 ? round_bf16(amax / 6.0f) : amax / 6.0f;
    float block = gs * a6;
    if (block > E4M3_MAX) block = E4M3_MAX;
    if (block < -E4M3_MAX) block = -E4M3_MAX;
    block = std::copysign(round_e4m3(std::fabs(block)), block);
    const float s = (block == 0.0f ? NV_CT_ZERO_BLOCK_SCALE : block) / gs;
    if (!std::isfinite(s) || s == 0.0f) special = true;
    return s;
  }
  if (act == ACT_MX) {
    float amax = 0.0f;
    bool nan = false, inf = false;
    for (int64_t i = 0; i < g; ++i) {
      const float a = std::fabs(xs[i]);
      nan |= std::isnan(a);
      inf |= std::isinf(a);
      amax = a > amax ? a : amax;
    }
    if (nan || inf) special = true;
    return mx_scale(nan ? NAN : amax);
  }
  float amax = 0.0f;  // NaN ignored
  for (int64_t i = 0; i < g; ++i) {
    const float a = std::fabs(xs[i]);
    amax = a > amax ? a : amax;  // false for NaN
  }
  float block = amax / (6.0f * gs);
  if (block > E4M3_MAX) block = E4M3_MAX;
  float s = round_e4m3(block) * gs;
  s = s >= NV_MIN_BLOCK_SCALE ? s : 1.0f;
  if (!std::isfinite(s)) special = true;
  return s;
}

// Quantise row r (values from x) into acts; gs: the NVFP4 input scale of the row's expert.
void quantize_row(const void* x, bool bf16, int64_t r, int64_t act, float gs, Acts& a, std::vector<float>& tmp) {
  const int64_t K = a.K, g = a.g, G = K / g;
  tmp.resize(K + G);
  float* xs = tmp.data();
  float* sg = tmp.data() + K;
  for (int64_t k = 0; k < K; ++k) xs[k] = load_x(x, bf16, r * K + k);
  if (act == ACT_NV) gs = gs > 0 ? gs : NV_MIN_INPUT_SCALE;  // NaN too
  bool special = false;
  for (int64_t j = 0; j < G; ++j) sg[j] = group_scale(xs + j * g, g, act, gs, bf16, special);
  a.special[r] = special;
  uint8_t* codes = a.codes.data() + r * K;
  float* sa = a.sa.data() + r * a.sa_row;
  for (int64_t j = 0; j < G; ++j) {
    const float s = sg[j], inv = 1.0f / s;
    for (int64_t k = j * g; k < (j + 1) * g; ++k) {
      int c;
      if (act == ACT_MX) {
        const float v = xs[k] * inv;  // = xs[k] / s: 1/s is exact (a power of two), both round once
        c = E2M1_X2[e2m1_code(std::fabs(v))];
        c = v < 0 ? -c : c;
      } else if (act == ACT_NV_CT) {
        const float v = clamp6(xs[k] / s);
        c = E2M1_X2[e2m1_code(std::fabs(v))];
        c = v < 0 ? -c : c;
      } else {
        c = E2M1_X2[e2m1_code(std::fabs(xs[k]) / s)];
        c = xs[k] >= 0 ? c : -c;
      }
      codes[a.posmap[k]] = uint8_t(c + OFF);
    }
  }
  for (int64_t k = 0; k < K; k += 8) sa[a.samap[k / 8]] = sg[k / g] * 0.25f;
}

// One grouped FP4 weight as stored.
struct Weight {
  int64_t fmt, N, K, g;
  const uint8_t* q; int64_t q_e, q_n;   // [E, N, K/2] bytes
  const uint8_t* s; int64_t s_e, s_n;   // [E, N, G] e8m0 / e4m3 bytes
  const float* s2; int64_t s2_e, s2_n;  // NVFP4: [E] or [E, N]
};

inline float e4m3_to_f(uint8_t b) {
  const uint32_t em = b & 0x7Fu, sign = uint32_t(b & 0x80u) << 24;
  if (em == 0x7Fu) return bits_f(0x7FC00000u | sign);
  return bits_f(f_bits(bits_f(em << 20) * 0x1p120f) | sign);
}

inline float e8m0_to_f(uint8_t e) {
  if (e == 255) return bits_f(0x7FC00000u);
  return e == 0 ? bits_f(0x00400000u) : bits_f(uint32_t(e) << 23);
}

inline float weight_group_scale(const Weight& w, int64_t e, int64_t n, int64_t j) {
  const uint8_t b = w.s[e * w.s_e + n * w.s_n + j];
  if (w.fmt == MXFP4) return e8m0_to_f(b);
  const float s2 = w.s2[e * w.s2_e + n * w.s2_n];
  return w.fmt == NVFP4_MODELOPT ? e4m3_to_f(b) * s2 : e4m3_to_f(b) / s2;
}

// Group scales of weight row n: out[0, G) (scalar).
void weight_scales_scalar(const Weight& w, int64_t e, int64_t n, float* out) {
  for (int64_t j = 0; j < w.K / w.g; ++j) out[j] = weight_group_scale(w, e, n, j);
}

// Tail groups of one row against weight row bytes p: Σ_t D_t · sa_t · sw_t (fp32, in order).
// sw: the weight row's group scales.
inline float tail_dot(const uint8_t* p, const uint8_t* codes, const float* sa, const float* sw, const Acts& a) {
  float acc = 0.0f;
  const int64_t k0 = a.kc();
  for (int64_t t = 0; t < a.tail_groups; ++t) {
    int32_t d = 0;
    for (int64_t k = k0 + t * a.g; k < k0 + (t + 1) * a.g; k += 2) {
      const uint8_t b = p[k / 2];
      d += (int32_t(codes[k]) - OFF) * E2M1_X2[b & 0xF] + (int32_t(codes[k + 1]) - OFF) * E2M1_X2[b >> 4];
    }
    acc += float(d) * (sa[a.sa_tail0() + t] * sw[k0 / a.g + t]);
  }
  return acc;
}

// rows [r0, r0 + m) of acts against weight row p (group scales sw) -> out[i] (fp32), scalar.
void rows_scalar(const uint8_t* p, const float* sw, const Acts& a, int64_t r0, int64_t m, float* out) {
  for (int64_t i = 0; i < m; ++i) {
    const uint8_t* codes = a.codes.data() + (r0 + i) * a.K;
    const float* sa = a.sa.data() + (r0 + i) * a.sa_row;
    float lane[LANES] = {};
    for (int64_t j = 0; j < a.nblk * LANES; ++j) {  // blocks: one group a term
      int32_t d = 0;
      for (int64_t k = j * a.g; k < (j + 1) * a.g; k += 2) {
        const uint8_t wb = p[k / 2];
        d += (int32_t(codes[a.pos(k)]) - OFF) * E2M1_X2[wb & 0xF];
        d += (int32_t(codes[a.pos(k + 1)]) - OFF) * E2M1_X2[wb >> 4];
      }
      lane[j % LANES] += float(d) * (sa[j] * sw[j]);
    }
    const int64_t kb = a.kb();
    for (int64_t c = 0; c < a.nch; ++c) {
      for (int64_t l = 0; l < LANES; ++l) {
        int32_t d = 0;
        for (int64_t b = 4 * l; b < 4 * l + 4; ++b) {
          const uint8_t wb = p[kb / 2 + c * 64 + b];
          d += (int32_t(codes[kb + c * CH + b]) - OFF) * E2M1_X2[wb & 0xF];
          d += (int32_t(codes[kb + c * CH + 64 + b]) - OFF) * E2M1_X2[wb >> 4];
        }
        lane[l] += float(d) * (sa[a.sa_chunk0() + c * LANES + l] * sw[(kb + c * CH + 8 * l) / a.g]);
      }
    }
    float acc = 0.0f;
    for (int64_t l = 0; l < LANES; ++l) acc += lane[l];
    out[i] = acc + tail_dot(p, codes, sa, sw, a);
  }
}

// The last step of the vector row kernels: out[i] = the fp32 sum, in lane order, of row i's L lanes
// (lanes[i·L, (i+1)·L), the stored accumulator) + its tail groups (tail_dot), for rows r0 .. r0 + m.
inline void finish_rows(const float* lanes, int L, int m, const uint8_t* p, const float* sw, const Acts& a,
                        int64_t r0, float* out) {
  for (int i = 0; i < m; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < L; ++j) acc += lanes[i * L + j];
    out[i] = acc + tail_dot(p, a.codes.data() + (r0 + i) * a.K, a.sa.data() + (r0 + i) * a.sa_row, sw, a);
  }
}

#if W4_X86
// Group scales of weight row n, 8 at a time (the scalar formulas lane-wise, exact decodes).
W4_AVX2 void weight_scales_avx2(const Weight& w, int64_t e, int64_t n, float* out) {
  const int64_t G = w.K / w.g;
  const uint8_t* b = w.s + e * w.s_e + n * w.s_n;
  int64_t j = 0;
  if (w.fmt == MXFP4) {
    for (; j + 8 <= G; j += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j)));
      __m256i f = _mm256_slli_epi32(v, 23);
      f = _mm256_blendv_epi8(f, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(v, _mm256_setzero_si256()));
      f = _mm256_blendv_epi8(f, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
      _mm256_storeu_ps(out + j, _mm256_castsi256_ps(f));
    }
  } else {
    const __m256 s2 = _mm256_set1_ps(w.s2[e * w.s2_e + n * w.s2_n]);
    for (; j + 8 <= G; j += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j)));
      const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
      const __m256 mag = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(em, 20)), _mm256_set1_ps(0x1p120f));
      const __m256i r = _mm256_blendv_epi8(_mm256_castps_si256(mag), _mm256_set1_epi32(0x7FC00000),
                                           _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
      const __m256 ws = _mm256_castsi256_ps(_mm256_or_si256(r, sign));
      _mm256_storeu_ps(out + j, w.fmt == NVFP4_MODELOPT ? _mm256_mul_ps(ws, s2) : _mm256_div_ps(ws, s2));
    }
  }
  for (; j < G; ++j) out[j] = weight_group_scale(w, e, n, j);
}

// ---------------------------------------------------------------- AVX2: vpmaddubsw + vpmaddwd
template <int M>
W4_AVX2 void rows_avx2_m(const uint8_t* p, const float* sw, const Acts& a, int64_t r0, float* out) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2)));
  const __m256i low4 = _mm256_set1_epi8(0x0F), twelve = _mm256_set1_epi8(OFF), ones = _mm256_set1_epi16(1);
  const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.g == 32 ? LANE_GROUP_MX : LANE_GROUP_NV));
  const int64_t gpc = CH / a.g, gph = gpc / 2;  // groups per chunk, per half
  __m256 facc[M];
  for (int i = 0; i < M; ++i) facc[i] = _mm256_setzero_ps();
  const uint8_t* codes = a.codes.data() + r0 * a.K + a.kb();  // the AVX2 layout has no blocks: kb() = 0
  const float* sa = a.sa.data() + r0 * a.sa_row + a.sa_chunk0();
  const uint8_t* pc = p + a.kb() / 2;
  const float* swc = sw + a.kb() / a.g;
  for (int64_t c = 0; c < a.nch; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + c * 64 + h * 32));
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(b, low4));
      const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
      const __m256i corr = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(twelve, lo), _mm256_maddubs_epi16(twelve, hi)), ones);
      const __m256 s = _mm256_permutevar8x32_ps(_mm256_loadu_ps(swc + c * gpc + h * gph), idx);
      for (int i = 0; i < M; ++i) {
        const uint8_t* ci = codes + i * a.K + c * CH + h * 32;
        const __m256i ae = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci));
        const __m256i ao = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + 64));
        const __m256i d16 = _mm256_add_epi16(_mm256_maddubs_epi16(ae, lo), _mm256_maddubs_epi16(ao, hi));
        const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(d16, ones), corr);
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(sa + i * a.sa_row + c * LANES + h * 8), s);
        facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, facc[i]);
      }
    }
  }
  alignas(32) float l[M * 8];
  for (int i = 0; i < M; ++i) _mm256_store_ps(l + i * 8, facc[i]);
  finish_rows(l, 8, M, p, sw, a, r0, out);
}

// ---------------------------------------------------------------- AVX-512 VNNI: vpdpbusd
// Blocks of 16 groups: the block's weight bytes transposed (vpermt2d) so that lane l holds group l's
// bytes 4v..4v+3 in vector v (MXFP4: NV = 4 vectors from 4 chunks, NVFP4: NV = 2 from 2); then NV
// vpdpbusd pairs per row leave each group's whole dot product in its lane, and one multiply by
// (s_x/4 · s_w) per 16 groups. Rows are interleaved per vector (M independent chains).
template <int M, int NV>
W4_VNNI inline void vnni_blocks(const uint8_t* p, const float* sw, const Acts& a, const uint8_t* codes,
                                const float* sa, __m512* facc) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2)));
  const __m512i low4 = _mm512_set1_epi8(0x0F), twelve = _mm512_set1_epi8(OFF), zero = _mm512_setzero_si512();
  const int64_t K = a.K, bcols = LANES * a.g, sa_row = a.sa_row;
  for (int64_t blk = 0; blk < a.nblk; ++blk) {
    const uint8_t* pb = p + blk * bcols / 2;
    __m512i lo[NV], hi[NV];
    __m512i ncorr = zero;
    for (int v = 0; v < NV; ++v) {
      const __m512i ix = _mm512_load_si512(NV == 4 ? BLOCK_IDX_MX[v] : BLOCK_IDX_NV[v]);
      __m512i t;
      if (NV == 4) {
        const __m512i w01 = _mm512_permutex2var_epi32(_mm512_loadu_si512(pb), ix, _mm512_loadu_si512(pb + 64));
        const __m512i w23 = _mm512_permutex2var_epi32(_mm512_loadu_si512(pb + 128), ix, _mm512_loadu_si512(pb + 192));
        t = _mm512_mask_blend_epi32(__mmask16(0xFF00), w01, w23);
      } else {
        t = _mm512_permutex2var_epi32(_mm512_loadu_si512(pb), ix, _mm512_loadu_si512(pb + 64));
      }
      lo[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(t, low4));
      hi[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t, 4), low4));
      ncorr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ncorr, twelve, lo[v]), twelve, hi[v]);
    }
    ncorr = _mm512_sub_epi32(zero, ncorr);
    __m512i d[M];
    for (int i = 0; i < M; ++i) d[i] = ncorr;
    const uint8_t* cb = codes + blk * bcols;
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < M; ++i) {
        d[i] = _mm512_dpbusd_epi32(d[i], _mm512_loadu_si512(cb + i * K + v * CH), lo[v]);
        d[i] = _mm512_dpbusd_epi32(d[i], _mm512_loadu_si512(cb + i * K + v * CH + 64), hi[v]);
      }
    const __m512 s = _mm512_loadu_ps(sw + blk * LANES);
    for (int i = 0; i < M; ++i) {
      const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(sa + i * sa_row + blk * LANES), s);
      facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i]), sc, facc[i]);
    }
  }
}

template <int M>
W4_VNNI void rows_vnni_m(const uint8_t* p, const float* sw, const Acts& a, int64_t r0, float* out) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2)));
  const __m512i low4 = _mm512_set1_epi8(0x0F), twelve = _mm512_set1_epi8(OFF), zero = _mm512_setzero_si512();
  const __m512i idx = _mm512_loadu_si512(a.g == 32 ? LANE_GROUP_MX : LANE_GROUP_NV);
  const int64_t gpc = CH / a.g;
  __m512 facc[M];
  for (int i = 0; i < M; ++i) facc[i] = _mm512_setzero_ps();
  const uint8_t* codes = a.codes.data() + r0 * a.K;
  const float* sa = a.sa.data() + r0 * a.sa_row;
  if (a.g == 32) vnni_blocks<M, 4>(p, sw, a, codes, sa, facc);
  else vnni_blocks<M, 2>(p, sw, a, codes, sa, facc);
  codes += a.kb();
  sa += a.sa_chunk0();
  const uint8_t* pc = p + a.kb() / 2;
  const float* swc = sw + a.kb() / a.g;
  for (int64_t c = 0; c < a.nch; ++c) {
    const __m512i b = _mm512_loadu_si512(pc + c * 64);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low4));
    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4));
    const __m512i corr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, twelve, lo), twelve, hi);
    const __m512 s = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(swc + c * gpc));
    for (int i = 0; i < M; ++i) {
      const uint8_t* ci = codes + i * a.K + c * CH;
      __m512i d = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(ci), lo);
      d = _mm512_sub_epi32(_mm512_dpbusd_epi32(d, _mm512_loadu_si512(ci + 64), hi), corr);
      const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(sa + i * a.sa_row + c * LANES), s);
      facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, facc[i]);
    }
  }
  alignas(64) float l[M * 16];
  for (int i = 0; i < M; ++i) _mm512_store_ps(l + i * 16, facc[i]);
  finish_rows(l, 16, M, p, sw, a, r0, out);
}

#define W4_ROWS(fn)                                                                                   \
  void fn(const uint8_t* p, const float* sw, const Acts& a, int64_t r0, int64_t m, float* out) {     \
    switch (m) {                                                                                      \
      case 1: return fn##_m<1>(p, sw, a, r0, out);                                                    \
      case 2: return fn##_m<2>(p, sw, a, r0, out);                                                    \
      case 3: return fn##_m<3>(p, sw, a, r0, out);                                                    \
      case 4: return fn##_m<4>(p, sw, a, r0, out);                                                    \
      case 5: return fn##_m<5>(p, sw, a, r0, out);                                                    \
      case 6: return fn##_m<6>(p, sw, a, r0, out);                                                    \
      case 7: return fn##_m<7>(p, sw, a, r0, out);                                                    \
      default: return fn##_m<8>(p, sw, a, r0, out);                                                   \
    }                                                                                                 \
  }
W4_ROWS(rows_avx2)
W4_ROWS(rows_vnni)
#undef W4_ROWS
#endif

bool path_supported(int64_t path) {
  if (path == SCALAR) return true;
#if W4_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (path == AVX2) return avx2;
  if (path == AVX512_VNNI)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

using RowsFn = void (*)(const uint8_t*, const float*, const Acts&, int64_t, int64_t, float*);
using ScalesFn = void (*)(const Weight&, int64_t, int64_t, float*);

// Checks shared by both ops; returns the row -> expert map and fills the acts (pre-pass).
// `blocked`: the layout has the block region (the AVX-512 VNNI path).
// `act`: the activation rule (Act), which must fit the weight format `fmt` (same group).
std::vector<int64_t> quantize_all(const at::Tensor& x, const at::Tensor& offsets, int64_t E, int64_t fmt,
                                  int64_t act, const std::optional<at::Tensor>& act_scale, bool blocked,
                                  Acts& a) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "w4a4: x must be a contiguous [R, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "w4a4: activations must be bfloat16 or float32, found ", x.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kInt && offsets.size(0) == E &&
              offsets.is_contiguous(), "w4a4: offsets must be a contiguous int32 [E] with E = ", E);
  TORCH_CHECK(fmt == MXFP4 || fmt == NVFP4_MODELOPT || fmt == NVFP4_CT, "w4a4: unknown FP4 format code ", fmt);
  const bool mx = fmt == MXFP4;
  TORCH_CHECK(act >= ACT_MX && act <= ACT_NV_CT && (act == ACT_MX) == mx,
              "w4a4: activation rule ", act, " does not fit weight format ", fmt);
  const int64_t R = x.size(0), K = x.size(1), g = mx ? 32 : 16;
  TORCH_CHECK(K % g == 0, "w4a4: K = ", K, " is not a multiple of the FP4 group ", g);
  const float* gs = nullptr;
  if (!mx) {
    TORCH_CHECK(act_scale.has_value() && act_scale->scalar_type() == at::kFloat && act_scale->dim() == 1 &&
                act_scale->size(0) == E && act_scale->is_contiguous(),
                "w4a4: NVFP4 needs a contiguous act_scale f32 [E] (each expert's input scale)");
    gs = act_scale->data_ptr<float>();
  }
  std::vector<int64_t> expert(R, -1);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = offsets.data_ptr<int32_t>()[e];
    TORCH_CHECK(end >= start && end <= R, "w4a4: offsets must be non-decreasing and <= R");
    for (int64_t r = start; r < end; ++r) expert[r] = e;
    start = end;
  }
  a.K = K; a.g = g;
  a.nblk = blocked ? K / (LANES * g) : 0;
  a.nch = (K - a.kb()) / CH;
  a.tail_groups = (K - a.kc()) / g;
  a.sa_row = a.sa_tail0() + a.tail_groups;
  a.posmap.resize(K);
  a.samap.resize(K / 8);
  for (int64_t k = 0; k < K; ++k) a.posmap[k] = int32_t(a.pos(k));
  for (int64_t k = 0; k < K; k += 8) a.samap[k / 8] = int32_t(a.sa_index(k));
  a.codes.assign(R * K, OFF);
  a.sa.assign(R * a.sa_row, 0.0f);
  a.special.assign(R, 0);
  const void* xp = x.data_ptr();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, R, 4, [&](int64_t b, int64_t c) {
    std::vector<float> tmp;
    for (int64_t r = b; r < c; ++r)
      if (expert[r] >= 0) quantize_row(xp, bf16, r, act, mx ? 0.0f : gs[expert[r]], a, tmp);
  });
  return expert;
}

// The fp32 dequantised activations of row r (the reference's values, formats/act_quant.py).
void row_values(const at::Tensor& x, const Acts& a, int64_t r, int64_t act, float gs, float* out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t K = a.K, g = a.g;
  std::vector<float> xs(K);
  for (int64_t k = 0; k < K; ++k) xs[k] = load_x(x.data_ptr(), bf16, r * K + k);
  if (act == ACT_NV) gs = gs > 0 ? gs : NV_MIN_INPUT_SCALE;
  for (int64_t j = 0; j < K / g; ++j) {
    bool special = false;
    const float s = group_scale(xs.data() + j * g, g, act, gs, bf16, special);
    for (int64_t k = j * g; k < (j + 1) * g; ++k) out[k] = qdq_value(xs[k], s, act);
  }
}

// x [R, K] bf16/f32; offsets int32 [E]; q uint8 [E, N, K/2]; scale [E, N, K/g] one byte per group;
// scale2 f32 [E] or [E, N] (NVFP4); act_scale f32 [E] (NVFP4: each expert's input scale) -> y [R, N]
// in x's dtype. Rows at or past offsets[E-1] get 0. Threads split over (expert, tile of tile_n rows).
at::Tensor w4a4_linear(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& scale2, int64_t fmt,
                       int64_t act, const std::optional<at::Tensor>& act_scale, int64_t path, int64_t tile_n) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "w4a4_linear: q must be a contiguous uint8 [E, N, K/2] tensor");
  TORCH_CHECK(path_supported(path), "w4a4_linear: path ", path, " is not supported by this CPU");
  TORCH_CHECK(tile_n > 0, "w4a4_linear: tile_n must be positive");
  const int64_t E = q.size(0), N = q.size(1), K = x.dim() == 2 ? x.size(1) : 0, R = x.dim() == 2 ? x.size(0) : 0;
  TORCH_CHECK(2 * q.size(2) == K, "w4a4_linear: q holds K = ", 2 * q.size(2), " columns, x has ", K);
  Acts a;
  const std::vector<int64_t> expert = quantize_all(x, offsets, E, fmt, act, act_scale, path == AVX512_VNNI, a);
  const bool mx = fmt == MXFP4;
  TORCH_CHECK(scale.is_contiguous() && scale.element_size() == 1 && scale.dim() == 3 && scale.size(0) == E &&
              scale.size(1) == N && scale.size(2) == K / a.g, "w4a4_linear: scale must be one byte per group [E, N, K/g]");
  Weight w{fmt, N, K, a.g, q.data_ptr<uint8_t>(), q.stride(0), q.stride(1),
           static_cast<const uint8_t*>(scale.data_ptr()), scale.stride(0), scale.stride(1), nullptr, 0, 0};
  if (!mx) {
    TORCH_CHECK(scale2.has_value() && scale2->scalar_type() == at::kFloat && scale2->size(0) == E &&
                (scale2->dim() == 1 || (scale2->dim() == 2 && scale2->size(1) == N)),
                "w4a4_linear: NVFP4 needs an f32 scale2 [E] or [E, N]");
    w.s2 = scale2->data_ptr<float>();
    w.s2_e = scale2->stride(0);
    w.s2_n = scale2->dim() == 2 ? scale2->stride(1) : 0;
  }
  RowsFn rows = rows_scalar;
  ScalesFn scales = weight_scales_scalar;
#if W4_X86
  if (path == AVX2) { rows = rows_avx2; scales = weight_scales_avx2; }
  if (path == AVX512_VNNI) { rows = rows_vnni; scales = weight_scales_avx2; }
#endif
  struct Task { int64_t e, r0, r1, n0, n1; };
  std::vector<Task> tasks;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = offsets.data_ptr<int32_t>()[e];
    if (end > start)
      for (int64_t n0 = 0; n0 < N; n0 += tile_n) tasks.push_back({e, start, end, n0, std::min(N, n0 + tile_n)});
    start = end;
  }
  at::Tensor y32 = at::zeros({R, N}, x.options().dtype(at::kFloat));
  float* yp = y32.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    // A weight row's K/g group scales, padded with LANES lanes: the vector paths load 16 floats from a
    // chunk's first group and keep (permute) only the chunk's own groups, so the last chunk's load
    // reaches into the padding. The buffer is reused by this thread across tasks and calls with other
    // K and g, so the padding is set to 0 with each row's scales: no lane read holds a value left by
    // another row or call (the permutes discard those lanes, so this is not a numeric change).
    const int64_t G = K / a.g, sw_row = G + LANES;
    thread_local std::vector<float> sw;
    if (sw.size() < size_t(tile_n * sw_row)) sw.resize(tile_n * sw_row, 0.0f);
    float out[ROW_BLOCK];
    for (int64_t t = t0; t < t1; ++t) {
      const Task& tk = tasks[t];
      for (int64_t n = tk.n0; n < tk.n1; ++n) {
        float* row = sw.data() + (n - tk.n0) * sw_row;
        scales(w, tk.e, n, row);
        std::fill(row + G, row + sw_row, 0.0f);
      }
      for (int64_t r = tk.r0; r < tk.r1; r += ROW_BLOCK) {
        const int64_t m = std::min(ROW_BLOCK, tk.r1 - r);
        for (int64_t n = tk.n0; n < tk.n1; ++n) {
          rows(w.q + tk.e * w.q_e + n * w.q_n, sw.data() + (n - tk.n0) * sw_row, a, r, m, out);
          for (int64_t i = 0; i < m; ++i) yp[(r + i) * N + n] = out[i];
        }
      }
    }
  });
  // rows with inf / NaN in their quantisation: the fp32 sum of the dequantised values
  const float* gs = mx ? nullptr : act_scale->data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    if (!a.special[r]) continue;
    const int64_t e = expert[r];
    std::vector<float> v(K);
    row_values(x, a, r, act, mx ? 0.0f : gs[e], v.data());
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* p = w.q + e * w.q_e + n * w.q_n;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k += 2) {
          const float s = weight_group_scale(w, e, n, k / a.g);
          acc += v[k] * (float(E2M1_X2[p[k / 2] & 0xF]) * 0.5f * s);
          acc += v[k + 1] * (float(E2M1_X2[p[k / 2] >> 4]) * 0.5f * s);
        }
        yp[r * N + n] = acc;
      }
    });
  }
  return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
}

// The kernel's quantised activations, dequantised: x [R, K] -> f32 [R, K] (code / 2 · scale for the
// integer rows, read back through `path`'s layout; the fp32 values for the others; rows past
// offsets[E-1] give 0). For tests: it must equal formats/act_quant.py's qdq of x in fp32 bit for bit.
at::Tensor w4a4_quantize(const at::Tensor& x, const at::Tensor& offsets, int64_t fmt, int64_t act,
                         const std::optional<at::Tensor>& act_scale, int64_t path) {
  Acts a;
  const std::vector<int64_t> expert =
      quantize_all(x, offsets, offsets.size(0), fmt, act, act_scale, path == AVX512_VNNI, a);
  const bool mx = fmt == MXFP4;
  const int64_t R = x.size(0), K = x.size(1);
  at::Tensor out = at::zeros({R, K}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const float* gs = mx ? nullptr : act_scale->data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    if (expert[r] < 0) continue;
    if (a.special[r]) {
      row_values(x, a, r, act, mx ? 0.0f : gs[expert[r]], o + r * K);
      continue;
    }
    const float* sa = a.sa.data() + r * a.sa_row;
    for (int64_t k = 0; k < K; ++k) {
      o[r * K + k] = float(int(a.codes[r * K + a.pos(k)]) - OFF) * sa[a.sa_index(k)] * 2.0f;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(m2serve_kernels, m) {
  m.def("w4a4_path_supported(int path) -> bool");
  m.def("w4a4_linear(Tensor x, Tensor offsets, Tensor q, Tensor scale, Tensor? scale2, int fmt, int act, "
        "Tensor? act_scale, "
        "int path, int tile_n) -> Tensor");
  m.def("w4a4_quantize(Tensor x, Tensor offsets, int fmt, int act, Tensor? act_scale, int path) -> Tensor");
}

TORCH_LIBRARY_IMPL(m2serve_kernels, CPU, m) {
  m.impl("w4a4_linear", &w4a4_linear);
  m.impl("w4a4_quantize", &w4a4_quantize);
}

TORCH_LIBRARY_IMPL(m2serve_kernels, CompositeExplicitAutograd, m) {
  m.impl("w4a4_path_supported", &path_supported);
}
