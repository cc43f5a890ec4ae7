// Per-output-channel int8 matmul as an XLA FFI custom call on CPU.
//
//   acc_p[m, n] = sum_k xq_p[m, k] * w[n, k]                 int32 over all of K (exact)
//   y[m, n] = (f32(acc_0) * xs_0[m]) * ws[n]                                        one part
//   y[m, n] = (f32(acc_0) * xs_0[m] + f32(acc_1) * xs_1[m]) * ws[n]                 two parts
//   y[m, n] = (two parts) + (f32(acc_r) * xs_0[m]) * ws_r[n]       two parts and a residual weight r (its own scales
//             ws_r and colsum; acc_r = sum_k xq_0[m, k] * r[n, k]): int8-channel-w16, the target _residual
//
// w: symmetric int8 weights (q in -127..127) with one f32 scale ws per output column, prepacked at load
// (kernels/int8_channel_matmul.py, pack()) as
//   packed  s8  [Np/16][Kp/4][16][4]   16 columns x 4 inputs in one 64-byte vector (vpdpbusd's operand), and
//                                      16 such rows (64 inputs) are one AMX B tile: one layout for both paths
//   scales  f32 [Np]
//   colsum  s32 [Np]                   sum_k w[n, k], for the +128 shift below
// (Np, Kp: N rounded up to 16, K to 64; padding is zero weight and zero scale).
// x is quantized per row (token) over its whole K: xs_0 = max|x| / 127, xq_0 = round-half-even(x / xs_0) in
// [-127, 127]; with two parts the residual r = x - xq_0 * xs_0 again with xs_1 = xs_0 / 254 (|r| <= xs_0 / 2, so
// xq_1 fits in [-127, 127]): ~15-bit activations for twice the products.
//
// vpdpbusd and tdpbusd multiply unsigned by signed bytes: the activations are the unsigned side, stored
// xq + 128, and the weights the signed side as they are, so each sum carries 128 * colsum[n], subtracted
// exactly in int32 before the float steps.
//
// Why bit-identical outputs at every row count: the int32 sums are exact whichever unit forms them, and the
// float steps after them are one fixed sequence (Finish / FinishPortable) on every path, compiled without
// contraction into fma (setup.py builds this file with -ffp-contract=off). So a row's output is the same in a
// one-row decode, a 256-row prefill chunk, on VNNI or on AMX: speculative decoding and batch invariance rely
// on it. kernels/int8_channel_matmul.py's numpy reference computes the same operations in the same order and
// equals the kernel bit for bit.
//
// Grouped target (a sparse MoE layer's experts): x's rows sorted by group, each group times its own weight of a stack,
// the groups one after another in one call, each multiplied as a call of its rows alone (no padded rows, one XLA op).
//
// Work split: items of (chunk of column tiles, block of input rows) are claimed from an atomic counter
// (runtime/parallel.h), column-chunk major so that a chunk's weights come from memory once and serve every row block
// from cache; an item first makes sure its row block is quantized (groups of kQuantRows rows, shared by the items
// that start on it: EnsureRows).
// VNNI: chunks of kChunkTiles; micro blocks of R act rows x C column tiles over all of K in zmm accumulators. AMX
// (calls of at least g_amx_min_rows input rows; one-row decode, bound by reading the weights, stays on VNNI): chunks
// of up to kAmxChunkTiles, row tile pairs outer and column pairs inner, in 2 x 2 blocks of 16 x 16 C tiles (tmm0-3)
// from A tiles of 16 act rows x 64 inputs (tmm4-5) and B tiles of 64 inputs x 16 columns (tmm6-7) over all of K,
// each C tile stored once.
#include <Python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "runtime/huge_pages.h"
#include "runtime/isa.h"
#include "runtime/module.h"
#include "runtime/parallel.h"

namespace ffi = xla::ffi;
namespace rt = slipstream::runtime;
using rt::Isa;

namespace {

constexpr int kTile = 16;        // columns per packed tile
constexpr int kStep = 64;        // K is padded to this: one AMX tile's inputs
constexpr int kAmxRows = 16;     // act rows per A tile
constexpr int kChunkTiles = 6;   // column tiles per VNNI work item
constexpr int kAmxChunkTiles = 48;  // at most this many column tiles per AMX work item (see Split)
constexpr int kRowBlock = 64;    // input rows per VNNI work item
constexpr int kAmxBlock = 256;   // input rows per AMX work item
constexpr int kQuantRows = 4;    // input rows per quantization item
constexpr int kMaxK = 65536;     // 255 * 127 * K stays below 2^31
constexpr float kInt8Max = 127.0f;
constexpr float kLoSteps = 254.0f;  // the second part's scale: xs_0 / 254

rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx512Vnni, Isa::kAmx};
// From this many input rows a call runs on the tile unit (where it is chosen; its outputs are the VNNI path's, so
// this changes speed only). Measured on a Xeon Emerald Rapids (2 cores, the default model's five layer shapes,
// `python -m benchmarks.kernel int8 --channel --rows 1,2,4,8,16`): the tile unit even with VNNI at 1-2 rows, even
// or ahead from 4 (0.82-1.06x the time with one part, 0.63-0.95x with two), 0.42-0.90x at 8, 0.34-0.81x at 16.
constexpr int kAmxMinRows = 4;
std::atomic<int> g_amx_min_rows{kAmxMinRows};  // amx_rows() changes it, for tests and benchmarks
std::atomic<int> g_max_threads{0};             // threading(): 0 is the pool's size

struct Problem {
  const float* x;
  int m, k, kp, n, tiles, parts;
  const int8_t* w;
  const float* ws;
  const int32_t* colsum;
  // the residual weight (int8-channel-w16): the same layout, times the activations' first part; null when absent
  const int8_t* wr = nullptr;
  const float* wsr = nullptr;
  const int32_t* colsumr = nullptr;
  float* y;
  size_t tile_bytes() const { return static_cast<size_t>(kp) * kTile; }
};

