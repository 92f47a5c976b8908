// SIMD helpers every kernel file shares: the vector width and register budget of the ISA this build targets,
// the vector types, and the loads and prefetches the panels and attention use.
//
// Built with -march=native (kernels.py), so the width follows the CPU: AVX-512 16 floats a vector, AVX / AVX2 8,
// else 4 (SSE, NEON) on GCC's generic vectors.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dominospec {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector (zmm)
constexpr int VREGS = 32;  // vector registers
constexpr int MR = 12;  // rows per group: 12 x 2 accumulators + 2 weight vectors of 32 registers
#elif defined(__AVX__)
constexpr int VW = 8;  // ymm
constexpr int VREGS = 16;
constexpr int MR = 6;  // 12 accumulators + 2 weight vectors of 16 registers
#else
constexpr int VW = 4;  // SSE / NEON
constexpr int VREGS = 16;
constexpr int MR = 4;
#endif
constexpr int NV = 2;  // vectors per panel row
constexpr int NR = VW * NV;  // panel width (output columns)

// With AVX2's 16 registers a group of one to three rows holds only 2 to 6 accumulators per panel: too
// few independent FMA chains to hide the FMA latency (4-5 cycles, two pipes), so a decode step there was
// bound by latency, not by memory. Such groups walk up to NPMAX adjacent panels at once (more columns,
// more chains), and int8 keeps its running totals in memory (touched once per group of k), which leaves
// the registers to the partial sums: MR rows per group in int8 too. Neither changes the order of any
// output element's sum. AVX-512's 32 registers need neither (NPMAX 1, totals in registers).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int NPMAX = 4;
constexpr bool I8_TOTALS_IN_MEMORY = true;
#else
constexpr int NPMAX = 1;
constexpr bool I8_TOTALS_IN_MEMORY = false;
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef int8_t vb __attribute__((vector_size(VW * sizeof(int8_t))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

inline vf load_vf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

inline void prefetch_row(const void* row, int bytes) {
  const char* c = static_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

}  // namespace dominospec
