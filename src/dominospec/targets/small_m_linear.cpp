// y = x @ W^T (+ b) for a few rows of x (decode and verify), streaming each weight once for all rows.
//
// W [N, K] is packed once into panels of NR output columns: packed[p][k][j] = W[p*NR + j][k]
// (zero rows pad N up to a multiple of NR). For one panel, the kernel keeps R rows x NR columns of
// accumulators in vector registers and walks k once: each weight vector it loads feeds R FMAs, so
// the weights cross the memory bus once whatever R is. Rows beyond the register budget (MR) are
// done in further groups while the panel is still in L2.
//
// Weight formats (the packed tensor's dtype says which): float32; bfloat16 (half the bytes, widened
// to fp32 in registers by a 16-bit shift: exact); int8 with an fp32 scale s and offset o per output
// column and group of G consecutive k, w = s * q + o (under a third of the bytes: each group's sum of
// exact int8 x fp32 products is kept apart, and when the group ends the total takes
// s * sum(q x) + o * sum(x), the row's sum of x over the group computed once per call).
// Activations and accumulation are fp32 in all three. Optionally, where the CPU has AVX512-BF16,
// bfloat16 weights packed in k-pairs run on the native bf16 dot product (vdpbf16ps), which also
// rounds the activations to bf16 (per row, the same whatever the batch).
//
// Every output element is accumulated in the same order (k = 0, 1, ..., one FMA per k; k-pairs for
// the dot product) whatever the number of rows, the row group or the thread: a row's result does
// not depend on its batch.
//
// Built by dominospec.targets.kernels with -O3 -march=native; the vector width follows the ISA.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DOMINOSPEC_BF16_DOT 1
#endif

#include <algorithm>
#include <cmath>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

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

// Panels walked at once by a group of R rows where NPMAX allows: 8 accumulators for one or two rows
// (int8, whose two rows ran slower on two panels: one row only)
constexpr int panels_for(int R, bool i8) { return std::min(NPMAX, R == 1 ? 4 : R == 2 && !i8 ? 2 : 1); }
constexpr int PREFETCH = 8;  // panel rows ahead
constexpr int64_t CHUNK = 64;  // rows per work item

