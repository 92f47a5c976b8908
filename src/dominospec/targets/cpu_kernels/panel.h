// What every weight format's panel kernel shares: how far ahead a panel is prefetched, how many adjacent panels
// a row group walks at once, one k step of fp32 FMAs over widened weights, and the store of a row group's sums.
//
// A panel is NR output columns of W packed k-major (pack.cpp): packed[p][k][j] = W[p*NR + j][k]. A panel
// kernel keeps R rows x NR columns of sums in registers and walks k once, so each weight loaded feeds R rows.
#pragma once

#include "simd.h"

namespace dominospec {

// Panels walked at once by a group of R rows where NPMAX allows: 8 accumulators for one or two rows
// (int8, whose two rows ran slower on two panels: one row only)
constexpr int panels_for(int R, bool i8) { return std::min(NPMAX, R == 1 ? 4 : R == 2 && !i8 ? 2 : 1); }
constexpr int PREFETCH = 8;  // panel rows ahead

// How far ahead a panel is prefetched: PREFETCH rows, and on AVX2 at least PREFETCH_BYTES (an int8 row
// of 16 bytes is a quarter of a cache line: 8 rows ahead was two lines)
constexpr int PREFETCH_BYTES = NPMAX > 1 ? 512 : 0;
template <typename T>
constexpr int64_t ahead() { return std::max<int64_t>(PREFETCH, PREFETCH_BYTES / (NR * sizeof(T))) * NR; }

// acc [R][NVP] -> y rows, plus the bias, only the ncols real columns
template <int R, int NVP = NV>
inline void store(vf (&acc)[R][NVP], float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[NVP * VW];
    std::memcpy(out, acc[r], sizeof(out));
    float* yr = y + r * ldy;
    if (bias != nullptr)
      for (int64_t j = 0; j < ncols; ++j) yr[j] = out[j] + bias[j];
    else
      std::memcpy(yr, out, ncols * sizeof(float));
  }
}

// One k of NP panels for R rows: acc[r][j * NV + v] += w[j][k][v] * x[r][k], one FMA each. With one
// panel, its NV weight vectors are loaded first and each row's x is broadcast in turn (R x NV
// accumulators + NV + 1 registers); with several, the rows' x are broadcast first and every weight
// vector goes straight into its R FMAs (R x NV x NP + R + 1), so that nothing spills.
template <typename Fmt, int R, int NP>
inline void step(vf (&acc)[R][NV * NP], const float* __restrict x, int64_t ldx, const typename Fmt::T* __restrict wp,
                 int64_t wstride, int64_t k) {
  if constexpr (NP == 1) {
    const typename Fmt::T* wk = wp + k * NR;
    prefetch_row(wk + ahead<typename Fmt::T>(), NR * sizeof(typename Fmt::T));
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Fmt::widen(wk + v * VW);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += w[v] * xs;  // contracted to one FMA
    }
  } else {
    vf xs[R];
    for (int r = 0; r < R; ++r) xs[r] = x[r * ldx + k] - vf{};  // a broadcast (x - 0 is x, -0 included)
    for (int j = 0; j < NP; ++j) {
      const typename Fmt::T* wk = wp + j * wstride + k * NR;
      prefetch_row(wk + ahead<typename Fmt::T>(), NR * sizeof(typename Fmt::T));
      for (int v = 0; v < NV; ++v) {
        const vf w = Fmt::widen(wk + v * VW);
        for (int r = 0; r < R; ++r) acc[r][j * NV + v] += w * xs[r];
      }
    }
  }
}

}  // namespace dominospec
