// y = x @ W^T (+ b) for a few rows of x (decode and verify), streaming each weight once for all rows.
//
// W [N, K] is packed once into panels of NR output columns: packed[p][k][j] = W[p*NR + j][k]
// (zero rows pad N up to a multiple of NR). For one panel, the kernel keeps R rows x NR columns of
// accumulators in vector registers and walks k once: each weight vector it loads feeds R FMAs, so
// the weights cross the memory bus once whatever R is. Rows beyond the register budget (MR) are
// done in further groups while the panel is still in L2.
//
// Every output element is accumulated in the same order (k = 0, 1, ..., one FMA per k) whatever
// the number of rows, the row group or the thread: a row's result does not depend on its batch.
//
// Built by dominospec.targets.kernels with -O3 -march=native; the vector width follows the ISA.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector (zmm)
constexpr int MR = 12;  // rows per group: 12 x 2 accumulators + 2 weight vectors of 32 registers
#elif defined(__AVX__)
constexpr int VW = 8;  // ymm
constexpr int MR = 6;  // 12 accumulators + 2 weight vectors of 16 registers
#else
constexpr int VW = 4;  // SSE / NEON
constexpr int MR = 4;
#endif
constexpr int NV = 2;  // vectors per panel row
constexpr int NR = VW * NV;  // panel width (output columns)
constexpr int PREFETCH = 8;  // panel rows ahead (NR floats each)
constexpr int64_t CHUNK = 64;  // rows per work item

typedef float vf __attribute__((vector_size(VW * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

template <int R>
void panel(const float* __restrict x, int64_t ldx, const float* __restrict wp, int64_t K, float* __restrict y,
           int64_t ldy, int64_t ncols, const float* __restrict bias) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = wp + k * NR;
    __builtin_prefetch(wk + PREFETCH * NR);
    __builtin_prefetch(wk + PREFETCH * NR + 16);
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load(wk + v * VW);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += w[v] * xs;  // contracted to one FMA
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[NR];
    std::memcpy(out, acc[r], sizeof(out));
    float* yr = y + r * ldy;
    if (bias != nullptr)
      for (int64_t j = 0; j < ncols; ++j) yr[j] = out[j] + bias[j];
    else
      std::memcpy(yr, out, ncols * sizeof(float));
  }
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);

template <int... Rs>
constexpr auto make_table(std::integer_sequence<int, Rs...>) {
  return std::array<PanelFn, sizeof...(Rs)>{&panel<Rs + 1>...};
}
const auto PANELS = make_table(std::make_integer_sequence<int, MR>{});

}  // namespace

int64_t panel_width() { return NR; }

int64_t max_rows_per_group() { return MR; }

torch::Tensor pack(const torch::Tensor& weight) {
  // [N, K] -> [ceil(N / NR), K, NR]
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: weight must be a 2-D float32 tensor");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  auto padded = torch::zeros({P * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t N) {
  // x [M, K] float32 contiguous; packed [P, K, NR] from pack(); bias [N] or None -> [M, N]
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.size(1) == x.size(1), "packed weight mismatch");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the packed panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bad bias");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work items: (panel, chunk of at most CHUNK rows), consecutive items sharing a panel, so
  // prefill's many rows spread over threads too; each chunk is split into balanced row groups.
  const int64_t chunks = (M + CHUNK - 1) / CHUNK;
  at::parallel_for(0, P * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / chunks, c = i % chunks;
      const int64_t col = p * NR, ncols = std::min<int64_t>(NR, N - col);
      const float* w = wp + p * K * NR;
      const int64_t first = c * CHUNK, rows_here = std::min<int64_t>(CHUNK, M - first);
      const int64_t groups = (rows_here + MR - 1) / MR;
      int64_t m0 = first;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = (first + rows_here - m0) / (groups - g);
        PANELS[rows - 1](xp + m0 * K, K, w, K, yp + m0 * N + col, N, ncols, b ? b + col : nullptr);
        m0 += rows;
      }
    }
  });
  return y;
}

torch::Tensor linear_silu_mul(const torch::Tensor& gate_up, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t N) {
  // gate_up [M, 2I] float32 contiguous -> linear(silu(gate) * up): the MLP's down projection, with the
  // activation computed here instead of in three tensor ops
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous(),
              "gate_up must be [M, 2I] float32");
  const int64_t I = gate_up.size(1) / 2;
  // ATen's vectorised silu, called from here: no Python dispatch, no chunk
  auto act = at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));  // [M, I] contiguous
  return linear(act, packed, bias, N);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_silu_mul", &linear_silu_mul);
  m.def("rope", &rope);
  m.def("panel_width", &panel_width);
  m.def("max_rows_per_group", &max_rows_per_group);
  m.def("pack", &pack);
  m.def("linear", &linear);
}
