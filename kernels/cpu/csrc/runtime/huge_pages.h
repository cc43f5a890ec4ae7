// Transparent huge pages for large buffers the kernels touch: the 2 MiB-aligned part of a buffer,
// advised with madvise (a hint: memory already mapped, or a kernel without THP, stays as it is).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace slipstream::runtime {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

struct HugeRange {
  uintptr_t lo = 0, hi = 0;  // 2 MiB-aligned; empty when hi <= lo
  size_t bytes() const { return hi > lo ? hi - lo : 0; }
};

inline HugeRange HugeAligned(const void* data, size_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  return {(start + kHugePage - 1) & ~(kHugePage - 1), (start + bytes) & ~(kHugePage - 1)};
}

// MADV_HUGEPAGE: later faults (and khugepaged) use 2 MiB pages. True when the kernel accepted it.
inline bool AdviseHugePages(HugeRange r) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  return r.bytes() && madvise(reinterpret_cast<void*>(r.lo), r.bytes(), MADV_HUGEPAGE) == 0;
#else
  (void)r;
  return false;
#endif
}

// MADV_COLLAPSE (Linux >= 6.1): the range moves to 2 MiB pages now, synchronously (~0.1 s per GB).
// False elsewhere, and the memory stays as it was.
inline bool CollapseHugePages(HugeRange r) {
#if defined(__linux__)
  constexpr int kCollapse = 25;  // MADV_COLLAPSE, which older headers lack
  return r.bytes() && madvise(reinterpret_cast<void*>(r.lo), r.bytes(), kCollapse) == 0;
#else
  (void)r;
  return false;
#endif
}

}  // namespace slipstream::runtime
