// Many-row group-wise int8 GEMM (llama.cpp's Q8_0 math) as an XLA FFI custom call on CPU: the
// prefill and mixed-step shapes (M >= ~16 rows), where the weights come from cache, not memory,
// and the int8 multiply-add rate is the bound. Same math, same packed weights and the same
// activation rounding as kernels/q8_matmul.py (its `reference` is the specification):
//
//   y[m, n] = sum_g sum_p f32(sum_{k in g} xq_p[m, k] * w[n, k]) * (xs_p[m, g] * ws[n, g])
//           + sum_g wo[n, g] * sum_{k in g} x[m, k]                          (only with offsets)
//
// Weights (pack() in kernels/q8_matmul.py): packed u8 [(L,) Np/16, Kp*16] = tiles of 16 columns as
// [Kp/4][16][4] holding w + 128; scales f32 [(L,) Np/16, Kp/32*16] as [Kp/32][16] per tile; offsets
// like scales or empty. A stack [L, ...] is read at the `layer` operand, where it lies.
//
// One call:
//   1. the M rows are quantized once, per row and group of 32 (xs = max|x| / 127, xq = round-half-even
//      (x / xs); with two parts the residual again with scale xs / 254), into a buffer of the calling
//      thread; blocks of rows are work items like the rest, so both threads quantize;
//   2. items of (a chunk of columns, a block of rows), column-chunk major: a chunk's weight panel is
//      read from memory once and stays in L1/L2 while the row blocks (and the micro blocks inside an
//      item) reuse it. A micro block is R input rows x C tiles: per group of 32 inputs, R*C int32
//      accumulators take 8 vpdpbusd each (the weight vector loaded once per C, the 4 activation bytes
//      broadcast from memory), then one convert, one multiply and one multiply-add per row and tile
//      fold the group into the f32 accumulators. With two parts the same accumulator goes on: times
//      254, plus part 1's bias, then part 1's 8 vpdpbusd: 254 * acc0 + acc1 exactly, scale xs / 254.
//   vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned side (w + 128), so each
//   accumulator starts at -128 * sum(xq) of its row and group.
// Threads: the calling thread and num_threads - 1 helpers scheduled on XLA's intra-op pool claim items
// from one atomic counter (quantization items first). A helper that starts late finds nothing and
// returns; the caller waits only for items that a running thread has claimed. A GEMM item whose rows
// are still being quantized waits for the thread quantizing them (it is running: every quantization
// item is claimed before any GEMM item).
//
// Measured (benchmarks/q8_gemm_bench.py, Zen 4 EPYC, 2 cores): 0.85-1.0x the many-row path of
// kernels/csrc/q8_matmul.cc, which already runs 4-row x 2-tile blocks at ~65% of the vpdpbusd peak; the
// per-group convert + multiply + multiply-add share the vpdpbusd ports and cap this math at ~77%
// (benchmarks/vnni_peak.c). q8_matmul does not route to this kernel.
//
// Instruction set, chosen at run time: AVX-512 VNNI only. isa() says "none" elsewhere and
// kernels/q8_gemm.py then runs the one-row kernel (kernels._q8_matmul), which has AVX2 and portable paths.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#define QG_X86 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGroup = 32;  // inputs per scale
constexpr int kTile = 16;   // columns per packed tile
constexpr int kQuantRows = 16;  // rows per quantization item

