// Ragged paged attention on CPU as an XLA FFI custom call: the contract is kernels/attention.py's
// docstring (kernels/attention_native.py makes the call). One call is one layer of one step.
//
//  1. Write. The new tokens' K/V go into their pages on the calling thread (int8: quantized per token
//     and head exactly like kernels.attention.quantize_kv). A step writes at most T x KV rows, little
//     next to what it reads. Padding tokens (t >= cu_q_lens[num_seqs]) write nothing.
//  2. Attend. A query row is one (token, query head) of a sequence and KV head. Work items are
//     (sequence, KV head, block of <= 8 rows, KV range) and are claimed from an atomic counter by the
//     calling thread and N-1 helpers scheduled on XLA's intra-op pool. So the G query heads of a KV
//     head, and the tokens of a prefill chunk, share every K/V load. An item reads its sequence's pages
//     where they lie, up to 16 keys of one page at a time (a chunk), with an online softmax. When
//     there are few items (few sequences), long KV ranges are split; split items leave partial
//     softmax states (max, sum, accumulator) that the caller combines once all items are done.
//
// Cache layout (per layer): k, v [KV, num_pages, page_size, hd] f32, bf16 or int8; int8 scales
// k_scale, v_scale [KV, num_pages, page_size] f32. A page holds its rows in order, except K in f32, in bf16
// with hd even, and in int8 with hd % 4 == 0: their page bytes are [hd * width / 4][page_size][4]
// (word-major: kernels/attention.py's doc), so that word w of 16 consecutive keys is one 64-byte load: an
// int8 word is 4 columns, as vpdpbusd wants them, an f32 word one column, for broadcast FMAs, a bf16 word
// two columns, widened in registers (a shift and a mask) for the same FMAs. A chunk of keys is
// n <= 16 consecutive rows of one page. Per chunk: scores S = Q K^T (bf16 / int8 K widened to f32 once into a small buffer that every
// row then reads from L1; int8 scores times k_scale), the online-softmax step, then acc += P V
// (int8: P times v_scale). As in the reference, the int8 scales multiply scores and probabilities.
//
// Instruction sets: each chunk step (scores, softmax, P x V, widening) has a portable loop and one vector
// version written once over runtime/vec.h's width-generic type (attention_steps.h), compiled for AVX2 (8
// lanes) and AVX-512 (16 lanes) and chosen at run time from the CPU's features (runtime/isa.h); nothing is
// compiled with -march. Other architectures use the portable loops. On AVX2 and AVX-512, P x V
// reads V rows in their cache type (widened in registers, once for all rows of the item); on AVX2 the
// int8 scores read word-major K as it lies too (bytes widened in registers). With AVX-512 VNNI,
// int8 KV (head_dim 64 or 128) never widens: S = Q K^T and P V run on vpdpbusd, with q and p split into
// two int8 parts each (~16 bits kept: output errors ~1e-4, far below those of the int8 K/V themselves).
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "runtime/huge_pages.h"
#include "runtime/isa.h"
#include "runtime/module.h"
#include "runtime/parallel.h"

#if defined(SLIPSTREAM_X86)
#define RPA_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define RPA_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
#endif

#include "runtime/vec.h"

namespace ffi = xla::ffi;
namespace rt = slipstream::runtime;
using rt::Isa;

namespace {

constexpr int kMaxRows = 8;        // query rows per work item
constexpr int kChunk = 16;         // keys per online-softmax step
constexpr int kMaxHeadDim = 512;
constexpr int kMinSplitKeys = 128; // a split KV range is never shorter
constexpr int kLoadChunks = 8;     // chunks of K/V loaded ahead of their compute, as one block
constexpr int kStreamAhead = 2;    // chunks of int8 K/V prefetched ahead on a streamed run
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Calls fn<R>(args...) with R = rows (1..8) as a compile-time constant (the VNNI steps).
#define RPA_FOR_ROWS(rows, fn, ...)       \
  switch (rows) {                         \
    case 1: return fn<1>(__VA_ARGS__);    \
    case 2: return fn<2>(__VA_ARGS__);    \
    case 3: return fn<3>(__VA_ARGS__);    \
    case 4: return fn<4>(__VA_ARGS__);    \
    case 5: return fn<5>(__VA_ARGS__);    \
    case 6: return fn<6>(__VA_ARGS__);    \
    case 7: return fn<7>(__VA_ARGS__);    \
    default: return fn<8>(__VA_ARGS__);   \
  }

enum class KvType { kF32, kBF16, kI8 };

// Query rows as two int8 parts for vpdpbusd (int8 KV, head_dim 64 or 128): q ~= scale * (hi + lo / 256),
// hi = round(q / scale) with scale = max|q| / 127, lo = the rounding residual times 256 (clipped to
// +-127), so q keeps ~16 bits. The cache's K is the unsigned side (k + 128); corr_* = 128 * sum(part)
// takes the shift back out.
struct QuantRows {
  alignas(64) int8_t hi[kMaxRows * kMaxHeadDim];
  alignas(64) int8_t lo[kMaxRows * kMaxHeadDim];
  int32_t corr_hi[kMaxRows], corr_lo[kMaxRows];
  float scale[kMaxRows];
};

// ---------------------------------------------------------------------------------------------
// Chunk steps. s and p are [kMaxRows][kChunk]; q and acc are [rows][hd]; k and v are [n][hd] f32.
// ---------------------------------------------------------------------------------------------
struct ChunkSteps {
  const char* name;
  // s[r][j] = q[r] . k[j] for j < n
  void (*scores)(const float* q, int rows, int hd, const float* k, int n, float* s);
  // Online-softmax step over the chunk's keys key..key+n-1: scores are scaled by kscale (int8 K, else
  // null), lanes past n and keys outside a row's [lo, pos] are masked (only checked when edge); the row
  // max m, sum l and accumulator acc are rescaled when the max grows, and s becomes p = exp(s - m),
  // exactly 0 where masked.
  void (*softmax)(float* s, int rows, int hd, const float* kscale, int key, int n, bool edge, const int* pos,
                  const int* lo, float* m, float* l, float* acc);
  // acc[r] += sum_j p[r][j] v[j] for j < n, v in the cache's type (int8: times vscale[j]); scratch
  // holds [kChunk][hd] floats for paths that widen v first
  void (*pv)(const float* p, int rows, int hd, KvType type, const void* v, const float* vscale, int n,
             float* acc, float* scratch);
  // dst[j] = float(src[j]) for j < n rows of hd values
  void (*widen_i8)(const int8_t* src, int n, int hd, float* dst);
  void (*widen_bf16)(const uint16_t* src, int n, int hd, float* dst);
  // f32 K word-major (the page is [hd][ps]: k points at column 0 of the chunk's first key, columns ps
  // floats apart): s[r][j] = q[r] . k[:, j] for j < n, with the keys in the vector lanes
  void (*scores_f32_words)(const float* q, int rows, int hd, const float* k, int ps, int n, float* s);
  // bf16 K word-major (the page is [hd / 2][ps][2]: k points at word 0 of the chunk's first key, words ps * 2
  // values apart; a word is columns 2w, 2w + 1 of one key): as scores_f32_words, each bf16 widened exactly
  void (*scores_bf16_words)(const float* q, int rows, int hd, const uint16_t* k, int ps, int n, float* s);
  // int8 KV with head_dim 64 or 128 on VNNI (null elsewhere): scores from the raw int8 K rows and the
  // two-part query; acc += p v from the raw int8 V rows (p times vscale), with acc's columns in the
  // order of unpermute_vnni (applied once when the item ends)
  void (*quantize_q)(const float* q, int rows, int hd, QuantRows& out);  // QuantRows from scaled q
  // (K word-major: k is word 0 of the chunk's first key, words ps * 4 bytes apart)
  void (*scores_i8_words)(const QuantRows& q, int rows, int hd, const int8_t* k, int ps, int n, float* s);
  void (*pv_i8)(const float* p, int rows, int hd, const int8_t* v, const float* vscale, int n, float* acc);
  // int8 K word-major, f32 query (null where the path widens K rows first): s[r][j] = q[r] . k[:, j] for
  // j < n (before k_scale), with the keys in the vector lanes; k and ps as in scores_i8_words
  void (*scores_i8_words_f32)(const float* q, int rows, int hd, const int8_t* k, int ps, int n, float* s);
  // int8 KV writes: q[i] = x[i] quantized as kernels.attention.quantize_kv does (scale = max|x| / 127,
  // round half to even, clip to +-127); returns the scale
  float (*quantize_kv_row)(const float* x, int hd, int8_t* q);
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

// ---- portable ----
void scores_portable(const float* q, int rows, int hd, const float* k, int n, float* s) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) {
      float d = 0.f;
      for (int x = 0; x < hd; ++x) d += q[r * hd + x] * k[j * hd + x];
      s[r * kChunk + j] = d;
    }
}