// Cache-line aligned storage: an A tile row (64 bytes) that straddles two lines costs the tile load twice the line
// reads (std::vector's own storage is 16-byte aligned: it took one thread's 256-row tile loop to ~0.65x its rate).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* q, size_t) { ::operator delete(q, std::align_val_t{64}); }
  bool operator==(const LineAligned&) const { return true; }
  bool operator!=(const LineAligned&) const { return false; }
};

// Quantized activations: act row m * parts + p holds part p of input row m as xq + 128; xs its scale. Laid out in
// A tiles: [act row / 16][Kp / 64][act row % 16][64], so that one A tile (16 act rows x 64 inputs) is 1 KiB in a
// row and a row tile's tiles follow each other along K. Rows past m * parts (to whole tiles) hold xq = 0, scale 0.
struct Acts {
  std::vector<uint8_t, LineAligned<uint8_t>> u;
  std::vector<float> xs;
};

// Act row `ar`'s first 64 inputs; its inputs k..k+63 (k a multiple of 64) lie k / 64 * kTileBytes further on.
constexpr size_t kTileBytes = kAmxRows * kStep;
inline size_t ActRow(int ar, int kp) {
  return (static_cast<size_t>(ar / kAmxRows) * (kp / kStep)) * kTileBytes + (ar % kAmxRows) * kStep;
}

// ---- quantization (the same operations on every path) ----------------------------------------------

inline int Clamp127(float v) {
  const int q = static_cast<int>(std::nearbyint(v));
  return std::min(127, std::max(-127, q));
}

void QuantizeRowPortable(const float* x, int k, int kp, int parts, uint8_t* u, float* xs) {
  float amax = 0.0f;
  for (int i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  float s = amax / kInt8Max;
  for (int p = 0; p < parts; ++p) {
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    uint8_t* row = u + static_cast<size_t>(p) * kp;
    for (int i = 0; i < k; ++i) {
      float v = x[i];
      if (p == 1) {  // the residual of part 0, recomputed from its integer
        const float prod = static_cast<float>(static_cast<int>(u[i]) - 128) * xs[0];
        v = v - prod;
      }
      row[i] = static_cast<uint8_t>(Clamp127(v * inv) + 128);
    }
    std::memset(row + k, 128, kp - k);
    xs[p] = s;
    s = s / kLoSteps;
  }
}

#if defined(SLIPSTREAM_X86)
// Four vectors of round(v) (int32) -> their 64 bytes in order, each clamped to -127..127 and stored as xq + 128.
// The packs saturate to -128..127; max_epi8 then lifts -128 to -127: the same clamp as Clamp127's.
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512i PackActs(const __m512i* q) {
  // packs_epi32 then packs_epi16 leave 128-bit lane l holding inputs 4l..4l+3 of each of the four vectors in turn
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
  const __m512i c = _mm512_max_epi8(_mm512_permutexvar_epi32(order, b), _mm512_set1_epi8(-127));
  return _mm512_xor_si512(c, _mm512_set1_epi8(static_cast<char>(0x80)));  // xq ^ 0x80 is xq + 128 as a u8
}

// 64 inputs from x (the first `valid` of them; the rest read as 0) -> P parts' A tile rows at dst[p].
template <int P, bool kFull>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void QuantizeStep(
    const float* x, int valid, __m512 inv0, __m512 inv1, __m512 vs0, uint8_t* dst0, uint8_t* dst1) {
  __m512i q0[4], q1[4];
  for (int v = 0; v < 4; ++v) {
    __m512 xv;
    if constexpr (kFull) {
      xv = _mm512_loadu_ps(x + v * 16);
    } else {
      const int left = valid - v * 16;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      xv = _mm512_maskz_loadu_ps(mask, x + v * 16);
    }
    q0[v] = _mm512_cvtps_epi32(_mm512_mul_ps(xv, inv0));  // round half to even (MXCSR's default)
    if constexpr (P == 2) {  // the residual of part 0 (clamped first, as Clamp127)
      const __m512i c0 = _mm512_min_epi32(_mm512_max_epi32(q0[v], _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      const __m512 r = _mm512_sub_ps(xv, _mm512_mul_ps(_mm512_cvtepi32_ps(c0), vs0));
      q1[v] = _mm512_cvtps_epi32(_mm512_mul_ps(r, inv1));
    }
  }
  _mm512_store_si512(dst0, PackActs(q0));
  if constexpr (P == 2) _mm512_store_si512(dst1, PackActs(q1));
}

// The same operations as QuantizeRowPortable, 64 inputs at a time, each part's 64 bytes stored straight into its A
// tile row: dst[p] is act row (row * parts + p)'s first 64 inputs (ActRow); the padding past k gets xq = 0.
template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void QuantizeRowAvx512(const float* x, int k, int kp, uint8_t* const* dst, float* xs) {
  __m512 vmax[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int i = 0;
  for (; i + 64 <= k; i += 64)  // four chains: max's latency
    for (int v = 0; v < 4; ++v) vmax[v] = _mm512_max_ps(vmax[v], _mm512_abs_ps(_mm512_loadu_ps(x + i + 16 * v)));
  for (; i + 16 <= k; i += 16) vmax[0] = _mm512_max_ps(vmax[0], _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vmax[0], vmax[1]), _mm512_max_ps(vmax[2], vmax[3])));
  for (; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s0 = amax / kInt8Max, s1 = s0 / kLoSteps;
  xs[0] = s0;
  if constexpr (P == 2) xs[1] = s1;
  const __m512 inv0 = _mm512_set1_ps(s0 > 0.0f ? 1.0f / s0 : 0.0f), inv1 = _mm512_set1_ps(s1 > 0.0f ? 1.0f / s1 : 0.0f);
  const __m512 vs0 = _mm512_set1_ps(s0);
  int k0 = 0;
  for (; k0 + kStep <= k; k0 += kStep) {
    const size_t at = static_cast<size_t>(k0 / kStep) * kTileBytes;
    QuantizeStep<P, true>(x + k0, kStep, inv0, inv1, vs0, dst[0] + at, dst[1] + at);
  }
  for (; k0 < kp; k0 += kStep) {
    const size_t at = static_cast<size_t>(k0 / kStep) * kTileBytes;
    QuantizeStep<P, false>(x + k0, k - k0, inv0, inv1, vs0, dst[0] + at, dst[1] + at);
  }
}
#endif

// ---- the float steps after the int32 sums --------------------------------------------------------

inline float FinishPortable(int32_t acc0, int32_t acc1, int32_t corr, float xs0, float xs1, float ws, int parts) {
  float f = static_cast<float>(acc0 - corr) * xs0;
  if (parts == 2) f = f + static_cast<float>(acc1 - corr) * xs1;
  return f * ws;
}

// The residual weight's term, added to Finish's output f: f + (f32(accr - corr_r) * xs0) * ws_r (the sum of the
// two calls it replaces, in their order).
inline float AddResidualPortable(float f, int32_t accr, int32_t corrr, float xs0, float wsr) {
  const float g = static_cast<float>(accr - corrr) * xs0;
  return f + g * wsr;
}

#if defined(SLIPSTREAM_X86)
template <int P>
__attribute__((target("avx512f"), always_inline)) inline __m512 Finish(__m512i acc0, __m512i acc1, __m512i corr,
                                                                        float xs0, float xs1, __m512 ws) {
  __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc0, corr)), _mm512_set1_ps(xs0));
  if constexpr (P == 2)
    f = _mm512_add_ps(f, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc1, corr)), _mm512_set1_ps(xs1)));
  return _mm512_mul_ps(f, ws);
}

