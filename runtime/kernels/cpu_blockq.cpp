// Block-quantized linear layers on the CPU: y = x @ W^T with W stored as GGUF-style integer codes.
//
// W[n, k] = d[n, k/S] * sc[n, k/G] * q[n, k] - dm[n, k/S] * mc[n, k/G]
//   q: unsigned codes of `bits` (4, 5, 6 or 8) bits; sc, mc: int8 per group of G (16 or 32) inputs;
//   d, dm: float32 per super-block of S inputs (S a multiple of G), stored as float32 or float16 (GGUF's
//   own scales; widened exactly where they are read); dm may be given as zero * d
//   (zero a power of two: symmetric formats, whose dm is then not stored). This holds GGUF's Q4_K,
//   Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 exactly (runtime/blockq.py builds the tensors).
// Activations are quantized per row to int8 in blocks of 32 (x ~ dx * xq, dx = max|x| / 127, as
// llama.cpp's Q8_0), the integer dot product C of every group is exact (int32), and the float
// epilogue runs in one fixed order, per output:
//   per group:        t = float(C) * float(sc); a = fma(t, dx, a); b = fma(float(mc), xs, b)
//   per super-block:  y = fma(a, d, y); y = fma(-b, dm, y); a = b = 0
// with xs = dx * (sum of the group's activation codes). So a row's result depends only on that row:
// the same bits at any row count and on every path below (AMX, AVX-512 VNNI, plain C++).
//
// Storage (made by runtime/blockq.py), W output channels ("a block") at a time, W = 32 for 4- to
// 6-bit codes and 16 for 8-bit ones; a block is one or two "sets" of 16 channels:
//   codes (N/W, K/G, group bytes) uint8: per group, G/4 rows of 64 bytes, row r holding channel c's
//     inputs 4r..4r+3 at bytes 4c..4c+3 (the VNNI / AMX B-tile layout). 4 to 6 bits: the low 4 bits
//     of channel c in the low nibble and of channel 16 + c in the high nibble of the same byte (16G
//     bytes). 5 bits then add, per row, bit 4 as two bit planes of 64 bits (one bit per byte of the
//     row), set 0's then set 1's (4G bytes). 6 bits add, per 4 rows (a quad), two 64-byte vectors, set
//     0's then set 1's, byte i holding bits 4-5 of row 4q + j's code at byte i in its bits 2j, 2j + 1
//     (8G bytes): a 16-bit shift and a mask bring a row's pairs to bits 4-5. With 4 bits the high
//     set is multiplied as (byte & 0xF0) = 16 * code, its dot product C is 16x, and its sc is taken
//     as float(sc) / 16 (both exact), which saves a shift per 64 bytes.
//   sc, mc (N/W, K/G, W) int8 (mc may be sc); d, dm (N/W, K/S, W) float32 or float16 (both alike).
//   Or, for 32-channel blocks whose sc and mc are all 6-bit (0..63: Q4_K, Q5_K), both packed into one
//   uint8 tensor (N/W, K/G, 48) passed as sc and mc, as GGUF keeps them in 6 bits (a step of the
//   1.5B reads ~19 MB less): per group, bytes 0-31 hold sc[c] & 15 | (mc[c] & 15) << 4 for channel
//   c, bytes 32-47 the fifth and sixth bits, byte c holding sc[c] >> 4, sc[16 + c] >> 4, mc[c] >> 4
//   and mc[16 + c] >> 4 in bits 0-1, 2-3, 4-5 and 6-7 (`BlockView::scales` unpacks them with 16-bit shifts).
// Paths: AMX (TDPBSUD, 16 rows a tile) for calls of several rows on CPUs with AMX-INT8; AVX-512
// VNNI (VPDPBUSD, 4 rows at a time in registers; more rows take each 256-input span of a block's
// codes in turn, so the codes are read from memory once) for fewer rows, or every row count without
// AMX; AVX2 (VPMADDUBSW + VPMADDWD) on CPUs without AVX-512; plain C++ elsewhere (slow, exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_widen.h"

namespace {

constexpr int kLanes = 16;      // output channels per set (one 512-bit vector of float32)
constexpr int kActBlock = 32;   // inputs per activation scale
// Software prefetch distance in the codes stream. Every 64-byte line is prefetched: on the 2-core
// VMs this was measured on, a streaming loop with this much arithmetic reads at the bandwidth of a
// bare read only when every line is prefetched ~4 KB ahead (about half of it otherwise). VNNI calls of
// more than 4 rows, which take each span of codes through every 4-row chunk in turn, prefetch ~8 KB
// ahead (measured on `epyc-bf16`, the 1.5B's step linears alternating: 8 / 16 / 64 rows 0.97 / 0.92 /
// 0.98x the time at 4 KB, 1-4 rows 1.00-1.04x slower, 2 KB 1.24x slower at 8-16 rows).
constexpr int kPrefetchBytes = 4096;
constexpr int kPrefetchBytesSpans = 8192;
constexpr int kAvx2AheadBytes = 8192;  // gemm_avx2_supers' prefetch distance

enum Isa : int64_t { kAuto = 0, kGeneric = 1, kVnni = 2, kAmx = 3, kAvx2 = 4 };

constexpr int block_width(int bits) { return bits == 8 ? 16 : 32; }
constexpr int kMaxGroupsPerSuper = 16;  // Q6_K: 256 / 16
constexpr int kPackedScaleBytes = 48;  // one group's 6-bit sc and mc of a 32-channel block
// bits of a code stored beside its low nibble (1 for 5-bit codes, 2 for 6-bit ones)
constexpr int high_bits(int bits) { return bits == 5 || bits == 6 ? bits - 4 : 0; }
// bytes of one group of one block: the low-nibble rows (or 8-bit rows), then the high bits
constexpr int group_bytes(int bits, int G) { return 16 * G + 4 * G * high_bits(bits); }

struct Weights {
  const uint8_t* codes;
  const int8_t* sc;
  const int8_t* mc;
  const void* d;   // float32, or float16 when `half`
  const void* dm;  // the same type; null: dm = zero * d
  bool half;
  float zero;
  int64_t N, K;
  int bits, G, S;
  bool packed;  // sc holds the 6-bit packing of sc and mc (see the header); mc is then sc
  // bytes of one group's scale codes in one block (of sc, and of mc)
  int64_t scale_bytes() const { return packed ? kPackedScaleBytes : block_width(bits); }
  // element i of d or dm, as float32
  float scale(const void* p, int64_t i) const {
    return half ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(p)[i])
                : static_cast<const float*>(p)[i];
  }
  // a pointer to element i of d or dm
  const void* scales_from(const void* p, int64_t i) const {
    return half ? static_cast<const void*>(static_cast<const uint16_t*>(p) + i)
                : static_cast<const void*>(static_cast<const float*>(p) + i);
  }
};

struct Acts {
  const int8_t* xq;  // (M, K)
  const float* dx;   // (M, K / 32)
  const float* xs;   // (M, K / G): dx * sum of the group's codes
  int64_t M, K;
};

// Channel `lane`'s scale code (or, with `min`, minimum code) from one group's packed scale bytes p.
inline int packed_code(const uint8_t* p, int lane, bool min) {
  const int low = min ? p[lane] >> 4 : p[lane] & 15;
  return low | ((p[32 + (lane & 15)] >> (2 * (lane >> 4) + (min ? 4 : 0))) & 3) << 4;
}

// ---------------------------------------------------------------- CPU features

