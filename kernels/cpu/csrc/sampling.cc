// Token sampling on CPU as an XLA FFI custom call: the contract is kernels/sampling.py's docstring
// (`reference` there is the same computation in JAX). One call samples one token per row of
// logits [B, V], rows split across XLA's intra-op pool (the calling thread takes rows too):
//
//  - greedy rows (temperature <= 0): the first index of the row max;
//  - other rows: x = (logits - max) / T, e = exp(x); the kept tokens are x >= the k-th largest x
//    (top-k, ties kept), then x >= the largest value v whose tokens x >= v hold top_p of the top-k
//    mass (top-p, ties kept), then e >= min_p (min-p: p >= min_p * p_max); then the inverse-CDF
//    draw in token order: the first kept token whose running mass exceeds u * the kept mass.
//
// Both cut-offs are exact order statistics, found by a radix select over the floats' ordered bit
// patterns (no sort): a 2048-bucket histogram of the top 11 bits (weighted by 1 for top-k, by e for
// top-p) picks the bucket that holds the cut-off, whose members are then refined 11 and 10 bits
// at a time. XLA:CPU's lax.top_k of 128 candidates alone took 3.9 ms at 32 x 49152, and the
// reference's fall-back bisection 32 full passes (top_p 0.9 over flat rows: 47 ms per step).
//
// Only the candidates are searched: the k-th largest of the 16-token blocks' maxima bounds the k-th
// largest token from below (and, for top-p, the first block maximum at which the maxima's own mass
// reaches the target), so the selects and the draw run over the tokens above that bound, compacted
// in token order; a draw with no cut-off goes by sums of 16-token blocks.
//
// Instruction sets: the row passes (max, exp, block maxima and sums, compaction) are written once over a
// vector type (sampling_rows.h), compiled for AVX-512 and for AVX2 and chosen at run time (runtime/isa.h)
// beside portable loops; nothing is
// compiled with -march. Sums are in double (the reference's in f32), so a draw whose u lies within
// rounding of a token boundary may pick the neighbouring token.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "runtime/isa.h"
#include "runtime/module.h"
#include "runtime/parallel.h"

#include "runtime/vec.h"

namespace ffi = xla::ffi;
namespace rt = slipstream::runtime;
using rt::Isa;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// uint32 keys that sort like the floats (the radix-sort trick); NaN never reaches them.
inline uint32_t ordered_key(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b >> 31) ? ~b : (b | 0x80000000u);
}

