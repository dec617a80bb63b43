/*
 * bf16 linear layers on CPUs with AVX512-BF16 for a few to a few dozen rows of x (batched
 * decodes, an aLoRA's invocation over a cached conversation, short chunks): vdpbf16ps multiplies
 * 16 pairs of bf16 per instruction into fp32 lanes, so these rows cost what the weight's bytes
 * cost, where oneDNN's bf16 matmul reorders the plain weight on every call. Built and loaded by
 * vllm/model_executor/layers/dense_gemv.py through vllm/native_build.py.
 *
 * Semantics (dense_gemv.py's `reference_linear` computes the same in float64, before rounding):
 *   out[m, n] = bf16(sum_k x[m, k] * w[n, k] (+ bias[n]))     x, w, bias, out bf16
 *   Each (m, n) is summed in one fixed order: 16 fp32 lanes, lane l taking the feature pairs
 *   (32 j + 2 l, 32 j + 2 l + 1) for j = 0, 1, ... (features past K count as 0), each pair's two
 *   products (exact in fp32) added one after the other, rounding to nearest even (bf16 subnormal
 *   inputs count as 0 and subnormal sums are flushed to 0: the instruction's DAZ/FTZ); then the
 *   lanes added by _mm512_reduce_add_ps's fixed tree, the bias (widened exactly) added, and the
 *   sum rounded to bf16 (nearest even). The order depends on neither the thread count, nor M,
 *   nor where a row falls in a tile: a row of x gets bitwise the same output however it is
 *   batched with others.
 *
 * Shapes: x bf16 [M, K] contiguous; weight bf16 [N, K] contiguous; bias bf16 [N] or none; out
 * bf16 [M, N] contiguous. Checked before any work.
 *
 * Tiles: kWRows weight rows x kXRows rows of x, 16 accumulators in the 32 zmm registers, their
 * lanes summed together (sums_of_sixteen). A tile's weight rows are not neighbours but lie evenly
 * apart over the task's rows (vllm_cpu_bits::for_strided_tiles), so each is a sequential stream of
 * its own, which the hardware prefetchers follow; a tile is read from memory once, by the first
 * group of rows of x, and from L1 by the others. The first group asks for each stream's next row
 * as it goes (a line of each per step) into L2 (the T2 hint: a T0 ask holds one of L1's few miss
 * buffers until its line arrives, which capped the reads). One Zen 4 thread, SmolLM2's 30 layers
 * beyond cache, alternating in one process: 1.44 / 1.26 / 1.08 / 1.0x the rate of neighbouring
 * rows with the next tile asked for at 1 / 4 / 8 / 16 rows of x (asking two or three rows ahead:
 * no better); at one row 1.03-1.15x the rate of the fp32-lane GEMV (dense_gemv.cpp; 1.18x on two
 * threads, 1.35x at two rows), whose widening and single products cap it even from L2 (~34 GB/s
 * against this kernel's ~48), so every bf16 row runs here where the CPU has AVX512-BF16
 * (dense_gemv.py `native_max_rows`). Granite-3.3-2B's long rows: 1.03-1.07x at one row, 0.90-0.96x
 * at two (docs/benchmarks.md, "Every bf16 decode on the vdpbf16ps kernel").
 * Work split: at::parallel_for over tiles of weight rows, at least ~64 KB of weight per task.
 */

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512BF16__)
#error "bf16_dot_linear.cpp needs AVX512-BF16 (dense_gemv.py builds it only where the CPU has it)"
#endif

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "bf16_bits.h"
#include "row_tiles.h"

namespace {

constexpr int kWRows = 4;                  // weight rows of a tile
constexpr int kXRows = 4;                  // rows of x of a tile: 16 accumulators, 4 x and 1 weight register
constexpr int64_t kPairs = 16;             // feature pairs of one zmm register: 32 bf16
constexpr int64_t kTaskBytes = 64 * 1024;  // least weight bytes per parallel task

// Inlined wherever used: out of line, a tile's accumulators lived in memory (their address
// escaped into the lane sums), which halved the kernel's speed. The loops over a tile's registers
// are unrolled by pragma for the same reason: left to GCC 12, a tile zeroed its 16 accumulators
// with a memset, spilled them after the loop over K and read them back for the lane sums (SmolLM2's
// and Granite-3.3-2B's layers, 3-32 rows of x, one and two Zen 4 threads: 0.91-0.97x the time
// unrolled, bitwise the same sums).
#define VLLM_INLINE inline __attribute__((always_inline))

// 32 bf16 features from k on, as 16 pairs: all of them, or (the row's last step) those before K
// and zeros.
VLLM_INLINE __m512bh load_pairs(const uint16_t* row, int64_t k) {
  return vllm_cpu_bits::as_bf16_pairs(_mm512_loadu_si512(row + k));
}
VLLM_INLINE __m512bh load_last_pairs(const uint16_t* row, int64_t k, int64_t K) {
  return vllm_cpu_bits::as_bf16_pairs(
      _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << (K - k)) - 1), row + k));
}

// One step of the lane sums: the 128-bit lanes of a and b as a shuffle picks them, added.
template <int kPick>
VLLM_INLINE __m512 add_halves(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, kPick & 0xFF), _mm512_shuffle_f32x4(a, b, kPick >> 8));
}
template <int kPick>
VLLM_INLINE __m512 add_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, kPick & 0xFF), _mm512_shuffle_ps(a, b, kPick >> 8));
}

