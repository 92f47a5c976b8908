// Every decoder layer of a decode- or verify-sized forward in one call.
//
// The Python loop over layers pays ~15 tensor ops per layer in dispatch, temporaries and views; for the
// few rows of a decode step that glue cost about as much as streaming the int8 weights. Here a layer is
// the same steps on the same kernels (norm, fused q/k/v, q/k norms where the model has them, RoPE, the
// cache write, attention one query at a time, o, residual, norm, gate/up, SiLU-mul down, residual) with
// the glue in plain loops. Each step is per row in a fixed order (the norm's sum of squares in VW lanes,
// then the lanes in order), so a row's bits still do not depend on its batch.
#pragma once

#include "kernels.h"

#include <vector>

namespace dominospec {

struct Projection {  // one PackedLinear: panels, bias and int8 scales (empty when absent), group, out columns
  torch::Tensor panels, bias, scale;
  int64_t group, n;
  torch::Tensor operator()(const torch::Tensor& x) const;
  torch::Tensor after_silu_mul(const torch::Tensor& gate_up) const;
};

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
                                 const std::vector<int64_t>& keep) const;

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm, qk_norm;
    Projection proj[4];  // qkv, o, gate_up, down
  };

  // heads first..first + Hkv of src [B, S, src_heads, D] -> cache [B, Hkv, L, D] at starts[b] + j
  void write_cache(const float* src, int64_t src_heads, int64_t first, const torch::Tensor& cache, int64_t B,
                   int64_t S, const int64_t* starts) const;

  std::vector<Layer> layers_;
  int64_t hq_, hkv_, d_;
  float eps_;
  double scale_;
};

}  // namespace dominospec
