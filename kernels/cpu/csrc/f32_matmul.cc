// f32 matmul y[M, N] = x[M, K] @ w[K, N] as an XLA FFI custom call on CPU.
//
// w is prepacked at load (kernels/f32_matmul.py, pack()) into column panels of 32:
//   packed f32 [Np/32][K][32]     (Np: N rounded up to 32; the padding columns are zero)
// so that at each k one panel gives its 32 weights as two contiguous 64-byte vectors and a panel is
// one sequential stream. A stack of L such weights [L][Np/32][K*32] is read at `layer` (a scanned
// layer loop passes the whole stack; no slice of it is copied).
//
// Micro kernel: R rows x P panels over all of K, the 2RP (AVX-512) accumulators held in registers
// from the first k to the last, stored once (masked past N). At each k it loads the P panels' 2P
// weight vectors and broadcasts R values of x: each weight vector feeds R FMAs. R = 14, P = 1 gives
// 28 zmm accumulators, 28 FMAs per 2 vector loads + 14 broadcasts, so the FMA units bound it (98%
// of the FMA peak on a Zen 4 EPYC with the data in L2). x is read where it lies: R row streams
// served from L1/L2 measured as fast as a copy of the rows into [K][R] order, without the copy.
// (FMAs with an embedded {1to16} broadcast ran at 42% there: the broadcast is a separate load.)
// While a panel's row blocks run, each takes its share of the next panel's lines into L2 (`Ahead`),
// so the weights, which come from memory once per call, arrive before they are needed.
// With few rows (decode: M <= 3) the weights stream from memory once and bandwidth bounds the call;
// the micro kernel then spans 4 panels (4 streams in flight per thread) and prefetches each 1 KiB
// ahead.
//
// Work split: items are (chunk of adjacent panels, block of rows), chunk major so that a chunk's
// weights come from memory once and serve each row block from L2 (1 MiB per core on the Zen 4 EPYC
// measured). Items are claimed from an atomic counter by the calling thread and by helpers
// scheduled on XLA's intra-op pool; a helper that starts late finds no work and returns, and the
// caller waits only for items that are running.
//
// Instruction sets, chosen at run time: AVX-512 and AVX2 + FMA (one micro kernel over runtime/vec.h's
// vector type, f32_matmul_tile.h), portable C++.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
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

constexpr int kPanel = 32;          // columns per packed panel
constexpr int kFewRows = 3;         // up to this many rows: the streaming (decode) shape
constexpr int kStreamPanels = 4;    // panels per streaming micro kernel
constexpr int kPrefetchBytes = 1024;

rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx2, Isa::kAvx512};
std::atomic<int> g_max_threads{0};      // 0: the pool's threads (a test and benchmark knob)
std::atomic<int> g_rows_per_block{0};   // 0: chosen per call (a benchmark knob)
std::atomic<int> g_panels_per_chunk{0};

// A range of the next panel to pull into L2 while a micro kernel runs: `lines` 64-byte lines from
// `next`, one every `every` steps of k (each micro block of a panel takes its share, so the next
// panel arrives from memory spread over the current one's work instead of stalling its first block).
struct Ahead {
  const char* next = nullptr;
  int lines = 0, every = 1;
};

struct Problem {
  const float* x;  // [m, k]
  const float* w;  // [panels][k][32]
  float* y;        // [m, n]
  int m, k, n, panels;
  size_t panel_floats() const { return static_cast<size_t>(k) * kPanel; }
};

// ---- micro kernels: R rows of x from row0 x P panels from panel0 ---------------------------------
// They write y rows row0 .. row0 + R - 1, columns of the P panels below n.

template <int R, int P>
void TilePortable(const Problem& p, int row0, int panel0, Ahead) {
  const float* a = p.x + static_cast<size_t>(row0) * p.k;
  float acc[R][P * kPanel] = {};
  for (int kk = 0; kk < p.k; ++kk)
    for (int c = 0; c < P; ++c) {
      const float* b = p.w + (panel0 + c) * p.panel_floats() + static_cast<size_t>(kk) * kPanel;
      for (int r = 0; r < R; ++r) {
        const float av = a[static_cast<size_t>(r) * p.k + kk];
        for (int j = 0; j < kPanel; ++j) acc[r][c * kPanel + j] += av * b[j];
      }
    }
  for (int c = 0; c < P; ++c) {
    const int n0 = (panel0 + c) * kPanel, valid = std::min(kPanel, p.n - n0);
    for (int r = 0; r < R; ++r)
      std::memcpy(p.y + static_cast<size_t>(row0 + r) * p.n + n0, &acc[r][c * kPanel], sizeof(float) * std::max(0, valid));
  }
}

// AVX2 + FMA and AVX-512 F: f32_matmul_tile.h, written once over runtime/vec.h, compiled for each.
#define SLIPSTREAM_PER_ISA_BODY "f32_matmul_tile.h"
#include "runtime/per_isa.h"

