// The Domino head's left-to-right rollout over a draft block in one call (drafter/fast.py's DominoSteps).
//
// Per slot the head is a GRU cell over the realised token's embedding, a low-rank correction of the slot's base
// logits and a pick: ~15 tensor ops and three small linears. From Python every slot paid the interpreter and
// the dispatch of each op; here the same ops run in the same order on the same kernels (ATen's elementwise
// kernels, this extension's linear), so the drafts, the logits and the top probabilities are the bits the
// Python loop gave, and a greedy block is one call.
#pragma once

#include "decoder_layers.h"

#include <vector>

namespace dominospec {

class DominoRollout {
 public:
  // tensors: the target's embedding table [V, H], the draft vocabulary [V'] int64 (empty: the full vocabulary),
  // then gates ([x ; s] -> [r_i + r_h, z_i + z_h, n_i, n_h]), w1_s and w2 as panels, bias, scale each; ints:
  // group and out columns of those three. hidden H, g the GRU width.
  DominoRollout(const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t hidden,
                int64_t g);

  // One slot k for R rows: xs [R, H + g] float32 ([x ; s], s updated in place), prev [R] target ids (the token
  // before the slot), base_k [R, V'], w1z [R, b, rank] (w1_z of every slot) -> the slot's logits [R, V'].
  torch::Tensor step(int64_t k, const torch::Tensor& prev, const torch::Tensor& base_k, const torch::Tensor& w1z,
                     const torch::Tensor& xs) const;

  // Every slot, greedy: base [R, b, V'], w1z [R, b, rank], anchors [R] -> {drafts [R, b] target ids, and with
  // `top` each slot's largest probability [R, b]}.
  std::vector<torch::Tensor> greedy(const torch::Tensor& base, const torch::Tensor& w1z, const torch::Tensor& anchors,
                                    bool top) const;

 private:
  torch::Tensor embedding_, vocab_;
  Projection gates_, w1_s_, w2_;
  int64_t hidden_, g_;
};

}  // namespace dominospec