// The 16 lanes of each of v[0..15] summed, lane 4 L + i of the result holding v[L + 4 i]'s sum,
// every sum in the same order: p_k = (l_k + l_{k+8}) + (l_{k+4} + l_{k+12}) for k < 4, then
// (p_0 + p_2) + (p_1 + p_3).
VLLM_INLINE __m512 sums_of_sixteen(const __m512 (&v)[16]) {
  __m512 s[8], r[4], x[2];
  #pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) s[i] = add_halves<0x44 | (0xEE << 8)>(v[2 * i], v[2 * i + 1]);  // l_k + l_{k+8}
  #pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) r[i] = add_halves<0x88 | (0xDD << 8)>(s[2 * i], s[2 * i + 1]);  // p_k
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i)
    x[i] = add_pairs<_MM_SHUFFLE(1, 0, 1, 0) | (_MM_SHUFFLE(3, 2, 3, 2) << 8)>(r[2 * i], r[2 * i + 1]);
  return add_pairs<_MM_SHUFFLE(2, 0, 2, 0) | (_MM_SHUFFLE(3, 1, 3, 1) << 8)>(x[0], x[1]);
}

// out rows m0 .. m0 + R - 1, columns n0 + c rs for c < C (R, C <= 4). `ahead`: the first of kWRows
// weight rows (`ahead_stride` apart) the steps ask for, a line of each per step, into L2.
// _mm_prefetch, not prefetch.h's asm (around which GCC kept the accumulators in memory: 2x slower),
// and unconditional (GCC may delete a hint under a condition): tiles with nothing to ask for ask
// for their own rows again.
template <int R, int C>
void tile(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t N, int64_t K,
          int64_t m0, int64_t n0, int64_t rs, const uint16_t* ahead, int64_t ahead_stride) {
  __m512 acc[16];  // acc[r + 4 c]: the lanes of out[m0 + r, n0 + c rs] (the sums' lane order)
  #pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto load) {
    #pragma GCC unroll 16
    for (int c = 0; c < kWRows; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + c * ahead_stride + k), _MM_HINT_T2);
    __m512bh xv[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xv[r] = load(x + (m0 + r) * K, k);
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512bh wv = load(w + (n0 + c * rs) * K, k);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r + 4 * c] = _mm512_dpbf16_ps(acc[r + 4 * c], xv[r], wv);
    }
  };
  int64_t k = 0;
  for (; k + 2 * kPairs <= K; k += 2 * kPairs)
    step(k, [](const uint16_t* row, int64_t at) { return load_pairs(row, at); });
  if (k < K) step(k, [K](const uint16_t* row, int64_t at) { return load_last_pairs(row, at, K); });
  __m512 sums = sums_of_sixteen(acc);  // lane 4 r + c: out[m0 + r, n0 + c rs]
  if (bias) {
    alignas(16) float b[4] = {};
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) b[c] = vllm_cpu_bits::widen(bias[n0 + c * rs]);
    sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_load_ps(b)));
  }
  alignas(32) uint16_t rounded[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(sums));
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[(m0 + r) * N + n0 + c * rs] = rounded[4 * r + c];
  }
}

// Every row of x against weight rows n0 + c rs (c < C), kXRows rows at a time. The first group reads
// the weights from memory and asks for `ahead`'s rows (ahead_stride apart); the others read L1.
template <int C>
void weight_tile(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t rs, const uint16_t* ahead, int64_t ahead_stride) {
  vllm_cpu_bits::for_row_tiles<kXRows>(M, [&](auto rows, int64_t m) {
    const bool first = m == 0;
    tile<decltype(rows)::value, C>(x, w, bias, out, N, K, m, n0, rs, first ? ahead : w + n0 * K,
                                   first ? ahead_stride : rs * K);
  });
}

// Weight rows [n_begin, n_end): strided tiles of kWRows (tile i: rows n_begin + i + j q), each
// asking for its streams' next rows (tile i + 1's; the last tile its own), then the rows left
// (fewer than kWRows) as one tile of neighbours, which asks for its first row again (its other
// asks would pass the weight's end).
void weight_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M, int64_t N,
                 int64_t K, int64_t n_begin, int64_t n_end) {
  const int64_t n = vllm_cpu_bits::for_strided_tiles<kWRows>(n_begin, n_end, [&](auto, int64_t first, int64_t q) {
    const int64_t next = std::min(first + 1, n_begin + q - 1);
    weight_tile<kWRows>(x, w, bias, out, M, N, K, first, q, w + next * K, q * K);
  });
  vllm_cpu_bits::for_row_tiles<kWRows>(n, n_end, [&](auto rows, int64_t n0) {
    weight_tile<decltype(rows)::value>(x, w, bias, out, M, N, K, n0, 1, w + n0 * K, 0);
  });
}

void bf16_dot_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bf16 [M, K], got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "weight must be contiguous bf16 [N, K], got ", weight.scalar_type(), " of shape ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight has ", weight.size(1), " input features, x has ", K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == M &&
                  out.size(1) == N,
              "out must be contiguous bf16 [M, N] = [", M, ", ", N, "], got ", out.scalar_type(), " of shape ",
              out.sizes());
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->size(0) == N,
                "bias must be contiguous bf16 [N] = [", N, "], got ", bias->scalar_type(), " of shape ", bias->sizes());
    bp = vllm_cpu_bits::elements<uint16_t>(*bias);
  }
  const uint16_t* xp = vllm_cpu_bits::elements<uint16_t>(x);
  const uint16_t* wp = vllm_cpu_bits::elements<uint16_t>(weight);
  uint16_t* op = vllm_cpu_bits::elements<uint16_t>(out);
  const int64_t tiles = (N + kWRows - 1) / kWRows;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, kWRows * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    weight_rows(xp, wp, bp, op, M, N, K, begin * kWRows, std::min(N, end * kWRows));
  });
}

}  // namespace

TORCH_LIBRARY(vllm_bf16_dot, m) {
  m.def("bf16_dot_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_bf16_dot, CPU, m) { m.impl("bf16_dot_linear", TORCH_FN(bf16_dot_linear)); }
