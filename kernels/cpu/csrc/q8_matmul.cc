// Group-wise int8 matmul (llama.cpp's Q8_0 layout) as an XLA FFI custom call on CPU.
//
//   y[m, n] = sum_g sum_p f32(sum_{k in g} xq_p[m, k] * w[n, k]) * (xs_p[m, g] * ws[n, g])
//           + sum_g wo[n, g] * sum_{k in g} x[m, k]                          (only with offsets)
//
// w: int8 weights with one f16 scale ws (and optionally one f16 offset wo) per 32 input channels
// per output column, prepacked at load (kernels/q8_matmul.py, pack()) as
//   packed   u8  [Np/16][Kp/4][16][4]   w + 128, so 16 columns x 4 inputs fill one 64-byte vector
//   scales   f16 [Np/16][Kp/32][16]
//   offsets  f16 [Np/16][Kp/32][16]     or empty (the weight is q * scale, as in Q8_0)
// (Np, Kp: N and K rounded up to 16 and 32; padding is zero weight, zero scale, zero offset).
// Weights whose values all lie in 0..15 (GGUF's Q4_1 and Q4_K blocks, Q4_0's with its -8 as an
// offset) may be packed at 4 bits (bits = 4), two 64-byte vectors of the layout above in one:
//   packed   u8  [Np/16][Kp/8][64]      byte b = vector 2i's byte b - 128 | (vector 2i+1's - 128) << 4
// which the kernel widens back to w + 128 in registers ((nibble) | 128): the same products from
// half the bytes, so the one-row (decode) call, which streams its weights, reads 20 bytes per group
// and column instead of 36.
// The offsets hold GGUF's asymmetric blocks (Q4_1: d * q + m) exactly; GGUF stores d and m in f16
// as well, so its blocks load bit for bit. f16 rather than f32 scales and offsets: a group of one
// column is 36 bytes (Q8_0's 34 with its offset), not 40, of the one-row call's weight stream.
// x is quantized here, per row and group of 32, as llama.cpp's quantize_row_q8_0 does:
// xs = max|x| / 127, xq = round-to-nearest-even(x / xs) in [-127, 127]. With parts = 2 the rounding
// residual is quantized again (scale xs / 254) as a second int8 row, so x is held to ~15 bits for
// twice the multiply work: p runs over the parts.
//
// vpdpbusd multiplies unsigned by signed bytes. The weights are the unsigned side (w + 128), the
// activations the signed side, so the shift costs 128 * sum_{k in g} xq[m, k] per row and group:
// the int32 accumulator starts at minus that, and no per-column correction has to be read.
//
// Work split: items are (chunk of 96 columns (64 on AMD, see kShape), block of up to 64 rows),
// column-chunk major so that a chunk's weights come from memory once and serve every row block
// from cache (the LM head's 28 MB does not stay in L3 across row blocks). Items are claimed from an
// atomic counter by the calling thread and by helpers scheduled on XLA's intra-op pool (a helper
// that starts late finds no work and returns). The items that touch a row block first quantize its
// rows, kQuantRows rows per claim, so threads starting on the same block share that work; an item
// waits only for rows another thread is quantizing (it is running, so the wait is short). Within an
// item the weight panel of C tiles (C*16 columns x Kp) stays in L1/L2 while R-row micro blocks
// stream past.
//
// With two parts the AVX-512 micro kernel sums each input row's pair exactly in int32 per group
// (254 * acc0 + acc1, scale xs / 254), so the float work per group is one row's, not two.
// One-row micro blocks prefetch each weight tile's stream (and its scales) ahead, by CPU (kShape). The
// quantized activations live in a per-calling-thread buffer kept between calls, and large outputs
// are advised to use transparent huge pages (fewer first-touch page faults).
//
// Gated input (gated = 1, a gated MLP's down projection): x is [M, 2K], the gate/up projection's
// output gate | up, and the input row is silu(gate) * up, formed per row right before it is
// quantized (GatedRow), so XLA never writes the [M, K] product (its slice-multiply fusion of the
// gate/up output was 4% of a 1052-token step).
//
// Instruction sets, chosen at run time: AMX (two-part calls of kInt8MinRows..kInt8MaxRows rows, 8- or 4-bit weights,
// on the INT8 tile unit, bit for bit the VNNI path's outputs, see TileInt8, a last row tile of 1-3 input rows after
// whole ones on VNNI, see Int8Tail; two-part calls of more rows with 4-bit weights on the BF16 tile unit with the
// same integers, see TileQ4Bf16; with SLIPSTREAM_AMX_BF16=1, two-part calls of at least kAmxMinRows rows whose
// weights come with their bf16 tiles, prepacked at load, on the BF16 tile unit, see TileBf16; the rest, one-row
// (decode) calls among them, as on AVX-512 VNNI, see RouteCall), AVX-512 VNNI, AVX2 (maddubs with the sign trick),
// portable.
#include <Python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "runtime/huge_pages.h"
#include "runtime/isa.h"
#include "runtime/module.h"
#include "runtime/parallel.h"
#include "runtime/vec.h"

namespace ffi = xla::ffi;
namespace rt = slipstream::runtime;
using rt::Isa;

namespace {

constexpr int kGroup = 32;      // inputs per scale (Q8_0 block)
constexpr int kTile = 16;       // columns per packed tile
constexpr int kRowBlock = 64;   // rows per work item
constexpr int kQuantRows = 4;   // rows per activation-quantization claim (a row block holds 16)

rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx2, Isa::kAvx512Vnni, Isa::kAmx};

// Quantized activations: `parts` int8 rows per input row (act row m * parts + p), Kp bytes each,
// and per act row and group its scale, the accumulator's starting value -128 * sum(xq), and the
// float sum of x (part 0; 0 for part 1) that the weight offsets multiply.
struct Acts {
  int kp = 0, groups = 0, parts = 1;
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  std::vector<int32_t> bias;
  std::vector<uint16_t> hi, lo;  // the tile unit's two-part path: x as bf16 hi + lo, [rows][Kp] each
  void ResizeBf16(int rows) {
    hi.resize(static_cast<size_t>(rows) * kp);
    lo.resize(static_cast<size_t>(rows) * kp);
  }
  void Resize(int rows) {
    const size_t act_rows = static_cast<size_t>(rows) * parts;
    q.resize(act_rows * kp);
    scale.resize(act_rows * groups);
    sum.resize(act_rows * groups);
    bias.resize(act_rows * groups);
  }
};

// Shapes of one call. Tiles of 16 columns; tile t's weights start at w + t * tile_bytes.
struct Problem {
  const float* x;
  int m, k;        // the input is [m, k]: x itself, or silu(gate) * up of x [m, 2k] when gated
  bool gated = false;
  const uint8_t* w;
  const uint16_t* ws;  // f16 scales
  const uint16_t* wo;  // f16 offsets, or nullptr
  const uint16_t* wt = nullptr;  // the weights split into bf16 hi + lo B tiles (see TileBf16), or nullptr
  int n, kp, groups, tiles, parts;
  int bits = 8;  // 8, or 4: two weights per byte (see the top of the file)
  float* y;  // [m, n]
  // one-row prefetch distances in bytes of each tile's stream: near into L1, far (0: none) into L2
  int pf_near = 1024, pf_far = 0;
  bool pf_nta = false;
  int stream_rows = 1;  // micro blocks of up to this many output rows (at most kMaxStreamRows) prefetch as above
  size_t tile_bytes() const { return static_cast<size_t>(kp) * kTile * bits / 8; }
  size_t tile_scales() const { return static_cast<size_t>(groups) * kTile; }
  size_t tile_bf16() const { return static_cast<size_t>(groups) * 2 * kTile * kGroup; }  // uint16s per tile of wt
};

constexpr int kMaxStreamRows = 3;  // the most output rows a prefetching micro block may have (Problem::stream_rows)

// IEEE half -> float, for the portable path (the vector paths convert with vcvtph2ps).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value man * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- activation quantization: per row and group of 32 -----------------------------------------
// All paths compute d = amax / 127, id = 1 / d (0 for an all-zero group), q = round-half-even(x * id),
// in f32 with the same operations, so they agree bit for bit with each other and with the reference.
// The second part quantizes r = x - q * d with d2 = d / 254 the same way (|r| <= d / 2); r is
// computed with one fused multiply-add on every path (as XLA computes the reference), because
// r * (1 / d2) lands on a rounding tie often enough that a second rounding of r changes the result.

struct GroupOut {  // where one group of one input row goes
  int8_t* q[2];
  float* scale[2];
  float* sum[2];
  int32_t* bias[2];
};

GroupOut Slot(Acts& a, int row, int g) {
  GroupOut o;
  for (int part = 0; part < 2; ++part) {
    const size_t ar = static_cast<size_t>(row) * a.parts + std::min(part, a.parts - 1);
    o.q[part] = a.q.data() + ar * a.kp + g * kGroup;
    o.scale[part] = &a.scale[ar * a.groups + g];
    o.sum[part] = &a.sum[ar * a.groups + g];
    o.bias[part] = &a.bias[ar * a.groups + g];
  }
  return o;
}

// v: 32 values (zero-padded past K).
// always_inline: inside QuantizeRowAvx2 std::fma becomes one instruction instead of a libm call.
__attribute__((always_inline)) inline void QuantizeGroupPortable(const float* v, int parts, const GroupOut& o) {
  float amax = 0.f, sum = 0.f;
  for (int i = 0; i < kGroup; ++i) {
    amax = std::max(amax, std::fabs(v[i]));
    sum += v[i];
  }
  float r[kGroup];
  float d = amax / 127.f;
  for (int part = 0; part < parts; ++part) {
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t total = 0;
    for (int i = 0; i < kGroup; ++i) {
      const float x = part == 0 ? v[i] : r[i];
      float q = std::nearbyint(x * id);  // default rounding: nearest even
      q = std::min(127.f, std::max(-127.f, q));
      o.q[part][i] = static_cast<int8_t>(q);
      total += static_cast<int32_t>(q);
      if (part == 0) r[i] = std::fma(-q, d, v[i]);  // fused, as every path computes it
    }
    *o.scale[part] = d;
    *o.bias[part] = -128 * total;
    *o.sum[part] = part == 0 ? sum : 0.f;
    d = d / 254.f;
  }
}

__attribute__((always_inline)) inline void QuantizeRowPortable(const float* x, int k, Acts& a, int row) {
  for (int g = 0; g < a.groups; ++g) {
    float v[kGroup] = {};
    const int base = g * kGroup, n = std::min(kGroup, k - base);
    std::memcpy(v, x + base, sizeof(float) * n);
    QuantizeGroupPortable(v, a.parts, Slot(a, row, g));
  }
}

#if defined(SLIPSTREAM_X86)

// Sixteen groups at a time: each group's 16-lane vector (its max |x|, its sums) is reduced by a
// transpose tree, two vectors into one holding both at half the lanes, to one vector of the 16
// groups' values: 15 vector ops and 30 shuffles against 16 horizontal reductions of 8 ops each
// (perf of a 288-row matmul with K = 1536 and 576 columns, Intel Xeon: the quantizer fell from 19% of
// the kernel's samples to 12.5%). Lane e of the tree's result holds group 4 * (e % 4) + e / 4:
// TreeOrder() undoes that.
// Op: MaxPs, AddPs or AddEpi32 on the float bits (the shuffles move 32-bit lanes whatever they hold).
struct MaxPs {
  __attribute__((target("avx512f"))) __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddPs {
  __attribute__((target("avx512f"))) __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct AddEpi32 {
  __attribute__((target("avx512f"))) __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};

template <typename Op>
__attribute__((target("avx512f"), always_inline)) inline __m512 TreeReduce16(const __m512 (&v)[16], Op op) {
  __m512 quad[4];
  // across 128-bit lanes: ab holds a in lanes 0-1 and b in 2-3; quad[j] holds group 4j + L in lane L
  for (int j = 0; j < 4; ++j) {
    const __m512 a = v[4 * j], b = v[4 * j + 1], c = v[4 * j + 2], e = v[4 * j + 3];
    const __m512 ab = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 ce = op(_mm512_shuffle_f32x4(c, e, 0x44), _mm512_shuffle_f32x4(c, e, 0xEE));
    quad[j] = op(_mm512_shuffle_f32x4(ab, ce, 0x88), _mm512_shuffle_f32x4(ab, ce, 0xDD));
  }
  // inside each 128-bit lane L: two quads' group 4j + L, two values each, then one value each
  const __m512 t0 = op(_mm512_shuffle_ps(quad[0], quad[1], 0x44), _mm512_shuffle_ps(quad[0], quad[1], 0xEE));
  const __m512 t1 = op(_mm512_shuffle_ps(quad[2], quad[3], 0x44), _mm512_shuffle_ps(quad[2], quad[3], 0xEE));
  return op(_mm512_shuffle_ps(t0, t1, 0x88), _mm512_shuffle_ps(t0, t1, 0xDD));
}

__attribute__((target("avx512f"))) inline __m512i TreeOrder() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// Groups g0 .. g0 + count - 1 (count <= 16) of one part: q = round(v * id) clamped to +-127 into
// q_out (32 bytes per group), with the residual v - q * d into resid when it is not null. Returns
// the 16 groups' sums of q in group order (0 past count).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i QuantGroups16(
    const float* v, int n, int count, __m512 d, __m512 id, int8_t* q_out, float* resid) {
  const __m512i lo_clamp = _mm512_set1_epi32(-127), hi_clamp = _mm512_set1_epi32(127);
  __m512 sums[16];
  for (int g = 0; g < 16; ++g) {
    if (g >= count) {
      sums[g] = _mm512_setzero_ps();
      continue;
    }
    const int n0 = std::max(0, std::min(16, n - g * kGroup)), n1 = std::max(0, std::min(16, n - g * kGroup - 16));
    const __m512 v0 = _mm512_maskz_loadu_ps(__mmask16((1u << n0) - 1), v + g * kGroup);
    const __m512 v1 = _mm512_maskz_loadu_ps(__mmask16((1u << n1) - 1), v + g * kGroup + 16);
    const __m512i sel = _mm512_set1_epi32(g);
    const __m512 ig = _mm512_permutexvar_ps(sel, id);
    // cvtps rounds with MXCSR's mode: nearest even unless someone changed it (as nearbyint would follow)
    const __m512i q0 =
        _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, ig)), lo_clamp), hi_clamp);
    const __m512i q1 =
        _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, ig)), lo_clamp), hi_clamp);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q_out + g * kGroup), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q_out + g * kGroup + 16), _mm512_cvtepi32_epi8(q1));
    sums[g] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
    if (resid) {
      const __m512 dg = _mm512_permutexvar_ps(sel, d);
      _mm512_storeu_ps(resid + g * kGroup, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q0), dg, v0));
      _mm512_storeu_ps(resid + g * kGroup + 16, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q1), dg, v1));
    }
  }
  return _mm512_permutexvar_epi32(TreeOrder(), _mm512_castps_si512(TreeReduce16(sums, AddEpi32())));
}

