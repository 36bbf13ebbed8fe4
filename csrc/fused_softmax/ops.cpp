// Schemas of the fused scaled-masked softmax ops. One forward covers the three
// variants (no mask, padding mask, causal); one backward covers them all too,
// because it only needs the saved output: y is already zero wherever the
// forward masked, so dx = scale * y * (dy - sum(dy * y)) is zero there as well.
//
// Semantics shared by every implementation (CPU, CUDA, and the Python fallback):
//   input [..., sq, sk]; y = softmax over the last dim of scale * input, where
//   masked positions are excluded (they get probability 0);
//   mask (padding) is bool [b or 1, np or 1, sq or 1, sk], True = masked,
//   for a 4-D input [b, np, sq, sk];
//   causal masks key j > query i and needs sq == sk;
//   a row whose every position is masked is all zeros, forward and backward.
//
// Attention sinks (softmax_type off-by-one / learnable): the sink forward takes
// sinks float32 [np], one logit per head that joins each row's max and sum, so
// y_j = exp(scale x_j) / (exp(sink) + sum_k exp(scale x_k)); it also returns
// each row's sink probability, float32 [rows] (1 on a fully masked row). The
// scores' gradient is the same formula (the sink column's dy is 0), so the
// row-dot backward is the plain backward that also returns each row's
// sum(dy * y), float32 [rows]: the sink's gradient is -sink_prob * that, summed
// over the head's rows.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(megatron_lite, m) {
  m.def("scaled_masked_softmax_forward(Tensor input, Tensor? mask, float scale, bool causal) -> Tensor");
  m.def("scaled_masked_softmax_backward(Tensor grad_output, Tensor output, float scale, bool causal) -> Tensor");
  m.def("scaled_masked_softmax_sink_forward(Tensor input, Tensor? mask, Tensor sinks, float scale, bool causal) "
        "-> (Tensor, Tensor)");
  m.def("scaled_masked_softmax_row_dot_backward(Tensor grad_output, Tensor output, float scale, bool causal) "
        "-> (Tensor, Tensor)");
}
