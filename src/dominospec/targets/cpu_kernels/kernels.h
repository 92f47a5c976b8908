// The functions one kernel file offers another (linear.cpp, pack.cpp, attention.cpp, decoder_layers.cpp);
// module.cpp binds them for Python and states the contract.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace dominospec {

int64_t panel_width();
bool has_bf16_dot();
std::vector<std::string> int8_dot_paths();
void set_int8_dot_path(const std::string& path);
std::string int8_dot_path();
torch::Tensor pack(const torch::Tensor& weight, const std::string& format);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& scale, int64_t group, int64_t N);
torch::Tensor linear_silu_mul(const torch::Tensor& gate_up, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale,
                              int64_t group, int64_t N);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& starts, double scale);

}  // namespace dominospec