__attribute__((target("avx512f,avx512bw")))
void QuantizeRowAvx512(const float* x, int k, Acts& a, int row) {
  alignas(64) float resid[16 * kGroup];
  for (int g0 = 0; g0 < a.groups; g0 += 16) {
    const int count = std::min(16, a.groups - g0), n = k - g0 * kGroup;
    const float* v = x + g0 * kGroup;
    __m512 amax[16], sum[16];
    for (int g = 0; g < 16; ++g) {
      const int n0 = std::max(0, std::min(16, n - g * kGroup)), n1 = std::max(0, std::min(16, n - g * kGroup - 16));
      const __m512 v0 = _mm512_maskz_loadu_ps(__mmask16((1u << n0) - 1), v + g * kGroup);
      const __m512 v1 = _mm512_maskz_loadu_ps(__mmask16((1u << n1) - 1), v + g * kGroup + 16);
      amax[g] = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
      sum[g] = _mm512_add_ps(v0, v1);
    }
    const __m512i order = TreeOrder();
    const __m512 am = _mm512_permutexvar_ps(order, TreeReduce16(amax, MaxPs()));
    const __m512 fs = _mm512_permutexvar_ps(order, TreeReduce16(sum, AddPs()));
    const __mmask16 valid = __mmask16((1u << count) - 1);
    __m512 d = _mm512_div_ps(am, _mm512_set1_ps(127.f));
    for (int part = 0; part < a.parts; ++part) {
      const size_t ar = static_cast<size_t>(row) * a.parts + part;
      const __mmask16 nonzero = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
      const __m512 id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.f), d);
      int8_t* q = a.q.data() + ar * a.kp + g0 * kGroup;
      const __m512i qsum = part == 0 ? QuantGroups16(v, n, count, d, id, q, a.parts == 2 ? resid : nullptr)
                                     : QuantGroups16(resid, 16 * kGroup, count, d, id, q, nullptr);
      const size_t at = ar * a.groups + g0;
      _mm512_mask_storeu_ps(&a.scale[at], valid, d);
      _mm512_mask_storeu_epi32(&a.bias[at], valid, _mm512_mullo_epi32(qsum, _mm512_set1_epi32(-128)));
      _mm512_mask_storeu_ps(&a.sum[at], valid, part == 0 ? fs : _mm512_setzero_ps());
      d = _mm512_div_ps(d, _mm512_set1_ps(254.f));
    }
  }
}

__attribute__((target("avx2,fma")))
void QuantizeRowAvx2(const float* x, int k, Acts& a, int row) {
  if (a.parts != 1) return QuantizeRowPortable(x, k, a, row);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i lo_clamp = _mm256_set1_epi32(-127), hi_clamp = _mm256_set1_epi32(127);
  for (int g = 0; g < a.groups; ++g) {
    const GroupOut o = Slot(a, row, g);
    const int base = g * kGroup;
    if (base + kGroup > k) {  // the ragged last group: the portable loop on a zero-padded copy
      float v[kGroup] = {};
      std::memcpy(v, x + base, sizeof(float) * (k - base));
      QuantizeGroupPortable(v, 1, o);
      continue;
    }
    __m256 v[4];
    __m256 m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + base + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      s = _mm256_add_ps(s, v[i]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    const float d = _mm_cvtss_f32(m4) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i qi[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), lo_clamp), hi_clamp);
      sum = _mm256_add_epi32(sum, qi[i]);
    }
    // int32 -> int8 keeping order: the packs work per 128-bit lane, the permute undoes that
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q[0]), p8);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    *o.scale[0] = d;
    *o.bias[0] = -128 * _mm_cvtsi128_si32(t4);
    *o.sum[0] = _mm_cvtss_f32(s4);
  }
}

#endif  // SLIPSTREAM_X86

// ---- gated input: out[i] = silu(g[i]) * u[i], g = gu[0 .. k), u = gu[k .. 2k) --------------------
// silu(g) = g * sigmoid(g) as jax.nn.silu computes it; sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e)
// for g >= 0, e / (1 + e) below.

void GatedRowPortable(const float* gu, int k, float* out) {
  for (int i = 0; i < k; ++i) {
    const float g = gu[i], e = std::exp(-std::fabs(g));
    out[i] = g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * gu[k + i];
  }
}

#if defined(SLIPSTREAM_X86)
__attribute__((target("avx512f,avx2,fma")))
void GatedRowAvx512(const float* gu, int k, float* out) {
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gu + i), u = _mm512_maskz_loadu_ps(m, gu + k + i);
    const __m512 e = rt::Vec16::exp(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, zero, _CMP_GE_OQ), e, one);
    // 1 / (1 + e), 1 + e in [1, 2]: rcp14 and one Newton step (~1 ulp; vdivps would cost ~16
    // cycles per 16 values, the whole of XLA's slice-multiply fusion again)
    const __m512 den = _mm512_add_ps(one, e), r0 = _mm512_rcp14_ps(den);
    const __m512 sig = _mm512_mul_ps(num, _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.f))));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
  }
}
#endif

void GatedRow(Isa isa, const float* gu, int k, float* out) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512Vnni) return GatedRowAvx512(gu, k, out);
#endif
  GatedRowPortable(gu, k, out);
}

void QuantizeRow(Isa isa, const float* x, int k, Acts& a, int row) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512Vnni) return QuantizeRowAvx512(x, k, a, row);
  if (isa == Isa::kAvx2) return QuantizeRowAvx2(x, k, a, row);
#endif
  QuantizeRowPortable(x, k, a, row);
}

// ---- the packed weights' bytes, 8 or 4 bits -------------------------------------------------------
// Byte b (0..63) of 64-byte vector v (4 inputs x 16 columns: v = k / 4) of a tile whose weights start
// at w, as w + 128 whatever the packing.
inline uint8_t WeightByte(const Problem& p, const uint8_t* w, int v, int b) {
  if (p.bits == 8) return w[static_cast<size_t>(v) * 64 + b];
  const uint8_t pair = w[static_cast<size_t>(v / 2) * 64 + b];
  return static_cast<uint8_t>(((v & 1) ? pair >> 4 : pair & 0x0F) | 0x80);
}

#if defined(SLIPSTREAM_X86)
// Bytes [32 * half, 32 * half + 32) of vector v, as WeightByte.
__attribute__((target("avx2"), always_inline)) inline __m256i LoadWeights32Avx2(const Problem& p, const uint8_t* w,
                                                                                   int v, int half) {
  if (p.bits == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + static_cast<size_t>(v) * 64 + half * 32));
  __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + static_cast<size_t>(v / 2) * 64 + half * 32));
  if (v & 1) pair = _mm256_srli_epi16(pair, 4);
  return _mm256_or_si256(_mm256_and_si256(pair, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(static_cast<char>(0x80)));
}
#endif

// ---- micro kernels: R act rows x C tiles over all of K ------------------------------------------
// Act rows row0 .. row0 + R - 1 (row0 and R multiples of p.parts); each writes the output rows
// (row0 + r) / parts, summing its parts, for columns below p.n.

template <int R, int C>
void TilePortable(const Problem& p, const Acts& a, int row0, int tile0) {
  float f[R][C][kTile] = {};
  for (int g = 0; g < p.groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const size_t ag = static_cast<size_t>(row0 + r) * p.groups + g;
      const int8_t* xq = a.q.data() + static_cast<size_t>(row0 + r) * p.kp + g * kGroup;
      for (int c = 0; c < C; ++c) {
        const uint8_t* w = p.w + (tile0 + c) * p.tile_bytes();
        const uint16_t* ws = p.ws + (tile0 + c) * p.tile_scales() + g * kTile;
        int32_t acc[kTile];
        for (int j = 0; j < kTile; ++j) acc[j] = a.bias[ag];
        for (int k4 = 0; k4 < kGroup / 4; ++k4)
          for (int j = 0; j < kTile; ++j)
            for (int i = 0; i < 4; ++i)
              acc[j] += int32_t(WeightByte(p, w, g * (kGroup / 4) + k4, j * 4 + i)) * xq[k4 * 4 + i];
        for (int j = 0; j < kTile; ++j) f[r][c][j] += float(acc[j]) * (HalfToFloat(ws[j]) * a.scale[ag]);
        if (p.wo) {
          const uint16_t* wo = p.wo + (tile0 + c) * p.tile_scales() + g * kTile;
          for (int j = 0; j < kTile; ++j) f[r][c][j] += HalfToFloat(wo[j]) * a.sum[ag];
        }
      }
    }
  }
  for (int r = 0; r < R; r += p.parts)
    for (int c = 0; c < C; ++c) {
      const int n0 = (tile0 + c) * kTile;
      float* out = p.y + static_cast<size_t>((row0 + r) / p.parts) * p.n + n0;
      for (int j = 0; j < kTile && n0 + j < p.n; ++j) out[j] = p.parts == 2 ? f[r][c][j] + f[r + 1][c][j] : f[r][c][j];
    }
}

#if defined(SLIPSTREAM_X86)

// P = p.parts. With two parts the act rows come in pairs (xq0, xq1) of one input row, with scales
// d and d1 = d / 254: the pair's int32 sums combine exactly as 254 * acc0 + acc1 (|.| < 2^31 for
// 32 inputs) and then take one scale d1, so the float work per group is that of one row.
// B = p.bits: with 4, each 64-byte load holds two vectors (4 inputs x 16 columns each), widened to
// w + 128 with a shift and one vpternlogd each.
template <int R, int C, int P, int B>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void TileAvx512(const Problem& p, const Acts& a, int row0, int tile0) {
  static_assert(B == 8 || B == 4, "8 or 4 bits per weight");
  static_assert(R % P == 0, "act rows come in whole input rows");
  constexpr int Y = R / P;  // output rows
  __m512 f[Y][C];
  for (int y = 0; y < Y; ++y)
    for (int c = 0; c < C; ++c) f[y][c] = _mm512_setzero_ps();
  const uint8_t* w = p.w + tile0 * p.tile_bytes();
  const uint16_t* ws = p.ws + tile0 * p.tile_scales();
  const uint16_t* wo = p.wo ? p.wo + tile0 * p.tile_scales() : nullptr;
  const int8_t* xq = a.q.data() + static_cast<size_t>(row0) * p.kp;
  const float* xs = a.scale.data() + static_cast<size_t>(row0) * p.groups;
  const float* xsum = a.sum.data() + static_cast<size_t>(row0) * p.groups;
  const int32_t* xb = a.bias.data() + static_cast<size_t>(row0) * p.groups;
  // Few rows (decode): the weights stream from memory once, so prefetch each tile's stream (and its
  // scales and offsets) p.pf_near bytes ahead into L1 and p.pf_far into L2; the first lines of every
  // stream are requested up front. Blocks of 2-3 output rows too where p.stream_rows says so (kShape).
  const bool stream = Y == 1 || (Y <= kMaxStreamRows && Y <= p.stream_rows);
  constexpr int kGroupBytes = kGroup * kTile * B / 8;  // weight bytes of one group of one tile
  const int near = p.pf_near, near_groups = near / kGroupBytes, far = p.pf_far, far_groups = far / kGroupBytes;
  // Non-temporal (p.pf_nta): the weights are read once per step, so they need not evict what the step
  // reads again from cache, the K/V of a few sequences above all (AMD Zen 4, one-slot decode step,
  // in-process A/Bs: model program 0.93-0.98x, step 0.96-0.99x for q8_0-a16, 0.91-0.94x for q8_0).
  const bool nta = p.pf_nta;
  if (stream) {
    for (int c = 0; c < C; ++c) {
      for (int b = 0; b < near; b += 64) {
        if (nta) _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + b), _MM_HINT_NTA);
        else _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + b), _MM_HINT_T0);
      }
      for (int g = 0; g < near_groups; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(ws + c * p.tile_scales() + g * kTile), _MM_HINT_T0);
        if (wo) _mm_prefetch(reinterpret_cast<const char*>(wo + c * p.tile_scales() + g * kTile), _MM_HINT_T0);
      }
    }
  }
  for (int g = 0; g < p.groups; ++g) {
    if (stream) {
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(ws + c * p.tile_scales() + (g + near_groups) * kTile), _MM_HINT_T0);
        if (wo) _mm_prefetch(reinterpret_cast<const char*>(wo + c * p.tile_scales() + (g + near_groups) * kTile), _MM_HINT_T0);
        if (far) {
          _mm_prefetch(reinterpret_cast<const char*>(ws + c * p.tile_scales() + (g + far_groups) * kTile), _MM_HINT_T1);
          if (wo) _mm_prefetch(reinterpret_cast<const char*>(wo + c * p.tile_scales() + (g + far_groups) * kTile), _MM_HINT_T1);
        }
      }
    }
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(xb[r * p.groups + g]);
      for (int c = 0; c < C; ++c) acc[r][c] = b;
    }
    constexpr int kLoads = kGroup / 4 * B / 8;  // 64-byte weight loads per group and tile
    constexpr int kVectors = 8 / B;             // 4-input vectors per load
