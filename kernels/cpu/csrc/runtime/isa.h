// The instruction sets the native kernels choose from at run time, detected once with cpuid and xgetbv
// (the CPU has the instructions and the OS saves their registers). Nothing is compiled with -march: each
// vector path carries its own __attribute__((target(...))), and a kernel runs the highest level it has
// code for that this CPU reaches (lowered by set_isa() in tests, to run every path on one machine).
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>

// -DSLIPSTREAM_PORTABLE_ONLY builds the portable paths alone (what other architectures get), to test them on x86.
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SLIPSTREAM_PORTABLE_ONLY)
#define SLIPSTREAM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace slipstream::runtime {

// Ordered levels: each implies the ones below it. kAvx2 is AVX2 + FMA + F16C; kAvx512 adds AVX-512 F;
// kAvx512Vnni adds BW, VL and VNNI (vpdpbusd); kAmx adds the AMX tile units (tile, int8, bf16), usable only
// once the OS has granted this process the tile state (RequestAmx).
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAmx = 4 };
constexpr Isa kAllIsas[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni, Isa::kAmx};

inline const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: break;
  }
  return "portable";
}

// Linux hands out the AMX tile data state (8 KiB per thread) only to processes that ask for it, once, with
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the grant covers every thread of the process. Without
// it the first tile instruction faults. Kernels older than 5.16 do not know the request: no AMX there.
inline bool RequestAmx() {
#if defined(SLIPSTREAM_X86) && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

struct CpuInfo {
  Isa level = Isa::kPortable;
  bool avx512_bf16 = false;  // vdpbf16ps
  bool amx = false;          // AMX tiles with int8 and bf16, granted by the OS (level is then kAmx)
  bool amd = false;          // "AuthenticAMD": a few tunings differ by vendor
  unsigned family = 0, model = 0;  // cpuid leaf 1, with the extended fields folded in
};

inline CpuInfo DetectCpu() {
  CpuInfo c;
#if defined(SLIPSTREAM_X86)
  unsigned a, b, cx, d;
  if (!__get_cpuid(0, &a, &b, &cx, &d)) return c;
  const unsigned max_leaf = a;
  c.amd = b == 0x68747541 && d == 0x69746e65 && cx == 0x444d4163;  // "Auth" "enti" "cAMD"
  __cpuid(1, a, b, cx, d);
  c.family = ((a >> 8) & 0xf) + ((a >> 20) & 0xff);
  c.model = ((a >> 4) & 0xf) | (((a >> 16) & 0xf) << 4);
  const bool fma = cx >> 12 & 1, f16c = cx >> 29 & 1, osxsave = cx >> 27 & 1, avx = cx >> 28 & 1;
  if (!osxsave || !avx || max_leaf < 7) return c;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6) == 0x6;             // SSE and AVX state
  const bool os_zmm = os_ymm && (xcr0_lo & 0xe0) == 0xe0;  // opmask, ZMM0-15 upper halves, ZMM16-31
  const bool os_amx = (xcr0_lo & 0x60000) == 0x60000;      // XTILECFG, XTILEDATA
  unsigned b7, c7, d7, a71 = 0, unused;
  __cpuid_count(7, 0, a, b7, c7, d7);
  const unsigned max_sub7 = a;
  if (max_sub7 >= 1) __cpuid_count(7, 1, a71, unused, unused, unused);
  const bool avx2 = b7 >> 5 & 1, avx512f = b7 >> 16 & 1, avx512bw = b7 >> 30 & 1, avx512vl = b7 >> 31 & 1;
  const bool vnni = c7 >> 11 & 1;
  if (!(os_ymm && avx2 && fma && f16c)) return c;
  c.level = Isa::kAvx2;
  if (!(os_zmm && avx512f)) return c;
  c.level = avx512bw && avx512vl && vnni ? Isa::kAvx512Vnni : Isa::kAvx512;
  c.avx512_bf16 = a71 >> 5 & 1;
  c.amx = c.level == Isa::kAvx512Vnni && c.avx512_bf16 && os_amx && (d7 >> 24 & 1) && (d7 >> 25 & 1) && (d7 >> 22 & 1) &&
          RequestAmx();  // amx-tile, amx-int8, amx-bf16, and the OS's grant
  if (c.amx) c.level = Isa::kAmx;
#endif
  return c;
}

inline const CpuInfo& Cpu() {
  static const CpuInfo info = DetectCpu();
  return info;
}

// One kernel's choice among the levels it has code for: the best this CPU runs, unless set() lowered it.
class IsaChoice {
 public:
  IsaChoice(std::initializer_list<Isa> paths) {
    for (Isa isa : paths) {
      paths_ |= 1u << static_cast<int>(isa);
      if (static_cast<int>(isa) <= static_cast<int>(Cpu().level) && static_cast<int>(isa) > static_cast<int>(best_))
        best_ = isa;
    }
    current_.store(best_);
  }
  Isa get() const { return current_.load(std::memory_order_relaxed); }
  Isa best() const { return best_; }
  bool has(Isa isa) const { return paths_ >> static_cast<int>(isa) & 1; }

  // Chooses `isa`, which has(isa) and isa <= best(); returns the previous choice.
  Isa set(Isa isa) { return current_.exchange(isa); }

 private:
  unsigned paths_ = 0;
  Isa best_ = Isa::kPortable;
  std::atomic<Isa> current_{Isa::kPortable};
};

}  // namespace slipstream::runtime