bool DetectVnni() {
#if defined(QG_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

const bool kVnni = DetectVnni();

// Tuning knobs (shape(): tests and benchmarks): input rows and tiles per micro block per parts value,
// rows per item, tiles per item.
std::atomic<int> g_rows[3] = {0, 4, 4};  // parts 2: 4 x 2, as fast as the one-row kernel's 2 x 2 pairs (both ~73% of the vpdpbusd peak per core)
std::atomic<int> g_tiles[3] = {0, 3, 2};
std::atomic<int> g_item_rows{64};
std::atomic<int> g_item_tiles{6};
std::atomic<int> g_max_threads{0};  // 0: the pool's

// Quantized activations of one call. Act row (row * parts + part) holds Kp int8; per act row and
// group: its bias -128 * sum(xq). Per input row and group: the scale the combined int32 sum takes (xs
// for one part, xs / 254 for two) and the float sum of x (for offsets).
struct Acts {
  int kp = 0, groups = 0, parts = 1;
  std::vector<int8_t> q;
  std::vector<int32_t> bias;
  std::vector<float> scale, sum;
  void Resize(int rows) {
    const size_t act = static_cast<size_t>(rows) * parts;
    if (q.size() < act * kp) q.resize(act * kp);
    if (bias.size() < act * groups) bias.resize(act * groups);
    if (scale.size() < static_cast<size_t>(rows) * groups) scale.resize(static_cast<size_t>(rows) * groups);
    if (sum.size() < static_cast<size_t>(rows) * groups) sum.resize(static_cast<size_t>(rows) * groups);
  }
};

struct Problem {
  const float* x;
  int m, k;
  const uint8_t* w;
  const float* ws;
  const float* wo;  // or nullptr
  int n, kp, groups, tiles, parts;
  float* y;
  size_t tile_bytes, tile_scales;
};

#if defined(QG_X86)

// One input row: for each group, d = amax / 127, id = 1 / d (0 when d is 0), q = clamp(rne(x * id)),
// then for two parts r = x - q * d (one fused multiply-add) quantized with d / 254 the same way.
// These are the reference's f32 operations, so xq agrees with it bit for bit.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void QuantizeRow(const Problem& p, Acts& a, int row) {
  const float* x = p.x + static_cast<size_t>(row) * p.k;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int g = 0; g < p.groups; ++g) {
    const int base = g * kGroup;
    const int n0 = std::clamp(p.k - base, 0, 16), n1 = std::clamp(p.k - base - 16, 0, 16);
    __m512 v0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1), x + base);
    __m512 v1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1), x + base + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    a.sum[static_cast<size_t>(row) * p.groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    float d = amax / 127.f;
    for (int part = 0; part < p.parts; ++part) {
      const size_t act = static_cast<size_t>(row) * p.parts + part;
      const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lo), hi);
      const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lo), hi);
      int8_t* out = a.q.data() + act * p.kp + base;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q1));
      a.bias[act * p.groups + g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      if (part + 1 == p.parts) {
        a.scale[static_cast<size_t>(row) * p.groups + g] = d;
        break;
      }
      const __m512 dv = _mm512_set1_ps(d);
      v0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q0), dv, v0);
      v1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q1), dv, v1);
      d = d / 254.f;
    }
  }
}

// R input rows (P act rows each) x C tiles, over all of K. Rows row0.., tiles tile0...
template <int R, int C, int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void Micro(const Problem& p, const Acts& a, int row0, int tile0) {
  __m512 f[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) f[r][c] = _mm512_setzero_ps();
  const uint8_t* w = p.w + tile0 * p.tile_bytes;
  const float* ws = p.ws + tile0 * p.tile_scales;
  const float* wo = p.wo ? p.wo + tile0 * p.tile_scales : nullptr;
  const int8_t* xq = a.q.data() + static_cast<size_t>(row0) * P * p.kp;
  const int32_t* xb = a.bias.data() + static_cast<size_t>(row0) * P * p.groups;
  const float* xs = a.scale.data() + static_cast<size_t>(row0) * p.groups;
  const float* xsum = a.sum.data() + static_cast<size_t>(row0) * p.groups;
  const size_t tb = p.tile_bytes, ts = p.tile_scales, kp = p.kp;
  const int groups = p.groups;
  for (int g = 0; g < groups; ++g) {
    // One int32 accumulator per input row and tile. With two parts it takes part 0's 8 steps, is
    // multiplied by 254 and given part 1's bias, then takes part 1's 8 steps: 254 * acc0 + acc1, exact
    // (|254 * acc0| < 2^27 for 32 inputs; vpdpbusd wraps, so the sum is exact mod 2^32 and in range).
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(xb[r * P * groups + g]);
      for (int c = 0; c < C; ++c) acc[r][c] = b;
    }
    const uint8_t* wg = w + static_cast<size_t>(g) * kGroup * kTile;
    for (int part = 0; part < P; ++part) {
      if (part == 1) {
        for (int r = 0; r < R; ++r) {  // 254 * acc = (acc << 8) - (acc << 1); vpmulld measured slower
          const __m512i b1 = _mm512_set1_epi32(xb[(r * P + 1) * groups + g]);
          for (int c = 0; c < C; ++c)
            acc[r][c] = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(acc[r][c], 8), _mm512_slli_epi32(acc[r][c], 1)), b1);
        }
      }
      const int8_t* xg = xq + part * kp + g * kGroup;
