// Width-generic f32 vectors for the kernels' per-ISA paths: Vec8 (AVX2 + FMA, 8 lanes, 16 registers) and
// Vec16 (AVX-512 F, 16 lanes, 32 registers) give the same static interface, so a kernel step is written
// once as a template body and compiled once per instruction set (kernels include the body inside a
// `#pragma GCC target` region per ISA, in a namespace of its own; see ragged_paged_attention.cc). Every
// member carries its own target attribute and is always inlined, so nothing here runs on a CPU without it.
//
// Where the two sets differ in how they reach a result (exp's 2^n, horizontal sums and maxima), each
// keeps the exact instruction sequence its kernels used before this header, so each path's bits are
// unchanged: reduce_add sums the upper half onto the lower one, then 128-bit halves, then pairs.
#pragma once

#include "isa.h"

#if defined(SLIPSTREAM_X86)
#include <cstdint>
#include <cstring>

#define SLIPSTREAM_VEC8 __attribute__((target("avx2,fma"), always_inline)) static inline
#define SLIPSTREAM_VEC16 __attribute__((target("avx512f,avx2,fma"), always_inline)) static inline

namespace slipstream::runtime {

struct Vec8 {
  using F = __m256;   // f32 lanes
  using I = __m256i;  // int32 lanes
  using Mask = __m256i;  // all-ones lanes
  static constexpr int kLanes = 8;
  static constexpr int kRegs = 16;  // vector registers

