// The attention kernel's chunk steps for one vector width, written once over runtime/vec.h: included by
// ragged_paged_attention.cc once per instruction set, inside that set's `#pragma GCC target` region and a
// namespace that defines V (rt::Vec8 for AVX2, rt::Vec16 for AVX-512). The contracts are ChunkSteps'.
// A chunk of kChunk = 16 keys is C = 16 / V::kLanes vectors (two on AVX2, one on AVX-512).
//
// Register budgets differ (16 ymm, 32 zmm), so the row blocks and the accumulator phases that keep enough
// FMA chains in flight do too; each ISA keeps the blocking it was tuned with, so its sums run in the
// same order and its results keep their bits. No include guard: it is meant to be included more than once.

constexpr int L = V::kLanes;
constexpr int C = kChunk / L;
constexpr bool kWide = V::kRegs >= 32;
using F = typename V::F;

// Calls Op::run<R, HD>(args...) for R = rows (1..kMaxR) and HD = head_dim when it is 64 or 128 (else 0:
// run reads the head_dim argument). A constant head_dim addresses the R query rows off one register: with a
// run-time one gcc ran short of registers for 8 rows' addresses and kept their accumulators on the stack.
template <class Op, int kMaxR, int HD, class... A>
inline void for_rows_t(int rows, A... args) {
  switch (rows) {
    case 1: return Op::template run<1, HD>(args...);
    case 2: return Op::template run<std::min(2, kMaxR), HD>(args...);
    case 3: return Op::template run<std::min(3, kMaxR), HD>(args...);
    case 4: return Op::template run<std::min(4, kMaxR), HD>(args...);
    case 5: return Op::template run<std::min(5, kMaxR), HD>(args...);
    case 6: return Op::template run<std::min(6, kMaxR), HD>(args...);
    case 7: return Op::template run<std::min(7, kMaxR), HD>(args...);
    default: return Op::template run<std::min(8, kMaxR), HD>(args...);
  }
}
template <class Op, int kMaxR, class... A>
inline void for_rows_hd(int rows, int hd, A... args) {
  if (hd == 64) return for_rows_t<Op, kMaxR, 64>(rows, args...);
  if (hd == 128) return for_rows_t<Op, kMaxR, 128>(rows, args...);
  for_rows_t<Op, kMaxR, 0>(rows, args...);
}

// ---- Row-order K: s[r][j] = q[r] . k[j], L keys at once reduced together (one accumulator per key) ----
struct ScoresRow {
  template <int, int HD>
  static void run(const float* q, int hd_arg, const float* k, int n, float* s) {
    const int hd = HD > 0 ? HD : hd_arg;
    int j = 0;
    for (; j + L <= n; j += L) {
      F a[L];
      for (int i = 0; i < L; ++i) a[i] = V::zero();
      for (int x = 0; x < hd; x += L) {
        const F qx = V::load(q + x);
        const float* kx = k + j * hd + x;
        for (int i = 0; i < L; ++i, kx += hd) a[i] = V::fma(qx, V::load(kx), a[i]);
      }
      V::store_sums(s + j, a);
    }
    for (; j < n; ++j) {
      F a = V::zero();
      for (int x = 0; x < hd; x += L) a = V::fma(V::load(q + x), V::load(k + j * hd + x), a);
      s[j] = V::reduce_add(a);
    }
  }
};

void scores(const float* q, int rows, int hd, const float* k, int n, float* s) {
  for (int r = 0; r < rows; ++r) for_rows_hd<ScoresRow, 1>(1, hd, q + r * hd, hd, k, n, s + r * kChunk);
}