void scores_f32_words_portable(const float* q, int rows, int hd, const float* k, int ps, int n, float* s) {
  for (int r = 0; r < rows; ++r) {
    float acc[kChunk] = {};
    for (int x = 0; x < hd; ++x) {
      const float qx = q[r * hd + x];
      const float* kx = k + int64_t(x) * ps;
      for (int j = 0; j < n; ++j) acc[j] += qx * kx[j];
    }
    std::copy(acc, acc + n, s + r * kChunk);
  }
}

void scores_bf16_words_portable(const float* q, int rows, int hd, const uint16_t* k, int ps, int n, float* s) {
  for (int r = 0; r < rows; ++r) {
    float acc[kChunk] = {};
    for (int x = 0; x < hd; ++x) {
      const float qx = q[r * hd + x];
      const uint16_t* kx = k + int64_t(x / 2) * ps * 2 + x % 2;
      for (int j = 0; j < n; ++j) acc[j] += qx * bf16_to_f32(kx[2 * j]);
    }
    std::copy(acc, acc + n, s + r * kChunk);
  }
}

// The bookkeeping every path shares: a row's max grows to m_new; returns the shift for its exp.
inline float raise_max(int r, float m_new, int hd, float* m, float* l, float* acc) {
  if (m_new > m[r]) {  // also the first visible key (m = -inf): acc and l are 0 then
    const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
    for (int x = 0; x < hd; ++x) acc[r * hd + x] *= corr;
    l[r] *= corr;
    m[r] = m_new;
  }
  return m[r] == kNegInf ? 0.f : m[r];  // a row with nothing visible yet keeps p = exp(-inf) = 0
}

void softmax_portable(float* s, int rows, int hd, const float* kscale, int key, int n, bool edge,
                      const int* pos, const int* lo, float* m, float* l, float* acc) {
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kChunk;
    if (kscale)
      for (int j = 0; j < n; ++j) sr[j] *= kscale[j];
    if (edge)
      for (int j = 0; j < kChunk; ++j)
        if (j >= n || key + j > pos[r] || key + j < lo[r]) sr[j] = kNegInf;
    float mx = sr[0];
    for (int j = 1; j < kChunk; ++j) mx = std::max(mx, sr[j]);
    const float shift = raise_max(r, mx, hd, m, l, acc);
    float sum = 0.f;
    for (int j = 0; j < kChunk; ++j) sum += (sr[j] = std::exp(sr[j] - shift));
    l[r] += sum;
  }
}

void pv_f32_portable(const float* p, int rows, int hd, const float* v, int n, float* acc) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) {
      const float pj = p[r * kChunk + j];
      for (int x = 0; x < hd; ++x) acc[r * hd + x] += pj * v[j * hd + x];
    }
}

void widen_i8_portable(const int8_t* src, int n, int hd, float* dst) {
  for (int j = 0; j < n * hd; ++j) dst[j] = float(src[j]);
}

void widen_bf16_portable(const uint16_t* src, int n, int hd, float* dst) {
  for (int j = 0; j < n * hd; ++j) dst[j] = bf16_to_f32(src[j]);
}

// pv for paths that widen bf16 / int8 rows into f32 first, then run their f32 loop.
template <void (*PV)(const float*, int, int, const float*, int, float*),
          void (*WidenI8)(const int8_t*, int, int, float*), void (*WidenBF16)(const uint16_t*, int, int, float*)>
void pv_widening(const float* p, int rows, int hd, KvType type, const void* v, const float* vscale, int n,
                 float* acc, float* scratch) {
  if (type == KvType::kBF16) WidenBF16(static_cast<const uint16_t*>(v), n, hd, scratch);
  if (type != KvType::kI8) return PV(p, rows, hd, type == KvType::kF32 ? static_cast<const float*>(v) : scratch, n, acc);
  float ps[kMaxRows * kChunk];  // the reference's p * v_scale
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) ps[r * kChunk + j] = p[r * kChunk + j] * vscale[j];
  WidenI8(static_cast<const int8_t*>(v), n, hd, scratch);
  PV(ps, rows, hd, scratch, n, acc);
}

// std::nearbyint for |y| < 2^22 (round half to even), without the libm call it becomes on baseline
// x86-64: adding 1.5 * 2^23 leaves no fraction bits, so the FPU rounds; subtracting it is exact.
inline float round_even(float y) {
  constexpr float kMagic = 12582912.f;
  return (y + kMagic) - kMagic;
}

float quantize_kv_row_portable(const float* x, int hd, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax * (1.0f / 127.0f);  // as XLA compiles the division by a constant
  const float safe = scale > 0.f ? scale : 1.f;
  for (int i = 0; i < hd; ++i) q[i] = int8_t(std::clamp(round_even(x[i] / safe), -127.f, 127.f));
  return scale;
}

constexpr ChunkSteps kPortable = {"portable", scores_portable, softmax_portable,
                                  pv_widening<pv_f32_portable, widen_i8_portable, widen_bf16_portable>,
                                  widen_i8_portable, widen_bf16_portable, scores_f32_words_portable,
                                  scores_bf16_words_portable, nullptr,
                                  nullptr, nullptr, nullptr, quantize_kv_row_portable};

// ---- AVX2 + FMA (8 lanes, hd % 8 == 0) and AVX-512 F (16 lanes, hd % 16 == 0): attention_steps.h, written
// once over runtime/vec.h, compiled for each. ----
#define SLIPSTREAM_PER_ISA_BODY "attention_steps.h"
#include "runtime/per_isa.h"

#if defined(SLIPSTREAM_X86)

// int8 K rows are never widened on AVX2 (word-major scores and P x V convert in registers), nor are int8 KV
// rows quantized in vectors there (the portable loop).
constexpr ChunkSteps kAvx2 = {"avx2", avx2::scores, avx2::softmax, avx2::pv, avx2::widen<int8_t>,
                              avx2::widen<uint16_t>, avx2::scores_f32_words, avx2::scores_bf16_words, nullptr,
                              nullptr, nullptr, avx2::scores_i8_words, quantize_kv_row_portable};

// quantize_kv_row_portable 16 values at a time (hd % 16 == 0), with the same IEEE division and rounding, so
// the bytes and the scale are equal. (maxps keeps its second operand where either is NaN, as std::max does.)
// A 256-token prefill writes 256 x 3 x 2 rows per layer on the calling thread before the attention items
// start: the scalar loop was ~18% of that call's CPU samples on an Intel Xeon.
RPA_AVX512 float quantize_kv_row_avx512(const float* x, int hd, int8_t* q) {
  __m512 mx = _mm512_setzero_ps();
  for (int i = 0; i < hd; i += 16) mx = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), mx);
  const float scale = _mm512_reduce_max_ps(mx) * (1.0f / 127.0f);
  const __m512 safe = _mm512_set1_ps(scale > 0.f ? scale : 1.f), lim = _mm512_set1_ps(127.f);
  for (int i = 0; i < hd; i += 16) {
    const __m512 y = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), safe),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(y, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
  return scale;
}

