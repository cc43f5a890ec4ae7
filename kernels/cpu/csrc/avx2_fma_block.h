// AVX2 f32 helpers shared by f32_matmul.cc and q8_matmul.cc. FmaRows16Avx2: R <= 6 rows of x times one
// k-row of 16 weights, accumulated into R x 2 ymm (12 accumulators + 2 weight vectors + 1 broadcast
// = 15 of the 16 registers). Callers unroll their k loop around it and keep `acc` in registers
// (#pragma GCC unroll on every loop over rows: a loop over acc left rolled makes GCC keep acc in
// memory and store all of it on every k).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

// Stores the first `valid` (<= 8) lanes of v at out; none when valid <= 0 (columns past N).
__attribute__((target("avx2,fma"), always_inline)) inline void StoreFirstAvx2(float* out, __m256 v, int valid) {
  if (valid >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (valid > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(out, tmp, sizeof(float) * valid);
  }
}

template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void FmaRows16Avx2(const float* const* rows, int kk,
                                                                             const float* w16, __m256 (&acc)[R][2]) {
  const __m256 b0 = _mm256_loadu_ps(w16), b1 = _mm256_loadu_ps(w16 + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 av = _mm256_broadcast_ss(rows[r] + kk);
    acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
  }
}
#endif
