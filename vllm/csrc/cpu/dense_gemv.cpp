/*
 * Dense linear layers on the CPU for few rows of x (decodes, short chunks): fp32 or bf16 weights
 * read once per call, fp32 or bf16 activations, fp32 accumulation. Built and loaded by
 * vllm/model_executor/layers/dense_gemv.py through vllm/native_build.py.
 *
 * Semantics (dense_gemv.py's `reference_linear` computes the same in float64):
 *   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])     x fp32 or bf16 [M, K], out [M, N] in x's dtype
 *     w = weight[n, k] as fp32: fp32 weights as they are; bf16 weights widened exactly (the 16
 *     bits of a bf16 are the high half of the fp32 with the same value: a shift, no rounding);
 *     a bf16 x widened the same way. bias (optional) fp32 [N], added once after the sum. A bf16
 *     out is that fp32 value rounded once to nearest even: what torch's .to(bfloat16) of the
 *     fp32 out gives, without the two conversions' passes and allocations per call.
 *   Each (m, n) is summed in one fixed order: 8 lanes, lane j taking k = j, j + 8, ... over the
 *   first floor(K / 8) * 8 features (one fused multiply-add each), the lanes added pairwise as
 *   ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the last K % 8 products in k order
 *   (fused multiply-adds). The order depends on neither the thread count, nor M, nor where a row
 *   falls in a tile, nor on AVX-512: the same x row gives bitwise the same output however it is
 *   batched, and an AVX2 build the same as an AVX-512 one. The portable path (no AVX2) keeps the
 *   order but may round each lane's products before adding them (no FMA): equal up to fp32
 *   rounding.
 *
 * Shapes: x fp32 or bf16 [M, K] contiguous; weight fp32 or bf16 [N, K] contiguous; out [M, N]
 * contiguous, x's dtype. Checked before any work.
 *
 * Vector path (AVX2 + FMA, the compiler targeting them through -march=native): tiles of 4 weight
 * rows, each 8-feature load of x shared by the 4 rows and each weight load by 2 rows of x (8
 * accumulators, 4 weights and 2 x vectors in the 16 ymm registers). K is walked in chunks of
 * `kChunk` features, so a tile's chunk (4 rows x 1024 fp32 = 16 KB) stays in L1 while every row
 * of x passes over it; the running sums live in a small per-thread buffer between chunks. A
 * tile's rows are not neighbours but lie evenly apart over the task's rows (`strided_tiles`): each
 * is its own sequential stream, pages apart, which the hardware prefetchers follow (see there).
 * With AVX-512 and 8 or more rows of x (where the kernel is compute-bound), tiles of 8 weight rows
 * in zmm registers that each hold two rows' 8 lanes against x's 8 features repeated: the same lanes
 * summed in the same order, with half the multiply-adds, each weight load shared by 4 rows of x.
 *
 * Work split: at::parallel_for over tiles of output rows, at least ~64 KB of weight per task so
 * that the small layers of a small model do not pay a fork per few microseconds of work.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "prefetch.h"
#include "row_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLM_DENSE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define VLLM_DENSE_AVX512 1
#endif
#endif

// The op namespace; a test builds this file a second time without AVX2 under another name.
#ifndef VLLM_DENSE_OPS
#define VLLM_DENSE_OPS vllm_dense
#endif

namespace {

constexpr int kLanes = 8;          // fp32 lanes of one ymm register: the summation order's lanes
constexpr int kYmmTile = 4;        // weight rows of a ymm tile (one row a register)
constexpr int kZmmTile = 8;        // weight rows of a zmm tile (two rows a register)
constexpr int kRowTile = 8;        // weight rows per unit of work split: whole tiles of either
constexpr int kZmmMinRows = 8;     // rows of x from which AVX-512 builds run zmm tiles
constexpr int64_t kChunk = 1024;   // features per pass over a tile (4 rows fp32: 16 KB of L1)
constexpr int64_t kTaskBytes = 64 * 1024;  // least weight bytes per parallel task
// bf16 rows of at least this many bytes are asked into L2 this far ahead, each row its own stream
// (see rows()).
constexpr int64_t kAskMinRowBytes = 4096;
constexpr int64_t kAskAhead = 4096;

using vllm_cpu_bits::narrow;  // fp32 -> bf16 bits rounded to nearest even; fp32 as is
using vllm_cpu_bits::widen;   // bf16 bits -> the fp32 of the same value; fp32 as is

// The lanes' pairwise sum, in the order the header states.
inline float lane_sum(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

// Products of features [k_begin, K) in k order, added to `sum` by fused multiply-adds (spelled
// out: the compiler contracts `sum += x * w` into one under some targets and not others).
template <typename W>
inline float tail(const W* w, const float* x, int64_t k_begin, int64_t K, float sum) {
  for (int64_t k = k_begin; k < K; ++k) sum = std::fma(x[k], widen(w[k]), sum);
  return sum;
}

#ifdef VLLM_DENSE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32, exactly
  return vllm_cpu_bits::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The register a pass accumulates in, and how a weight row and x fill it. Every lane sums one
// (row, lane) of the header's order with one FMA per 8 features, so Ymm and Zmm give bitwise the
// same results (tested: a build without AVX-512 against this one).
struct Ymm {  // 8 lanes of one weight row
  using V = __m256;
  static constexpr int kRows = 1;   // weight rows per register
  static constexpr int kXRows = 2;  // rows of x sharing each weight load: 8 accumulators, 4 weights, 2 x
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V x8(const float* x) { return _mm256_loadu_ps(x); }
  template <typename W>
  static V w8(const W* w, int64_t) { return load8(w); }
  static void store(float* lanes, V v) { _mm256_storeu_ps(lanes, v); }
};

#ifdef VLLM_DENSE_AVX512
// 8 lanes of each of two weight rows (the first in the low half, the one `row_stride` weights on
// in the high half) against x's 8 features repeated in both halves: half the FMAs of Ymm for the
// same sums.
struct Zmm {
  using V = __m512;
  static constexpr int kRows = 2;
  static constexpr int kXRows = 4;  // of the 32 zmm registers: 16 accumulators, 4 weights, 1 x
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V x8(const float* x) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(x)); }
  static V w8(const float* w, int64_t row_stride) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w)), _mm256_loadu_ps(w + row_stride), 1);
  }
  static V w8(const uint16_t* w, int64_t row_stride) {  // both rows' 8 bf16, widened as load8 does
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + row_stride));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return vllm_cpu_bits::widen16(both);
  }
  static void store(float* lanes, V v) { _mm512_storeu_ps(lanes, v); }
};
#endif

// Features [k0, k1) (multiples of 8) of the R weight rows w + r * row_stride against XR rows of x,
// in registers of Vec; acc [XR][R / Vec::kRows] holds the running lanes in and out. kAsk: each
// row's line kAskAhead bytes on is asked for once per line.
template <typename Vec, typename W, int R, int XR, bool kAsk = false>
inline void pass(const W* w, const float* x, int64_t K, int64_t row_stride, int64_t k0, int64_t k1,
                 typename Vec::V* acc) {
  constexpr int NV = R / Vec::kRows;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights of a cache line
  typename Vec::V a[XR][NV];
  for (int i = 0; i < XR; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = acc[i * NV + v];
  for (int64_t k = k0; k < k1; k += kLanes) {
    if constexpr (kAsk) {
      if (k % kLine == 0)
        for (int v = 0; v < NV; ++v)
          vllm_cpu_bits::prefetch_to_l2(reinterpret_cast<const char*>(w + v * Vec::kRows * row_stride + k) +
                                        kAskAhead);
    }
    typename Vec::V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Vec::w8(w + v * Vec::kRows * row_stride + k, row_stride);
    for (int i = 0; i < XR; ++i) {
      const typename Vec::V xv = Vec::x8(x + i * K + k);
      for (int v = 0; v < NV; ++v) a[i][v] = Vec::fma(wv[v], xv, a[i][v]);
    }
  }
  for (int i = 0; i < XR; ++i)
    for (int v = 0; v < NV; ++v) acc[i * NV + v] = a[i][v];
}

// Output rows n + r * rs (r < R) for every row of x. acc: scratch of M * R / Vec::kRows registers.
// kAsk: the first rows of x to pass over a chunk ask for the weights ahead (pass).
template <typename Vec, typename W, typename O, int R, bool kAsk = false>
void tile(const W* w, const float* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t n,
          int64_t rs, typename Vec::V* acc) {
  constexpr int NV = R / Vec::kRows;
  constexpr int XR = Vec::kXRows;
  const int64_t k_vec = K / kLanes * kLanes, row_stride = rs * K;
  for (int64_t i = 0; i < M * NV; ++i) acc[i] = Vec::zero();
  const W* wt = w + n * K;
  // Only the first pass over a chunk reads memory (and asks ahead, kAsk): the rows of x after it
  // find the tile in L1.
  for (int64_t k0 = 0; k0 < k_vec; k0 += kChunk) {
    const int64_t k1 = std::min(k_vec, k0 + kChunk);
    int64_t m = 0;
    const auto rows_of_x = [&](auto rows_tag) {  // the next rows_tag::value rows of x
      constexpr int X = decltype(rows_tag)::value;
      if (m == 0)
        pass<Vec, W, R, X, kAsk>(wt, x, K, row_stride, k0, k1, acc);
      else
        pass<Vec, W, R, X>(wt, x + m * K, K, row_stride, k0, k1, acc + m * NV);
      m += X;
    };
    while (m + XR <= M) rows_of_x(std::integral_constant<int, XR>{});
    if constexpr (XR > 2) {
      if (m + 2 <= M) rows_of_x(std::integral_constant<int, 2>{});
    }
    while (m < M) rows_of_x(std::integral_constant<int, 1>{});
  }
  for (int64_t m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) {
      float lanes[kLanes * Vec::kRows];
      Vec::store(lanes, acc[m * NV + v]);
      for (int h = 0; h < Vec::kRows; ++h) {
        const int64_t row = n + (v * Vec::kRows + h) * rs;
        const float sum = tail(w + row * K, x + m * K, k_vec, K, lane_sum(lanes + h * kLanes));
        out[m * N + row] = narrow<O>(bias ? sum + bias[row] : sum);
      }
    }
}

// Per-task scratch of the running lanes, for every register shape a task's tiles use.
struct Scratch {
  explicit Scratch(int64_t M) : ymm(M * kYmmTile / Ymm::kRows) {
#ifdef VLLM_DENSE_AVX512
    if (M >= kZmmMinRows) zmm.resize(M * kZmmTile / Zmm::kRows);
#endif
  }
  std::vector<__m256> ymm;
#ifdef VLLM_DENSE_AVX512
  std::vector<__m512> zmm;
#endif
};

// Tiles of R rows spread over [n, n_end) (vllm_cpu_bits::for_strided_tiles): SmolLM2's shapes
// read at 10-11 GB/s with a tile's rows neighbours even with software prefetch 8 KB ahead, 14
// (bf16) and 15-18 (fp32) spread with none (a plain sum: 14-16); long rows (K = 8192 fp32) the
// same either way. Returns the first row left (fewer than R remain).
template <typename Vec, typename W, typename O, int R, bool kAsk = false>
int64_t strided_tiles(const W* w, const float* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K,
                      int64_t n, int64_t n_end, typename Vec::V* acc) {
  return vllm_cpu_bits::for_strided_tiles<R>(n, n_end, [&](auto, int64_t first, int64_t q) {
    tile<Vec, W, O, R, kAsk>(w, x, bias, out, M, N, K, first, q, acc);
  });
}

// Output rows [n_begin, n_end): strided tiles of 4 (ymm) or, with AVX-512 and kZmmMinRows rows of
// x, of 8 and then 2 (zmm); single rows for what is left. With AVX-512, tiles of 8 rows in zmm
// registers (one AVX-512 EPYC thread, SmolLM2's shapes: 1.15-1.55x faster at 8 rows, 1.2-2x at
// 16, where the kernel is compute-bound); fewer rows stream the weights as fast or faster in ymm
// tiles of 4 (zmm tiles measured 0.8-1.0x at 1 and 4 rows). Both give bitwise the same sums.
template <typename W, typename O>
void rows(const W* w, const float* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t n_begin,
          int64_t n_end, Scratch& scratch) {
  int64_t n = n_begin;
#ifdef VLLM_DENSE_AVX512
  if (M >= kZmmMinRows) {
    n = strided_tiles<Zmm, W, O, kZmmTile>(w, x, bias, out, M, N, K, n, n_end, scratch.zmm.data());
    n = strided_tiles<Zmm, W, O, 2>(w, x, bias, out, M, N, K, n, n_end, scratch.zmm.data());
  }
#endif
  // bf16 rows of 4 KB and more: each tile row's stream asked into L2 ahead of its loads. One Zen 3
  // thread, cold, one row of x: 2048 x 8192 read at 18-20 -> 27 GB/s, 3072 x 2048 the same or a
  // few % faster, shorter rows unchanged (so not asked); Granite-3.3-2B bf16 decode step 224 ->
  // 204 ms in the engine. fp32 rows measured 5-25% slower with the asks at every length.
  constexpr bool kAsk = std::is_same_v<W, uint16_t>;  // fp32 instantiates no asking variant
  if (kAsk && K * static_cast<int64_t>(sizeof(W)) >= kAskMinRowBytes)
    n = strided_tiles<Ymm, W, O, kYmmTile, kAsk>(w, x, bias, out, M, N, K, n, n_end, scratch.ymm.data());
  else
    n = strided_tiles<Ymm, W, O, kYmmTile>(w, x, bias, out, M, N, K, n, n_end, scratch.ymm.data());
  for (; n < n_end; ++n) tile<Ymm, W, O, 1>(w, x, bias, out, M, N, K, n, 1, scratch.ymm.data());
}
#else
// One output row for every row of x, lanes as the vector path keeps them.
template <typename W, typename O>
void row(const W* w, const float* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t n) {
  const int64_t k_vec = K / kLanes * kLanes;
  const W* wr = w + n * K;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float lanes[kLanes] = {};
    for (int64_t k = 0; k < k_vec; k += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] += xr[k + j] * widen(wr[k + j]);
    const float sum = tail(wr, xr, k_vec, K, lane_sum(lanes));
    out[m * N + n] = narrow<O>(bias ? sum + bias[n] : sum);
  }
}
#endif

template <typename W, typename O>
void gemv(const W* w, const float* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + kRowTile - 1) / kRowTile;
  const int64_t tile_bytes = std::max<int64_t>(1, kRowTile * K * static_cast<int64_t>(sizeof(W)));
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * kRowTile, n_end = std::min(N, end * kRowTile);
#ifdef VLLM_DENSE_AVX2
    Scratch acc(M);  // [M, registers of a tile] running lanes
    rows<W, O>(w, x, bias, out, M, N, K, n_begin, n_end, acc);
#else
    for (int64_t n = n_begin; n < n_end; ++n) row<W, O>(w, x, bias, out, M, N, K, n);
#endif
  });
}

template <typename W>
void gemv_to(const at::Tensor& out, const W* w, const float* x, const float* bias, int64_t M, int64_t N, int64_t K) {
  if (out.scalar_type() == at::kFloat) {
    gemv<W, float>(w, x, bias, out.data_ptr<float>(), M, N, K);
  } else {
    gemv<W, uint16_t>(w, x, bias, vllm_cpu_bits::elements<uint16_t>(out), M, N, K);
  }
}

void dense_gemv(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous(),
              "x must be contiguous fp32 or bf16 [M, K], got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be contiguous fp32 or bf16 [N, K], got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight has ", weight.size(1), " input features, x has ", K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.size(0) == M &&
                  out.size(1) == N,
              "out must be contiguous [M, N] = [", M, ", ", N, "] in x's dtype ", x.scalar_type(), ", got ",
              out.scalar_type(), " of shape ", out.sizes());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->size(0) == N,
                "bias must be contiguous fp32 [N] = [", N, "], got ", bias->scalar_type(), " of shape ",
                bias->sizes());
    bp = bias->data_ptr<float>();
  }
  // A bf16 x widened once for the whole call (every tile reads it again): M * K floats.
  std::vector<float> widened;
  const float* xp = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  if (xp == nullptr) {
    const uint16_t* xb = vllm_cpu_bits::elements<uint16_t>(x);
    widened.resize(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) widened[i] = widen(xb[i]);
    xp = widened.data();
  }
  if (weight.scalar_type() == at::kFloat) {
    gemv_to<float>(out, weight.data_ptr<float>(), xp, bp, M, N, K);
  } else {
    gemv_to<uint16_t>(out, vllm_cpu_bits::elements<uint16_t>(weight), xp, bp, M, N, K);
  }
}

}  // namespace

TORCH_LIBRARY(VLLM_DENSE_OPS, m) { m.def("dense_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()"); }

TORCH_LIBRARY_IMPL(VLLM_DENSE_OPS, CPU, m) { m.impl("dense_gemv", TORCH_FN(dense_gemv)); }
