// f32_matmul.cc's micro kernel for one vector width, written once over runtime/vec.h: included by
// f32_matmul.cc once per instruction set, inside that set's `#pragma GCC target` region and a namespace
// that defines V (rt::Vec8 for AVX2, rt::Vec16 for AVX-512). No include guard: included more than once.
//
// R rows of x from row0 x P panels from panel0, over all of K; writes y rows row0 .. row0 + R - 1, the
// columns of the P panels below n. Each output is one chain of FMAs over k in order, whatever the blocking.
//  - Few rows (R <= kFewRows, decode): R x (P panels) accumulators, one pass over the panels' streams.
//  - More rows: two vectors of columns per pass (2R accumulators + 2 weight vectors + 1 broadcast), so each
//    weight load feeds 2R FMAs: one pass per panel on AVX-512 (2 x 16 columns), two on AVX2 (2 x 8; with
//    a whole panel per pass the 16 ymm ran out and the weights were re-read from L1 by every row, and the
//    loads, not the FMAs, bounded it: 28% of the FMA peak on a Zen 3 EPYC at 256 rows, half of XLA's dots).
// Two tunings differ by width, each as measured on the machines it was tuned on: the stream prefetch
// (AVX-512), and x's rows as pointers (AVX2, <= 6 rows: each broadcast one load with an index, no address
// arithmetic; AVX-512's 14 rows would take 14 of the 16 general registers). Every loop over the
// accumulators carries an unroll pragma: one left rolled makes gcc keep them in memory, stored on every k.

constexpr int L = V::kLanes;
using F = typename V::F;
constexpr bool kWide = V::kRegs >= 32;
constexpr int kMaxTileRows = kWide ? 14 : 6;
constexpr int kKUnroll = kWide ? 1 : 4;  // the k loop's unrolling as each was tuned

template <int R, int P>
void Tile(const Problem& p, int row0, int panel0, Ahead ahead) {
  constexpr bool kStream = R <= kFewRows;
  static_assert(kStream || P == 1, "more rows: one panel");
  constexpr int NV = kStream ? P * kPanel / L : 2;  // accumulator vectors per row and pass
  constexpr int kPasses = P * kPanel / (NV * L);
  const float* a = p.x + static_cast<size_t>(row0) * p.k;
  const float* b = p.w + panel0 * p.panel_floats();
  const size_t stride = p.panel_floats();
  if (kWide && kStream)
    for (int c = 0; c < P; ++c)
      for (int off = 0; off < kPrefetchBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + c * stride) + off, _MM_HINT_T0);
  const float* ar[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) ar[r] = a + static_cast<size_t>(r) * p.k;
  int countdown = ahead.every;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int col0 = pass * NV * L;  // the pass's first column within the P panels
    if (panel0 * kPanel + col0 >= p.n) break;
    F acc[R][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
#pragma GCC unroll kKUnroll
    for (int kk = 0; kk < p.k; ++kk) {
      if (!kStream && ahead.lines > 0 && --countdown == 0) {  // the next panel (on AVX2 over the first pass)
        _mm_prefetch(ahead.next, _MM_HINT_T1);
        ahead.next += 64;
        --ahead.lines;
        countdown = ahead.every;
      }
      F bv[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const int col = col0 + v * L, c = col / kPanel;
        const float* bc = b + c * stride + static_cast<size_t>(kk) * kPanel + col % kPanel;
        if (kWide && kStream && col % kPanel == 0 && (kk & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(bc) + kPrefetchBytes, _MM_HINT_T0);
        bv[v] = V::load(bc);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const F av = kWide ? V::set1(a[static_cast<size_t>(r) * p.k + kk]) : V::broadcast(ar[r] + kk);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(av, bv[v], acc[r][v]);
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const int n0 = panel0 * kPanel + col0 + v * L;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) V::store_first(p.y + static_cast<size_t>(row0 + r) * p.n + n0, acc[r][v], p.n - n0);
    }
  }
}