bool cpu_has(unsigned leaf, unsigned sub, int reg, int bit) {
  unsigned r[4];
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

bool os_avx512() {
  if (!cpu_has(1, 0, 2, 27)) return false;  // OSXSAVE
  return (xgetbv0() & 0xE6) == 0xE6;          // SSE, AVX, opmask, ZMM state enabled
}

bool has_vnni() {
  static const bool ok = os_avx512() && cpu_has(7, 0, 1, 16) /*avx512f*/ && cpu_has(7, 0, 1, 30) /*bw*/ &&
                         cpu_has(7, 0, 1, 31) /*vl*/ && cpu_has(7, 0, 2, 11) /*avx512_vnni*/;
  return ok;
}

bool has_avx2() {
  static const bool ok = cpu_has(1, 0, 2, 27) /*osxsave*/ && (xgetbv0() & 0x6) == 0x6 /*SSE, AVX state*/ &&
                         cpu_has(7, 0, 1, 5) /*avx2*/ && cpu_has(1, 0, 2, 12) /*fma*/ && cpu_has(1, 0, 2, 29) /*f16c*/;
  return ok;
}

bool request_amx() {
  // Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool has_amx() {
  static const bool ok = has_vnni() && cpu_has(7, 0, 3, 24) /*amx_tile*/ && cpu_has(7, 0, 3, 25) /*amx_int8*/ &&
                         request_amx() && (xgetbv0() & (3ull << 17)) == (3ull << 17);
  return ok;
}

// ---------------------------------------------------------------- activations

// One block of 32 inputs: its int8 codes and scale dx = max|x| / 127 (the plain C++ reference of the
// vector versions below, and their fallback for a block holding NaN or inf).
template <typename T>
void quantize_block(const T* xr, int8_t* qr, float* dx) {
  float amax = 0.f;
  // a NaN stays (std::max would drop it): a NaN or inf input makes the block's scale NaN or inf and
  // the row's outputs non-finite, as a float product would, instead of rounding to finite codes
  for (int j = 0; j < kActBlock; ++j) {
    const float v = std::fabs((float)xr[j]);
    if (v > amax || std::isnan(v)) amax = v;
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const bool finite = std::isfinite(amax);  // else codes 0 (a NaN has no int8), and the scale carries it
  *dx = amax / 127.f;
  for (int j = 0; j < kActBlock; ++j) qr[j] = finite ? (int8_t)std::nearbyint((float)xr[j] * inv) : 0;
}

template <typename T>
void quantize_blocks_generic(const T* xr, int64_t blocks, int8_t* qr, float* dx) {
  for (int64_t b = 0; b < blocks; ++b) quantize_block(xr + b * kActBlock, qr + b * kActBlock, dx + b);
}

// The same codes and scales with AVX-512 and with AVX2: the same float products, rounded to nearest
// even by the conversion (the default rounding mode, as std::nearbyint rounds), and one maximum.
#define SPECDEC_AVX512_ACT __attribute__((target("avx512f,avx512bw")))
#define SPECDEC_AVX2_ACT __attribute__((target("avx2")))

template <typename T>
SPECDEC_AVX512_ACT void quantize_blocks_avx512(const T* xr, int64_t blocks, int8_t* qr, float* dx) {
  for (int64_t b = 0; b < blocks; ++b) {
    const T* xb = xr + b * kActBlock;
    const __m512 v0 = specdec_widen::load16(xb), v1 = specdec_widen::load16(xb + 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    const float amax = nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    if (!std::isfinite(amax)) {
      quantize_block(xb, qr + b * kActBlock, dx + b);
      continue;
    }
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    dx[b] = amax / 127.f;
    _mm_storeu_si128((__m128i*)(qr + b * kActBlock), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128((__m128i*)(qr + b * kActBlock + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  }
}

template <typename T>
SPECDEC_AVX2_ACT void quantize_blocks_avx2(const T* xr, int64_t blocks, int8_t* qr, float* dx) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < blocks; ++b) {
    const T* xb = xr + b * kActBlock;
    __m256 v[4], top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = specdec_widen::load8(xb + 8 * i);
      top = _mm256_max_ps(top, _mm256_and_ps(v[i], abs_mask));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(m4);
    if (!std::isfinite(amax)) {
      quantize_block(xb, qr + b * kActBlock, dx + b);
      continue;
    }
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    dx[b] = amax / 127.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    // int32 -> int8 in input order (the packs interleave 128-bit lanes; the permutation undoes it)
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)(qr + b * kActBlock),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

// Quantize rows of x (M, K) into xq (M, K) int8, dx (M, K/32), xs (M, K/G), with the instructions of
// kernel path `path` (the same numbers on every path). Deterministic per row.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int G, int8_t* xq, float* dx, float* xs, int64_t path) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* qr = xq + m * K;
      float* dr = dx + m * (K / kActBlock);
      if (path == kVnni || path == kAmx) quantize_blocks_avx512(x + m * K, K / kActBlock, qr, dr);
      else if (path == kAvx2) quantize_blocks_avx2(x + m * K, K / kActBlock, qr, dr);
      else quantize_blocks_generic(x + m * K, K / kActBlock, qr, dr);
      for (int64_t g = 0; g < K / G; ++g) {
        int32_t sum = 0;
        for (int j = 0; j < G; ++j) sum += qr[g * G + j];
        xs[m * (K / G) + g] = dr[g * G / kActBlock] * (float)sum;
      }
    }
  });
}

// ---------------------------------------------------------------- generic C++ path

// The code of set s, channel c, input j of a group (within one block), as the kernels multiply it
// (4 bits, high set: 16 * code).
inline int code_at(const uint8_t* grp, int bits, int G, int s, int c, int j) {
  const int r = j / 4, pos = c * 4 + j % 4;
  const uint8_t byte = grp[r * 64 + pos];
  if (bits == 8) return byte;
  if (bits == 4) return s == 0 ? (byte & 0x0F) : (byte & 0xF0);
  const int code = s == 0 ? (byte & 0x0F) : (byte >> 4);
  if (bits == 5) {
    const uint8_t* plane = grp + 16 * G + r * 16 + s * 8;  // bit 4 of the row's 64 codes of set s
    return code | (((plane[pos / 8] >> (pos % 8)) & 1) << 4);
  }
  const uint8_t* pairs = grp + 16 * G + (r / 4) * 128 + s * 64;  // bits 4-5 of the quad's codes of set s
  return code | (((pairs[pos] >> (2 * (r % 4))) & 3) << 4);
}

template <typename T>
void gemm_generic(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  const int W = block_width(w.bits), sets = W / kLanes;
  const int64_t groups = w.K / w.G, supers = w.K / w.S, gps = w.S / w.G, gbytes = group_bytes(w.bits, w.G);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int s = 0; s < sets; ++s) {
        for (int c = 0; c < kLanes; ++c) {
          const int lane = s * kLanes + c;
          float acc = 0.f;
          for (int64_t sb = 0; sb < supers; ++sb) {
            float as = 0.f, am = 0.f;
            for (int64_t j = 0; j < gps; ++j) {
              const int64_t g = sb * gps + j;
              const uint8_t* grp = w.codes + (b * groups + g) * gbytes;
              const int8_t* xr = a.xq + m * a.K + g * w.G;
              int32_t dot = 0;
              for (int k = 0; k < w.G; ++k) dot += code_at(grp, w.bits, w.G, s, c, k) * xr[k];
              const int64_t at = (b * groups + g) * w.scale_bytes();
              const uint8_t* packed = reinterpret_cast<const uint8_t*>(w.sc + at);
              float scf = (float)(w.packed ? packed_code(packed, lane, false) : w.sc[at + lane]);
              if (w.bits == 4 && s == 1) scf = scf * 0.0625f;
              const float mcf = (float)(w.packed ? packed_code(packed, lane, true) : w.mc[at + lane]);
              const float t = (float)dot * scf;
              as = std::fma(t, a.dx[m * (a.K / kActBlock) + g * w.G / kActBlock], as);
              am = std::fma(mcf, a.xs[m * groups + g], am);
            }
            const int64_t di = (b * supers + sb) * W + lane;
            acc = std::fma(as, w.scale(w.d, di), acc);
            acc = std::fma(-am, w.dm ? w.scale(w.dm, di) : w.scale(w.d, di) * w.zero, acc);
          }
          const int64_t n = b * W + lane;
          y[m * w.N + n] = (T)(bias ? acc + bias[n] : acc);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- AVX-512 helpers

#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma")))
#define SPECDEC_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,amx-tile,amx-int8")))

SPECDEC_AVX512 inline __m512 int8_to_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

template <typename T>
SPECDEC_AVX512 inline void store_row(__m512 acc, const float* bias, T* y) {
  if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, acc);
  } else {
    // round to nearest even, as c10::BFloat16 (NaN stays NaN)
    alignas(64) float tmp[kLanes];
    _mm512_store_ps(tmp, acc);
    for (int c = 0; c < kLanes; ++c) y[c] = (T)tmp[c];
  }
}

// 16 values of d or dm from element i on, as float32 (float16 widened exactly)
SPECDEC_AVX512 inline __m512 scales16(const void* p, int64_t i, bool half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(p) + i)))
              : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// One block's weights, positioned, and its group / super-block counts.
template <int BITS, int G>
struct BlockView {
  static constexpr int W = block_width(BITS), kSets = W / kLanes, kGroupBytes = group_bytes(BITS, G), R = G / 4;
  const uint8_t* codes;
  const int8_t *sc, *mc;
  const void *d, *dm;  // dm null: zero * d
  bool half, packed;
  float zero;
  int64_t groups, supers, gps, scale_bytes;
  BlockView(const Weights& w, int64_t b)
      : groups(w.K / G), supers(w.K / w.S), gps(w.S / G), scale_bytes(w.scale_bytes()) {
    codes = w.codes + b * groups * kGroupBytes;
    sc = w.sc + b * groups * scale_bytes;
    mc = w.mc + b * groups * scale_bytes;
    packed = w.packed;
    d = w.scales_from(w.d, b * supers * W);
    dm = w.dm ? w.scales_from(w.dm, b * supers * W) : nullptr;
    half = w.half;
    zero = w.zero;
  }
  // d and dm of super-block sb, set s
  SPECDEC_AVX512 void super_scales(int64_t sb, int s, __m512& dv, __m512& dmv) const {
    dv = scales16(d, sb * W + s * kLanes, half);
    dmv = dm ? scales16(dm, sb * W + s * kLanes, half) : _mm512_mul_ps(dv, _mm512_set1_ps(zero));
  }
  // float(sc) and float(mc) of group g, every set (the 4-bit high set's sc divided by 16: see the file's
  // header); packed codes are unpacked for both sets at once, 16-bit shifts whose bits from a
  // neighbouring byte are masked off
  SPECDEC_AVX512 void scales(int64_t g, __m512* scf, __m512* mcf) const {
    if constexpr (kSets == 2) {  // packed codes are those of 32-channel blocks
      if (packed) {
        const int8_t* p = sc + g * scale_bytes;
        const __m256i lo = _mm256_loadu_si256((const __m256i*)p), m4 = _mm256_set1_epi8(0x0F);
        const __m256i m45 = _mm256_set1_epi8(0x30);
        const __m128i hi = _mm_loadu_si128((const __m128i*)(p + 32));
        const __m256i hs = _mm256_set_m128i(_mm_slli_epi16(hi, 2), _mm_slli_epi16(hi, 4));  // set 1 | set 0
        const __m256i hm = _mm256_set_m128i(_mm_srli_epi16(hi, 2), hi);
        const __m256i c = _mm256_ternarylogic_epi32(_mm256_and_si256(lo, m4), hs, m45, 0xF8);  // a | (b & c)
        const __m256i m = _mm256_ternarylogic_epi32(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4), hm, m45, 0xF8);
        scf[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
        scf[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
        if (BITS == 4) scf[1] = _mm512_mul_ps(scf[1], _mm512_set1_ps(0.0625f));
        mcf[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(m)));
        mcf[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(m, 1)));
        return;
      }
    }
    for (int s = 0; s < kSets; ++s) {
      scf[s] = int8_to_float(sc + g * W + s * kLanes);
      if (BITS == 4 && s == 1) scf[s] = _mm512_mul_ps(scf[s], _mm512_set1_ps(0.0625f));
      mcf[s] = int8_to_float(mc + g * W + s * kLanes);
    }
  }
};

// The pairs of row j of a quad (bits 2j, 2j + 1 of each byte of `pairs`) moved to bits 4-5, other bits
// left for the caller to mask with 0x30 (16-bit shifts: what a byte gets from its neighbour lies outside 4-5).
SPECDEC_AVX512 inline __m512i pairs_to_bits45(__m512i pairs, int j) {
  switch (j) {
    case 0: return _mm512_slli_epi16(pairs, 4);
    case 1: return _mm512_slli_epi16(pairs, 2);
    case 2: return pairs;
    default: return _mm512_srli_epi16(pairs, 2);
  }
}

// Row r of a 5- or 6-bit group: the codes of set 0 and set 1 (low nibbles plus the high bits).
template <int BITS, int G>
SPECDEC_AVX512 inline void unpack_high(const uint8_t* grp, int r, __m512i& set0, __m512i& set1) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i row = _mm512_loadu_si512(grp + r * 64);
  set0 = _mm512_and_si512(row, low);
  set1 = _mm512_and_si512(_mm512_srli_epi16(row, 4), low);
  if constexpr (BITS == 5) {
    const uint8_t* planes = grp + 16 * G + r * 16;
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    set0 = _mm512_mask_add_epi8(set0, _load_mask64((__mmask64*)planes), set0, bit4);
    set1 = _mm512_mask_add_epi8(set1, _load_mask64((__mmask64*)(planes + 8)), set1, bit4);
  } else {
    const uint8_t* pairs = grp + 16 * G + (r / 4) * 128;
    const __m512i m45 = _mm512_set1_epi8(0x30);
    const __m512i h0 = pairs_to_bits45(_mm512_loadu_si512(pairs), r % 4);
    const __m512i h1 = pairs_to_bits45(_mm512_loadu_si512(pairs + 64), r % 4);
    set0 = _mm512_ternarylogic_epi32(set0, h0, m45, 0xF8);  // set0 | (h0 & 0x30)
    set1 = _mm512_ternarylogic_epi32(set1, h1, m45, 0xF8);
  }
}

// prefetcht0 of the line at p, as an asm statement: GCC 12 drops _mm_prefetch (and __builtin_prefetch)
// from the target("avx512...") functions below after inlining, so the VNNI and AMX loops had none
inline void prefetch_line(const void* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }

// Prefetch the codes `distance` bytes ahead of group g, and the scale codes: every line, or with
// `parts` > 1 the lines part, part + parts, ... (the chunks of rows that share a span of codes each
// take their part, so requests to memory go out all through the span's arithmetic).
template <int BITS, int G>
inline void prefetch_group(const BlockView<BITS, G>& v, int64_t g, int part = 0, int parts = 1,
                           int distance = kPrefetchBytes) {
  const char* grp = (const char*)(v.codes + g * v.kGroupBytes + distance);
  for (int off = part * 64; off < v.kGroupBytes; off += 64 * parts) prefetch_line(grp + off);
  if (part != 0) return;
  // the scale codes of the group `distance` bytes ahead: the line of their last byte, when it is not the
  // previous group's (so every line is fetched once)
  const int64_t end = (g + distance / v.kGroupBytes + 1) * v.scale_bytes - 1;
  if (end / 64 != (end - v.scale_bytes) / 64) {
    prefetch_line(v.sc + end);
    if (!v.packed) prefetch_line(v.mc + end);
  }
}

// The float accumulators of one row and set: y, and the super-block's partial sums a, b.
struct Acc {
  __m512 y, a, b;
};

// Per group: a += dx * (float(C) * sc), b += mc * xs.
SPECDEC_AVX512 inline void accumulate(Acc& acc, __m512i dot, __m512 scf, __m512 mcf, float dx, float xs) {
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scf);
  acc.a = _mm512_fmadd_ps(t, _mm512_set1_ps(dx), acc.a);
  acc.b = _mm512_fmadd_ps(mcf, _mm512_set1_ps(xs), acc.b);
}

// Per super-block: y += a * d - b * dm; a = b = 0.
SPECDEC_AVX512 inline void close_super(Acc& acc, __m512 d, __m512 dm) {
  acc.y = _mm512_fmadd_ps(acc.a, d, acc.y);
  acc.y = _mm512_fnmadd_ps(acc.b, dm, acc.y);
  acc.a = acc.b = _mm512_setzero_ps();
}

// ---------------------------------------------------------------- AVX-512 VNNI path

// Rows m0 .. m0 + MT - 1 of one block, super-blocks [sb0, sb1): VPDPBUSD with the activations
// broadcast four bytes at a time. Each row's y accumulators come in and go out through fy
// (16 floats at fy + (i * S + s) * 16: row m0 + i, set s); a super-block's partial sums live in registers.
// With `sbuf` (calls of several chunks), the first chunk of a span leaves each group's float scale and
// minimum codes there for the other chunks (unpacking 6-bit codes takes ~13 vector ops a group).
// 5- and 6-bit codes are unpacked by every chunk of rows again (measured no slower than unpacking a
// span once into L1 for all chunks, now that 6-bit codes take a shift and a ternary-logic op per set).
template <int BITS, int G, int MT>
SPECDEC_AVX512 void vnni_rows(const BlockView<BITS, G>& v, const Acts& a, int64_t m0, int64_t sb0, int64_t sb1,
                              float* fy, int part, int parts, float* sbuf) {
  using V = BlockView<BITS, G>;
  constexpr int R = V::R, S = V::kSets;
  const int64_t K = a.K;
  const int8_t* xq[MT];
  const float *dx[MT], *xs[MT];
  for (int i = 0; i < MT; ++i) {
    xq[i] = a.xq + (m0 + i) * K;
    dx[i] = a.dx + (m0 + i) * (K / kActBlock);
    xs[i] = a.xs + (m0 + i) * v.groups;
  }
  Acc acc[MT][S];
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < S; ++s) {
      acc[i][s].y = _mm512_loadu_ps(fy + (i * S + s) * kLanes);
      acc[i][s].a = acc[i][s].b = _mm512_setzero_ps();
    }
  const __m512i low = _mm512_set1_epi8(0x0F);
  int64_t g = sb0 * v.gps;
  for (int64_t sb = sb0; sb < sb1; ++sb) {
    for (int64_t j = 0; j < v.gps; ++j, ++g) {
      const uint8_t* grp = v.codes + g * V::kGroupBytes;
      prefetch_group(v, g, part, parts, a.M > 4 ? kPrefetchBytesSpans : kPrefetchBytes);
      __m512i full[MT], high[MT];
      for (int i = 0; i < MT; ++i) full[i] = high[i] = _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) {
        // 4 bits: a = the raw bytes, b = 16 x the high set's codes; 5, 6 bits: a = set 0, b = set 1
        __m512i a, b;
        if constexpr (BITS == 8) {
          a = b = _mm512_loadu_si512(grp + r * 64);
        } else if constexpr (BITS == 4) {
          a = _mm512_loadu_si512(grp + r * 64);
          b = _mm512_andnot_si512(low, a);
        } else {
          unpack_high<BITS, G>(grp, r, a, b);
        }
        for (int i = 0; i < MT; ++i) {
          int32_t x4;
          std::memcpy(&x4, xq[i] + g * G + 4 * r, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          full[i] = _mm512_dpbusd_epi32(full[i], a, xb);
          if constexpr (BITS != 8) high[i] = _mm512_dpbusd_epi32(high[i], b, xb);
        }
      }
      __m512 scfs[S], mcfs[S];
      float* sg = sbuf ? sbuf + (g - sb0 * v.gps) * 2 * S * kLanes : nullptr;
      if (sg && part > 0) {
        for (int s = 0; s < S; ++s) {
          scfs[s] = _mm512_load_ps(sg + s * kLanes);
          mcfs[s] = _mm512_load_ps(sg + (S + s) * kLanes);
        }
      } else {
        v.scales(g, scfs, mcfs);
        if (sg)
          for (int s = 0; s < S; ++s) {
            _mm512_store_ps(sg + s * kLanes, scfs[s]);
            _mm512_store_ps(sg + (S + s) * kLanes, mcfs[s]);
          }
      }
      for (int s = 0; s < S; ++s) {
        const __m512 scf = scfs[s], mcf = mcfs[s];
        for (int i = 0; i < MT; ++i) {
          // 4 bits: set 0 = full - (16 x high codes), set 1 = 16 x high codes
          const __m512i dot = BITS == 8 ? full[i] : s == 1 ? high[i]
                              : BITS == 4 ? _mm512_sub_epi32(full[i], high[i]) : full[i];
          accumulate(acc[i][s], dot, scf, mcf, dx[i][g * G / kActBlock], xs[i][g]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      __m512 dv, dmv;
      v.super_scales(sb, s, dv, dmv);
      for (int i = 0; i < MT; ++i) close_super(acc[i][s], dv, dmv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(fy + (i * S + s) * kLanes, acc[i][s].y);
}

// Rows [m0, m1) of a block, super-blocks [sb0, sb1), four rows at a time.
template <int BITS, int G>
SPECDEC_AVX512 void vnni_span(const BlockView<BITS, G>& v, const Acts& a, int64_t m0, int64_t m1, int64_t sb0,
                              int64_t sb1, float* fy) {
  constexpr int S = BlockView<BITS, G>::kSets;
  const int parts = (int)((m1 - m0 + 3) / 4);
  // the span's groups' scale and minimum codes as floats (at most 16 groups: kSpanInputs / 16)
  alignas(64) float sbuf[16 * 2 * S * kLanes];
  float* sb = parts > 1 ? sbuf : nullptr;
  int part = 0;
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4, ++part) vnni_rows<BITS, G, 4>(v, a, m, sb0, sb1, fy + m * S * kLanes, part, parts, sb);
  switch (m1 - m) {
    case 3: vnni_rows<BITS, G, 3>(v, a, m, sb0, sb1, fy + m * S * kLanes, part, parts, sb); break;
    case 2: vnni_rows<BITS, G, 2>(v, a, m, sb0, sb1, fy + m * S * kLanes, part, parts, sb); break;
    case 1: vnni_rows<BITS, G, 1>(v, a, m, sb0, sb1, fy + m * S * kLanes, part, parts, sb); break;
    default: break;
  }
}

// Inputs per span of a call of more than 4 rows: every 4-row chunk of the rows takes one span of a
// block's codes in turn, so the codes come from memory once per call and from L1 for the other chunks.
constexpr int64_t kSpanInputs = 256;
static_assert(kSpanInputs / 16 <= 16, "vnni_span's scale buffer holds the groups of one span");

// Every row of blocks [b0, b1). Up to 4 rows run in registers over the whole block; more rows run
// span by span (each span of codes read from memory once, by the first chunk of rows, while the
// accumulators of all rows wait in fy), so the row count multiplies arithmetic, not memory traffic.
template <int BITS, int G, typename T>
SPECDEC_AVX512 void gemm_vnni(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  using V = BlockView<BITS, G>;
  constexpr int S = V::kSets;
  std::vector<float> fy(a.M * S * kLanes);
  const int64_t supers = w.K / w.S;
  const int64_t span = a.M <= 4 ? supers : std::max<int64_t>(1, kSpanInputs / w.S);
  for (int64_t b = b0; b < b1; ++b) {
    const V v(w, b);
    std::fill(fy.begin(), fy.end(), 0.f);
    for (int64_t sb0 = 0; sb0 < supers; sb0 += span)
      vnni_span<BITS, G>(v, a, 0, a.M, sb0, std::min(supers, sb0 + span), fy.data());
    for (int64_t m = 0; m < a.M; ++m)
      for (int s = 0; s < S; ++s) {
        const int64_t n = b * V::W + s * kLanes;
        store_row(_mm512_loadu_ps(fy.data() + (m * S + s) * kLanes), bias ? bias + n : nullptr, y + m * w.N + n);
      }
  }
}

// ---------------------------------------------------------------- AVX2 path

// CPUs without AVX-512 (most laptops and desktops, older servers): VPMADDUBSW + VPMADDWD in 256-bit
// vectors compute the same exact int32 dot products as VPDPBUSD, and the float epilogue runs the same
// operations in the same order on 8 lanes at a time, so every output bit equals the other paths'.
// A 64-byte code row is two halves of 8 channels; VPMADDUBSW saturates past 32767, so the codes it
// multiplies stay below 128: 4-bit codes are split into nibbles, 8-bit ones into bits 0-6 and bit 7.

#define SPECDEC_AVX2_FN __attribute__((target("avx2,fma,f16c")))

// The scale codes (or, with `min`, minimum codes) of the 8 channels of half h of set s from one group's
// packed scale bytes p (see the header), as float32.
SPECDEC_AVX2_FN inline __m256 packed_codes8(const int8_t* p, int s, int h, bool min) {
  const __m128i lo = _mm_loadl_epi64((const __m128i*)(p + 16 * s + 8 * h));
  const __m128i hi = _mm_loadl_epi64((const __m128i*)(p + 32 + 8 * h));
  const __m128i low = min ? _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_set1_epi8(0x0F)) : _mm_and_si128(lo, _mm_set1_epi8(0x0F));
  const __m128i high = min ? (s ? _mm_srli_epi16(hi, 2) : hi) : (s ? _mm_slli_epi16(hi, 2) : _mm_slli_epi16(hi, 4));
  const __m128i codes = _mm_or_si128(low, _mm_and_si128(high, _mm_set1_epi8(0x30)));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
}

// 8 values of d or dm from element i on, as float32 (float16 widened exactly)
SPECDEC_AVX2_FN inline __m256 scales8(const void* p, int64_t i, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(p) + i)))
              : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

SPECDEC_AVX2_FN inline __m256 int8_to_float8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// acc + the sums of 4 products per 32-bit lane: unsigned codes w (< 128) by signed activations x
SPECDEC_AVX2_FN inline __m256i dot4_avx2(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

// `pairs_to_bits45` on a half row
SPECDEC_AVX2_FN inline __m256i pairs_to_bits45_avx2(__m256i pairs, int j) {
  switch (j) {
    case 0: return _mm256_slli_epi16(pairs, 4);
    case 1: return _mm256_slli_epi16(pairs, 2);
    case 2: return pairs;
    default: return _mm256_srli_epi16(pairs, 2);
  }
}

// 0x10 in byte j where bit j of m is set (bit 4 of the 5-bit codes of one half row)
SPECDEC_AVX2_FN inline __m256i plane_bits(uint32_t m) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)m), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