inline float key_to_float(uint32_t k) {
  const uint32_t b = (k >> 31) ? (k & 0x7FFFFFFFu) : ~k;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// ---- row passes: AVX-512 or AVX2 where the CPU has them (chosen at run time), else portable loops ----

struct RowMax {
  float max;
  bool nan;
};

RowMax row_max_portable(const float* l, int v) {
  RowMax r{kNegInf, false};
  for (int i = 0; i < v; ++i) {
    r.nan |= l[i] != l[i];
    r.max = l[i] > r.max ? l[i] : r.max;
  }
  return r;
}

int first_equal_portable(const float* l, int v, float m) {
  for (int i = 0; i < v; ++i)
    if (l[i] == m) return i;
  return 0;
}

// x = (l - m) / t and e = exp(x); returns the sum of e
double exp_shifted_portable(const float* l, int v, float m, float t, float* x, float* e) {
  double sum = 0.0;
  for (int i = 0; i < v; ++i) {
    x[i] = (l[i] - m) / t;
    e[i] = std::exp(x[i]);
    sum += e[i];
  }
  return sum;
}

// the max of each block of 16 (the last block: of what it holds)
void block_max_portable(const float* x, int v, float* out) {
  for (int b = 0; b * 16 < v; ++b) {
    float m = kNegInf;
    for (int i = b * 16; i < std::min(v, b * 16 + 16); ++i) m = std::max(m, x[i]);
    out[b] = m;
  }
}

// indices i (ascending) with x[i] >= tau; idx holds v + 16 entries
int compact_portable(const float* x, int v, float tau, int32_t* idx) {
  int n = 0;
  for (int i = 0; i < v; ++i)
    if (x[i] >= tau) idx[n++] = i;
  return n;
}

// the sum of each block of 16 of the kept e (e >= min_p)
void block_sum_portable(const float* e, int v, float min_p, double* out) {
  for (int b = 0; b * 16 < v; ++b) {
    double sum = 0.0;
    for (int i = b * 16; i < std::min(v, b * 16 + 16); ++i)
      if (e[i] >= min_p) sum += e[i];
    out[b] = sum;
  }
}

struct RowOps {
  RowMax (*row_max)(const float*, int);
  int (*first_equal)(const float*, int, float);
  double (*exp_shifted)(const float*, int, float, float, float*, float*);
  void (*block_max)(const float*, int, float*);
  int (*compact)(const float*, int, float, int32_t*);
  void (*block_sum)(const float*, int, float, double*);
};

#if defined(SLIPSTREAM_X86)
// The vector types of sampling_rows.h, one per ISA: runtime/vec.h's, plus the passes' own operations; each
// compiled under its own target pragma.
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
struct V : rt::Vec16 {
  static constexpr int W = kLanes;
  using M = __mmask16;
  using D = __m512d;  // 8 double lanes
  static M none() { return 0; }
  static M unordered(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static M either(M a, M b) { return a | b; }
  static bool any(M m) { return m != 0; }
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static unsigned equal_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static D zero_d() { return _mm512_setzero_pd(); }
  static void add_halves_d(F e, D& s0, D& s1) {
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  static double reduce_d(D s0, D s1) { return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1)); }
  static float max16(const float* x) { return _mm512_reduce_max_ps(_mm512_loadu_ps(x)); }
  // the tokens i.. i + 15 with x >= tau, appended to idx (which has 16 entries of slack): compressed in a
  // register, then one full store; the compress-to-memory form is microcoded on AMD Zen 4 (this pass took
  // 11% of a flat top-p row's samples with it)
  static int compact(const float* x, F tv, int i, int32_t* idx, int n) {
    const __mmask16 ge = _mm512_cmp_ps_mask(_mm512_loadu_ps(x), tv, _CMP_GE_OQ);
    if (!ge) return n;
    const __m512i iota = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(i));
    _mm512_storeu_si512(idx + n, _mm512_maskz_compress_epi32(ge, iota));
    return n + __builtin_popcount(ge);
  }
  static float sum_kept(__mmask16 in, const float* e, float min_p) {
    const __m512 a = _mm512_maskz_loadu_ps(in, e);
    return _mm512_reduce_add_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(min_p), _CMP_GE_OQ), a));
  }
  static double sum16_kept(const float* e, float min_p) { return sum_kept(0xFFFF, e, min_p); }
  static void tail_block_sum(const float* e, int n, float min_p, double* out) {
    *out = sum_kept(__mmask16((1u << n) - 1), e, min_p);
  }
};
#include "sampling_rows.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct V : rt::Vec8 {
  static constexpr int W = kLanes;
  using M = __m256;   // compare results, all-ones lanes
  using D = __m256d;  // 4 double lanes
  static M none() { return _mm256_setzero_ps(); }
  static M unordered(F a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static M either(M a, M b) { return _mm256_or_ps(a, b); }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static float reduce_max(F a) {  // not Vec8::reduce_max, whose max chain may keep a NaN lane
    alignas(32) float m[8];
    _mm256_store_ps(m, a);
    float r = kNegInf;
    for (float x : m) r = std::max(r, x);  // NaN lanes fall out, as in the portable loop
    return r;
  }
  static unsigned equal_bits(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static D zero_d() { return _mm256_setzero_pd(); }
  static void add_halves_d(F e, D& s0, D& s1) {
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  static double reduce_d(D s0, D s1) {
    alignas(32) double d[4];
    _mm256_store_pd(d, _mm256_add_pd(s0, s1));
    return d[0] + d[1] + d[2] + d[3];
  }
  static float max16(const float* x) {
    const __m256 m = _mm256_max_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  static int compact(const float* x, F tv, int i, int32_t* idx, int n) {
    for (int ge = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), tv, _CMP_GE_OQ)); ge; ge &= ge - 1)
      idx[n++] = i + __builtin_ctz(ge);
    return n;
  }
  static double sum16_kept(const float* e, float min_p) {
    const __m256 mp = _mm256_set1_ps(min_p);
    const __m256 a = _mm256_loadu_ps(e), c = _mm256_loadu_ps(e + 8);
    const __m256 s = _mm256_add_ps(_mm256_and_ps(a, _mm256_cmp_ps(a, mp, _CMP_GE_OQ)),
                                   _mm256_and_ps(c, _mm256_cmp_ps(c, mp, _CMP_GE_OQ)));
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  static void tail_block_sum(const float* e, int n, float min_p, double* out) { block_sum_portable(e, n, min_p, out); }
};
#include "sampling_rows.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx2, Isa::kAvx512};


const RowOps& row_ops() {
  static const RowOps portable = {row_max_portable, first_equal_portable, exp_shifted_portable,
                                  block_max_portable, compact_portable, block_sum_portable};
#if defined(SLIPSTREAM_X86)
  // the tables are built here, in code for any x86 CPU (a function compiled for AVX-512 would not run on others)
  static const RowOps avx2 = {avx2::row_max, avx2::first_equal, avx2::exp_shifted,
                              avx2::block_max, avx2::compact, avx2::block_sum};
  static const RowOps avx512 = {avx512::row_max, avx512::first_equal, avx512::exp_shifted,
                                avx512::block_max, avx512::compact, avx512::block_sum};
  switch (g_isa.get()) {
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    default: break;
  }
#endif
  return portable;
}

struct Scratch {
  std::vector<float> x, e, bmax, top;
  std::vector<double> bsum;
  std::vector<int32_t> idx, sub;
  std::vector<uint32_t> keys;  // a bucket's members, refined
  std::vector<double> wts, parts;
};

// hist[b] = the weight of the items whose bucket(j) is b, in 4 interleaved partial histograms (on rows
// whose tokens fall in few buckets, one histogram's adds wait on each other through memory)
template <class Bucket, class Weight>
void histogram(int n, int buckets, Bucket bucket, Weight weight, std::vector<double>& parts, double* hist) {
  parts.assign(4 * size_t(buckets), 0.0);
  double* h = parts.data();
  int j = 0;
  for (; j + 4 <= n; j += 4)
    for (int q = 0; q < 4; ++q) h[q * buckets + bucket(j + q)] += weight(j + q);
  for (; j < n; ++j) h[bucket(j)] += weight(j);
  for (int b = 0; b < buckets; ++b) hist[b] = h[b] + h[buckets + b] + h[2 * buckets + b] + h[3 * buckets + b];
}

// The largest key t among the tokens idx[0..n) (tokens 0..n-1 when idx is null) such that the weight
// of those with key >= t reaches `need`: weight 1 per token (t = the need-th largest key) or e. A
// radix select in three levels (bits 21-31, 10-20, 0-9 of the key); `need` is at most the tokens'
// total weight.
uint32_t select_key(const float* x, const float* e, const int32_t* idx, int n, double need, bool by_mass,
                    Scratch& s) {
  constexpr int kShifts[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
  double hist[2048];
  auto token = [idx](int j) { return idx ? idx[j] : j; };
  histogram(
      n, 2048, [&](int j) { return ordered_key(x[token(j)]) >> 21; },
      [&](int j) { return by_mass ? double(e[token(j)]) : 1.0; }, s.parts, hist);
  s.keys.clear();
  s.wts.clear();
  double above = 0.0;  // weight of the keys above the current bucket
  uint32_t prefix = 0;
  for (int level = 0; level < 3; ++level) {
    const int buckets = 1 << kBits[level];
    if (level > 0) {
      const uint32_t mask = (1u << kBits[level]) - 1;
      const int shift = kShifts[level];
      histogram(
          int(s.keys.size()), buckets, [&](int j) { return (s.keys[j] >> shift) & mask; },
          [&](int j) { return s.wts[j]; }, s.parts, hist);
    }
    int b = buckets - 1;
    for (; b > 0; --b) {
      if (hist[b] > 0.0 && above + hist[b] >= need) break;  // the first non-empty bucket that reaches it
      above += hist[b];
    }
    prefix |= uint32_t(b) << kShifts[level];
    if (level == 0) {  // the chosen bucket's members
      for (int j = 0; j < n; ++j) {
        const uint32_t k = ordered_key(x[token(j)]);
        if ((k >> 21) == uint32_t(b)) s.keys.push_back(k), s.wts.push_back(by_mass ? double(e[token(j)]) : 1.0);
      }
    } else if (level == 1) {  // those that share the prefix so far
      size_t m = 0;
      for (size_t j = 0; j < s.keys.size(); ++j)
        if ((s.keys[j] >> 10) == (prefix >> 10)) s.keys[m] = s.keys[j], s.wts[m] = s.wts[j], ++m;
      s.keys.resize(m);
      s.wts.resize(m);
    }
  }
  return prefix;
}

// A lower bound on the value whose tokens (x >= it) reach `need` of weight (1 or e per token):
// going down the block maxima, each is a distinct token, so the first maximum at which the maxima
// alone reach `need` bounds the answer from below. -inf when that needs most blocks.
float block_bound(const float* bmax, int nb, double need, bool by_mass, Scratch& s) {
  for (int c : {64, 512}) {
    if (c >= nb) break;
    s.top.assign(bmax, bmax + nb);
    std::nth_element(s.top.begin(), s.top.begin() + c, s.top.end(), std::greater<float>());
    std::sort(s.top.begin(), s.top.begin() + c, std::greater<float>());
    double w = 0.0;
    for (int j = 0; j < c; ++j) {
      w += by_mass ? std::exp(double(s.top[j])) * (1.0 - 1e-6) : 1.0;  // below the kernel's e: a safe bound
      if (w >= need) return s.top[j];
    }
  }
  return kNegInf;
}

int sample_row(const float* l, int v, float t, int top_k, float top_p, float min_p, float u, Scratch& s) {
  const RowOps& ops = row_ops();
  const RowMax rm = ops.row_max(l, v);
  if (rm.nan || rm.max == kNegInf) return 0;
  if (!(t > 0.f)) return ops.first_equal(l, v, rm.max);
  s.x.resize(v);
  s.e.resize(v);
  float* x = s.x.data();
  float* e = s.e.data();
  const double total_all = ops.exp_shifted(l, v, rm.max, t, x, e);
  const int k = (top_k <= 0 || top_k >= v) ? v : top_k;
  const int nb = (v + 15) / 16;
  float cutoff = kNegInf;
  // idx[0..n): ascending token ids that hold every kept token (all of them when n == v)
  s.idx.resize(v + 16);  // compact() may write 16 past its count
  int32_t* idx = s.idx.data();
  int n = v;
  bool all = true;
  if (k < v || top_p < 1.f) {
    s.bmax.resize(nb);
    ops.block_max(x, v, s.bmax.data());
  }
  auto restrict_to = [&](float tau) {
    if (!(tau > kNegInf)) return;
    if (all) {
      n = ops.compact(x, v, tau, idx);
      all = false;
    } else {
      int m = 0;
      for (int j = 0; j < n; ++j)
        if (x[idx[j]] >= tau) idx[m++] = idx[j];
      n = m;
    }
  };
  const int32_t* list = nullptr;  // what select_key reads: null while `all`
  if (k < v) {
    restrict_to(block_bound(s.bmax.data(), nb, double(k), false, s));
    list = all ? nullptr : idx;
    cutoff = key_to_float(select_key(x, e, list, n, double(k), false, s));
    restrict_to(cutoff);
  }
  if (top_p < 1.f) {
    double mass = 0.0;
    if (all) {
      mass = total_all;
    } else {
      for (int j = 0; j < n; ++j) mass += e[idx[j]];
    }
    const double need = double(top_p) * mass;
    if (all) restrict_to(block_bound(s.bmax.data(), nb, need, true, s));
    list = all ? nullptr : idx;
    cutoff = std::max(cutoff, key_to_float(select_key(x, e, list, n, need, true, s)));
    restrict_to(cutoff);
  }
  // the draw: the first kept token whose running mass exceeds u * the kept mass
  int last = -1;  // the last kept token seen (the list's draw falls back to it)
  if (all) {  // no cut-off: blocks of 16 first, then the tokens of one block
    s.bsum.resize(nb);
    ops.block_sum(e, v, min_p, s.bsum.data());
    double total = 0.0;
    for (int b = 0; b < nb; ++b) total += s.bsum[b];
    const double target = double(u) * total;
    double cum = 0.0;
    for (int b = 0; b < nb; ++b) {
      if (cum + s.bsum[b] <= target) {
        cum += s.bsum[b];
        continue;
      }
      for (int i = b * 16; i < std::min(v, b * 16 + 16); ++i) {
        if (!(e[i] >= min_p && e[i] > 0.f)) continue;
        cum += e[i];
        if (cum > target) return i;
      }
    }
    for (int i = v - 1; i >= 0; --i)  // rounding left u * total past the end: the last kept token
      if (e[i] >= min_p && e[i] > 0.f) return i;
  } else {
    double total = 0.0;
    for (int j = 0; j < n; ++j)
      if (e[idx[j]] >= min_p) total += e[idx[j]];
    const double target = double(u) * total;
    double cum = 0.0;
    for (int j = 0; j < n; ++j) {
      const int i = idx[j];
      if (!(e[i] >= min_p && e[i] > 0.f)) continue;
      cum += e[i];
      last = i;
      if (cum > target) return i;
    }
  }
  return last >= 0 ? last : ops.first_equal(l, v, rm.max);
}

// The model's logprobs of a row: the sampled token's, and the n_top largest (ties: lower id first,
// as lax.top_k orders them) with their ids; n_top <= 16 * blocks uses the block maxima's bound.
void logprobs_row(const float* l, int v, int token, int n_top, float* chosen, int32_t* ids, float* vals,
                  Scratch& s) {
  const RowOps& ops = row_ops();
  const RowMax rm = ops.row_max(l, v);
  s.x.resize(v);
  s.e.resize(v);
  const double log_z = double(rm.max) + std::log(ops.exp_shifted(l, v, rm.max, 1.f, s.x.data(), s.e.data()));
  *chosen = float(double(l[std::min(std::max(token, 0), v - 1)]) - log_z);
  const int nb = (v + 15) / 16;
  s.bmax.resize(nb);
  ops.block_max(l, v, s.bmax.data());
  s.idx.resize(v + 16);  // compact() may write 16 past its count
  int32_t* idx = s.idx.data();
  const int n = ops.compact(l, v, block_bound(s.bmax.data(), nb, double(n_top), false, s), idx);
  const int m = std::min(n, n_top);
  std::partial_sort(idx, idx + m, idx + n, [l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  for (int j = 0; j < n_top; ++j) {
    ids[j] = j < m ? idx[j] : 0;
    vals[j] = j < m ? float(double(l[idx[j]]) - log_z) : kNegInf;
  }
}

// Rows split across the calling thread and XLA's pool (runtime/parallel.h), one Scratch per thread.
template <class F>
void for_rows(ffi::ThreadPool& pool, int rows, F fn) {
  rt::ParallelFor(pool, rows, 0, [&fn](int64_t r) {
    thread_local Scratch s;
    fn(int(r), s);
  });
}

ffi::Error SampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                      ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                      ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::S32> token) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2) return ffi::Error::InvalidArgument("sample_tokens: logits must be [B, V]");
  const int64_t b = ld[0], v = ld[1];
  for (int64_t n : {temperature.element_count(), top_k.element_count(), top_p.element_count(),
                    min_p.element_count(), u.element_count(), token->element_count()})
    if (n != b) return ffi::Error::InvalidArgument("sample_tokens: every per-row input and the output must be [B]");
  if (b == 0) return ffi::Error::Success();
  if (v <= 0 || v > std::numeric_limits<int>::max())
    return ffi::Error::InvalidArgument("sample_tokens: vocab size out of range");
  const float *l = logits.typed_data(), *t = temperature.typed_data(), *p = top_p.typed_data(),
              *mp = min_p.typed_data(), *uu = u.typed_data();
  const int32_t* k = top_k.typed_data();
  int32_t* out = token->typed_data();
  const int vocab = int(v);
  for_rows(pool, int(b), [=](int r, Scratch& s) {
    out[r] = sample_row(l + int64_t(r) * vocab, vocab, t[r], k[r], p[r], mp[r], uu[r], s);
  });
  return ffi::Error::Success();
}

ffi::Error LogprobsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> token,
                        ffi::ResultBuffer<ffi::F32> chosen, ffi::ResultBuffer<ffi::S32> top_ids,
                        ffi::ResultBuffer<ffi::F32> top_vals) {
  const auto ld = logits.dimensions(), td = top_ids->dimensions();
  if (ld.size() != 2 || td.size() != 2 || top_vals->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("top_logprobs: logits [B, V], top ids and values [B, N]");
  const int64_t b = ld[0], v = ld[1], n_top = td[1];
  if (int64_t(token.element_count()) != b || int64_t(chosen->element_count()) != b || td[0] != b ||
      int64_t(top_vals->element_count()) != b * n_top)
    return ffi::Error::InvalidArgument("top_logprobs: token and chosen [B], top ids and values [B, N]");
  if (b == 0) return ffi::Error::Success();
  if (v <= 0 || v > std::numeric_limits<int>::max() || n_top > v)
    return ffi::Error::InvalidArgument("top_logprobs: vocab size out of range, or N above it");
  const float* l = logits.typed_data();
  const int32_t* tok = token.typed_data();
  float *c = chosen->typed_data(), *tv = top_vals->typed_data();
  int32_t* ti = top_ids->typed_data();
  const int vocab = int(v), n = int(n_top);
  for_rows(pool, int(b), [=](int r, Scratch& s) {
    logprobs_row(l + int64_t(r) * vocab, vocab, tok[r], n, c + r, ti + int64_t(r) * n, tv + int64_t(r) * n, s);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamSampleTokens, SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // min_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [B], in [0, 1)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // token [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamTopLogprobs, LogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // the token's logprob [B]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top ids [B, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // top logprobs [B, N]

PyMODINIT_FUNC PyInit__sampling() {
  static rt::ModuleSpec spec{
      "_sampling", "Token sampling (greedy, temperature, top-k/top-p/min-p) for XLA:CPU through the FFI.",
      {{"slipstream_sample_tokens", reinterpret_cast<void*>(SlipstreamSampleTokens)},
       {"slipstream_top_logprobs", reinterpret_cast<void*>(SlipstreamTopLogprobs)}},
      &g_isa,
      {}};
  return rt::CreateModule(spec);
}