// int8 K on AVX-512 without VNNI is widened to rows (memcpy of its words, then widen) for the row-order scores.
constexpr ChunkSteps kAvx512 = {"avx512", avx512::scores, avx512::softmax, avx512::pv, avx512::widen<int8_t>,
                                avx512::widen<uint16_t>, avx512::scores_f32_words, avx512::scores_bf16_words,
                                nullptr, nullptr, nullptr, nullptr, quantize_kv_row_avx512};

// ---- AVX-512 VNNI, int8 KV: vpdpbusd (unsigned x signed bytes, 4 products summed per int32 lane) ----
// Scores: K is word-major in the cache (the page's bytes [hd / 4][ps][4]; k points at word 0 of the
// chunk's first key, words are ps * 4 bytes apart), so word w of the chunk's 16 keys is one masked
// 64-byte load (keys past n read as zeros; their scores are masked), shifted to unsigned (k + 128).
// One vpdpbusd per (word, row, part) then leaves the 16 keys' sums in the 16 lanes, with no horizontal
// reduction and no transpose (before the word-major layout, a 16 x 16 int32 transpose of the rows per
// chunk: ~64 shuffles shared by the G rows).
template <int R>
RPA_VNNI void scores_i8_words_rows_vnni(const QuantRows& q, int hd, const int8_t* k, int ps, int n, float* s) {
  __m512i hi[R], lo[R];
  for (int r = 0; r < R; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const __mmask16 in = __mmask16((1u << n) - 1);
  for (int x0 = 0; x0 < hd; x0 += 64) {
    __m512i t[kChunk];
    for (int w = 0; w < 16; ++w)
      t[w] = _mm512_xor_si512(_mm512_maskz_loadu_epi32(in, k + (int64_t(x0 / 4 + w) * ps) * 4), flip);
    for (int r = 0; r < R; ++r) {
      const int32_t* qh = reinterpret_cast<const int32_t*>(q.hi + r * hd + x0);
      const int32_t* ql = reinterpret_cast<const int32_t*>(q.lo + r * hd + x0);
      for (int w = 0; w < 16; ++w) {
        hi[r] = _mm512_dpbusd_epi32(hi[r], t[w], _mm512_set1_epi32(qh[w]));
        lo[r] = _mm512_dpbusd_epi32(lo[r], t[w], _mm512_set1_epi32(ql[w]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512i h = _mm512_sub_epi32(hi[r], _mm512_set1_epi32(q.corr_hi[r]));
    const __m512i l = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(q.corr_lo[r]));
    const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l));
    _mm512_storeu_ps(s + r * kChunk, _mm512_mul_ps(d, _mm512_set1_ps(q.scale[r] * (1.f / 256.f))));
  }
}

// P x V: each row's p * vscale for the chunk becomes two unsigned byte parts,
// p ~= scale * (hi + lo / 256) (hi = floor, lo = the remainder in 1/256ths, at most 255): ~16 bits.
// V rows are interleaved 4 keys at a time so that a 32-bit lane holds one column of 4 keys (vpdpbusd's
// groups): 16 keys x 64 columns become z[4 g + sub], keys 4g .. 4g+3, lane 4L + i = column
// 16 L + 4 sub + i. acc keeps that order (lane 4L + i of block sub at acc[16 sub + 4L + i]) for the
// whole item.
template <int R>
RPA_VNNI void pv_i8_rows_vnni(const float* p, int hd, const int8_t* v, const float* vscale, int n, float* acc) {
  alignas(64) int32_t ph[R][4], pl[R][4];  // bytes: 16 keys
  float scale[R];
  const __mmask16 in = __mmask16((1u << n) - 1);
  const __m512 vs = _mm512_maskz_loadu_ps(in, vscale);
  for (int r = 0; r < R; ++r) {
    const __m512 pp = _mm512_maskz_mul_ps(in, _mm512_loadu_ps(p + r * kChunk), vs);
    const float mx = _mm512_reduce_max_ps(pp);
    scale[r] = 0.f;
    if (!(mx > 1e-30f)) {  // nothing visible (or negligible) in this chunk
      _mm_store_si128(reinterpret_cast<__m128i*>(ph[r]), _mm_setzero_si128());
      _mm_store_si128(reinterpret_cast<__m128i*>(pl[r]), _mm_setzero_si128());
      continue;
    }
    const __m512 a = _mm512_min_ps(_mm512_mul_ps(pp, _mm512_set1_ps(255.f / mx)), _mm512_set1_ps(255.f));
    const __m512 h = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 l = _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(a, h), _mm512_set1_ps(256.f)),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                   _mm512_set1_ps(255.f));
    _mm_store_si128(reinterpret_cast<__m128i*>(ph[r]), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(h)));
    _mm_store_si128(reinterpret_cast<__m128i*>(pl[r]), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(l)));
    scale[r] = mx * (1.f / (255.f * 256.f));
  }
  for (int x0 = 0; x0 < hd; x0 += 64) {
    __m512i z[kChunk];
    for (int g = 0; g < 4; ++g) {
      __m512i r4[4];  // keys past n read as zeros (their p is 0)
      for (int i = 0; i < 4; ++i)
        r4[i] = 4 * g + i < n ? _mm512_loadu_si512(v + (4 * g + i) * hd + x0) : _mm512_setzero_si512();
      const __m512i lo01 = _mm512_unpacklo_epi8(r4[0], r4[1]), hi01 = _mm512_unpackhi_epi8(r4[0], r4[1]);
      const __m512i lo23 = _mm512_unpacklo_epi8(r4[2], r4[3]), hi23 = _mm512_unpackhi_epi8(r4[2], r4[3]);
      z[4 * g] = _mm512_unpacklo_epi16(lo01, lo23);      // lane 4L + i: column 16 L + i
      z[4 * g + 1] = _mm512_unpackhi_epi16(lo01, lo23);  // 16 L + 4 + i
      z[4 * g + 2] = _mm512_unpacklo_epi16(hi01, hi23);  // 16 L + 8 + i
      z[4 * g + 3] = _mm512_unpackhi_epi16(hi01, hi23);  // 16 L + 12 + i
    }
    for (int r = 0; r < R; ++r) {
      if (scale[r] == 0.f) continue;
      __m512i bh[4], bl[4];  // the row's p bytes of keys 4g .. 4g+3, in every lane
      for (int g = 0; g < 4; ++g) bh[g] = _mm512_set1_epi32(ph[r][g]), bl[g] = _mm512_set1_epi32(pl[r][g]);
      const __m512 sr = _mm512_set1_ps(scale[r]);
      for (int sub = 0; sub < 4; ++sub) {
        __m512i dh = _mm512_setzero_si512(), dl = _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g) {
          dh = _mm512_dpbusd_epi32(dh, bh[g], z[4 * g + sub]);
          dl = _mm512_dpbusd_epi32(dl, bl[g], z[4 * g + sub]);
        }
        const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);  // 256 hi + lo: < 2^28
        float* dst = acc + r * hd + x0 + 16 * sub;
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sr, _mm512_loadu_ps(dst)));
      }
    }
  }
}

