// CUDA implementation of the fused scaled-masked softmax. A row lives in
// registers: a warp per row up to 1024 keys (four rows per block), a 512-thread
// block per row up to 16384 keys; longer rows are refused here and take the
// Python fallback. Loads and stores are 16 bytes wide when the row length and
// pointers allow it. Only c10 core, c10/cuda and the CUDA runtime are used (no
// ATen/cuda), so the file compiles against the headers of a CPU torch wheel too,
// which is how CI checks it on machines without a GPU.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>

#include "fused_softmax/layout.h"

namespace megatron_lite::fused_softmax::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kBlockThreads = 512;
constexpr int kMaxPerThread = 32;  // floats held in registers per thread
constexpr int kWarpRowsPerBlock = 4;
constexpr int64_t kMaxKeys = int64_t{kBlockThreads} * kMaxPerThread;

// Threads per block for rows of kThreads threads: four warp-wide rows, or one
// block-wide row. Kernels declare it as their launch bound so that ptxas keeps
// a block-wide row's registers (up to 2 x 32 floats per thread) within budget.
template <int kThreads>
constexpr int kThreadsPerBlock = kThreads == kWarp ? kWarp * kWarpRowsPerBlock : kThreads;

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T value[kVec];
};

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Reduces v over the kThreads threads of a row: shuffles within a warp, then
// shared memory across the warps of a block-wide row.
template <int kThreads, typename Op>
__device__ float row_reduce(float v, Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if constexpr (kThreads > kWarp) {
    __shared__ float partial[kThreads / kWarp];
    __syncthreads();  // the previous reduction's readers are done with `partial`
    if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = v;
    __syncthreads();
    v = partial[0];
#pragma unroll
    for (int w = 1; w < kThreads / kWarp; ++w) v = op(v, partial[w]);
  }
  return v;
}

// Loads kVec elements at column j0 of a row as floats (one 16-byte load when kVec > 1).
template <typename T, int kVec>
__device__ void load(const T* row, int64_t j0, float* out) {
  if constexpr (kVec == 1) {
    out[0] = static_cast<float>(row[j0]);
  } else {
    const Pack<T, kVec> pack = *reinterpret_cast<const Pack<T, kVec>*>(row + j0);
#pragma unroll
    for (int v = 0; v < kVec; ++v) out[v] = static_cast<float>(pack.value[v]);
  }
}

template <typename T, int kVec>
__device__ void store(T* row, int64_t j0, const float* in) {
  Pack<T, kVec> pack;
#pragma unroll
  for (int v = 0; v < kVec; ++v) pack.value[v] = static_cast<T>(in[v]);
  *reinterpret_cast<Pack<T, kVec>*>(row + j0) = pack;
}

// Which row this thread works on and its place in it; false when past the last row.
template <int kThreads>
__device__ bool locate(int64_t rows, int64_t& row, int& lane) {
  constexpr int kRowsPerBlock = kThreadsPerBlock<kThreads> / kThreads;
  row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kThreads;
  lane = threadIdx.x % kThreads;
  return row < rows;
}

// Thread `lane` holds chunks lane, lane + kThreads, ... of kVec elements each.
template <typename T, int kThreads, int kPerThread, int kVec>
__global__ void __launch_bounds__(kThreadsPerBlock<kThreads>)
    forward_kernel(const T* __restrict__ input, const bool* __restrict__ mask, T* __restrict__ output, Layout layout,
                   bool causal, float scale, const float* __restrict__ sinks, float* __restrict__ sink_probs) {
  int64_t row;
  int lane;
  if (!locate<kThreads>(layout.rows, row, lane)) return;  // uniform over the row's threads
  const int64_t sk = layout.sk;
  const int64_t n = causal ? row % layout.sq + 1 : sk;  // keys this query may see
  const T* x = input + row * sk;
  const bool* masked = mask == nullptr ? nullptr : mask + mask_offset(layout, row);

  float values[kPerThread];
  float max = -INFINITY;
#pragma unroll
  for (int c = 0; c < kPerThread / kVec; ++c) {
    const int64_t j0 = (int64_t{c} * kThreads + lane) * kVec;
    float* chunk = values + c * kVec;
    if (j0 < n) load<T, kVec>(x, j0, chunk);  // the causal tail is never read
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int64_t j = j0 + v;
      const bool seen = j < n && (masked == nullptr || !masked[j]);
      chunk[v] = seen ? scale * chunk[v] : -INFINITY;
      max = fmaxf(max, chunk[v]);
    }
  }
  max = row_reduce<kThreads>(max, Max());
  // An attention sink is one more logit of the row (its head's), in the max and the sum, with no value.
  const float sink = sinks == nullptr ? -INFINITY : sinks[(row / layout.sq) % layout.heads];
  max = fmaxf(max, sink);

  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    values[i] = max == -INFINITY ? 0.0f : __expf(values[i] - max);  // exp(-inf) = 0 at masked keys
    sum += values[i];
  }
  sum = row_reduce<kThreads>(sum, Sum());
  const float sink_term = sinks == nullptr ? 0.0f : __expf(sink - max);
  sum += sink_term;
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;  // a fully masked row stays all zeros
  if (sink_probs != nullptr && lane == 0) sink_probs[row] = sink_term * inverse;

  T* y = output + row * sk;
