// The row-invariant attention kernel (runtime.invariant, op attention_rows), included twice: by
// cpu_attention_isa.cpp under `#pragma GCC target` (AVX-512, then AVX2, each with FMA) and by
// cpu_attention.cpp for any x86-64, each time inside its own namespace (SPECDEC_ATTN_NS). Plain
// pointers only: no ATen code is compiled under a target pragma. The path is picked per CPU (or by
// $SPECDEC_ATTENTION_ISA, which tests use to run every build on one CPU).
//
// Per query the arithmetic is fixed, so a query's output depends only on its q and the keys it
// may see, never on the other queries, rows or padding slots of the call:
//   score_j = (sum over d = 0..D-1, in order, of q[d] * k_j[d], one fma per step) * 1/sqrt(D)
//     for its visible keys j in slot order (lanes run over 16 keys at once, never over d);
//   w_j = exp_nonpositive(score_j - max): one polynomial for every lane and vector width;
//   Z = the w_j summed in 16 lanes by j mod 16, then folded in one fixed tree;
//   out[d] = (sum over j, in order, of w_j * v_j[d], one fma per step) * (1 / Z).
// Every fma is exactly rounded (AVX-512 or AVX2 vfmadd, or std::fma), so the builds give the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#ifndef SPECDEC_ATTN_PROBLEM
#define SPECDEC_ATTN_PROBLEM
constexpr int64_t kAttnQueries = 32;  // queries per work item: they share its converted keys and values

// One call of attention_rows, as every build of the kernel takes it.
struct AttnProblem {
  const void* q;       // (B, Hq, T, D) contiguous
  const void* keys;    // (B, Hkv, S, D), strides below, last axis contiguous
  const void* values;
  void* out;           // (B, Hq, T, D) contiguous
  bool bf16;           // element type: bfloat16, else float32
  int64_t B, Hq, Hkv, T, D, S;
  int64_t ks[3], vs[3];   // strides of keys, values over (B, Hkv, S), in elements
  const bool* mask;       // (B, T, S) or null: causal on `pre` within `window`
  const int64_t* pre;     // (B,)
  int64_t window;         // 0 = none
  // a paged cache (runtime.paged_cache): keys, values are pools (NB, Hkv, bs, D) with strides ks, vs
  // over (NB, Hkv, bs), and slot s of row b is position s % bs of block table[b * tw + s / bs]
  const int64_t* table;   // (B, tw) or null: keys, values are (B, Hkv, S, D)
  int64_t tw, bs;
};

#endif

