// Every decoder layer of a decode- or verify-sized forward in one call (native.py's fused path).

#include "decoder_layers.h"

#include "simd.h"

#include <algorithm>
#include <cmath>

namespace dominospec {
namespace {

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

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

}  // namespace

torch::Tensor Projection::operator()(const torch::Tensor& x) const {
  return linear(x, panels, present(bias), present(scale), group, n);
}

torch::Tensor Projection::after_silu_mul(const torch::Tensor& gate_up) const {
  return linear_silu_mul(gate_up, panels, present(bias), present(scale), group, n);
}

std::vector<torch::Tensor> DecoderLayers::run(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
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

void DecoderLayers::write_cache(const float* src, int64_t src_heads, int64_t first, const torch::Tensor& cache, int64_t B,
                 int64_t S, const int64_t* starts) const {
  TORCH_CHECK(cache.is_contiguous(), "the cache layer must be contiguous");
  float* c = cache.data_ptr<float>();
  const int64_t L = cache.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t g = 0; g < hkv_; ++g)
        std::memcpy(c + ((b * hkv_ + g) * L + starts[b] + j) * d_, src + ((b * S + j) * src_heads + first + g) * d_,
                    d_ * sizeof(float));
}

}  // namespace dominospec
