// Vectorised loops over one softmax row, in float. The softmax kernel calls
// these per row; low-precision rows are widened to float first.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace megatron_lite::fused_softmax::cpu {

// keep[j] = all ones where mask[j] is false, 0 where it is true (masked).
void keep_bits(const bool* mask, uint32_t* keep, int64_t n);
// max over j < n of scale * x[j] where keep[j] (keep may be null: all kept); -inf if none is kept.
float scaled_max(const float* x, const uint32_t* keep, int64_t n, float scale);
// y[j] = exp(scale * x[j] - max) where keep[j], else 0; returns sum(y).
float scaled_exp_sum(const float* x, const uint32_t* keep, float* y, int64_t n, float scale, float max);
void multiply(float* y, int64_t n, float factor);
float dot(const float* a, const float* b, int64_t n);
// dx[j] = scale * y[j] * (dy[j] - dy_dot_y): the softmax gradient from the saved output.
void softmax_grad(const float* dy, const float* y, float* dx, int64_t n, float scale, float dy_dot_y);

void widen(const c10::BFloat16* src, float* dst, int64_t n);
void widen(const c10::Half* src, float* dst, int64_t n);
void narrow(const float* src, c10::BFloat16* dst, int64_t n);
void narrow(const float* src, c10::Half* dst, int64_t n);

}  // namespace megatron_lite::fused_softmax::cpu
