// Argument checks and row indexing shared by the CPU and CUDA kernels, so both
// reject the same inputs with the same messages. Header-only and free of
// CUDA types so that nvcc and the host compiler both take it.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>

// The kernels' input dtypes, each computed with float accumulation.
#define MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(TYPE, NAME, ...)                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)              \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)       \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace megatron_lite::fused_softmax {

// How a kernel walks the input: `rows` rows of `sk` contiguous elements. Row r
// is query r % sq of batch-head r / sq. The mask row of (batch, head, query)
// starts at batch * mask_stride_b + head * mask_stride_h + query * mask_stride_q
// (a stride is 0 where the mask broadcasts).
struct Layout {
  int64_t rows = 0;
  int64_t sq = 0;
  int64_t sk = 0;
  int64_t heads = 1;
  int64_t mask_stride_b = 0;
  int64_t mask_stride_h = 0;
  int64_t mask_stride_q = 0;
};

inline void check_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fused softmax: ", name, " must be float32, bfloat16 or float16, got ", dtype);
}

// Checks input (and mask) and describes the rows of a contiguous input; the
// mask only needs a contiguous last dim.
inline Layout make_layout(const at::Tensor& input, const c10::optional<at::Tensor>& mask, bool causal) {
  check_dtype(input, "input");
  TORCH_CHECK(input.dim() >= 2, "fused softmax: input must be [..., sq, sk], got shape ", input.sizes());
  Layout layout;
  layout.sq = input.size(-2);
  layout.sk = input.size(-1);
  layout.rows = input.numel() / std::max<int64_t>(layout.sk, 1);
  if (causal) {
    TORCH_CHECK(layout.sq == layout.sk, "fused softmax: the causal mask needs sq == sk, got sq=", layout.sq,
                " sk=", layout.sk, " (input shape ", input.sizes(), ")");
    TORCH_CHECK(!mask.has_value(), "fused softmax: pass either a padding mask or causal=True, not both");
  }
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(input.dim() == 4, "fused softmax: a padding mask needs input [b, np, sq, sk], got shape ",
                input.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool, "fused softmax: mask must be bool (True = masked), got ",
                m.scalar_type());
    TORCH_CHECK(m.device() == input.device(), "fused softmax: mask is on ", m.device(), " but input is on ",
                input.device());
    bool fits = m.dim() == 4 && m.size(3) == layout.sk;
    for (int d = 0; fits && d < 3; ++d) fits = m.size(d) == input.size(d) || m.size(d) == 1;
    TORCH_CHECK(fits, "fused softmax: mask shape ", m.sizes(), " does not broadcast to input shape ",
                input.sizes(), "; use [b or 1, 1, sq, sk]");
    TORCH_CHECK(m.size(3) <= 1 || m.stride(3) == 1, "fused softmax: mask needs a contiguous last dim");
    layout.heads = input.size(1);
    layout.mask_stride_b = m.size(0) == 1 ? 0 : m.stride(0);
    layout.mask_stride_h = m.size(1) == 1 ? 0 : m.stride(1);
    layout.mask_stride_q = m.size(2) == 1 ? 0 : m.stride(2);
  }
  return layout;
}

inline void check_backward(const at::Tensor& grad_output, const at::Tensor& output, bool causal) {
  check_dtype(output, "output");
  TORCH_CHECK(grad_output.sizes() == output.sizes(), "fused softmax: grad_output shape ", grad_output.sizes(),
              " differs from output shape ", output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == output.scalar_type(), "fused softmax: grad_output is ",
              grad_output.scalar_type(), " but output is ", output.scalar_type());
  TORCH_CHECK(output.dim() >= 2, "fused softmax: output must be [..., sq, sk], got shape ", output.sizes());
  TORCH_CHECK(!causal || output.size(-2) == output.size(-1),
              "fused softmax: the causal mask needs sq == sk, got shape ", output.sizes());
}

// An op's arguments made ready for a kernel: checked, contiguous (the mask only
// in its last dim, so that broadcast masks stay views), with their row layout.
struct ForwardArgs {
  at::Tensor input;
  c10::optional<at::Tensor> mask;
  Layout layout;
};

inline ForwardArgs prepare_forward(const at::Tensor& input, const c10::optional<at::Tensor>& mask, bool causal) {
  ForwardArgs args{input.contiguous(), mask, {}};
  if (mask.has_value() && mask->dim() == 4 && mask->size(3) > 1 && mask->stride(3) != 1) {
    args.mask = mask->contiguous();
  }
  args.layout = make_layout(args.input, args.mask, causal);
  return args;
}

struct BackwardArgs {
  at::Tensor grad_output;
  at::Tensor output;
  Layout layout;
};

inline BackwardArgs prepare_backward(const at::Tensor& grad_output, const at::Tensor& output, bool causal) {
  check_backward(grad_output, output, causal);
  BackwardArgs args{grad_output.contiguous(), output.contiguous(), {}};
  args.layout = make_layout(args.output, c10::nullopt, causal);
  return args;
}

// The attention sinks of a 4-D input [b, np, sq, sk]: one float logit per head, contiguous, on the
// input's device (the op's caller converts a bf16/fp16 parameter).
inline at::Tensor prepare_sinks(const at::Tensor& input, const at::Tensor& sinks) {
  TORCH_CHECK(input.dim() == 4, "fused softmax: sinks need input [b, np, sq, sk], got shape ", input.sizes());
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == input.size(1), "fused softmax: sinks must be [np] = [",
              input.size(1), "], one per head, got shape ", sinks.sizes());
  TORCH_CHECK(sinks.scalar_type() == at::kFloat, "fused softmax: sinks must be float32, got ", sinks.scalar_type());
  TORCH_CHECK(sinks.device() == input.device(), "fused softmax: sinks are on ", sinks.device(),
              " but input is on ", input.device());
  return sinks.contiguous();
}

// Row r's mask offset (in elements) from the mask's data pointer.
C10_HOST_DEVICE inline int64_t mask_offset(const Layout& layout, int64_t row) {
  const int64_t query = row % layout.sq;
  const int64_t batch_head = row / layout.sq;
  return (batch_head / layout.heads) * layout.mask_stride_b + (batch_head % layout.heads) * layout.mask_stride_h +
         query * layout.mask_stride_q;
}

}  // namespace megatron_lite::fused_softmax
