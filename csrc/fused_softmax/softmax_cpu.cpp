// CPU implementation of the fused scaled-masked softmax: rows in parallel
// (at::parallel_for), each row in float with the vectorised loops of
// row_math_cpu. The causal variant touches only the first i + 1 keys of query
// row i and writes zeros over the rest.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <limits>
#include <vector>

#include "fused_softmax/layout.h"
#include "fused_softmax/row_math_cpu.h"

namespace megatron_lite::fused_softmax::cpu {
namespace {

// Rows per task: enough elements that a task outweighs its scheduling.
int64_t grain_rows(int64_t sk) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1)); }

// Runs fn(row, next) over all rows in parallel chunks, where `next` is the row
// the same task does next (-1 if none) so that fn can prefetch it: causal rows
// end early and break the hardware prefetcher's stream. Chunks are contiguous
// rows; a causal batch-head costs the same as any other, so chunks balance
// whenever batch x heads is a few times the thread count.
template <typename Fn>
void for_each_row(const Layout& layout, const Fn& fn) {
  at::parallel_for(0, layout.rows, grain_rows(layout.sk), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) fn(row, row + 1 < end ? row + 1 : -1);
  });
}

// Asks for the first `count` elements of a row to be brought into cache.
template <typename T>
void prefetch(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset);
  }
}

// Softmax of one float row: the first `n` of `sk` positions take part, the rest are zeros. With a sink
// (`sink` not null: one more logit in the denominator, attention sinks) its probability goes to *sink_prob.
void forward_row(const float* x, const uint32_t* keep, float* y, int64_t n, int64_t sk, float scale,
                 const float* sink, float* sink_prob) {
  float max = scaled_max(x, keep, n, scale);
  if (sink != nullptr) max = std::max(max, *sink);
  if (max == -std::numeric_limits<float>::infinity()) {
    std::fill(y, y + sk, 0.0f);  // every position masked: documented to give zeros
    return;
  }
  float sum = scaled_exp_sum(x, keep, y, n, scale, max);
  const float sink_term = sink == nullptr ? 0.0f : std::exp(*sink - max);
  sum += sink_term;
  multiply(y, n, 1.0f / sum);
  std::fill(y + n, y + sk, 0.0f);
  if (sink != nullptr) *sink_prob = sink_term / sum;
}

// The row's dot(dy, y) goes to *dot_out when it is not null (the sink's gradient needs it).
void backward_row(const float* dy, const float* y, float* dx, int64_t n, int64_t sk, float scale, float* dot_out) {
  const float dy_dot_y = dot(dy, y, n);
  softmax_grad(dy, y, dx, n, scale, dy_dot_y);
  std::fill(dx + n, dx + sk, 0.0f);
  if (dot_out != nullptr) *dot_out = dy_dot_y;
}

// Per-thread row scratch, reused across rows and calls.
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

template <typename scalar_t>
void forward(const at::Tensor& input, const bool* mask, const Layout& layout, bool causal, float scale,
             at::Tensor& output, const float* sinks, float* sink_probs) {
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  scalar_t* y = output.mutable_data_ptr<scalar_t>();
  const int64_t sk = layout.sk;
  const auto length = [&](int64_t row) { return causal ? row % layout.sq + 1 : sk; };
  for_each_row(layout, [&](int64_t row, int64_t next) {
    thread_local std::vector<uint32_t> keep_buffer;
    thread_local std::vector<float> float_buffer;
    if (next >= 0) prefetch(x + next * sk, length(next));
    const int64_t n = length(row);
    uint32_t* keep = nullptr;
    if (mask != nullptr) {
      keep = scratch(keep_buffer, sk);
      keep_bits(mask + mask_offset(layout, row), keep, n);
    }
    // Row r is query r % sq of batch-head r / sq; a sink belongs to the head.
    const float* sink = sinks == nullptr ? nullptr : sinks + (row / layout.sq) % layout.heads;
    float* sink_prob = sink_probs == nullptr ? nullptr : sink_probs + row;
    if constexpr (std::is_same_v<scalar_t, float>) {
      forward_row(x + row * sk, keep, y + row * sk, n, sk, scale, sink, sink_prob);
    } else {
      float* buffer = scratch(float_buffer, 2 * sk);
      widen(x + row * sk, buffer, n);
      forward_row(buffer, keep, buffer + sk, n, sk, scale, sink, sink_prob);
      narrow(buffer + sk, y + row * sk, sk);
    }
  });
}