// acc (+ bias) into 8 outputs of type T. bf16: c10::BFloat16's rounding in vector form (the same bits:
// NaN -> 0x7FC0, else (u + 0x7FFF + bit 16 of u) >> 16); its scalar conversion, one output at a time, took
// ~9% of a 512-row call of a 1536-input Q4_K weight.
template <typename T>
SPECDEC_AVX2_FN inline void store8(__m256 acc, const float* bias, T* out) {
  if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias));
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, acc);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "store8 writes float32 or bf16");
    const __m256i u = _mm256_castps_si256(acc);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
    const __m256i v = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);  // 8 values below 2^16
    _mm_storeu_si128((__m128i*)out, _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
  }
}

// Half h of code row r of a group (4 to 6 bits): the codes of set 0 and of set 1, as bytes below 64
template <int BITS, int G>
SPECDEC_AVX2_FN inline void half_row_codes(const uint8_t* grp, int r, int h, __m256i& c0, __m256i& c1) {
  const __m256i row = _mm256_loadu_si256((const __m256i*)(grp + r * 64 + h * 32)), low = _mm256_set1_epi8(0x0F);
  c0 = _mm256_and_si256(row, low);
  c1 = _mm256_and_si256(_mm256_srli_epi16(row, 4), low);
  if constexpr (BITS == 5) {
    uint32_t p0, p1;
    const uint8_t* planes = grp + 16 * G + r * 16 + h * 4;
    std::memcpy(&p0, planes, 4);
    std::memcpy(&p1, planes + 8, 4);
    c0 = _mm256_or_si256(c0, plane_bits(p0));
    c1 = _mm256_or_si256(c1, plane_bits(p1));
  } else if constexpr (BITS == 6) {
    const uint8_t* pairs = grp + 16 * G + (r / 4) * 128 + h * 32;
    const __m256i m45 = _mm256_set1_epi8(0x30);
    const __m256i h0 = pairs_to_bits45_avx2(_mm256_loadu_si256((const __m256i*)pairs), r % 4);
    const __m256i h1 = pairs_to_bits45_avx2(_mm256_loadu_si256((const __m256i*)(pairs + 64)), r % 4);
    c0 = _mm256_or_si256(c0, _mm256_and_si256(h0, m45));
    c1 = _mm256_or_si256(c1, _mm256_and_si256(h1, m45));
  }
}

// Rows m0 .. m0 + MT - 1 of block b, channels h*8 .. h*8 + 7 of each set (half h of every code row).
template <int BITS, int G, typename T, int MT, bool PACKED>
SPECDEC_AVX2_FN void avx2_half(const Weights& w, const Acts& a, int64_t m0, const float* bias, T* y, int64_t b,
                               int h) {
  constexpr int W = block_width(BITS), S = W / kLanes, R = G / 4, kGroupBytes = group_bytes(BITS, G);
  // code rows whose VPMADDUBSW results add up in int16 without overflow: 2 * kSpan products of a code
  // (< 16, < 32 or < 64) and an activation (|x| <= 127) per 16-bit lane stay under 32768
  constexpr int kSpan = BITS == 4 ? R : BITS == 5 ? 4 : 2;
  static_assert(R % kSpan == 0, "a group holds whole spans");
  const int64_t groups = w.K / G, supers = w.K / w.S, gps = w.S / G, K = a.K;
  const uint8_t* codes = w.codes + b * groups * kGroupBytes;
  constexpr int64_t scale_bytes = PACKED ? kPackedScaleBytes : W;
  const int8_t* sc = w.sc + b * groups * scale_bytes;
  const int8_t* mc = w.mc + b * groups * scale_bytes;
  const void* d = w.scales_from(w.d, b * supers * W + h * 8);
  const void* dm = w.dm ? w.scales_from(w.dm, b * supers * W + h * 8) : nullptr;
  __m256 ya[MT][S], aa[MT][S], ba[MT][S];
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < S; ++s) ya[i][s] = aa[i][s] = ba[i][s] = _mm256_setzero_ps();
  const __m256i bit7 = _mm256_set1_epi8((char)0x80);
  int64_t g = 0;
  for (int64_t sb = 0; sb < supers; ++sb) {
    for (int64_t j = 0; j < gps; ++j, ++g) {
      const uint8_t* grp = codes + g * kGroupBytes;
      const char* ahead = (const char*)grp + kPrefetchBytes;
      for (int off = h * 32; off < kGroupBytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      __m256i dot[MT][S], part[MT][S];  // part: int16 sums of VPMADDUBSW over kSpan code rows
      for (int i = 0; i < MT; ++i)
        for (int s = 0; s < S; ++s) dot[i][s] = part[i][s] = _mm256_setzero_si256();
      for (int r = 0; r < R; ++r) {
        __m256i c0, c1;  // 4 to 6 bits: the codes of set 0 and set 1; 8 bits: bits 0-6 and bit 7
        if constexpr (BITS == 8) {
          const __m256i row = _mm256_loadu_si256((const __m256i*)(grp + r * 64 + h * 32));
          c0 = _mm256_andnot_si256(bit7, row);
          c1 = _mm256_and_si256(bit7, row);
        } else {
          half_row_codes<BITS, G>(grp, r, h, c0, c1);
        }
        for (int i = 0; i < MT; ++i) {
          int32_t x4;
          std::memcpy(&x4, a.xq + (m0 + i) * K + g * G + 4 * r, 4);
          const __m256i xb = _mm256_set1_epi32(x4);
          if constexpr (BITS == 8) {
            dot[i][0] = dot4_avx2(dot4_avx2(dot[i][0], c0, xb), c1, xb);
          } else {
            part[i][0] = _mm256_add_epi16(part[i][0], _mm256_maddubs_epi16(c0, xb));
            part[i][1] = _mm256_add_epi16(part[i][1], _mm256_maddubs_epi16(c1, xb));
            if ((r + 1) % kSpan == 0)
              for (int s = 0; s < S; ++s) {
                dot[i][s] = _mm256_add_epi32(dot[i][s], _mm256_madd_epi16(part[i][s], _mm256_set1_epi16(1)));
                part[i][s] = _mm256_setzero_si256();
              }
          }
        }
      }
      for (int s = 0; s < S; ++s) {
        // PACKED is a template argument: choosing at run time here cost the 1-row step 7% (registers). Unpacking
        // costs 2-16 rows 3-5% on this path (not its one row), and keeping a pair's unpacked codes for the
        // next pairs saved none of it
        __m256 scf = PACKED ? packed_codes8(sc + g * scale_bytes, s, h, false)
                            : int8_to_float8(sc + g * W + s * kLanes + h * 8);
        if (BITS == 4 && s == 1) scf = _mm256_mul_ps(scf, _mm256_set1_ps(0.0625f));
        const __m256 mcf = PACKED ? packed_codes8(mc + g * scale_bytes, s, h, true)
                                  : int8_to_float8(mc + g * W + s * kLanes + h * 8);
        for (int i = 0; i < MT; ++i) {
          // 4 bits, set 1: the other paths multiply 16 x the high codes (see the file's header)
          const __m256i dv = (BITS == 4 && s == 1) ? _mm256_slli_epi32(dot[i][s], 4) : dot[i][s];
          const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dv), scf);
          aa[i][s] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.dx[(m0 + i) * (K / kActBlock) + g * G / kActBlock]), aa[i][s]);
          ba[i][s] = _mm256_fmadd_ps(mcf, _mm256_set1_ps(a.xs[(m0 + i) * groups + g]), ba[i][s]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const __m256 dv = scales8(d, sb * W + s * kLanes, w.half);
      const __m256 dmv = dm ? scales8(dm, sb * W + s * kLanes, w.half) : _mm256_mul_ps(dv, _mm256_set1_ps(w.zero));
      for (int i = 0; i < MT; ++i) {
        ya[i][s] = _mm256_fmadd_ps(aa[i][s], dv, ya[i][s]);
        ya[i][s] = _mm256_fnmadd_ps(ba[i][s], dmv, ya[i][s]);
        aa[i][s] = ba[i][s] = _mm256_setzero_ps();
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < S; ++s) {
      const int64_t n = b * W + s * kLanes + h * 8;
      store8(ya[i][s], bias ? bias + n : nullptr, y + (m0 + i) * w.N + n);
    }
}

// 4- to 6-bit codes in groups whose |C * sc| stays below 2^24 (G (2^BITS - 1) 127 128: every such format here but
// 6-bit codes in groups of 32) take the scale code into the integer dot product: VPMADDWD of the int16 sums by
// (sc, sc) gives C * sc in int32, which equals the other paths' float(C) * float(sc) exactly (with 4 bits, set 1:
// float(16 C) * (sc / 16), also exact). A super-block's scales are unpacked once for both halves and every pair of
// rows, and its codes, read from memory in the first half's pass, stay in L1 for the others.
template <int BITS, int G>
constexpr bool avx2_int_scales() {
  return BITS != 8 && (int64_t)G * ((1 << BITS) - 1) * 127 * 128 < (int64_t(1) << 24);
}

// One super-block's scales of one block, per [group][set][half] (8 channels): sc as int16 pairs, mc as float32
struct alignas(32) Avx2Scales {
  __m256i sc[kMaxGroupsPerSuper][2][2];
  __m256 mc[kMaxGroupsPerSuper][2][2];
  __m256 d[2][2], dm[2][2];
};

// byte c of scq / mcq: channel c's scale / min code, set c / 16 in 128-bit lane c / 16
SPECDEC_AVX2_FN inline void codes_to_lanes(__m256i scq, __m256i mcq, __m256i sc[2][2], __m256 mc[2][2]) {
  const __m256i lo = _mm256_unpacklo_epi8(scq, scq), hi = _mm256_unpackhi_epi8(scq, scq);
  sc[0][0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo));
  sc[1][0] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1));
  sc[0][1] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi));
  sc[1][1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1));
  const __m128i m0 = _mm256_castsi256_si128(mcq), m1 = _mm256_extracti128_si256(mcq, 1);
  mc[0][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m0));
  mc[0][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(m0, m0)));
  mc[1][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m1));
  mc[1][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(m1, m1)));
}

