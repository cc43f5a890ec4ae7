// Compiles one kernel body, written once over runtime/vec.h, for AVX2 + FMA (namespace avx2, V = Vec8: 8
// lanes, 16 registers) and for AVX-512 F (namespace avx512, V = Vec16: 16 lanes, 32 registers), each in its own
// `#pragma GCC target` region (the ggml-cpu pattern: gcc 12 will not inline target-attributed helpers into a
// template). Include it where the body belongs, after naming the body's header:
//
//   #define SLIPSTREAM_PER_ISA_BODY "f32_matmul_tile.h"
//   #include "runtime/per_isa.h"
//
// No include guard: each kernel file includes it once per body.
#if defined(SLIPSTREAM_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using V = rt::Vec8;
#include SLIPSTREAM_PER_ISA_BODY
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
using V = rt::Vec16;
#include SLIPSTREAM_PER_ISA_BODY
}  // namespace avx512
#pragma GCC pop_options
#endif  // SLIPSTREAM_X86
#undef SLIPSTREAM_PER_ISA_BODY
