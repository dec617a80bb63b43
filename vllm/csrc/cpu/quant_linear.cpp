/*
 * Weight-only quantized linear layers on the CPU: int8 and int4 weights with one fp32 scale per
 * group of `group` input features, activations in fp32. Built and loaded by
 * vllm/model_executor/layers/quantization.py through vllm/native_build.py.
 *
 * Semantics (identical to quantization.py's `dequantize` followed by a matmul):
 *   int8:  W[n, k] = scales[n, k / group] * qweight[n, k]                 qweight int8 [N, K]
 *   int4:  within each group of 32 (GGUF Q4_0's block layout; group is a multiple of 32),
 *          byte j of block b of row n holds element 32 b + j in its low nibble and element
 *          32 b + j + 16 in its high nibble, both stored as q + 8 with q in [-8, 7]:
 *          W[n, k] = scales[n, k / group] * (nibble - 8)                   qweight uint8 [N, K / 2]
 *   out[m, n] = sum_k x[m, k] * W[n, k]                                    out fp32 [M, N]
 *
 * Shapes: x fp32 [M, K] contiguous; scales fp32 [N, K / group] contiguous; K a multiple of
 * group. Checked before any work.
 *
 * Work split: at::parallel_for over output features; for each (row of x, output feature) the
 * group's products are summed in fp32 straight from the packed bytes (widened in registers,
 * no dequantized copy), then scaled once per group. The weight row stays in L1 across the
 * few rows of x this kernel is used for, so weight bytes come from memory once per call.
 * Sums run in a fixed order per (m, n): results do not depend on the thread count.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kQ4Block = 32;

void check_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  int64_t group, int64_t k_per_row_byte) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous 2-D");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * k_per_row_byte == K, "qweight holds ", qweight.size(1) * k_per_row_byte,
              " input features per row, x has ", K);
  TORCH_CHECK(group > 0 && K % group == 0, "group (", group, ") must divide K (", K, ")");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              "scales must be contiguous fp32 [N, K / group]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == N,
              "out must be contiguous fp32 [M, N]");
}

void quant_linear_int8(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "int8 qweight must be int8");
  check_inputs(out, x, qweight, scales, group, 1);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int8_t* q = qp + n * K + g * group;
          const float* xg = xr + g * group;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < group; ++j) acc += xg[j] * static_cast<float>(q[j]);
          total += sp[n * G + g] * acc;
        }
        op[m * N + n] = total;
      }
    }
  });
}

void quant_linear_int4(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "int4 qweight must be uint8 (two values per byte)");
  TORCH_CHECK(group % kQ4Block == 0, "int4 group (", group, ") must be a multiple of 32");
  check_inputs(out, x, qweight, scales, group, 2);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  constexpr int64_t kHalf = kQ4Block / 2;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qp + n * (K / 2);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float acc = 0.f;
          for (int64_t b = g * group; b < (g + 1) * group; b += kQ4Block) {
            const uint8_t* q = row + b / 2;
            const float* xb = xr + b;
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < kHalf; ++j) {
              acc += xb[j] * static_cast<float>(static_cast<int>(q[j] & 0x0F) - 8) +
                     xb[j + kHalf] * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
            }
          }
          total += sp[n * G + g] * acc;
        }
        op[m * N + n] = total;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(vllm_quant, m) {
  m.def("linear_int8(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, int group) -> ()");
  m.def("linear_int4(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, int group) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_quant, CPU, m) {
  m.impl("linear_int8", TORCH_FN(quant_linear_int8));
  m.impl("linear_int4", TORCH_FN(quant_linear_int4));
}
