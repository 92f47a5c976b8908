// The linear: y = x @ W^T (+ b) for a few rows of x (decode and verify) or many (prefill), streaming each weight
// once for all rows of a group. The panel kernels are per weight format (format_*.h); here they are tabled by
// row count and adjacent panels, and the rows and panels spread over threads.
//
// Every output element is accumulated in the same order (k = 0, 1, ..., one FMA per k; k-pairs for the bf16 dot
// product) whatever the number of rows, the row group or the thread: a row's result does not depend on its batch.

#include "format_bf16_pairs.h"
#include "format_float.h"
#include "format_int8.h"
#include "format_int8_dot.h"
#include "format_q4_dot.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>
#include <type_traits>
#include <utility>

namespace dominospec {
namespace {

constexpr int64_t CHUNK = 64;  // rows per work item

// One row group through NP adjacent panels: (x rows, ldx, first panel, elements from one panel to the
// next, K, y, ldy, ncols, bias, and for int8: the first panel's scales and offsets, floats from one
// panel's to the next, the rows' group sums of x, the group size)
template <typename X, typename T>
using PanelFn = void (*)(const X*, int64_t, const T*, int64_t, int64_t, float*, int64_t, int64_t, const float*,
                         const float*, int64_t, const float*, int64_t);

// Adjacent panels a group of R rows walks at once in a format of weight type T (int8-dot's uint8: one)
template <typename T>
constexpr int panels_at_once(int R) {
  return std::is_same_v<T, uint8_t> ? 1 : panels_for(R, std::is_same_v<T, int8_t>);
}

// table[np - 1][R - 1]; np is at most panels_at_once(R) (a wider entry is never called, so it repeats np = 1)
template <int NT, typename X, typename T, template <int, int> class Kernel, int NP, int... Rs>
constexpr std::array<PanelFn<X, T>, NT> table_row(std::integer_sequence<int, Rs...>) {
  return {{Kernel<Rs + 1, (NP <= panels_at_once<T>(Rs + 1) ? NP : 1)>::run...}};
}
template <int NT, typename X, typename T, template <int, int> class Kernel, int... Ps>
constexpr std::array<std::array<PanelFn<X, T>, NT>, NPMAX> make_table(std::integer_sequence<int, Ps...>) {
  return {{table_row<NT, X, T, Kernel, Ps + 1>(std::make_integer_sequence<int, NT>{})...}};
}

template <typename Fmt>
struct Panel {
  template <int R, int NP>
  struct K {
    static constexpr PanelFn<float, typename Fmt::T> run = &panel<Fmt, R, NP>;
  };
};
template <int R, int NP>
struct PanelI8 {
  static constexpr PanelFn<float, int8_t> run = &panel_i8<R, NP>;
};

// int8 holds partial sums and totals: with the totals in memory, as many rows as fp32
constexpr int MR_I8 = I8_TOTALS_IN_MEMORY ? MR : MR / 2;
constexpr auto NPS = std::make_integer_sequence<int, NPMAX>{};
const auto PANELS_F32 = make_table<MR, float, float, Panel<F32>::K>(NPS);
const auto PANELS_BF16 = make_table<MR, float, uint16_t, Panel<BF16>::K>(NPS);
const auto PANELS_I8 = make_table<MR_I8, float, int8_t, PanelI8>(NPS);

#ifdef DOMINOSPEC_BF16_DOT
template <int R, int NP>
struct PanelDot {
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t, int64_t K2, float* y, int64_t ldy,
                  int64_t ncols, const float* bias, const float*, int64_t, const float*, int64_t) {
    static_assert(NP == 1, "the bf16 dot product walks one panel at a time");
    panel_dot<R>(x, ldx, wp, K2, y, ldy, ncols, bias);
  }
};
const auto PANELS_DOT = make_table<MR, uint16_t, uint16_t, PanelDot>(NPS);
#endif

// int8-dot: (xq, ldx, panel, -, K4, y, ldy, ncols, bias, scales and offsets, -, row info, quads a group)
template <typename Dot>
struct PanelInt8Dot {
  template <int R, int NP>
  struct K {
    static void run(const int8_t* x, int64_t ldx, const uint8_t* wp, int64_t, int64_t K4, float* y, int64_t ldy,
                    int64_t ncols, const float* bias, const float* so, int64_t, const float* info, int64_t qg) {
      panel_int8_dot<Dot, R>(x, ldx, wp, K4, y, ldy, ncols, bias, so, info, qg);
    }
  };
};
#ifdef DOMINOSPEC_INT8_DOT_VNNI
const auto PANELS_INT8_DOT_VNNI = make_table<MR_DOT, int8_t, uint8_t, PanelInt8Dot<DotVnni>::K>(NPS);
#endif
#ifdef DOMINOSPEC_INT8_DOT_AVX2
const auto PANELS_INT8_DOT_AVX2 = make_table<MR_DOT, int8_t, uint8_t, PanelInt8Dot<DotAvx2>::K>(NPS);
#endif

// q4-dot: (xq, ldx, panel, -, blocks, y, ldy, ncols, bias, float16 scales (and offsets), -, row info, -); EIGHT:
// a Q8_0 tensor's panels
template <typename Dot, bool EIGHT>
struct PanelQ4Dot {
  template <int R, int NP>
  struct K {
    static void run(const int8_t* x, int64_t ldx, const uint8_t* wp, int64_t, int64_t groups, float* y, int64_t ldy,
                    int64_t ncols, const float* bias, const float* so, int64_t, const float* info, int64_t) {
      panel_q4_dot<Dot, R, EIGHT>(x, ldx, wp, groups, y, ldy, ncols, bias, reinterpret_cast<const uint16_t*>(so),
                                  info);
    }
  };
};
#ifdef DOMINOSPEC_INT8_DOT_VNNI
const auto PANELS_Q4_DOT_VNNI = make_table<MR_Q4, int8_t, uint8_t, PanelQ4Dot<Q4Vnni, false>::K>(NPS);
const auto PANELS_Q8_DOT_VNNI = make_table<MR_Q4, int8_t, uint8_t, PanelQ4Dot<DotVnni, true>::K>(NPS);
#endif
#ifdef DOMINOSPEC_INT8_DOT_AVX2
const auto PANELS_Q4_DOT_AVX2 = make_table<MR_Q4, int8_t, uint8_t, PanelQ4Dot<Q4Avx2, false>::K>(NPS);
const auto PANELS_Q8_DOT_AVX2 = make_table<MR_Q4, int8_t, uint8_t, PanelQ4Dot<DotAvx2, true>::K>(NPS);
#endif

// The int8-dot instructions this build has, best first, and the one linear() uses (set_int8_dot_path)
std::vector<std::string> int8_dot_builds() {
  std::vector<std::string> paths;
#ifdef DOMINOSPEC_INT8_DOT_VNNI
  paths.push_back("avx512-vnni");
#endif
#ifdef DOMINOSPEC_INT8_DOT_AVX2
  paths.push_back("avx2");
#endif
  return paths;
}
std::string int8_dot_choice = int8_dot_builds().empty() ? "" : int8_dot_builds()[0];

// One block of x quantised (format_int8_dot.h): qx = round-half-even(x / d) for d = max|x| / 127 (0 where d is 0);
// returns sum(qx). Whole blocks of whole vectors take the vector path; both give the same values (the division is
// IEEE, and adding then subtracting 1.5 * 2^23 rounds |v| <= 127 to the nearest integer, ties to even, as rint).
int32_t quantize_block(const float* __restrict x, int64_t n, int8_t* __restrict q, float& d) {
  float amax = 0.0f;
  int32_t sum = 0;
  if (n % VW == 0) {
    vf m = {};
    for (int64_t k = 0; k < n; k += VW) {
      const vf v = load_vf(x + k);
      const vf a = v < 0 ? -v : v;
      m = a > m ? a : m;
    }
    for (int l = 0; l < VW; ++l) amax = std::max(amax, m[l]);
    d = amax / 127.0f;
    if (d == 0.0f) {
      std::fill(q, q + n, int8_t{0});
      return 0;
    }
    const float magic = 12582912.0f;  // 1.5 * 2^23
    vi total = {};
    for (int64_t k = 0; k < n; k += VW) {
      vf r = (load_vf(x + k) / d + magic) - magic;
      r = r > 127.0f ? vf{} + 127.0f : r;
      r = r < -127.0f ? vf{} - 127.0f : r;
      const vi qi = __builtin_convertvector(r, vi);
      total += qi;
      const vb qb = __builtin_convertvector(qi, vb);
      std::memcpy(q + k, &qb, sizeof(vb));
    }
    for (int l = 0; l < VW; ++l) sum += total[l];
    return sum;
  }
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  d = amax / 127.0f;
  for (int64_t k = 0; k < n; ++k) {
    const float r = d > 0.0f ? std::nearbyint(x[k] / d) : 0.0f;
    const int32_t qi = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, r)));
    q[k] = static_cast<int8_t>(qi);
    sum += qi;
  }
  return sum;
}