namespace SPECDEC_ATTN_NS {

constexpr int kLanes = 16;
// 16 floats as one value (GCC vector extension): elementwise IEEE arithmetic, the same bits whether
// the ISA runs it as one AVX-512 register or as four SSE ones; 4-byte aligned, so it may point into
// any float buffer
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kQueries = kAttnQueries;
constexpr int64_t kChunk = 32;    // keys per pass of the value sum (their float rows stay in L1)
constexpr int64_t kMaxD = 256;    // largest head dim

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16 (NaN kept quiet)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// a * b + c per lane, rounded once
#if defined(SPECDEC_ATTN_AVX512)
inline v16 fma16(float a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps(_mm512_set1_ps(a), (__m512)b, (__m512)c); }
#else
inline v16 fma16(float a, v16 b, v16 c) {
  for (int l = 0; l < kLanes; ++l) c[l] = __builtin_fmaf(a, b[l], c[l]);
  return c;
}
#endif

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// exp(x) for 16 values x <= 0 (Cody-Waite reduction, degree-6 polynomial, ~2 ulp; below -87 it
// returns exp(-87)). No library call and one formula for every lane.
inline v16 exp_nonpositive(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  const v16 t = x * 1.44269504088896341f + 0.5f;
  v16 n = __builtin_convertvector(__builtin_convertvector(t, i16), v16);  // trunc, then floor
  n = n > t ? n - 1.0f : n;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;  // 2^n
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One query's softmax weights in place: sc[0..n) = exp(sc - max), and 1 / their sum (n >= 1).
inline float softmax_weights(float* sc, int64_t n) {
  v16 top = v16{} + sc[0];  // lane maxima (a maximum is the same in any order)
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const v16 x = load16(sc + j);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, top[l]);
  for (; j < n; ++j) m = std::max(m, sc[j]);
  v16 sum{};
  for (j = 0; j + kLanes <= n; j += kLanes) {
    const v16 w = exp_nonpositive(load16(sc + j) - m);
    store16(sc + j, w);
    sum += w;
  }
  if (j < n) {  // the tail in a zero-padded vector: lane l holds key j + l, as a full vector would
    float tail[kLanes] = {0.0f};
    for (int64_t l = 0; j + l < n; ++l) tail[l] = sc[j + l] - m;
    v16 w = exp_nonpositive(load16(tail));
    for (int64_t l = n - j; l < kLanes; ++l) w[l] = 0.0f;
    store16(tail, w);
    for (int64_t l = 0; j + l < n; ++l) sc[j + l] = tail[l];
    sum += w;
  }
  for (int width = kLanes / 2; width > 0; width /= 2)  // fold: lane l += lane l + width
    for (int l = 0; l < width; ++l) sum[l] += sum[l + width];
  return 1.0f / sum[0];
}

inline float load_elem(const void* base, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// a[0 .. 16 NV) += w[j] * values[row(j) * stride + 0 .. 16 NV) for j = from .. stop - 1, in order (NV
// vectors held in registers); row(j) = slot[j], or j with no slot list (the caller's values start at
// the first visible slot)
#if defined(SPECDEC_ATTN_AVX2)
// (AVX2: each v16 as two 256-bit registers, by intrinsics: GCC moved 64-byte vector values through the
// stack and general registers there, ~10x the AVX-512 build's time)
template <int NV>
inline void weighted_sum(float* a, const float* w, const int32_t* slot, int64_t from, int64_t stop,
                         const float* values, int64_t stride) {
  __m256 r[2 * NV];
#pragma GCC unroll 16
  for (int u = 0; u < 2 * NV; ++u) r[u] = _mm256_loadu_ps(a + 8 * u);
  for (int64_t j = from; j < stop; ++j) {
    const float* row = values + (slot != nullptr ? static_cast<int64_t>(slot[j]) : j) * stride;
    const __m256 x = _mm256_set1_ps(w[j]);
#pragma GCC unroll 16
    for (int u = 0; u < 2 * NV; ++u) r[u] = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + 8 * u), r[u]);
  }
#pragma GCC unroll 16
  for (int u = 0; u < 2 * NV; ++u) _mm256_storeu_ps(a + 8 * u, r[u]);
}
#else
template <int NV>
inline void weighted_sum(float* a, const float* w, const int32_t* slot, int64_t from, int64_t stop,
                         const float* values, int64_t stride) {
  v16 r[NV];
  for (int u = 0; u < NV; ++u) r[u] = load16(a + u * kLanes);
  for (int64_t j = from; j < stop; ++j) {
    const float* row = values + (slot != nullptr ? static_cast<int64_t>(slot[j]) : j) * stride;
    for (int u = 0; u < NV; ++u) r[u] = fma16(w[j], load16(row + u * kLanes), r[u]);
  }
  for (int u = 0; u < NV; ++u) store16(a + u * kLanes, r[u]);
}
#endif

// Queries scored at once (each query's sums one accumulator, each key vector loaded once for all) and
// value vectors summed at once: as many as the build's vector registers hold without spilling (32 zmm;
// 16 ymm, a v16 taking two; 16 xmm, a v16 taking four)
#if defined(SPECDEC_ATTN_AVX512)
constexpr int kScoreRows = 8, kMaxSums = 8;
#elif defined(SPECDEC_ATTN_AVX2)
constexpr int kScoreRows = 4, kMaxSums = 4;
#else
constexpr int kScoreRows = 2, kMaxSums = 2;
#endif