__attribute__((target("avx512f"), always_inline)) inline __m512 AddResidual(__m512 f, __m512i accr, __m512i corrr,
                                                                             float xs0, __m512 wsr) {
  const __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(accr, corrr)), _mm512_set1_ps(xs0));
  return _mm512_add_ps(f, _mm512_mul_ps(g, wsr));
}
#endif

// ---- portable: one act row block x one column tile ------------------------------------------------

void TilePortable(const Problem& p, const Acts& a, int row, int tile) {
  const int8_t* w = p.w + tile * p.tile_bytes();
  const int n0 = tile * kTile, cols = std::min(kTile, p.n - n0);
  for (int c = 0; c < cols; ++c) {
    int32_t acc[2] = {0, 0};
    for (int q = 0; q < p.parts; ++q) {
      const uint8_t* x = a.u.data() + ActRow(row * p.parts + q, p.kp);
      int32_t s = 0;
      for (int i = 0; i < p.kp; ++i)
        s += static_cast<int32_t>(x[i / kStep * kTileBytes + i % kStep]) * w[(i / 4) * 64 + c * 4 + i % 4];
      acc[q] = s;
    }
    const float* xs = a.xs.data() + static_cast<size_t>(row) * p.parts;
    float f = FinishPortable(acc[0], acc[1], 128 * p.colsum[n0 + c], xs[0], p.parts == 2 ? xs[1] : 0.0f,
                             p.ws[n0 + c], p.parts);
    if (p.wr) {
      const int8_t* wr = p.wr + tile * p.tile_bytes();
      const uint8_t* x = a.u.data() + ActRow(row * p.parts, p.kp);
      int32_t s = 0;
      for (int i = 0; i < p.kp; ++i)
        s += static_cast<int32_t>(x[i / kStep * kTileBytes + i % kStep]) * wr[(i / 4) * 64 + c * 4 + i % 4];
      f = AddResidualPortable(f, s, 128 * p.colsumr[n0 + c], xs[0], p.wsr[n0 + c]);
    }
    p.y[static_cast<size_t>(row) * p.n + n0 + c] = f;
  }
}

#if defined(SLIPSTREAM_X86)
// ---- AVX-512 VNNI: R act rows (R / P input rows) x C column tiles over all of K -------------------
// kRes: the residual weight's tiles too, in the same pass (each weight vector of both, the act rows read once),
// times each input row's first part.
template <int R, int C, int P, bool kRes = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void TileVnni(const Problem& p, const Acts& a, int ar0, int tile0) {
  const size_t kp = p.kp, tb = p.tile_bytes();
  const uint8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.u.data() + ActRow(ar0 + r, p.kp);
  const int8_t* w = p.w + tile0 * tb;
  const int8_t* wr = kRes ? p.wr + tile0 * tb : nullptr;
  constexpr int RR = kRes ? R / P : 1;  // residual accumulators: one per input row
  __m512i acc[R][C], accr[RR][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) accr[r][c] = _mm512_setzero_si512();
  for (size_t k4 = 0; k4 < kp / 4; ++k4) {
    __m512i wv[C], wrv[C];
    for (int c = 0; c < C; ++c) {
      if constexpr (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(w + c * tb + k4 * 64 + 1024), _MM_HINT_T0);
      wv[c] = _mm512_loadu_si512(w + c * tb + k4 * 64);
      if constexpr (kRes) {
        if constexpr (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(wr + c * tb + k4 * 64 + 1024), _MM_HINT_T0);
        wrv[c] = _mm512_loadu_si512(wr + c * tb + k4 * 64);
      }
    }
    const size_t at = k4 / 16 * kTileBytes + k4 % 16 * 4;  // inputs 4 k4.. in the A tile layout
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x[r] + at, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xb, wv[c]);
      if constexpr (kRes) {
        if (r % P == 0)
          for (int c = 0; c < C; ++c) accr[r / P][c] = _mm512_dpbusd_epi32(accr[r / P][c], xb, wrv[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int n0 = (tile0 + c) * kTile, cols = std::min(kTile, p.n - n0);
    const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.colsum + n0), 7);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, p.ws + n0);
    __m512i corrr = _mm512_setzero_si512();
    __m512 wsr = _mm512_setzero_ps();
    if constexpr (kRes) {
      corrr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.colsumr + n0), 7);
      wsr = _mm512_maskz_loadu_ps(mask, p.wsr + n0);
    }
    for (int i = 0; i < R / P; ++i) {
      const int row = ar0 / P + i;
      const float* xs = a.xs.data() + static_cast<size_t>(row) * P;
      __m512 f = Finish<P>(acc[i * P][c], acc[i * P + P - 1][c], corr, xs[0], xs[P - 1], ws);
      if constexpr (kRes) f = AddResidual(f, accr[i][c], corrr, xs[0], wsr);
      _mm512_mask_storeu_ps(p.y + static_cast<size_t>(row) * p.n + n0, mask, f);
    }
  }
}

