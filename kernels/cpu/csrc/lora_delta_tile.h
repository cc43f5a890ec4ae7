// lora_delta.cc's micro kernel for one vector width, written once over runtime/vec.h: included by
// lora_delta.cc once per instruction set, inside that set's `#pragma GCC target` region and a namespace
// that defines V (rt::Vec8 for AVX2, rt::Vec16 for AVX-512). No include guard: included more than once.
//
// R tokens of one slot: h = x A_s (one vector of A's columns at a time, R accumulators over all of K, each
// A load feeding R FMAs), then y += h B_s (two vectors of a B panel's columns at a time, 2R accumulators
// over the slot's r rows). h stays in L1 between the two. Each output is one chain of FMAs in order (k for
// h, then the rank index for the delta), added to y once. A gated x (gate | up) gives each tile's rows
// silu(gate) * up first, into a scratch block.

constexpr int L = V::kLanes;
using F = typename V::F;
constexpr int kMaxTileRows = V::kRegs >= 32 ? 14 : 6;  // 2R accumulators + 2 B vectors + 1 broadcast

// out[0 .. k) = silu(g) * u for g = gu[0 .. k), u = gu[k .. 2k): silu(g) = g * sigmoid(g) as jax.nn.silu
// computes it, sigmoid from e = exp(-|g|) <= 1 (V::exp's domain): 1 / (1 + e) for g >= 0, e / (1 + e) below.
void GatedRow(const float* gu, int k, float* out) {
  const F one = V::set1(1.f), zero = V::zero();
  for (int i = 0; i < k; i += L) {
    const int valid = k - i;
    const auto m = V::first(valid);
    const F g = valid >= L ? V::load(gu + i) : V::load(gu + i, m);
    const F u = valid >= L ? V::load(gu + k + i) : V::load(gu + k + i, m);
    const F e = V::exp(V::sub(zero, V::abs(g)));
    const F sig = V::div(V::select(V::ge(g, zero), one, e), V::add(one, e));
    V::store_first(out + i, V::mul(V::mul(g, sig), u), valid);
  }
}

template <int R>
void Project(const Problem& p, const Span& s, const int* tok, const float* const* xr, float* h) {
  // h[i][v*L ..]: the slot's columns rounded out to whole vectors, from global column s.v0 * L
  for (int v = 0; v < s.nv; ++v) {
    const int col = (s.v0 + v) * L;  // a vector never straddles two panels: L divides kPanel
    const float* a = p.a + static_cast<size_t>(col / kPanel) * p.k * kPanel + col % kPanel;
    F acc[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = V::zero();
    for (int kk = 0; kk < p.k; ++kk) {
      const F w = V::load(a + static_cast<size_t>(kk) * kPanel);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = V::fma(V::set1(xr[i][kk]), w, acc[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) V::store(h + i * s.hstride + v * L, acc[i]);
  }
  // y rows += h B_s, two vectors of columns per pass (a whole panel on AVX-512, half of one on AVX2)
  const float* hs = h + s.hoff;  // row j of B_s is h's column hoff + j
  for (int n0 = 0; n0 < p.n; n0 += 2 * L) {
    const float* b = p.b + static_cast<size_t>(n0 / kPanel) * p.cols * kPanel + static_cast<size_t>(s.c0) * kPanel +
                     n0 % kPanel;
    F acc[R][2];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = V::zero();
    for (int j = 0; j < p.rank; ++j) {
      const F b0 = V::load(b + j * kPanel), b1 = V::load(b + j * kPanel + L);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const F hv = V::set1(hs[i * s.hstride + j]);
        acc[i][0] = V::fma(hv, b0, acc[i][0]);
        acc[i][1] = V::fma(hv, b1, acc[i][1]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      float* y = p.y + static_cast<size_t>(tok[i]) * p.ldy + n0;
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const int valid = p.n - n0 - v * L;
        if (valid >= L) {
          V::store(y + v * L, V::add(V::load(y + v * L), acc[i][v]));
        } else if (valid > 0) {
          const auto m = V::first(valid);
          V::store_first(y + v * L, V::add(V::load(y + v * L, m), acc[i][v]), valid);
        }
      }
    }
  }
}

// `rows` (1 .. kMaxTileRows) tokens of the slot at `tok`, their x rows at xr.
template <int R = kMaxTileRows>
void Tile(const Problem& p, const Span& s, const int* tok, const float* const* xr, int rows, float* h) {
  if constexpr (R > 1) {
    if (rows < R) return Tile<R - 1>(p, s, tok, xr, rows, h);
  }
  Project<R>(p, s, tok, xr, h);
}

// One work item: `count` tokens of slot `slot` (>= 1) at `tok`, in tiles of near-equal height.
void Run(const Problem& p, int slot, const int* tok, int count) {
  Span s;
  s.c0 = (slot - 1) * p.rank;
  s.v0 = s.c0 / L;
  s.nv = (s.c0 + p.rank + L - 1) / L - s.v0;
  s.hoff = s.c0 - s.v0 * L;
  s.hstride = s.nv * L;
  std::vector<float> h(static_cast<size_t>(kMaxTileRows) * s.hstride);
  std::vector<float> gated(p.gated ? static_cast<size_t>(kMaxTileRows) * p.k : 0);
  const float* xr[kMaxTileRows];
  const int tiles = (count + kMaxTileRows - 1) / kMaxTileRows, base = count / tiles, extra = count % tiles;
  for (int t = 0; t < tiles; ++t) {
    const int rows = base + (t < extra);
    for (int i = 0; i < rows; ++i) {
      xr[i] = p.x + static_cast<size_t>(tok[i]) * p.ldx;
      if (p.gated) {
        GatedRow(xr[i], p.k, gated.data() + static_cast<size_t>(i) * p.k);
        xr[i] = gated.data() + static_cast<size_t>(i) * p.k;
      }
    }
    Tile(p, s, tok, xr, rows, h.data());
    tok += rows;
  }
}