// QuantRows, 16 values at a time (hd % 16 == 0), rounding to nearest even
RPA_VNNI void quantize_rows_vnni(const float* q, int rows, int hd, QuantRows& out) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 lim = _mm512_set1_ps(127.f);
  for (int r = 0; r < rows; ++r) {
    const float* qr = q + r * hd;
    __m512 mx = _mm512_setzero_ps();
    for (int x = 0; x < hd; x += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qr + x)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
    for (int x = 0; x < hd; x += 16) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr + x), inv);
      const __m512 h = _mm512_max_ps(_mm512_min_ps(_mm512_roundscale_ps(a, kNearest), lim), -lim);
      const __m512 l = _mm512_max_ps(
          _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(a, h), _mm512_set1_ps(256.f)), kNearest), lim),
          -lim);
      const __m512i hi = _mm512_cvtps_epi32(h), lo = _mm512_cvtps_epi32(l);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi + r * hd + x), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo + r * hd + x), _mm512_cvtepi32_epi8(lo));
      sum_hi = _mm512_add_epi32(sum_hi, hi);
      sum_lo = _mm512_add_epi32(sum_lo, lo);
    }
    out.corr_hi[r] = 128 * _mm512_reduce_add_epi32(sum_hi);
    out.corr_lo[r] = 128 * _mm512_reduce_add_epi32(sum_lo);
    out.scale[r] = amax / 127.f;
  }
}

RPA_VNNI void scores_i8_words_vnni(const QuantRows& q, int rows, int hd, const int8_t* k, int ps, int n, float* s) {
  RPA_FOR_ROWS(rows, scores_i8_words_rows_vnni, q, hd, k, ps, n, s);
}

RPA_VNNI void pv_i8_vnni(const float* p, int rows, int hd, const int8_t* v, const float* vscale, int n, float* acc) {
  RPA_FOR_ROWS(rows, pv_i8_rows_vnni, p, hd, v, vscale, n, acc);
}

constexpr ChunkSteps kAvx512Vnni = {"avx512_vnni", avx512::scores, avx512::softmax, avx512::pv,
                                    avx512::widen<int8_t>, avx512::widen<uint16_t>, avx512::scores_f32_words,
                                    avx512::scores_bf16_words, quantize_rows_vnni,
                                    scores_i8_words_vnni, pv_i8_vnni, nullptr, quantize_kv_row_avx512};
#endif  // SLIPSTREAM_X86

// pv_i8's column order within each 64 columns: block sub, lane 4L + i holds column 16 L + 4 sub + i.
// Swapping L and sub is its own inverse: this maps acc to natural order (and back).
void unpermute_vnni(float* acc, int rows, int hd) {
  float tmp[64];
  for (int r = 0; r < rows; ++r)
    for (int x0 = 0; x0 < hd; x0 += 64) {
      float* a = acc + r * hd + x0;
      for (int sub = 0; sub < 4; ++sub)
        for (int L = 0; L < 4; ++L)
          for (int i = 0; i < 4; ++i) tmp[16 * L + 4 * sub + i] = a[16 * sub + 4 * L + i];
      std::copy(tmp, tmp + 64, a);
    }
}

// The kernel's paths; set_isa() lowers the choice in tests. Each path needs head_dim % 16 (AVX-512) or % 8
// (AVX2): a head_dim that does not fit takes the next path down.
rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni};

const ChunkSteps& steps_for(int hd) {
  const int isa = static_cast<int>(g_isa.get());
#if defined(SLIPSTREAM_X86)
  if (isa >= 3 && hd % 16 == 0) return kAvx512Vnni;
  if (isa >= 2 && hd % 16 == 0) return kAvx512;
  if (isa >= 1 && hd % 8 == 0) return kAvx2;
#endif
  (void)isa;
  (void)hd;
  return kPortable;
}

// ---------------------------------------------------------------------------------------------
// The problem and its work items.
// ---------------------------------------------------------------------------------------------
struct Problem {
  int T, H, KV, G, hd, num_pages, ps, P, S, num_seqs;
  float sm_scale;
  int window;  // 0: none
  KvType type;
  bool k_words;  // K pages word-major, bytes [hd * width / 4][ps][4]: int8 with hd % 4 == 0, bf16 with hd
                 // even, and f32
  const float* q;  // [T, H, hd]
  float* out;      // [T, H, hd]
  void* k;         // this layer's [KV, num_pages, ps, hd]
  void* v;
  float* k_scale;  // this layer's [KV, num_pages, ps] (int8 only)
  float* v_scale;
  const int32_t* kv_lens;
  const int32_t* page_indices;  // [S, P]
  const int32_t* cu;            // [S + 1]
  bool load_runs;               // load_keys also for blocks on one run of page ids (load_ahead_mode)
  bool prefetch_next;           // load_ahead_mode 2 (x86; elsewhere as 0)

  int q_begin(int s) const { return std::clamp(cu[s], 0, T); }
  int q_end(int s) const { return std::clamp(cu[s + 1], q_begin(s), T); }
  int kv_len(int s) const { return std::clamp(kv_lens[s], 0, P * ps); }
  int page(int s, int key) const { return std::clamp(page_indices[int64_t(s) * P + key / ps], 0, num_pages - 1); }
  // Whether keys [a, b) of sequence s lie on consecutive page ids (so each KV head's K and V of them are
  // one contiguous byte range each).
  bool one_run(int s, int a, int b) const {
    const int first = page(s, a);
    for (int key = a - a % ps + ps, i = 1; key < b; key += ps, ++i)
      if (page(s, key) != first + i) return false;
    return true;
  }
  int64_t row_offset(int kh, int page, int off) const {  // element offset of a (page, slot) row
    return (int64_t(kh) * num_pages + page) * ps + off;
  }
  int width() const { return type == KvType::kF32 ? 4 : type == KvType::kBF16 ? 2 : 1; }
  // Where keys [off, off + n) of a page lie in K (v false) or V: the first byte and the length of the
  // byte range holding them (for word-major K, from word 0 of key off to the last word of key off + n - 1).
  const char* segment(bool v, int kh, int page, int off, int n, int64_t* bytes) const {
    const int64_t row0 = row_offset(kh, page, off);
    if (!v && k_words) {
      *bytes = (int64_t(hd) * width() / 4 - 1) * ps * 4 + int64_t(n) * 4;
      return static_cast<const char*>(k) + (row0 - off) * hd * width() + int64_t(off) * 4;
    }
    *bytes = int64_t(n) * hd * width();
    return static_cast<const char*>(v ? this->v : k) + row0 * hd * width();
  }
};

struct Item {
  int seq, kh, row_begin, row_end;  // rows r = token * G + g within the sequence
  int key_lo, key_hi;
  int partial;                      // -1: writes the output; else its slot in the partials
};

struct Group {  // the split items of one (sequence, KV head, row block): partials [first, first + n)
  int seq, kh, row_begin, row_end, first, n;
};

struct Partials {  // per slot: m[kMaxRows], l[kMaxRows], acc[kMaxRows][hd]
  int hd;
  std::vector<float> data;
  float* m(int slot) { return data.data() + int64_t(slot) * stride(); }
  float* l(int slot) { return m(slot) + kMaxRows; }
  float* acc(int slot) { return m(slot) + 2 * kMaxRows; }
  int64_t stride() const { return 2 * kMaxRows + int64_t(kMaxRows) * hd; }
};

// Position of a sequence's row (the key it sees last) and the first key it sees.
inline int row_pos(const Problem& p, int s, int row) {
  return p.kv_lens[s] - (p.q_end(s) - p.q_begin(s) - row / p.G);
}
inline int row_lo(const Problem& p, int pos) { return p.window > 0 ? std::max(0, pos - p.window + 1) : 0; }

