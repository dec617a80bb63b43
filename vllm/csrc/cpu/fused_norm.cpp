/*
 * RMSNorm, and RMSNorm fused with the residual add, on the CPU in one pass over each row.
 * Built and loaded by vllm/model_executor/layers/layernorm.py through vllm/native_build.py.
 *
 * Semantics (those of layernorm.py's torch path, HF's LlamaRMSNorm order of operations):
 *   fused_add_rms_norm:  x <- x + residual          (rounded to the model dtype, as torch's add_)
 *                        out = norm(x)
 *   rms_norm:            out = norm(x)               (x untouched)
 *   norm(h) = weight * to_dtype(float(h) * rsqrt(mean(float(h)^2) + eps))
 * where the product with the weight is rounded to the model dtype (in fp32 a plain product).
 * Every step but one rounds exactly as torch does; the exception is the sum of squares,
 * accumulated in fp32 in another order than torch's reduction, so outputs agree with the torch
 * path to fp32 rounding (bf16: the same bf16 value, or the neighbour when the fp32 value sits
 * on a rounding boundary), and the residual sum agrees bit for bit.
 *
 * Shapes: x, residual, out contiguous [rows, hidden] of one dtype (fp32 or bf16); weight
 * contiguous [hidden] of that dtype; out must not alias x. Checked before any work.
 *
 * Work split: at::parallel_for over rows; a row (a few KiB) is read once for the sum of squares
 * and once more, from L1, for the output. A row's result does not depend on the thread count.
 * Why: torch's path costs about ten small ops per norm (add, to, pow, mean, add, rsqrt, mul,
 * to, mul) each allocating a tensor; at batch 1 their dispatch, not arithmetic, is the cost.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "bf16_bits.h"

namespace {

using namespace vllm_cpu_bits;  // widen, narrow, elements: bf16 handled as its bits

void check_common(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "weight must be contiguous [", x.size(1), "] of x's dtype");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be contiguous, of x's shape and dtype");
  TORCH_CHECK(out.data_ptr() != x.data_ptr(), "out must not alias x");
}

// One row: optionally x += residual (stored rounded), then out = norm(x).
template <typename T, bool kAdd>
inline void norm_row(T* out, T* x, const T* residual, const T* weight, int64_t hidden, float eps) {
  float sum = 0.f;
  if constexpr (kAdd) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < hidden; ++j) {
      const T summed = narrow<T>(widen(x[j]) + widen(residual[j]));
      x[j] = summed;
      const float h = widen(summed);
      sum += h * h;
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < hidden; ++j) {
      const float h = widen(x[j]);
      sum += h * h;
    }
  }
  const float variance = sum / static_cast<float>(hidden);
  const float inv = 1.f / std::sqrt(variance + eps);  // torch's rsqrt: a correctly rounded sqrt, then a division
#pragma omp simd
  for (int64_t j = 0; j < hidden; ++j) {
    const T normed = narrow<T>(widen(x[j]) * inv);
    out[j] = narrow<T>(widen(normed) * widen(weight[j]));
  }
}

template <typename T, bool kAdd>
void norm_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
               double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  T* op = elements<T>(out);
  T* xp = elements<T>(x);
  const T* rp = kAdd ? elements<T>(*residual) : nullptr;
  const T* wp = elements<T>(weight);
  const float feps = static_cast<float>(eps);
  // Rows of a few hundred to a few thousand features: 16 rows per task keeps a task well
  // above the thread start-up cost, and one row (a decode) never wakes other threads.
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T, kAdd>(op + r * hidden, xp + r * hidden, kAdd ? rp + r * hidden : nullptr, wp, hidden, feps);
    }
  });
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_common(out, x, weight);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float, false>(out, x, nullptr, weight, eps);
  } else {
    norm_rows<uint16_t, false>(out, x, nullptr, weight, eps);
  }
}

void fused_add_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  check_common(out, x, weight);
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes(),
              "residual must be contiguous, of x's shape and dtype");
  TORCH_CHECK(out.data_ptr() != residual.data_ptr(), "out must not alias residual");
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float, true>(out, x, &residual, weight, eps);
  } else {
    norm_rows<uint16_t, true>(out, x, &residual, weight, eps);
  }
}

}  // namespace

TORCH_LIBRARY(vllm_norm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor(b!) x, Tensor residual, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_norm, CPU, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("fused_add_rms_norm", TORCH_FN(fused_add_rms_norm));
}
