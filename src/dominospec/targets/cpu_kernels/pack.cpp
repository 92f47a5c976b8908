// Packing W [N, K] into the panels of each weight format, once at load (kernels.PackedLinear).

#include "format_bf16_pairs.h"
#include "kernels.h"

namespace dominospec {
namespace {

torch::Tensor padded_columns(const torch::Tensor& weight) {
  // [N, K] -> [P * NR, K], zero rows appended
  const int64_t N = weight.size(0), P = (N + NR - 1) / NR;
  auto padded = torch::zeros({P * NR, weight.size(1)}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded;
}

void check_int8_values(const torch::Tensor& weight) {
  TORCH_CHECK(weight.min().item<float>() >= -128.0f && weight.max().item<float>() <= 127.0f &&
                  torch::equal(weight, weight.round()),
              "pack: int8 weights must be integers in -128..127");
}

}  // namespace

torch::Tensor pack(const torch::Tensor& weight, const std::string& format) {
  // [N, K] float32 -> panels [ceil(N / NR), K, NR] of float32, bfloat16 (rounded to nearest even) or
  // int8 (the values must already be integers in -128..127; the caller packs the scales and offsets);
  // "bfloat16_pairs" -> [ceil(N / NR), ceil(K / 2), NR, 2] bfloat16 for the dot-product kernel;
  // "int8_quads" (int8-dot, integers as for int8) -> [ceil(N / NR), ceil(K / 4), NR, 4] uint8 holding q + 128.
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
  if (format == "int8_quads") {  // int8-dot: [P, ceil(K / 4), NR, 4] uint8, q + 128 (padding: q = 0)
    check_int8_values(weight);
    const int64_t K4 = (K + 3) / 4;
    auto quads = torch::zeros({P * NR, 4 * K4}, weight.options());
    quads.narrow(1, 0, K).copy_(padded);
    return quads.add_(128.0).to(at::kByte).view({P, NR, K4, 4}).permute({0, 2, 1, 3}).contiguous();
  }
  auto panels = padded.view({P, NR, K}).transpose(1, 2);  // [P, K, NR]
  if (format == "float32") return panels.contiguous();
  if (format == "bfloat16") return panels.to(at::kBFloat16).contiguous();
  if (format == "int8") {
    check_int8_values(weight);
    return panels.to(at::kChar).contiguous();
  }
  TORCH_CHECK(false, "pack: unknown weight format ", format);
  return panels;
}

}  // namespace dominospec