// The scales of super-block sb of block b: every channel's codes of a group in one pass (packed: the 6-bit
// layout of the header, with 16-bit shifts as `BlockView::scales`)
SPECDEC_AVX2_FN inline void avx2_scales(const Weights& w, int64_t b, int64_t sb, int G, Avx2Scales& out) {
  const int64_t groups = w.K / G, supers = w.K / w.S, gps = w.S / G;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m45 = _mm256_set1_epi8(0x30);
  for (int64_t j = 0; j < gps; ++j) {
    const int64_t g = b * groups + sb * gps + j;
    __m256i scq, mcq;
    if (w.packed) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(w.sc) + g * kPackedScaleBytes;
      const __m256i lo = _mm256_loadu_si256((const __m256i*)p);
      const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p + 32)));
      const __m256i sch = _mm256_blend_epi32(_mm256_slli_epi16(hi, 4), _mm256_slli_epi16(hi, 2), 0xF0);
      const __m256i mch = _mm256_blend_epi32(hi, _mm256_srli_epi16(hi, 2), 0xF0);
      scq = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(sch, m45));
      mcq = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4), _mm256_and_si256(mch, m45));
    } else {
      scq = _mm256_loadu_si256((const __m256i*)(w.sc + g * 32));
      mcq = _mm256_loadu_si256((const __m256i*)(w.mc + g * 32));
    }
    codes_to_lanes(scq, mcq, out.sc[j], out.mc[j]);
  }
  for (int s = 0; s < 2; ++s)
    for (int h = 0; h < 2; ++h) {
      const int64_t i = (b * supers + sb) * 32 + s * kLanes + h * 8;
      out.d[s][h] = scales8(w.d, i, w.half);
      out.dm[s][h] = w.dm ? scales8(w.dm, i, w.half) : _mm256_mul_ps(out.d[s][h], _mm256_set1_ps(w.zero));
    }
}

// The codes of half h (channels h*8 .. h*8 + 7 of each set) of one super-block's gps groups, from grp0, as bytes
// below 64: u[(j R + r) 2 + s] holds row r of group j, set s (unpacked once for every row of a call).
template <int BITS, int G>
SPECDEC_AVX2_FN inline void avx2_unpack_half(const uint8_t* grp0, int64_t gps, int h, __m256i* u) {
  constexpr int R = G / 4, kGroupBytes = group_bytes(BITS, G);
  for (int64_t j = 0; j < gps; ++j) {
    const uint8_t* grp = grp0 + j * kGroupBytes;
    for (int r = 0; r < R; ++r) {
      __m256i c0, c1;
      half_row_codes<BITS, G>(grp, r, h, c0, c1);
      _mm256_store_si256(u + (j * R + r) * 2, c0);
      _mm256_store_si256(u + (j * R + r) * 2 + 1, c1);
    }
  }
}

// Rows m0 .. m0 + MT - 1, half h, of one super-block whose first group is g0, its codes unpacked in u:
// yacc (MT rows of 32 floats) += the super-block's part of the output, its mins' sums given in bsum (as
// avx2_min_sums writes them). PF: prefetch the codes at `ahead` (a super-block to come) a line or two per code row
// as the products go, so that memory stays busy however few rows share the unpacked codes (in one burst per
// super-block it idled between bursts at 2-5 rows).
template <int BITS, int G, int MT, bool PF>
SPECDEC_AVX2_FN inline void avx2_super_rows(const __m256i* u, const Avx2Scales& sc, int64_t gps, int64_t g0,
                                            const Acts& a, int64_t m0, int h, const float* bsum, float* yacc,
                                            const uint8_t* ahead) {
  constexpr int R = G / 4, kGroupLines = group_bytes(BITS, G) / 64;
  constexpr int kSpan = BITS == 4 ? R : BITS == 5 ? 4 : 2;  // as avx2_half
  const int64_t K = a.K;
  const int8_t* xq[MT];
  for (int i = 0; i < MT; ++i) xq[i] = a.xq + (m0 + i) * K + g0 * G;
  __m256 aa[MT][2];
  for (int i = 0; i < MT; ++i) aa[i][0] = aa[i][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < gps; ++j) {
    __m256i dot[MT][2];
    for (int i = 0; i < MT; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    for (int r0 = 0; r0 < R; r0 += kSpan) {
      __m256i part[MT][2];
      for (int i = 0; i < MT; ++i) part[i][0] = part[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int r = r0; r < r0 + kSpan; ++r) {
        if constexpr (PF)  // lines r L / R .. (r + 1) L / R - 1 of group j's L
          for (int l = r * kGroupLines / R; l < (r + 1) * kGroupLines / R; ++l)
            prefetch_line(ahead + (j * kGroupLines + l) * 64);
        const __m256i c0 = _mm256_load_si256(u + (j * R + r) * 2), c1 = _mm256_load_si256(u + (j * R + r) * 2 + 1);
        for (int i = 0; i < MT; ++i) {
          int32_t x4;
          std::memcpy(&x4, xq[i] + j * G + 4 * r, 4);
          const __m256i xb = _mm256_set1_epi32(x4);
          part[i][0] = _mm256_add_epi16(part[i][0], _mm256_maddubs_epi16(c0, xb));
          part[i][1] = _mm256_add_epi16(part[i][1], _mm256_maddubs_epi16(c1, xb));
          // keep each sum in order: GCC otherwise reassociates the chain, computes every product first and
          // spills them to the stack (seen in the disassembly of the 2-row tile)
          asm("" : "+x"(part[i][0]), "+x"(part[i][1]));
        }
      }
      for (int i = 0; i < MT; ++i)
        for (int s = 0; s < 2; ++s) dot[i][s] = _mm256_add_epi32(dot[i][s], _mm256_madd_epi16(part[i][s], sc.sc[j][s][h]));
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 dx = _mm256_set1_ps(a.dx[(m0 + i) * (K / kActBlock) + (g0 + j) * G / kActBlock]);
      for (int s = 0; s < 2; ++s) aa[i][s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][s]), dx, aa[i][s]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < 2; ++s) {
      float* yp = yacc + i * 32 + s * kLanes + h * 8;
      const __m256 yv = _mm256_fmadd_ps(aa[i][s], sc.d[s][h], _mm256_load_ps(yp));
      _mm256_store_ps(yp, _mm256_fnmadd_ps(_mm256_load_ps(bsum + i * 16 + s * 8), sc.dm[s][h], yv));
    }
}

// The mins' sums of rows m0 .. m0 + MT - 1, half h, of one super-block whose first group is g0: bsum[i 16 + s 8 ..]
// (8 channels of set s) = the sum over its groups, in order, of mc * xs (each (row, set) one chain, the other
// paths' bits). Taken out of avx2_super_rows, which has no registers left to interleave them with its products:
// there its 2 x 3 chains waited on each fused multiply-add (~8% of a 512-row call); 4 rows here give 8 chains.
template <int G, int MT>
SPECDEC_AVX2_FN inline void avx2_min_sums(const Avx2Scales& sc, int64_t gps, int64_t g0, const Acts& a, int64_t m0,
                                          int h, float* bsum) {
  const int64_t groups = a.K / G;
  __m256 ba[MT][2];
  for (int i = 0; i < MT; ++i) ba[i][0] = ba[i][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < gps; ++j)
    for (int i = 0; i < MT; ++i) {
      const __m256 xs = _mm256_set1_ps(a.xs[(m0 + i) * groups + g0 + j]);
      for (int s = 0; s < 2; ++s) ba[i][s] = _mm256_fmadd_ps(sc.mc[j][s][h], xs, ba[i][s]);
    }
  for (int i = 0; i < MT; ++i)
    for (int s = 0; s < 2; ++s) _mm256_store_ps(bsum + i * 16 + s * 8, ba[i][s]);
}

// avx2_min_sums for `rows` rows from m0, 4 at a time (8 independent chains), then the 1-3 left
template <int G>
SPECDEC_AVX2_FN inline void avx2_chunk_min_sums(const Avx2Scales& sc, int64_t gps, int64_t g0, const Acts& a,
                                                int64_t m0, int64_t rows, int h, float* bsum) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) avx2_min_sums<G, 4>(sc, gps, g0, a, m0 + i, h, bsum + i * 16);
  switch (rows - i) {
    case 3: return avx2_min_sums<G, 3>(sc, gps, g0, a, m0 + i, h, bsum + i * 16);
    case 2: return avx2_min_sums<G, 2>(sc, gps, g0, a, m0 + i, h, bsum + i * 16);
    case 1: return avx2_min_sums<G, 1>(sc, gps, g0, a, m0 + i, h, bsum + i * 16);
    default: return;
  }
}

// Blocks [b0, b1) of 2+ rows with avx2_super_rows: up to kChunk rows at a time, each super-block in turn, its
// scales and each half's codes unpacked once, the mins' sums of every row, then 3 rows at a time with 4-bit codes
// and 2 with 5 or 6 (what 16 vector registers hold). 128-row chunks took 0.90-0.97x the time of 32-row ones in
// 128- and 512-row calls of the 1.5B's linears (fewer passes over each block's codes), 512-row ones no less.
template <int BITS, int G, typename T>
SPECDEC_AVX2_FN void gemm_avx2_supers(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  constexpr int kGroupBytes = group_bytes(BITS, G), kChunk = 128, MT = BITS == 4 ? 3 : 2;
  const int64_t groups = w.K / G, supers = w.K / w.S, gps = w.S / G;
  alignas(32) float yacc[kChunk * 32], bsum[kChunk * 16];
  alignas(32) __m256i u[kMaxGroupsPerSuper * 8 * 2];  // a super-block's half: up to 16 groups of up to 8 rows, 2 sets
  Avx2Scales sc;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* codes = w.codes + b * groups * kGroupBytes;
    for (int64_t m0 = 0; m0 < a.M; m0 += kChunk) {
      const int64_t rows = std::min<int64_t>(kChunk, a.M - m0);
      std::fill(yacc, yacc + rows * 32, 0.f);
      for (int64_t sb = 0; sb < supers; ++sb) {
        avx2_scales(w, b, sb, G, sc);
        const uint8_t* here = codes + sb * gps * kGroupBytes;
        for (int h = 0; h < 2; ++h) {
          avx2_unpack_half<BITS, G>(here, gps, h, u);
          // the first row tile of the first half prefetches the codes kAvx2AheadBytes on
          const uint8_t* ahead = here + kAvx2AheadBytes;
          const int64_t g0 = sb * gps;
          avx2_chunk_min_sums<G>(sc, gps, g0, a, m0, rows, h, bsum);
          int64_t i = 0;
          if (h == 0 && m0 == 0) {
            const int first = rows >= MT ? MT : rows >= 2 ? 2 : 1;
            if (first == MT) avx2_super_rows<BITS, G, MT, true>(u, sc, gps, g0, a, m0, h, bsum, yacc, ahead);
            else if (first == 2) avx2_super_rows<BITS, G, 2, true>(u, sc, gps, g0, a, m0, h, bsum, yacc, ahead);
            else avx2_super_rows<BITS, G, 1, true>(u, sc, gps, g0, a, m0, h, bsum, yacc, ahead);
            i = first;
          }
          for (; i + MT <= rows; i += MT)
            avx2_super_rows<BITS, G, MT, false>(u, sc, gps, g0, a, m0 + i, h, bsum + i * 16, yacc + i * 32, ahead);
          if (MT == 3 && i + 2 <= rows) {
            avx2_super_rows<BITS, G, 2, false>(u, sc, gps, g0, a, m0 + i, h, bsum + i * 16, yacc + i * 32, ahead);
            i += 2;
          }
          if (i < rows)
            avx2_super_rows<BITS, G, 1, false>(u, sc, gps, g0, a, m0 + i, h, bsum + i * 16, yacc + i * 32, ahead);
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < 32; c += 8) {
          const int64_t n = b * 32 + c;
          store8(_mm256_load_ps(yacc + i * 32 + c), bias ? bias + n : nullptr, y + (m0 + i) * w.N + n);
        }
    }
  }
}

