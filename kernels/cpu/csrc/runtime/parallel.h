// The one work loop of the native kernels: items 0..n-1 claimed from an atomic counter by the calling
// thread and by helpers scheduled on XLA's intra-op pool. A helper that starts late finds nothing left
// and touches only the counters (shared, so they outlive the call); the caller waits only for items
// that are running, never for a helper that has not started.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace slipstream::runtime {

// Runs fn(item) for every item in [0, n) on up to `threads` threads (0: the pool's size, the caller
// included) and returns when all are done. An item may wait on another item only if that one is
// already running (claimed), as the q8 kernel's shared row quantization does.
template <class F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int threads, F&& fn) {
  if (n <= 0) return;
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto c = std::make_shared<Counters>();
  auto work = [c, n, f = &fn] {
    int64_t ran = 0;
    for (int64_t i; (i = c->next.fetch_add(1, std::memory_order_relaxed)) < n; ++ran) (*f)(i);
    if (ran) c->done.fetch_add(ran, std::memory_order_acq_rel);
  };
  int64_t t = std::max<int64_t>(1, pool.num_threads());
  if (threads > 0) t = std::min<int64_t>(t, threads);
  t = std::min(t, n);
  for (int64_t i = 0; i < t - 1; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (c->done.load(std::memory_order_acquire) != n) std::this_thread::yield();
}

// Shared work inside a ParallelFor item: for every i in [lo, hi) whose state is 0, the first thread to claim
// it (0 -> 1) runs fn(i) and marks it done (2); then the caller waits until all of [lo, hi) are done. So the
// threads whose items need the same rows (a decode step's 32 rows are one block) share their quantization
// instead of one doing it while the rest wait.
template <class F>
void ClaimOnce(std::atomic<int>* state, int lo, int hi, F&& fn) {
  for (int i = lo; i < hi; ++i) {
    int expected = 0;
    if (state[i].load(std::memory_order_relaxed) != 0 ||
        !state[i].compare_exchange_strong(expected, 1, std::memory_order_acq_rel))
      continue;
    fn(i);
    state[i].store(2, std::memory_order_release);
  }
  for (int i = lo; i < hi; ++i)
    while (state[i].load(std::memory_order_acquire) != 2) std::this_thread::yield();
}

}  // namespace slipstream::runtime
