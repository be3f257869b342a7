// The row-invariant attention kernel (cpu_attention_rows.h) built for AVX-512 and for AVX2, each
// with FMA; cpu_attention.cpp picks one by the CPU's features (or its own portable build).
// Every header the kernel uses is included before the target pragmas, so no library code (a
// template such as std::vector) is compiled for an ISA the CPU may lack.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define SPECDEC_ATTN_NS attn_avx512
#define SPECDEC_ATTN_AVX512
#include "cpu_attention_rows.h"
#undef SPECDEC_ATTN_AVX512
#undef SPECDEC_ATTN_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SPECDEC_ATTN_NS attn_avx2
#define SPECDEC_ATTN_AVX2
#include "cpu_attention_rows.h"
#undef SPECDEC_ATTN_AVX2
#undef SPECDEC_ATTN_NS
#pragma GCC pop_options

void specdec_convert_kv_avx512(const AttnProblem& p, float* kt, float* vf, int64_t u0, int64_t u1) {
  attn_avx512::convert_kv(p, kt, vf, u0, u1);
}

void specdec_attention_rows_avx512(const AttnProblem& p, const float* kt, const float* vf, int64_t w0, int64_t w1) {
  attn_avx512::attention_rows_items(p, kt, vf, w0, w1);
}

void specdec_convert_kv_avx2(const AttnProblem& p, float* kt, float* vf, int64_t u0, int64_t u1) {
  attn_avx2::convert_kv(p, kt, vf, u0, u1);
}

void specdec_attention_rows_avx2(const AttnProblem& p, const float* kt, const float* vf, int64_t w0, int64_t w1) {
  attn_avx2::attention_rows_items(p, kt, vf, w0, w1);
}