// One row of blocks [b0, b1) where the scale codes enter the integer product: both halves of every code row in one
// pass (the codes read once, each line prefetched as the stream goes), a super-block's scales unpacked once.
template <int BITS, int G, typename T>
SPECDEC_AVX2_FN void gemm_avx2_row(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  constexpr int R = G / 4, kGroupBytes = group_bytes(BITS, G);
  constexpr int kSpan = BITS == 4 ? R : BITS == 5 ? 4 : 2;  // as avx2_half
  const int64_t groups = w.K / G, supers = w.K / w.S, gps = w.S / G;
  alignas(32) float yacc[32];
  Avx2Scales sc;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* codes = w.codes + b * groups * kGroupBytes;
    std::fill(yacc, yacc + 32, 0.f);
    for (int64_t sb = 0; sb < supers; ++sb) {
      avx2_scales(w, b, sb, G, sc);
      __m256 aa[2][2];
      for (int s = 0; s < 2; ++s) aa[s][0] = aa[s][1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < gps; ++j) {
        const int64_t g = sb * gps + j;
        const uint8_t* grp = codes + g * kGroupBytes;
        for (int off = 0; off < kGroupBytes; off += 64) prefetch_line((const char*)grp + kPrefetchBytes + off);
        __m256i dot[2][2], part[2][2];
        for (int s = 0; s < 2; ++s)
          for (int h = 0; h < 2; ++h) dot[s][h] = part[s][h] = _mm256_setzero_si256();
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, a.xq + g * G + 4 * r, 4);
          const __m256i xb = _mm256_set1_epi32(x4);
          for (int h = 0; h < 2; ++h) {
            __m256i c0, c1;
            half_row_codes<BITS, G>(grp, r, h, c0, c1);
            part[0][h] = _mm256_add_epi16(part[0][h], _mm256_maddubs_epi16(c0, xb));
            part[1][h] = _mm256_add_epi16(part[1][h], _mm256_maddubs_epi16(c1, xb));
          }
          if ((r + 1) % kSpan == 0)
            for (int s = 0; s < 2; ++s)
              for (int h = 0; h < 2; ++h) {
                dot[s][h] = _mm256_add_epi32(dot[s][h], _mm256_madd_epi16(part[s][h], sc.sc[j][s][h]));
                part[s][h] = _mm256_setzero_si256();
              }
        }
        const __m256 dx = _mm256_set1_ps(a.dx[g * G / kActBlock]);
        for (int s = 0; s < 2; ++s)
          for (int h = 0; h < 2; ++h) aa[s][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[s][h]), dx, aa[s][h]);
      }
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < 2; ++h) {
          __m256 ba = _mm256_setzero_ps();
          for (int64_t j = 0; j < gps; ++j) ba = _mm256_fmadd_ps(sc.mc[j][s][h], _mm256_set1_ps(a.xs[sb * gps + j]), ba);
          float* yp = yacc + s * kLanes + h * 8;
          const __m256 yv = _mm256_fmadd_ps(aa[s][h], sc.d[s][h], _mm256_load_ps(yp));
          _mm256_store_ps(yp, _mm256_fnmadd_ps(ba, sc.dm[s][h], yv));
        }
    }
    for (int c = 0; c < 32; c += 8) {
      const int64_t n = b * 32 + c;
      store8(_mm256_load_ps(yacc + c), bias ? bias + n : nullptr, y + n);
    }
  }
}

// q0 / q1 += one code row of sets 0 / 1 (c0, c1) times the 4 activations at x, in int16
SPECDEC_AVX2_FN inline void avx2_add_row(__m256i& q0, __m256i& q1, __m256i c0, __m256i c1, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  const __m256i xb = _mm256_set1_epi32(x4);
  q0 = _mm256_add_epi16(q0, _mm256_maddubs_epi16(c0, xb));
  q1 = _mm256_add_epi16(q1, _mm256_maddubs_epi16(c1, xb));
  asm("" : "+x"(q0), "+x"(q1));  // keep each sum in order (as avx2_super_rows)
}

// d0 / d1 += the int32 products of a span's int16 sums s0 / s1 with the scale codes sc0 / sc1 (VPMADDWD); s0 = s1 = 0
// (VPMADDWD is exact and int32 sums in any order are, so 4-bit codes' one span a group and 6-bit codes' two give the
// other paths' int32 products)
SPECDEC_AVX2_FN inline void avx2_span_dot(__m256i& d0, __m256i& d1, __m256i& s0, __m256i& s1, __m256i sc0, __m256i sc1) {
  d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(s0, sc0));
  d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(s1, sc1));
  s0 = s1 = _mm256_setzero_si256();
}

// Rows m0 .. m0 + NR - 1 (NR <= 4) of one super-block whose first group g0 starts at grp0: yacc (NR rows of 32
// floats) += the super-block's part of the output. Each group half by half while its lines are in L1 (the codes read
// from memory once; avx2_half reads a block twice, once a half), every row sharing each unpacked code row, the scale
// codes entering the integer product (int16 sums flushed through VPMADDWD every kSpan code rows, as avx2_half).
// PF: prefetch each group's lines kPrefetchBytes on (the first row tile of a call; the others find the super-block in
// L1). Every sum in the other paths' order (each float chain over the groups in order).
template <int BITS, int G, int NR, bool PF>
SPECDEC_AVX2_FN inline void avx2_stream_rows(const uint8_t* grp0, const Avx2Scales& sc, int64_t gps, int64_t g0,
                                             const Acts& a, int64_t m0, float* yacc, float* bsum) {
  constexpr int R = G / 4, kGroupBytes = group_bytes(BITS, G);
  constexpr int kSpan = BITS == 4 ? R : BITS == 5 ? 4 : 2;  // as avx2_half
  const int64_t K = a.K, act_blocks = K / kActBlock;
  // the groups' float sums, [row][set][half]: in registers for 1-2 rows, in L1 for 3-4 (16 vector registers hold
  // no more beside the integer sums; in L1 at 2 rows: 1.10x the time)
  constexpr bool kRegs = NR <= 2;
  __m256 ar[kRegs ? NR : 1][2][2];
  alignas(32) float am[kRegs ? 1 : NR][2][2][8];
  const int8_t* xq[NR];
  for (int i = 0; i < NR; ++i) xq[i] = a.xq + (m0 + i) * K + g0 * G;
  for (int i = 0; i < NR; ++i)
    for (int s = 0; s < 2; ++s)
      for (int h = 0; h < 2; ++h) {
        if constexpr (kRegs) ar[i][s][h] = _mm256_setzero_ps();
        else _mm256_store_ps(am[i][s][h], _mm256_setzero_ps());
      }
  for (int64_t j = 0; j < gps; ++j) {
    const uint8_t* grp = grp0 + j * kGroupBytes;
    const int64_t g = g0 + j;
    if constexpr (PF)
      for (int off = 0; off < kGroupBytes; off += 64) prefetch_line((const char*)grp + kPrefetchBytes + off);
    for (int h = 0; h < 2; ++h) {
      // row i's int16 sums of a span (si0, si1: sets 0 and 1) and int32 products with the scale codes (di0, di1), in
      // named variables: as arrays of 8 vectors GCC kept them on the stack
      const __m256i zero = _mm256_setzero_si256();
      __m256i s00 = zero, s01 = zero, s10 = zero, s11 = zero, s20 = zero, s21 = zero, s30 = zero, s31 = zero;
      __m256i d00 = zero, d01 = zero, d10 = zero, d11 = zero, d20 = zero, d21 = zero, d30 = zero, d31 = zero;
      const __m256i sc0 = sc.sc[j][0][h], sc1 = sc.sc[j][1][h];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i c0, c1;
        half_row_codes<BITS, G>(grp, r, h, c0, c1);
        const int64_t at = j * G + 4 * r;
        avx2_add_row(s00, s01, c0, c1, xq[0] + at);
        if constexpr (NR > 1) avx2_add_row(s10, s11, c0, c1, xq[1] + at);
        if constexpr (NR > 2) avx2_add_row(s20, s21, c0, c1, xq[2] + at);
        if constexpr (NR > 3) avx2_add_row(s30, s31, c0, c1, xq[3] + at);
        if ((r + 1) % kSpan == 0) {
          avx2_span_dot(d00, d01, s00, s01, sc0, sc1);
          if constexpr (NR > 1) avx2_span_dot(d10, d11, s10, s11, sc0, sc1);
          if constexpr (NR > 2) avx2_span_dot(d20, d21, s20, s21, sc0, sc1);
          if constexpr (NR > 3) avx2_span_dot(d30, d31, s30, s31, sc0, sc1);
        }
      }
      const __m256i dots[4][2] = {{d00, d01}, {d10, d11}, {d20, d21}, {d30, d31}};
      for (int i = 0; i < NR; ++i) {
        const __m256 dx = _mm256_set1_ps(a.dx[(m0 + i) * act_blocks + g * G / kActBlock]);
        for (int s = 0; s < 2; ++s) {
          const __m256 p = _mm256_cvtepi32_ps(dots[i][s]);
          if constexpr (kRegs) ar[i][s][h] = _mm256_fmadd_ps(p, dx, ar[i][s][h]);
          else _mm256_store_ps(am[i][s][h], _mm256_fmadd_ps(p, dx, _mm256_load_ps(am[i][s][h])));
        }
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    avx2_min_sums<G, NR>(sc, gps, g0, a, m0, h, bsum);
    for (int i = 0; i < NR; ++i)
      for (int s = 0; s < 2; ++s) {
        float* yp = yacc + i * 32 + s * kLanes + h * 8;
        __m256 sum;
        if constexpr (kRegs) sum = ar[i][s][h];
        else sum = _mm256_load_ps(am[i][s][h]);
        const __m256 yv = _mm256_fmadd_ps(sum, sc.d[s][h], _mm256_load_ps(yp));
        _mm256_store_ps(yp, _mm256_fnmadd_ps(_mm256_load_ps(bsum + i * 16 + s * 8), sc.dm[s][h], yv));
      }
  }
}

// avx2_stream_rows for 1-4 rows from m0
template <int BITS, int G, bool PF>
SPECDEC_AVX2_FN inline void avx2_stream_tile(const uint8_t* grp0, const Avx2Scales& sc, int64_t gps, int64_t g0,
                                             const Acts& a, int64_t m0, int rows, float* yacc, float* bsum) {
  switch (rows) {
    case 4: return avx2_stream_rows<BITS, G, 4, PF>(grp0, sc, gps, g0, a, m0, yacc, bsum);
    case 3: return avx2_stream_rows<BITS, G, 3, PF>(grp0, sc, gps, g0, a, m0, yacc, bsum);
    case 2: return avx2_stream_rows<BITS, G, 2, PF>(grp0, sc, gps, g0, a, m0, yacc, bsum);
    default: return avx2_stream_rows<BITS, G, 1, PF>(grp0, sc, gps, g0, a, m0, yacc, bsum);
  }
}

// The rows of blocks [b0, b1) (at most kAvx2StreamMaxRows): each super-block's scales unpacked once, then
// avx2_stream_rows 4 rows at a time, the 1-3 left last (the first tile streaming the codes from memory, the others
// reading them in L1).
constexpr int kAvx2StreamMaxRows = 16;
template <int BITS, int G, typename T>
SPECDEC_AVX2_FN void gemm_avx2_stream(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  constexpr int kGroupBytes = group_bytes(BITS, G), kTile = 4;
  const int64_t groups = w.K / G, supers = w.K / w.S, gps = w.S / G;
  alignas(32) float yacc[kAvx2StreamMaxRows * 32], bsum[4 * 16];
  Avx2Scales sc;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* codes = w.codes + b * groups * kGroupBytes;
    std::fill(yacc, yacc + a.M * 32, 0.f);
    for (int64_t sb = 0; sb < supers; ++sb) {
      avx2_scales(w, b, sb, G, sc);
      const uint8_t* here = codes + sb * gps * kGroupBytes;
      const int first = (int)std::min<int64_t>(kTile, a.M);
      avx2_stream_tile<BITS, G, true>(here, sc, gps, sb * gps, a, 0, first, yacc, bsum);
      for (int64_t m0 = first; m0 < a.M; m0 += kTile)
        avx2_stream_tile<BITS, G, false>(here, sc, gps, sb * gps, a, m0, (int)std::min<int64_t>(kTile, a.M - m0),
                                         yacc + m0 * 32, bsum);
    }
    for (int64_t i = 0; i < a.M; ++i)
      for (int c = 0; c < 32; c += 8) {
        const int64_t n = b * 32 + c;
        store8(_mm256_load_ps(yacc + i * 32 + c), bias ? bias + n : nullptr, y + i * w.N + n);
      }
  }
}

