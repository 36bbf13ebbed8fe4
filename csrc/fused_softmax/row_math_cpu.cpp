// The loops are plain C++ that the compiler vectorises; target_clones builds
// each one for AVX-512, AVX2 and baseline x86-64 and picks the best at load
// time, so the extension stays portable without per-ISA source files. exp is
// our own polynomial because libm's expf does not vectorise. Masks enter as
// 32-bit keep words and selections are bitwise: gcc does not vectorise these
// loops with bool loads or with branches in them.
#include "fused_softmax/row_math_cpu.h"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGATRON_LITE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MEGATRON_LITE_CLONES
#endif

namespace megatron_lite::fused_softmax::cpu {
namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// exp(x) for x <= 0 (softmax arguments minus their max), within ~2 ulp (Cephes
// expf polynomial). Below -87.3 the true value is under 1.2e-38 and we return
// exactly 0, which also keeps 2^n inside the normal range.
inline float exp_nonpositive(float x) {
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + kRoundMagic;
  const float n = t - kRoundMagic;
  const int32_t n_int = static_cast<int32_t>(float_to_bits(t) - float_to_bits(kRoundMagic));
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;  // x - n ln2, ln2 split in two for precision
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * r * r + r + 1.0f) * bits_to_float(static_cast<uint32_t>(n_int + 127) << 23);
  return x < -87.3f ? 0.0f : e;
}

}  // namespace

MEGATRON_LITE_CLONES void keep_bits(const bool* mask, uint32_t* keep, int64_t n) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(mask);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) keep[j] = bytes[j] ? 0u : ~0u;
}

MEGATRON_LITE_CLONES float scaled_max(const float* x, const uint32_t* keep, int64_t n, float scale) {
  constexpr uint32_t kMinusInfinity = 0xff800000u;
  float m = -std::numeric_limits<float>::infinity();
  if (keep == nullptr) {
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, scale * x[j]);
  } else {
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) {
      m = std::max(m, bits_to_float((float_to_bits(scale * x[j]) & keep[j]) | (kMinusInfinity & ~keep[j])));
    }
  }
  return m;
}

MEGATRON_LITE_CLONES float scaled_exp_sum(const float* x, const uint32_t* keep, float* y, int64_t n, float scale,
                                          float max) {
  float sum = 0.0f;
  if (keep == nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      y[j] = exp_nonpositive(scale * x[j] - max);
      sum += y[j];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      y[j] = bits_to_float(float_to_bits(exp_nonpositive(scale * x[j] - max)) & keep[j]);
      sum += y[j];
    }
  }
  return sum;
}

MEGATRON_LITE_CLONES void multiply(float* y, int64_t n, float factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] *= factor;
}

MEGATRON_LITE_CLONES float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

MEGATRON_LITE_CLONES void softmax_grad(const float* dy, const float* y, float* dx, int64_t n, float scale,
                                       float dy_dot_y) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dx[j] = scale * y[j] * (dy[j] - dy_dot_y);
}

MEGATRON_LITE_CLONES void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = bits_to_float(static_cast<uint32_t>(bits[j]) << 16);
}

MEGATRON_LITE_CLONES void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t u = float_to_bits(src[j]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    bits[j] = static_cast<uint16_t>(std::isnan(src[j]) ? 0x7fc0u : rounded);
  }
}

// Half has no cheap bit trick; c10's conversions are still branch-free enough to be fast.
void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

void narrow(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j]);
}

}  // namespace megatron_lite::fused_softmax::cpu
