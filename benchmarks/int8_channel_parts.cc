/* Where the time of kernels/cpu/csrc/int8_channel_matmul.cc's AMX path goes: one thread, one call's worth of work
 * on random data (M rows, K inputs, N outputs, P activation parts), thread CPU time, best and median of REPS.
 * Built against the kernel's own source (it includes the .cc file) and the XLA FFI headers:
 *     python -m benchmarks.kernel int8 --channel-parts [--rows 256]      (builds and runs this for the five shapes)
 * or by hand:
 *     g++ -O3 -std=c++17 -ffp-contract=off -Ikernels/cpu/csrc \
 *         -I$(python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
 *         -I$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])') benchmarks/int8_channel_parts.cc \
 *         -L$LIBDIR -lpython3.11 -o int8_channel_parts && ./int8_channel_parts M K N P [REPS [PEAK]]
 * (the kernel's module entry points link against libpython; LIBDIR: sysconfig's, also on LD_LIBRARY_PATH).
 * Stages, each with everything before it, in the kernel's order (row tile pairs outer, column pairs inner, chunks
 * of up to 48 column tiles), the sums the kernel's own:
 *   quant   the row quantization (Job::Quantize) alone
 *   loop    the tile products of every 2 x 2 block, C tiles left in the tile registers
 *   cstore  + the four C tile stores per block
 *   finish  + the float steps, each output vector stored to one small L1-resident buffer
 *   call    the kernel's own items (Job::Run: quantization, products, float steps, stores to the [M, N] output)
 *   gated   what a gated gate/up call would do (not in the kernel): quantization, then 2 x 2 blocks pairing column
 *           tile t with tile t + N/32 (gate and up), both finished and silu(g) * u (fixed operations, SiluMul)
 *           stored once: half the output stores, the same tile products
 * Prints microseconds and, for loop, call and gated, GOP/s (2*M*K*N over the time) and the share of `peak` if
 * given. */
#include "int8_channel_matmul.cc"  // NOLINT: the kernel's translation unit, its anonymous namespace included

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>

namespace {

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum Stage { kLoop, kCStore, kFinish, kGated };

alignas(64) float g_sink[2][kAmxRows * 2 * kTile];  // the finish stage's outputs: one block's, kept in L1

// silu(g) * u by fixed operations: exp(-g) by range reduction, a degree-6 Horner polynomial and scaling by 2^n, its
// argument clamped to [-87, 88] (no subnormals), then a division: what a gated gate/up call would add per output.
__attribute__((target("avx512f"), always_inline)) inline __m512 SiluMul(__m512 g, __m512 u) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
  __m512 q = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(c));
  const __m512 e = _mm512_scalef_ps(q, n);
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// C tiles 0-3 = rows x (row tile pair) . columns w0 | w1, over all of K (the kernel's 2 x 2 block).
__attribute__((target("amx-tile,amx-int8"))) inline void Block2x2(const uint8_t* x, size_t row_tile, const int8_t* w0,
                                                                 const int8_t* w1, int kp) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int k = 0; k < kp; k += kStep) {
    const size_t xa = static_cast<size_t>(k / kStep) * kTileBytes, wb = static_cast<size_t>(k) * kTile;
    _tile_loadd(4, x + xa, kStep);
    _tile_loadd(6, w0 + wb, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, w1 + wb, 64);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(5, x + row_tile + xa, kStep);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
}

__attribute__((target("amx-tile,amx-int8"))) inline void StoreC(int32_t* cbuf, int kc) {
  _tile_stored(0, cbuf, 64);
  _tile_stored(1, cbuf + kc, 64);
  _tile_stored(2, cbuf + 2 * kc, 64);
  _tile_stored(3, cbuf + 3 * kc, 64);
}