#pragma GCC unroll 8  // GCC leaves the loop rolled for some blocks, the accumulators then in memory
    for (int ld = 0; ld < kLoads; ++ld) {
      __m512i wv[kVectors][C];
      const size_t off = (static_cast<size_t>(g) * kLoads + ld) * 64;
      for (int c = 0; c < C; ++c) {
        if (stream) {
          if (nta) _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + off + near), _MM_HINT_NTA);
          else _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + off + near), _MM_HINT_T0);
          if (far) {
            if (nta) _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + off + far), _MM_HINT_NTA);
            else _mm_prefetch(reinterpret_cast<const char*>(w + c * p.tile_bytes() + off + far), _MM_HINT_T1);
          }
        }
        const __m512i raw = _mm512_loadu_si512(w + c * p.tile_bytes() + off);
        if constexpr (B == 8) {
          wv[0][c] = raw;
        } else {  // (nibble & 0x0F) | 0x80: ternary-logic table (A & B) | C = 0xEA
          const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(static_cast<char>(0x80));
          wv[0][c] = _mm512_ternarylogic_epi32(raw, low, top, 0xEA);
          wv[1][c] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low, top, 0xEA);
        }
      }
      for (int v = 0; v < kVectors; ++v)
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq + static_cast<size_t>(r) * p.kp + g * kGroup + (ld * kVectors + v) * 4, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[v][c], xv);
        }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + c * p.tile_scales() + g * kTile)));
      for (int y = 0; y < Y; ++y) {
        __m512i total = acc[y * P][c];
        if (P == 2)  // 254 * acc0 + acc1
          total = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(total, 8), _mm512_slli_epi32(total, 1)), acc[y * P + 1][c]);
        const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(xs[(y * P + P - 1) * p.groups + g]));
        f[y][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), s, f[y][c]);
      }
    }
    if (wo) {
      for (int c = 0; c < C; ++c) {
        const __m512 oc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + c * p.tile_scales() + g * kTile)));
        for (int y = 0; y < Y; ++y) f[y][c] = _mm512_fmadd_ps(oc, _mm512_set1_ps(xsum[y * P * p.groups + g]), f[y][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int n0 = (tile0 + c) * kTile;
    const int valid = std::min(kTile, p.n - n0);
    const __mmask16 mask = valid >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int y = 0; y < Y; ++y) _mm512_mask_storeu_ps(p.y + static_cast<size_t>(row0 / P + y) * p.n + n0, mask, f[y][c]);
  }
}

__attribute__((target("avx2,f16c"), always_inline)) inline __m256 LoadHalf8(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

template <int R, int C>
__attribute__((target("avx2,fma,f16c")))
void TileAvx2(const Problem& p, const Acts& a, int row0, int tile0) {
  constexpr int V = 2 * C;
  __m256 f[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) f[r][v] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* w = p.w + tile0 * p.tile_bytes();
  const uint16_t* ws = p.ws + tile0 * p.tile_scales();
  const uint16_t* wo = p.wo ? p.wo + tile0 * p.tile_scales() : nullptr;
  for (int g = 0; g < p.groups; ++g) {
    __m256i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
    for (int k4 = 0; k4 < kGroup / 4; ++k4) {
      __m256i wsgn[V], wabs[V];
      const size_t off = (static_cast<size_t>(g) * (kGroup / 4) + k4) * 64;
      for (int v = 0; v < V; ++v) {
        const __m256i raw = LoadWeights32Avx2(p, w + (v / 2) * p.tile_bytes(), g * (kGroup / 4) + k4, v % 2);
        wsgn[v] = _mm256_xor_si256(raw, flip);
        wabs[v] = _mm256_abs_epi8(wsgn[v]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, a.q.data() + static_cast<size_t>(row0 + r) * p.kp + g * kGroup + k4 * 4, 4);
        const __m256i xv = _mm256_set1_epi32(x4);
        for (int v = 0; v < V; ++v) {
          const __m256i pairs = _mm256_maddubs_epi16(wabs[v], _mm256_sign_epi8(xv, wsgn[v]));
          acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const size_t so = (v / 2) * p.tile_scales() + g * kTile + (v % 2) * 8;
      const __m256 sc = LoadHalf8(ws + so);
      for (int r = 0; r < R; ++r) {
        const size_t ag = static_cast<size_t>(row0 + r) * p.groups + g;
        const __m256 s = _mm256_mul_ps(sc, _mm256_set1_ps(a.scale[ag]));
        f[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), s, f[r][v]);
        if (wo) f[r][v] = _mm256_fmadd_ps(LoadHalf8(wo + so), _mm256_set1_ps(a.sum[ag]), f[r][v]);
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int n0 = (tile0 + v / 2) * kTile + (v % 2) * 8;
    for (int r = 0; r < R; r += p.parts) {
      const __m256 val = p.parts == 2 ? _mm256_add_ps(f[r][v], f[r + 1][v]) : f[r][v];
      rt::Vec8::store_first(p.y + static_cast<size_t>((row0 + r) / p.parts) * p.n + n0, val, p.n - n0);
    }
  }
}

// AVX2, two-part activations, many rows: no int8 dot product on AVX2 beats f32 FMAs here (maddubs
// + madd + add per 32 products, twice for the two parts: 0.55-1.1x XLA's f32 matmul at 256 rows on
// a Zen 3 EPYC). So each item widens a tile's weights once to f32, w = (u8 - 128) * scale + offset,
// in [Kp][16] order, and runs f32 FMAs on x itself: the dequantized weight times the unquantized
// activations, exact up to f32 rounding (closer to the float product than the two parts' ~15 bits).
constexpr int kF32MinRows = 8;  // input rows from which a two-part call takes this path on AVX2
constexpr int kF32Rows = 6;     // rows per micro block: 12 accumulators + 2 weight vectors + 1 broadcast

__attribute__((target("avx2,fma,f16c")))
void DequantTileAvx2(const Problem& p, int tile, float* buf) {
  const uint8_t* w = p.w + tile * p.tile_bytes();
  const uint16_t* ws = p.ws + tile * p.tile_scales();
  const uint16_t* wo = p.wo ? p.wo + tile * p.tile_scales() : nullptr;
  // 32 bytes = 8 columns x 4 inputs ([col][input]); per 128-bit lane, a 4 x 4 byte transpose to
  // [input][col], then dwords (0,4,1,5,2,6,3,7) put input i's 8 columns in 64-bit piece i.
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i bias = _mm256_set1_epi32(128);
  for (int k4 = 0; k4 < p.kp / 4; ++k4) {
    const int g = k4 * 4 / kGroup;
    for (int half = 0; half < 2; ++half) {
      const __m256 sc = LoadHalf8(ws + g * kTile + half * 8);
      const __m256 of = wo ? LoadHalf8(wo + g * kTile + half * 8) : _mm256_setzero_ps();
      __m256i raw = LoadWeights32Avx2(p, w, k4, half);
      raw = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(raw, transpose), order);
      const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
      const __m128i pieces[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(pieces[i]), bias);
        _mm256_storeu_ps(buf + (k4 * 4 + i) * kTile + half * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc, of));
      }
    }
  }
}

// R <= 6 rows of x times one k-row of 16 weights, accumulated into R x 2 ymm (12 accumulators + 2 weight
// vectors + 1 broadcast = 15 of the 16 registers). The caller unrolls its k loop around it and keeps `acc`
// in registers (#pragma GCC unroll on every loop over rows: a loop over acc left rolled makes GCC keep acc
// in memory and store all of it on every k).
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

// y rows row0 .. row0 + R - 1, the tile's 16 columns (those below n) = x rows times buf [K][16].
template <int R>
__attribute__((target("avx2,fma")))
void TileF32Avx2(const Problem& p, const float* buf, int row0, int tile) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = p.x + static_cast<size_t>(row0 + r) * p.k;
  const float* b = buf;
#pragma GCC unroll 4
  for (int kk = 0; kk < p.k; ++kk, b += kTile) FmaRows16Avx2<R>(xr, kk, b, acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      const int n0 = tile * kTile + h * 8;
      rt::Vec8::store_first(p.y + static_cast<size_t>(row0 + r) * p.n + n0, acc[r][h], p.n - n0);
    }
}

using TileF32Fn = void (*)(const Problem&, const float*, int, int);
constexpr TileF32Fn kTileF32Avx2[kF32Rows] = {&TileF32Avx2<1>, &TileF32Avx2<2>, &TileF32Avx2<3>,
                                              &TileF32Avx2<4>, &TileF32Avx2<5>, &TileF32Avx2<6>};

#endif  // SLIPSTREAM_X86

// ---- AMX ---------------------------------------------------------------------------------------
constexpr int kAmxRows = 16;  // rows of a tile: input rows per micro block

// AMX-BF16, two parts: x times the dequantized weight, each split into bf16 hi + lo, and the three products
// x_lo w_hi + x_hi w_hi + x_hi w_lo summed in f32 over all of K in the C tiles, with no work per group. Each
// product carries ~16 significant bits (the dropped x_lo w_lo is below 2^-16 of it): closer to f32 than the two
// int8 parts (~15 bits of x per group).
// The weights' split is made once, at load (kernels/q8_matmul.py, pack_tiles: w = q * d (+ m) rounded once to
// f32, w_hi = bf16(w), w_lo = bf16(w - w_hi)), and passed as `tiles`: per column tile and group, w_hi's B tile
// then w_lo's (16 rows of 64 bytes: row j holds inputs 2j and 2j + 1 of the group for the 16 columns), 4 bytes
// per weight. x is split per call into A tiles (SplitRowBf16).
// Why not int8 tiles with the group-32 scales: a scale pass per group and C tile (tile store, a float pass)
// and a product at half depth (K = 32 of 64 costs 0.85x a full one here); a bit-exact int8 version measured
// 0.96-1.2x the VNNI path's time. Why three bf16 products and not the integer q in bf16 (exact) times x hi +
// lo with the scales applied per group: measured on this project's Emerald Rapids (one core, 256 rows x 96
// columns, operands prepacked, benchmarks/amx_blocking.cc, A2 and B1): 731 useful GFLOP/s for these three products in
// 2 x 2 blocks against 517 for that two-product scheme (its per-group pass, 1 x 2 blocks), 583 in 1 x 2 blocks.
// Blocking: 2 row tiles x 2 column tiles: C in tmm0-3 (tmm(2r + c)), x's A tiles in tmm4-5, the weights' B
// tiles in tmm6-7; per group 8 tile loads for 12 products.
constexpr int kBf16BlockRows = 256;  // input rows per item: each column tile's B panel serves 16 row tiles
// From this many input rows a two-part call with prepacked tiles runs on the tile unit. Measured (Xeon Emerald
// Rapids, 2 cores, default model shapes, `python -m benchmarks.kernel int8 --amx --rows 32,64,128,256,512`): the
// kernel alone wins from 32 rows, but a 32-slot decode step took the same time either way (its tiles, 4 bytes a
// weight, stream from memory where the int8 weights stay in L3), so decode steps keep the VNNI path.
constexpr int kAmxMinRows = 64;
std::atomic<int> g_amx_min_rows{kAmxMinRows};  // amx_rows() changes it, for benchmarks

#if defined(SLIPSTREAM_X86)
struct AmxBf16Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
alignas(64) const AmxBf16Config kAmxBf16Config{};

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline __m512 Bf16Float(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h)), 16));
}

// x row `row` (k values) as bf16 hi and lo into acts.hi / acts.lo, zero past k up to Kp, laid out as the
// tile unit's A tiles: [row / 16][group][row % 16][32], so that each tile load reads 1 KiB in a row.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void SplitRowBf16(const float* x, int k, Acts& a, int row) {
  const size_t base = (static_cast<size_t>(row / kAmxRows) * a.groups * kAmxRows + row % kAmxRows) * kGroup;
  for (int i = 0; i < a.kp; i += 16) {
    const int n = std::max(0, std::min(16, k - i));
    const __m512 v = _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), x + i);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, Bf16Float(h)));
    const size_t at = base + static_cast<size_t>(i / kGroup) * kAmxRows * kGroup + i % kGroup;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.hi.data() + at), reinterpret_cast<const __m256i&>(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.lo.data() + at), reinterpret_cast<const __m256i&>(l));
  }
}