// Whether gemm_avx2_stream takes a call of `rows` rows. The 1.5B's step linears on an AVX2-only EPYC, alternating
// builds in one process: 4-bit codes 0.80-0.87 / 0.71-0.84 / 0.80-0.91 / 0.93-0.98x gemm_avx2_supers' time at
// 3 / 4 / 8 / 16 rows, the same as the two-row kernel it replaced at 2, equal at 32-64, 1.15-1.19x at 128-512 (a tile
// unpacks the codes anew; prefill keeps gemm_avx2_supers); 6-bit codes in groups of 16 0.77-0.87 / 0.86-0.90 / 0.88 /
// 0.94-0.98 / 0.98-1.00x at 3 / 4 / 5 / 6-7 / 8 rows, 1.02x at 16 and 1.17-1.27x avx2_half's time at 2 rows. Other
// formats were not measured: they keep avx2_half and gemm_avx2_supers.
template <int BITS>
constexpr bool avx2_streams(int64_t rows) {
  return BITS == 4 ? rows >= 2 && rows <= kAvx2StreamMaxRows : BITS == 6 && rows >= 3 && rows <= 8;
}

// gemm_avx2_supers from 3 rows on where gemm_avx2_stream does not run; 2 rows of 5- and 6-bit codes stream faster
// through avx2_half (gemm_avx2_supers 1.16x its time at 2 rows).
constexpr int kAvx2SupersMinRows = 3;

// Every row of blocks [b0, b1): where the scale codes enter the integer product, gemm_avx2_row for one row,
// gemm_avx2_stream where avx2_streams and gemm_avx2_supers for kAvx2SupersMinRows+; else two rows at a time (16
// vector registers hold no more), half by half.
template <int BITS, int G, typename T>
SPECDEC_AVX2_FN void gemm_avx2(const Weights& w, const Acts& a, const float* bias, T* y, int64_t b0, int64_t b1) {
  if constexpr (avx2_int_scales<BITS, G>()) {
    if (a.M == 1) return gemm_avx2_row<BITS, G, T>(w, a, bias, y, b0, b1);
    if (avx2_streams<BITS>(a.M)) return gemm_avx2_stream<BITS, G, T>(w, a, bias, y, b0, b1);
    if (a.M >= kAvx2SupersMinRows) return gemm_avx2_supers<BITS, G, T>(w, a, bias, y, b0, b1);
  }
  for (int64_t b = b0; b < b1; ++b)
    for (int h = 0; h < 2; ++h) {
      int64_t m = 0;
      if (BITS != 8 && w.packed) {
        for (; m + 2 <= a.M; m += 2) avx2_half<BITS, G, T, 2, true>(w, a, m, bias, y, b, h);
        if (m < a.M) avx2_half<BITS, G, T, 1, true>(w, a, m, bias, y, b, h);
      } else {
        for (; m + 2 <= a.M; m += 2) avx2_half<BITS, G, T, 2, false>(w, a, m, bias, y, b, h);
        if (m < a.M) avx2_half<BITS, G, T, 1, false>(w, a, m, bias, y, b, h);
      }
    }
}

// ---------------------------------------------------------------- AMX path

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: A (16 rows of G int8 activations); tmm1, tmm2: B (G/4 rows of 64 bytes, one per set);
// tmm3, tmm4: C (16 x 16 int32, one per set).
SPECDEC_AMX void amx_configure(int G) {
  TileConfig cfg;
  cfg.rows[0] = 16;
  cfg.colsb[0] = (uint16_t)G;
  for (int t : {1, 2}) { cfg.rows[t] = (uint8_t)(G / 4); cfg.colsb[t] = 64; }
  for (int t : {3, 4}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  // GCC 12 does not see that ldtilecfg reads cfg and drops the stores above without this barrier
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Activations in group-major tiles: xt[(m0 / 16) * groups * 16 * G + g * 16 * G + i * G + j] =
// xq[m0 + i][g * G + j], rows past M zero.
void tile_activations(const int8_t* xq, int64_t M, int64_t K, int G, int8_t* xt) {
  const int64_t groups = K / G, tiles = (M + 15) / 16;
  std::memset(xt, 0, tiles * 16 * K);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* base = xt + (m / 16) * groups * 16 * G + (m % 16) * G;
    for (int64_t g = 0; g < groups; ++g) std::memcpy(base + g * 16 * G, xq + m * K + g * G, G);
  }
}

// Groups of one super-block first go through the tiles (their C tiles kept in cbuf), then each
// row's accumulators take the super-block's groups in order, in registers.

template <int BITS, int G, typename T>
SPECDEC_AMX void gemm_amx(const Weights& w, const Acts& a, const int8_t* xt, const float* bias, T* y, int64_t b0,
                          int64_t b1) {
  using V = BlockView<BITS, G>;
  constexpr int R = V::R, S = V::kSets;
  amx_configure(G);
  alignas(64) int32_t cbuf[kMaxGroupsPerSuper][S][16 * kLanes];
  alignas(64) float scf[kMaxGroupsPerSuper][S][kLanes], mcf[kMaxGroupsPerSuper][S][kLanes];
  alignas(64) uint8_t bbuf[S][R * 64];
  alignas(64) float fy[16][S][kLanes];
  const int64_t K = a.K;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
    const V v(w, b);
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int mt = (int)std::min<int64_t>(16, a.M - m0);
      const int8_t* xtile = xt + (m0 / 16) * v.groups * 16 * G;
      std::memset(fy, 0, sizeof(fy));
      for (int64_t sb = 0; sb < v.supers; ++sb) {
        const int64_t g0 = sb * v.gps;
        for (int64_t j = 0; j < v.gps; ++j) {
          const int64_t g = g0 + j;
          const uint8_t* grp = v.codes + g * V::kGroupBytes;
          prefetch_group(v, g);
          _tile_loadd(0, xtile + g * 16 * G, G);
          if constexpr (BITS == 8) {
            _tile_zero(3);
            _tile_loadd(1, grp, 64);
            _tile_dpbsud(3, 0, 1);
            _tile_stored(3, cbuf[j][0], 64);
          } else {
            for (int r = 0; r < R; ++r) {
              __m512i a, b;
              if constexpr (BITS == 4) {
                const __m512i row = _mm512_loadu_si512(grp + r * 64);
                a = _mm512_and_si512(row, low);
                b = _mm512_andnot_si512(low, row);  // 16 x the high set's codes, as the VNNI path
              } else {
                unpack_high<BITS, G>(grp, r, a, b);
              }
              _mm512_store_si512(bbuf[0] + r * 64, a);
              _mm512_store_si512(bbuf[S - 1] + r * 64, b);
            }
            _tile_zero(3);
            _tile_zero(4);
            _tile_loadd(1, bbuf[0], 64);
            _tile_loadd(2, bbuf[S - 1], 64);
            _tile_dpbsud(3, 0, 1);
            _tile_dpbsud(4, 0, 2);
            _tile_stored(3, cbuf[j][0], 64);
            _tile_stored(4, cbuf[j][S - 1], 64);
          }
          __m512 scfs[S], mcfs[S];
          v.scales(g, scfs, mcfs);
          for (int s = 0; s < S; ++s) {
            _mm512_store_ps(scf[j][s], scfs[s]);
            _mm512_store_ps(mcf[j][s], mcfs[s]);
          }
        }
        for (int s = 0; s < S; ++s) {
          __m512 dv, dmv;
          v.super_scales(sb, s, dv, dmv);
          for (int i = 0; i < mt; ++i) {
            const int64_t m = m0 + i;
            const float* dxr = a.dx + m * (K / kActBlock);
            const float* xsr = a.xs + m * v.groups;
            Acc acc{_mm512_load_ps(fy[i][s]), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t j = 0; j < v.gps; ++j) {
              const int64_t g = g0 + j;
              accumulate(acc, _mm512_load_si512(cbuf[j][s] + i * kLanes), _mm512_load_ps(scf[j][s]),
                         _mm512_load_ps(mcf[j][s]), dxr[g * G / kActBlock], xsr[g]);
            }
            close_super(acc, dv, dmv);
            _mm512_store_ps(fy[i][s], acc.y);
          }
        }
      }
      for (int i = 0; i < mt; ++i)
        for (int s = 0; s < S; ++s) {
          const int64_t n = b * V::W + s * kLanes;
          store_row(_mm512_load_ps(fy[i][s]), bias ? bias + n : nullptr, y + (m0 + i) * w.N + n);
        }
    }
  }
  _tile_release();
}

