/* The q8 matmul's micro kernels alone (kernels/cpu/csrc/q8_matmul.cc, compiled in): for one weight shape, two-part
 * activations and 1, 2, 4, 8, 16 input rows, the VNNI blocks (TileAvx512 as RunItem picks them, 6-tile chunks) against
 * the int8 tile path (TileInt8 over the same chunks), per thread, in ns per (column tile, group) item, and the
 * two-part quantization of the rows (and the gated input's silu(gate) * up) per call; the outputs
 * are compared bit for bit when COPIES is 1. COPIES distinct weights are used in turn (enough to leave L2: the
 * weights then come from L3 or memory, as in an engine step). Options after the four numbers: --threads T (each
 * thread runs the whole measurement; default 1), --reps R (200), --median (medians instead of minima),
 * --only-amx / --only-vnni, --rows M,M,... (the input row counts; default 1,2,4,8,16), --pair (BITS 4: the tile
 * path as calls of more than 64 rows run it, TileQ4Bf16).
 *     g++ -O3 -std=c++17 -fno-math-errno -fno-wrapv -I$(python -c "import jax.ffi; print(jax.ffi.include_dir())") \
 *       -Ikernels/cpu/csrc -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
 *       benchmarks/q8_tile_probe.cc -o q8_tile_probe -lpython3.11 \
 *       -L$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))") \
 *       -Wl,-rpath,$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
 *     ./q8_tile_probe K N COPIES BITS [options]   (e.g. 576 3072 40 4: the default model's gate/up, 4-bit) */
#include "q8_matmul.cc"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Options {
  int threads = 1, reps = 200;
  bool median = false, only_amx = false, only_vnni = false;
  std::vector<int> rows = {1, 2, 4, 8, 16};
  bool pair = false;
  int chunk = 6;  // --chunk: column tiles per chunk of the --pair path
};

void Probe(int k, int n, int copies, int bits, const Options& opt) {
  const int groups = k / kGroup, tiles = n / kTile;
  std::mt19937 rng(1);
  const size_t wbytes = static_cast<size_t>(tiles) * k * kTile * bits / 8;
  const size_t sbytes = static_cast<size_t>(tiles) * groups * kTile;
  std::vector<uint8_t> w(wbytes * copies);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::vector<uint16_t> ws(sbytes * copies), wo(sbytes * copies);
  for (auto& h : ws) h = 0x2000 + (rng() & 0x3ff);
  for (auto& h : wo) h = 0x2000 + (rng() & 0x3ff);
  const int reps = opt.reps;
  const bool only_amx = opt.only_amx, only_vnni = opt.only_vnni, median = opt.median;
  constexpr int kParts = 2, kChunk = 6;
  for (int m : opt.rows) {
    std::vector<float> x(static_cast<size_t>(m) * k);
    for (auto& v : x) v = (rng() % 2001) / 1000.f - 1.f;
    std::vector<float> y_vnni(static_cast<size_t>(m) * n), y_amx(static_cast<size_t>(m) * n);
    Acts a;
    a.kp = k;
    a.groups = groups;
    a.parts = kParts;
    a.Resize((m * kParts + kAmxRows - 1) / kAmxRows * kAmxRows);
    // the activations' two-part quantization of the m rows (what each call does before its products), and with a
    // gated input (the down projection: x [m, 2K]) silu(gate) * up formed per row first; medians of 50
    std::vector<double> t_quant, t_gated;
    std::vector<float> gu(2 * static_cast<size_t>(k)), row(k);
    for (auto& v : gu) v = (rng() % 2001) / 1000.f - 1.f;
    for (int rep = 0; rep < 50; ++rep) {
      double t0 = Now();
      for (int r = 0; r < m; ++r) QuantizeRow(Isa::kAvx512Vnni, x.data() + static_cast<size_t>(r) * k, k, a, r);
      t_quant.push_back(Now() - t0);
      t0 = Now();
      for (int r = 0; r < m; ++r) GatedRow(Isa::kAvx512Vnni, gu.data(), k, row.data());
      t_gated.push_back(Now() - t0);
    }
    std::sort(t_quant.begin(), t_quant.end());
    std::sort(t_gated.begin(), t_gated.end());
    if (opt.pair) {
      a.ResizeBf16((m + kAmxRows - 1) / kAmxRows * kAmxRows);
      for (int r = 0; r < m; ++r) SplitActsBf16(a, r);
    }
    Problem p{};
    p.x = x.data();
    p.m = m;
    p.k = k;
    p.n = n;
    p.kp = k;
    p.groups = groups;
    p.tiles = tiles;
    p.parts = kParts;
    p.bits = bits;
    auto use = [&](int c) {
      p.w = w.data() + c * wbytes;
      p.ws = ws.data() + c * sbytes;
      p.wo = wo.data() + c * sbytes;
    };
    std::vector<double> t_vnni, t_amx;
    alignas(64) static uint16_t wide[16 * 64 * 512];  // a chunk's bf16 B tiles (16 column tiles, K up to 2048)
    for (int rep = 0; rep < reps; ++rep) {
      if (!only_amx) {
        use(rep % copies);
        p.y = y_vnni.data();
        const double t0 = Now();
        for (int t = 0; t < tiles; t += kChunk) {
          const int hi = std::min(t + kChunk, tiles);
          int r, c;
          for (int tt = t; tt < hi; tt += c) {
            MicroShape(Isa::kAvx512Vnni, m * kParts, kParts, &r, &c);
            c = std::min(c, hi - tt);
            for (int row = 0; row < m * kParts; row += r)
              PickTile(Isa::kAvx512Vnni, std::min(r, m * kParts - row), c, kParts, bits)(p, a, row, tt);
          }
        }
        t_vnni.push_back(Now() - t0);
      }
      if (!only_vnni) {
        use((rep + copies / 2) % copies);
        p.y = y_amx.data();
        const double t0 = Now();
        const int row_tiles = (m * kParts + kAmxRows - 1) / kAmxRows;
        const int tile_rows = row_tiles == 1 ? m * kParts : kAmxRows;
        const TileInt8Fn tile = PickTileInt8(kParts, bits, tile_rows, true);  // the probe's weights have offsets
        AmxBeginInt8(tile_rows);
        const int chunk = opt.pair ? opt.chunk : kChunk;
        for (int t = 0; t < tiles; t += chunk) {
          const int hi = std::min(t + chunk, tiles);
          int at = 0;
          if (opt.pair) {  // as Job::RunItemQ4Bf16
            AmxBeginBf16();
            WidenChunkBf16(p, t, hi, wide);
            for (int rt = 0; rt < (m + kAmxRows - 1) / kAmxRows; ++rt) TileQ4Bf16(p, a, rt, t, hi, wide);
            AmxBeginInt8(tile_rows);
            at = row_tiles;
          }
          for (; at < row_tiles; ++at) tile(p, a, at * kAmxRows, t, hi);
        }
        AmxEnd();
        t_amx.push_back(Now() - t0);
      }
    }
    if (copies == 1 && !only_amx && !only_vnni && y_vnni != y_amx) printf("M %d: the outputs differ\n", m);
    auto stat = [&](std::vector<double>& v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return (median ? v[v.size() / 2] : v[0]) / (static_cast<double>(tiles) * groups) * 1e9;
    };
    const double v = stat(t_vnni), am = stat(t_amx);
    printf("bits %d K %d N %d copies %d M %2d: vnni %.1f ns/item, amx %.1f ns/item (%.2fx); quantizing the rows %.1f us "
           "(+ gating %.1f us)\n", bits, k, n, copies, m, v, am, v > 0 ? am / v : 0.0, t_quant[25] * 1e6, t_gated[25] * 1e6);
  }
}

}  // namespace