template <int P>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl"))) void Stages(const Job& job, Stage stage) {
  const Problem& p = job.p;
  const Acts& a = *job.acts;
  const size_t row_tile = static_cast<size_t>(p.kp / kStep) * kTileBytes;
  const int row_tiles = (p.m * P + kAmxRows - 1) / kAmxRows;
  constexpr int kC = kAmxRows * kTile;
  alignas(64) int32_t cbuf[4 * kC];
  AmxBegin();
  if (stage == kGated) {  // gate tile t and up tile t + half in each block; silu(g) * u into [M, N / 2]
    const int half = p.tiles / 2;
    const size_t out_n = static_cast<size_t>(half) * kTile;
    for (int chunk = 0; chunk < job.chunks; ++chunk) {
      const int tile_lo = chunk * job.chunk_tiles / 2, tile_hi = std::min(tile_lo + job.chunk_tiles / 2, half);
      for (int rt = 0; rt < row_tiles; rt += 2)
        for (int t = tile_lo; t < tile_hi; ++t) {
          const uint8_t* x = a.u.data() + rt * row_tile;
          const int8_t* wg = p.w + t * p.tile_bytes();
          const int8_t* wu = p.w + (t + half) * p.tile_bytes();
          Block2x2(x, row_tile, wg, wu, p.kp);
          StoreC(cbuf, kC);
          const int ng = t * kTile, nu = (t + half) * kTile;
          const __m512i cg = _mm512_slli_epi32(_mm512_loadu_si512(p.colsum + ng), 7);
          const __m512i cu = _mm512_slli_epi32(_mm512_loadu_si512(p.colsum + nu), 7);
          const __m512 wsg = _mm512_loadu_ps(p.ws + ng), wsu = _mm512_loadu_ps(p.ws + nu);
          for (int r = 0; r < 2; ++r) {
            const int32_t* c0 = cbuf + 2 * r * kC;
            const int32_t* c1 = c0 + kC;
            const int row0 = (rt + r) * (kAmxRows / P);
            const float* xs = a.xs.data() + static_cast<size_t>(row0) * P;
            float* out = p.y + static_cast<size_t>(row0) * out_n + ng;
            for (int i = 0; i < kAmxRows / P; ++i, out += out_n) {
              const int at = i * P * kTile, at1 = (i * P + P - 1) * kTile;
              const __m512 g = Finish<P>(_mm512_load_si512(c0 + at), _mm512_load_si512(c0 + at1), cg, xs[i * P],
                                         xs[i * P + P - 1], wsg);
              const __m512 u = Finish<P>(_mm512_load_si512(c1 + at), _mm512_load_si512(c1 + at1), cu, xs[i * P],
                                         xs[i * P + P - 1], wsu);
              _mm512_storeu_ps(out, SiluMul(g, u));
            }
          }
        }
    }
    AmxEnd();
    return;
  }
  for (int chunk = 0; chunk < job.chunks; ++chunk) {
    const int tile_lo = chunk * job.chunk_tiles, tile_hi = std::min(tile_lo + job.chunk_tiles, p.tiles);
    for (int rt = 0; rt < row_tiles; rt += 2)  // whole row tile and column pairs (main checks)
      for (int t = tile_lo; t < tile_hi; t += 2) {
        const uint8_t* x = a.u.data() + rt * row_tile;
        const int8_t* w = p.w + t * p.tile_bytes();
        Block2x2(x, row_tile, w, w + p.tile_bytes(), p.kp);
        if (stage == kLoop) continue;
        StoreC(cbuf, kC);
        if (stage == kCStore) continue;
        for (int tt = 0; tt < 2; ++tt) {
          const int n0 = (t + tt) * kTile;
          const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(p.colsum + n0), 7);
          const __m512 ws = _mm512_loadu_ps(p.ws + n0);
          for (int r = 0; r < 2; ++r) {
            const int32_t* c = cbuf + (2 * r + tt) * kC;
            const float* xs = a.xs.data() + static_cast<size_t>(rt + r) * (kAmxRows / P) * P;
            for (int i = 0; i < kAmxRows / P; ++i)
              _mm512_store_ps(g_sink[tt] + (r * kAmxRows + i) * kTile,
                              Finish<P>(_mm512_load_si512(c + i * P * kTile),
                                        _mm512_load_si512(c + (i * P + P - 1) * kTile), corr, xs[i * P],
                                        xs[i * P + P - 1], ws));
          }
        }
      }
  }
  AmxEnd();
}