// dot[r] = the dot products of query r (qi + r * D) with a block of 16 keys ([d][16]), each summed over
// d in order with one fma per step, for r < Q
#if defined(SPECDEC_ATTN_AVX2)
template <int Q>
inline void score_rows(const float* kblock, const float* qi, int64_t D, float (*dot)[kLanes]) {
  __m256 lo[Q], hi[Q];
#pragma GCC unroll 8
  for (int r = 0; r < Q; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kblock + d * kLanes), k1 = _mm256_loadu_ps(kblock + d * kLanes + 8);
#pragma GCC unroll 8
    for (int r = 0; r < Q; ++r) {
      const __m256 q = _mm256_set1_ps(qi[r * D + d]);
      lo[r] = _mm256_fmadd_ps(q, k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(q, k1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Q; ++r) {
    _mm256_storeu_ps(dot[r], lo[r]);
    _mm256_storeu_ps(dot[r] + 8, hi[r]);
  }
}
#else
template <int Q>
inline void score_rows(const float* kblock, const float* qi, int64_t D, float (*dot)[kLanes]) {
  v16 d0{}, d1{}, d2{}, d3{}, d4{}, d5{}, d6{}, d7{};  // named, so they stay in registers
  for (int64_t d = 0; d < D; ++d) {
    const v16 k = load16(kblock + d * kLanes);
    d0 = fma16(qi[d], k, d0);
    d1 = fma16(qi[D + d], k, d1);
    if constexpr (Q > 2) {
      d2 = fma16(qi[2 * D + d], k, d2);
      d3 = fma16(qi[3 * D + d], k, d3);
    }
    if constexpr (Q > 4) {
      d4 = fma16(qi[4 * D + d], k, d4);
      d5 = fma16(qi[5 * D + d], k, d5);
      d6 = fma16(qi[6 * D + d], k, d6);
      d7 = fma16(qi[7 * D + d], k, d7);
    }
  }
  const v16 all[8] = {d0, d1, d2, d3, d4, d5, d6, d7};
  for (int r = 0; r < Q; ++r) store16(dot[r], all[r]);
}
#endif

// Prefetch the 16 keys and values of a paged row from slot s0 on (s0 a multiple of 16 within one block:
// contiguous rows of D elements there). A unit's block is another part of the pool than the unit before
// it, which the hardware prefetcher does not foresee. An asm prefetcht0: GCC drops __builtin_prefetch
// from functions built under target pragmas (runtime/kernels/cpu_blockq.cpp says the same).
inline void prefetch_unit(const AttnProblem& P, int64_t b, int64_t kvh, int64_t s0) {
  const int64_t blk = P.table[b * P.tw + s0 / P.bs], at = s0 % P.bs, elem = P.bf16 ? 2 : 4;
  const char* k = static_cast<const char*>(P.keys) + (blk * P.ks[0] + kvh * P.ks[1] + at * P.ks[2]) * elem;
  const char* v = static_cast<const char*>(P.values) + (blk * P.vs[0] + kvh * P.vs[1] + at * P.vs[2]) * elem;
  for (int64_t off = 0; off < kLanes * P.ks[2] * elem; off += 64) __asm__ volatile("prefetcht0 %0" : : "m"(k[off]));
  for (int64_t off = 0; off < kLanes * P.vs[2] * elem; off += 64) __asm__ volatile("prefetcht0 %0" : : "m"(v[off]));
}

#if defined(SPECDEC_ATTN_AVX512)
// n <= 16 elements from element i of base (bfloat16 or float32) as float, the rest zero
template <bool BF16>
inline __m512 load_row16(const void* base, int64_t i, int64_t n) {
  const __mmask16 m = n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  if constexpr (BF16)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i)), 16));
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
}

// r[c] = column c of the 16 x 16 floats whose row j is r[j]
inline void transpose16(__m512 r[kLanes]) {
  __m512 t[kLanes], u[kLanes];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(a, c, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(b, d, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

template <bool BF16>
inline void convert_unit_avx512(const AttnProblem& P, const int64_t* koff, const int64_t* voff, float* kdst,
                                float* vdst) {
  const int64_t D = P.D, Dp = (D + kLanes - 1) / kLanes * kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, D - d0);
    __m512 r[kLanes];
    for (int j = 0; j < kLanes; ++j) r[j] = koff[j] < 0 ? _mm512_setzero_ps() : load_row16<BF16>(P.keys, koff[j] + d0, n);
    transpose16(r);
    if (n == kLanes) {  // stores from the registers (GCC makes a variable-count loop a memcpy of a stack copy)
#pragma GCC unroll 16
      for (int c = 0; c < kLanes; ++c) _mm512_storeu_ps(kdst + (d0 + c) * kLanes, r[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) _mm512_storeu_ps(kdst + (d0 + c) * kLanes, r[c]);
    }
  }
  for (int j = 0; j < kLanes; ++j) {
    float* vrow = vdst + j * Dp;
    if (voff[j] < 0) {
      for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) _mm512_storeu_ps(vrow + d0, _mm512_setzero_ps());
      continue;
    }
    for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) _mm512_storeu_ps(vrow + d0, load_row16<BF16>(P.values, voff[j] + d0, D - d0));
  }
}
#endif