#pragma unroll
  for (int c = 0; c < kPerThread / kVec; ++c) {
    const int64_t j0 = (int64_t{c} * kThreads + lane) * kVec;
    if (j0 >= sk) break;
    float* chunk = values + c * kVec;
#pragma unroll
    for (int v = 0; v < kVec; ++v) chunk[v] *= inverse;
    store<T, kVec>(y, j0, chunk);
  }
}

// dx = scale * y * (dy - sum(dy * y)), zero past the causal limit.
template <typename T, int kThreads, int kPerThread, int kVec>
__global__ void __launch_bounds__(kThreadsPerBlock<kThreads>)
    backward_kernel(const T* __restrict__ grad_output, const T* __restrict__ output, T* __restrict__ grad_input,
                    Layout layout, bool causal, float scale, float* __restrict__ dots) {
  int64_t row;
  int lane;
  if (!locate<kThreads>(layout.rows, row, lane)) return;
  const int64_t sk = layout.sk;
  const int64_t n = causal ? row % layout.sq + 1 : sk;
  const T* dy_row = grad_output + row * sk;
  const T* y_row = output + row * sk;

  float dy[kPerThread];
  float y[kPerThread];
  float dot = 0.0f;
#pragma unroll
  for (int c = 0; c < kPerThread / kVec; ++c) {
    const int64_t j0 = (int64_t{c} * kThreads + lane) * kVec;
    if (j0 < n) {
      load<T, kVec>(dy_row, j0, dy + c * kVec);
      load<T, kVec>(y_row, j0, y + c * kVec);
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int i = c * kVec + v;
      if (j0 + v >= n) dy[i] = y[i] = 0.0f;  // past the causal limit, or never loaded
      dot += dy[i] * y[i];
    }
  }
  dot = row_reduce<kThreads>(dot, Sum());
  if (dots != nullptr && lane == 0) dots[row] = dot;  // for the sink's gradient

  T* dx = grad_input + row * sk;
#pragma unroll
  for (int c = 0; c < kPerThread / kVec; ++c) {
    const int64_t j0 = (int64_t{c} * kThreads + lane) * kVec;
    if (j0 >= sk) break;
    float chunk[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) chunk[v] = scale * y[c * kVec + v] * (dy[c * kVec + v] - dot);
    store<T, kVec>(dx, j0, chunk);
  }
}

struct Launch {
  const void* a;  // forward: input;  backward: grad_output
  const void* b;  // forward: mask;   backward: output
  void* out;
  Layout layout;
  bool causal;
  float scale;
  const float* sinks = nullptr;  // forward with attention sinks: [np] logits
  float* row_out = nullptr;      // forward: each row's sink probability; backward: each row's dot(dy, y)
};