template <typename T>
struct Buffer {  // 64-byte aligned, as XLA's buffers are
  std::unique_ptr<T[], void (*)(T*)> data{nullptr, [](T* q) { ::operator delete[](q, std::align_val_t{64}); }};
  explicit Buffer(size_t n) {
    data.reset(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t{64})));
  }
  T& operator[](size_t i) { return data[i]; }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s M K N P [REPS [PEAK_GOPS]]\n", argv[0]);
    return 2;
  }
  const int m = atoi(argv[1]), k = atoi(argv[2]), n = atoi(argv[3]), parts = atoi(argv[4]);
  const int reps = argc > 5 ? atoi(argv[5]) : 30;
  const double peak = argc > 6 ? atof(argv[6]) : 0.0;
  if (m < 1 || k < 1 || n < 1 || (parts != 1 && parts != 2) || k > kMaxK || (m * parts) % 32 || n % 32) {
    fprintf(stderr, "M, K, N >= 1, K <= %d, P 1 or 2, M * P and N multiples of 32 (the stages run whole 2 x 2 "
            "blocks)\n", kMaxK);
    return 2;
  }
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("no AMX: the OS did not grant the tile state\n");
    return 0;
  }
  Job job;
  Problem& p = job.p;
  p.m = m, p.k = k, p.kp = (k + kStep - 1) / kStep * kStep, p.n = n, p.tiles = (n + kTile - 1) / kTile, p.parts = parts;
  const size_t np = static_cast<size_t>(p.tiles) * kTile;
  Buffer<float> x(static_cast<size_t>(m) * k), y(static_cast<size_t>(m) * n), ws(np);
  Buffer<int8_t> w(np * p.kp);
  Buffer<int32_t> colsum(np);
  srand(1);
  for (size_t i = 0; i < static_cast<size_t>(m) * k; ++i) x[i] = rand() / float(RAND_MAX) - 0.5f;
  for (size_t i = 0; i < np * p.kp; ++i) w[i] = static_cast<int8_t>(rand() % 255 - 127);
  for (size_t i = 0; i < np; ++i) ws[i] = 0.01f, colsum[i] = rand() % 1000;
  p.x = &x[0], p.w = &w[0], p.ws = &ws[0], p.colsum = &colsum[0], p.y = &y[0];
  Acts acts;
  const size_t act_rows = (static_cast<size_t>(m) * parts + kAmxRows - 1) / kAmxRows * kAmxRows;
  acts.u.assign(act_rows * p.kp, 128);
  acts.xs.assign(act_rows, 0.0f);
  job.acts = &acts;
  job.isa = Isa::kAvx512Vnni;
  job.amx = true;
  job.block_rows = kAmxBlock;
  job.quant_blocks = (m + kQuantRows - 1) / kQuantRows;
  job.row_state = std::make_unique<std::atomic<int>[]>(job.quant_blocks);
  job.Split(1);

  auto time = [&](auto fn) {  // best and median of reps, microseconds
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const double t0 = ThreadSeconds();
      fn();
      t.push_back((ThreadSeconds() - t0) * 1e6);
    }
    std::sort(t.begin(), t.end());
    return std::pair<double, double>{t[0], t[t.size() / 2]};
  };
  auto quant = [&] {
    for (int i = 0; i < job.quant_blocks; ++i) job.Quantize(i);
  };
  auto call = [&] {
    for (int i = 0; i < job.quant_blocks; ++i) job.row_state[i].store(0);
    for (int i = 0; i < job.chunks * job.row_blocks; ++i) job.Run(i);
  };
  auto stage = [&](Stage s) { return [&job, s, parts] { parts == 2 ? Stages<2>(job, s) : Stages<1>(job, s); }; };
  call();  // warm: buffers, pages, the tile state
  const auto tq = time(quant), tl = time(stage(kLoop)), tc = time(stage(kCStore)), tf = time(stage(kFinish)),
             tcall = time(call), tg = time([&] { quant(); stage(kGated)(); });
  const double ops = 2.0 * m * k * n;
  auto rate = [&](double us) {
    static char s[64];
    snprintf(s, sizeof s, "%.0f GOP/s%s", ops / us * 1e-3, "");
    if (peak > 0) snprintf(s, sizeof s, "%.0f GOP/s, %.1f%%", ops / us * 1e-3, 100.0 * ops / us * 1e-3 / peak);
    return std::string(s);
  };
  printf("M %d K %d N %d P %d (best / median of %d, us): quant %.1f / %.1f | loop %.1f / %.1f (%s) | cstore %.1f / "
         "%.1f | finish %.1f / %.1f | call %.1f / %.1f (%s) | gated call %.1f / %.1f (%s)\n",
         m, k, n, parts, reps, tq.first, tq.second, tl.first, tl.second, rate(tl.second).c_str(), tc.first, tc.second,
         tf.first, tf.second, tcall.first, tcall.second, rate(tcall.second).c_str(), tg.first, tg.second,
         rate(tg.second).c_str());
  return 0;
}