// ---- Online softmax over one chunk ----
void softmax(float* s, int rows, int hd, const float* kscale, int key, int n, bool edge, const int* pos,
             const int* lo, float* m, float* l, float* acc) {
  typename V::Mask in[C];
  typename V::I keys[C];
  F ks[C];
  for (int c = 0; c < C; ++c) {
    in[c] = V::first(n - c * L);
    keys[c] = V::iota(key + c * L);
    ks[c] = kscale ? V::load(kscale + c * L, in[c]) : V::set1(1.f);
  }
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kChunk;
    F h[C];
    for (int c = 0; c < C; ++c) {
      h[c] = V::mul(V::load(sr + c * L), ks[c]);
      if (edge)  // visible: j < n, lo <= key + j <= pos
        h[c] = V::select(V::in_range(in[c], keys[c], lo[r], pos[r]), h[c], V::set1(kNegInf));
    }
    // the row max grows in few chunks: a compare finds out, and the horizontal max runs only then (with
    // m = -inf and every lane masked nothing is greater, so the shift is 0 and p = exp(-inf) = 0)
    const F mr = V::set1(m[r]);
    bool grows = false;
    for (int c = 0; c < C; ++c) grows |= V::any_gt(h[c], mr);
    float shift = m[r] == kNegInf ? 0.f : m[r];
    if (grows) {
      F mx = h[0];
      for (int c = 1; c < C; ++c) mx = V::max(mx, h[c]);
      shift = raise_max(r, V::reduce_max(mx), hd, m, l, acc);
    }
    const F sh = V::set1(shift);
    F sum = V::zero();
    for (int c = 0; c < C; ++c) {
      const F p = V::exp(V::sub(h[c], sh));
      V::store(sr + c * L, p);
      sum = c == 0 ? p : V::add(sum, p);
    }
    l[r] += V::reduce_add(sum);
  }
}

// ---- P x V: acc[r] += sum_j p[r][j] v[j], V rows read in their cache type (widened in registers) ----
// R rows at once, 2L columns at a time (or L, the last): each V row's columns are loaded (and widened) once
// for all R rows, whose accumulators stay in registers. On 16 registers, A = 2 key phases keep >= 4 FMA
// chains in flight for 1-2 rows, and at most 6 rows fit (more run as 4 + the rest).
constexpr int kPvRows = kWide ? 8 : 6;

struct PvRows {
  template <int R, int, class T>
  static void run(const float* p, int hd, const T* v, int n, float* acc) {
    constexpr int A = !kWide && R <= 2 ? 2 : 1;
    int x = 0;
    for (; x + 2 * L <= hd; x += 2 * L) {
      F a[A][R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[0][r][0] = V::load(acc + r * hd + x), a[0][r][1] = V::load(acc + r * hd + x + L);
        for (int ph = 1; ph < A; ++ph) a[ph][r][0] = a[ph][r][1] = V::zero();
      }
      int j = 0;
      for (; j + A <= n; j += A)
#pragma GCC unroll 2
        for (int ph = 0; ph < A; ++ph) {
          const F v0 = V::load(v + (j + ph) * hd + x), v1 = V::load(v + (j + ph) * hd + x + L);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const F pj = V::broadcast(p + r * kChunk + j + ph);
            a[ph][r][0] = V::fma(pj, v0, a[ph][r][0]);
            a[ph][r][1] = V::fma(pj, v1, a[ph][r][1]);
          }
        }
      for (; j < n; ++j) {
        const F v0 = V::load(v + j * hd + x), v1 = V::load(v + j * hd + x + L);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F pj = V::broadcast(p + r * kChunk + j);
          a[0][r][0] = V::fma(pj, v0, a[0][r][0]);
          a[0][r][1] = V::fma(pj, v1, a[0][r][1]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        for (int ph = 1; ph < A; ++ph) a[0][r][0] = V::add(a[0][r][0], a[ph][r][0]), a[0][r][1] = V::add(a[0][r][1], a[ph][r][1]);
        V::store(acc + r * hd + x, a[0][r][0]);
        V::store(acc + r * hd + x + L, a[0][r][1]);
      }
    }
    if (x < hd) {  // hd % 2L == L
      F a[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r] = V::load(acc + r * hd + x);
      for (int j = 0; j < n; ++j) {
        const F v0 = V::load(v + j * hd + x);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r] = V::fma(V::broadcast(p + r * kChunk + j), v0, a[r]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) V::store(acc + r * hd + x, a[r]);
    }
  }
};

template <class T>
struct PvTyped {
  template <int R, int HD>
  static void run(const float* p, int hd, const T* v, int n, float* acc) { PvRows::run<R, HD>(p, hd, v, n, acc); }
};

template <class T>
void pv_typed(const float* p, int rows, int hd, const T* v, int n, float* acc) {
  if (rows > kPvRows) {
    PvRows::run<4, 0>(p, hd, v, n, acc);
    p += 4 * kChunk, acc += 4 * hd, rows -= 4;
  }
  for_rows_t<PvTyped<T>, kPvRows, 0>(rows, p, hd, v, n, acc);
}