// ---- AMX-INT8: RT row tiles x CT column tiles of 16 x 16 over all of K ----------------------------
struct AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};  // C: 16 int32; A: 64 inputs; B: 16 columns x 4
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};    // B: 64 inputs in 16 rows of 4
};
alignas(64) const AmxConfig kAmxConfig{};

__attribute__((target("amx-tile"))) void AmxBegin() { _tile_loadconfig(&kAmxConfig); }
__attribute__((target("amx-tile"))) void AmxEnd() { _tile_release(); }

// C tile (2r + t) = A tile row tile rt0 + r x B tile of column tile tile0 + t over all of K (RT, CT in {1, 2}), stored
// once; then the float steps (Finish) of each output row below m and column below n. kRes (CT = 1): C tile 2r + 1
// is instead the same A tiles times the residual weight's B tile of column tile tile0 (tmm7), sharing the A tile
// loads; only its rows of first parts are used (the product with the second parts' rows is wasted: a layout of
// first parts alone would cost a second copy of the activations).
template <int RT, int CT, int P, bool kRes = false>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
void TileAmx(const Problem& p, const Acts& a, int rt0, int tile0) {
  static_assert(!kRes || CT == 1, "the residual's C tiles take the second column's registers");
  constexpr bool kSecond = CT == 2 || kRes;  // C tiles 1 and 3 in use
  const size_t row_tile = static_cast<size_t>(p.kp / kStep) * kTileBytes;  // one row tile's A tiles
  const uint8_t* x = a.u.data() + rt0 * row_tile;
  const int8_t* w = p.w + tile0 * p.tile_bytes();
  const int8_t* w7 = kRes ? p.wr + tile0 * p.tile_bytes() : w + p.tile_bytes();  // tmm7's B tiles
  _tile_zero(0);
  if constexpr (kSecond) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && kSecond) _tile_zero(3);
  for (int k = 0; k < p.kp; k += kStep) {
    const size_t xa = static_cast<size_t>(k / kStep) * kTileBytes, wb = static_cast<size_t>(k) * kTile;
    _tile_loadd(4, x + xa, kStep);
    _tile_loadd(6, w + wb, 64);
    _tile_dpbusd(0, 4, 6);
    if constexpr (kSecond) {
      _tile_loadd(7, w7 + wb, 64);
      _tile_dpbusd(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, x + row_tile + xa, kStep);
      _tile_dpbusd(2, 5, 6);
      if constexpr (kSecond) _tile_dpbusd(3, 5, 7);
    }
  }
  constexpr int kC = kAmxRows * kTile;  // int32s of one C tile
  alignas(64) int32_t cbuf[4 * kC];
  _tile_stored(0, cbuf, 64);
  if constexpr (kSecond) _tile_stored(1, cbuf + kC, 64);
  if constexpr (RT == 2) _tile_stored(2, cbuf + 2 * kC, 64);
  if constexpr (RT == 2 && kSecond) _tile_stored(3, cbuf + 3 * kC, 64);
  // locals: the output stores could alias p's and a's fields, which the compiler would then load again per vector
  float* const y = p.y;
  const size_t n = p.n;
  const float* const xs_all = a.xs.data();
  for (int t = 0; t < CT; ++t) {
    const int n0 = (tile0 + t) * kTile, cols = std::min(kTile, p.n - n0);
    const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.colsum + n0), 7);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, p.ws + n0);
    __m512i corrr = _mm512_setzero_si512();
    __m512 wsr = _mm512_setzero_ps();
    if constexpr (kRes) {
      corrr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.colsumr + n0), 7);
      wsr = _mm512_maskz_loadu_ps(mask, p.wsr + n0);
    }
    for (int r = 0; r < RT; ++r) {
      const int32_t* c = cbuf + (2 * r + t) * kC;
      const int32_t* cr = cbuf + (2 * r + 1) * kC;  // kRes: the residual's sums
      const int row0 = (rt0 + r) * (kAmxRows / P), rows = std::min(kAmxRows / P, p.m - row0);
      const float* xs = xs_all + static_cast<size_t>(row0) * P;
      float* out = y + static_cast<size_t>(row0) * n + n0;
      for (int i = 0; i < rows; ++i, xs += P, out += n) {
        __m512 f = Finish<P>(_mm512_load_si512(c + i * P * kTile), _mm512_load_si512(c + (i * P + P - 1) * kTile),
                             corr, xs[0], xs[P - 1], ws);
        if constexpr (kRes) f = AddResidual(f, _mm512_load_si512(cr + i * P * kTile), corrr, xs[0], wsr);
        _mm512_mask_storeu_ps(out, mask, f);
      }
    }
  }
}
#endif  // SLIPSTREAM_X86

// ---- items ------------------------------------------------------------------------------------------

struct Job {
  Problem p;
  Isa isa;
  bool amx = false;
  int block_rows = kRowBlock, row_blocks = 1, chunk_tiles = kChunkTiles, chunks = 1;
  Acts* acts;

  std::unique_ptr<std::atomic<int>[]> row_state;  // per kQuantRows rows: 0 not quantized, 1 in progress, 2 ready
  int quant_blocks = 0;

  // The rows of row block rb, quantized (rt::ClaimOnce: the threads that start on one row block share
  // its quantization), in the same parallel loop as the products (one wake-up of the pool's threads per call,
  // not two), as the q8 kernel does.
  void EnsureRows(int rb) {
    const int lo = rb * (block_rows / kQuantRows), hi = std::min(lo + block_rows / kQuantRows, quant_blocks);
    rt::ClaimOnce(row_state.get(), lo, hi, [this](int qb) { Quantize(qb); });
  }

