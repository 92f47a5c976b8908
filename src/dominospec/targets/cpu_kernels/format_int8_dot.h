// Weight format int8-dot ("int8_quads"): int8 weights x int8 activations on the CPU's integer dot product.
//
// Weights: quant.py's int8 (w = s * q + o per output column and group of G k, G a multiple of 4), packed in k-quads
// with a bias of 128, packed[p][k4][j][t] = q(W[p*NR + j][4*k4 + t]) + 128 as uint8 (zero-padded k and columns
// hold q = 0). Activations: each row quantised on its own in blocks of the same G k (as llama.cpp's Q8_0): d =
// max|x| / 127, qx = round-half-even(x / d) in -127..127 (0 where d is 0), plus, per row and block, d * sum(qx)
// and 128 * sum(qx) (quantize_rows, linear.cpp). So the model this format computes is W (as int8 stores it) times
// x rounded to its blocks: a format of its own (precision "int8-weights-dot").
//
// Per column and group, the integer dot sum(q * qx) is exact in int32, whichever instruction forms it:
//   - AVX512-VNNI: vpdpbusd multiplies the biased weights (u8) by the activations (s8), four products a lane,
//     giving sum((q + 128) * qx) onto a start of -128 * sum(qx), the row's correction (exact in int32);
//   - AVX2: vpmaddubsw on |q| (u8, <= 128) and qx carrying q's sign (s8), pairs of at most 2 * 128 * 127 (no
//     saturation), then vpmaddwd by ones into int32 lanes. (On an AVX-512 build it runs on the two halves of
//     each vector, so this machine can test it.)
// Then, in one fixed order per group, each step rounded to fp32 on its own (no FMA contraction: the float64
// reference in the tests mirrors it op by op):
//   total += float(dot) * (s * d);   total += o * (d * sum(qx))
// and the bias at the end. Nothing depends on which other rows share the call: decode = verify, bit for bit.
#pragma once

#include "format_float.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define DOMINOSPEC_INT8_DOT_VNNI 1
#endif
#if defined(__AVX2__)
#define DOMINOSPEC_INT8_DOT_AVX2 1
#endif

namespace dominospec {

constexpr int QUAD = 4;  // k per int32 lane of one dot-product instruction
constexpr int ROW_INFO = 3;  // per row and block: d, d * sum(qx), 128 * sum(qx)
// Rows a group: the integer sums take R x NV registers, plus NV weight vectors and a broadcast; the fp32 totals
// another R x NV up to MR_DOT / 2 rows, beyond that they sit in memory (touched once per group of k)
constexpr int MR_DOT = VREGS == 32 ? 12 : 4;

// The value never leaves a register through the compiler's view: a product is not fused into the next add.
inline vf rounded(vf v) {
  asm("" : "+v"(v));
  return v;
}

#ifdef DOMINOSPEC_INT8_DOT_VNNI
struct DotVnni {
  static constexpr bool BIASED = true;  // sums (q + 128) * qx: the sum starts at -128 * sum(qx)
  static inline vi madd(vi acc, vi w, vi x) {
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
  }
};
#endif

#ifdef DOMINOSPEC_INT8_DOT_AVX2
struct DotAvx2 {
  static constexpr bool BIASED = false;  // unbiases the weights itself
  static inline __m256i madd256(__m256i acc, __m256i w, __m256i x) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // q, signed
    const __m256i a = _mm256_abs_epi8(q);  // |q| read as u8 (128 for -128)
    const __m256i b = _mm256_sign_epi8(x, q);  // qx with q's sign, 0 where q is 0
    const __m256i pairs = _mm256_maddubs_epi16(a, b);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static inline vi madd(vi acc, vi w, vi x) {
#if defined(__AVX512F__)
    const __m512i a = (__m512i)acc, wv = (__m512i)w, xv = (__m512i)x;
    const __m256i lo = madd256(_mm512_castsi512_si256(a), _mm512_castsi512_si256(wv), _mm512_castsi512_si256(xv));
    const __m256i hi = madd256(_mm512_extracti64x4_epi64(a, 1), _mm512_extracti64x4_epi64(wv, 1),
                               _mm512_extracti64x4_epi64(xv, 1));
    return (vi)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#else
    return (vi)madd256((__m256i)acc, (__m256i)w, (__m256i)x);
#endif
  }
};
#endif

// R rows through one panel: xq [R][ldx] int8 (k padded to whole quads with 0), wp [K4][NR][4] biased weights,
// so [groups][2][NR] the panel's scales then offsets per group, info [R][groups][ROW_INFO], qg quads a group
template <typename Dot, int R>
void panel_int8_dot(const int8_t* __restrict xq, int64_t ldx, const uint8_t* __restrict wp, int64_t K4,
                    float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                    const float* __restrict so, const float* __restrict info, int64_t qg) {
  const int64_t groups = (K4 + qg - 1) / qg;
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  constexpr bool in_memory = R > MR_DOT / 2;
  if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  for (int64_t g = 0; g < groups; ++g) {
    vi isum[R][NV];  // VNNI's start at -128 * sum(qx): they end at sum(q * qx), exactly
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t start = Dot::BIASED ? -static_cast<int32_t>(info[(r * groups + g) * ROW_INFO + 2]) : 0;
      for (int v = 0; v < NV; ++v) isum[r][v] = vi{} + start;
    }
    const int64_t q1 = std::min(K4, (g + 1) * qg);
    for (int64_t q = g * qg; q < q1; ++q) {
      const uint8_t* wk = wp + q * NR * QUAD;
      prefetch_row(wk + PREFETCH * NR * QUAD, NR * QUAD);
      vi w[NV];
      for (int v = 0; v < NV; ++v) std::memcpy(&w[v], wk + v * VW * QUAD, sizeof(vi));
#pragma GCC unroll 16  // every row's sums in registers (a rolled loop kept them on the stack)
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * ldx + q * QUAD, sizeof(four));
        const vi xb = vi{} + four;  // the row's 4 activations in every lane
        for (int v = 0; v < NV; ++v) isum[r][v] = Dot::madd(isum[r][v], w[v], xb);
      }
    }
    vf sg[NV], og[NV];
    for (int v = 0; v < NV; ++v) {
      sg[v] = load_vf(so + g * 2 * NR + v * VW);
      og[v] = load_vf(so + g * 2 * NR + NR + v * VW);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* ri = info + (r * groups + g) * ROW_INFO;
      const float d = ri[0], dsum = ri[1];
      for (int v = 0; v < NV; ++v) {
        const vf dot = __builtin_convertvector(isum[r][v], vf);  // exact: |dot| < 2^24
        acc[r][v] += rounded(dot * rounded(sg[v] * d));
        acc[r][v] += rounded(og[v] * dsum);
      }
    }
    if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  }
  store<R>(acc, y, ldy, ncols, bias);
}

}  // namespace dominospec
