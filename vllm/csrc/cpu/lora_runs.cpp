/*
 * Multi-LoRA on the CPU for runs of consecutive tokens with one adapter slot (the runs case of
 * vllm/lora/ops/torch_ops.py's add_lora) in one call per layer, over the layer's stacked slots
 * (vllm/lora/layers.py: A of every slice concatenated, B block-diagonal, held here transposed).
 * Built and loaded by vllm/lora/ops/cpu_native.py through vllm/native_build.py.
 *
 * Why: a LoRA delta is tiny (rank 16 against a few thousand features), so on the CPU the torch
 * path's cost is its two small matmuls per run and layer (~70-90 us a call in bf16 on a Zen 4
 * thread: 8-13 ms over SmolLM2's 120 LoRA layers, about a base decode step).
 *
 * Semantics (torch_ops.add_lora's, up to summation order):
 *   for each run (slot s, tokens t0 .. t1 - 1):
 *     h[t, j] = dtype(sum_k x[t, k] * a[s, j, k])                                   for j < RA
 *     for each block (c0, nc, r0, nr), for c < nc:
 *       y[t, c0 + c] = dtype(y[t, c0 + c] + sum_{j < nr} h[t, r0 + j] * b_t[s, r0 + j, c0 + c])
 *   where b_t[s] is the layer's B [N, RA] transposed and a block is one slice's columns and its
 *   rank columns: B is zero outside the blocks, so the torch path's full sum over RA is the same
 *   value. dtype(v) rounds to the tensors' dtype (bf16: nearest even, as torch's casts; fp32: as
 *   is), h as the torch path's `x @ a.T` rounds it. Sums in fp32, bf16 operands widened exactly:
 *   h's over k in one order fixed by the build (vector lanes, then their sum), y's over j in order.
 *   A token's result depends on neither the batch nor the thread count.
 *
 * Shapes: x [T, K], y [T, N] (unit stride along their rows); a [S, RA, K] and b_t [S, RA, N]
 * contiguous; one dtype, fp32 or bf16; blocks flat (c0, nc, r0, nr) within N and RA; runs flat
 * (slot, t0, t1) with 0 <= slot < S, 0 <= t0 < t1 <= T. Checked before any work.
 *
 * Work split: a run's h serially (T x RA dot products), its y at::parallel_for over chunks of
 * kCols columns where the run's expand is big enough to pay for a fork (kParallelMacs).
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_bits.h"

namespace {

using vllm_cpu_bits::narrow;
using vllm_cpu_bits::widen;

constexpr int64_t kCols = 16;               // columns of y summed side by side (one vector of fp32)
constexpr int64_t kParallelMacs = 1 << 16;  // multiply-adds of a run's expand from which threads share it

template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += widen(a[k]) * widen(b[k]);
  return acc;
}

// y[0:W] += sum_{j < nr} h[j] * b_t[j * N + 0:W], each column's sum over j in order, then rounded.
template <typename T, int64_t W>
inline void expand_cols(T* y, const float* h, const T* b_t, int64_t N, int64_t nr) {
  float acc[W] = {};
  for (int64_t j = 0; j < nr; ++j) {
    const float hj = h[j];
    const T* row = b_t + j * N;
#pragma omp simd
    for (int64_t c = 0; c < W; ++c) acc[c] += hj * widen(row[c]);
  }
  for (int64_t c = 0; c < W; ++c) y[c] = narrow<T>(widen(y[c]) + acc[c]);
}

// Columns [c_begin, c_end) of one block for the run's rows: h [rows, RA] (rounded values, as fp32).
template <typename T>
void expand_block(T* y, int64_t y_stride, const float* h, int64_t RA, const T* b_t, int64_t N, int64_t rows,
                  int64_t r0, int64_t nr, int64_t c_begin, int64_t c_end) {
  for (int64_t t = 0; t < rows; ++t) {
    T* yt = y + t * y_stride;
    const float* ht = h + t * RA + r0;
    const T* bt = b_t + r0 * N;
    int64_t c = c_begin;
    for (; c + kCols <= c_end; c += kCols) expand_cols<T, kCols>(yt + c, ht, bt + c, N, nr);
    for (; c < c_end; ++c) expand_cols<T, 1>(yt + c, ht, bt + c, N, nr);
  }
}

template <typename T>
void runs_into(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               at::IntArrayRef blocks, at::IntArrayRef runs) {
  const int64_t K = x.size(1), N = b_t.size(2), RA = a.size(1);
  const T* xp = vllm_cpu_bits::elements<T>(x);
  T* yp = vllm_cpu_bits::elements<T>(y);
  std::vector<float> h;
  for (size_t r = 0; r < runs.size(); r += 3) {
    const int64_t slot = runs[r], t0 = runs[r + 1], rows = runs[r + 2] - t0;
    const T* as = vllm_cpu_bits::elements<T>(a) + slot * RA * K;
    const T* bs = vllm_cpu_bits::elements<T>(b_t) + slot * RA * N;
    h.resize(static_cast<size_t>(rows * RA));  // [rows, RA]
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < RA; ++j)
        h[t * RA + j] = widen(narrow<T>(dot(xp + (t0 + t) * x.stride(0), as + j * K, K)));
    T* yr = yp + t0 * y.stride(0);
    for (size_t k = 0; k < blocks.size(); k += 4) {
      const int64_t c0 = blocks[k], nc = blocks[k + 1], r0 = blocks[k + 2], nr = blocks[k + 3];
      const int64_t chunks = (nc + kCols - 1) / kCols;
      const int64_t grain = std::max<int64_t>(1, kParallelMacs / std::max<int64_t>(1, rows * nr * kCols));
      at::parallel_for(0, chunks, grain, [&](int64_t i0, int64_t i1) {
        expand_block(yr, y.stride(0), h.data(), RA, bs, N, rows, r0, nr, c0 + i0 * kCols,
                     c0 + std::min(nc, i1 * kCols));
      });
    }
  }
}

void add_lora_runs(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                   at::IntArrayRef blocks, at::IntArrayRef runs) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "add_lora_runs: x must be float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(y.scalar_type() == dtype && a.scalar_type() == dtype && b_t.scalar_type() == dtype,
              "add_lora_runs: y, a and b_t must be ", dtype, " like x");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "add_lora_runs: x [T, K] and y [T, N] with unit stride along their rows, got ", x.sizes(), " and ",
              y.sizes());
  TORCH_CHECK(a.dim() == 3 && b_t.dim() == 3 && a.is_contiguous() && b_t.is_contiguous() && a.size(2) == x.size(1) &&
                  b_t.size(0) == a.size(0) && b_t.size(1) == a.size(1) && b_t.size(2) == y.size(1),
              "add_lora_runs: a must be contiguous [S, RA, K] = [S, RA, ", x.size(1), "] and b_t [S, RA, ",
              y.size(1), "], got ", a.sizes(), " and ", b_t.sizes());
  const int64_t S = a.size(0), RA = a.size(1), N = y.size(1), T = x.size(0);
  TORCH_CHECK(blocks.size() % 4 == 0 && runs.size() % 3 == 0,
              "add_lora_runs: blocks must be flat (c0, nc, r0, nr) and runs flat (slot, t0, t1)");
  for (size_t k = 0; k < blocks.size(); k += 4)
    TORCH_CHECK(blocks[k] >= 0 && blocks[k + 1] >= 0 && blocks[k] + blocks[k + 1] <= N && blocks[k + 2] >= 0 &&
                    blocks[k + 3] >= 0 && blocks[k + 2] + blocks[k + 3] <= RA,
                "add_lora_runs: block (", blocks[k], ", ", blocks[k + 1], ", ", blocks[k + 2], ", ", blocks[k + 3],
                ") outside ", N, " columns and ", RA, " ranks");
  for (size_t r = 0; r < runs.size(); r += 3)
    TORCH_CHECK(runs[r] >= 0 && runs[r] < S && runs[r + 1] >= 0 && runs[r + 1] < runs[r + 2] && runs[r + 2] <= T,
                "add_lora_runs: run (", runs[r], ", ", runs[r + 1], ", ", runs[r + 2], ") outside ", S, " slots and ",
                T, " tokens");
  if (dtype == at::kFloat)
    runs_into<float>(y, x, a, b_t, blocks, runs);
  else
    runs_into<uint16_t>(y, x, a, b_t, blocks, runs);
}

}  // namespace

TORCH_LIBRARY(vllm_lora, m) {
  m.def("add_lora_runs(Tensor(a!) y, Tensor x, Tensor a, Tensor b_t, int[] blocks, int[] runs) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lora, CPU, m) { m.impl("add_lora_runs", TORCH_FN(add_lora_runs)); }