// RT row tiles (from row tile rt0) x CT column tiles (from tile0), RT, CT in {1, 2}, over all of K. Rows past
// p.m (the last row tile's) are computed from whatever the A buffer holds and not stored.
template <int RT, int CT>
__attribute__((target("amx-tile,amx-bf16,avx512f")))
void TileBf16(const Problem& p, const Acts& a, int rt0, int tile0) {
  constexpr size_t kElems = kAmxRows * kGroup;  // one A or B tile: 16 rows of 32 bf16
  const size_t x_step = static_cast<size_t>(p.groups) * kElems;  // one row tile's A tiles
  const uint16_t* xh = a.hi.data() + rt0 * x_step;
  const uint16_t* xl = a.lo.data() + rt0 * x_step;
  const size_t w_step = p.tile_bf16();
  const uint16_t* w = p.wt + tile0 * w_step;
  _tile_zero(0);
  if constexpr (CT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  if constexpr (RT == 2 && CT == 2) {
    // Tile registers are not renamed: a load into tmm4-7 waits for the products still reading it. So each load
    // is issued right after the last product that reads its register, while the others keep the unit busy,
    // and the next group's first operands are loaded during this group's last products.
    _tile_loadd(4, xl, 64);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + w_step, 64);
    _tile_loadd(5, xl + x_step, 64);
    for (int g = 0; g < p.groups; ++g) {
      const size_t xg = static_cast<size_t>(g) * kElems, wg = 2 * xg;  // w: hi then lo per group
      const bool next = g + 1 < p.groups;
      // x_lo w_hi
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(4, xh + xg, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      _tile_loadd(5, xh + x_step + xg, 64);
      // x_hi w_hi
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(6, w + wg + kElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
      _tile_loadd(7, w + w_step + wg + kElems, 64);
      // x_hi w_lo, then the next group's x_lo and w_hi
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (next) _tile_loadd(6, w + wg + 2 * kElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (next) _tile_loadd(4, xl + xg + kElems, 64);
      _tile_dpbf16ps(3, 5, 7);
      if (next) {
        _tile_loadd(7, w + w_step + wg + 2 * kElems, 64);
        _tile_loadd(5, xl + x_step + xg + kElems, 64);
      }
    }
  } else {
    // each (r, c) of the block: C(r, c) += A(r) B(c)
    auto products = []() __attribute__((always_inline)) {
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (CT == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    };
    for (int g = 0; g < p.groups; ++g) {
      const size_t xg = static_cast<size_t>(g) * kElems, wg = 2 * xg;  // w: hi then lo per group
      _tile_loadd(4, xl + xg, 64);
      if constexpr (RT == 2) _tile_loadd(5, xl + x_step + xg, 64);
      _tile_loadd(6, w + wg, 64);
      if constexpr (CT == 2) _tile_loadd(7, w + w_step + wg, 64);
      products();  // x_lo w_hi
      _tile_loadd(4, xh + xg, 64);
      if constexpr (RT == 2) _tile_loadd(5, xh + x_step + xg, 64);
      products();  // x_hi w_hi
      _tile_loadd(6, w + wg + kElems, 64);
      if constexpr (CT == 2) _tile_loadd(7, w + w_step + wg + kElems, 64);
      products();  // x_hi w_lo
    }
  }
  alignas(64) float c[4][kAmxRows * kTile];
  _tile_stored(0, c[0], 64);
  if constexpr (CT == 2) _tile_stored(1, c[1], 64);
  if constexpr (RT == 2) _tile_stored(2, c[2], 64);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, c[3], 64);
  for (int r = 0; r < RT; ++r) {
    const int row0 = (rt0 + r) * kAmxRows, rows = std::min(kAmxRows, p.m - row0);
    for (int t = 0; t < CT; ++t) {
      const int n0 = (tile0 + t) * kTile, valid = std::min(kTile, p.n - n0);
      const __mmask16 mask = valid >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const float* ct = c[2 * r + t];
      for (int i = 0; i < rows; ++i)
        _mm512_mask_storeu_ps(p.y + static_cast<size_t>(row0 + i) * p.n + n0, mask, _mm512_load_ps(ct + i * kTile));
    }
  }
}

__attribute__((target("amx-tile"))) void AmxBeginBf16() { _tile_loadconfig(&kAmxBf16Config); }
__attribute__((target("amx-tile"))) void AmxEnd() { _tile_release(); }
#endif  // SLIPSTREAM_X86

// AMX-INT8: the VNNI path's arithmetic on the tile unit, bit for bit. Per group of 32 inputs, tdpbsud (A signed
// int8 activations x B unsigned w + 128) gives each act row's int32 sum over the group, as vpdpbusd does; a vector
// pass adds the row's -128 * sum(xq) and, with two parts, combines the pair of act rows as 254 * acc0 + acc1 (exact
// in int32, the same integer the VNNI path forms; with 4-bit weights exactly in float, the same f32), then applies
// f = fma(f32(total), ws * xs, f) (and the offsets' fma) in group order: the same float operations in the same order,
// so every output equals the VNNI path's.
// Operands as they lie, nothing repacked: the 8-bit packed weight [Kp/4][16][4] per column tile is tdpbsud's B layout
// (a group: 8 rows of 64 bytes), and the quantized act rows (part p of input row m at row m * P + p, Kp bytes each)
// are A tiles of 16 act rows x 32 bytes with stride Kp. With two parts a tile's 16 act rows are 8 input rows.
// 4-bit weights are widened per group into a B tile (TileInt8). Each row tile runs over its item's column tiles
// group by group, one stream of (column tile, group) items with four C tiles in rotation, its f32 sums in registers
// (named ones, see below).
// What a group of one 16 x 16 block costs (one core, this Emerald Rapids, operands in L1): the K = 32 product ~5 ns
// (as long as a K = 64 one), the C tile's store ~5 ns, the vector pass over the stored tile (bias, combine,
// convert, scale, fma) ~10-13 ns; VNNI's products and float steps for the same block ~32 ns (8-bit weights).
// What made the tile path pay at few rows (one core, benchmarks/q8_tile_probe.cc, 4-bit 576 x 3072, 8 input rows, two
// parts: 1.05x -> 0.78x the VNNI time): the weights prefetched ahead, as the one-row VNNI path does (the stream from
// memory stalled the tile loads), each C tile stored two items after its product (a store right behind its product
// waited for it, and the tile unit takes its instructions in order), the scale pass six items behind the store, and
// no division per item. Then (h-tile8) the scale pass's output sums in named registers (an array of them, reached
// from a lambda, was loaded and stored around every fma: each float load through xs or xsum may alias it), the
// offsets' test out of the row loop (template parameter O), and with 4-bit weights the pair combined in float (see
// Q8_INT8_ROW): 6 vector instructions an output row and group where there were 8, a load and two stores; the
// probe's items at 8-64 rows 0.77-0.90x the time (weights from L3), the default model's decode-step chain's q8
// calls (`python -m benchmarks.kernel int8 --dispatch`) 0.91x at 8 rows, 0.80x at 16, 0.78x at 32, 0.72x at 64 and
// unchanged at 4. Where an item's time goes now (same probe, 576 x 3072, weights from L3, parts cut out): at 4 input
// rows ~26 ns, of which ~19 is the weight stream alone (its prefetches, with nothing else); at 8 rows ~31 ns, the
// scale pass ~7 of it; at 16 rows (two row tiles) ~65 ns: the scale pass ~20 (about its 6 vector uops an output row
// on the two 512-bit ports), the tile work (products, tile loads, C stores, widening) ~24, the stream ~21, which hardly
// overlap. Two row tiles against each B tile (one widening and one B load for two products, the 16 output rows' sums
// in registers) measured 0.87-1.21x the time of one row tile at a time (median 1.09-1.13x over 16-64 rows, either
// order of the tile loads); prefetching 8 KiB ahead, or also into L2 16-32 KiB ahead, did not beat the 4 KiB into L1
// below, nor the scale pass 3 or 10 items behind its product instead of 6 (1.04x, 1.09x), nor TileQ4Bf16 at 16-64
// rows (1.0-1.45x the old path's time: its widening per item is not shared there). Earlier layouts: 2 x 2 tile
// blocks (four C tiles, f32 sums in memory) 1.05-1.10x the VNNI time at 256 rows, 1 x 1 blocks with two groups in
// flight 0.89-0.98x.
constexpr int kAmxBlockRows = 256;  // input rows per item
// The row counts whose two-part calls run on the int8 tile unit (the others on VNNI: same outputs). Measured (Xeon
// Emerald Rapids): on one core (benchmarks/q8_tile_probe.cc) 0.78-0.86x the VNNI time at 4, 8 and 16 input rows,
// 1.4-1.6x at 1-2 rows (the VNNI one-row path streams the weights with less work per group); in the default model's
// program on both cores (`python -m benchmarks.spec_profile`, the threads on contiguous segments, see Job::workers),
// its q8 calls 0.87x at 4 tokens, 0.83x at 8 and 16; with the sums in registers (h-tile8) 0.97x at 4, 0.71x at 8,
// 0.66x at 16, and the decode-step chain's (`benchmarks.kernel int8 --dispatch`) 0.67x at 32 rows (a 32-slot decode
// step's calls) and 0.68x at 64. A 32-slot decode step: 0.94x (before the segments). Earlier
// (`python -m benchmarks.kernel int8 --amx`, 8-bit): 0.93-1.14x at 128 rows, 0.95-1.10x at 256 and 512; one part
// 0.92-1.07x at 16-32 rows and 1.06-1.27x from 128 (its tile store and scale pass per group and 16 x 16 tile cost as
// much as the VNNI products they replace), so one-part calls stay on VNNI.
constexpr int kInt8MinRows = 4, kInt8MaxRows = 64;
std::atomic<int> g_int8_min_rows{kInt8MinRows}, g_int8_max_rows{kInt8MaxRows}, g_int8_min_parts{2};  // amx_rows()

// The input rows of a row block of `rows` that the int8 tile path leaves to the vector path: a last, partial row tile
// of fewer than g_int8_min_rows input rows after whole ones. Such a tile costs the tile unit what a call of that few
// rows does (1.2-1.6x VNNI's time at 1-2 rows, see above: it streams and widens the chunk's weights again and runs
// the scale pass), where the vector path reads the weights the whole tiles just brought into cache. Measured (Xeon
// Emerald Rapids, `python -m benchmarks.kernel int8 --dispatch`: the default model's 120 layer calls + LM head
// chained, time inside the q8 calls, alternated per rep): with such a tile on the tile unit (then configured for 16
// rows, as every row tile of a call of more than one) 1.13x / 1.07x / 1.03x VNNI's time at 9 / 10 / 11 rows and
// 1.13x / 1.09x at 17 / 18, 0.99x at 12, 1.00x at 20; now 0.86x / 0.83x / 0.81x, 0.81x / 0.82x, 0.85x and 0.89x (a
// last partial tile of 4-7 input rows runs on tiles of its rows).
inline int Int8Tail(int rows, int parts) {
  const int per_tile = kAmxRows / parts, tail = rows % per_tile;
  return rows > per_tile && tail < g_int8_min_rows.load(std::memory_order_relaxed) ? tail : 0;
}

#if defined(SLIPSTREAM_X86)
struct alignas(64) AmxInt8Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};  // C: 16 int32, A: 32 int8, B: 64 bytes (16 cols x 4)
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};      // B: a group's 32 inputs in 8 rows of 4
};

// One row tile of act rows (from act row at0, a multiple of 16) x column tiles tile_lo .. tile_hi - 1, over all of K:
// items (column tile, group) in order, item i's product in C tile tmm(i % 4), stored two items later into a ring of
// buffers and scaled kLag items after its product, so the tile unit, the stores and the vector pass work on
// different items; the row tile's output rows (8 with two parts) stay in registers across a column tile's groups.
// Act rows past p.m * P (in the last row tile) are multiplied and never stored; the tile rows in use (the
// configuration's, see AmxBeginInt8) may be fewer than 16.
// 4-bit weights (B = 4): each group's nibbles are widened to a B tile in a buffer, as the nibbles themselves
// (0..15, not + 128): tdpbsud then gives sum(q * xq) directly, the same integer as the VNNI path's -128 * sum(xq) +
// sum((q + 128) * xq), so no bias is added back. Y: the output rows scaled (those of the tile rows in use).
template <int P, int B, int Y, bool O>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c")))
void TileInt8(const Problem& p, const Acts& a, int at0, int tile_lo, int tile_hi) {
  static_assert(Y * P <= kAmxRows, "a tile holds 16 act rows");
  constexpr size_t kGroupBytes = kGroup * kTile * B / 8;  // a group's packed weights: 512 or 256 bytes
  constexpr int kLag = 6, kRing = 8;  // items between a C tile's store and its scale pass; C buffers
  constexpr int kAhead = 4096 / kGroupBytes;  // items prefetched ahead: 4 KiB of packed weights
  // B = 4: items widened ahead (a tile load reads the widened bytes from L1 once their stores have left the store
  // buffer, not before) and the ring of widened B tiles
  constexpr int kWLead = 8, kWRing = 16;
  const int rows = std::min(kAmxRows, p.m * P - at0), groups = p.groups, kp = p.kp;
  const int items = (tile_hi - tile_lo) * groups;
  const int8_t* const xq = a.q.data() + static_cast<size_t>(at0) * kp;
  const int32_t* const xb = a.bias.data() + static_cast<size_t>(at0) * groups;
  const float* const xs = a.scale.data() + static_cast<size_t>(at0) * groups + (P - 1) * groups;
  const float* const xsum = a.sum.data() + static_cast<size_t>(at0) * groups;
  alignas(64) int32_t cbuf[kRing][Y * P * kTile];
  alignas(64) uint8_t bbuf[kWRing][kGroup * kTile];  // B = 4: item i's widened B tile in bbuf[i % kWRing]
  // the output rows' sums in named registers (an array of vectors reached from a lambda stayed on the stack, stored
  // after every fma: every float load through xs or xsum may alias it); those past Y are never touched
  __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0, f8 = f0, f9 = f0,
         f10 = f0, f11 = f0, f12 = f0, f13 = f0, f14 = f0, f15 = f0;
  // item i: column tile tile_lo + i / groups, group i % groups. The tiles' weights, scales and offsets lie one
  // after another (a tile is its groups' in order), so item i's are at i times a group's size from tile_lo's.
  const uint8_t* const w = p.w + tile_lo * p.tile_bytes();
  const uint16_t* const ws = p.ws + tile_lo * p.tile_scales();
  const uint16_t* const wo = O ? p.wo + tile_lo * p.tile_scales() : nullptr;
  auto weights = [&](int i) __attribute__((always_inline)) { return w + static_cast<size_t>(i) * kGroupBytes; };
  // B = 4: item i's nibbles widened into bbuf[i % 4] (vectors 2j and 2j + 1 from packed bytes 64j .. 64j + 63)
  auto widen = [&](int i) __attribute__((always_inline, target("avx512f,avx512bw"))) {
    if constexpr (B == 4) {
      if (i >= items) return;
      const __m512i low = _mm512_set1_epi8(0x0F);
      const uint8_t* in = weights(i);
      uint8_t* out = bbuf[i % kWRing];
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(in + j * 64);
        _mm512_store_si512(out + j * 128, _mm512_and_si512(raw, low));
        _mm512_store_si512(out + j * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
      }
    }
  };
  auto b_tile = [&](int i) __attribute__((always_inline)) -> const void* {
    if constexpr (B == 4) return bbuf[i % kWRing];
    else return weights(i);
  };
  // tile register numbers must be constants: item i multiplies into tmm(i % 4) from A tile tmm(4 + i % 2) and B
  // tile tmm(6 + i % 2), and its C tile is stored two items later, so the tile unit has the next products queued
  // while a product finishes (a store right after its product waits for it, and the unit takes its instructions in
  // order)
#define Q8_INT8_PRODUCT(C, A, Bt, i, g)                                       \
  do {                                                                        \
    _tile_zero(C);                                                            \
    _tile_loadd(A, xq + (g) * kGroup, kp);                                    \
    _tile_loadd(Bt, b_tile(i), 64);                                           \
    _tile_dpbsud(C, A, Bt);                                                   \
  } while (0)
  // item i's scale pass (the VNNI path's integer and float steps, TileAvx512) from its stored C tile; after its
  // column tile's last group the output rows are stored. 4-bit weights with two parts: the pair's total
  // 254 * acc0 + acc1 formed in float, fma(f32(acc0), 254, f32(acc1)), which is exact, so the same f32 as the VNNI
  // path's conversion of the int32 total (|acc| <= 32 * 15 * 128, |total| < 2^24): two conversions and an fma
  // where the integer combine took two shifts, a subtraction, an addition and a conversion. With 8-bit weights the
  // total can pass 2^24 and is formed in int32, as the VNNI path does.
  int st = tile_lo, sg = 0;  // the scale pass's next item: its column tile and group
  const __m512 k254 = _mm512_set1_ps(254.0f);
#define Q8_INT8_ROW(F, Y_)                                                                                  \
  do {                                                                                                      \
    if constexpr ((Y_) < Y) {                                                                              \
      constexpr int r_ = (Y_) * P;  /* rows past `rows` scale whatever their tile rows hold, never stored */ \
      const size_t ag = static_cast<size_t>(r_) * groups + sg_;                                             \
      __m512 total;                                                                                         \
      if constexpr (B == 4 && P == 2) {                                                                     \
        total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + r_ * kTile)), k254,              \
                                _mm512_cvtepi32_ps(_mm512_load_si512(cb + (r_ + 1) * kTile)));             \
      } else {                                                                                              \
        __m512i t_ = _mm512_load_si512(cb + r_ * kTile);                                                    \
        if constexpr (B == 8) t_ = _mm512_add_epi32(t_, _mm512_set1_epi32(xb[ag]));                         \
        if constexpr (P == 2) { /* 254 * acc0 + acc1 */                                                     \
          __m512i acc1 = _mm512_load_si512(cb + (r_ + 1) * kTile);                                          \
          if constexpr (B == 8) acc1 = _mm512_add_epi32(acc1, _mm512_set1_epi32(xb[ag + groups]));          \
          t_ = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(t_, 8), _mm512_slli_epi32(t_, 1)), acc1); \
        }                                                                                                   \
        total = _mm512_cvtepi32_ps(t_);                                                                     \
      }                                                                                                     \
      F = _mm512_fmadd_ps(total, _mm512_mul_ps(sc, _mm512_set1_ps(xs[ag])), F);                              \
      if constexpr (O) F = _mm512_fmadd_ps(oc, _mm512_set1_ps(xsum[ag]), F);                                \
    }                                                                                                       \
  } while (0)