int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
  const int k = argc > 1 ? atoi(argv[1]) : 576, n = argc > 2 ? atoi(argv[2]) : 576;
  const int copies = argc > 3 ? atoi(argv[3]) : 1, bits = argc > 4 ? atoi(argv[4]) : 4;
  Options opt;
  bool bad = k % kGroup || n % kTile || copies < 1 || (bits != 4 && bits != 8);
  for (int i = 5; i < argc && !bad; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) opt.threads = atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) opt.reps = atoi(argv[++i]);
    else if (a == "--median") opt.median = true;
    else if (a == "--pair") opt.pair = true;
    else if (a == "--chunk" && i + 1 < argc) opt.chunk = atoi(argv[++i]);
    else if (a == "--only-amx") opt.only_amx = true;
    else if (a == "--only-vnni") opt.only_vnni = true;
    else if (a == "--rows" && i + 1 < argc) {
      opt.rows.clear();
      for (const char* s = argv[++i]; *s;) {
        char* end;
        opt.rows.push_back(static_cast<int>(strtol(s, &end, 10)));
        if (end == s || opt.rows.back() < 1) { bad = true; break; }
        s = *end == ',' ? end + 1 : end;
      }
    }
    else bad = true;
  }
  if (bad || opt.threads < 1 || opt.reps < 1 || (opt.pair && bits != 4)) {
    fprintf(stderr, "usage: q8_tile_probe K N COPIES BITS [--threads T] [--reps R] [--median] [--only-amx | "
                    "--only-vnni] [--rows M,M,...] [--pair (BITS 4)] (K a multiple of 32, N of 16, BITS 4 or 8)\n");
    return 2;
  }
  std::vector<std::thread> others;
  for (int i = 1; i < opt.threads; ++i) others.emplace_back([=] { Probe(k, n, copies, bits, opt); });
  Probe(k, n, copies, bits, opt);
  for (auto& t : others) t.join();
}