// How far ahead a panel is prefetched: PREFETCH rows, and on AVX2 at least PREFETCH_BYTES (an int8 row
// of 16 bytes is a quarter of a cache line: 8 rows ahead was two lines)
constexpr int PREFETCH_BYTES = NPMAX > 1 ? 512 : 0;
template <typename T>
constexpr int64_t ahead() { return std::max<int64_t>(PREFETCH, PREFETCH_BYTES / (NR * sizeof(T))) * NR; }

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef int8_t vb __attribute__((vector_size(VW * sizeof(int8_t))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

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

inline void prefetch_row(const void* row, int bytes) {
  const char* c = static_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

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

// One row group through NP adjacent panels: (x rows, ldx, first panel, elements from one panel to the
// next, K, y, ldy, ncols, bias, and for int8: the first panel's scales and offsets, floats from one
// panel's to the next, the rows' group sums of x, the group size)
template <typename X, typename T>
using PanelFn = void (*)(const X*, int64_t, const T*, int64_t, int64_t, float*, int64_t, int64_t, const float*,
                         const float*, int64_t, const float*, int64_t);

// table[np - 1][R - 1]; np is at most panels_for(R) (a wider entry is never called, so it repeats np = 1)
template <int NT, typename X, typename T, template <int, int> class Kernel, int NP, int... Rs>
constexpr std::array<PanelFn<X, T>, NT> table_row(std::integer_sequence<int, Rs...>) {
  constexpr bool i8 = std::is_same_v<T, int8_t>;
  return {{Kernel<Rs + 1, (NP <= panels_for(Rs + 1, i8) ? NP : 1)>::run...}};
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

// Work items: (block of adjacent panels, chunk of at most CHUNK rows), consecutive items sharing a block,
// so prefill's many rows spread over threads too; each chunk is split into balanced row groups of at
// most NT rows, and each group walks its block np panels at a time (panels_for, fewer where the threads
// would otherwise go short of blocks). The row grouping and np change which rows and columns share
// registers, never the order of any output element's sum.
template <typename X, typename T, size_t NT>
void run_panels(const std::array<std::array<PanelFn<X, T>, NT>, NPMAX>& panels, const X* xp, int64_t ldx,
                const T* wp, int64_t panel_elems, int64_t Kp, float* yp, int64_t M, int64_t N, int64_t P,
                const float* b, const float* so = nullptr, const float* xsum = nullptr, int64_t group = 0) {
  const int64_t groups = group > 0 ? (Kp + group - 1) / group : 0;
  const int64_t sstride = groups * 2 * NR;
  const int64_t chunks = (M + CHUNK - 1) / CHUNK;
  const int64_t first_rows = std::min<int64_t>(CHUNK, M), first_groups = (first_rows + NT - 1) / NT;
  const int64_t widest = (first_rows + first_groups - 1) / first_groups;  // rows of the first chunk's widest group
  const int64_t per_thread = std::max<int64_t>(1, P / std::max<int64_t>(1, at::get_num_threads()));
  constexpr bool i8 = std::is_same_v<T, int8_t>;
  const int64_t block = std::min<int64_t>(panels_for(static_cast<int>(widest), i8), per_thread);
  const int64_t blocks = (P + block - 1) / block;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p_first = (i / chunks) * block, p_end = std::min(P, p_first + block), c = i % chunks;
      const int64_t first = c * CHUNK, rows_here = std::min<int64_t>(CHUNK, M - first);
      const int64_t row_groups = (rows_here + NT - 1) / NT;
      int64_t m0 = first;
      for (int64_t g = 0; g < row_groups; ++g) {
        const int64_t rows = (first + rows_here - m0) / (row_groups - g);
        const int64_t step = std::min<int64_t>(panels_for(static_cast<int>(rows), i8), block);
        for (int64_t p = p_first; p < p_end; p += step) {
          const int64_t np = std::min(step, p_end - p);
          const int64_t col = p * NR, ncols = std::min<int64_t>(np * NR, N - col);
          panels[np - 1][rows - 1](xp + m0 * ldx, ldx, wp + p * panel_elems, panel_elems, Kp, yp + m0 * N + col, N,
                                   ncols, b ? b + col : nullptr, so ? so + p * sstride : nullptr, sstride,
                                   xsum ? xsum + m0 * groups : nullptr, group);
        }
        m0 += rows;
      }
    }
  });
}

torch::Tensor padded_columns(const torch::Tensor& weight) {
  // [N, K] -> [P * NR, K], zero rows appended
  const int64_t N = weight.size(0), P = (N + NR - 1) / NR;
  auto padded = torch::zeros({P * NR, weight.size(1)}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded;
}

}  // namespace

int64_t panel_width() { return NR; }

int64_t max_rows_per_group() { return MR; }

bool has_bf16_dot() {
#ifdef DOMINOSPEC_BF16_DOT
  return true;
#else
  return false;
#endif
}

torch::Tensor pack(const torch::Tensor& weight, const std::string& format) {
  // [N, K] float32 -> panels [ceil(N / NR), K, NR] of float32, bfloat16 (rounded to nearest even) or
  // int8 (the values must already be integers in -128..127; the caller packs the scales and offsets);
  // "bfloat16_pairs" -> [ceil(N / NR), ceil(K / 2), NR, 2] bfloat16 for the dot-product kernel.
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: weight must be a 2-D float32 tensor");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  auto padded = padded_columns(weight);  // [P * NR, K]
  if (format == "bfloat16_pairs") {
    const int64_t K2 = (K + 1) / 2;
    auto even = torch::zeros({P * NR, 2 * K2}, weight.options());
    even.narrow(1, 0, K).copy_(padded);
    // [P, NR, K2, 2] -> [P, K2, NR, 2]
    return even.to(at::kBFloat16).view({P, NR, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  auto panels = padded.view({P, NR, K}).transpose(1, 2);  // [P, K, NR]
  if (format == "float32") return panels.contiguous();
  if (format == "bfloat16") return panels.to(at::kBFloat16).contiguous();
  if (format == "int8") {
    TORCH_CHECK(weight.min().item<float>() >= -128.0f && weight.max().item<float>() <= 127.0f &&
                    torch::equal(weight, weight.round()),
                "pack: int8 weights must be integers in -128..127");
    return panels.to(at::kChar).contiguous();
  }
  TORCH_CHECK(false, "pack: unknown weight format ", format);
  return panels;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scale, int64_t group, int64_t N) {
  // x [M, K] float32 contiguous; packed from pack(); bias [N] or None; int8 only: scale
  // [P, ceil(K / group), 2, NR] float32 (per padded column and group of `group` k: scale, then offset) -> [M, N]
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  const bool pairs = packed.dim() == 4;
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(2) == NR && packed.is_contiguous(), "packed weight mismatch");
  TORCH_CHECK(pairs ? (packed.size(1) == (K + 1) / 2 && packed.size(3) == 2) : (packed.dim() == 3 && packed.size(1) == K),
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

// ---- Every decoder layer of a decode- or verify-sized forward in one call ----
//
// The Python loop over layers pays ~15 tensor ops per layer in dispatch, temporaries and views; for the
// few rows of a decode step that glue cost about as much as streaming the int8 weights. Here a layer is
// the same steps on the same kernels (norm, fused q/k/v, q/k norms where the model has them, RoPE, the
// cache write, attention one query at a time, o, residual, norm, gate/up, SiLU-mul down, residual) with
// the glue in plain loops. Each step is per row in a fixed order (the norm's sum of squares in VW lanes,
// then the lanes in order), so a row's bits still do not depend on its batch.

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

struct Projection {  // one PackedLinear: panels, bias and int8 scales (empty when absent), group, out columns
  torch::Tensor panels, bias, scale;
  int64_t group, n;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return linear(x, panels, present(bias), present(scale), group, n);
  }
  torch::Tensor after_silu_mul(const torch::Tensor& gate_up) const {
    return linear_silu_mul(gate_up, panels, present(bias), present(scale), group, n);
  }
};

void rms_norm_rows(const float* __restrict x, int64_t rows, int64_t width, int64_t ldx, const float* __restrict w,
                   int64_t ldw, float eps, float* __restrict y, int64_t ldy) {
  // y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w[r or 0]; ldw 0: one weight row for all
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    vf lanes = {};
    int64_t i = 0;
    for (; i + VW <= width; i += VW) {
      vf v;
      std::memcpy(&v, xr + i, sizeof(vf));
      lanes += v * v;
    }
    float sum = 0.0f;
    for (int l = 0; l < VW; ++l) sum += lanes[l];
    for (; i < width; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    const float* wr = w + r * ldw;
    float* yr = y + r * ldy;
    for (int64_t j = 0; j < width; ++j) yr[j] = xr[j] * inv * wr[j];
  }
}

class DecoderLayers {
 public:
  // Per layer, in order: tensors (input norm, post-attention norm, q/k norm weights [Hq + Hkv, D] or
  // empty, then qkv, o, gate_up, down as panels, bias, scale each) and ints (group, out columns of the
  // four projections).
  DecoderLayers(const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t hq, int64_t hkv,
                int64_t d, double eps, double scale)
      : hq_(hq), hkv_(hkv), d_(d), eps_(static_cast<float>(eps)), scale_(scale) {
    TORCH_CHECK(tensors.size() % 15 == 0 && ints.size() * 15 == tensors.size() * 8, "DecoderLayers: 15 tensors and 8 ints per layer");
    for (size_t i = 0, j = 0; i < tensors.size(); i += 15, j += 8) {
      Layer layer{tensors[i], tensors[i + 1], tensors[i + 2], {}};
      for (int p = 0; p < 4; ++p)
        layer.proj[p] = Projection{tensors[i + 3 + 3 * p], tensors[i + 4 + 3 * p], tensors[i + 5 + 3 * p],
                                   ints[j + 2 * p], ints[j + 2 * p + 1]};
      layers_.push_back(layer);
    }
  }

  // x [B, S, H] float32 contiguous (the embedded tokens); k_cache, v_cache [layers, B, Hkv, L, D] (a rows view
  // of the cache is fine); cos, sin [1 or B, S, D] (the sign of rotate_half in sin); starts [B] int64, where
  // each row's first new token goes. Returns [x after the last layer, x after each layer in `keep`].
  std::vector<torch::Tensor> run(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& starts,
                                 const std::vector<int64_t>& keep) const {
    TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [B, S, H] float32");
    const int64_t B = x.size(0), S = x.size(1), H = x.size(2), M = B * S, heads = hq_ + 2 * hkv_;
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == static_cast<int64_t>(layers_.size()) && k_cache.size(1) == B &&
                    k_cache.size(2) == hkv_ && k_cache.size(4) == d_ && k_cache.sizes() == v_cache.sizes(),
                "DecoderLayers: the caches do not match the model");
    auto st = starts.to(at::kLong).contiguous();
    TORCH_CHECK(st.numel() == B, "starts must be [B]");
    const int64_t* sp = st.data_ptr<int64_t>();
    const int64_t L = k_cache.size(3);
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] + S <= L, "row ", b, " writes past the cache");
    std::vector<torch::Tensor> out(1);
    auto normed = torch::empty({M, H}, x.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      rms_norm_rows(x.data_ptr<float>(), M, H, H, layer.input_norm.data_ptr<float>(), 0, eps_,
                    normed.data_ptr<float>(), H);
      auto qkv = layer.proj[0](normed);  // [M, heads * D]: heads q | k | v
      if (layer.qk_norm.numel() > 0) {  // q and k heads normed over D in place (v untouched)
        float* p = qkv.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
          rms_norm_rows(p + m * heads * d_, hq_ + hkv_, d_, d_, layer.qk_norm.data_ptr<float>(), d_, eps_,
                        p + m * heads * d_, d_);
      }
      auto qkv4 = qkv.view({B, S, heads, d_});
      auto qk = rope(qkv4, cos, sin, hq_ + hkv_);  // [B, S, hq + hkv, D]
      auto kc = k_cache.select(0, i), vc = v_cache.select(0, i);  // [B, Hkv, L, D]
      write_cache(qk.data_ptr<float>(), hq_ + hkv_, hq_, kc, B, S, sp);
      write_cache(qkv.data_ptr<float>(), heads, hq_ + hkv_, vc, B, S, sp);
      auto attn = attend(qk.narrow(2, 0, hq_), kc, vc, st, scale_);  // [B, S, Hq, D]
      auto h = layer.proj[1](attn.view({M, hq_ * d_})).add_(x.view({M, H}));  // x + o(attn)
      rms_norm_rows(h.data_ptr<float>(), M, H, H, layer.post_norm.data_ptr<float>(), 0, eps_,
                    normed.data_ptr<float>(), H);
      auto next = layer.proj[3].after_silu_mul(layer.proj[2](normed)).add_(h);  // h + down(silu(gate) * up)
      x = next.view({B, S, H});  // a new tensor each layer: a kept feature is never written again
      if (std::find(keep.begin(), keep.end(), static_cast<int64_t>(i)) != keep.end()) out.push_back(x);
    }
    out[0] = x;
    return out;
  }

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm, qk_norm;
    Projection proj[4];  // qkv, o, gate_up, down
  };

  void write_cache(const float* src, int64_t src_heads, int64_t first, const torch::Tensor& cache, int64_t B,
                   int64_t S, const int64_t* starts) const {
    // heads first..first + Hkv of src [B, S, src_heads, D] -> cache [B, Hkv, L, D] at starts[b] + j
    TORCH_CHECK(cache.is_contiguous(), "the cache layer must be contiguous");
    float* c = cache.data_ptr<float>();
    const int64_t L = cache.size(2);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < S; ++j)
        for (int64_t g = 0; g < hkv_; ++g)
          std::memcpy(c + ((b * hkv_ + g) * L + starts[b] + j) * d_, src + ((b * S + j) * src_heads + first + g) * d_,
                      d_ * sizeof(float));
  }

  std::vector<Layer> layers_;
  int64_t hq_, hkv_, d_;
  float eps_;
  double scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend);
  m.def("linear_silu_mul", &linear_silu_mul);
  m.def("rope", &rope);
  m.def("panel_width", &panel_width);
  m.def("max_rows_per_group", &max_rows_per_group);
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("pack", &pack);
  m.def("linear", &linear);
  py::class_<DecoderLayers>(m, "DecoderLayers", py::module_local())  // builds of other sources may share a process
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t, double, double>())
      .def("run", &DecoderLayers::run, py::call_guard<py::gil_scoped_release>());  // a server's threads run meanwhile
}