#if defined(SPECDEC_ATTN_AVX2)
// 8 elements from element i of base (bfloat16 or float32) as float
template <bool BF16>
inline __m256 load_row8(const void* base, int64_t i) {
  if constexpr (BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))), 16));
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

// r[c] = column c of the 8 x 8 floats whose row j is r[j]
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// `convert_unit` in AVX2 registers for whole groups of 8 dims; the dims past the last whole group in
// the plain loop
template <bool BF16>
inline void convert_unit_avx2(const AttnProblem& P, const int64_t* koff, const int64_t* voff, float* kdst,
                              float* vdst) {
  const int64_t D = P.D, Dp = (D + kLanes - 1) / kLanes * kLanes, D8 = D / 8 * 8;
  for (int64_t d0 = 0; d0 < D8; d0 += 8)
    for (int j0 = 0; j0 < kLanes; j0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = koff[j0 + j] < 0 ? _mm256_setzero_ps() : load_row8<BF16>(P.keys, koff[j0 + j] + d0);
      transpose8(r);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(kdst + (d0 + c) * kLanes + j0, r[c]);
    }
  for (int j = 0; j < kLanes; ++j) {
    float* vrow = vdst + j * Dp;
    for (int64_t d0 = 0; d0 < D8; d0 += 8)
      _mm256_storeu_ps(vrow + d0, voff[j] < 0 ? _mm256_setzero_ps() : load_row8<BF16>(P.values, voff[j] + d0));
    for (int64_t d = D8; d < D; ++d) {
      kdst[d * kLanes + j] = koff[j] < 0 ? 0.0f : load_elem(P.keys, BF16, koff[j] + d);
      vrow[d] = voff[j] < 0 ? 0.0f : load_elem(P.values, BF16, voff[j] + d);
    }
    for (int64_t d = D; d < Dp; ++d) vrow[d] = 0.0f;
  }
}
#endif

// One unit of `convert_kv`: the 16 keys and values at element offsets koff[j], voff[j] (-1: a slot
// past S, zeros) into kdst ([d][16 keys]) and vdst (16 rows of Dp floats). Conversion is exact, so
// the AVX-512 and AVX2 transposes write the bits of the plain loop.
inline void convert_unit(const AttnProblem& P, const int64_t* koff, const int64_t* voff, float* kdst, float* vdst) {
#if defined(SPECDEC_ATTN_AVX512)
  if (P.bf16) convert_unit_avx512<true>(P, koff, voff, kdst, vdst);
  else convert_unit_avx512<false>(P, koff, voff, kdst, vdst);
#elif defined(SPECDEC_ATTN_AVX2)
  if (P.bf16) convert_unit_avx2<true>(P, koff, voff, kdst, vdst);
  else convert_unit_avx2<false>(P, koff, voff, kdst, vdst);
#else
  const int64_t D = P.D, Dp = (D + kLanes - 1) / kLanes * kLanes;
  for (int j = 0; j < kLanes; ++j) {
    float* vrow = vdst + j * Dp;
    for (int64_t d = 0; d < D; ++d) kdst[d * kLanes + j] = koff[j] < 0 ? 0.0f : load_elem(P.keys, P.bf16, koff[j] + d);
    for (int64_t d = 0; d < D; ++d) vrow[d] = voff[j] < 0 ? 0.0f : load_elem(P.values, P.bf16, voff[j] + d);
    for (int64_t d = D; d < Dp; ++d) vrow[d] = 0.0f;
  }
#endif
}

