/*
 * Rows of x quantized to int8 per block of 32 for the CPU quantized linear (quant_linear.cpp
 * states the rounding), the sums of x' per weight group that int4 offsets meet, and the calling
 * thread's workspace those and the int4 pairs' layout (quant_int4_pairs.h) live in from call to
 * call. Every path, row layout or row tiles, multiplies the same xq and xs.
 */

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "quant_int4_pairs.h"
#include "quant_rows.h"

namespace vllm_quant_activations {
namespace {  // internal linkage: see quant_rows.h

using vllm_quant_rows::kBlock;
#ifdef VLLM_QUANT_AVX2
using vllm_quant_rows::Int4Pairs;
using vllm_quant_rows::kPairLayoutBytes;
#endif

constexpr int64_t kPrepRowsPerTask = 32;  // rows of x a thread quantizes and lays out at a time

// One row of x -> xq [K] and xs [ceil(K / 32)], as the header states.
inline void quantize_row(const float* x, int64_t K, int8_t* xq, float* xs) {
  int64_t k0 = 0, b = 0;
#ifdef VLLM_QUANT_AVX2
  for (; k0 + kBlock <= K; k0 += kBlock, ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + k0 + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    xs[b] = d;
    // cvtps rounds half to even (the default MXCSR mode). |x * inv| exceeds 127 only where d is
    // subnormal and inexact: the clamp keeps the scalar path's values there. The packs
    // interleave 128-bit lanes; the permute restores feature order.
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], inv), lo), hi));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + k0),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
#endif
  for (; k0 < K; k0 += kBlock, ++b) {
    const int64_t len = std::min(kBlock, K - k0);
    float amax = 0.f;
    for (int64_t j = 0; j < len; ++j) amax = std::max(amax, std::fabs(x[k0 + j]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    xs[b] = d;
    for (int64_t j = 0; j < len; ++j) {
      const float r = std::nearbyint(x[k0 + j] * inv);  // default rounding mode: half to even
      xq[k0 + j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
    }
  }
}

// What GGUF Q4_K's offsets meet: x' summed per weight group, gsums[m, g] = the sum over the group's
// blocks b of xs[m, b] times the integer sum of xq over block b (fp32, in block order). K is a
// multiple of group, group of 32.
inline void group_sums(const int8_t* xq, const float* xs, int64_t M, int64_t K, int64_t group,
                       std::vector<float>& sums) {
  const int64_t G = K / group, nblocks = K / kBlock, per_group = group / kBlock;
  sums.resize(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        int32_t t = 0;
        for (int64_t j = 0; j < kBlock; ++j) t += xq[m * K + b * kBlock + j];
        s += xs[m * nblocks + b] * static_cast<float>(t);
      }
      sums[m * G + g] = s;
    }
}


// What a call lays x out in, kept by the calling thread from call to call: a decode step makes
// ~200 calls, and allocating these each time (64-byte aligned vectors among them) cost ~3% of
// SmolLM2's int4 step in malloc, with the caches that churns. Sizes follow each call (resize);
// every element a call reads it has written first.
struct Workspace {
  std::vector<int8_t> xq;       // [M, K]
  std::vector<float> xs;        // [M, ceil(K / 32)]
  std::vector<float> gsums;     // [M, G] (group_sums), where weights have offsets
  std::vector<float> sums;      // [M, N] fp32 sums of a bf16 out
  std::vector<uint8_t> xu;      // [M, K] xq + 128 (dot_blocks_rows), int8 with several rows only
  std::vector<int32_t> xsum;    // [M, K / 32 * kXSums] sums of xq per (half) block (row tiles only)
#ifdef VLLM_QUANT_AVX2
  std::vector<Int4Pairs> pairs; // one per row of x, paired int4 only
#endif

  // After a call: buffers a long prompt's rows grew (hundreds of MB at thousands of rows) are
  // freed rather than held for the thread's lifetime; a decode batch's are kept for the next call.
  void trim() {
    constexpr size_t kKeptBytes = size_t{64} << 20;
    const auto drop = [&](auto& v, size_t bytes) {
      if (bytes > kKeptBytes) std::decay_t<decltype(v)>().swap(v);
    };
    const auto bytes = [](const auto& v) {
      return v.capacity() * sizeof(typename std::decay_t<decltype(v)>::value_type);
    };
    drop(xq, bytes(xq)), drop(xs, bytes(xs)), drop(gsums, bytes(gsums)), drop(sums, bytes(sums)), drop(xu, bytes(xu));
    drop(xsum, bytes(xsum));
#ifdef VLLM_QUANT_AVX2
    drop(pairs, pairs.empty() ? 0 : pairs.size() * pairs[0].lo.capacity() * kPairLayoutBytes);
#endif
  }
};

inline Workspace& calling_thread_workspace() {
  thread_local Workspace workspace;
  return workspace;
}

// Every row of x (fp32 or bf16 [M, K]) quantized into work.xq [M, K] and work.xs [M, ceil(K / 32)]:
// on the intra-op threads where there are many rows (a prompt's); a decode's few on the calling
// thread.
inline void quantize_x(const at::Tensor& x, Workspace& work) {
  const int64_t M = x.size(0), K = x.size(1), nblocks = (K + kBlock - 1) / kBlock;
  work.xq.resize(M * K), work.xs.resize(M * nblocks);
  int8_t* xq = work.xq.data();
  float* xs = work.xs.data();
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, M, kPrepRowsPerTask, [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> widened;  // one row of a bf16 x at a time
    widened.resize(bf16_x ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = bf16_x ? widened.data() : x.data_ptr<float>() + m * K;
      if (bf16_x) {
        const uint16_t* bits = static_cast<const uint16_t*>(x.data_ptr()) + m * K;
        for (int64_t k = 0; k < K; ++k) widened[k] = vllm_cpu_bits::widen(bits[k]);
      }
      quantize_row(xr, K, xq + m * K, xs + m * nblocks);
    }
  });
}

}  // namespace
}  // namespace vllm_quant_activations