  void Quantize(int item) {
    const int lo = item * kQuantRows, hi = std::min(lo + kQuantRows, p.m);
    for (int row = lo; row < hi; ++row) {
      const float* x = p.x + static_cast<size_t>(row) * p.k;
      float* xs = acts->xs.data() + static_cast<size_t>(row) * p.parts;
#if defined(SLIPSTREAM_X86)
      if (isa != Isa::kPortable) {
        uint8_t* dst[2] = {acts->u.data() + ActRow(row * p.parts, p.kp),
                           acts->u.data() + ActRow(row * p.parts + p.parts - 1, p.kp)};
        if (p.parts == 2) QuantizeRowAvx512<2>(x, p.k, p.kp, dst, xs);
        else QuantizeRowAvx512<1>(x, p.k, p.kp, dst, xs);
        continue;
      }
#endif
      thread_local std::vector<uint8_t> u;  // [parts][Kp], then scattered into the A tile layout
      u.resize(static_cast<size_t>(p.parts) * p.kp);
      QuantizeRowPortable(x, p.k, p.kp, p.parts, u.data(), xs);
      for (int part = 0; part < p.parts; ++part) {
        uint8_t* dst = acts->u.data() + ActRow(row * p.parts + part, p.kp);
        for (int k0 = 0; k0 < p.kp; k0 += kStep)
          std::memcpy(dst + k0 / kStep * kTileBytes, u.data() + static_cast<size_t>(part) * p.kp + k0, kStep);
      }
    }
  }

  // Work items: (chunk of chunk_tiles column tiles, block of block_rows input rows), chunk major. On the tile unit a
  // chunk is up to 48 column tiles (at K = 576 its B panel, 432 KiB, stays in L2), at least one per thread.
  void Split(int threads) {
    if (amx) {
      chunks = std::max((p.tiles + kAmxChunkTiles - 1) / kAmxChunkTiles, std::min(threads, (p.tiles + 1) / 2));
      chunk_tiles = ((p.tiles + chunks - 1) / chunks + 1) / 2 * 2;  // whole column pairs
    }
    chunks = (p.tiles + chunk_tiles - 1) / chunk_tiles;
    row_blocks = (p.m + block_rows - 1) / block_rows;
  }

  void Run(int item) {
    const int chunk = item / row_blocks, rb = item % row_blocks;
    EnsureRows(rb);
    const int tile_lo = chunk * chunk_tiles, tile_hi = std::min(tile_lo + chunk_tiles, p.tiles);
    const int row_lo = rb * block_rows, row_hi = std::min(row_lo + block_rows, p.m);
#if defined(SLIPSTREAM_X86)
    if (amx) return RunAmx(tile_lo, tile_hi, row_lo, row_hi);
    if (isa == Isa::kAvx512Vnni) {
      if (p.wr) return RunVnni<2, true>(tile_lo, tile_hi, row_lo, row_hi);  // the residual comes with two parts
      return p.parts == 2 ? RunVnni<2>(tile_lo, tile_hi, row_lo, row_hi) : RunVnni<1>(tile_lo, tile_hi, row_lo, row_hi);
    }
#endif
    for (int t = tile_lo; t < tile_hi; ++t)
      for (int row = row_lo; row < row_hi; ++row) TilePortable(p, *acts, row, t);
  }

#if defined(SLIPSTREAM_X86)
  // One input row (decode) streams 4 tiles at a time; more rows reuse each weight vector over up to 6 act rows x 3
  // tiles (18 accumulators: enough independent vpdpbusd to hide its latency).
  // With the residual (kRes) the one-row stream reads both weights' 4 tiles in one pass (12 accumulators), and the
  // micro blocks are 2 input rows x 3 tiles (12 + 6 accumulators and 6 weight vectors: within the 32 registers).
  template <int P, bool kRes = false>
  void RunVnni(int tile_lo, int tile_hi, int row_lo, int row_hi) {
    if (row_hi - row_lo == 1) {
      for (int t = tile_lo; t < tile_hi; t += 4) VnniOneRow<P, kRes>(std::min(4, tile_hi - t), row_lo * P, t);
      return;
    }
    constexpr int kRows = kRes ? 2 : 6 / P;  // input rows per micro block
    for (int t = tile_lo; t < tile_hi; t += 3) {
      const int c = std::min(3, tile_hi - t);
      for (int row = row_lo; row < row_hi; row += kRows)
        VnniFn<P, kRes>(std::min(kRows, row_hi - row), c)(p, *acts, row * P, t);
    }
  }

  template <int P, bool kRes>
  void VnniOneRow(int c, int ar0, int t) {
    if (c == 4) TileVnni<P, 4, P, kRes>(p, *acts, ar0, t);
    else if (c == 3) TileVnni<P, 3, P, kRes>(p, *acts, ar0, t);
    else if (c == 2) TileVnni<P, 2, P, kRes>(p, *acts, ar0, t);
    else TileVnni<P, 1, P, kRes>(p, *acts, ar0, t);
  }

  using TileFn = void (*)(const Problem&, const Acts&, int, int);
  template <int P, int Rows, bool kRes = false>
  static constexpr std::array<TileFn, 3> kRowFns = {&TileVnni<Rows * P, 1, P, kRes>, &TileVnni<Rows * P, 2, P, kRes>,
                                                    &TileVnni<Rows * P, 3, P, kRes>};
  // the micro kernel of `rows` input rows (1..6/P; with the residual 1..2) x c tiles (1..3)
  template <int P, bool kRes = false>
  static TileFn VnniFn(int rows, int c) {
    if constexpr (kRes) {
      static_assert(P == 2, "the residual comes with two parts");
      static constexpr std::array<std::array<TileFn, 3>, 2> table = {kRowFns<2, 1, true>, kRowFns<2, 2, true>};
      return table[rows - 1][c - 1];
    } else if constexpr (P == 2) {
      static constexpr std::array<std::array<TileFn, 3>, 3> table = {kRowFns<2, 1>, kRowFns<2, 2>, kRowFns<2, 3>};
      return table[rows - 1][c - 1];
    } else {
      static constexpr std::array<std::array<TileFn, 3>, 6> table = {kRowFns<1, 1>, kRowFns<1, 2>, kRowFns<1, 3>,
                                                                     kRowFns<1, 4>, kRowFns<1, 5>, kRowFns<1, 6>};
      return table[rows - 1][c - 1];
    }
  }