void pv(const float* p, int rows, int hd, KvType type, const void* v, const float* vscale, int n, float* acc,
        float*) {
  switch (type) {
    case KvType::kF32:
      return pv_typed(p, rows, hd, static_cast<const float*>(v), n, acc);
    case KvType::kBF16:
      return pv_typed(p, rows, hd, static_cast<const uint16_t*>(v), n, acc);
    case KvType::kI8: {  // p[r][j] * vscale[j], then the raw int8 rows
      alignas(64) float ps[kMaxRows * kChunk];
      F vs[C];
      for (int c = 0; c < C; ++c) vs[c] = V::load(vscale + c * L, V::first(n - c * L));
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < C; ++c) V::store(ps + r * kChunk + c * L, V::mul(V::load(p + r * kChunk + c * L), vs[c]));
      return pv_typed(ps, rows, hd, static_cast<const int8_t*>(v), n, acc);
    }
  }
}

// ---- Widening K rows for the row-order scores (exact) ----
template <class T>
void widen(const T* src, int n, int hd, float* dst) {
  for (int i = 0; i < n * hd; i += L) V::store(dst + i, V::load(src + i));
}

// ---- Word-major K: keys in the lanes (a chunk's word w is C masked loads), broadcast FMAs, no
// horizontal sums. Rows run in blocks of kWordRows (each block reads the chunk's K again, from L1). ----
constexpr int kWordRows = kWide ? 8 : 4;

// Each row's scores gather in A column phases of C vectors, summed in phase order at the end.
template <int R, int A>
inline void store_phases(F (&acc)[A][R][C], float* s) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      F sum = acc[0][r][c];
      for (int a = 1; a < A; ++a) sum = V::add(sum, acc[a][r][c]);
      V::store(s + r * kChunk + c * L, sum);
    }
}

template <int R, int A>
inline void zero_phases(F (&acc)[A][R][C]) {
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[a][r][c] = V::zero();
}

// f32 K (column x of the chunk's keys: ps floats apart). A column phases keep >= 8 FMA chains in flight
// for few rows. (AMD Zen 4, 32 x 384 f32 step, consecutive pages, AVX-512: 26.8 -> 21.7 ms against
// row-order K.) On 32 registers rows > 4 also take 2 phases: with one, gcc stored every row's accumulator to
// the stack on each column (objdump), which cost a prefill chunk's 8-row items more than their FMAs.
struct F32Words {
  template <int R, int HD>
  static void run(const float* q, int hd_arg, const float* k, int ps, int n, float* s) {
    const int hd = HD > 0 ? HD : hd_arg;
    constexpr int A = kWide ? (R <= 2 ? 4 : 2) : (R == 1 ? 4 : R == 2 ? 2 : 1);
    typename V::Mask m[C];
    for (int c = 0; c < C; ++c) m[c] = V::first(n - c * L);
    F acc[A][R][C];
    zero_phases(acc);
    for (int x = 0; x < hd; x += A)
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) {
        const float* kx = k + int64_t(x + a) * ps;
        F kv[C];
        for (int c = 0; c < C; ++c) kv[c] = V::load(kx + c * L, m[c]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F qx = V::broadcast(q + r * hd + x + a);
          for (int c = 0; c < C; ++c) acc[a][r][c] = V::fma(qx, kv[c], acc[a][r][c]);
        }
      }
    store_phases(acc, s);
  }
};