// ---- dispatch over (ISA, rows, panels) -----------------------------------------------------------

using TileFn = void (*)(const Problem&, int, int, Ahead);

constexpr int kMaxRows = 14;  // AVX-512: 2 * 14 accumulators + 2 weight vectors of 32 zmm

// The largest row count of one micro kernel, per ISA.
int MaxRows(Isa isa) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512) return avx512::kMaxTileRows;
  if (isa == Isa::kAvx2) return avx2::kMaxTileRows;
#endif
  return 4;
}

template <int R>
TileFn Pick(Isa isa, int panels) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512) {
    if constexpr (R <= kFewRows) {
      if (panels == kStreamPanels) return &avx512::Tile<R, kStreamPanels>;
    }
    return &avx512::Tile<R, 1>;
  }
  if constexpr (R <= avx2::kMaxTileRows) {
    if (isa == Isa::kAvx2) return &avx2::Tile<R, 1>;
  }
#endif
  if constexpr (R <= 4) return &TilePortable<R, 1>;
  return nullptr;  // MaxRows keeps the other paths at or below their row counts
}

// rows in 1 .. MaxRows(isa); panels 1 or (rows <= kFewRows, AVX-512) kStreamPanels.
TileFn PickTile(Isa isa, int rows, int panels) {
  static const TileFn table[3][kMaxRows][2] = {
#define F32_ROW(I, R) {Pick<R>(I, 1), Pick<R>(I, kStreamPanels)}
#define F32_ISA(I)                                                                                   \
  {F32_ROW(I, 1), F32_ROW(I, 2), F32_ROW(I, 3), F32_ROW(I, 4), F32_ROW(I, 5), F32_ROW(I, 6), F32_ROW(I, 7), \
   F32_ROW(I, 8), F32_ROW(I, 9), F32_ROW(I, 10), F32_ROW(I, 11), F32_ROW(I, 12), F32_ROW(I, 13), F32_ROW(I, 14)}
      F32_ISA(Isa::kPortable), F32_ISA(Isa::kAvx2), F32_ISA(Isa::kAvx512)
#undef F32_ISA
#undef F32_ROW
  };
  return table[static_cast<int>(isa)][rows - 1][panels == 1 ? 0 : 1];
}

// ---- the work queue ------------------------------------------------------------------------------

struct Claim {
  int rb, lo, hi;  // row block rb, panels [lo, hi)
};

struct Job {
  Problem p;
  Isa isa;
  int threads, rows_per_block, row_blocks, panels_per_chunk, chunks, items;

  // The claims, in the order threads take them. With one row block, claims shrink as the panels run
  // out (each takes 1/(2 x threads) of what is left, at least panels_per_chunk), so the threads finish
  // together: big claims first keep each thread's panels adjacent (Ahead), small ones last even out.
  std::vector<Claim> Claims() const {
    std::vector<Claim> out;
    if (row_blocks == 1) {
      for (int cur = 0; cur < p.panels;) {
        const int take = std::max(panels_per_chunk, (p.panels - cur) / (2 * threads));
        out.push_back({0, cur, std::min(cur + take, p.panels)});
        cur += take;
      }
      return out;
    }
    for (int item = 0; item < items; ++item) {
      const int lo = item / row_blocks * panels_per_chunk;
      out.push_back({item % row_blocks, lo, std::min(lo + panels_per_chunk, p.panels)});
    }
    return out;
  }

  void Run(int rb, int panel_lo, int panel_hi) {
    const int row_lo = rb * rows_per_block, row_hi = std::min(row_lo + rows_per_block, p.m);
    // micro blocks of near-equal height: ceil(rows / max) of them
    const int rows = row_hi - row_lo, cap = MaxRows(isa);
    const int blocks = (rows + cap - 1) / cap, base = rows / blocks, extra = rows % blocks;
    for (int panel = panel_lo; panel < panel_hi;) {
      const bool stream = rows <= kFewRows && isa == Isa::kAvx512 && panel + kStreamPanels <= panel_hi;
      const int span = stream ? kStreamPanels : 1;
      // the claim's next panel comes into L2 over this panel's blocks
      const int panel_lines = static_cast<int>(p.panel_floats() * sizeof(float) / 64);
      const bool more = !stream && panel + 1 < panel_hi;
      const char* next = reinterpret_cast<const char*>(p.w + (panel + 1) * p.panel_floats());
      for (int i = 0, row = row_lo; i < blocks; ++i) {
        const int r = base + (i < extra);
        Ahead ahead;
        if (more) {
          const int lo = static_cast<int>(int64_t(panel_lines) * i / blocks);
          const int hi = static_cast<int>(int64_t(panel_lines) * (i + 1) / blocks);
          ahead.next = next + int64_t(lo) * 64;
          ahead.lines = hi - lo;
          ahead.every = std::max(1, p.k / std::max(1, hi - lo));
        }
        PickTile(isa, r, span)(p, row, panel, ahead);
        row += r;
      }
      panel += span;
    }
  }

};

