// Multi-LoRA delta as an XLA FFI custom call on CPU: y[t] += (x[t] A_s) B_s for every token t on an adapter
// slot s = slots[t] >= 1; a token on slot 0 (the base model) keeps its row. y is updated in place (the call
// aliases it to its result), in columns col .. col + N - 1 of its rows: a fused group's output (q | k | v,
// gate | up) takes each member's delta where it lies, with no copy of the member's columns. With `gated`,
// x is a gated MLP's gate | up [T, 2K] and a token's input row is silu(gate) * up (the down projection's
// delta beside kernels/q8_matmul's gated down projection), formed here for the adapter tokens only.
//
// The adapters of S slots of rank r lie side by side in two stacks packed for kernels/f32_matmul (its
// pack(); quantization/lora.py's PackedStack), read at `layer` where they lie:
//   A [L][ceil(S*r/32)][K][32]   slot s's columns (s-1)*r .. s*r - 1: column c in panel c/32, lane c%32
//   B [L][ceil(N/32)][S*r][32]   slot s's rows (s-1)*r .. s*r - 1 of each panel, contiguous
// Only a token's own slot is multiplied: r*(K + N) multiply-adds per token, where a dense product over all
// slots (masked) takes S times as many and reads every slot's A and B whatever the tokens use.
//
// Work split: the tokens are grouped by slot (a counting sort of slots[]); an item is a block of up to
// kBlock tokens of one slot, the items of a slot adjacent, claimed from an atomic counter by the calling
// thread and helpers on XLA's pool (runtime/parallel.h). An item runs micro tiles of R tokens
// (lora_delta_tile.h): h = x A_s over all of K, then y += h B_s over the r rows; a slot's A and B
// (r*(K + N) floats: 36-98 KiB each at r = 16 on the default model) come from memory once per item and stay
// in L2 for its tiles.
//
// Instruction sets, chosen at run time: AVX-512 and AVX2 + FMA (one body over runtime/vec.h,
// lora_delta_tile.h), portable C++.
#include <Python.h>

#include <algorithm>
#include <cmath>
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

constexpr int kPanel = 32;  // columns per packed panel (kernels/f32_matmul.py's PANEL)
constexpr int kBlock = 28;  // tokens per work item at most: two AVX-512 tiles

rt::IsaChoice g_isa{Isa::kPortable, Isa::kAvx2, Isa::kAvx512};

struct Problem {
  const float* x;  // [t, ldx]: the input rows, or gate | up rows (ldx = 2k) when gated
  const float* a;  // the layer's A panels [ceil(cols/32)][k][32]
  const float* b;  // the layer's B panels [ceil(n/32)][cols][32]
  float* y;        // [t, ldy] from the member's first column: n of each row updated in place
  int k, n, ldx, ldy, rank, cols;
  bool gated;
};

// One slot's columns of A (rows of B) as the vector paths read them: from column c0, rounded out to whole
// vectors of A's panels (v0 .. v0 + nv - 1); h holds the tile's x A over those, row stride hstride, and
// the slot's own columns from hoff.
struct Span {
  int c0, v0, nv, hoff, hstride;
};

// ---- portable: one token at a time --------------------------------------------------------------

void RunPortable(const Problem& p, int slot, const int* tok, int count) {
  const int c0 = (slot - 1) * p.rank;
  std::vector<float> h(p.rank), gated(p.gated ? p.k : 0);
  for (int t = 0; t < count; ++t) {
    const float* x = p.x + static_cast<size_t>(tok[t]) * p.ldx;
    if (p.gated) {  // silu(g) * u as lora_delta_tile.h's GatedRow
      for (int i = 0; i < p.k; ++i) {
        const float g = x[i], e = std::exp(-std::fabs(g));
        gated[i] = g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * x[p.k + i];
      }
      x = gated.data();
    }
    for (int j = 0; j < p.rank; ++j) {
      const int c = c0 + j;
      const float* a = p.a + static_cast<size_t>(c / kPanel) * p.k * kPanel + c % kPanel;
      float acc = 0.f;
      for (int kk = 0; kk < p.k; ++kk) acc += x[kk] * a[static_cast<size_t>(kk) * kPanel];
      h[j] = acc;
    }
    float* y = p.y + static_cast<size_t>(tok[t]) * p.ldy;
    for (int c = 0; c < p.n; ++c) {
      const float* b = p.b + static_cast<size_t>(c / kPanel) * p.cols * kPanel + static_cast<size_t>(c0) * kPanel +
                       c % kPanel;
      float acc = 0.f;
      for (int j = 0; j < p.rank; ++j) acc += h[j] * b[j * kPanel];
      y[c] += acc;
    }
  }
}

// AVX2 + FMA and AVX-512 F: lora_delta_tile.h, written once over runtime/vec.h, compiled for each.
#define SLIPSTREAM_PER_ISA_BODY "lora_delta_tile.h"
#include "runtime/per_isa.h"

using RunFn = void (*)(const Problem&, int, const int*, int);

RunFn PickRun(Isa isa) {
#if defined(SLIPSTREAM_X86)
  if (isa == Isa::kAvx512) return &avx512::Run;
  if (isa == Isa::kAvx2) return &avx2::Run;
#endif
  return &RunPortable;
}