// bf16 K (word w of the chunk's keys: key j's columns 2w, 2w+1 in int32 lane j): column 2w is each lane's
// low half shifted up, 2w + 1 its high half (bf16 -> f32 is exact), then as in the f32 form. A word phases
// of P column-parity accumulator sets keep >= 8 chains for 1-2 rows. (With a run-time head_dim, 8 rows'
// accumulators went to the stack on every word: 16 stores per 16 FMAs, and a 256-token prefill's scores
// took 2.3x its P x V's samples.)
struct Bf16Words {
  template <int R, int HD>
  static void run(const float* q, int hd_arg, const uint16_t* k, int ps, int n, float* s) {
    const int hd = HD > 0 ? HD : hd_arg;
    constexpr int A = kWide && R <= 2 ? 2 : 1;
    constexpr int P = kWide || R <= 2 ? 2 : 1;
    typename V::Mask m[C];
    for (int c = 0; c < C; ++c) m[c] = V::first(n - c * L);
    const typename V::I high = V::set1_i32(int(0xFFFF0000u));
    F acc[A * P][R][C];
    zero_phases(acc);
    for (int w = 0; w < hd / 2; w += A)  // hd % (2A) == 0 (kWide: hd % 16 == 0)
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a) {
        const uint16_t* kw = k + int64_t(w + a) * ps * 2;
        F even[C], odd[C];
        for (int c = 0; c < C; ++c) {
          const typename V::I words = V::load_i32(kw + 2 * c * L, m[c]);
          even[c] = V::bits_f32(V::template shl<16>(words));
          odd[c] = V::bits_f32(V::and_i32(words, high));
        }
        const float* qw = q + 2 * (w + a);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F qe = V::broadcast(qw + r * hd), qo = V::broadcast(qw + r * hd + 1);
          for (int c = 0; c < C; ++c) acc[a * P][r][c] = V::fma(qe, even[c], acc[a * P][r][c]);
          for (int c = 0; c < C; ++c) acc[a * P + P - 1][r][c] = V::fma(qo, odd[c], acc[a * P + P - 1][r][c]);
        }
      }
    store_phases(acc, s);
  }
};

// int8 K (word w of the chunk's keys: key j's columns 4w .. 4w+3 in int32 lane j): column 4w + c is byte c
// of each lane, sign-extended by two shifts, then converted and used as in the f32 form; A column phases
// (c even / odd) for 1-2 rows. (Where AVX-512 VNNI runs int8 KV, the query's two int8 parts and vpdpbusd
// replace this.)
struct I8Words {
  template <int R, int HD>
  static void run(const float* q, int hd_arg, const int8_t* k, int ps, int n, float* s) {
    const int hd = HD > 0 ? HD : hd_arg;
    constexpr int A = R <= 2 ? 2 : 1;
    typename V::Mask m[C];
    for (int c = 0; c < C; ++c) m[c] = V::first(n - c * L);
    F acc[A][R][C];
    zero_phases(acc);
    for (int w = 0; w < hd / 4; ++w) {
      const int8_t* kw = k + int64_t(w) * ps * 4;
      typename V::I words[C];
      for (int c = 0; c < C; ++c) words[c] = V::load_i32(kw + 4 * c * L, m[c]);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        F col[C];
        for (int c = 0; c < C; ++c) col[c] = V::to_f32(V::template sar<24>(shl_var(words[c], b)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F qx = V::broadcast(q + r * hd + 4 * w + b);
          for (int c = 0; c < C; ++c) acc[b % A][r][c] = V::fma(qx, col[c], acc[b % A][r][c]);
        }
      }
    }
    store_phases(acc, s);
  }
  // words << (24 - 8 b): byte b at the top
  static inline typename V::I shl_var(typename V::I w, int b) {
    switch (b) {
      case 0: return V::template shl<24>(w);
      case 1: return V::template shl<16>(w);
      case 2: return V::template shl<8>(w);
      default: return w;
    }
  }
};

template <class Op, class K>
void words_in_row_blocks(const float* q, int rows, int hd, const K* k, int ps, int n, float* s) {
  for (; rows > 0; rows -= kWordRows, q += kWordRows * hd, s += kWordRows * kChunk)
    for_rows_hd<Op, kWordRows>(std::min(rows, kWordRows), hd, q, hd, k, ps, n, s);
}

void scores_f32_words(const float* q, int rows, int hd, const float* k, int ps, int n, float* s) {
  words_in_row_blocks<F32Words>(q, rows, hd, k, ps, n, s);
}
void scores_bf16_words(const float* q, int rows, int hd, const uint16_t* k, int ps, int n, float* s) {
  words_in_row_blocks<Bf16Words>(q, rows, hd, k, ps, n, s);
}
// (AVX2's: AVX-512 widens int8 K rows, or runs VNNI)
[[maybe_unused]] void scores_i8_words(const float* q, int rows, int hd, const int8_t* k, int ps, int n, float* s) {
  words_in_row_blocks<I8Words>(q, rows, hd, k, ps, n, s);
}