// Keys and values as float, once per call for all queries: unit u of B * Hkv * blocks (row b, KV
// head, block of 16 slots) writes its keys as [d][16 keys] into kt (D * 16 floats per unit) and its
// values as 16 rows of Dp floats (D rounded up to 16, zero-padded) into vf. Slots past S are zero.
inline void convert_kv(const AttnProblem& P, float* kt, float* vf, int64_t u0, int64_t u1) {
  const int64_t D = P.D, S = P.S, Dp = (D + kLanes - 1) / kLanes * kLanes, blocks = (S + kLanes - 1) / kLanes;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = u / (P.Hkv * blocks), kvh = (u / blocks) % P.Hkv, kb = u % blocks;
    const int64_t kbase = b * P.ks[0] + kvh * P.ks[1], vbase = b * P.vs[0] + kvh * P.vs[1];
    if (P.table != nullptr && P.bs % kLanes == 0 && (kb + 1) * kLanes < S)
      prefetch_unit(P, b, kvh, (kb + 1) * kLanes);  // the next unit's keys and values lie in another block
    int64_t koff[kLanes], voff[kLanes];
    int64_t kblk = 0, vblk = 0, at0 = 0;  // a paged unit's block base and the position of its key j = 0
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t s = kb * kLanes + j;
      if (s >= S) {
        koff[j] = voff[j] = -1;
        continue;
      }
      koff[j] = kbase + s * P.ks[2];
      voff[j] = vbase + s * P.vs[2];
      if (P.table != nullptr) {  // through the block table: one lookup per 16 keys when blocks hold whole units
        if (j == 0 || P.bs % kLanes != 0) {
          const int64_t blk = P.table[b * P.tw + s / P.bs];
          kblk = blk * P.ks[0] + kvh * P.ks[1];
          vblk = blk * P.vs[0] + kvh * P.vs[1];
          at0 = s % P.bs - j;
        }
        koff[j] = kblk + (at0 + j) * P.ks[2];
        voff[j] = vblk + (at0 + j) * P.vs[2];
      }
    }
    convert_unit(P, koff, voff, kt + u * D * kLanes, vf + u * kLanes * Dp);
  }
}