#define Q8_INT8_OUT(F, Y_)                                                                                  \
  do {                                                                                                      \
    if constexpr ((Y_) < Y) {                                                                              \
      if ((Y_) * P < rows) _mm512_mask_storeu_ps(p.y + static_cast<size_t>(out0 + (Y_)) * p.n + n0, mask, F); \
      F = _mm512_setzero_ps();                                                                              \
    }                                                                                                       \
  } while (0)
#define Q8_INT8_SCALE(i)                                                                                    \
  do {                                                                                                      \
    const int t_ = st, sg_ = sg;                                                                            \
    if (++sg == groups) sg = 0, ++st;                                                                       \
    const int32_t* cb = cbuf[(i) % kRing];                                                                  \
    const size_t so = static_cast<size_t>(i) * kTile;                                                       \
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + so)));      \
    __m512 oc = _mm512_setzero_ps();                                                                        \
    if constexpr (O) oc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + so)));   \
    Q8_INT8_ROW(f0, 0); Q8_INT8_ROW(f1, 1); Q8_INT8_ROW(f2, 2); Q8_INT8_ROW(f3, 3);                         \
    Q8_INT8_ROW(f4, 4); Q8_INT8_ROW(f5, 5); Q8_INT8_ROW(f6, 6); Q8_INT8_ROW(f7, 7);                         \
    Q8_INT8_ROW(f8, 8); Q8_INT8_ROW(f9, 9); Q8_INT8_ROW(f10, 10); Q8_INT8_ROW(f11, 11);                     \
    Q8_INT8_ROW(f12, 12); Q8_INT8_ROW(f13, 13); Q8_INT8_ROW(f14, 14); Q8_INT8_ROW(f15, 15);                 \
    if (sg_ == groups - 1) {                                                                                \
      const int out0 = at0 / P, n0 = t_ * kTile, cols = std::min(kTile, p.n - n0);                          \
      const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);               \
      Q8_INT8_OUT(f0, 0); Q8_INT8_OUT(f1, 1); Q8_INT8_OUT(f2, 2); Q8_INT8_OUT(f3, 3);                       \
      Q8_INT8_OUT(f4, 4); Q8_INT8_OUT(f5, 5); Q8_INT8_OUT(f6, 6); Q8_INT8_OUT(f7, 7);                       \
      Q8_INT8_OUT(f8, 8); Q8_INT8_OUT(f9, 9); Q8_INT8_OUT(f10, 10); Q8_INT8_OUT(f11, 11);                   \
      Q8_INT8_OUT(f12, 12); Q8_INT8_OUT(f13, 13); Q8_INT8_OUT(f14, 14); Q8_INT8_OUT(f15, 15);               \
    }                                                                                                       \
  } while (0)
  // The weights stream from memory (a verification step's calls read each weight once): item i + kAhead's
  // packed weights, scales and offsets are prefetched while item i is multiplied.
  auto prefetch = [&](int i) __attribute__((always_inline)) {
    if (i >= items) return;
    const char* wi = reinterpret_cast<const char*>(weights(i));
    for (size_t b = 0; b < kGroupBytes; b += 64) _mm_prefetch(wi + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ws + static_cast<size_t>(i) * kTile), _MM_HINT_T0);
    if constexpr (O) _mm_prefetch(reinterpret_cast<const char*>(wo + static_cast<size_t>(i) * kTile), _MM_HINT_T0);
  };
  for (int i = 0; i < std::min(items, kAhead); ++i) prefetch(i);
  for (int i = 0; i < kWLead; ++i) widen(i);
  int g = 0;  // the next product's group
#define Q8_INT8_STEP(j, C, A, Bt, Cprev)                           \
  do {                                                             \
    if ((j) < items) {                                             \
      prefetch((j) + kAhead);                                      \
      widen((j) + kWLead);                                         \
      Q8_INT8_PRODUCT(C, A, Bt, j, g);                             \
      if (++g == groups) g = 0;                                    \
    }                                                              \
    if ((j) >= 2 && (j) - 2 < items)                               \
      _tile_stored(Cprev, cbuf[((j) - 2) % kRing], 64);            \
    if ((j) >= kLag && (j) - kLag < items) Q8_INT8_SCALE((j) - kLag); \
  } while (0)
  for (int i = 0; i < items + kLag; i += 4) {
    Q8_INT8_STEP(i, 0, 4, 6, 2);
    Q8_INT8_STEP(i + 1, 1, 5, 7, 3);
    Q8_INT8_STEP(i + 2, 2, 4, 6, 0);
    Q8_INT8_STEP(i + 3, 3, 5, 7, 1);
  }
#undef Q8_INT8_STEP
#undef Q8_INT8_SCALE
#undef Q8_INT8_OUT
#undef Q8_INT8_ROW
#undef Q8_INT8_PRODUCT
}

using TileInt8Fn = void (*)(const Problem&, const Acts&, int, int, int);
// [offsets][bits == 4][output rows of the tile in use - 1], per parts
template <int P, int B, bool O, size_t... I>
constexpr std::array<TileInt8Fn, sizeof...(I)> Int8Rows(std::index_sequence<I...>) {
  return {&TileInt8<P, B, static_cast<int>(I) + 1, O>...};
}
template <int P, bool O>
constexpr std::array<std::array<TileInt8Fn, kAmxRows / P>, 2> Int8Bits() {
  return {Int8Rows<P, 8, O>(std::make_index_sequence<kAmxRows / P>()),
          Int8Rows<P, 4, O>(std::make_index_sequence<kAmxRows / P>())};
}
constexpr std::array<std::array<TileInt8Fn, 16>, 2> kTileInt8P1[2] = {Int8Bits<1, false>(), Int8Bits<1, true>()};
constexpr std::array<std::array<TileInt8Fn, 8>, 2> kTileInt8P2[2] = {Int8Bits<2, false>(), Int8Bits<2, true>()};
TileInt8Fn PickTileInt8(int parts, int bits, int tile_rows, bool offsets) {
  const int y = tile_rows / parts;
  return parts == 1 ? kTileInt8P1[offsets][bits == 4][y - 1] : kTileInt8P2[offsets][bits == 4][y - 1];
}

// The int8 tile configuration with `rows` act rows in the A and C tiles (16, or fewer for a call whose act rows
// fill less than one tile: the products, tile loads and C stores then cost less).
struct AmxInt8Rows {
  AmxInt8Config config[kAmxRows + 1];
  AmxInt8Rows() {
    for (int r = 1; r <= kAmxRows; ++r) {
      for (int t : {0, 1, 2, 3, 4, 5}) config[r].rows[t] = static_cast<uint8_t>(r);  // C and A tiles
    }
  }
};
alignas(64) const AmxInt8Rows kAmxInt8Rows;

__attribute__((target("amx-tile"))) void AmxBeginInt8(int rows) { _tile_loadconfig(&kAmxInt8Rows.config[rows]); }
#endif  // SLIPSTREAM_X86

// ---- many rows, 4-bit weights: the VNNI path's integers on the BF16 tile unit ---------------------------------------
// Two-part calls of at least g_q4_bf16_min_rows input rows whose weights are 4-bit (the default model's Q4_1 layers: a
// prefill chunk, a mixed step, a wide verification). Per input row and group the VNNI path forms the integer
// total = 254 * acc0 + acc1 = sum_k (254 * xq0[k] + xq1[k]) * q[k] (q the nibbles 0..15) and then the float steps
// f = fma(f32(total), ws * xs1, f) (+ the offsets' fma). Here each input's v = 254 * xq0 + xq1 (|v| <= 32385) is split
// into bf16 v_hi + v_lo, both exact (v_hi: v rounded to 8 significant bits; v_lo = v - v_hi, |v_lo| <= 64), and q is
// exact in bf16; tdpbf16ps sums the products v_hi * q + v_lo * q of a group in f32, and every product and partial sum is
// an integer below 32 * 32385 * 15 < 2^24, so the f32 sum is exactly f32(total) whatever the order of the additions.
// The float steps that follow are TileInt8's, so every output equals the VNNI path's bit for bit. Against the int8
// tiles (TileInt8, parts as rows: 8 input rows a tile) a C tile holds 16 input rows' totals: half the C stores, and a
// vector pass of one C row load, a multiply and two fmas an output row (no bias, no combine, no conversion).
// A tiles: acts.hi / acts.lo as TileBf16's ([row / 16][group][row % 16][32], SplitActsBf16); B tiles: each chunk's
// nibbles widened once to bf16 pairs (WidenChunkBf16: item i's 16 rows x 64 bytes at wide + i * 512).
// Measured (one core, benchmarks/q8_tile_probe.cc --pair, 256 rows, operands in L2, medians, Xeon Emerald Rapids with
// other jobs on the host): 0.56-0.63x the VNNI time at 576 x 3072, 0.72-0.75x at 1536 x 576, 0.65-0.85x at 576 x 960,
// 0.70-0.92x at 576 x 576. The int8 tiles (TileInt8, one 16-act-row tile at a time) took 0.84-0.93x; the int8 tiles two
// row tiles at a time with one B tile per two products (h-prefill 3ac8af3) measured the same as this path in the
// same runs. Where an int8 pair item's time went (576 x 3072): products and tile loads ~40%, C stores ~15%, the vector
// pass ~45%, which did not overlap (interleaving the vector pass's rows between the tile instructions changed
// nothing); halving the stores and the vector pass here did not make the item cheaper either, nor did chunks of 2 or
// 3 column tiles (B panels that stay in L1) instead of 6, so what bounds an item (~55 ns, about 5x its two products)
// is still open (this VM exposes no hardware counters).
constexpr int kQ4Bf16MinRows = kInt8MaxRows + 1;
std::atomic<int> g_q4_bf16_min_rows{kQ4Bf16MinRows};  // q4_bf16_rows()

#if defined(SLIPSTREAM_X86)
// Input row `row`'s two quantized act rows (2 row, 2 row + 1) as bf16 v_hi and v_lo of v = 254 * xq0 + xq1 into
// acts.hi / acts.lo, in the A tile layout of SplitRowBf16.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void SplitActsBf16(Acts& a, int row) {
  const size_t base = (static_cast<size_t>(row / kAmxRows) * a.groups * kAmxRows + row % kAmxRows) * kGroup;
  const int8_t* q0 = a.q.data() + static_cast<size_t>(2 * row) * a.kp;
  const int8_t* q1 = q0 + a.kp;
  const __m512 k254 = _mm512_set1_ps(254.0f);
  for (int i = 0; i < a.kp; i += 16) {
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + i))));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + i))));
    const __m512 v = _mm512_fmadd_ps(v0, k254, v1);  // exact: |v| < 2^15
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, Bf16Float(h)));  // exact, as is v - h
    const size_t at = base + static_cast<size_t>(i / kGroup) * kAmxRows * kGroup + i % kGroup;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.hi.data() + at), reinterpret_cast<const __m256i&>(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.lo.data() + at), reinterpret_cast<const __m256i&>(l));
  }
}

// The nibbles of column tiles tile_lo .. tile_hi - 1 (4-bit weights) as bf16 B tiles, item after item, into wide: row r
// of item i's tile holds, for each of the 16 columns, inputs 2r and 2r + 1 of the group.
__attribute__((target("avx512f,avx512bw")))
void WidenChunkBf16(const Problem& p, int tile_lo, int tile_hi, uint16_t* wide) {
  const int items = (tile_hi - tile_lo) * p.groups;
  alignas(64) uint16_t table[32], even[32], odd[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
    // an 8-bit row v holds inputs 4v .. 4v + 3 of column n in bytes 4n .. 4n + 3: bf16 row 2v takes bytes 4n, 4n + 1
    even[i] = static_cast<uint16_t>(4 * (i / 2) + i % 2);
    odd[i] = static_cast<uint16_t>(even[i] + 2);
  }
  const __m512i tab = _mm512_load_si512(table), ie = _mm512_load_si512(even), io = _mm512_load_si512(odd);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* in = p.w + tile_lo * p.tile_bytes();
  for (int i = 0; i < items; ++i, in += 256, wide += 512) {
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(in + j * 64);
      const __m512i rows[2] = {_mm512_and_si512(raw, low), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low)};
      for (int h = 0; h < 2; ++h) {  // 8-bit row v = 2j + h -> bf16 rows 2v, 2v + 1
        const __m512i a = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(rows[h])), tab);
        const __m512i b = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(rows[h], 1)), tab);
        uint16_t* out = wide + (2 * (2 * j + h)) * 32;
        _mm512_store_si512(out, _mm512_permutex2var_epi16(a, ie, b));
        _mm512_store_si512(out + 32, _mm512_permutex2var_epi16(a, io, b));
      }
    }
  }
}

