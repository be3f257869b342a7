// Float32 or bfloat16 values loaded as float32 vectors (bfloat16 widened exactly: its bits moved to the
// high half), for the kernels built under target attributes (cpu_blockq.cpp, cpu_argmax.cpp). T is
// float or a 16-bit bfloat16 type.
#pragma once

#include <immintrin.h>

#include <type_traits>

namespace specdec_widen {

// 16 values from p
template <typename T>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    static_assert(sizeof(T) == 2, "float or bfloat16");
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 8 values from p
template <typename T>
__attribute__((target("avx2"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    static_assert(sizeof(T) == 2, "float or bfloat16");
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

}  // namespace specdec_widen