void write_new_kv(const Problem& p, const ChunkSteps& isa, const float* k_new, const float* v_new) {
  const int hd = p.hd;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.q_begin(s), q1 = p.q_end(s);
    for (int t = q0; t < q1; ++t) {
      const int pos = p.kv_lens[s] - (q1 - t);
      if (pos < 0 || pos >= p.P * p.ps) continue;
      const int slot = pos / p.ps;
      const int page = p.page_indices[int64_t(s) * p.P + slot];
      if (page < 0 || page >= p.num_pages) continue;  // like the reference's dropped scatter
      for (int kh = 0; kh < p.KV; ++kh) {
        const int64_t row = p.row_offset(kh, page, pos % p.ps);
        for (int which = 0; which < 2; ++which) {
          const float* x = (which ? v_new : k_new) + (int64_t(t) * p.KV + kh) * hd;
          void* buf = which ? p.v : p.k;
          switch (p.type) {
            case KvType::kF32:
              if (!which && p.k_words) {  // word-major page: column i of this key, ps floats apart
                float* col0 = static_cast<float*>(buf) + (row - pos % p.ps) * hd + pos % p.ps;
                for (int i = 0; i < hd; ++i) col0[int64_t(i) * p.ps] = x[i];
              } else {
                std::memcpy(static_cast<float*>(buf) + row * hd, x, hd * sizeof(float));
              }
              break;
            case KvType::kBF16:
              if (!which && p.k_words) {  // word-major page: word w (columns 2w, 2w+1) of this key, ps * 2 apart
                const int off = pos % p.ps;
                uint16_t* page0 = static_cast<uint16_t*>(buf) + (row - off) * hd + off * 2;
                for (int i = 0; i < hd; ++i) page0[int64_t(i / 2) * p.ps * 2 + i % 2] = f32_to_bf16(x[i]);
              } else {
                for (int i = 0; i < hd; ++i) static_cast<uint16_t*>(buf)[row * hd + i] = f32_to_bf16(x[i]);
              }
              break;
            case KvType::kI8: {  // kernels.attention.quantize_kv
              alignas(64) int8_t qrow[kMaxHeadDim];
              const float scale = isa.quantize_kv_row(x, hd, qrow);
              int8_t* dst = static_cast<int8_t*>(buf) + row * hd;
              if (!which && p.k_words) {  // word-major page: word w of this key, ps * 4 bytes apart
                const int off = pos % p.ps;
                int8_t* page0 = static_cast<int8_t*>(buf) + (row - off) * hd + off * 4;
                for (int w = 0; w < hd / 4; ++w) std::memcpy(page0 + int64_t(w) * p.ps * 4, qrow + 4 * w, 4);
              } else {
                std::memcpy(dst, qrow, hd);
              }
              (which ? p.v_scale : p.k_scale)[row] = scale;
              break;
            }
          }
        }
      }
    }
  }
}

// Loads one byte of every 64-byte line of keys [a, b) of a sequence's K and V (and the ends of their int8
// scale rows), so that the block's chunks then compute from L1/L2. The loads are independent and the loop
// is short, so the core keeps many misses in flight; software prefetches (into L2, chunks ahead, with the
// pages touched first), mixed into the chunk steps, kept far fewer (AMD EPYC Zen 5, 32 x 384 step, random
// page order, attention_bench: bf16 21.7 -> 13.6 ms, int8 20.7 -> 11.6, f32 24.7 -> 21.4; consecutive
// pages, where the prefetches were skipped: bf16 16.7 -> 10.2, int8 14.1 -> 9.8, f32 19.3 -> 16.7; the
// same lines loaded one chunk at a time a few chunks ahead measured 15-17 ms for bf16, a whole item at
// once as blocks of 8 chunks).
//
// Blocks on one run of page ids are a plain stream per KV head, which the hardware prefetchers follow
// while the chunks compute; whether touching them first still pays depends on the core. AMD Zen 5, pages
// in order: bf16 16.7 -> 10.2 ms with the touch (above). AMD Zen 4, 32 x 384 decode step on the page
// tables of a simulated server (page_placement_bench --placements new --load-ahead all,scattered), touch
// on runs -> not: f32 22.4 -> 16.9 ms, bf16 15.8 -> 10.8, int8 10.7 -> 8.7 (the hardware streams a run
// during the compute; the touch loop stalls it); random page order there: bf16 ~20 with the touch, ~23.5
// without (every block is scattered, so both modes touch it). A 256-token prefill chunk: f32 29.6 -> 26.6.
// On Intel (Emerald Rapids, 2 cores, 32 x 384 step, random page order, avx512_vnni path, alternated in one
// run) touching each block stalls the compute for its misses; touching only an item's first block and, with
// each chunk, prefetching (into L1) the chunk one block ahead overlaps the two: int8 15.0 -> 13.4 ms (0.87-0.92x
// in five runs), bf16 19.5 -> 17.9, f32 30.3 -> 29.6. (Prefetching a whole block at once, or into L2, was
// slower for int8: 13.1 -> 20.3 ms.)
// load_ahead_mode(): 0 touches every block, 1 only blocks whose pages are not one run, 2 prefetches as above;
// the default is 1 on AMD family 19h models 10h+ (Zen 4), 0 on other AMD cores (Zen 5), 2 elsewhere (Intel);
// load_ahead() sets it (kernels/native.py passes SLIPSTREAM_KV_LOAD_AHEAD=all | scattered | prefetch).
std::atomic<int> g_load_ahead{-1};  // -1: choose on first use

int load_ahead_default() {
  const rt::CpuInfo& cpu = rt::Cpu();
  if (!cpu.amd) return 2;
  return cpu.family == 0x19 && cpu.model >= 0x10 ? 1 : 0;  // Zen 3 is family 19h models 00h-0Fh, 20h-5Fh
}

int load_ahead_mode() {
  int mode = g_load_ahead.load(std::memory_order_relaxed);
  if (mode < 0) {
    mode = load_ahead_default();
    g_load_ahead.store(mode);
  }
  return mode;
}

void load_keys(const Problem& p, int s, int kh, int a, int b) {
  unsigned sum = 0;
  for (int key = a; key < b;) {
    const int off = key % p.ps, n = std::min(p.ps - off, b - key);
    for (bool v : {false, true}) {
      int64_t bytes;
      const char* r = p.segment(v, kh, p.page(s, key), off, n, &bytes);
      for (int64_t o = 0; o < bytes; o += 64) sum += *reinterpret_cast<const volatile unsigned char*>(r + o);
      sum += *reinterpret_cast<const volatile unsigned char*>(r + bytes - 1);
    }
    if (p.type == KvType::kI8) {
      const int64_t row0 = p.row_offset(kh, p.page(s, key), off);
      const volatile unsigned char* ks = reinterpret_cast<const volatile unsigned char*>(p.k_scale + row0);
      const volatile unsigned char* vs = reinterpret_cast<const volatile unsigned char*>(p.v_scale + row0);
      sum += ks[0] + vs[0] + ks[n * 4 - 1] + vs[n * 4 - 1];
    }
    key += n;
  }
  asm volatile("" : : "r"(sum));
}