// One row tile of input rows (rt * 16 ..) x column tiles tile_lo .. tile_hi - 1 over all of K: items (column tile,
// group) in order; item i's product into C tile tmm(i % 2) from A tiles tmm(2 + i % 2) (v_hi) and tmm(4 + i % 2) (v_lo)
// and B tile tmm(6 + i % 2), stored one item later and scaled kLag items after its product; the 16 output rows' sums in
// named registers (an array of vectors reached by reference stays in memory, and every float load through xs or
// xsum, which may alias it, then forces a store). Rows past p.m are multiplied and never stored.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,f16c")))
void TileQ4Bf16(const Problem& p, const Acts& a, int rt, int tile_lo, int tile_hi, const uint16_t* wide) {
  constexpr int kLag = 4, kRing = 6;
  constexpr size_t kElems = kAmxRows * kGroup;  // one A or B tile: 16 rows of 32 bf16
  const int rows = std::min(kAmxRows, p.m - rt * kAmxRows), groups = p.groups;
  const int items = (tile_hi - tile_lo) * groups;
  const uint16_t* const xh = a.hi.data() + static_cast<size_t>(rt) * groups * kElems;
  const uint16_t* const xl = a.lo.data() + static_cast<size_t>(rt) * groups * kElems;
  // part 1's scale and part 0's sum of input row rt * 16 + y at [2 y * groups + g]
  const float* const xs = a.scale.data() + static_cast<size_t>(2 * rt * kAmxRows + 1) * groups;
  const float* const xsum = a.sum.data() + static_cast<size_t>(2 * rt * kAmxRows) * groups;
  alignas(64) float cbuf[kRing][kAmxRows * kTile];
  __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0, f8 = f0, f9 = f0,
         f10 = f0, f11 = f0, f12 = f0, f13 = f0, f14 = f0, f15 = f0;
  const uint16_t* const ws = p.ws + tile_lo * p.tile_scales();
  const uint16_t* const wo = p.wo ? p.wo + tile_lo * p.tile_scales() : nullptr;
  int st = tile_lo, sg = 0;  // the scale pass's next item: its column tile and group
  int g = 0;  // the next product's group
#define Q4_BF16_PRODUCT(C, Ah, Al, Bt, i)                  \
  do {                                                     \
    _tile_zero(C);                                         \
    _tile_loadd(Bt, wide + static_cast<size_t>(i) * kElems, 64); \
    _tile_loadd(Ah, xh + static_cast<size_t>(g) * kElems, 64);   \
    _tile_dpbf16ps(C, Ah, Bt);                             \
    _tile_loadd(Al, xl + static_cast<size_t>(g) * kElems, 64);   \
    _tile_dpbf16ps(C, Al, Bt);                             \
  } while (0)
#define Q4_BF16_ROW(F, R_)                                                                            \
  do {                                                                                                \
    const size_t ag = static_cast<size_t>(2 * (R_)) * groups + sg_;                                   \
    F = _mm512_fmadd_ps(_mm512_load_ps(cb + (R_) * kTile), _mm512_mul_ps(sc, _mm512_set1_ps(xs[ag])), F); \
    if (wo) F = _mm512_fmadd_ps(oc, _mm512_set1_ps(xsum[ag]), F);                                     \
  } while (0)
#define Q4_BF16_OUT(F, R_)                                                                            \
  do {                                                                                                \
    if ((R_) < rows) _mm512_mask_storeu_ps(p.y + static_cast<size_t>(out0 + (R_)) * p.n + n0, mask, F); \
    F = _mm512_setzero_ps();                                                                          \
  } while (0)
#define Q4_BF16_SCALE(i)                                                                              \
  do {                                                                                                \
    const int t_ = st, sg_ = sg;                                                                      \
    if (++sg == groups) sg = 0, ++st;                                                                 \
    const float* cb = cbuf[(i) % kRing];                                                              \
    const size_t so = static_cast<size_t>(i) * kTile;                                                 \
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + so))); \
    const __m512 oc = wo ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + so))) \
                         : _mm512_setzero_ps();                                                       \
    Q4_BF16_ROW(f0, 0); Q4_BF16_ROW(f1, 1); Q4_BF16_ROW(f2, 2); Q4_BF16_ROW(f3, 3);                   \
    Q4_BF16_ROW(f4, 4); Q4_BF16_ROW(f5, 5); Q4_BF16_ROW(f6, 6); Q4_BF16_ROW(f7, 7);                   \
    Q4_BF16_ROW(f8, 8); Q4_BF16_ROW(f9, 9); Q4_BF16_ROW(f10, 10); Q4_BF16_ROW(f11, 11);               \
    Q4_BF16_ROW(f12, 12); Q4_BF16_ROW(f13, 13); Q4_BF16_ROW(f14, 14); Q4_BF16_ROW(f15, 15);           \
    if (sg_ == groups - 1) {                                                                          \
      const int out0 = rt * kAmxRows, n0 = t_ * kTile, cols = std::min(kTile, p.n - n0);              \
      const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);         \
      Q4_BF16_OUT(f0, 0); Q4_BF16_OUT(f1, 1); Q4_BF16_OUT(f2, 2); Q4_BF16_OUT(f3, 3);                 \
      Q4_BF16_OUT(f4, 4); Q4_BF16_OUT(f5, 5); Q4_BF16_OUT(f6, 6); Q4_BF16_OUT(f7, 7);                 \
      Q4_BF16_OUT(f8, 8); Q4_BF16_OUT(f9, 9); Q4_BF16_OUT(f10, 10); Q4_BF16_OUT(f11, 11);             \
      Q4_BF16_OUT(f12, 12); Q4_BF16_OUT(f13, 13); Q4_BF16_OUT(f14, 14); Q4_BF16_OUT(f15, 15);         \
    }                                                                                                 \
  } while (0)
#define Q4_BF16_STEP(j, C, Ah, Al, Bt, Cprev)                                 \
  do {                                                                        \
    if ((j) < items) {                                                        \
      Q4_BF16_PRODUCT(C, Ah, Al, Bt, j);                                      \
      if (++g == groups) g = 0;                                               \
    }                                                                         \
    if ((j) >= 1 && (j) - 1 < items) _tile_stored(Cprev, cbuf[((j) - 1) % kRing], 64); \
    if ((j) >= kLag && (j) - kLag < items) Q4_BF16_SCALE((j) - kLag);         \
  } while (0)
  for (int i = 0; i < items + kLag; i += 2) {
    Q4_BF16_STEP(i, 0, 2, 4, 6, 1);
    Q4_BF16_STEP(i + 1, 1, 3, 5, 7, 0);
  }
#undef Q4_BF16_STEP
#undef Q4_BF16_SCALE
#undef Q4_BF16_OUT
#undef Q4_BF16_ROW
#undef Q4_BF16_PRODUCT
}
#endif  // SLIPSTREAM_X86

// ---- dispatch over (ISA, rows, tiles) -----------------------------------------------------------

using TileFn = void (*)(const Problem&, const Acts&, int, int);

template <int R, int C>
TileFn Pick(Isa isa, int parts, int bits) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512Vnni) {
    if constexpr (R % 2 == 0) {
      if (parts == 2) return bits == 4 ? &TileAvx512<R, C, 2, 4> : &TileAvx512<R, C, 2, 8>;
    }
    return bits == 4 ? &TileAvx512<R, C, 1, 4> : &TileAvx512<R, C, 1, 8>;
  }
  if constexpr (R <= 4) {
    if (isa == Isa::kAvx2) return &TileAvx2<R, C>;
  }
#endif
  if constexpr (R <= 4) return &TilePortable<R, C>;
  return nullptr;  // MicroShape gives the portable and AVX2 paths at most 4 rows
}

// Register budget: AVX-512 holds R*C int + R/P*C float accumulators in 32 zmm; AVX2 2*R*C each in 16 ymm.
constexpr int kMaxRows = 8;
constexpr int kMaxTiles = 4;

TileFn PickTile(Isa isa, int rows, int tiles, int parts, int bits) {
  static const TileFn table[4][2][2][kMaxRows][kMaxTiles] = {
#define Q8_ROW(I, P, B, R) {Pick<R, 1>(I, P, B), Pick<R, 2>(I, P, B), Pick<R, 3>(I, P, B), Pick<R, 4>(I, P, B)}
#define Q8_BITS(I, P, B) {Q8_ROW(I, P, B, 1), Q8_ROW(I, P, B, 2), Q8_ROW(I, P, B, 3), Q8_ROW(I, P, B, 4), \
                          Q8_ROW(I, P, B, 5), Q8_ROW(I, P, B, 6), Q8_ROW(I, P, B, 7), Q8_ROW(I, P, B, 8)}
#define Q8_PARTS(I, P) {Q8_BITS(I, P, 8), Q8_BITS(I, P, 4)}
#define Q8_ISA(I) {Q8_PARTS(I, 1), Q8_PARTS(I, 2)}
      Q8_ISA(Isa::kPortable), Q8_ISA(Isa::kAvx2), Q8_ISA(Isa::kAvx512), Q8_ISA(Isa::kAvx512Vnni)
#undef Q8_ISA
#undef Q8_PARTS
#undef Q8_BITS
#undef Q8_ROW
  };
  return table[static_cast<int>(isa)][parts - 1][bits == 4][rows - 1][tiles - 1];
}

// AVX-512 micro blocks (act rows x tiles, for one and for two parts) and tiles per work item, by
// CPU. This Ice Lake Xeon retires two vpdpbusd a cycle, so a block needs 10+ independent int32
// accumulators to hide the instruction's 5-cycle latency: 4 x 3 and 6 x 3 (3 input rows) against the
// 4 x 2 blocks tuned on a Zen 4 EPYC (where 4 x 2 beat 6 x 2, 5 x 2, 4 x 3 and 8 x 1), in-process A/B
// on the default model's shapes: 0.86-0.90x the time at 288 rows and 0.84-0.90x at 32 (one part),
// 0.82-0.89x and 0.80-0.84x (two parts); a 288-token mixed engine step (32 decodes + a 256-token
// chunk, with the quantizer below) 0.95x in q8_0 and 0.91x in q8_0-a16. Items of 6 tiles hold whole
// 3-tile blocks. The one-row path (4-tile blocks) is the same on both, except how far ahead it
// prefetches: on the Zen 4 EPYC, 1 KiB ahead into L1 left the one-row calls at 46-52% of the read
// bandwidth of the kernel's threads in a decode step's chain of calls; 512 bytes into L1 plus 2 KiB into L2 took the chain to
// 0.77-0.97x its time and the engine's one-slot decode step to 0.886x (q8_0) and 0.894x (q8_0-a16)
// (in-process A/Bs; L1's few miss buffers capped the reads in flight, L2 holds more).
struct Avx512Shape {
  int rows, tiles;          // one part
  int a16_rows, a16_tiles;  // two parts: act rows (pairs of an input row) x tiles
  int chunk_tiles;          // tiles (of 16 columns) per work item
  int pf_near, pf_far;      // one-row prefetch distances: bytes of each tile's stream into L1 and L2
  bool pf_nta;              // those prefetches non-temporal (measured on AMD only)
  // micro blocks of up to this many output rows prefetch their weights as the one-row block does. Without it a call
  // of 2-3 input rows (a 2-token verification; on the int8 tile path, the tail of a 9- or 17-row call) read its
  // weights with no prefetch: on the Emerald Rapids Xeon (`python -m benchmarks.kernel int8 --dispatch`'s decode-step
  // chain, prefetch_rows 3 against 1 alternated per rep, two runs) 0.80-0.89x the time inside the q8 calls at 2 rows,
  // 0.89-0.93x at 3, the same at 1. Not measured on AMD: 1 there.
  int stream_rows;
};

Avx512Shape DetectShape() {
#if defined(SLIPSTREAM_X86)
  if (rt::Cpu().amd) return {4, 2, 4, 2, 4, 512, 2048, true, 1};
#endif
  return {4, 3, 6, 3, 6, 1024, 0, false, 3};
}

const Avx512Shape kShape = DetectShape();
// The one-row prefetch distances in use (prefetch() changes them, for benchmarks)
std::atomic<int> g_pf_near{kShape.pf_near}, g_pf_far{kShape.pf_far};
std::atomic<bool> g_pf_nta{kShape.pf_nta};
std::atomic<int> g_stream_rows{kShape.stream_rows};  // prefetch_rows() changes it, for benchmarks

// The AVX2 and portable paths keep 4-tile items.
int ChunkTiles(Isa isa) { return isa == Isa::kAvx512Vnni ? kShape.chunk_tiles : 4; }

// Micro-block shape per ISA: (act rows, tiles). One input row streams 4 tiles (more loads in
// flight); several act rows reuse each weight vector from a register. rows_left is a multiple of
// parts, and so is the chosen row count.
void MicroShape(Isa isa, int rows_left, int parts, int* r, int* c) {
  if (rows_left == parts) {
    *r = parts;
    *c = isa == Isa::kAvx2 && parts == 2 ? 1 : 4;
  } else if (isa == Isa::kAvx2) {
    *r = 2;
    *c = 1;
  } else if (isa == Isa::kPortable) {
    *r = std::min(rows_left, 4);
    *c = 2;
  } else {
    *r = std::min(rows_left, parts == 2 ? kShape.a16_rows : kShape.rows);
    *c = parts == 2 ? kShape.a16_tiles : kShape.tiles;
  }
}

// ---- the work queue ------------------------------------------------------------------------------

// Which units a call runs on: the tile unit's int8 or bf16 path (AMX), and the vector path `isa` for the rest.
struct Route {
  Isa isa;  // the vector path (AVX-512 VNNI where AMX is chosen)
  bool bf16 = false, int8_tiles = false, q4_bf16 = false;
};

// One-row (decode) calls and calls of 2-3 rows stay on the vector path whatever the ISA: they stream each weight once,
// and the VNNI one-row micro kernel does less work per group than the tile path (see kInt8MinRows). route() shows
// the choice to tests.
Route RouteCall(Isa isa, int m, int parts, int bits, bool has_bf16_tiles) {
  Route r{isa};
  r.bf16 = isa == Isa::kAmx && parts == 2 && m >= g_amx_min_rows.load(std::memory_order_relaxed) && has_bf16_tiles;
  // many-row two-part calls with 4-bit weights: the int8 tile path's items on the BF16 tile unit (TileQ4Bf16)
  const bool q4 = parts == 2 && bits == 4 && m >= g_q4_bf16_min_rows.load(std::memory_order_relaxed);
  r.int8_tiles = isa == Isa::kAmx && !r.bf16 && parts >= g_int8_min_parts.load(std::memory_order_relaxed) &&
                 m >= g_int8_min_rows.load(std::memory_order_relaxed) &&
                 (m <= g_int8_max_rows.load(std::memory_order_relaxed) || q4);
  r.q4_bf16 = r.int8_tiles && q4;
  if (isa == Isa::kAmx) r.isa = Isa::kAvx512Vnni;  // the vector path of the rest
  return r;
}