  // The block's row tile pairs outer (their A tiles stay in L1), the chunk's column pairs inner (its B panel in L2):
  // each output row is written along the chunk, 128 bytes a block. The other order (column pairs outer) wrote
  // 32-row x 128-byte strips down the output and took 1.1-1.2x the time at q/k/v and gate/up (one thread, 256 rows).
  void RunAmx(int tile_lo, int tile_hi, int row_lo, int row_hi) {
    const int per_tile = kAmxRows / p.parts;  // input rows per A tile
    const int rt_lo = row_lo / per_tile, rt_hi = (row_hi + per_tile - 1) / per_tile;
    AmxBegin();
    for (int rt = rt_lo; rt < rt_hi; rt += 2) {
      const int rts = std::min(2, rt_hi - rt);
      if (p.wr) {  // 2 x 1 blocks: C tiles of the weight and of its residual per row tile (see TileAmx)
        for (int t = tile_lo; t < tile_hi; ++t)
          if (rts == 2) TileAmx<2, 1, 2, true>(p, *acts, rt, t);
          else TileAmx<1, 1, 2, true>(p, *acts, rt, t);
        continue;
      }
      for (int t = tile_lo; t < tile_hi; t += 2) {
        const int cts = std::min(2, tile_hi - t);
        if (p.parts == 2) AmxBlock<2>(rts, cts, rt, t);
        else AmxBlock<1>(rts, cts, rt, t);
      }
    }
    AmxEnd();
  }

  template <int P>
  void AmxBlock(int rts, int cts, int rt, int t) {
    if (rts == 2 && cts == 2) TileAmx<2, 2, P>(p, *acts, rt, t);
    else if (rts == 2) TileAmx<2, 1, P>(p, *acts, rt, t);
    else if (cts == 2) TileAmx<1, 2, P>(p, *acts, rt, t);
    else TileAmx<1, 1, P>(p, *acts, rt, t);
  }
#endif
};

// The residual weight's buffers (int8-channel-w16), shaped as the weight's; absent in the plain call.
struct Residual {
  ffi::Buffer<ffi::S8> packed;
  ffi::Buffer<ffi::F32> scales;
  ffi::Buffer<ffi::S32> colsum;
};

// Checks x [M, K], the weight (one [Np/16, Kp*16], or a stack [L, ...]), its residual and y [M, N] against each
// other and fills p's sizes (M, K, Kp, N, tiles); *stack: L, or 1 for one weight.
ffi::Error Describe(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S8>& packed, const ffi::Buffer<ffi::F32>& scales,
                    const ffi::Buffer<ffi::S32>& colsum, const Residual* residual, ffi::Span<const int64_t> yd,
                    int32_t parts, Problem& p, int64_t* stack) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), sd = scales.dimensions(), cd = colsum.dimensions();
  // one weight [Np/16, Kp*16] (scales, colsum [Np]), or a stack of L of them of which `layer` picks one (read
  // where it lies: a scanned layer loop passes the whole stack)
  const size_t rank = wd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank - 1 || cd.size() != rank - 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "int8_channel_matmul: x [M,K], packed [(L,) Np/16, Kp*16], scales and colsum [(L,) Np], layer [], y [M,N]");
  if (parts != 1 && parts != 2) return ffi::Error::InvalidArgument("int8_channel_matmul: parts must be 1 or 2");
  *stack = rank == 3 ? wd[0] : 1;
  const size_t lw = rank - 2;
  p.m = static_cast<int>(xd[0]);
  p.k = static_cast<int>(xd[1]);
  p.tiles = static_cast<int>(wd[lw]);
  p.kp = static_cast<int>(wd[lw + 1] / kTile);
  p.n = static_cast<int>(yd[1]);
  p.parts = parts;
  if (yd[0] != xd[0] || wd[lw + 1] % (kTile * kStep) || p.k > p.kp || p.k + kStep <= p.kp || p.kp > kMaxK ||
      p.n > p.tiles * kTile || p.n + kTile <= p.tiles * kTile || sd[lw] != int64_t(p.tiles) * kTile ||
      cd[lw] != sd[lw] || (rank == 3 && (sd[0] != wd[0] || cd[0] != wd[0])))
    return ffi::Error::InvalidArgument("int8_channel_matmul: packed weight, scales, colsum, x and y shapes disagree");
  if (residual) {
    if (parts != 2) return ffi::Error::InvalidArgument("int8_channel_matmul: a residual weight needs parts = 2");
    const auto rd = residual->packed.dimensions(), rsd = residual->scales.dimensions(),
               rcd = residual->colsum.dimensions();
    if (rd.size() != rank || rsd.size() != rank - 1 || rcd.size() != rank - 1 ||
        !std::equal(rd.begin(), rd.end(), wd.begin()) || !std::equal(rsd.begin(), rsd.end(), sd.begin()) ||
        !std::equal(rcd.begin(), rcd.end(), cd.begin()))
      return ffi::Error::InvalidArgument("int8_channel_matmul: the residual weight's shapes are not the weight's");
  }
  return ffi::Error::Success();
}

