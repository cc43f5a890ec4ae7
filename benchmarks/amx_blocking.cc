/* Candidate inner loops for the q8 matmul's AMX path (kernels/cpu/csrc/q8_matmul.cc, TileBf16), on the default
 * model's sizes, one thread, operands prepacked; useful GFLOP/s = 2*M*K*N over the thread's CPU time (best of 30):
 *   A   x and w each bf16 hi + lo, three products per group, 1 row tile x 2 column tiles
 *   A2  the same in 2 x 2 blocks; A3 A2 with each tile load issued right after the last product reading it
 *   B1  the integer q in bf16 (exact) times x hi + lo, two products per group, the group's scales (and
 *       offsets) applied per group by a vector pass over double-buffered C tiles, 1 x 2 blocks
 *   B3  B1 on one column tile with the accumulators in registers
 * and the cost of an int8 tile product at K = 64 and at K = 32 (a group of 32 alone).
 *     g++ -O2 -std=c++17 -mamx-tile -mamx-bf16 -mamx-int8 -mavx512f amx_blocking.cc -o amx_blocking
 *     ./amx_blocking K M TILES     (e.g. 576 256 192: A2/A3 sweep TILES column tiles, the others 6) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <vector>
struct Cfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static Cfg cfg;
static double now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int M = 256, K = 576, NT = 6; // NT col tiles per chunk
static int G, NTOT = 6;
uint16_t *xh, *xl, *wh, *wl, *wq; float *y, *ds, *ms, *sx;
// layouts: x [rt][g][16][32]; w per tile [t][g][16][32]
#define XT(p, rt, g) ((p) + ((size_t)(rt) * G + (g)) * 512)
#define WT(p, t, g) ((p) + ((size_t)(t) * G + (g)) * 512)
// (A) 1 row tile x 2 col tiles, 3 products
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runA() {
  for (int t = 0; t < NT; t += 2)
    for (int rt = 0; rt < M / 16; ++rt) {
      _tile_zero(0); _tile_zero(1);
      for (int g = 0; g < G; ++g) {
        _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xl, rt, g), 64);
        _tile_loadd(6, WT(wh, t, g), 64); _tile_loadd(7, WT(wl, t, g), 64);
        _tile_dpbf16ps(0, 5, 6); _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(2, WT(wh, t + 1, g), 64); _tile_loadd(3, WT(wl, t + 1, g), 64);
        _tile_dpbf16ps(1, 5, 2); _tile_dpbf16ps(1, 4, 3); _tile_dpbf16ps(1, 4, 2);
      }
      _tile_stored(0, y + (size_t)rt * 16 * 96 + t * 16, 96 * 4);
      _tile_stored(1, y + (size_t)rt * 16 * 96 + t * 16 + 16, 96 * 4);
    }
}
// (A2) 2x2 blocking, 3 products
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runA2() {
  for (int t = 0; t < NTOT; t += 2)
    for (int rt = 0; rt < M / 16; rt += 2) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int g = 0; g < G; ++g) {
        _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xh, rt + 1, g), 64);
        _tile_loadd(6, WT(wh, t, g), 64); _tile_loadd(7, WT(wh, t + 1, g), 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(6, WT(wl, t, g), 64); _tile_loadd(7, WT(wl, t + 1, g), 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, XT(xl, rt, g), 64); _tile_loadd(5, XT(xl, rt + 1, g), 64);
        _tile_loadd(6, WT(wh, t, g), 64); _tile_loadd(7, WT(wh, t + 1, g), 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      float* o = y + (size_t)rt * 16 * 96 + (t % NT) * 16;
      _tile_stored(0, o, 384); _tile_stored(1, o + 16, 384);
      _tile_stored(2, o + 16 * 96, 384); _tile_stored(3, o + 16 * 96 + 16, 384);
    }
}
// (B1) q exact in bf16, x hi+lo: 2 products per group and C tile; per-group scale pass; 1 row tile x 2 col
// tiles, C double-buffered (0,1 | 2,3), accumulators in a local 16x32 buffer.
template <bool OFF>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void scalePass(const float* c, float* acc, const float* d, const float* m, const float* s) {
  const __m512 dv = _mm512_loadu_ps(d);
  const __m512 mv = _mm512_loadu_ps(m);
  for (int r = 0; r < 16; ++r) {
    __m512 a = _mm512_load_ps(acc + r * 16);
    a = _mm512_fmadd_ps(_mm512_load_ps(c + r * 16), dv, a);
    if (OFF) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(s[r]), a);
    _mm512_store_ps(acc + r * 16, a);
  }
}
template <bool OFF>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runB1() {
  alignas(64) float cbuf[2][2][256];
  alignas(64) float acc[2][256];
  for (int t = 0; t < NT; t += 2)
    for (int rt = 0; rt < M / 16; ++rt) {
      memset(acc, 0, sizeof acc);
      const float* sxr = sx + (size_t)rt * 16 * G;  // [row][g] -> use [g][16] layout for simplicity
      for (int g = 0; g <= G; ++g) {
        if (g < G) {
          if (g % 2 == 0) {
            _tile_zero(0); _tile_zero(1);
            _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xl, rt, g), 64);
            _tile_loadd(6, WT(wq, t, g), 64); _tile_loadd(7, WT(wq, t + 1, g), 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7);
          } else {
            _tile_zero(2); _tile_zero(3);
            _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xl, rt, g), 64);
            _tile_loadd(6, WT(wq, t, g), 64); _tile_loadd(7, WT(wq, t + 1, g), 64);
            _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7);
          }
        }
        if (g > 0) {  // previous group's tiles
          const int pg = g - 1, b = pg % 2;
          if (b == 0) { _tile_stored(0, cbuf[0][0], 64); _tile_stored(1, cbuf[0][1], 64); }
          else { _tile_stored(2, cbuf[1][0], 64); _tile_stored(3, cbuf[1][1], 64); }
          for (int c = 0; c < 2; ++c)
            scalePass<OFF>(cbuf[b][c], acc[c], ds + ((size_t)(t + c) * G + pg) * 16, ms + ((size_t)(t + c) * G + pg) * 16, sxr + pg * 16);
        }
      }
      for (int c = 0; c < 2; ++c)
        for (int r = 0; r < 16; ++r) memcpy(y + ((size_t)rt * 16 + r) * 96 + (t + c) * 16, acc[c] + r * 16, 64);
    }
}
// (B3) one col tile, register accumulators, C double buffered (0 | 1), x in 4,5, q in 6
template <bool OFF>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runB3() {
  alignas(64) float cbuf[2][256];
  for (int t = 0; t < NT; ++t)
    for (int rt = 0; rt < M / 16; ++rt) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const float* sxr = sx + (size_t)rt * 16 * G;
      for (int g = 0; g <= G; ++g) {
        if (g < G) {
          if (g % 2 == 0) {
            _tile_zero(0);
            _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xl, rt, g), 64); _tile_loadd(6, WT(wq, t, g), 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6);
          } else {
            _tile_zero(1);
            _tile_loadd(4, XT(xh, rt, g), 64); _tile_loadd(5, XT(xl, rt, g), 64); _tile_loadd(6, WT(wq, t, g), 64);
            _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 5, 6);
          }
        }
        if (g > 0) {
          const int pg = g - 1, b = pg % 2;
          if (b == 0) _tile_stored(0, cbuf[0], 64); else _tile_stored(1, cbuf[1], 64);
          const __m512 dv = _mm512_loadu_ps(ds + ((size_t)t * G + pg) * 16);
          const __m512 mv = _mm512_loadu_ps(ms + ((size_t)t * G + pg) * 16);
          for (int r = 0; r < 16; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf[b] + r * 16), dv, acc[r]);
            if (OFF) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sxr[pg * 16 + r]), acc[r]);
          }
        }
      }
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + ((size_t)rt * 16 + r) * 96 + t * 16, acc[r]);
    }
}
// raw int8 tdpbusd cost at K=64 vs K=32 (1 C tile chain of 4 independent C)
__attribute__((target("amx-tile,amx-int8"))) double int8depth(int kbytes) {
  Cfg c{}; c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  c.colsb[4] = c.colsb[5] = kbytes; c.rows[6] = c.rows[7] = kbytes / 4;
  _tile_loadconfig(&c);
  _tile_loadd(4, xh, 64); _tile_loadd(5, xh, 64); _tile_loadd(6, wq, 64); _tile_loadd(7, wq, 64);
  long it = 1000000; double s = now();
  for (long i = 0; i < it; ++i) { _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7); }
  double e = now() - s; _tile_release(); _tile_loadconfig(&cfg);
  return e / (it * 4) * 1e9;  // ns per product
}
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runA3() {
  for (int t = 0; t < NTOT; t += 2)
    for (int rt = 0; rt < M / 16; rt += 2) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const uint16_t *xl0 = XT(xl, rt, 0), *xl1 = XT(xl, rt + 1, 0), *xh0 = XT(xh, rt, 0), *xh1 = XT(xh, rt + 1, 0);
      const uint16_t *h0 = WT(wh, t, 0), *h1 = WT(wh, t + 1, 0), *l0 = WT(wl, t, 0), *l1 = WT(wl, t + 1, 0);
      _tile_loadd(4, xl0, 64); _tile_loadd(6, h0, 64); _tile_loadd(7, h1, 64); _tile_loadd(5, xl1, 64);
      for (int g = 0; g < G; ++g) {
        const size_t o = (size_t)g * 512; const bool next = g + 1 < G;
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_loadd(4, xh0 + o, 64);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); _tile_loadd(5, xh1 + o, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); _tile_loadd(6, l0 + o, 64);
        _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_loadd(7, l1 + o, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); if (next) _tile_loadd(6, h0 + o + 512, 64);
        _tile_dpbf16ps(1, 4, 7); if (next) _tile_loadd(4, xl0 + o + 512, 64);
        _tile_dpbf16ps(3, 5, 7); if (next) { _tile_loadd(7, h1 + o + 512, 64); _tile_loadd(5, xl1 + o + 512, 64); }
      }
      float* o = y + (size_t)rt * 16 * 96 + (t % NT) * 16;
      _tile_stored(0, o, 384); _tile_stored(1, o + 16, 384);
      _tile_stored(2, o + 16 * 96, 384); _tile_stored(3, o + 16 * 96 + 16, 384);
    }
}
int main(int argc, char** argv) {
  if (argc > 1) K = atoi(argv[1]);
  if (argc > 2) M = atoi(argv[2]);
  G = K / 32;
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg.palette = 1; for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  if (argc > 3) NTOT = atoi(argv[3]);
  size_t xe = (size_t)M * K, we = (size_t)NTOT * 16 * K;
  auto al = [](size_t b) { return aligned_alloc(64, (b + 63) / 64 * 64); };
  xh = (uint16_t*)al(xe * 2); xl = (uint16_t*)al(xe * 2); wh = (uint16_t*)al(we * 2); wl = (uint16_t*)al(we * 2); wq = (uint16_t*)al(we * 2);
  for (size_t i = 0; i < xe; ++i) { xh[i] = 0x3f80 | (rand() & 0x7f); xl[i] = 0x3300 | (rand() & 0x7f); }
  for (size_t i = 0; i < we; ++i) { wh[i] = 0x3f80 | (rand() & 0x7f); wl[i] = 0x3300 | (rand() & 0x7f); wq[i] = 0x4200 | (rand() & 0x7f); }
  y = (float*)al((size_t)M * 96 * 4); ds = (float*)al((size_t)NT * G * 64); ms = (float*)al((size_t)NT * G * 64); sx = (float*)al((size_t)M * G * 4);
  for (size_t i = 0; i < (size_t)NT * G * 16; ++i) { ds[i] = 0.01f; ms[i] = 0.001f; }
  for (size_t i = 0; i < (size_t)M * G; ++i) sx[i] = 1.f;
  _tile_loadconfig(&cfg);
  struct { const char* name; void (*f)(); } runs[] = {{"A 1x2 3prod", runA}, {"A2 2x2 3prod", runA2}, {"A3 2x2 pipelined", runA3}, {"A2 again", runA2}, {"A3 again", runA3}, {"B1 1x2 2prod+scale", runB1<false>},
    {"B1 +offsets", runB1<true>}, {"B3 1x1 reg acc", runB3<false>}, {"B3 +offsets", runB3<true>}};
  double flop = 2.0 * M * K * NT * 16; double flopA2 = 2.0 * M * K * NTOT * 16;
  for (auto& r : runs) {
    double best = 1e9;
    for (int rep = 0; rep < 30; ++rep) { double s = now(); r.f(); best = std::min(best, now() - s); }
    double fl = (r.f == runA2 || r.f == runA3) ? flopA2 : flop;
    printf("K=%d M=%d NTOT=%d %-22s %8.1f us  %6.0f GFLOP/s useful (1 core)\n", K, M, NTOT, r.name, best * 1e6, fl / best / 1e9);
  }
  printf("int8 tdpbusd ns/product: K=64 %.2f, K=32 %.2f\n", int8depth(64), int8depth(32));
}