struct Job {
  Problem p;
  Isa isa;           // the vector path (AVX-512 VNNI where the tile unit is chosen)
  bool bf16 = false;  // two parts, at least kAmxMinRows rows, AMX: RunItemBf16
  bool int8_tiles = false;  // AMX, g_int8_min_rows..g_int8_max_rows rows (or q4_bf16's): RunItemInt8
  bool q4_bf16 = false;  // int8_tiles, two parts, 4-bit weights, at least g_q4_bf16_min_rows rows: TileQ4Bf16
  int block_rows = kRowBlock;  // input rows per item
  Acts& acts;  // the calling thread's (thread_local, reused across calls): see Q8MatmulImpl
  explicit Job(Acts& a) : acts(a) {}
  int row_blocks, chunks, items;
  // The int8 tile path's work split: item w (a worker, one per thread) runs the chunks of segment w, a contiguous
  // range of the call's chunks, then takes what is left of the others' segments. With the chunks handed out in turn
  // (the VNNI path's split) two threads of one call each ran the tile path's items ~1.3x slower than one thread
  // alone (two threads of benchmarks/q8_tile_probe.cc's kind on one shared output: neighbouring chunks' stores;
  // contiguous halves ran at the one-thread speed); the model program's 8- and 16-token q8 calls went from 1.05x the
  // VNNI path's time to 0.83x.
  int workers = 0;
  std::unique_ptr<std::atomic<int>[]> seg_next;
  int SegBegin(int s) const { return static_cast<int>(static_cast<int64_t>(s) * chunks / workers); }
  bool f32_path = false;  // AVX2, two parts, at least kF32MinRows rows: RunItemF32
  int quant_blocks;
  std::unique_ptr<std::atomic<int>[]> row_state;  // per kQuantRows rows: 0 not quantized, 1 in progress, 2 ready

  // The rows of row block rb, quantized (rt::ClaimOnce: the threads that start on one row block, a
  // decode step's 32 rows are one, share its quantization instead of one doing it while the rest wait).
  void EnsureRows(int rb) {
    const int lo = rb * (block_rows / kQuantRows), hi = std::min(lo + block_rows / kQuantRows, quant_blocks);
    rt::ClaimOnce(row_state.get(), lo, hi, [this](int qb) {
      const int row_hi = std::min((qb + 1) * kQuantRows, p.m);
      thread_local std::vector<float> gated;
      if (p.gated) gated.resize(p.k);
      for (int row = qb * kQuantRows; row < row_hi; ++row) {
        const float* x = p.x + static_cast<size_t>(row) * p.k * (p.gated ? 2 : 1);
        if (p.gated) {
          GatedRow(isa, x, p.k, gated.data());
          x = gated.data();
        }
#if defined(SLIPSTREAM_X86)
        if (bf16) {
          SplitRowBf16(x, p.k, acts, row);
          continue;
        }
#endif
        QuantizeRow(isa, x, p.k, acts, row);
#if defined(SLIPSTREAM_X86)
        if (q4_bf16) SplitActsBf16(acts, row);
#endif
      }
    });
  }

  void RunItem(int item) {
#if defined(SLIPSTREAM_X86)
    if (workers) {
      for (int k = 0; k < workers; ++k) {
        const int s = (item + k) % workers, end = SegBegin(s + 1);
        for (int c; (c = seg_next[s].fetch_add(1, std::memory_order_relaxed)) < end;)
          for (int rb = 0; rb < row_blocks; ++rb) RunItemInt8(c, rb);
      }
      return;
    }
#endif
    const int chunk = item / row_blocks, rb = item % row_blocks;
#if defined(SLIPSTREAM_X86)
    if (f32_path) return RunItemF32(chunk, rb);
    if (bf16) return RunItemBf16(chunk, rb);
    if (int8_tiles) return RunItemInt8(chunk, rb);
#endif
    EnsureRows(rb);
    // act rows of this block
    const int row_lo = rb * kRowBlock * p.parts, row_hi = std::min((rb + 1) * kRowBlock, p.m) * p.parts;
    const int chunk_tiles = ChunkTiles(isa);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    RunVector(tile_lo, tile_hi, row_lo, row_hi);
  }

  // The vector path's micro blocks: act rows [act_lo, act_hi) (whole input rows, quantized) x column tiles
  // [tile_lo, tile_hi).
  void RunVector(int tile_lo, int tile_hi, int act_lo, int act_hi) {
    int r, c;
    for (int t = tile_lo; t < tile_hi; t += c) {
      MicroShape(isa, act_hi - act_lo, p.parts, &r, &c);
      c = std::min(c, tile_hi - t);
      for (int row = act_lo; row < act_hi; row += r) {
        const int rows = std::min(r, act_hi - row);
        PickTile(isa, rows, c, p.parts, p.bits)(p, acts, row, t);
      }
    }
  }

#if defined(SLIPSTREAM_X86)
  // AMX-BF16 (see TileBf16): the chunk's column tiles against the block's row tiles, in 2 x 2 blocks (column
  // pairs outer: a pair's B panel serves every row tile of the block from L2).
  void RunItemBf16(int chunk, int rb) {
    EnsureRows(rb);
    const int row_lo = rb * block_rows, row_hi = std::min(row_lo + block_rows, p.m);
    const int rt_lo = row_lo / kAmxRows, rt_hi = (row_hi + kAmxRows - 1) / kAmxRows;
    const int chunk_tiles = ChunkTiles(isa);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    AmxBeginBf16();
    for (int t = tile_lo; t < tile_hi; t += 2) {
      const bool two_cols = t + 1 < tile_hi;
      for (int rt = rt_lo; rt < rt_hi; rt += 2) {
        const bool two_rows = rt + 1 < rt_hi;
        if (two_rows && two_cols) TileBf16<2, 2>(p, acts, rt, t);
        else if (two_rows) TileBf16<2, 1>(p, acts, rt, t);
        else if (two_cols) TileBf16<1, 2>(p, acts, rt, t);
        else TileBf16<1, 1>(p, acts, rt, t);
      }
    }
    AmxEnd();
  }

  // AMX-INT8 (see TileInt8): each of the block's act row tiles against each of the chunk's column tiles, one
  // 16 x 16 output block at a time (the chunk's B panel stays in L1/L2 across the row tiles). A last row tile of
  // fewer act rows runs on tiles of its rows (the configuration's), or, when it holds fewer than g_int8_min_rows
  // input rows after whole ones (Int8Tail), on the vector path right after, while the chunk's weights are in cache.
  void RunItemInt8(int chunk, int rb) {
    EnsureRows(rb);
    const int row_lo = rb * block_rows, row_hi = std::min(row_lo + block_rows, p.m);
    if (q4_bf16) return RunItemQ4Bf16(chunk, row_lo, row_hi);
    const int tail = Int8Tail(row_hi - row_lo, p.parts);
    const int act_lo = row_lo * p.parts, act_hi = (row_hi - tail) * p.parts;  // act_lo: a multiple of 16
    const int chunk_tiles = ChunkTiles(isa);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    int configured = 0;  // the act rows of the loaded tile configuration
    for (int at0 = act_lo; at0 < act_hi; at0 += kAmxRows) {
      const int rows = std::min(kAmxRows, act_hi - at0);  // a multiple of p.parts
      if (rows != configured) AmxBeginInt8(configured = rows);
      PickTileInt8(p.parts, p.bits, rows, p.wo != nullptr)(p, acts, at0, tile_lo, tile_hi);
    }
    if (configured) AmxEnd();
    if (tail) RunVector(tile_lo, tile_hi, act_hi, row_hi * p.parts);
  }

  // Many rows, 4-bit weights (see TileQ4Bf16): the chunk's B tiles widened to bf16 once, then each row tile of the
  // block against them.
  void RunItemQ4Bf16(int chunk, int row_lo, int row_hi) {
    const int chunk_tiles = ChunkTiles(isa);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    thread_local std::vector<uint16_t> panel;
    panel.resize(static_cast<size_t>(tile_hi - tile_lo) * p.groups * kAmxRows * kGroup + 32);
    uint16_t* const wide = panel.data() + (-reinterpret_cast<uintptr_t>(panel.data()) & 63) / 2;
    WidenChunkBf16(p, tile_lo, tile_hi, wide);
    AmxBeginBf16();
    for (int rt = row_lo / kAmxRows; rt < (row_hi + kAmxRows - 1) / kAmxRows; ++rt)
      TileQ4Bf16(p, acts, rt, tile_lo, tile_hi, wide);
    AmxEnd();
  }

  // The AVX2 two-part path (see DequantTileAvx2): x unquantized, each tile widened once per item.
  void RunItemF32(int chunk, int rb) {
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(p.kp) * kTile);
    const int row_lo = rb * kRowBlock, row_hi = std::min(row_lo + kRowBlock, p.m);
    const int rows = row_hi - row_lo, blocks = (rows + kF32Rows - 1) / kF32Rows;
    const int base = rows / blocks, extra = rows % blocks;
    const int chunk_tiles = ChunkTiles(isa);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    for (int t = tile_lo; t < tile_hi; ++t) {
      DequantTileAvx2(p, t, buf.data());
      for (int i = 0, row = row_lo; i < blocks; ++i) {  // micro blocks of near-equal height
        const int r = base + (i < extra);
        kTileF32Avx2[r - 1](p, buf.data(), row, t);
        row += r;
      }
    }
  }
#endif

};

// profile(True) records each call's (start, end) on the steady clock in ns, its rows and its weight
// bytes, until profile(False): benchmarks/int8_matmul_bench.py splits a decode step's time into the
// kernel's calls and what XLA does between them. Off, a call pays one relaxed load.
std::atomic<bool> g_profile{false};
std::mutex g_profile_mu;
std::vector<std::array<int64_t, 4>> g_calls;  // guarded by g_profile_mu

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic<int> g_max_threads{0};  // 0: the pool's thread count (a test and benchmark knob)

// A large output (the LM head over many rows: 256 x 49152 f32 is 50 MB) is usually fresh memory
// from mmap, so the first write to each 4 KiB page faults; asking for transparent huge pages turns
// ~12k faults into ~25.
void AdviseHugePages(void* data, size_t bytes) {
  if (bytes >= 8 * rt::kHugePage) rt::AdviseHugePages(rt::HugeAligned(data, bytes));
}

// rows: null (every row), or [begin, end): only those rows of x are multiplied and written to y (the others of y
// are left as they are: the caller's other kernel writes them). A row's output is the same either way.
ffi::Error Q8MatmulRun(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                       ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> offsets, ffi::Buffer<ffi::U16> tiles,
                       ffi::Buffer<ffi::S32> layer, const int32_t* rows,
                       ffi::ResultBuffer<ffi::F32> y, int32_t parts, int32_t gated, int32_t bits) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  // packed and scales (and offsets) are one weight [T, W], or a stack of L weights [L, T, W] of which
  // `layer` picks one (a scanned layer loop passes the whole stack: no slice of it is copied)
  const size_t rank = wd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank || yd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "q8_matmul: x [M,K], packed [(L,) Np/16, Kp*16], scales [(L,) Np/16, Kp/2], tiles [(L,) Np/16, Kp*32] or [0], "
        "layer [] or [1], y [M,N]");
  if (parts != 1 && parts != 2) return ffi::Error::InvalidArgument("q8_matmul: parts must be 1 or 2");
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("q8_matmul: bits must be 8 or 4");
  if (gated != 0 && (gated != 1 || xd[1] % 2))
    return ffi::Error::InvalidArgument("q8_matmul: gated must be 0 or 1, and a gated x [M, 2K]");
  const int64_t stack = rank == 3 ? wd[0] : 1;
  const int64_t index = rank == 3 ? layer.typed_data()[0] : 0;
  if (index < 0 || index >= stack) return ffi::Error::InvalidArgument("q8_matmul: layer index out of range");
  const size_t lw = rank - 2;  // the first of the two weight dimensions
  // The quantized activations live in a buffer of the calling thread, kept between calls (no
  // allocation, page faults or zeroing per call). Helpers use it only while this call waits for them.
  const bool profile = g_profile.load(std::memory_order_relaxed);
  const int64_t start = profile ? NowNs() : 0;
  thread_local Acts tl_acts;
  Job job(tl_acts);
  Problem& p = job.p;
  p.m = static_cast<int>(xd[0]);
  p.k = static_cast<int>(gated ? xd[1] / 2 : xd[1]);
  p.gated = gated != 0;
  p.tiles = static_cast<int>(wd[lw]);
  p.bits = bits;
  p.kp = static_cast<int>(wd[lw + 1] * 8 / bits / kTile);
  p.groups = p.kp / kGroup;
  p.n = static_cast<int>(yd[1]);
  p.parts = parts;
  if (yd[0] != xd[0] || (wd[lw + 1] * 8 / bits) % (kTile * kGroup) || sd[lw] != wd[lw] || sd[lw + 1] != int64_t(p.groups) * kTile ||
      (rank == 3 && sd[0] != wd[0]) || p.k > p.kp || p.k + kGroup <= p.kp || p.n > p.tiles * kTile ||
      p.n + kTile <= p.tiles * kTile ||
      (offsets.element_count() != 0 && offsets.element_count() != scales.element_count()) ||
      (tiles.element_count() != 0 &&
       tiles.element_count() != static_cast<size_t>(stack) * p.tiles * p.groups * 2 * kTile * kGroup))
    return ffi::Error::InvalidArgument("q8_matmul: packed weight, scales, offsets, x and y shapes disagree");
  int64_t begin = 0;
  if (rows) {
    begin = std::clamp<int64_t>(rows[0], 0, p.m);
    p.m = static_cast<int>(std::clamp<int64_t>(rows[1], begin, p.m) - begin);
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const size_t weight_bytes = static_cast<size_t>(p.tiles) * p.tile_bytes();
  const size_t weight_scales = static_cast<size_t>(p.tiles) * p.tile_scales();
  p.x = x.typed_data() + begin * xd[1];
  p.w = packed.typed_data() + index * weight_bytes;
  p.ws = scales.typed_data() + index * weight_scales;
  p.wo = offsets.element_count() ? offsets.typed_data() + index * weight_scales : nullptr;
  p.wt = tiles.element_count() ? tiles.typed_data() + index * static_cast<size_t>(p.tiles) * p.tile_bf16() : nullptr;
  p.y = y->typed_data() + begin * p.n;
  p.pf_near = g_pf_near.load(std::memory_order_relaxed);
  p.pf_far = g_pf_far.load(std::memory_order_relaxed);
  p.pf_nta = g_pf_nta.load(std::memory_order_relaxed);
  p.stream_rows = g_stream_rows.load(std::memory_order_relaxed);
  const Route route = RouteCall(g_isa.get(), p.m, parts, bits, p.wt != nullptr);
  job.isa = route.isa;
  job.bf16 = route.bf16;
  job.int8_tiles = route.int8_tiles;
  job.q4_bf16 = route.q4_bf16;
  if (job.bf16) job.block_rows = kBf16BlockRows;
  if (job.int8_tiles) job.block_rows = kAmxBlockRows;
#if defined(SLIPSTREAM_X86)
  job.f32_path = job.isa == Isa::kAvx2 && parts == 2 && p.m >= kF32MinRows;
#endif
  AdviseHugePages(p.y, static_cast<size_t>(p.m) * p.n * sizeof(float));
  Acts& a = job.acts;
  a.kp = p.kp;
  a.groups = p.groups;
  a.parts = parts;
  // the widened AVX2 path reads x itself; the tile unit reads whole 16-row tiles (the rows past m unused)
  if (job.bf16) a.ResizeBf16((p.m + kAmxRows - 1) / kAmxRows * kAmxRows);  // whole tiles (the rows past m unused)
  else if (job.int8_tiles) a.Resize((p.m + kAmxRows - 1) / kAmxRows * kAmxRows);  // whole 16-act-row tiles
  if (job.q4_bf16) a.ResizeBf16((p.m + kAmxRows - 1) / kAmxRows * kAmxRows);  // whole 16-input-row A tiles
  else if (!job.f32_path) a.Resize(p.m);
#if defined(SLIPSTREAM_X86)
  thread_local std::vector<float> gated_x;  // that path's input, formed whole here when gated
  if (job.f32_path && p.gated) {
    gated_x.resize(static_cast<size_t>(p.m) * p.k);
    for (int row = 0; row < p.m; ++row)
      GatedRow(job.isa, p.x + static_cast<size_t>(row) * 2 * p.k, p.k, gated_x.data() + static_cast<size_t>(row) * p.k);
    p.x = gated_x.data();
    p.gated = false;
  }
#endif
  job.row_blocks = (p.m + job.block_rows - 1) / job.block_rows;
  job.chunks = (p.tiles + ChunkTiles(job.isa) - 1) / ChunkTiles(job.isa);
  job.items = job.row_blocks * job.chunks;
  if (job.int8_tiles) {
    const int64_t pool_threads = std::max<int64_t>(1, pool.num_threads());
    const int64_t cap = g_max_threads.load(std::memory_order_relaxed);
    const int64_t threads = cap > 0 ? std::min(cap, pool_threads) : pool_threads;
    job.workers = static_cast<int>(std::min<int64_t>(threads, job.chunks));
    job.seg_next.reset(new std::atomic<int>[job.workers]);
    for (int s = 0; s < job.workers; ++s) job.seg_next[s].store(job.SegBegin(s));
    job.items = job.workers;
  }
  job.quant_blocks = (p.m + kQuantRows - 1) / kQuantRows;
  job.row_state.reset(new std::atomic<int>[job.quant_blocks]);
  for (int i = 0; i < job.quant_blocks; ++i) job.row_state[i].store(0);

  rt::ParallelFor(pool, job.items, g_max_threads.load(std::memory_order_relaxed),
                  [&job](int64_t item) { job.RunItem(static_cast<int>(item)); });
  if (profile) {
    const int64_t end = NowNs();
    std::lock_guard<std::mutex> lock(g_profile_mu);
    g_calls.push_back({start, end, p.m, static_cast<int64_t>(weight_bytes)});
  }
  return ffi::Error::Success();
}

