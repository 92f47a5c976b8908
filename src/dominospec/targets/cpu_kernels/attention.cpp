// RoPE and attention over the KV cache for a few new tokens per row (decode and verify), each query on its own.

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace dominospec {

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads) {
  // x [B, S, >= heads, D] float32, last dim contiguous; cos/sin [1 or B, S, D] contiguous, the sign of
  // rotate_half folded into sin. Returns the first `heads` heads rotated: [B, S, heads, D] contiguous,
  // out = x * cos + roll(x, D/2) * sin.
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.stride(3) == 1, "x must be [B, S, H, D] float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 3 && cos.sizes() == sin.sizes(), "bad cos/sin");
  const int64_t B = x.size(0), S = x.size(1), D = x.size(3), half = D / 2, Bc = cos.size(0);
  TORCH_CHECK(heads <= x.size(2) && D % 2 == 0 && cos.size(1) == S && cos.size(2) == D && (Bc == 1 || Bc == B),
              "rope: shapes do not match");
  auto out = torch::empty({B, S, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = x.stride(0), ss = x.stride(1), sh = x.stride(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t) {
      const float* c = cp + ((Bc == 1 ? 0 : b) * S + t) * D;
      const float* sn = sp + ((Bc == 1 ? 0 : b) * S + t) * D;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xi = xp + b * sb + t * ss + h * sh;
        float* o = op + ((b * S + t) * heads + h) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = xi[d] * c[d] + xi[d + half] * sn[d];
        for (int64_t d = half; d < D; ++d) o[d] = xi[d] * c[d] + xi[d - half] * sn[d];
      }
    }
  return out;
}

// Attention over the KV cache for a few new tokens per row (decode and verify), each query on its own.
//
// Query j of row b sits at position starts[b] + j and reads keys 0..starts[b] + j. Its score with key t
// is the dot product over D in one fixed order (with AVX-512 or AVX and D a multiple of VW: per key, VW
// lanes of partial sums over d, then a fixed tree of lane shuffles that sums VW keys' lanes at once; else
// one FMA per d in order); its softmax takes the max, the exponentials and their sum in key order, and its output
// sums the values in key order. Up to QG queries of a kv head go together, so each key and value row is
// loaded once for all of them (from L1/L2: the cache is read about once per QG queries), but nothing in
// one query's arithmetic depends on the other queries of the call, the other rows, their number or the
// thread that runs it: a token verified among k others, decoded alone, or run in a ragged batch of the
// engine gets the same bits. (SDPA's masked multi-query and one-query paths sum in different orders.)

namespace {

#if defined(__AVX512F__)
inline vf sum_lanes(const vf (&a)[16]) {
  // out[l] = the sum of a[l]'s 16 lanes, by a fixed tree (halves, quarters, eighths, pairs): 16 keys at once
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif defined(__AVX__)
inline vf sum_lanes(const vf (&a)[8]) {
  // the same tree for 8 keys of 8 lanes (halves, pairs, neighbours). Before it, AVX2 summed each score
  // one d at a time: 64 dependent FMAs a score, the bulk of a verify's time at long contexts
  vf b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif
#if defined(__AVX512F__) || defined(__AVX__)
#define DOMINOSPEC_LANE_SCORES 1
#endif

constexpr int QG = 4;  // queries of one kv head that share each key and value row as it streams by

#ifdef DOMINOSPEC_LANE_SCORES
template <int NQ>
void key_scores_v(const float* const* q, const float* __restrict keys, int64_t n, int64_t D, float scale,
                  float* const* out) {
  vf acc[NQ][VW];
  for (int l = 0; l < VW; ++l) {
    vf a[NQ] = {};
    if (l < n)
      for (int64_t d = 0; d < D; d += VW) {
        vf kv;
        std::memcpy(&kv, keys + l * D + d, sizeof(vf));
        for (int c = 0; c < NQ; ++c) {
          vf qv;
          std::memcpy(&qv, q[c] + d, sizeof(vf));
          a[c] += qv * kv;  // one FMA
        }
      }
    for (int c = 0; c < NQ; ++c) acc[c][l] = a[c];
  }
  for (int c = 0; c < NQ; ++c) {
    const vf s = sum_lanes(acc[c]) * scale;
    std::memcpy(out[c], &s, n * sizeof(float));
  }
}
#endif

inline void key_scores(const float* const* q, int nq, const float* __restrict keys, int64_t n, int64_t D, float scale,
                       float* const* out) {
  // out[c][l] = scale * (q[c] . keys[l]) for nq <= QG queries and the n <= VW keys of one block (rows of D); each
  // query's sums in one fixed order, whatever nq and n (a key's sum reads only its own lanes)
#ifdef DOMINOSPEC_LANE_SCORES
  if (D % VW == 0) {
    switch (nq) {
      case 1: return key_scores_v<1>(q, keys, n, D, scale, out);
      case 2: return key_scores_v<2>(q, keys, n, D, scale, out);
      case 3: return key_scores_v<3>(q, keys, n, D, scale, out);
      default: return key_scores_v<4>(q, keys, n, D, scale, out);
    }
  }
#endif
  for (int c = 0; c < nq; ++c)
    for (int64_t l = 0; l < n; ++l) {
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s += q[c][d] * keys[l * D + d];
      out[c][l] = s * scale;
    }
}

inline vf exp_nonpositive(vf x) {
  // e^x for x <= 0 (scores minus their max), VW lanes at once: Cody-Waite reduction by ln 2 and a
  // degree-6 polynomial (Cephes' expf coefficients), ~1 ulp
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;
  const vf y = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);  // toward zero, then floor:
  n += __builtin_convertvector(n > y, vf);  // a true lane is -1
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Value accumulators a span keeps in registers: with 16 vector registers 8 (four queries x 8 vectors of
// D = 64 spilled on every FMA: the span walks D in slices of 8 / NQ vectors, measured on AVX2); with 32 all
// NQ x NDV as before (not measured otherwise)
constexpr int VALUE_ACCUMULATORS = VREGS == 16 ? 8 : 64;

template <int NDV, int NQ>
void values_span(const float* const* w, const float* __restrict vals, int64_t t0, int64_t t1, float* const* acc) {
  // acc[c] += w[c][t] * vals[t] for t in [t0, t1) in order, NQ queries at once: each value row (slice) is loaded
  // once for all of them and the NQ x NS accumulators stay in registers over the span; a lane's sum over t is
  // the same whatever the slicing
  constexpr int NS = std::max(1, std::min(NDV, VALUE_ACCUMULATORS / NQ));
  static_assert(NDV % NS == 0, "value slices must tile D");
  for (int i0 = 0; i0 < NDV; i0 += NS) {
    vf a[NQ][NS];
    for (int c = 0; c < NQ; ++c)
      for (int i = 0; i < NS; ++i) std::memcpy(&a[c][i], acc[c] + (i0 + i) * VW, sizeof(vf));
    for (int64_t t = t0; t < t1; ++t) {
      const float* vt = vals + t * NDV * VW + i0 * VW;
      vf x[NS];
      for (int i = 0; i < NS; ++i) std::memcpy(&x[i], vt + i * VW, sizeof(vf));
      for (int c = 0; c < NQ; ++c)
        for (int i = 0; i < NS; ++i) a[c][i] += w[c][t] * x[i];
    }
    for (int c = 0; c < NQ; ++c) std::memcpy(acc[c] + i0 * VW, a[c], sizeof(a[c]));
  }
}

template <int NDV>
void weighted_values_v(const float* const* w, const int64_t* T, int nq, const float* __restrict vals,
                       float* const* acc) {
  // acc[c][D = NDV * VW] += w[c][t] * vals[t] for t < T[c] in order, for nq <= QG queries (T non-decreasing), in
  // spans where queries first..nq-1 all still read keys; across spans the sums continue as in one pass
  int64_t lo = 0;
  for (int first = 0; first < nq; ++first) {
    const int64_t hi = T[first];
    if (hi <= lo) continue;
    switch (nq - first) {
      case 1: values_span<NDV, 1>(w + first, vals, lo, hi, acc + first); break;
      case 2: values_span<NDV, 2>(w + first, vals, lo, hi, acc + first); break;
      case 3: values_span<NDV, 3>(w + first, vals, lo, hi, acc + first); break;
      default: values_span<NDV, 4>(w + first, vals, lo, hi, acc + first); break;
    }
    lo = hi;
  }
}

void weighted_values(const float* const* w, const int64_t* T, int nq, const float* vals, int64_t D,
                     float* const* acc) {
  // the same sums lane by lane whichever branch runs: a lane is one d, summed over t in order
  switch (D == VW * (D / VW) ? D / VW : 0) {
    case 1: return weighted_values_v<1>(w, T, nq, vals, acc);
    case 2: return weighted_values_v<2>(w, T, nq, vals, acc);
    case 4: return weighted_values_v<4>(w, T, nq, vals, acc);
    case 8: return weighted_values_v<8>(w, T, nq, vals, acc);
    default:
      for (int c = 0; c < nq; ++c)
        for (int64_t t = 0; t < T[c]; ++t)
          for (int64_t d = 0; d < D; ++d) acc[c][d] += w[c][t] * vals[t * D + d];
  }
}

}  // namespace

torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& starts, double scale) {
  // q [B, S, Hq, D] float32 (D contiguous); k, v [B, Hkv, L, D] contiguous caches; starts [B] int64.
  // Returns [B, S, Hq, D]. One work item per (row, kv head), its S x Hq / Hkv queries one after another.
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, "q must be [B, S, Hq, D] float32");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "k and v must be contiguous [B, Hkv, L, D] float32 caches of one shape");
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "attend: q and the caches do not match");
  auto st = starts.to(at::kLong).contiguous();
  TORCH_CHECK(st.dim() == 1 && st.size(0) == B, "starts must be [B]");
  const int64_t* sp = st.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] + S <= L, "attend: row ", b, " reads past the cache (start ", sp[b], ", ", S,
                " new, ", L, " cached)");
  const int64_t G = Hq / Hkv;  // q heads per kv head
  auto out = torch::empty({B, S, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = q.stride(0), ss = q.stride(1), sh = q.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / Hkv, g = u % Hkv, start = sp[b], Qn = S * G;
      const float* keys = kp + (b * Hkv + g) * L * D;
      const float* vals = vp + (b * Hkv + g) * L * D;
      const int64_t stride = (start + S + VW - 1) / VW * VW;  // a query's scores, then weights, in whole vectors
      p.resize(QG * stride);
      acc.resize(QG * D);
      for (int64_t q0 = 0; q0 < Qn; q0 += QG) {  // queries (j, h) in order, QG at a time; query j reads keys 0..start + j
        const int nq = static_cast<int>(std::min<int64_t>(QG, Qn - q0));
        const float* qv[QG];
        float *ph[QG], *oc[QG], *dst[QG];
        int64_t T[QG];
        for (int c = 0; c < nq; ++c) {
          const int64_t j = (q0 + c) / G, h = (q0 + c) % G;
          qv[c] = qp + b * sb + j * ss + (g * G + h) * sh;
          ph[c] = p.data() + c * stride;
          oc[c] = acc.data() + c * D;
          T[c] = start + j + 1;
        }
        for (int64_t t0 = 0; t0 < T[nq - 1]; t0 += VW) {  // scores: each key block loaded once for the group
          for (int c = 0; c < nq; ++c) dst[c] = ph[c] + t0;
          key_scores(qv, nq, keys + t0 * D, std::min<int64_t>(VW, T[nq - 1] - t0), D, sc, dst);
        }
        float total[QG];
        for (int c = 0; c < nq; ++c) {
          float* w = ph[c];
          const int64_t Tc = T[c], Tpad = (Tc + VW - 1) / VW * VW;
          std::fill(w + Tc, w + Tpad, w[0]);  // the last vector's lanes past T: a score of this query's
          vf mv;  // the max (exact in any order) VW lanes at a time
          std::memcpy(&mv, w, sizeof(vf));
          for (int64_t t = VW; t < Tpad; t += VW) {
            vf x;
            std::memcpy(&x, w + t, sizeof(vf));
            mv = x > mv ? x : mv;
          }
          float m = mv[0];
          for (int l = 1; l < VW; ++l) m = std::max(m, mv[l]);
          std::fill(w + Tc, w + Tpad, m);  // then finite past T, and weighted 0 below
          // weights VW at a time, lanes past T set to 0; the sum kept per lane (lane = t mod VW) and the lanes
          // added in a fixed order: the same bits for the same T
          vf total_v = {};
          for (int64_t t = 0; t < Tc; t += VW) {
            vf x;
            std::memcpy(&x, w + t, sizeof(vf));
            vf e = exp_nonpositive(x - m);
            for (int64_t l = Tc - t; l < VW; ++l) e[l] = 0.0f;
            std::memcpy(w + t, &e, sizeof(vf));
            total_v += e;
          }
          total[c] = 0.0f;
          for (int l = 0; l < VW; ++l) total[c] += total_v[l];
          std::fill(oc[c], oc[c] + D, 0.0f);
        }
        weighted_values(ph, T, nq, vals, D, oc);  // each value row loaded once for the group
        for (int c = 0; c < nq; ++c) {
          const int64_t j = (q0 + c) / G, h = (q0 + c) % G;
          float* o = op + ((b * S + j) * Hq + g * G + h) * D;
          const float inv = 1.0f / total[c];
          for (int64_t d = 0; d < D; ++d) o[d] = oc[c][d] * inv;
        }
      }
    }
  });
  return out;
}

}  // namespace dominospec