// Work items w0..w1-1 of B * Hkv * ceil(G * T / kQueries): (row b, KV head, a chunk of up to kQueries
// of its G * T queries), over the keys and values `convert_kv` wrote.
inline void attention_rows_items(const AttnProblem& P, const float* kt_all, const float* vf_all, int64_t w0,
                                 int64_t w1) {
  const int64_t G = P.Hq / P.Hkv, per_head = G * P.T, chunks = (per_head + kQueries - 1) / kQueries, D = P.D, S = P.S;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes, blocks = (S + kLanes - 1) / kLanes;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // scratch, written before it is read (a zero-filled std::vector cost ~10% of a 1-token call)
  std::unique_ptr<float[]> qf(new float[(kQueries + 7) * D]), score(new float[kQueries * S]), acc(new float[kQueries * Dp]);
  // with a mask, each query's visible slots in order; without one they are [first, first + n)
  const bool listed = P.mask != nullptr;
  std::unique_ptr<int32_t[]> slot(listed ? new int32_t[kQueries * S] : nullptr);
  int64_t n[kQueries], pos[kQueries], first[kQueries];
  float inv[kQueries];
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t b = w / (P.Hkv * chunks), kvh = (w / chunks) % P.Hkv, i0 = (w % chunks) * kQueries;
    const int64_t count = std::min(kQueries, per_head - i0);
    const float* kt = kt_all + (b * P.Hkv + kvh) * blocks * D * kLanes;
    const float* vf = vf_all + (b * P.Hkv + kvh) * blocks * kLanes * Dp;
    int64_t lo = S, hi = -1;
    for (int64_t i = 0; i < count; ++i) {  // q to float; each query's visible keys in slot order
      const int64_t h = kvh * G + (i0 + i) / P.T, t = (i0 + i) % P.T;
      const int64_t qoff = ((b * P.Hq + h) * P.T + t) * D;
      for (int64_t d = 0; d < D; ++d) qf[i * D + d] = load_elem(P.q, P.bf16, qoff + d);
      n[i] = 0;
      if (listed) {
        int32_t* sl = slot.get() + i * S;
        const bool* row = P.mask + (b * P.T + t) * S;
        for (int64_t s = 0; s < S; ++s)
          if (row[s]) sl[n[i]++] = static_cast<int32_t>(s);
        first[i] = n[i] > 0 ? sl[0] : 0;
      } else {
        const int64_t last = P.pre[b] + t;
        first[i] = P.window > 0 ? std::max<int64_t>(0, last - P.window + 1) : 0;
        n[i] = last - first[i] + 1;
      }
      if (n[i] > 0) {
        lo = std::min<int64_t>(lo, first[i]);
        hi = std::max<int64_t>(hi, listed ? slot[i * S + n[i] - 1] : first[i] + n[i] - 1);
      }
    }
    std::fill(qf.get() + count * D, qf.get() + (count + 7) * D, 0.0f);
    const int64_t kb_lo = hi < 0 ? 0 : lo / kLanes, kb_hi = hi < 0 ? -1 : hi / kLanes;
    std::fill(pos, pos + count, 0);
    for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {  // scores: one key block against every query
      const float* kblock = kt + kb * D * kLanes;
      const int64_t end = (kb + 1) * kLanes;
      for (int64_t i8 = 0; i8 < count; i8 += kScoreRows) {  // kScoreRows independent sums per load
        float dot[kScoreRows][kLanes];
        score_rows<kScoreRows>(kblock, qf.get() + i8 * D, D, dot);
        for (int64_t r = 0; r < kScoreRows && i8 + r < count; ++r) {
          const int64_t i = i8 + r;
          float* sc = score.get() + i * S;
          if (listed) {
            const int32_t* sl = slot.get() + i * S;
            for (; pos[i] < n[i] && sl[pos[i]] < end; ++pos[i]) sc[pos[i]] = dot[r][sl[pos[i]] - kb * kLanes] * scale;
            continue;
          }
          // slots [from, to) of this block, at sc[s - first]: the same products, a vector at a time
          const int64_t from = std::max(first[i], kb * kLanes), to = std::min(first[i] + n[i], end);
          if (from >= to) continue;
          float scaled[kLanes];
          store16(scaled, load16(dot[r]) * scale);
          std::memcpy(sc + (from - first[i]), scaled + (from - kb * kLanes), (to - from) * sizeof(float));
          pos[i] = to - first[i];
        }
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      inv[i] = n[i] > 0 ? softmax_weights(score.get() + i * S, n[i]) : 0.0f;
      std::fill(acc.get() + i * Dp, acc.get() + (i + 1) * Dp, 0.0f);
      pos[i] = 0;
    }
    for (int64_t c0 = lo; c0 <= hi; c0 += kChunk) {  // value sums, kChunk keys at a time
      const int64_t end = c0 + kChunk;
      for (int64_t i = 0; i < count; ++i) {
        const int32_t* sl = listed ? slot.get() + i * S : nullptr;
        const float* sc = score.get() + i * S;
        const float* vi = vf + (listed ? 0 : first[i] * Dp);
        float* a = acc.get() + i * Dp;
        int64_t stop = pos[i];  // this query's keys before `end`
        if (listed)
          while (stop < n[i] && sl[stop] < end) ++stop;
        else
          stop = std::min(n[i], std::max(pos[i], end - first[i]));
        int64_t d0 = 0;  // up to kMaxSums accumulators in registers at a time
        if constexpr (kMaxSums >= 8)
          for (; d0 + 8 * kLanes <= Dp; d0 += 8 * kLanes) weighted_sum<8>(a + d0, sc, sl, pos[i], stop, vi + d0, Dp);
        if constexpr (kMaxSums >= 4)
          for (; d0 + 4 * kLanes <= Dp; d0 += 4 * kLanes) weighted_sum<4>(a + d0, sc, sl, pos[i], stop, vi + d0, Dp);
        for (; d0 + 2 * kLanes <= Dp; d0 += 2 * kLanes) weighted_sum<2>(a + d0, sc, sl, pos[i], stop, vi + d0, Dp);
        for (; d0 < Dp; d0 += kLanes) weighted_sum<1>(a + d0, sc, sl, pos[i], stop, vi + d0, Dp);
        pos[i] = stop;
      }
    }
    for (int64_t i = 0; i < count; ++i) {  // out = acc * (1 / Z); zeros for a query that sees no key
      const int64_t h = kvh * G + (i0 + i) / P.T, t = (i0 + i) % P.T;
      const int64_t ooff = ((b * P.Hq + h) * P.T + t) * D;
      const float* a = acc.get() + i * Dp;
      for (int64_t d = 0; d < D; ++d) {
        const float x = a[d] * inv[i];
        if (P.bf16)
          static_cast<uint16_t*>(P.out)[ooff + d] = float_to_bf16(x);
        else
          static_cast<float*>(P.out)[ooff + d] = x;
      }
    }
  }
}

}  // namespace SPECDEC_ATTN_NS