#pragma GCC unroll 8
      for (int k4 = 0; k4 < kGroup / 4; ++k4) {
        __m512i wv[C];
        for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(wg + c * tb + k4 * 64);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xg + r * P * kp + k4 * 4, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 sc = _mm512_loadu_ps(ws + c * ts + g * kTile);
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(xs[r * groups + g]));
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), s, f[r][c]);
      }
    }
    if (wo) {
      for (int c = 0; c < C; ++c) {
        const __m512 oc = _mm512_loadu_ps(wo + c * ts + g * kTile);
        for (int r = 0; r < R; ++r) f[r][c] = _mm512_fmadd_ps(oc, _mm512_set1_ps(xsum[r * groups + g]), f[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int n0 = (tile0 + c) * kTile;
    const int valid = std::min(kTile, p.n - n0);
    const __mmask16 mask = valid >= kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + static_cast<size_t>(row0 + r) * p.n + n0, mask, f[r][c]);
  }
}

#endif  // QG_X86

using MicroFn = void (*)(const Problem&, const Acts&, int, int);
constexpr int kMaxR = 6;
constexpr int kMaxC = 4;

template <int R, int C, int P>
constexpr MicroFn PickOne() {
#if defined(QG_X86)
  // registers: R*C int32 + R*C f32 accumulators + C weight vectors + a broadcast within 32 zmm
  if constexpr (2 * R * C + C + 1 <= 32) return &Micro<R, C, P>;
#endif
  return nullptr;
}

MicroFn Pick(int r, int c, int parts) {
#define QG_C(R, P) {PickOne<R, 1, P>(), PickOne<R, 2, P>(), PickOne<R, 3, P>(), PickOne<R, 4, P>()}
#define QG_P(P) {QG_C(1, P), QG_C(2, P), QG_C(3, P), QG_C(4, P), QG_C(5, P), QG_C(6, P)}
  static const MicroFn table[2][kMaxR][kMaxC] = {QG_P(1), QG_P(2)};
#undef QG_P
#undef QG_C
  if (r < 1 || r > kMaxR || c < 1 || c > kMaxC || parts < 1 || parts > 2) return nullptr;
  return table[parts - 1][r - 1][c - 1];
}

struct Job {
  Problem p;
  Acts* acts;
  int rows, tiles;  // micro block (input rows, tiles)
  int item_rows, item_tiles;
  int quant_items, row_blocks, chunks, items;
  std::unique_ptr<std::atomic<int>[]> ready;  // per quantization block: 1 once its rows are quantized
  std::atomic<int> next{0}, done{0};

  void Quantize(int qb) {
#if defined(QG_X86)
    const int hi = std::min(p.m, (qb + 1) * kQuantRows);
    for (int row = qb * kQuantRows; row < hi; ++row) QuantizeRow(p, *acts, row);
#endif
    ready[qb].store(1, std::memory_order_release);
  }

  void Gemm(int item) {
    const int chunk = item / row_blocks, rb = item % row_blocks;
    const int row_lo = rb * item_rows, row_hi = std::min(p.m, row_lo + item_rows);
    for (int qb = row_lo / kQuantRows; qb * kQuantRows < row_hi; ++qb)
      while (ready[qb].load(std::memory_order_acquire) == 0) std::this_thread::yield();
    const int tile_lo = chunk * item_tiles, tile_hi = std::min(p.tiles, tile_lo + item_tiles);
    for (int t = tile_lo; t < tile_hi; t += tiles) {
      const int c = std::min(tiles, tile_hi - t);
      for (int row = row_lo; row < row_hi; row += rows) {
        const int r = std::min(rows, row_hi - row);
        Pick(r, c, p.parts)(p, *acts, row, t);
      }
    }
  }

  void Work() {
    int ran = 0;
    for (int item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items; ++ran) {
      if (item < quant_items)
        Quantize(item);
      else
        Gemm(item - quant_items);
    }
    if (ran) done.fetch_add(ran, std::memory_order_acq_rel);
  }
};

// Outputs of many rows x a wide weight (the LM head over 256 rows: 50 MB) are fresh mmap'd memory whose
// first write faults once per 4 KiB page; transparent huge pages make that once per 2 MiB. A hint only.
void HintHugePages(float* y, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (bytes < 16 * kHuge) return;
  const uintptr_t first = (reinterpret_cast<uintptr_t>(y) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(y) + bytes) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)y;
  (void)bytes;
#endif
}

