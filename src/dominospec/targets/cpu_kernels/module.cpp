// The Python binding of the CPU kernels (kernels.py builds this directory into one extension per source hash,
// CPU flags and torch version, and PackedLinear / native.py / drafter/fast.py call it).
//
// The contract, stated once for both sides:
//   pack(W [N, K] float32, format) -> panels. format "float32" | "bfloat16" -> [P, K, NR] of that dtype;
//     "int8" -> [P, K, NR] int8 (W must hold integers -128..127; scales packed separately as float32 panels);
//     "bfloat16_pairs" -> [P, ceil(K / 2), NR, 2] bfloat16. P = ceil(N / NR), NR = panel_width(); padded
//     columns are zero.
//   linear(x [M, K] float32 contiguous, panels, bias [N] | None, scale | None, group, N) -> y [M, N] float32:
//     y = x @ W^T + b. int8 panels need scale [P, ceil(K / group), 2, NR] float32 (per padded column and group
//     of `group` k: its scale, then its offset; W = scale * q + offset). A row's result never depends on the
//     other rows of the call (decode = verify = engine batch, bit for bit).
//   linear_silu_mul(gate_up [M, 2I], ...) = linear(silu(gate) * up, ...), the same arguments after the first.
//   rope(x [B, S, >= heads, D], cos, sin [1 or B, S, D] (rotate_half's sign folded into sin), heads) ->
//     [B, S, heads, D]; attend(q [B, S, Hq, D], k, v [B, Hkv, L, D] caches, starts [B] int64, scale) ->
//     [B, S, Hq, D], query j of row b reading keys 0..starts[b] + j, each query alone in a fixed order.
//   DecoderLayers(tensors, ints, hq, hkv, d, eps, scale).run(x, k_cache, v_cache, cos, sin, starts, keep):
//     every layer of a decode- or verify-sized forward in one call (decoder_layers.h says the layout).
//   DominoRollout(tensors, ints, hidden, g).step(k, prev, base_k, w1z, xs) / .greedy(base, w1z, anchors, top):
//     the drafter's Domino head, one slot or a whole greedy block (drafter_rollout.h says the layout).
//     "int8_quads" (int8-dot) -> [P, ceil(K / 4), NR, 4] uint8 holding q + 128; linear() then quantises each row of
//     x in blocks of `group` k and sums int8 x int8 products in int32 (format_int8_dot.h), scale as for int8.
//   q4-dot: panels [P, K / 32, 4, NR, 4] uint8 (two 4-bit weights a byte, packed in Python: kernels.pack_q4) with
//     scale [P, K / 32, 2, NR] float16; linear() quantises x's rows as for int8-dot (format_q4_dot.h).
//   has_bf16_dot(): whether this build has "bfloat16_pairs" (AVX512-BF16). int8_dot_paths(): the instruction
//     paths this build has for int8-dot, best first ("avx512-vnni", "avx2"; none: int8-dot is refused);
//     set_int8_dot_path(name) / int8_dot_path(): the one linear() uses (process-wide; tests force "avx2").

#include <torch/extension.h>
#include <pybind11/stl.h>

#include "decoder_layers.h"
#include "drafter_rollout.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace dominospec;
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("linear_silu_mul", &linear_silu_mul);
  m.def("rope", &rope);
  m.def("attend", &attend);
  m.def("panel_width", &panel_width);
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("int8_dot_paths", &int8_dot_paths);
  m.def("set_int8_dot_path", &set_int8_dot_path);
  m.def("int8_dot_path", &int8_dot_path);
  py::class_<DecoderLayers>(m, "DecoderLayers", py::module_local())  // builds of other sources may share a process
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t, double, double>())
      .def("run", &DecoderLayers::run, py::call_guard<py::gil_scoped_release>());  // a server's threads run meanwhile
  py::class_<DominoRollout>(m, "DominoRollout", py::module_local())
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t>())
      .def("step", &DominoRollout::step, py::call_guard<py::gil_scoped_release>())
      .def("greedy", &DominoRollout::greedy, py::call_guard<py::gil_scoped_release>());
}
