// The Domino head's rollout in one call (drafter_rollout.h).

#include "drafter_rollout.h"

#include <ATen/ATen.h>

namespace dominospec {

DominoRollout::DominoRollout(const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints,
                             int64_t hidden, int64_t g)
    : hidden_(hidden), g_(g) {
  TORCH_CHECK(tensors.size() == 11 && ints.size() == 6, "DominoRollout: 11 tensors and 6 ints");
  embedding_ = tensors[0];
  vocab_ = tensors[1];
  Projection* projections[3] = {&gates_, &w1_s_, &w2_};
  for (int p = 0; p < 3; ++p)
    *projections[p] = Projection{tensors[2 + 3 * p], tensors[3 + 3 * p], tensors[4 + 3 * p], ints[2 * p],
                                 ints[2 * p + 1]};
  TORCH_CHECK(embedding_.dim() == 2 && embedding_.size(1) == hidden_, "DominoRollout: the embedding must be [V, H]");
}

torch::Tensor DominoRollout::step(int64_t k, const torch::Tensor& prev, const torch::Tensor& base_k,
                                  const torch::Tensor& w1z, const torch::Tensor& xs) const {
  c10::InferenceMode guard;
  const int64_t H = hidden_, g = g_;
  TORCH_CHECK(xs.dim() == 2 && xs.size(1) == H + g && xs.is_contiguous(), "DominoRollout: xs must be [R, H + g]");
  xs.narrow(1, 0, H).copy_(at::embedding(embedding_, prev));
  auto pre = gates_(xs);  // [R, 4g]
  auto ru = at::sigmoid(pre.narrow(1, 0, 2 * g));
  auto n = at::addcmul(pre.narrow(1, 2 * g, g), ru.narrow(1, 0, g), pre.narrow(1, 3 * g, g)).tanh_();
  auto s = at::lerp(n, xs.narrow(1, H, g), ru.narrow(1, g, g));  // (1 - u) n + u s
  xs.narrow(1, H, g).copy_(s);
  if (k == 0) return base_k;  // slot 0 stays pure: the backbone already sees the anchor
  return w2_(at::silu(w1z.select(1, k) + w1_s_(s))).add_(base_k);
}

std::vector<torch::Tensor> DominoRollout::greedy(const torch::Tensor& base, const torch::Tensor& w1z,
                                                 const torch::Tensor& anchors, bool top) const {
  c10::InferenceMode guard;
  TORCH_CHECK(base.dim() == 3 && w1z.dim() == 3 && anchors.dim() == 1 && anchors.size(0) == base.size(0),
              "DominoRollout: base [R, b, V'], w1z [R, b, rank], anchors [R]");
  const int64_t R = base.size(0), b = base.size(1);
  auto drafts = at::empty({R, b}, anchors.options());
  auto tops = top ? at::empty({R, b}, base.options()) : at::empty({0}, base.options());
  auto xs = at::zeros({R, hidden_ + g_}, base.options());
  auto prev = anchors;
  for (int64_t k = 0; k < b; ++k) {
    auto logits = step(k, prev, base.select(1, k), w1z, xs);  // [R, V']
    if (top) tops.select(1, k).copy_(at::softmax(logits, -1).amax(-1));
    auto picks = logits.argmax(-1);
    prev = vocab_.numel() > 0 ? vocab_.index({picks}) : picks;
    drafts.select(1, k).copy_(prev);
  }
  return {drafts, tops};
}

}  // namespace dominospec
