// Weight formats with fp32 activations, float32 and bfloat16: how VW packed weights become VW fp32 lanes, and
// their panel kernel (one FMA per k and column, in k order).
#pragma once

#include "panel.h"

namespace dominospec {

// How VW packed weights become VW fp32 lanes, one struct per storage format.
struct F32 {
  using T = float;
  static inline vf widen(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(vf));
    return v;
  }
};

// The widening loads below use AVX-512 / AVX2 intrinsics where the ISA has them: GCC lowers the
// generic vector conversions of a 16-bit or 8-bit vector poorly (split or scalarised).
struct BF16 {  // bf16 is the top half of an fp32: zero-extend to 32 bits and shift up
  using T = uint16_t;
  static inline vf widen(const uint16_t* p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    vh h;
    std::memcpy(&h, p, sizeof(vh));
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    std::memcpy(&v, &u, sizeof(vf));
    return v;
#endif
  }
};

// NP adjacent panels (wstride elements apart) for R rows: y columns [0, NP * NR), only ncols stored
template <typename Fmt, int R, int NP>
void panel(const float* __restrict x, int64_t ldx, const typename Fmt::T* __restrict wp, int64_t wstride, int64_t K,
           float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, const float*, int64_t,
           const float*, int64_t) {
  constexpr int NVP = NV * NP;
  vf acc[R][NVP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVP; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < K; ++k) step<Fmt, R, NP>(acc, x, ldx, wp, wstride, k);
  store<R, NVP>(acc, y, ldy, ncols, bias);
}

}  // namespace dominospec
