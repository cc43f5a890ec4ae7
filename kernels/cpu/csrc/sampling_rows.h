// sampling.cc's vectorized row passes, written once over a vector type V (W float lanes: V::F, its
// compare mask V::M, and the few operations below). sampling.cc includes this file once per
// instruction set, inside that ISA's namespace and `#pragma GCC target`, so each copy is compiled for
// its own ISA (no -march). Whole vectors run here; the tails go to the portable loops, whose results
// are exact (max, compare) or summed the way the ISA's own tail did before (V::tail_block_sum).
// No include guard: included more than once on purpose.

RowMax row_max(const float* l, int v) {
  typename V::F mx = V::set1(kNegInf);
  typename V::M nan = V::none();
  int i = 0;
  for (; i + V::W <= v; i += V::W) {
    const typename V::F a = V::load(l + i);
    nan = V::either(nan, V::unordered(a));
    mx = V::max(mx, a);
  }
  RowMax r = row_max_portable(l + i, v - i);
  r.max = std::max(r.max, V::reduce_max(mx));
  r.nan |= V::any(nan);
  return r;
}

int first_equal(const float* l, int v, float m) {
  const typename V::F mv = V::set1(m);
  int i = 0;
  for (; i + V::W <= v; i += V::W)
    if (const unsigned eq = V::equal_bits(V::load(l + i), mv)) return i + __builtin_ctz(eq);
  for (; i < v; ++i)
    if (l[i] == m) return i;
  return 0;
}

// x = (l - m) / t, e = exp(x); the sum of e in double, over two accumulators of W / 2 lanes
double exp_shifted(const float* l, int v, float m, float t, float* x, float* e) {
  const typename V::F mv = V::set1(m), tv = V::set1(t);
  typename V::D s0 = V::zero_d(), s1 = V::zero_d();
  int i = 0;
  for (; i + V::W <= v; i += V::W) {
    const typename V::F xi = V::div(V::sub(V::load(l + i), mv), tv);
    const typename V::F ei = V::exp(xi);
    V::store(x + i, xi);
    V::store(e + i, ei);
    V::add_halves_d(ei, s0, s1);
  }
  return V::reduce_d(s0, s1) + exp_shifted_portable(l + i, v - i, m, t, x + i, e + i);
}

void block_max(const float* x, int v, float* out) {
  int b = 0;
  for (; b * 16 + 16 <= v; ++b) out[b] = V::max16(x + b * 16);
  if (b * 16 < v) block_max_portable(x + b * 16, v - b * 16, out + b);
}

int compact(const float* x, int v, float tau, int32_t* idx) {
  const typename V::F tv = V::set1(tau);
  int n = 0, i = 0;
  for (; i + V::W <= v; i += V::W) n = V::compact(x + i, tv, i, idx, n);
  for (; i < v; ++i)
    if (x[i] >= tau) idx[n++] = i;
  return n;
}

void block_sum(const float* e, int v, float min_p, double* out) {
  int b = 0;
  for (; b * 16 + 16 <= v; ++b) out[b] = V::sum16_kept(e + b * 16, min_p);
  if (b * 16 < v) V::tail_block_sum(e + b * 16, v - b * 16, min_p, out + b);
}
