// CPU implementation of the fused scaled-masked softmax: rows in parallel
// (at::parallel_for), each row in float with the vectorised loops of
// row_math_cpu. The causal variant touches only the first i + 1 keys of query
// row i and writes zeros over the rest.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "fused_softmax/layout.h"
#include "fused_softmax/row_math_cpu.h"

namespace megatron_lite::fused_softmax::cpu {
namespace {

// Rows per task: enough elements that a task outweighs its scheduling.
int64_t grain_rows(int64_t sk) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1)); }

// Runs fn(row) for every row. Causal rows grow in cost with the query index, so
// a task takes query i together with query sq-1-i of the same batch-head: every
// pair costs the same, and contiguous chunks of pairs balance across threads.
template <typename Fn>
void for_each_row(const Layout& layout, bool causal, const Fn& fn) {
  if (!causal) {
    at::parallel_for(0, layout.rows, grain_rows(layout.sk), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) fn(row);
    });
    return;
  }
  const int64_t pairs_per_head = (layout.sq + 1) / 2;
  const int64_t heads = layout.rows / layout.sq;
  at::parallel_for(0, heads * pairs_per_head, std::max<int64_t>(1, grain_rows(layout.sk) / 2),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t pair = begin; pair < end; ++pair) {
                       const int64_t first_row = (pair / pairs_per_head) * layout.sq;
                       const int64_t query = pair % pairs_per_head;
                       fn(first_row + query);
                       if (layout.sq - 1 - query != query) fn(first_row + layout.sq - 1 - query);
                     }
                   });
}

// Softmax of one float row: the first `n` of `sk` positions take part, the rest are zeros.
void forward_row(const float* x, const bool* mask, float* y, int64_t n, int64_t sk, float scale) {
  const float max = scaled_max(x, mask, n, scale);
  if (max == -std::numeric_limits<float>::infinity()) {
    std::fill(y, y + sk, 0.0f);  // every position masked: documented to give zeros
    return;
  }
  const float sum = scaled_exp_sum(x, mask, y, n, scale, max);
  multiply(y, n, 1.0f / sum);
  std::fill(y + n, y + sk, 0.0f);
}

void backward_row(const float* dy, const float* y, float* dx, int64_t n, int64_t sk, float scale) {
  softmax_grad(dy, y, dx, n, scale, dot(dy, y, n));
  std::fill(dx + n, dx + sk, 0.0f);
}

template <typename scalar_t>
void forward(const at::Tensor& input, const bool* mask, const Layout& layout, bool causal, float scale,
             at::Tensor& output) {
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  scalar_t* y = output.mutable_data_ptr<scalar_t>();
  const int64_t sk = layout.sk;
  for_each_row(layout, causal, [&](int64_t row) {
    const bool* mask_row = mask == nullptr ? nullptr : mask + mask_offset(layout, row);
    const int64_t n = causal ? row % layout.sq + 1 : sk;
    if constexpr (std::is_same_v<scalar_t, float>) {
      forward_row(x + row * sk, mask_row, y + row * sk, n, sk, scale);
    } else {
      thread_local std::vector<float> buffer;
      buffer.resize(2 * sk);
      widen(x + row * sk, buffer.data(), n);
      forward_row(buffer.data(), mask_row, buffer.data() + sk, n, sk, scale);
      narrow(buffer.data() + sk, y + row * sk, sk);
    }
  });
}

template <typename scalar_t>
void backward(const at::Tensor& grad_output, const at::Tensor& output, const Layout& layout, bool causal,
              float scale, at::Tensor& grad_input) {
  const scalar_t* dy = grad_output.const_data_ptr<scalar_t>();
  const scalar_t* y = output.const_data_ptr<scalar_t>();
  scalar_t* dx = grad_input.mutable_data_ptr<scalar_t>();
  const int64_t sk = layout.sk;
  for_each_row(layout, causal, [&](int64_t row) {
    const int64_t n = causal ? row % layout.sq + 1 : sk;
    const int64_t start = row * sk;
    if constexpr (std::is_same_v<scalar_t, float>) {
      backward_row(dy + start, y + start, dx + start, n, sk, scale);
    } else {
      thread_local std::vector<float> buffer;
      buffer.resize(3 * sk);
      widen(dy + start, buffer.data(), n);
      widen(y + start, buffer.data() + sk, n);
      backward_row(buffer.data(), buffer.data() + sk, buffer.data() + 2 * sk, n, sk, scale);
      narrow(buffer.data() + 2 * sk, dx + start, sk);
    }
  });
}

at::Tensor forward_op(const at::Tensor& input_, const c10::optional<at::Tensor>& mask_, double scale, bool causal) {
  const at::Tensor input = input_.contiguous();
  c10::optional<at::Tensor> mask = mask_;
  if (mask.has_value() && mask->dim() == 4 && mask->size(3) > 1 && mask->stride(3) != 1) mask = mask->contiguous();
  const Layout layout = make_layout(input, mask, causal);
  at::Tensor output = at::empty_like(input);
  if (input.numel() == 0) return output;
  const bool* mask_data = mask.has_value() ? mask->const_data_ptr<bool>() : nullptr;
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(input.scalar_type(), "scaled_masked_softmax_forward",
                                       [&] { forward<scalar_t>(input, mask_data, layout, causal, scale, output); });
  return output;
}

at::Tensor backward_op(const at::Tensor& grad_output_, const at::Tensor& output_, double scale, bool causal) {
  check_backward(grad_output_, output_, causal);
  const at::Tensor grad_output = grad_output_.contiguous();
  const at::Tensor output = output_.contiguous();
  const Layout layout = make_layout(output, c10::nullopt, causal);
  at::Tensor grad_input = at::empty_like(output);
  if (output.numel() == 0) return grad_input;
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(output.scalar_type(), "scaled_masked_softmax_backward", [&] {
    backward<scalar_t>(grad_output, output, layout, causal, scale, grad_input);
  });
  return grad_input;
}

}  // namespace
}  // namespace megatron_lite::fused_softmax::cpu

TORCH_LIBRARY_IMPL(megatron_lite, CPU, m) {
  m.impl("scaled_masked_softmax_forward", &megatron_lite::fused_softmax::cpu::forward_op);
  m.impl("scaled_masked_softmax_backward", &megatron_lite::fused_softmax::cpu::backward_op);
}