ffi::Error Q8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> offsets, ffi::Buffer<ffi::U16> tiles,
                        ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> y, int32_t parts, int32_t gated, int32_t bits) {
  return Q8MatmulRun(pool, x, packed, scales, offsets, tiles, layer, nullptr, y, parts, gated, bits);
}

// y_in: y's previous contents (aliased to y by the caller: the rows outside `rows` keep them), or [0] (none)
ffi::Error Q8MatmulRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                            ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> offsets, ffi::Buffer<ffi::U16> tiles,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> y_in,
                            ffi::ResultBuffer<ffi::F32> y, int32_t parts, int32_t gated, int32_t bits) {
  if (rows.element_count() != 2) return ffi::Error::InvalidArgument("q8_matmul: rows is [begin, end)");
  if (y_in.element_count() != 0 && y_in.element_count() != y->element_count())
    return ffi::Error::InvalidArgument("q8_matmul: y_in is y's shape, or [0]");
  return Q8MatmulRun(pool, x, packed, scales, offsets, tiles, layer, rows.typed_data(), y, parts, gated, bits);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamQ8Matmul, Q8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [Np/16, Kp/32*16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // offsets like scales, or [0]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // tiles [(L,) Np/16, Kp/32*1024] bf16 bits, or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer: which of a stack [L, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int32_t>("parts")        // int8 parts per activation
                                  .Attr<int32_t>("gated")        // 1: x is gate | up, the input silu(gate) * up
                                  .Attr<int32_t>("bits"));       // 8, or 4: two weights per packed byte

// The same on rows [begin, end) of x only (a step's rows of one kind: quantization/layer_forms.py's StackedHybrid)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamQ8MatmulRows, Q8MatmulRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [Np/16, Kp/32*16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // offsets like scales, or [0]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // tiles, or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer: which of a stack [L, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows [2]: begin, end (clamped to [0, M])
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y_in [M, N] aliased to y, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]: rows outside [begin, end) unwritten
                                  .Attr<int32_t>("parts")
                                  .Attr<int32_t>("gated")
                                  .Attr<int32_t>("bits"));

// ---- Python module: targets(), isa(), set_isa() (runtime/module.h) and the tuning setters --------

// threading(max_threads) -> the previous max_threads (0: the pool's size); negative keeps it. For tests
// of the thread policy: which thread runs which item must not change an output.
static PyObject* ThreadingPy(PyObject*, PyObject* args) {
  int max_threads = -1;
  if (!PyArg_ParseTuple(args, "|i", &max_threads)) return nullptr;
  const int prev = g_max_threads.load();
  if (max_threads >= 0) g_max_threads.store(max_threads);
  return PyLong_FromLong(prev);
}

// prefetch(near, far) -> the previous (near, far): the one-row path's prefetch distances in bytes of
// each weight tile's stream, into L1 and into L2 (far 0: none); a negative argument keeps that
// setting. For benchmarks (benchmarks/int8_matmul_bench.py compares them in one process).
static PyObject* PrefetchPy(PyObject*, PyObject* args) {
  int near = -1, far = -1;
  if (!PyArg_ParseTuple(args, "|ii", &near, &far)) return nullptr;
  PyObject* prev = Py_BuildValue("(ii)", g_pf_near.load(), g_pf_far.load());
  if (near > 4096 || far > 16384) {
    Py_XDECREF(prev);
    PyErr_SetString(PyExc_ValueError, "prefetch: near <= 4096 and far <= 16384 bytes");
    return nullptr;
  }
  if (near >= 0) g_pf_near.store(near / 64 * 64);
  if (far >= 0) g_pf_far.store(far / 64 * 64);
  return prev;
}

// amx_rows(int8_min, int8_max, int8_parts, bf16_min) -> the previous four: calls of int8_min..int8_max rows with at
// least int8_parts parts run on the int8 tile unit, and two-part calls of at least bf16_min rows whose weight comes
// with its pack_tiles on the bf16 one; a negative argument keeps that setting. For tests (every row count on the
// tile unit) and benchmarks measuring the crossover against VNNI.
static PyObject* AmxRowsPy(PyObject*, PyObject* args) {
  int lo = -1, hi = -1, parts = -1, bf16 = -1;
  if (!PyArg_ParseTuple(args, "|iiii", &lo, &hi, &parts, &bf16)) return nullptr;
  PyObject* prev = Py_BuildValue("(iiii)", g_int8_min_rows.load(), g_int8_max_rows.load(), g_int8_min_parts.load(),
                                 g_amx_min_rows.load());
  if (lo >= 0) g_int8_min_rows.store(std::max(lo, 1));
  if (hi >= 0) g_int8_max_rows.store(hi);
  if (parts >= 0) g_int8_min_parts.store(std::max(std::min(parts, 2), 1));
  if (bf16 >= 0) g_amx_min_rows.store(std::max(bf16, 1));
  return prev;
}

// q4_bf16_rows(min) -> the previous min: two-part calls with 4-bit weights of at least min rows run on the bf16 tile
// unit with the VNNI path's integers (TileQ4Bf16); a negative argument keeps it. For tests and benchmarks.
static PyObject* Q4Bf16RowsPy(PyObject*, PyObject* args) {
  int lo = -1;
  if (!PyArg_ParseTuple(args, "|i", &lo)) return nullptr;
  PyObject* prev = PyLong_FromLong(g_q4_bf16_min_rows.load());
  if (lo >= 0) g_q4_bf16_min_rows.store(std::max(lo, 1));
  return prev;
}

// route(rows, parts, bf16_tiles, bits) -> the paths a call of that many input rows takes now (the ISA chosen,
// amx_rows(), q4_bf16_rows()): "amx_bf16", "amx_q4_bf16" (4-bit weights, TileQ4Bf16), "amx_int8",
// "amx_int8 + avx512_vnni" (the int8 tile path with its last rows on VNNI, Int8Tail), or the
// vector path's ISA ("avx512_vnni", "avx2", "portable"). Tests check the dispatch with it, without timing.
static PyObject* RoutePy(PyObject*, PyObject* args) {
  int rows = 0, parts = 0, bf16_tiles = 0, bits = 8;
  if (!PyArg_ParseTuple(args, "ii|pi", &rows, &parts, &bf16_tiles, &bits)) return nullptr;
  if (rows < 1 || (parts != 1 && parts != 2) || (bits != 4 && bits != 8)) {
    PyErr_SetString(PyExc_ValueError, "route: rows >= 1, parts 1 or 2, bits 4 or 8");
    return nullptr;
  }
  const Route r = RouteCall(g_isa.get(), rows, parts, bits, bf16_tiles != 0);
  if (r.bf16) return PyUnicode_FromString("amx_bf16");
  if (r.q4_bf16) return PyUnicode_FromString("amx_q4_bf16");
  if (r.int8_tiles) {
    const int last = rows - (rows - 1) / kAmxBlockRows * kAmxBlockRows;  // input rows of the last row block
    return PyUnicode_FromString(Int8Tail(last, parts) ? "amx_int8 + avx512_vnni" : "amx_int8");
  }
  return PyUnicode_FromString(rt::IsaName(r.isa));
}

// prefetch_rows(rows) -> the previous: micro blocks of up to `rows` output rows (1..kMaxStreamRows) prefetch their
// weights as the one-row path does; a negative argument keeps it. For benchmarks (and tests: no output changes).
static PyObject* PrefetchRowsPy(PyObject*, PyObject* args) {
  int rows = -1;
  if (!PyArg_ParseTuple(args, "|i", &rows)) return nullptr;
  if (rows == 0 || rows > kMaxStreamRows) {
    PyErr_Format(PyExc_ValueError, "prefetch_rows: 1..%d output rows (negative: keep)", kMaxStreamRows);
    return nullptr;
  }
  const int prev = g_stream_rows.load();
  if (rows > 0) g_stream_rows.store(rows);
  return PyLong_FromLong(prev);
}

// nontemporal(on) -> the previous setting: the one-row path's weight prefetches non-temporal.
static PyObject* NontemporalPy(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  return PyBool_FromLong(g_pf_nta.exchange(on != 0));
}

// profile(on) -> the calls recorded since the last profile() call, as (start_ns, end_ns, rows,
// weight_bytes) tuples; then records from now on if `on`.
static PyObject* ProfilePy(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  std::vector<std::array<int64_t, 4>> calls;
  {
    std::lock_guard<std::mutex> lock(g_profile_mu);
    calls.swap(g_calls);
    g_profile.store(on != 0);
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(calls.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto& c = calls[i];
    PyObject* t = Py_BuildValue("(LLLL)", static_cast<long long>(c[0]), static_cast<long long>(c[1]),
                                static_cast<long long>(c[2]), static_cast<long long>(c[3]));
    if (!t) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), t);
  }
  return list;
}

PyMODINIT_FUNC PyInit__q8_matmul() {
  static rt::ModuleSpec spec{
      "_q8_matmul", "Group-wise int8 (Q8_0) matmul for XLA:CPU through the FFI.",
      {{"slipstream_q8_matmul", reinterpret_cast<void*>(SlipstreamQ8Matmul)},
       {"slipstream_q8_matmul_rows", reinterpret_cast<void*>(SlipstreamQ8MatmulRows)}},
      &g_isa,
      {{"profile", ProfilePy, METH_O,
        "profile(on): the calls recorded so far as (start_ns, end_ns, rows, weight_bytes); records from now on "
        "if on."},
       {"threading", ThreadingPy, METH_VARARGS,
        "threading(max_threads): at most this many threads per call (0: the pool's; negative: keep); returns "
        "the previous."},
       {"prefetch", PrefetchPy, METH_VARARGS,
        "prefetch(near, far): the one-row prefetch distances in bytes, into L1 and L2 (negative: keep); returns "
        "the previous."},
       {"amx_rows", AmxRowsPy, METH_VARARGS,
        "amx_rows(int8_min, int8_max, int8_parts, bf16_min): calls of int8_min..int8_max rows with at least "
        "int8_parts parts run on the int8 tile unit, two-part calls of at least bf16_min rows with tiles on the "
        "bf16 one (negative: keep); returns the previous four."},
       {"q4_bf16_rows", Q4Bf16RowsPy, METH_VARARGS,
        "q4_bf16_rows(min): two-part calls with 4-bit weights of at least min rows run on the bf16 tile unit with "
        "the VNNI path's integers (negative: keep); returns the previous min."},
       {"prefetch_rows", PrefetchRowsPy, METH_VARARGS,
        "prefetch_rows(rows): micro blocks of up to rows output rows prefetch their weights as the one-row path does "
        "(negative: keep); returns the previous."},
       {"route", RoutePy, METH_VARARGS,
        "route(rows, parts, bf16_tiles=False, bits=8): the paths a call of that many input rows takes now, e.g. "
        "'avx512_vnni', 'amx_int8', 'amx_int8 + avx512_vnni' (its last rows on VNNI), 'amx_q4_bf16', 'amx_bf16'."},
       {"nontemporal", NontemporalPy, METH_O,
        "nontemporal(on): the one-row path's weight prefetches non-temporal (PREFETCHNTA); returns the "
        "previous."}}};
  return rt::CreateModule(spec);
}