template <typename T, bool kBackward, int kThreads, int kPerThread, int kVec>
void launch(const Launch& p) {
  constexpr int kRowsPerBlock = kThreadsPerBlock<kThreads> / kThreads;
  const dim3 grid((p.layout.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const dim3 block(kThreadsPerBlock<kThreads>);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if constexpr (kBackward) {
    backward_kernel<T, kThreads, kPerThread, kVec><<<grid, block, 0, stream>>>(
        static_cast<const T*>(p.a), static_cast<const T*>(p.b), static_cast<T*>(p.out), p.layout, p.causal, p.scale,
        p.row_out);
  } else {
    forward_kernel<T, kThreads, kPerThread, kVec><<<grid, block, 0, stream>>>(
        static_cast<const T*>(p.a), static_cast<const bool*>(p.b), static_cast<T*>(p.out), p.layout, p.causal,
        p.scale, p.sinks, p.row_out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Picks the smallest register budget per thread that holds the row.
template <typename T, bool kBackward, int kThreads, int kVec, int kPerThread = kVec>
void launch_sized(const Launch& p) {
  if constexpr (kPerThread < kMaxPerThread) {
    if (p.layout.sk > int64_t{kThreads} * kPerThread) {
      launch_sized<T, kBackward, kThreads, kVec, kPerThread * 2>(p);
      return;
    }
  }
  launch<T, kBackward, kThreads, kPerThread, kVec>(p);
}

template <typename T, bool kBackward, int kVec>
void launch_vec(const Launch& p) {
  if (p.layout.sk <= int64_t{kWarp} * kMaxPerThread) {
    launch_sized<T, kBackward, kWarp, kVec>(p);
  } else {
    launch_sized<T, kBackward, kBlockThreads, kVec>(p);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, bool kBackward>
void launch_typed(const Launch& p) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorise =
      p.layout.sk % kVec == 0 && aligned16(p.a) && aligned16(p.out) && (!kBackward || aligned16(p.b));
  if (vectorise) {
    launch_vec<T, kBackward, kVec>(p);
  } else {
    launch_vec<T, kBackward, 1>(p);
  }
}

void check_cuda(const at::Tensor& t, const Layout& layout) {
  TORCH_CHECK(t.is_cuda(), "fused softmax CUDA kernel got a tensor on ", t.device());
  TORCH_CHECK(layout.sk <= kMaxKeys, "fused softmax: the CUDA kernel takes rows of up to ", kMaxKeys,
              " keys, got ", layout.sk, "; FusedScaleMaskSoftmax uses the torch fallback for longer rows");
}

at::Tensor forward_op(const at::Tensor& input, const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  const ForwardArgs args = prepare_forward(input, mask, causal);
  check_cuda(args.input, args.layout);
  const c10::cuda::CUDAGuard guard(args.input.device());
  at::Tensor output = at::empty_like(args.input);
  if (output.numel() == 0) return output;
  const Launch p{args.input.const_data_ptr(), args.mask.has_value() ? args.mask->const_data_ptr() : nullptr,
                 output.mutable_data_ptr(), args.layout, causal, static_cast<float>(scale)};
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(output.scalar_type(), "scaled_masked_softmax_forward_cuda",
                                       [&] { launch_typed<scalar_t, false>(p); });
  return output;
}

at::Tensor backward_op(const at::Tensor& grad_output, const at::Tensor& output, double scale, bool causal) {
  const BackwardArgs args = prepare_backward(grad_output, output, causal);
  check_cuda(args.output, args.layout);
  const c10::cuda::CUDAGuard guard(args.output.device());
  at::Tensor grad_input = at::empty_like(args.output);
  if (grad_input.numel() == 0) return grad_input;
  const Launch p{args.grad_output.const_data_ptr(), args.output.const_data_ptr(), grad_input.mutable_data_ptr(),
                 args.layout, causal, static_cast<float>(scale)};
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(grad_input.scalar_type(), "scaled_masked_softmax_backward_cuda",
                                       [&] { launch_typed<scalar_t, true>(p); });
  return grad_input;
}

std::tuple<at::Tensor, at::Tensor> sink_forward_op(const at::Tensor& input, const c10::optional<at::Tensor>& mask,
                                                   const at::Tensor& sinks, double scale, bool causal) {
  const ForwardArgs args = prepare_forward(input, mask, causal);
  check_cuda(args.input, args.layout);
  const at::Tensor sink_values = prepare_sinks(args.input, sinks);
  const c10::cuda::CUDAGuard guard(args.input.device());
  Layout layout = args.layout;
  layout.heads = args.input.size(1);
  at::Tensor output = at::empty_like(args.input);
  at::Tensor sink_probs = at::empty({layout.rows}, args.input.options().dtype(at::kFloat));
  if (output.numel() == 0) return {output, sink_probs};
  Launch p{args.input.const_data_ptr(), args.mask.has_value() ? args.mask->const_data_ptr() : nullptr,
           output.mutable_data_ptr(), layout, causal, static_cast<float>(scale)};
  p.sinks = sink_values.const_data_ptr<float>();
  p.row_out = sink_probs.mutable_data_ptr<float>();
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(output.scalar_type(), "scaled_masked_softmax_sink_forward_cuda",
                                       [&] { launch_typed<scalar_t, false>(p); });
  return {output, sink_probs};
}

std::tuple<at::Tensor, at::Tensor> row_dot_backward_op(const at::Tensor& grad_output, const at::Tensor& output,
                                                       double scale, bool causal) {
  const BackwardArgs args = prepare_backward(grad_output, output, causal);
  check_cuda(args.output, args.layout);
  const c10::cuda::CUDAGuard guard(args.output.device());
  at::Tensor grad_input = at::empty_like(args.output);
  at::Tensor dots = at::empty({args.layout.rows}, args.output.options().dtype(at::kFloat));
  if (grad_input.numel() == 0) return {grad_input, dots};
  Launch p{args.grad_output.const_data_ptr(), args.output.const_data_ptr(), grad_input.mutable_data_ptr(),
           args.layout, causal, static_cast<float>(scale)};
  p.row_out = dots.mutable_data_ptr<float>();
  MEGATRON_LITE_DISPATCH_SOFTMAX_TYPES(grad_input.scalar_type(), "scaled_masked_softmax_row_dot_backward_cuda",
                                       [&] { launch_typed<scalar_t, true>(p); });
  return {grad_input, dots};
}

}  // namespace
}  // namespace megatron_lite::fused_softmax::cuda

TORCH_LIBRARY_IMPL(megatron_lite, CUDA, m) {
  m.impl("scaled_masked_softmax_forward", &megatron_lite::fused_softmax::cuda::forward_op);
  m.impl("scaled_masked_softmax_backward", &megatron_lite::fused_softmax::cuda::backward_op);
  m.impl("scaled_masked_softmax_sink_forward", &megatron_lite::fused_softmax::cuda::sink_forward_op);
  m.impl("scaled_masked_softmax_row_dot_backward", &megatron_lite::fused_softmax::cuda::row_dot_backward_op);
}