// One work item: its rows' online softmax over keys [key_lo, key_hi) of its sequence's pages, loaded
// kLoadChunks chunks at a time right before they are computed.
void attend(const Problem& p, const Item& it, const ChunkSteps& isa, Partials& partials) {
  const int hd = p.hd, s = it.seq, rows = it.row_end - it.row_begin;
  alignas(64) float q[kMaxRows * kMaxHeadDim];
  alignas(64) float acc[kMaxRows * kMaxHeadDim];
  alignas(64) float kbuf[kChunk * kMaxHeadDim];
  alignas(64) float vbuf[kChunk * kMaxHeadDim];
  alignas(64) float sc[2][kMaxRows * kChunk];  // this chunk's p and the next chunk's scores
  float m[kMaxRows], l[kMaxRows];
  int pos[kMaxRows], lo[kMaxRows];
  int min_pos = std::numeric_limits<int>::max(), max_lo = 0;
  for (int r = 0; r < rows; ++r) {
    const int row = it.row_begin + r;
    const int t = p.q_begin(s) + row / p.G, h = it.kh * p.G + row % p.G;
    const float* qr = p.q + (int64_t(t) * p.H + h) * hd;
    for (int x = 0; x < hd; ++x) q[r * hd + x] = qr[x] * p.sm_scale;
    pos[r] = row_pos(p, s, row);
    lo[r] = row_lo(p, pos[r]);
    min_pos = std::min(min_pos, pos[r]);
    max_lo = std::max(max_lo, lo[r]);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + rows * hd, 0.f);
  const bool vnni_i8 = p.type == KvType::kI8 && isa.scores_i8_words && (hd == 64 || hd == 128);
  // int8 scores from word-major K and the f32 query, where the path has them (AVX2)
  const bool words_i8 = p.type == KvType::kI8 && !vnni_i8 && p.k_words && isa.scores_i8_words_f32;
  QuantRows qq;
  if (vnni_i8) isa.quantize_q(q, rows, hd, qq);

  // int8 K/V on a run the hardware streams (not touched): the K and V lines of the chunk kStreamAhead
  // chunks ahead are prefetched into L2 as well (int8 is compute-bound here, so the stream falls behind
  // less; AMD Zen 4, 32 x 384 step, pages in order: 8.8-9.1 -> 7.8-8.7 ms; the same for f32 and bf16 was
  // slower: f32 18-19 -> 22-25 ms with L1 hints, bf16 no gain).
  bool streamed = false;  // the current block is on one run and was not touched
  auto load_block = [&](int key) {
#if defined(SLIPSTREAM_X86)
    if (p.prefetch_next) {  // load_ahead_mode 2: the first block touched, then the chunk one block ahead prefetched
      if (key == it.key_lo) load_keys(p, s, it.kh, key, std::min(it.key_hi, key + kLoadChunks * kChunk));
      const int next = key + kLoadChunks * kChunk;
      if (next < it.key_hi) {
        const int off = next % p.ps, n = std::min({kChunk, p.ps - off, it.key_hi - next});
        for (bool v : {false, true}) {
          int64_t bytes;
          const char* r = p.segment(v, it.kh, p.page(s, next), off, n, &bytes);
          for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
          _mm_prefetch(r + bytes - 1, _MM_HINT_T0);
        }
        if (p.type == KvType::kI8) {
          const int64_t row0 = p.row_offset(it.kh, p.page(s, next), off);
          _mm_prefetch(reinterpret_cast<const char*>(p.k_scale + row0), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p.v_scale + row0), _MM_HINT_T0);
        }
      }
      return;
    }
#endif
    if ((key - it.key_lo) % (kLoadChunks * kChunk) == 0) {
      const int end = std::min(it.key_hi, key + kLoadChunks * kChunk);
      streamed = !p.load_runs && p.one_run(s, key, end);
      if (!streamed) load_keys(p, s, it.kh, key, end);
    }
#if defined(SLIPSTREAM_X86)
    const int ahead = key + kStreamAhead * kChunk;
    if (streamed && p.type == KvType::kI8 && ahead < it.key_hi) {
      const int off = ahead % p.ps, n = std::min({kChunk, p.ps - off, it.key_hi - ahead});
      for (bool v : {false, true}) {
        int64_t bytes;
        const char* r = p.segment(v, it.kh, p.page(s, ahead), off, n, &bytes);
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
      }
    }
#endif
  };
  struct Chunk {
    int key, off, n;
    int64_t row0;  // element offset of its first (page, slot) row
  };
  auto chunk_at = [&](int key) {
    const int off = key % p.ps;
    return Chunk{key, off, std::min({kChunk, p.ps - off, it.key_hi - key}), p.row_offset(it.kh, p.page(s, key), off)};
  };
  const int width = p.type == KvType::kF32 ? 4 : p.type == KvType::kBF16 ? 2 : 1;
  auto scores = [&](const Chunk& c, float* out) {
    const int64_t row0 = c.row0;
    const int off = c.off, n = c.n;
    switch (p.type) {
      case KvType::kF32:  // word-major: scores_f32_words reads it as it lies
        break;
      case KvType::kBF16:  // word-major (hd even): scores_bf16_words reads it as it lies
        if (!p.k_words) isa.widen_bf16(static_cast<const uint16_t*>(p.k) + row0 * hd, n, hd, kbuf);
        break;
      case KvType::kI8:
        if (vnni_i8 || words_i8) break;
        if (p.k_words) {  // rows in order first, then widened
          alignas(64) int8_t rows_i8[kChunk * kMaxHeadDim];
          const int8_t* w0 = static_cast<const int8_t*>(p.k) + (row0 - off) * hd + off * 4;
          for (int w = 0; w < hd / 4; ++w)  // a 4-byte word at a time
            for (int j = 0; j < n; ++j) std::memcpy(rows_i8 + j * hd + 4 * w, w0 + (int64_t(w) * p.ps + j) * 4, 4);
          isa.widen_i8(rows_i8, n, hd, kbuf);
        } else {
          isa.widen_i8(static_cast<const int8_t*>(p.k) + row0 * hd, n, hd, kbuf);
        }
    }
    if (vnni_i8)  // hd 64 or 128: K is word-major
      isa.scores_i8_words(qq, rows, hd, static_cast<const int8_t*>(p.k) + (row0 - off) * hd + off * 4, p.ps, n, out);
    else if (words_i8)
      isa.scores_i8_words_f32(q, rows, hd, static_cast<const int8_t*>(p.k) + (row0 - off) * hd + off * 4, p.ps, n, out);
    else if (p.type == KvType::kF32)
      isa.scores_f32_words(q, rows, hd, static_cast<const float*>(p.k) + (row0 - off) * hd + off, p.ps, n, out);
    else if (p.type == KvType::kBF16 && p.k_words)
      isa.scores_bf16_words(q, rows, hd, static_cast<const uint16_t*>(p.k) + (row0 - off) * hd + off * 2, p.ps, n,
                            out);
    else
      isa.scores(q, rows, hd, kbuf, n, out);
  };
  auto softmax = [&](const Chunk& c, float* sc) {
    const bool edge = c.n < kChunk || c.key + c.n - 1 > min_pos || c.key < max_lo;
    isa.softmax(sc, rows, hd, p.type == KvType::kI8 ? p.k_scale + c.row0 : nullptr, c.key, c.n, edge, pos, lo, m, l,
                acc);
  };
  auto pv = [&](const Chunk& c, const float* sc) {
    const void* vc = static_cast<const char*>(p.v) + c.row0 * hd * width;
    if (vnni_i8)
      isa.pv_i8(sc, rows, hd, static_cast<const int8_t*>(vc), p.v_scale + c.row0, c.n, acc);
    else
      isa.pv(sc, rows, hd, p.type, vc, p.type == KvType::kI8 ? p.v_scale + c.row0 : nullptr, c.n, acc, vbuf);
  };
  // Software-pipelined by one chunk: the next chunk's scores come right before this chunk's P x V, so
  // the core overlaps the two (they are independent; one chunk's steps are too many instructions for the
  // out-of-order window to reach the next chunk's on its own). The next chunk's softmax comes after this
  // chunk's P x V, as a max it raises rescales acc.
  if (it.key_lo < it.key_hi) {
    Chunk cur = chunk_at(it.key_lo);
    int b = 0;
    load_block(cur.key);
    scores(cur, sc[0]);
    softmax(cur, sc[0]);
    for (;;) {
      const bool more = cur.key + cur.n < it.key_hi;
      Chunk nxt{};
      if (more) {
        nxt = chunk_at(cur.key + cur.n);
        load_block(nxt.key);
        scores(nxt, sc[b ^ 1]);
      }
      pv(cur, sc[b]);
      if (!more) break;
      softmax(nxt, sc[b ^ 1]);
      cur = nxt;
      b ^= 1;
    }
  }
  if (vnni_i8) unpermute_vnni(acc, rows, hd);

  if (it.partial >= 0) {
    std::copy(m, m + rows, partials.m(it.partial));
    std::copy(l, l + rows, partials.l(it.partial));
    std::copy(acc, acc + rows * hd, partials.acc(it.partial));
    return;
  }
  for (int r = 0; r < rows; ++r) {
    const int row = it.row_begin + r;
    const int t = p.q_begin(s) + row / p.G, h = it.kh * p.G + row % p.G;
    float* o = p.out + (int64_t(t) * p.H + h) * hd;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int x = 0; x < hd; ++x) o[x] = acc[r * hd + x] * inv;
  }
}