// p's weight pointers at weight `index` of the stack (and of its residual's).
void PointAt(Problem& p, const ffi::Buffer<ffi::S8>& packed, const ffi::Buffer<ffi::F32>& scales,
             const ffi::Buffer<ffi::S32>& colsum, const Residual* residual, int64_t index) {
  const size_t np = static_cast<size_t>(p.tiles) * kTile;
  p.w = packed.typed_data() + index * np * p.kp;
  p.ws = scales.typed_data() + index * np;
  p.colsum = colsum.typed_data() + index * np;
  if (residual) {
    p.wr = residual->packed.typed_data() + index * np * p.kp;
    p.wsr = residual->scales.typed_data() + index * np;
    p.colsumr = residual->colsum.typed_data() + index * np;
  }
}

// The product of p (its x, weight and y pointers set) over the pool's threads.
void Execute(ffi::ThreadPool& pool, const Problem& problem) {
  if (problem.m == 0 || problem.n == 0) return;
  Job job;
  job.p = problem;
  const Problem& p = job.p;
  // a large output (the LM head over many rows) is usually fresh memory: 2 MiB pages fault ~500x less often
  const size_t out_bytes = static_cast<size_t>(p.m) * p.n * sizeof(float);
  if (out_bytes >= 8 * rt::kHugePage) rt::AdviseHugePages(rt::HugeAligned(p.y, out_bytes));
  job.isa = g_isa.get();
  job.amx = job.isa == Isa::kAmx && p.m >= g_amx_min_rows.load(std::memory_order_relaxed);
  if (job.isa == Isa::kAmx) job.isa = Isa::kAvx512Vnni;  // the vector path of the rest
  if (job.amx) job.block_rows = kAmxBlock;
  // the calling thread's buffer, kept between calls; helpers use it only while this call waits for them
  thread_local Acts acts;
  job.acts = &acts;
  const size_t act_rows = (static_cast<size_t>(p.m) * p.parts + kAmxRows - 1) / kAmxRows * kAmxRows;
  acts.u.resize(act_rows * p.kp);
  acts.xs.resize(act_rows);
  const size_t used = static_cast<size_t>(p.m) * p.parts;
  for (size_t ar = used; ar < act_rows; ++ar)  // xq = 0 past the rows
    for (int k0 = 0; k0 < p.kp; k0 += kStep) std::memset(acts.u.data() + ActRow(ar, p.kp) + k0 / kStep * kTileBytes, 128, kStep);
  std::fill(acts.xs.begin() + used, acts.xs.end(), 0.0f);
  const int threads = g_max_threads.load(std::memory_order_relaxed);
  job.quant_blocks = (p.m + kQuantRows - 1) / kQuantRows;
  job.row_state = std::make_unique<std::atomic<int>[]>(job.quant_blocks);  // value-initialized: 0
  const int pool_threads = std::max<int>(1, pool.num_threads());
  job.Split(threads > 0 ? std::min(threads, pool_threads) : pool_threads);
  rt::ParallelFor(pool, int64_t(job.chunks) * job.row_blocks, threads,
                  [&job](int64_t item) { job.Run(static_cast<int>(item)); });
}

ffi::Error Int8ChannelMatmulRun(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed,
                                ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> colsum, const Residual* residual,
                                ffi::Buffer<ffi::S32> layer, const int32_t* rows, ffi::ResultBuffer<ffi::F32> y,
                                int32_t parts) {
  Problem p;
  int64_t stack = 1;
  if (ffi::Error e = Describe(x, packed, scales, colsum, residual, y->dimensions(), parts, p, &stack); e.failure()) return e;
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("int8_channel_matmul: layer is a scalar");
  const int64_t index = packed.dimensions().size() == 3 ? layer.typed_data()[0] : 0;
  if (index < 0 || index >= stack) return ffi::Error::InvalidArgument("int8_channel_matmul: layer index out of range");
  int64_t begin = 0;  // rows: only [begin, end) of x are multiplied and written (the rest of y is left as it is)
  if (rows) {
    begin = std::clamp<int64_t>(rows[0], 0, p.m);
    p.m = static_cast<int>(std::clamp<int64_t>(rows[1], begin, p.m) - begin);
  }
  p.x = x.typed_data() + begin * p.k;
  p.y = y->typed_data() + begin * p.n;
  PointAt(p, packed, scales, colsum, residual, index);
  Execute(pool, p);
  return ffi::Error::Success();
}

// Rows sorted by group (a sparse MoE layer's (token, expert) pairs by expert): group g's sizes[g] rows, after the
// groups before it, times weight first + g of the stack, each group as a call on its rows alone would multiply
// them (bit for bit); rows past every group's are 0. One call for all of a layer's experts: the groups run one
// after another, each split over the threads as any call is.
ffi::Error Int8ChannelMatmulGroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed,
                                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> colsum,
                                        ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> first,
                                        ffi::ResultBuffer<ffi::F32> y, int32_t parts) {
  Problem p;
  int64_t stack = 1;
  if (ffi::Error e = Describe(x, packed, scales, colsum, nullptr, y->dimensions(), parts, p, &stack); e.failure()) return e;
  const int64_t groups = sizes.element_count();
  if (packed.dimensions().size() != 3 || sizes.dimensions().size() != 1 || first.element_count() != 1)
    return ffi::Error::InvalidArgument("int8_channel_matmul (grouped): a stack [L, ...], sizes [G], first []");
  const int64_t base = first.typed_data()[0];
  if (base < 0 || base + groups > stack)
    return ffi::Error::InvalidArgument("int8_channel_matmul (grouped): weights first .. first + G - 1 out of range");
  const int rows = p.m;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t size = sizes.typed_data()[g];
    if (size < 0 || row + size > rows)
      return ffi::Error::InvalidArgument("int8_channel_matmul (grouped): group sizes negative or past x's rows");
    Problem one = p;
    one.m = size;
    one.x = x.typed_data() + row * p.k;
    one.y = y->typed_data() + row * p.n;
    PointAt(one, packed, scales, colsum, nullptr, base + g);
    Execute(pool, one);
    row += size;
  }
  std::fill(y->typed_data() + row * p.n, y->typed_data() + static_cast<size_t>(rows) * p.n, 0.0f);
  return ffi::Error::Success();
}