// Each row of x [M, K] quantised on its own in blocks of `group` k: xq [M, ldq] int8, k past K zero; info [M, groups,
// ROW_INFO] (d, d * sum(qx), 128 * sum(qx)). Per row and block: the same bits whatever M.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, int8_t* xq, int64_t ldq, float* info) {
  const int64_t groups = (K + group - 1) / group;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* qr = xq + m * ldq;
    std::fill(qr + K, qr + ldq, int8_t{0});
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group, n = std::min(K, k0 + group) - k0;
      float d;
      const int32_t sum = quantize_block(x + m * K + k0, n, qr + k0, d);
      float* ri = info + (m * groups + g) * ROW_INFO;
      ri[0] = d;
      ri[1] = d * static_cast<float>(sum);
      ri[2] = 128.0f * static_cast<float>(sum);
    }
  }
}

// Work items: (block of adjacent panels, chunk of at most CHUNK rows), consecutive items sharing a block,
// so prefill's many rows spread over threads too; each chunk is split into balanced row groups of at
// most NT rows, and each group walks its block np panels at a time (panels_for, fewer where the threads
// would otherwise go short of blocks). The row grouping and np change which rows and columns share
// registers, never the order of any output element's sum.
// (For int8 and int8-dot, xsum holds info_width floats per row and group; the scales take scale_floats floats per
// group and panel: two per column, or one for q4-dot's float16 pairs.)
template <typename X, typename T, size_t NT>
void run_panels(const std::array<std::array<PanelFn<X, T>, NT>, NPMAX>& panels, const X* xp, int64_t ldx,
                const T* wp, int64_t panel_elems, int64_t Kp, float* yp, int64_t M, int64_t N, int64_t P,
                const float* b, const float* so = nullptr, const float* xsum = nullptr, int64_t group = 0,
                int64_t info_width = 1, int64_t scale_floats = 2 * NR) {
  const int64_t groups = group > 0 ? (Kp + group - 1) / group : 0;
  const int64_t sstride = groups * scale_floats;
  const int64_t chunks = (M + CHUNK - 1) / CHUNK;
  const int64_t first_rows = std::min<int64_t>(CHUNK, M), first_groups = (first_rows + NT - 1) / NT;
  const int64_t widest = (first_rows + first_groups - 1) / first_groups;  // rows of the first chunk's widest group
  const int64_t per_thread = std::max<int64_t>(1, P / std::max<int64_t>(1, at::get_num_threads()));
  const int64_t block = std::min<int64_t>(panels_at_once<T>(static_cast<int>(widest)), per_thread);
  const int64_t blocks = (P + block - 1) / block;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p_first = (i / chunks) * block, p_end = std::min(P, p_first + block), c = i % chunks;
      const int64_t first = c * CHUNK, rows_here = std::min<int64_t>(CHUNK, M - first);
      const int64_t row_groups = (rows_here + NT - 1) / NT;
      int64_t m0 = first;
      for (int64_t g = 0; g < row_groups; ++g) {
        const int64_t rows = (first + rows_here - m0) / (row_groups - g);
        const int64_t step = std::min<int64_t>(panels_at_once<T>(static_cast<int>(rows)), block);
        for (int64_t p = p_first; p < p_end; p += step) {
          const int64_t np = std::min(step, p_end - p);
          const int64_t col = p * NR, ncols = std::min<int64_t>(np * NR, N - col);
          panels[np - 1][rows - 1](xp + m0 * ldx, ldx, wp + p * panel_elems, panel_elems, Kp, yp + m0 * N + col, N,
                                   ncols, b ? b + col : nullptr, so ? so + p * sstride : nullptr, sstride,
                                   xsum ? xsum + m0 * groups * info_width : nullptr, group);
        }
        m0 += rows;
      }
    }
  });
}

}  // namespace