void combine(const Problem& p, const Group& g, Partials& partials) {
  const int hd = p.hd;
  for (int r = 0; r < g.row_end - g.row_begin; ++r) {
    float mx = kNegInf;
    for (int i = 0; i < g.n; ++i) mx = std::max(mx, partials.m(g.first + i)[r]);
    const int row = g.row_begin + r;
    const int t = p.q_begin(g.seq) + row / p.G, h = g.kh * p.G + row % p.G;
    float* o = p.out + (int64_t(t) * p.H + h) * hd;
    std::fill(o, o + hd, 0.f);
    if (mx == kNegInf) continue;
    float l = 0.f;
    for (int i = 0; i < g.n; ++i) {
      const int slot = g.first + i;
      const float mi = partials.m(slot)[r];
      if (mi == kNegInf) continue;
      const float w = std::exp(mi - mx);
      l += w * partials.l(slot)[r];
      const float* a = partials.acc(slot) + r * hd;
      for (int x = 0; x < hd; ++x) o[x] += w * a[x];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int x = 0; x < hd; ++x) o[x] *= inv;
  }
}

// Items: (sequence, KV head, row block), each split into KV ranges of >= kMinSplitKeys keys when there
// are fewer than 4 items per thread.
void plan(const Problem& p, int threads, std::vector<Item>& items, std::vector<Group>& groups) {
  std::vector<Item> base;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int rows = (p.q_end(s) - p.q_begin(s)) * p.G;
    for (int kh = 0; kh < p.KV; ++kh)
      for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int r1 = std::min(rows, r0 + kMaxRows);
        const int hi = std::min(row_pos(p, s, r1 - 1) + 1, p.kv_len(s));
        const int lo = row_lo(p, row_pos(p, s, r0));
        base.push_back({s, kh, r0, r1, lo, std::max(lo, hi), -1});
      }
  }
  const int64_t want = 4 * int64_t(threads);
  const int64_t per_item = base.empty() ? 1 : (want + int64_t(base.size()) - 1) / int64_t(base.size());
  int slots = 0;
  for (const Item& b : base) {
    const int len = b.key_hi - b.key_lo;
    const int n = int(std::max<int64_t>(1, std::min<int64_t>(per_item, len / kMinSplitKeys)));
    if (n == 1) {
      items.push_back(b);
      continue;
    }
    groups.push_back({b.seq, b.kh, b.row_begin, b.row_end, slots, n});
    const int step = ((len + n - 1) / n + kChunk - 1) / kChunk * kChunk;
    for (int i = 0; i < n; ++i) {
      Item part = b;
      part.key_lo = std::min(b.key_hi, b.key_lo + i * step);
      part.key_hi = std::min(b.key_hi, b.key_lo + (i + 1) * step);
      part.partial = slots++;
      items.push_back(part);
    }
  }
}

// The KV cache on 2 MiB pages. XLA's buffers come from malloc on 4 KiB pages (64 bytes past a page start,
// so a 4 KiB page segment of f32 K spans two of them), and a step reads its sequences' pages in no
// particular order: on 4 KiB pages each segment is its own TLB entry and its own physical run. The first
// time a cache buffer is seen, its 2 MiB-aligned part is madvise(MADV_HUGEPAGE)d (future faults, and
// khugepaged) and MADV_COLLAPSE'd (Linux >= 6.1: now, synchronously, ~0.1 s per GB; elsewhere that call
// fails and the buffer stays as it was). Buffers under 2 MiB are left alone; the memory was touched
// already, so RSS does not change. huge_pages(False) turns it off (kernels/native.py, for SLIPSTREAM_KV_HUGE_PAGES=0). (AMD Zen 4, 32 x 384 step,
// random page order: f32 page_size 64 36.1 -> 33.4 ms, 128 35.1 -> 31.0, consecutive pages of 16
// 49.6 -> 26.4; page_size 16 random and int8 KV: no clear change.)
std::atomic<int> g_huge_pages{1};           // 0 off; 1 on
std::atomic<int64_t> g_huge_bytes{0};       // bytes madvised so far (MADV_HUGEPAGE accepted)
std::atomic<int64_t> g_collapsed_bytes{0};  // of those, bytes MADV_COLLAPSE accepted
std::atomic<int64_t> g_collapse_ns{0};      // time spent in those madvise calls

bool huge_pages_on() { return g_huge_pages.load(std::memory_order_relaxed) == 1; }

void advise_huge_pages(const void* buf, size_t bytes) {
  const rt::HugeRange r = rt::HugeAligned(buf, bytes);
  if (!r.bytes() || !huge_pages_on()) return;
  // The buffers advised lately, by exact range: a new buffer that reuses part of a freed one's addresses is
  // a new mapping (malloc unmaps large blocks), so it is advised again. Only a new buffer of the very same
  // range as one of these goes unnoticed (the engine allocates its cache once).
  static std::mutex mu;
  static std::vector<std::pair<uintptr_t, uintptr_t>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(done.begin(), done.end(), std::make_pair(r.lo, r.hi)) != done.end()) return;
  if (done.size() >= 16) done.erase(done.begin());
  done.emplace_back(r.lo, r.hi);
  const auto t0 = std::chrono::steady_clock::now();
  if (rt::AdviseHugePages(r)) {
    g_huge_bytes.fetch_add(int64_t(r.bytes()));
    if (rt::CollapseHugePages(r)) g_collapsed_bytes.fetch_add(int64_t(r.bytes()));
  }
  g_collapse_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