// The kernels of one (bits, group) pair.
template <typename T>
struct Kernels {
  void (*vnni)(const Weights&, const Acts&, const float*, T*, int64_t, int64_t);
  void (*amx)(const Weights&, const Acts&, const int8_t*, const float*, T*, int64_t, int64_t);
  void (*avx2)(const Weights&, const Acts&, const float*, T*, int64_t, int64_t);
};

template <typename T>
Kernels<T> kernels_for(int bits, int G) {
  switch (bits * 100 + G) {
    case 432: return {gemm_vnni<4, 32, T>, gemm_amx<4, 32, T>, gemm_avx2<4, 32, T>};
    case 416: return {gemm_vnni<4, 16, T>, gemm_amx<4, 16, T>, gemm_avx2<4, 16, T>};
    case 532: return {gemm_vnni<5, 32, T>, gemm_amx<5, 32, T>, gemm_avx2<5, 32, T>};
    case 516: return {gemm_vnni<5, 16, T>, gemm_amx<5, 16, T>, gemm_avx2<5, 16, T>};
    case 632: return {gemm_vnni<6, 32, T>, gemm_amx<6, 32, T>, gemm_avx2<6, 32, T>};
    case 616: return {gemm_vnni<6, 16, T>, gemm_amx<6, 16, T>, gemm_avx2<6, 16, T>};
    case 832: return {gemm_vnni<8, 32, T>, gemm_amx<8, 32, T>, gemm_avx2<8, 32, T>};
    default: return {gemm_vnni<8, 16, T>, gemm_amx<8, 16, T>, gemm_avx2<8, 16, T>};
  }
}

// ---------------------------------------------------------------- op

// fn over blocks [0, nb) on every thread: each thread first takes kGuidedSharePercent of an equal share as one
// contiguous range (the stream the prefetchers follow), then the rest in chunks, about kGuidedChunks a thread, as
// threads come free. Equal static ranges finished apart on an AVX2-only EPYC VM (a worker wakes later, the two cores'
// memory rates differ; the measurements are in docs/cpu_kernels.md). A block's output never depends on which thread
// computes it.
constexpr int64_t kGuidedSharePercent = 75, kGuidedChunks = 4;

template <typename F>
void parallel_guided(int64_t nb, const F& fn) {
  const int64_t T = at::get_num_threads();
  const int64_t share = nb * kGuidedSharePercent / 100 / T;
  const int64_t chunk = std::max<int64_t>(1, (nb - T * share) / (kGuidedChunks * T));
  std::atomic<int64_t> next{T * share};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (share) fn(t * share, (t + 1) * share);
      for (int64_t s = next.fetch_add(chunk); s < nb; s = next.fetch_add(chunk)) fn(s, std::min(nb, s + chunk));
    }
  });
}

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "specdec::blockq_mm: ", msg); }

int64_t pick_isa(int64_t isa, int64_t M, int64_t amx_min_rows) {
  if (isa == kAuto) {
    if (has_amx() && M >= amx_min_rows) return kAmx;
    return has_vnni() ? kVnni : has_avx2() ? kAvx2 : kGeneric;
  }
  if (isa == kAvx2) TORCH_CHECK(has_avx2(), "specdec::blockq_mm: this CPU has no AVX2 and FMA");
  if (isa == kAmx) TORCH_CHECK(has_amx(), "specdec::blockq_mm: this CPU (or OS) has no AMX-INT8");
  if (isa == kVnni) TORCH_CHECK(has_vnni(), "specdec::blockq_mm: this CPU has no AVX-512 VNNI");
  return isa;
}

at::Tensor blockq_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& mc,
                     const at::Tensor& d, const c10::optional<at::Tensor>& dm, const c10::optional<at::Tensor>& bias,
                     int64_t bits, int64_t group, int64_t super, double zero, int64_t isa, int64_t amx_min_rows) {
  check(x.device().is_cpu(), "x must be on the CPU");
  check(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  check(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  check(group == 16 || group == 32, "group must be 16 or 32");
  check(super > 0 && super % group == 0 && super / group <= kMaxGroupsPerSuper,
        "super must be a positive multiple of group, at most 16 groups");
  const int64_t K = x.size(-1), W = block_width((int)bits);
  check(K % super == 0 && K % kActBlock == 0, "in_features must be a multiple of the super-block and of 32");
  check(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
        "codes must be (N/W, K/G, group bytes) uint8");
  const int64_t N = codes.size(0) * W;
  check(codes.size(1) == K / group && codes.size(2) == group_bytes((int)bits, (int)group),
        "codes do not match K, group and bits");
  const bool packed = sc.scalar_type() == at::kByte;
  if (packed)
    check(W == 32 && sc.is_contiguous() && sc.numel() == N / W * (K / group) * kPackedScaleBytes &&
              mc.data_ptr() == sc.data_ptr() && mc.sizes() == sc.sizes() && mc.scalar_type() == at::kByte,
          "packed scale codes must be uint8 (N/W, K/G, 48) of 4- to 6-bit codes, passed as both sc and mc");
  else
    check(sc.scalar_type() == at::kChar && mc.scalar_type() == at::kChar && sc.is_contiguous() && mc.is_contiguous() &&
              sc.numel() == N * (K / group) && mc.numel() == N * (K / group),
          "sc, mc must be int8 (N/W, K/G, W), or one packed uint8 tensor (N/W, K/G, 48)");
  check((d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf) && d.is_contiguous() &&
            d.numel() == N * (K / super), "d must be float32 or float16 (N/W, K/S, W)");
  check(dm.has_value() ? (dm->scalar_type() == d.scalar_type() && dm->is_contiguous() && dm->numel() == d.numel())
                       : zero != 0.0, "dm must be (N/W, K/S, W) of d's dtype, or absent with a zero");
  at::Tensor b32;
  if (bias.has_value()) {
    b32 = bias->to(at::kFloat).contiguous();
    check(b32.numel() == N, "bias must have out_features elements");
  }
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_sizes);

  const int64_t path = pick_isa(isa, M, amx_min_rows);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / kActBlock}, x.options().dtype(at::kFloat));
  at::Tensor xs = at::empty({M, K / group}, x.options().dtype(at::kFloat));
  if (x2.scalar_type() == at::kFloat)
    quantize_rows(x2.data_ptr<float>(), M, K, (int)group, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xs.data_ptr<float>(),
                  path);
  else
    quantize_rows(x2.data_ptr<at::BFloat16>(), M, K, (int)group, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                  xs.data_ptr<float>(), path);
  at::Tensor xt;
  if (path == kAmx) {
    xt = at::empty({(M + 15) / 16 * 16 * K}, x.options().dtype(at::kChar));
    tile_activations(xq.data_ptr<int8_t>(), M, K, (int)group, xt.data_ptr<int8_t>());
  }

  const Weights w{codes.data_ptr<uint8_t>(), static_cast<const int8_t*>(sc.data_ptr()),
                  static_cast<const int8_t*>(mc.data_ptr()), d.data_ptr(), dm.has_value() ? dm->data_ptr() : nullptr,
                  d.scalar_type() == at::kHalf, (float)zero, N, K, (int)bits, (int)group, (int)super, packed};
  const Acts a{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xs.data_ptr<float>(), M, K};
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  auto run = [&](auto* yp) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const Kernels<T> k = kernels_for<T>((int)bits, (int)group);
    const int8_t* xtp = path == kAmx ? xt.data_ptr<int8_t>() : nullptr;
    if (path == kAvx2) return parallel_guided(N / W, [&](int64_t b0, int64_t b1) { k.avx2(w, a, bp, yp, b0, b1); });
    at::parallel_for(0, N / W, 1, [&](int64_t b0, int64_t b1) {
      if (path == kAmx) k.amx(w, a, xtp, bp, yp, b0, b1);
      else if (path == kVnni) k.vnni(w, a, bp, yp, b0, b1);
      else gemm_generic(w, a, bp, yp, b0, b1);
    });
  };
  if (x.scalar_type() == at::kFloat) run(y.data_ptr<float>());
  else run(y.data_ptr<at::BFloat16>());
  return y.view(out_sizes);
}

// Read every byte of `t` once (AVX-512 loads where the CPU has them, else AVX2 ones, all threads) and return
// an XOR of it, so the reads cannot be optimized away: the memory-bandwidth probe of the benchmarks. (Plain
// byte loads read ~0.6x the bandwidth of 256-bit ones on an AVX2-only EPYC.)
SPECDEC_AVX2_FN int64_t read_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
  }
  const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  int64_t x = _mm256_extract_epi64(a, 0) ^ _mm256_extract_epi64(a, 1) ^ _mm256_extract_epi64(a, 2) ^
              _mm256_extract_epi64(a, 3);
  for (; i < n; ++i) x ^= p[i];
  return x;
}

SPECDEC_AVX512 int64_t read_avx512(const uint8_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  int64_t x = _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  for (; i < n; ++i) x ^= p[i];
  return x;
}

int64_t read_probe(const at::Tensor& t) {
  check(t.device().is_cpu() && t.is_contiguous(), "read_probe needs a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size(), chunk = 1 << 20;
  std::vector<int64_t> parts((n + chunk - 1) / chunk, 0);
  at::parallel_for(0, (int64_t)parts.size(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t len = std::min(chunk, n - c * chunk);
      if (has_vnni()) {
        parts[c] = read_avx512(p + c * chunk, len);
      } else if (has_avx2()) {
        parts[c] = read_avx2(p + c * chunk, len);
      } else {
        int64_t x = 0;
        for (int64_t i = 0; i < len; ++i) x ^= p[c * chunk + i];
        parts[c] = x;
      }
    }
  });
  int64_t x = 0;
  for (int64_t v : parts) x ^= v;
  return x;
}

// Which paths this CPU runs: bit 0 generic (always), bit 1 AVX-512 VNNI, bit 2 AMX-INT8, bit 3 AVX2.
int64_t blockq_isas() { return 1 | (has_vnni() ? 2 : 0) | (has_amx() ? 4 : 0) | (has_avx2() ? 8 : 0); }

}  // namespace

// The op namespace carries a hash of this source (-DSPECDEC_OPS=specdec_cpu_<hash>, set by
// cpu_blockq.py): graphs that torch.compile cached for an older version of these ops name another
// namespace, so they are never replayed against a changed schema.
TORCH_LIBRARY(SPECDEC_OPS, m) {
  m.def("blockq_mm(Tensor x, Tensor codes, Tensor sc, Tensor mc, Tensor d, Tensor? dm, Tensor? bias, int bits, "
        "int group, int super, float zero=0., int isa=0, int amx_min_rows=12) -> Tensor");
  m.def("blockq_isas() -> int", &blockq_isas);
  m.def("read_probe(Tensor t) -> int");
}

TORCH_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) {
  m.impl("blockq_mm", &blockq_mm);
  m.impl("read_probe", &read_probe);
}