int64_t panel_width() { return NR; }

std::vector<std::string> int8_dot_paths() { return int8_dot_builds(); }

void set_int8_dot_path(const std::string& path) {
  const auto paths = int8_dot_builds();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "int8-dot: this build has no path ", path,
              paths.empty() ? " (the CPU has neither AVX512-VNNI nor AVX2)" : "");
  int8_dot_choice = path;
}

std::string int8_dot_path() { return int8_dot_choice; }

bool has_bf16_dot() {
#ifdef DOMINOSPEC_BF16_DOT
  return true;
#else
  return false;
#endif
}

namespace {

// q4-dot (format_q4_dot.h): x [M, K] float32, K a multiple of 32; packed [P, K / 32, 4, NR, 4] uint8 nibble pairs
// with scale [P, K / 32, 2, NR] float16 (scales, then offsets), or a Q8_0 tensor's [P, K / 32, 8, NR, 4] uint8
// (q + 128) with scale [P, K / 32, 1, NR] float16
torch::Tensor linear_q4_dot(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale,
                            int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), G = K / Q4_BLOCK;
  const bool eight = packed.size(2) == 2 * OCTETS;
  TORCH_CHECK(K % Q4_BLOCK == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == G && (eight || packed.size(2) == OCTETS) && packed.size(3) == NR &&
                  packed.size(4) == QUAD,
              "q4-dot panels must be [P, K / 32, 4 or 8, NR, 4] uint8 for x's ", K, " columns");
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the packed panels");
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->dim() == 4 &&
                  scale->size(0) == P && scale->size(1) == G && scale->size(2) == (eight ? 1 : 2) &&
                  scale->size(3) == NR,
              "q4-dot scales must be [P, K / 32, 2 (1 for Q8_0), NR] float16");
  TORCH_CHECK(!int8_dot_choice.empty(), "q4-dot needs AVX512-VNNI or AVX2; this CPU has neither");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bad bias");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto info = torch::empty({M, G, ROW_INFO}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, Q4_BLOCK, xq.data_ptr<int8_t>(), K, info.data_ptr<float>());
  const auto* so = reinterpret_cast<const float*>(scale->data_ptr<at::Half>());  // float16: NR / 2 floats a value
  const auto* wp = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = G * packed.size(2) * NR * QUAD, scale_floats = scale->size(2) * NR / 2;
  const auto run = [&](const auto& table) {
    run_panels(table, xq.data_ptr<int8_t>(), K, wp, panel_bytes, G, y.data_ptr<float>(), M, N, P, b, so,
               info.data_ptr<float>(), 1, ROW_INFO, scale_floats);
  };