// Row blocks and panel chunks: few rows are one block whose claims take at least 4 panels (each
// a set of streams); more rows are blocks of at most 256 (x's block, 256 x K floats, stays in L2 or
// L3 while the panels pass: each panel comes from memory once per row block). One row block is
// claimed in shrinking runs of adjacent panels (Job::Claims); several are items of (row block, chunk
// of panels/threads adjacent panels): a thread pulls the next panel of its own run into its L2
// (Ahead), and a thread that starts late still finds work.
void Split(Job& job, int threads) {
  const Problem& p = job.p;
  int rows = g_rows_per_block.load(std::memory_order_relaxed);
  int panels = g_panels_per_chunk.load(std::memory_order_relaxed);
  if (rows <= 0) {
    const int blocks = (p.m + 255) / 256;
    rows = (p.m + blocks - 1) / blocks;
  }
  job.threads = threads;
  job.rows_per_block = rows;
  job.row_blocks = (p.m + rows - 1) / rows;
  if (panels <= 0)
    panels = p.m <= kFewRows ? kStreamPanels : job.row_blocks == 1 ? 1 : std::max(1, p.panels / threads);
  job.panels_per_chunk = panels;
  job.chunks = (p.panels + panels - 1) / panels;
  job.items = job.row_blocks * job.chunks;
}

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), yd = y->dimensions();
  const size_t rank = wd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || yd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("f32_matmul: x [M,K], packed [(L,) Np/32, K*32], layer [] or [1], y [M,N]");
  const int64_t stack = rank == 3 ? wd[0] : 1;
  const int64_t index = rank == 3 ? layer.typed_data()[0] : 0;
  if (index < 0 || index >= stack) return ffi::Error::InvalidArgument("f32_matmul: layer index out of range");
  Job job;
  Problem& p = job.p;
  p.m = static_cast<int>(xd[0]);
  p.k = static_cast<int>(xd[1]);
  p.n = static_cast<int>(yd[1]);
  p.panels = static_cast<int>(wd[rank - 2]);
  if (yd[0] != xd[0] || wd[rank - 1] != int64_t(p.k) * kPanel || p.n > p.panels * kPanel ||
      p.n + kPanel <= p.panels * kPanel)
    return ffi::Error::InvalidArgument("f32_matmul: packed weight, x and y shapes disagree");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.x = x.typed_data();
  p.w = packed.typed_data() + index * static_cast<size_t>(p.panels) * p.panel_floats();
  p.y = y->typed_data();
  if (p.k == 0) {
    std::memset(p.y, 0, sizeof(float) * static_cast<size_t>(p.m) * p.n);
    return ffi::Error::Success();
  }
  job.isa = g_isa.get();
  int threads = std::max(1, static_cast<int>(pool.num_threads()));
  const int cap = g_max_threads.load(std::memory_order_relaxed);
  if (cap > 0) threads = std::min(threads, cap);
  Split(job, threads);
  const std::vector<Claim> claims = job.Claims();
  rt::ParallelFor(pool, static_cast<int64_t>(claims.size()), threads, [&](int64_t i) {
    job.Run(claims[i].rb, claims[i].lo, claims[i].hi);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamF32Matmul, F32MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // packed [(L,) Np/32, K*32]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer: which of a stack [L, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

// ---- Python module: targets(), isa(), set_isa() (runtime/module.h) and threading() ---------------

// threading(max_threads, rows_per_block, panels_per_chunk) -> the previous three; a negative
// argument keeps that setting, 0 restores the default. For tests and benchmarks of the work split.
static PyObject* ThreadingPy(PyObject*, PyObject* args) {
  int max_threads = -1, rows = -1, panels = -1;
  if (!PyArg_ParseTuple(args, "|iii", &max_threads, &rows, &panels)) return nullptr;
  PyObject* prev = Py_BuildValue("(iii)", g_max_threads.load(), g_rows_per_block.load(), g_panels_per_chunk.load());
  if (max_threads >= 0) g_max_threads.store(max_threads);
  if (rows >= 0) g_rows_per_block.store(rows);
  if (panels >= 0) g_panels_per_chunk.store(panels);
  return prev;
}

PyMODINIT_FUNC PyInit__f32_matmul() {
  static rt::ModuleSpec spec{
      "_f32_matmul", "f32 matmul over column-panel-packed weights for XLA:CPU through the FFI.",
      {{"slipstream_f32_matmul", reinterpret_cast<void*>(SlipstreamF32Matmul)}},
      &g_isa,
      {{"threading", ThreadingPy, METH_VARARGS,
        "threading(max_threads, rows_per_block, panels_per_chunk): set the work split (negative: keep, 0: "
        "default); returns the previous."}}};
  return rt::CreateModule(spec);
}