struct Item {
  int slot, first, count;  // `count` tokens of `slot`, from order[first]
};

ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y_in, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::S32> layer, int64_t rank, int64_t col, int64_t n, int64_t gated,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto yd = y_in.dimensions(), xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (yd.size() != 2 || xd.size() != 2 || ad.size() != bd.size() || (ad.size() != 2 && ad.size() != 3) ||
      slots.dimensions().size() != 1 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "lora_delta: y [T,W], x [T,K] (gated: [T,2K]), a [(L,) ceil(S*r/32), K*32], b [(L,) ceil(N/32), S*r*32], slots [T], "
        "layer []");
  const size_t rk = ad.size();
  const int64_t stack = rk == 3 ? ad[0] : 1, index = rk == 3 ? layer.typed_data()[0] : 0;
  if (rk == 3 && bd[0] != stack) return ffi::Error::InvalidArgument("lora_delta: A and B stacks of different depths");
  if (index < 0 || index >= stack) return ffi::Error::InvalidArgument("lora_delta: layer index out of range");
  Problem p;
  const int64_t t = xd[0];
  p.gated = gated != 0;
  if (p.gated && xd[1] % 2) return ffi::Error::InvalidArgument("lora_delta: a gated x holds gate | up, an even width");
  p.ldx = static_cast<int>(xd[1]);
  p.k = p.gated ? p.ldx / 2 : p.ldx;
  if (col < 0 || n < 0 || col + n > yd[1]) return ffi::Error::InvalidArgument("lora_delta: columns col .. col + n outside y");
  p.n = static_cast<int>(n);
  p.ldy = static_cast<int>(yd[1]);
  p.cols = static_cast<int>(bd[rk - 1] / kPanel);
  if (rank < 1 || p.cols % rank != 0)
    return ffi::Error::InvalidArgument("lora_delta: B's rows are not whole slots of the rank");
  p.rank = static_cast<int>(rank);
  const int num_slots = p.cols / p.rank;
  const int64_t pa = ad[rk - 2], pb = bd[rk - 2];
  if (yd[0] != t || slots.dimensions()[0] != t || ad[rk - 1] != int64_t(p.k) * kPanel ||
      bd[rk - 1] != int64_t(p.cols) * kPanel || pa != (p.cols + kPanel - 1) / kPanel ||
      pb != (p.n + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("lora_delta: y, x, A, B and slots shapes disagree");
  p.y = y->typed_data();
  if (p.y != y_in.typed_data()) std::memcpy(p.y, y_in.typed_data(), sizeof(float) * static_cast<size_t>(t) * p.ldy);
  p.y += col;
  p.x = x.typed_data();
  p.a = a.typed_data() + index * pa * int64_t(p.k) * kPanel;
  p.b = b.typed_data() + index * pb * int64_t(p.cols) * kPanel;

  // tokens grouped by slot: order[] lists each slot's tokens in turn (slot 0's are left out)
  const int32_t* s = slots.typed_data();
  std::vector<int> start(num_slots + 2, 0);
  for (int64_t i = 0; i < t; ++i) {
    if (s[i] < 0 || s[i] > num_slots) return ffi::Error::InvalidArgument("lora_delta: a token's slot is out of range");
    ++start[s[i] + 1];
  }
  if (start[1] == t || p.n == 0) return ffi::Error::Success();  // no token on an adapter
  for (int i = 1; i <= num_slots + 1; ++i) start[i] += start[i - 1];
  std::vector<int> order(t), fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < t; ++i) order[fill[s[i]]++] = static_cast<int>(i);
  std::vector<Item> items;
  for (int slot = 1; slot <= num_slots; ++slot) {
    const int count = start[slot + 1] - start[slot];
    if (count == 0) continue;
    const int blocks = (count + kBlock - 1) / kBlock, base = count / blocks, extra = count % blocks;
    for (int i = 0, first = start[slot]; i < blocks; ++i) {
      const int rows = base + (i < extra);
      items.push_back({slot, first, rows});
      first += rows;
    }
  }
  const RunFn run = PickRun(g_isa.get());
  rt::ParallelFor(pool, static_cast<int64_t>(items.size()), 0, [&](int64_t i) {
    run(p, items[i].slot, order.data() + items[i].first, items[i].count);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SlipstreamLoraDelta, LoraDeltaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y [T, N] (aliased to the result)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A [(L,) ceil(S*r/32), K*32]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // B [(L,) ceil(N/32), S*r*32]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]: 0 the base model
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer: which of the stacks [L, ...]
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("col")           // the first of y's columns updated
                                  .Attr<int64_t>("n")             // how many: B's width N
                                  .Attr<int64_t>("gated")         // 1: x is gate | up, the input silu(gate) * up
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y, its columns col .. col + N - 1 + the deltas

PyMODINIT_FUNC PyInit__lora_delta() {
  static rt::ModuleSpec spec{
      "_lora_delta", "Multi-LoRA per-token delta over slot stacks packed for kernels/f32_matmul (XLA:CPU FFI).",
      {{"slipstream_lora_delta", reinterpret_cast<void*>(SlipstreamLoraDelta)}},
      &g_isa,
      {}};
  return rt::CreateModule(spec);
}