#ifdef DOMINOSPEC_INT8_DOT_VNNI
  if (int8_dot_choice == "avx512-vnni") eight ? run(PANELS_Q8_DOT_VNNI) : run(PANELS_Q4_DOT_VNNI);
#endif
#ifdef DOMINOSPEC_INT8_DOT_AVX2
  if (int8_dot_choice == "avx2") eight ? run(PANELS_Q8_DOT_AVX2) : run(PANELS_Q4_DOT_AVX2);
#endif
  return y;
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scale, int64_t group, int64_t N) {
  // x [M, K] float32 contiguous; packed from pack(); bias [N] or None; int8 only: scale
  // [P, ceil(K / group), 2, NR] float32 (per padded column and group of `group` k: scale, then offset) -> [M, N]
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  if (packed.dim() == 5) return linear_q4_dot(x, packed, bias, scale, N);
  const bool quads = packed.scalar_type() == at::kByte;  // int8-dot
  const bool pairs = packed.dim() == 4 && !quads;
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(2) == NR && packed.is_contiguous(), "packed weight mismatch");
  TORCH_CHECK(quads   ? (packed.dim() == 4 && packed.size(1) == (K + 3) / 4 && packed.size(3) == 4)
              : pairs ? (packed.size(1) == (K + 1) / 2 && packed.size(3) == 2)
                      : (packed.dim() == 3 && packed.size(1) == K),
              "packed weight does not match x's ", K, " columns");
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the packed panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bad bias");
    b = bias->data_ptr<float>();
  }
  const float* s = nullptr;
  if (scale.has_value() && scale->defined()) {
    TORCH_CHECK(group > 0, "int8 scales need a group size");
    TORCH_CHECK(scale->dim() == 4 && scale->size(0) == P && scale->size(1) == (K + group - 1) / group &&
                    scale->size(2) == 2 && scale->size(3) == NR && scale->is_contiguous() &&
                    scale->scalar_type() == at::kFloat,
                "scale must be [P, ceil(K / group), 2, NR] float32");
    s = scale->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const auto dtype = packed.scalar_type();
  if (pairs) {
#ifdef DOMINOSPEC_BF16_DOT
    TORCH_CHECK(dtype == at::kBFloat16 && s == nullptr, "paired panels are bfloat16, without scales");
    const int64_t K2 = packed.size(1);
    auto xb = torch::zeros({M, 2 * K2}, x.options().dtype(at::kBFloat16));  // activations rounded to bf16
    xb.narrow(1, 0, K).copy_(x);
    const auto* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    run_panels(PANELS_DOT, xbp, 2 * K2, wp, K2 * NR * 2, K2, yp, M, N, P, b);
    return y;
#else
    TORCH_CHECK(false, "this build has no bf16 dot product (AVX512-BF16)");
#endif
  }
  if (dtype == at::kFloat) {
    run_panels(PANELS_F32, xp, K, packed.data_ptr<float>(), K * NR, K, yp, M, N, P, b);
  } else if (dtype == at::kBFloat16) {
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    run_panels(PANELS_BF16, xp, K, wp, K * NR, K, yp, M, N, P, b);
  } else if (dtype == at::kByte) {  // int8-dot: [P, K4, NR, 4] biased int8 in k-quads
    TORCH_CHECK(s != nullptr && group > 0 && group % QUAD == 0, "int8-dot panels need their scales, groups of 4k k");
    const int64_t K4 = (K + QUAD - 1) / QUAD, groups = (K + group - 1) / group;
    TORCH_CHECK(packed.dim() == 4 && packed.size(1) == K4 && packed.size(3) == QUAD, "int8-dot panels mismatch");
    TORCH_CHECK(!int8_dot_choice.empty(), "int8-dot needs AVX512-VNNI or AVX2; this CPU has neither");
    auto xq = torch::empty({M, K4 * QUAD}, x.options().dtype(at::kChar));
    auto info = torch::empty({M, groups, ROW_INFO}, x.options());
    quantize_rows(xp, M, K, group, xq.data_ptr<int8_t>(), K4 * QUAD, info.data_ptr<float>());
    const auto* xqp = xq.data_ptr<int8_t>();
    const auto* wp = packed.data_ptr<uint8_t>();
    const float* ip = info.data_ptr<float>();
#ifdef DOMINOSPEC_INT8_DOT_VNNI
    if (int8_dot_choice == "avx512-vnni")
      run_panels(PANELS_INT8_DOT_VNNI, xqp, K4 * QUAD, wp, K4 * NR * QUAD, K4, yp, M, N, P, b, s, ip, group / QUAD,
                 ROW_INFO);
#endif
#ifdef DOMINOSPEC_INT8_DOT_AVX2
    if (int8_dot_choice == "avx2")
      run_panels(PANELS_INT8_DOT_AVX2, xqp, K4 * QUAD, wp, K4 * NR * QUAD, K4, yp, M, N, P, b, s, ip, group / QUAD,
                 ROW_INFO);
#endif
  } else if (dtype == at::kChar) {
    TORCH_CHECK(s != nullptr, "int8 panels need their scales");
    const int64_t groups = (K + group - 1) / group;
    auto xsum = torch::empty({M, groups}, x.options());  // [M, G]: each row's sum of x over each group
    float* xs = xsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)  // in k order, one row at a time: the same bits whatever M
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.0f;
        for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) sum += xp[m * K + k];
        xs[m * groups + g] = sum;
      }
    run_panels(PANELS_I8, xp, K, packed.data_ptr<int8_t>(), K * NR, K, yp, M, N, P, b, s, xs, group);
  } else {
    TORCH_CHECK(false, "packed weights of dtype ", dtype, " are not a kernel format");
  }
  return y;
}

torch::Tensor linear_silu_mul(const torch::Tensor& gate_up, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale,
                              int64_t group, int64_t N) {
  // gate_up [M, 2I] float32 contiguous -> linear(silu(gate) * up): the MLP's down projection, with the
  // activation computed here instead of in three tensor ops
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous(),
              "gate_up must be [M, 2I] float32");
  const int64_t I = gate_up.size(1) / 2;
  // ATen's vectorised silu, called from here: no Python dispatch, no chunk
  auto act = at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));  // [M, I] contiguous
  return linear(act, packed, bias, scale, group, N);
}

}  // namespace dominospec
