// Weight format int8 with fp32 activations: int8 weights with an fp32 scale s and offset o per output column and
// group of G consecutive k, w = s * q + o (quant.py's quantize_int8). Each group's sum of exact int8 x fp32
// products is kept apart, and when the group ends the total takes s * sum(q x) + o * sum(x), the row's sum of x
// over the group computed once per call (linear.cpp).
#pragma once

#include "format_float.h"

namespace dominospec {

struct I8 {  // an int8 is exactly an fp32; the group's scale and offset come after the group's sum
  using T = int8_t;
  static inline vf widen(const int8_t* p) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
    vb b;
    std::memcpy(&b, p, sizeof(vb));
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);  // sign-extend, then convert
#endif
  }
};

// int8 panels; so [ceil(K / G)][2][NR] per panel (sstride floats apart): each group's scales, then its
// offsets; xsum [R][ceil(K / G)]: each row's sum of x over each group. Per group, R x NV partial sums,
// then total += part * s + o * xsum. The totals sit in registers (at most MR / 2 rows a group) or, where
// registers are few, in memory (MR rows).
template <int R, int NP>
void panel_i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict wp, int64_t wstride, int64_t K,
              float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, const float* __restrict so,
              int64_t sstride, const float* __restrict xsum, int64_t G) {
  constexpr int NVP = NV * NP;
  const int64_t groups = (K + G - 1) / G;
  vf acc[R][NVP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVP; ++v) acc[r][v] = vf{};
  // totals and partial sums in registers where they fit (at most MR / 2 rows of one panel), else totals in memory
  constexpr bool in_memory = I8_TOTALS_IN_MEMORY && (NP > 1 || R > MR / 2);
  if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    vf part[R][NVP];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NVP; ++v) part[r][v] = vf{};
    const int64_t k1 = std::min(K, k0 + G);
    for (int64_t k = k0; k < k1; ++k) step<I8, R, NP>(part, x, ldx, wp, wstride, k);
    vf sg[NVP], og[NVP];
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < NV; ++v) {
        sg[j * NV + v] = F32::widen(so + j * sstride + g * 2 * NR + v * VW);
        og[j * NV + v] = F32::widen(so + j * sstride + g * 2 * NR + NR + v * VW);
      }
    for (int r = 0; r < R; ++r) {
      const float xg = xsum[r * groups + g];
      for (int v = 0; v < NVP; ++v) {
        acc[r][v] += part[r][v] * sg[v];  // one FMA each
        acc[r][v] += og[v] * xg;
      }
    }
    if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  }
  store<R, NVP>(acc, y, ldy, ncols, bias);
}

}  // namespace dominospec