ffi::Error Int8ChannelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed,
                                 ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> colsum, ffi::Buffer<ffi::S32> layer,
                                 ffi::ResultBuffer<ffi::F32> y, int32_t parts) {
  return Int8ChannelMatmulRun(pool, x, packed, scales, colsum, nullptr, layer, nullptr, y, parts);
}

ffi::Error Int8ChannelMatmulResidualImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed,
                                         ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> colsum,
                                         ffi::Buffer<ffi::S8> packed_lo, ffi::Buffer<ffi::F32> scales_lo,
                                         ffi::Buffer<ffi::S32> colsum_lo, ffi::Buffer<ffi::S32> layer,
                                         ffi::ResultBuffer<ffi::F32> y, int32_t parts) {
  const Residual residual{packed_lo, scales_lo, colsum_lo};
  return Int8ChannelMatmulRun(pool, x, packed, scales, colsum, &residual, layer, nullptr, y, parts);
}

// rows [begin, end) of x only; y_in: y's previous contents (aliased to y by the caller: the other rows keep them), or
// [0] (none)
ffi::Error Int8ChannelMatmulResidualRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                             ffi::Buffer<ffi::S8> packed, ffi::Buffer<ffi::F32> scales,
                                             ffi::Buffer<ffi::S32> colsum, ffi::Buffer<ffi::S8> packed_lo,
                                             ffi::Buffer<ffi::F32> scales_lo, ffi::Buffer<ffi::S32> colsum_lo,
                                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                                             ffi::Buffer<ffi::F32> y_in, ffi::ResultBuffer<ffi::F32> y,
                                             int32_t parts) {
  if (rows.element_count() != 2) return ffi::Error::InvalidArgument("int8_channel_matmul: rows is [begin, end)");
  if (y_in.element_count() != 0 && y_in.element_count() != y->element_count())
    return ffi::Error::InvalidArgument("int8_channel_matmul: y_in is y's shape, or [0]");
  const Residual residual{packed_lo, scales_lo, colsum_lo};
  return Int8ChannelMatmulRun(pool, x, packed, scales, colsum, &residual, layer, rows.typed_data(), y, parts);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamInt8ChannelMatmul, Int8ChannelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed [(L,) Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: which of a stack [L, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int32_t>("parts"));     // int8 parts per activation

// The same plus a residual weight (int8-channel-w16) times the activations' first part:
//   y = Finish(acc_0, acc_1) + (f32(accr - 128 colsum_lo) * xs_0) * scales_lo
XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamInt8ChannelMatmulResidual, Int8ChannelMatmulResidualImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed [(L,) Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed_lo: the residual weight, as packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales_lo
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum_lo
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: which of a stack [L, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int32_t>("parts"));     // int8 parts per activation (2)

// The same on rows [begin, end) of x only (a step's prompt rows: quantization/layer_forms.py's StackedHybrid)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamInt8ChannelMatmulResidualRows, Int8ChannelMatmulResidualRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed [(L,) Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum [(L,) Np]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed_lo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales_lo
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum_lo
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [2]: begin, end (clamped to [0, M])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y_in [M, N] aliased to y, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]: rows outside [begin, end) unwritten
                                  .Attr<int32_t>("parts"));

// Rows sorted by group, group g's times weight first + g of the stack (a sparse MoE layer's experts: models/moe.py)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamInt8ChannelMatmulGrouped, Int8ChannelMatmulGroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by group
                                  .Arg<ffi::Buffer<ffi::S8>>()   // packed [L, Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [L, Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // colsum [L, Np]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sizes [G]: rows of each group, in order
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first: group 0's weight in the stack
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int32_t>("parts"));

// ---- Python module: targets(), isa(), set_isa() (runtime/module.h) and the test/benchmark setters ----

// amx_rows(min_rows) -> the previous: calls of at least min_rows input rows run on the tile unit where it is chosen
// (1: every call; a huge value: none); negative keeps it. For tests (results must not change) and benchmarks.
static PyObject* AmxRowsPy(PyObject*, PyObject* args) {
  int rows = -1;
  if (!PyArg_ParseTuple(args, "|i", &rows)) return nullptr;
  const int prev = g_amx_min_rows.load();
  if (rows >= 0) g_amx_min_rows.store(std::max(rows, 1));
  return PyLong_FromLong(prev);
}

// threading(max_threads) -> the previous (0: the pool's size); negative keeps it.
static PyObject* ThreadingPy(PyObject*, PyObject* args) {
  int max_threads = -1;
  if (!PyArg_ParseTuple(args, "|i", &max_threads)) return nullptr;
  const int prev = g_max_threads.load();
  if (max_threads >= 0) g_max_threads.store(max_threads);
  return PyLong_FromLong(prev);
}

PyMODINIT_FUNC PyInit__int8_channel_matmul() {
  static rt::ModuleSpec spec{
      "_int8_channel_matmul", "Per-output-channel int8 matmul for XLA:CPU through the FFI.",
      {{"slipstream_int8_channel_matmul", reinterpret_cast<void*>(SlipstreamInt8ChannelMatmul)},
       {"slipstream_int8_channel_matmul_residual", reinterpret_cast<void*>(SlipstreamInt8ChannelMatmulResidual)},
       {"slipstream_int8_channel_matmul_residual_rows",
        reinterpret_cast<void*>(SlipstreamInt8ChannelMatmulResidualRows)},
       {"slipstream_int8_channel_matmul_grouped", reinterpret_cast<void*>(SlipstreamInt8ChannelMatmulGrouped)}},
      &g_isa,
      {{"amx_rows", AmxRowsPy, METH_VARARGS,
        "amx_rows(min_rows): calls of at least min_rows input rows run on the tile unit (negative: keep); returns "
        "the previous."},
       {"threading", ThreadingPy, METH_VARARGS,
        "threading(max_threads): at most this many threads per call (0: the pool's; negative: keep); returns the "
        "previous."}}};
  return rt::CreateModule(spec);
}