ffi::Error run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
               ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in,
               const ffi::AnyBuffer* ks_in, const ffi::AnyBuffer* vs_in, ffi::Buffer<ffi::S32> layer,
               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
               ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
               int32_t sliding_window, ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::AnyBuffer k_out,
               ffi::AnyBuffer v_out, ffi::AnyBuffer* ks_out, ffi::AnyBuffer* vs_out) {
  const auto qd = q.dimensions(), kd = k_in.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: q [T,H,hd], k [L,KV,pages,ps,hd], "
                                       "page_indices [S,P] expected");
  Problem p{};
  p.T = int(qd[0]), p.H = int(qd[1]), p.hd = int(qd[2]);
  const int L = int(kd[0]);
  p.KV = int(kd[1]), p.num_pages = int(kd[2]), p.ps = int(kd[3]);
  p.S = int(pd[0]), p.P = int(pd[1]);
  if (kd[4] != p.hd || p.KV <= 0 || p.H % p.KV != 0 || p.hd > kMaxHeadDim || p.num_pages <= 0 || p.ps <= 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: head_dim must match and be <= 512, H a "
                                       "multiple of KV heads");
  if (kv_lens.element_count() < size_t(p.S) || cu_q_lens.element_count() < size_t(p.S) + 1)
    return ffi::Error::InvalidArgument("ragged_paged_attention: kv_lens [S] and cu_q_lens [S+1] expected");
  p.G = p.H / p.KV;
  p.num_seqs = std::clamp(num_seqs.typed_data()[0], 0, p.S);
  p.sm_scale = sm_scale;
  p.window = std::max(0, int(sliding_window));
  p.load_runs = load_ahead_mode() != 1;
  p.prefetch_next = load_ahead_mode() == 2;
  const auto dtype = k_in.element_type();
  p.type = dtype == ffi::DataType::F32 ? KvType::kF32 : dtype == ffi::DataType::BF16 ? KvType::kBF16 : KvType::kI8;
  p.k_words = (p.type == KvType::kI8 && p.hd % 4 == 0) || (p.type == KvType::kBF16 && p.hd % 2 == 0) ||
              p.type == KvType::kF32;
  if ((p.type == KvType::kI8) != (ks_in != nullptr) || (dtype != ffi::DataType::F32 &&
      dtype != ffi::DataType::BF16 && dtype != ffi::DataType::S8))
    return ffi::Error::InvalidArgument("ragged_paged_attention: KV cache must be f32, bf16, or int8 with scales");

  // The cache outputs alias the inputs; should XLA ever hand distinct buffers, start from a copy.
  const ffi::AnyBuffer* ins[] = {&k_in, &v_in, ks_in, vs_in};
  ffi::AnyBuffer* outs[] = {&k_out, &v_out, ks_out, vs_out};
  for (int i = 0; i < 4; ++i)
    if (ins[i] && outs[i]->untyped_data() != ins[i]->untyped_data())
      std::memcpy(outs[i]->untyped_data(), ins[i]->untyped_data(), ins[i]->size_bytes());
  for (int i = 0; i < 4; ++i)
    if (outs[i]) advise_huge_pages(outs[i]->untyped_data(), outs[i]->size_bytes());

  const int l = std::clamp(layer.typed_data()[0], 0, L - 1);
  const int64_t plane = int64_t(p.KV) * p.num_pages * p.ps;  // rows per layer
  const size_t width = ffi::ByteWidth(dtype);
  p.k = static_cast<char*>(k_out.untyped_data()) + l * plane * p.hd * width;
  p.v = static_cast<char*>(v_out.untyped_data()) + l * plane * p.hd * width;
  if (ks_out) {
    p.k_scale = static_cast<float*>(ks_out->untyped_data()) + l * plane;
    p.v_scale = static_cast<float*>(vs_out->untyped_data()) + l * plane;
  }
  p.q = q.typed_data();
  p.out = out->typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu = cu_q_lens.typed_data();

  const ChunkSteps& isa = steps_for(p.hd);
  write_new_kv(p, isa, k_new.typed_data(), v_new.typed_data());

  // Padding tokens get zeros; every real token's rows are written by an item or a combine.
  const int valid_end = p.num_seqs > 0 ? p.q_end(p.num_seqs - 1) : 0;
  std::fill(p.out + int64_t(valid_end) * p.H * p.hd, p.out + int64_t(p.T) * p.H * p.hd, 0.f);

  const int threads = int(std::max<int64_t>(1, pool.num_threads()));
  std::vector<Item> items;
  std::vector<Group> groups;
  plan(p, threads, items, groups);
  Partials partials{p.hd, {}};
  int slots = 0;
  for (const Group& g : groups) slots += g.n;
  partials.data.resize(size_t(slots) * partials.stride());
  rt::ParallelFor(pool, int64_t(items.size()), 0, [&](int64_t i) { attend(p, items[i], isa, partials); });
  for (const Group& g : groups) combine(p, g, partials);
  return ffi::Error::Success();
}

ffi::Error run_float(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                     ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                     ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                     int32_t sliding_window, ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::AnyBuffer> k_out,
                     ffi::Result<ffi::AnyBuffer> v_out) {
  return run(pool, q, k_new, v_new, k, v, nullptr, nullptr, layer, kv_lens, page_indices, cu_q_lens, num_seqs,
             sm_scale, sliding_window, out, *k_out, *v_out, nullptr, nullptr);
}

ffi::Error run_int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                    ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_scale,
                    ffi::AnyBuffer v_scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                    ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int32_t sliding_window,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::AnyBuffer> k_out,
                    ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> ks_out,
                    ffi::Result<ffi::AnyBuffer> vs_out) {
  if (k_scale.element_type() != ffi::DataType::F32 || v_scale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: int8 KV scales must be f32");
  return run(pool, q, k_new, v_new, k, v, &k_scale, &v_scale, layer, kv_lens, page_indices, cu_q_lens,
             num_seqs, sm_scale, sliding_window, out, *k_out, *v_out, &*ks_out, &*vs_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionFloat, run_float,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new [T, KV, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::AnyBuffer>()         // k [L, KV, pages, ps, hd] f32 | bf16
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")  // 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>()     // out [T, H, hd]
                                  .Ret<ffi::AnyBuffer>()            // k (aliases the k operand)
                                  .Ret<ffi::AnyBuffer>());          // v

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionInt8, run_int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::AnyBuffer>()         // k int8
                                  .Arg<ffi::AnyBuffer>()         // v int8
                                  .Arg<ffi::AnyBuffer>()         // k_scale [L, KV, pages, ps] f32
                                  .Arg<ffi::AnyBuffer>()         // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// ---------------------------------------------------------------------------------------------
// Python module: targets(), isa(), set_isa() (runtime/module.h), huge_pages() and load_ahead().
// ---------------------------------------------------------------------------------------------
namespace {

PyObject* huge_pages(PyObject*, PyObject* args) {
  int enable = -1;
  if (!PyArg_ParseTuple(args, "|p", &enable)) return nullptr;
  if (enable >= 0) g_huge_pages.store(enable);
  return Py_BuildValue("{s:O,s:L,s:L,s:d}", "enabled", huge_pages_on() ? Py_True : Py_False, "advised_bytes",
                       (long long)g_huge_bytes.load(), "collapsed_bytes", (long long)g_collapsed_bytes.load(),
                       "seconds", g_collapse_ns.load() * 1e-9);
}

const char* const kLoadAheadNames[] = {"all", "scattered", "prefetch"};

PyObject* load_ahead(PyObject*, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "|s", &name)) return nullptr;
  if (name) {
    const std::string n(name);
    if (n != "all" && n != "scattered" && n != "prefetch" && n != "default") {
      PyErr_SetString(PyExc_ValueError, "load_ahead: one of 'all', 'scattered', 'prefetch', 'default'");
      return nullptr;
    }
    g_load_ahead.store(n == "all" ? 0 : n == "scattered" ? 1 : n == "prefetch" ? 2 : load_ahead_default());
  }
  return PyUnicode_FromString(kLoadAheadNames[load_ahead_mode()]);
}

}  // namespace

PyMODINIT_FUNC PyInit__ragged_paged_attention() {
  static rt::ModuleSpec spec{
      "_ragged_paged_attention", "Ragged paged attention, native CPU kernel (XLA FFI)",
      {{"slipstream_ragged_paged_attention", reinterpret_cast<void*>(RaggedPagedAttentionFloat)},
       {"slipstream_ragged_paged_attention_int8", reinterpret_cast<void*>(RaggedPagedAttentionInt8)}},
      &g_isa,
      {{"load_ahead", load_ahead, METH_VARARGS,
        "load_ahead([mode]) -> mode: which blocks of K/V an item loads right before computing them: 'all', "
        "'scattered' (not those on one run of page ids, which the hardware prefetchers stream), or 'prefetch' "
        "(only its first; each chunk prefetches the one a block ahead); 'default' is this CPU's choice "
        "(SLIPSTREAM_KV_LOAD_AHEAD sets the first)"},
       {"huge_pages", huge_pages, METH_VARARGS,
        "huge_pages([enable]) -> {enabled, advised_bytes, collapsed_bytes, seconds}: KV cache buffers on 2 MiB "
        "pages (madvise MADV_HUGEPAGE + MADV_COLLAPSE the first time the kernel sees each)"}}};
  return rt::CreateModule(spec);
}