ffi::Error Q8GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, int32_t parts) {
  if (!kVnni) return ffi::Error::Internal("q8_gemm: this CPU has no AVX-512 VNNI (use kernels._q8_matmul)");
  const auto xd = x.dimensions(), wd = packed.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  const size_t rank = wd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank || yd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "q8_gemm: x [M,K], packed [(L,) Np/16, Kp*16], scales [(L,) Np/16, Kp/2], layer [], y [M,N]");
  if (parts != 1 && parts != 2) return ffi::Error::InvalidArgument("q8_gemm: parts must be 1 or 2");
  const int64_t stack = rank == 3 ? wd[0] : 1;
  const int64_t index = rank == 3 ? layer.typed_data()[0] : 0;
  if (index < 0 || index >= stack) return ffi::Error::InvalidArgument("q8_gemm: layer index out of range");
  const size_t lw = rank - 2;
  auto job = std::make_shared<Job>();
  Problem& p = job->p;
  p.m = static_cast<int>(xd[0]);
  p.k = static_cast<int>(xd[1]);
  p.tiles = static_cast<int>(wd[lw]);
  p.kp = static_cast<int>(wd[lw + 1] / kTile);
  p.groups = p.kp / kGroup;
  p.n = static_cast<int>(yd[1]);
  p.parts = parts;
  if (yd[0] != xd[0] || wd[lw + 1] % (kTile * kGroup) || sd[lw] != wd[lw] || sd[lw + 1] != int64_t(p.groups) * kTile ||
      (rank == 3 && sd[0] != wd[0]) || p.k > p.kp || p.k + kGroup <= p.kp || p.n > p.tiles * kTile ||
      p.n + kTile <= p.tiles * kTile || (offsets.element_count() != 0 && offsets.element_count() != scales.element_count()))
    return ffi::Error::InvalidArgument("q8_gemm: packed weight, scales, offsets, x and y shapes disagree");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.tile_bytes = static_cast<size_t>(p.kp) * kTile;
  p.tile_scales = static_cast<size_t>(p.groups) * kTile;
  const size_t weight_bytes = p.tiles * p.tile_bytes, weight_scales = p.tiles * p.tile_scales;
  p.x = x.typed_data();
  p.w = packed.typed_data() + index * weight_bytes;
  p.ws = scales.typed_data() + index * weight_scales;
  p.wo = offsets.element_count() ? offsets.typed_data() + index * weight_scales : nullptr;
  p.y = y->typed_data();
  HintHugePages(p.y, static_cast<size_t>(p.m) * p.n * sizeof(float));

  // The calling thread's buffer, kept between calls; helpers touch it only while this call waits.
  thread_local Acts tl_acts;
  Acts& a = tl_acts;
  a.kp = p.kp;
  a.groups = p.groups;
  a.parts = parts;
  a.Resize(p.m);
  job->acts = &a;
  job->rows = g_rows[parts].load(std::memory_order_relaxed);
  job->tiles = g_tiles[parts].load(std::memory_order_relaxed);
  job->item_tiles = std::max(job->tiles, g_item_tiles.load(std::memory_order_relaxed) / job->tiles * job->tiles);
  job->item_rows = std::max(job->rows, g_item_rows.load(std::memory_order_relaxed) / job->rows * job->rows);
  job->quant_items = (p.m + kQuantRows - 1) / kQuantRows;
  job->row_blocks = (p.m + job->item_rows - 1) / job->item_rows;
  job->chunks = (p.tiles + job->item_tiles - 1) / job->item_tiles;
  job->items = job->quant_items + job->row_blocks * job->chunks;
  job->ready.reset(new std::atomic<int>[job->quant_items]);
  for (int i = 0; i < job->quant_items; ++i) job->ready[i].store(0, std::memory_order_relaxed);

  int threads = static_cast<int>(std::min<int64_t>(pool.num_threads(), job->items));
  const int cap = g_max_threads.load(std::memory_order_relaxed);
  if (cap > 0) threads = std::min(threads, cap);
  for (int i = 1; i < threads; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  // Items claimed by helpers are running now: wait for them (never for a helper that has not started).
  while (job->done.load(std::memory_order_acquire) != job->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamQ8Gemm, Q8GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed [(L,) Np/16, Kp*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales [(L,) Np/16, Kp/32*16]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // offsets like scales, or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer: which of a stack [L, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int32_t>("parts"));

// ---- Python module ---------------------------------------------------------------------------------

static PyObject* Targets(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(SlipstreamQ8Gemm), nullptr, nullptr);
  if (!capsule || PyDict_SetItemString(dict, "slipstream_q8_gemm", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(dict);
    return nullptr;
  }
  Py_DECREF(capsule);
  return dict;
}

static PyObject* IsaPy(PyObject*, PyObject*) { return PyUnicode_FromString(kVnni ? "avx512_vnni" : "none"); }

// shape(parts, rows, tiles, item_rows, item_tiles, max_threads) -> the previous values; a value <= 0
// keeps that setting. Micro block rows x tiles must fit the registers (see PickOne).
static PyObject* ShapePy(PyObject*, PyObject* args) {
  int parts = 1, rows = 0, tiles = 0, item_rows = 0, item_tiles = 0, max_threads = -1;
  if (!PyArg_ParseTuple(args, "i|iiiii", &parts, &rows, &tiles, &item_rows, &item_tiles, &max_threads)) return nullptr;
  if (parts != 1 && parts != 2) {
    PyErr_SetString(PyExc_ValueError, "parts must be 1 or 2");
    return nullptr;
  }
  const int r = rows > 0 ? rows : g_rows[parts].load(), c = tiles > 0 ? tiles : g_tiles[parts].load();
  for (int rr = 1; rr <= r; ++rr)
    for (int cc = 1; cc <= c; ++cc)
      if (!Pick(rr, cc, parts)) {
        PyErr_Format(PyExc_ValueError, "no micro block of %d rows x %d tiles for %d parts", rr, cc, parts);
        return nullptr;
      }
  PyObject* prev = Py_BuildValue("(iiiii)", g_rows[parts].load(), g_tiles[parts].load(), g_item_rows.load(),
                                 g_item_tiles.load(), g_max_threads.load());
  g_rows[parts].store(r);
  g_tiles[parts].store(c);
  if (item_rows > 0) g_item_rows.store(item_rows);
  if (item_tiles > 0) g_item_tiles.store(item_tiles);
  if (max_threads >= 0) g_max_threads.store(max_threads);
  return prev;
}

static PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "FFI target name -> PyCapsule of its XLA FFI handler."},
    {"isa", IsaPy, METH_NOARGS, "avx512_vnni, or none (this module's kernel cannot run on this CPU)."},
    {"shape", ShapePy, METH_VARARGS,
     "shape(parts, rows, tiles, item_rows, item_tiles, max_threads): micro block and work split (<= 0 keeps; "
     "max_threads 0: the pool's); returns the previous (rows, tiles, item_rows, item_tiles, max_threads)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_q8_gemm",
                              "Many-row group-wise int8 (Q8_0) GEMM for XLA:CPU through the FFI.", -1, kMethods};

PyMODINIT_FUNC PyInit__q8_gemm() { return PyModule_Create(&kModule); }
