// Weight format q4-dot ("q4_octets"): a GGUF file's own 4-bit blocks x int8 activations on the integer dot product.
//
// Weights: Q4_1 blocks of 32 k as the file holds them, w = s * q + o with q in 0..15 and s, o float16 (Q4_0:
// o = -8 * s, exact in float16; quant.Blocks). Packed per panel and block in four octets of k, two k-quads an
// octet in the two nibbles of a byte: packed[p][g][o][j][t] = q(W[p*NR + j][32g + 8o + t]) | q(.. + 4 + t) << 4,
// 4 bits a weight; scales [P][G][2][NR] float16 (each block's s for the panel's NR columns, then its o).
// Activations: each row quantised on its own in blocks of 32, exactly as int8-dot does (quantize_rows, linear.cpp:
// d, d * sum(qx) per row and block). The nibbles are unpacked in registers; per column and block the integer dot
// sum(q * qx) is exact in int32 (|sum| <= 32 * 15 * 127):
//   - AVX512-VNNI: vpdpbusd, the nibbles (u8) times the activations (s8), four products a lane;
//   - AVX2: vpmaddubsw (pairs of at most 2 * 15 * 127, no saturation), then vpmaddwd by ones.
// Then int8-dot's fixed order per block, each step rounded to fp32 on its own:
//   total += float(dot) * (s * d);   total += o * (d * sum(qx))
// and the bias at the end. A row's result never depends on the other rows of the call.
#pragma once

#include "format_int8_dot.h"

namespace dominospec {

constexpr int OCTETS = 4;  // octets of k per block of 32
constexpr int Q4_BLOCK = OCTETS * 2 * QUAD;
// Rows a group: the integer sums take R x NV registers, plus 2 x NV unpacked weight vectors and two broadcasts; the
// fp32 totals another R x NV up to Q4_TOTALS_IN_REGISTERS rows, beyond that they sit in memory (touched once a
// block). A verify of up to MR_Q4 rows then streams the panels once.
constexpr int MR_Q4 = VREGS == 32 ? 12 : 4;
constexpr int Q4_TOTALS_IN_REGISTERS = VREGS == 32 ? 6 : 2;

inline vf widen_half(const uint16_t* p) {  // VW float16 -> fp32 (exact)
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int l = 0; l < VW; ++l) v[l] = static_cast<float>(reinterpret_cast<const _Float16*>(p)[l]);
  return v;
#endif
}

#ifdef DOMINOSPEC_INT8_DOT_VNNI
struct Q4Vnni {  // unsigned nibbles x signed activations, four products summed a lane
  static constexpr bool BIASED = false;  // nibbles are unsigned already
  static inline vi madd(vi acc, vi w, vi x) { return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x); }
};
#endif

#ifdef DOMINOSPEC_INT8_DOT_AVX2
struct Q4Avx2 {
  static constexpr bool BIASED = false;
  static inline __m256i madd256(__m256i acc, __m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(w, x);  // w in 0..15: no saturation
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

// R rows through one panel: xq [R][ldx] int8 (whole blocks), wp [G][OCTETS][NR][4] nibble pairs, so [G][2][NR]
// float16 scales then offsets, info [R][G][ROW_INFO] (int8-dot's row quantisation). EIGHT: a Q8_0 tensor instead,
// wp [G][8][NR][4] holding q + 128 (int8-dot's bias, so Dot is int8-dot's DotVnni / DotAvx2) and so [G][1][NR] its
// float16 scales alone (no offset: its step is left out, not added as 0).
template <typename Dot, int R, bool EIGHT>
void panel_q4_dot(const int8_t* __restrict xq, int64_t ldx, const uint8_t* __restrict wp, int64_t groups,
                  float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                  const uint16_t* __restrict so, const float* __restrict info) {
  typedef uint16_t vh2 __attribute__((vector_size(sizeof(vi))));  // a vi's bytes as 16-bit lanes, for the shift
  constexpr int64_t OCTET_BYTES = NR * QUAD;
  constexpr int STEPS = EIGHT ? 2 * OCTETS : OCTETS;  // weight rows of NR x 4 bytes a block
  constexpr int PAIRS = EIGHT ? 1 : 2;  // float16 values a column and block
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  const vi low = vi{} + 0x0F0F0F0F;
  constexpr bool in_memory = R > Q4_TOTALS_IN_REGISTERS;
  if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  for (int64_t g = 0; g < groups; ++g) {
    vi isum[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) isum[r][v] = vi{};
    for (int o = 0; o < STEPS; ++o) {
      const uint8_t* wk = wp + (g * STEPS + o) * OCTET_BYTES;
      prefetch_row(wk + PREFETCH * OCTET_BYTES, OCTET_BYTES);
      vi lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        vi w;
        std::memcpy(&w, wk + v * VW * QUAD, sizeof(vi));
        lo[v] = EIGHT ? w : w & low;
        if constexpr (!EIGHT) hi[v] = (vi)((vh2)w >> 4) & low;
      }
      const int64_t k = g * Q4_BLOCK + o * (EIGHT ? 1 : 2) * QUAD;
      for (int r = 0; r < R; ++r) {
        int32_t first, second;
        std::memcpy(&first, xq + r * ldx + k, sizeof(first));
        const vi xa = vi{} + first;  // the row's 4 activations in every lane
        if constexpr (EIGHT) {
          for (int v = 0; v < NV; ++v) isum[r][v] = Dot::madd(isum[r][v], lo[v], xa);
        } else {
          std::memcpy(&second, xq + r * ldx + k + QUAD, sizeof(second));
          const vi xb = vi{} + second;
          for (int v = 0; v < NV; ++v) isum[r][v] = Dot::madd(Dot::madd(isum[r][v], lo[v], xa), hi[v], xb);
        }
      }
    }
    vf sg[NV], og[NV];
    for (int v = 0; v < NV; ++v) {
      sg[v] = widen_half(so + g * PAIRS * NR + v * VW);
      if constexpr (!EIGHT) og[v] = widen_half(so + g * PAIRS * NR + NR + v * VW);
    }
    for (int r = 0; r < R; ++r) {
      const float* ri = info + (r * groups + g) * ROW_INFO;
      const float d = ri[0], dsum = ri[1];
      for (int v = 0; v < NV; ++v) {
        vf dot = __builtin_convertvector(isum[r][v], vf);  // exact: |dot| < 2^24
        if constexpr (EIGHT && Dot::BIASED) dot -= ri[2];  // 128 * sum(qx) off, exactly
        acc[r][v] += rounded(dot * rounded(sg[v] * d));
        if constexpr (!EIGHT) acc[r][v] += rounded(og[v] * dsum);
      }
    }
    if constexpr (in_memory) asm volatile("" : : "r"(acc) : "memory");
  }
  store<R>(acc, y, ldy, ncols, bias);
}

}  // namespace dominospec
