// Weight format bfloat16 on the CPU's bf16 dot product (AVX512-BF16, "bfloat16_pairs"): bf16 weights packed in
// k-pairs, activations rounded to bf16 per row (the same whatever the batch), fp32 sums.
#pragma once

#include "format_float.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DOMINOSPEC_BF16_DOT 1
#endif

namespace dominospec {

#ifdef DOMINOSPEC_BF16_DOT
// bf16 weights in k-pairs: packed[p][k2][j][t] = W[p*NR + j][2*k2 + t]; x already bf16, [R][2*K2].
// One vdpbf16ps adds w[2k2]*x[2k2] + w[2k2+1]*x[2k2+1] to each of 16 fp32 lanes.
template <int R>
void panel_dot(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict wp, int64_t K2,
               float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias) {
  static_assert(VW == 16, "the bf16 dot product runs on zmm registers");
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* wk = wp + k2 * NR * 2;
    prefetch_row(wk + PREFETCH * NR * 2, NR * 2 * sizeof(uint16_t));
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wk + v * VW * 2);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k2, sizeof(pair));
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], xs);
    }
  }
  vf out[R][NV];
  std::memcpy(out, acc, sizeof(out));
  store<R>(out, y, ldy, ncols, bias);
}
#endif

}  // namespace dominospec