template <typename scalar_t>
void backward(const at::Tensor& grad_output, const at::Tensor& output, const Layout& layout, bool causal,
              float scale, at::Tensor& grad_input, float* dots) {
  const scalar_t* dy = grad_output.const_data_ptr<scalar_t>();
  const scalar_t* y = output.const_data_ptr<scalar_t>();
  scalar_t* dx = grad_input.mutable_data_ptr<scalar_t>();
  const int64_t sk = layout.sk;
  const auto length = [&](int64_t row) { return causal ? row % layout.sq + 1 : sk; };
  for_each_row(layout, [&](int64_t row, int64_t next) {
    if (next >= 0) {
      prefetch(dy + next * sk, length(next));
      prefetch(y + next * sk, length(next));
    }
    const int64_t n = length(row);
    const int64_t start = row * sk;
    float* dot_out = dots == nullptr ? nullptr : dots + row;
    if constexpr (std::is_same_v<scalar_t, float>) {
      backward_row(dy + start, y + start, dx + start, n, sk, scale, dot_out);
    } else {
      thread_local std::vector<float> float_buffer;
      float* buffer = scratch(float_buffer, 3 * sk);
      widen(dy + start, buffer, n);
      widen(y + start, buffer + sk, n);
      backward_row(buffer, buffer + sk, buffer + 2 * sk, n, sk, scale, dot_out);
      narrow(buffer + 2 * sk, dx + start, sk);
    }
  });
}

at::Tensor forward_op(const at::Tensor& input, const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  const ForwardArgs args = prepare_forward(input, mask, causal);
  at::Tensor output = at::empty_like(args.input);
  if (output.numel() == 0) return output;
  const bool* mask_data = args.mask.has_value() ? args.mask->const_data_ptr<bool>() : nullptr;
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(output.scalar_type(), "scaled_masked_softmax_forward", [&] {
    forward<scalar_t>(args.input, mask_data, args.layout, causal, scale, output, nullptr, nullptr);
  });
  return output;
}

at::Tensor backward_op(const at::Tensor& grad_output, const at::Tensor& output, double scale, bool causal) {
  const BackwardArgs args = prepare_backward(grad_output, output, causal);
  at::Tensor grad_input = at::empty_like(args.output);
  if (grad_input.numel() == 0) return grad_input;
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(grad_input.scalar_type(), "scaled_masked_softmax_backward", [&] {
    backward<scalar_t>(args.grad_output, args.output, args.layout, causal, scale, grad_input, nullptr);
  });
  return grad_input;
}

std::tuple<at::Tensor, at::Tensor> sink_forward_op(const at::Tensor& input, const c10::optional<at::Tensor>& mask,
                                                   const at::Tensor& sinks, double scale, bool causal) {
  const ForwardArgs args = prepare_forward(input, mask, causal);
  const at::Tensor sink_values = prepare_sinks(args.input, sinks);
  Layout layout = args.layout;
  layout.heads = args.input.size(1);
  at::Tensor output = at::empty_like(args.input);
  at::Tensor sink_probs = at::empty({layout.rows}, args.input.options().dtype(at::kFloat));
  if (output.numel() == 0) return {output, sink_probs};
  const bool* mask_data = args.mask.has_value() ? args.mask->const_data_ptr<bool>() : nullptr;
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(output.scalar_type(), "scaled_masked_softmax_sink_forward", [&] {
    forward<scalar_t>(args.input, mask_data, layout, causal, scale, output, sink_values.const_data_ptr<float>(),
                      sink_probs.mutable_data_ptr<float>());
  });
  return {output, sink_probs};
}

std::tuple<at::Tensor, at::Tensor> row_dot_backward_op(const at::Tensor& grad_output, const at::Tensor& output,
                                                       double scale, bool causal) {
  const BackwardArgs args = prepare_backward(grad_output, output, causal);
  at::Tensor grad_input = at::empty_like(args.output);
  at::Tensor dots = at::empty({args.layout.rows}, args.output.options().dtype(at::kFloat));
  if (grad_input.numel() == 0) return {grad_input, dots};
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(grad_input.scalar_type(), "scaled_masked_softmax_row_dot_backward", [&] {
    backward<scalar_t>(args.grad_output, args.output, args.layout, causal, scale, grad_input,
                       dots.mutable_data_ptr<float>());
  });
  return {grad_input, dots};
}

}  // namespace
}  // namespace megatron_lite::fused_softmax::cpu

TORCH_LIBRARY_IMPL(megatron_lite, CPU, m) {
  m.impl("scaled_masked_softmax_forward", &megatron_lite::fused_softmax::cpu::forward_op);
  m.impl("scaled_masked_softmax_backward", &megatron_lite::fused_softmax::cpu::backward_op);
  m.impl("scaled_masked_softmax_sink_forward", &megatron_lite::fused_softmax::cpu::sink_forward_op);
  m.impl("scaled_masked_softmax_row_dot_backward", &megatron_lite::fused_softmax::cpu::row_dot_backward_op);
}