  SLIPSTREAM_VEC8 F zero() { return _mm256_setzero_ps(); }
  SLIPSTREAM_VEC8 F set1(float x) { return _mm256_set1_ps(x); }
  SLIPSTREAM_VEC8 F broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  SLIPSTREAM_VEC8 F load(const float* x) { return _mm256_loadu_ps(x); }
  SLIPSTREAM_VEC8 void store(float* x, F v) { _mm256_storeu_ps(x, v); }
  // the first `valid` lanes of v at x (none when valid <= 0)
  SLIPSTREAM_VEC8 void store_first(float* x, F v, int valid) {
    if (valid >= 8) {
      _mm256_storeu_ps(x, v);
    } else if (valid > 0) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, v);
      std::memcpy(x, tmp, sizeof(float) * valid);
    }
  }
  // 8 values of a cache row, widened to f32 (exactly)
  SLIPSTREAM_VEC8 F load(const uint16_t* x) {  // bf16
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  SLIPSTREAM_VEC8 F load(const int8_t* x) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
  }
  SLIPSTREAM_VEC8 F add(F a, F b) { return _mm256_add_ps(a, b); }
  SLIPSTREAM_VEC8 F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  SLIPSTREAM_VEC8 F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  SLIPSTREAM_VEC8 F div(F a, F b) { return _mm256_div_ps(a, b); }
  SLIPSTREAM_VEC8 F max(F a, F b) { return _mm256_max_ps(a, b); }
  SLIPSTREAM_VEC8 F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  SLIPSTREAM_VEC8 F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c

  // Masks: lanes below n (none for n <= 0; maskload reads nothing past them)
  SLIPSTREAM_VEC8 Mask first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota(0)); }
  // the lanes of m with lo <= k <= hi
  SLIPSTREAM_VEC8 Mask in_range(Mask m, I k, int lo, int hi) {
    return _mm256_andnot_si256(_mm256_or_si256(_mm256_cmpgt_epi32(k, _mm256_set1_epi32(hi)),
                                               _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), k)),
                               m);
  }
  SLIPSTREAM_VEC8 Mask ge(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }  // a >= b
  SLIPSTREAM_VEC8 F select(Mask m, F yes, F no) { return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(m)); }
  SLIPSTREAM_VEC8 bool any_gt(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
  SLIPSTREAM_VEC8 F load(const float* x, Mask m) { return _mm256_maskload_ps(x, m); }  // 0 outside m
  SLIPSTREAM_VEC8 I load_i32(const void* x, Mask m) { return _mm256_maskload_epi32(static_cast<const int*>(x), m); }

  // int32 lanes
  SLIPSTREAM_VEC8 I iota(int first) {  // first, first + 1, ...
    return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  }
  SLIPSTREAM_VEC8 I set1_i32(int x) { return _mm256_set1_epi32(x); }
  SLIPSTREAM_VEC8 I and_i32(I a, I b) { return _mm256_and_si256(a, b); }
  template <int S>
  SLIPSTREAM_VEC8 I shl(I a) { return _mm256_slli_epi32(a, S); }
  template <int S>
  SLIPSTREAM_VEC8 I sar(I a) { return _mm256_srai_epi32(a, S); }
  SLIPSTREAM_VEC8 F to_f32(I a) { return _mm256_cvtepi32_ps(a); }
  SLIPSTREAM_VEC8 F bits_f32(I a) { return _mm256_castsi256_ps(a); }

  // Horizontal
  SLIPSTREAM_VEC8 float reduce_add(F a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  SLIPSTREAM_VEC8 float reduce_max(F a) {
    a = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 1));
    a = _mm256_max_ps(a, _mm256_permute_ps(a, 0x4e));
    a = _mm256_max_ps(a, _mm256_permute_ps(a, 0xb1));
    return _mm256_cvtss_f32(a);
  }
  // lane i = the sum of a[i]'s lanes
  SLIPSTREAM_VEC8 F transpose_sums(const F* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  // s[i] = the sum of a[i]'s lanes, i < kLanes
  SLIPSTREAM_VEC8 void store_sums(float* s, const F* a) { store(s, transpose_sums(a)); }

  // exp(x) for x <= 0: Cody-Waite reduction n = round(x / ln 2), r = x - n ln 2 in two steps, a degree-6
  // polynomial for exp(r), times 2^n built in the exponent bits. Relative error ~1e-7; 0 below -87.3
  // (and for -inf).
  SLIPSTREAM_VEC8 F exp(F x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
};

struct Vec16 {
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static constexpr int kRegs = 32;

  SLIPSTREAM_VEC16 F zero() { return _mm512_setzero_ps(); }
  SLIPSTREAM_VEC16 F set1(float x) { return _mm512_set1_ps(x); }
  SLIPSTREAM_VEC16 F broadcast(const float* x) { return _mm512_set1_ps(*x); }
  SLIPSTREAM_VEC16 F load(const float* x) { return _mm512_loadu_ps(x); }
  SLIPSTREAM_VEC16 void store(float* x, F v) { _mm512_storeu_ps(x, v); }
  SLIPSTREAM_VEC16 void store_first(float* x, F v, int valid) {
    if (valid > 0) _mm512_mask_storeu_ps(x, first(valid), v);
  }
  SLIPSTREAM_VEC16 F load(const uint16_t* x) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  SLIPSTREAM_VEC16 F load(const int8_t* x) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
  }
  SLIPSTREAM_VEC16 F add(F a, F b) { return _mm512_add_ps(a, b); }
  SLIPSTREAM_VEC16 F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  SLIPSTREAM_VEC16 F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  SLIPSTREAM_VEC16 F div(F a, F b) { return _mm512_div_ps(a, b); }
  SLIPSTREAM_VEC16 F max(F a, F b) { return _mm512_max_ps(a, b); }
  SLIPSTREAM_VEC16 F abs(F a) { return _mm512_abs_ps(a); }
  SLIPSTREAM_VEC16 F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  SLIPSTREAM_VEC16 Mask first(int n) { return n >= 16 ? Mask(0xFFFF) : n <= 0 ? Mask(0) : Mask((1u << n) - 1); }
  SLIPSTREAM_VEC16 Mask in_range(Mask m, I k, int lo, int hi) {
    return m & _mm512_cmple_epi32_mask(k, _mm512_set1_epi32(hi)) & _mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(lo));
  }
  SLIPSTREAM_VEC16 Mask ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  SLIPSTREAM_VEC16 F select(Mask m, F yes, F no) { return _mm512_mask_mov_ps(no, m, yes); }
  SLIPSTREAM_VEC16 bool any_gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
  SLIPSTREAM_VEC16 F load(const float* x, Mask m) { return _mm512_maskz_loadu_ps(m, x); }
  SLIPSTREAM_VEC16 I load_i32(const void* x, Mask m) { return _mm512_maskz_loadu_epi32(m, x); }

  SLIPSTREAM_VEC16 I iota(int first) {
    return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(first));
  }
  SLIPSTREAM_VEC16 I set1_i32(int x) { return _mm512_set1_epi32(x); }
  SLIPSTREAM_VEC16 I and_i32(I a, I b) { return _mm512_and_si512(a, b); }
  template <int S>
  SLIPSTREAM_VEC16 I shl(I a) { return _mm512_slli_epi32(a, S); }
  template <int S>
  SLIPSTREAM_VEC16 I sar(I a) { return _mm512_srai_epi32(a, S); }
  SLIPSTREAM_VEC16 F to_f32(I a) { return _mm512_cvtepi32_ps(a); }
  SLIPSTREAM_VEC16 F bits_f32(I a) { return _mm512_castsi512_ps(a); }

  SLIPSTREAM_VEC16 float reduce_add(F a) { return _mm512_reduce_add_ps(a); }
  SLIPSTREAM_VEC16 float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  // s[i] = the sum of a[i]'s lanes, i < 16: each folded to 8 lanes (low + high half), then two 8 x 8
  // transposing reductions
  SLIPSTREAM_VEC16 void store_sums(float* s, const F* a) {
    __m256 h[16];
    for (int i = 0; i < 16; ++i)
      h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    _mm256_storeu_ps(s, Vec8::transpose_sums(h));
    _mm256_storeu_ps(s + 8, Vec8::transpose_sums(h + 8));
  }

  // exp(x) for x <= 0 as Vec8::exp, with 2^n applied by vscalef
  SLIPSTREAM_VEC16 F exp(F x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
  }
};

}  // namespace slipstream::runtime

#endif  // SLIPSTREAM_X86
