/*
 * The row layout's loops of the CPU quantized linear (quant_linear.cpp states the semantics and
 * the work split; quant_int4_pairs.h holds int4's paired loop, quant_tiles.h the row tiles): a
 * weight row's blocks of 32 against one or two rows of x quantized to int8 per block of 32, the
 * scalar path for what the vector loops do not take, and the offsets of int4 formats with them.
 * Everything here is a function of its arguments; the caller splits the work.
 *
 * Vector path (AVX2 + FMA + F16C, the compiler targeting them through -march=native): a block of
 * 32 weights meets 32 int8 activations in _mm256_maddubs_epi16 + _mm256_madd_epi16 (unsigned x
 * signed bytes), or one vpdpbusd where the compiler targets AVX512-VNNI or AVX-VNNI. int8: |w|
 * against x with w's sign, so w = -128 from a GGUF file stays exact; int4: the stored nibbles
 * (q + 8, unsigned) against x, less 8 x summed once per block of x. Each int32 lane holds 4
 * consecutive products, so lanes 0-3 are features 0-15 and lanes 4-7 features 16-31: groups of
 * 16 (GGUF Q6_K's) get one scale per half. Other groups (not 16, not a multiple of 32, not one
 * per row) and a last short block take the scalar path (dot_scalar), which does the same integer
 * math and is the whole kernel where AVX2 is absent. Scales are read as stored (fp32, bf16 bits,
 * GGUF's fp16 d); only the scalar path and K-quant scales outside their own loop read an fp32 copy
 * the caller makes. int8 against several rows of x (dot_blocks_rows, AVX512-VNNI): x + 128
 * unsigned against w as stored, less 128 times the weight sums formed once per block for all rows
 * of x, two rows of x at a time: the same integer sums in fewer instructions.
 */

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"
#include "prefetch.h"

// What the compiler targets (-march=native): the vector path needs AVX2 + FMA + F16C; with
// AVX512-VNNI besides, the paired int4 loop takes eight pairs a vector and quant_tiles.h's row
// tiles are built (VLLM_QUANT_OCTS).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLLM_QUANT_AVX2 1
#endif
#if defined(VLLM_QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VLLM_QUANT_OCTS 1
#endif

namespace vllm_quant_rows {
// Internal linkage, as quant_linear.cpp's own functions (these headers are parts of that one
// translation unit): the compiler then inlines the loops into their callers as before the split;
// with vague linkage dot_blocks and dot_blocks_rows stayed out of line (SmolLM2's int8 head at 8
// rows of x 1.06x the time).
namespace {

constexpr int64_t kBlock = 32;  // activation block, and the int4 packing block
// How far ahead of a row's reads the asks of one row of x go.
constexpr int64_t kStreamAskAhead = 4096;

// Weight value k of row `row` (int8: the byte; int4: its nibble minus 8).
template <bool kInt4>
inline int32_t weight_at(const uint8_t* row, int64_t k) {
  if constexpr (kInt4) {
    const uint8_t byte = row[(k / kBlock) * (kBlock / 2) + (k % kBlock) % (kBlock / 2)];
    return static_cast<int32_t>((k % kBlock) < kBlock / 2 ? byte & 0x0F : byte >> 4) - 8;
  } else {
    return static_cast<int8_t>(row[k]);
  }
}

// GCC 12's vectorizer turns this loop's signed x signed byte products into vpdpbusd, which
// takes one operand as unsigned: wrong sums wherever the compiler targets AVX-VNNI or
// AVX512-VNNI (caught on an AVX-512 EPYC by the odd-group tests). The loop only runs for groups
// the vector path does not take and a last short block, so it stays scalar.
#if defined(__GNUC__) && !defined(__clang__)
#define VLLM_NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#else
#define VLLM_NO_VECTORIZE
#endif

// Features [k_begin, K) of one (m, n) pair, one integer sum per run sharing a block and a group.
template <bool kInt4>
VLLM_NO_VECTORIZE float dot_scalar(const uint8_t* row, const float* ws, const int8_t* xq, const float* xs,
                                   int64_t k_begin, int64_t K, int64_t group) {
  float total = 0.f;
  int64_t k = k_begin;
  while (k < K) {
    const int64_t b = k / kBlock, g = k / group;
    const int64_t end = std::min({(b + 1) * kBlock, (g + 1) * group, K});
    int32_t isum = 0;
    for (; k < end; ++k) isum += static_cast<int32_t>(xq[k]) * weight_at<kInt4>(row, k);
    total += xs[b] * ws[g] * static_cast<float>(isum);
  }
  return total;
}

// Per-group offsets of int4 weights other than Q4_K's: fp32 [N, G] as given, or GGUF Q4_1's fp16
// mins m [N, G] beside fp16 scales d, the group's offset m + 8d (formed in fp32: 8d is exact, so
// one rounding, as quantization.py's group_offsets forms it). The paired loop adds them itself
// (dot_int4_pairs; Q4_1's as d q + m there), the other paths after a row's sums (offsets_dot).
struct Offsets {
  const float* fp32 = nullptr;
  const c10::Half* mins = nullptr;
  const c10::Half* scales = nullptr;  // with mins
  int64_t pitch = 0;                  // elements from one row's offsets (and those scales) to the next

  bool any() const { return fp32 != nullptr || mins != nullptr; }
  // The same offsets from row n on.
  Offsets from_row(int64_t n) const {
    return {fp32 == nullptr ? nullptr : fp32 + n * pitch, mins == nullptr ? nullptr : mins + n * pitch,
            scales == nullptr ? nullptr : scales + n * pitch, pitch};
  }
};

#ifdef VLLM_QUANT_AVX2
// 8 int32 lanes, lane i = sum of the products of bytes 4i..4i+3 of u (unsigned) and s (signed).
// Pairs of products must fit int16, as they do for every caller: 2 * 128 * 127 < 32768.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// What block_dot subtracts from int4 sums, per block of x: 8 times x, as lanes (0 for int8).
template <bool kInt4>
inline __m256i block_bias(__m256i x) {
  if constexpr (kInt4) return dot_u8_s8(_mm256_set1_epi8(8), x);
  return _mm256_setzero_si256();
}

// Block b of a weight row against a block of x: int32 lanes as dot_u8_s8 lays them out.
//   int8: |w| against x with w's sign, so w = -128 (possible in a GGUF file) stays exact.
//   int4: the stored nibbles q + 8 go straight in as the unsigned operand; 8 x comes off after.
template <bool kInt4>
inline __m256i block_dot(const uint8_t* row, int64_t b, __m256i x, __m256i x_bias) {
  if constexpr (kInt4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                             _mm256_set1_epi8(0x0F));  // [low nibbles (0-15), high (16-31)]
    return _mm256_sub_epi32(dot_u8_s8(nibbles, x), x_bias);
  } else {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
    return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // |-128| reads as unsigned 128
  }
}

inline float hsum2(__m128 v) { return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v))); }  // lanes 0 + 1

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A weight scale as stored (fp32, bf16 bits, fp16) as fp32: exact.
inline float scale_at(const float* p) { return *p; }
inline float scale_at(const uint16_t* p) { return vllm_cpu_bits::widen(*p); }
inline float scale_at(const c10::Half* p) { return _cvtsh_ss(p->x); }

// Full blocks [0, nfull) of the kRows weight rows rs rows apart (rows + r * rs * row_bytes, their
// scales ws + r * rs * G) against one row of x: out[r * rs] = their sums. Several weight rows share
// each load of x and keep independent accumulators in flight. group is 16, a multiple of 32, or K.
// kAsk (int8, groups of 32 or more): each row's stream asked kStreamAskAhead on into L2, a line
// per two blocks. One thread, one row of x: on Zen 3, 2048 x 8192 alone, cold, 25% faster and
// Granite-3.3-2B's int8 decode step 120.8 -> 112.9 and 115.3 -> 110.1 ms in the engine; on Zen 4
// (VNNI), 2048 x 8192 14.7 -> 19.7 GB/s (8192 x 2048's rows, not asked, the same), its down_proj
// in that decode 13.6% faster timed per op, the step 0.95-0.99x in three alternating runs.
// sc, d (groups of 16: GGUF Q6_K's two-level scales, else null): the rows' int8 sub-scales [.., G]
// and their superblocks' d [.., G / 16], read instead of ws: each scale d * sc, exact.
// ws: the scales as stored, S = float, uint16_t (bf16 bits) or c10::Half (GGUF Q8_0's d), instead
// of an fp32 copy made per call (an allocation and a pass over [N, K / 32] per call; per-round
// A/B medians 0.98-1.12x, cold, one and two Zen 4 threads, on a host too noisy to say more).
template <bool kInt4, int kRows, bool kAsk, typename S>
void dot_blocks(const uint8_t* rows, int64_t row_bytes, const S* ws, int64_t G, const int8_t* xq,
                const float* xs, int64_t nfull, int64_t group, float* out, int64_t rs, const int8_t* sc,
                const float* d) {
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  if (group == 16) {
    float formed[kRows][16];  // Q6_K: the current superblock's scales of each row
    for (int64_t b = 0; b < nfull; ++b) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i x_bias = block_bias<kInt4>(x);
      const __m256 x_scale = _mm256_broadcast_ss(xs + b);
      if (sc != nullptr && b % 8 == 0)  // a superblock's 16 scales d * sc per row, formed once
        for (int r = 0; r < kRows; ++r) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + r * rs * G + 2 * b));
          const __m256 dr = _mm256_set1_ps(d[r * rs * (G / 16) + b / 8]);
          _mm256_storeu_ps(formed[r], _mm256_mul_ps(dr, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
          _mm256_storeu_ps(formed[r] + 8,
                           _mm256_mul_ps(dr, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))));
        }
      for (int r = 0; r < kRows; ++r) {
        // the block's two halves' scales
        const float w0 = sc != nullptr ? formed[r][2 * (b % 8)] : scale_at(ws + r * rs * G + 2 * b);
        const float w1 = sc != nullptr ? formed[r][2 * (b % 8) + 1] : scale_at(ws + r * rs * G + 2 * b + 1);
        const __m256 wd = _mm256_mul_ps(x_scale, _mm256_set_m128(_mm_set1_ps(w1), _mm_set1_ps(w0)));
        const __m256i s = block_dot<kInt4>(rows + r * rs * row_bytes, b, x, x_bias);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), wd, acc[r]);
      }
    }
  } else {
    // Blocks per group: whole groups of 32-blocks, or every full block when one group spans K.
    const int64_t per_group = group % kBlock == 0 ? group / kBlock : nfull;
    for (int64_t b0 = 0, g = 0; b0 < nfull; b0 += per_group, ++g) {
      const int64_t b_end = std::min(nfull, b0 + per_group);
      // The group's blocks scaled by x's scales, then once by the weight scale: one multiply less
      // per block where a group spans many blocks (int8 per channel).
      __m256 group_acc[kRows];
      for (int r = 0; r < kRows; ++r) group_acc[r] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b_end; ++b) {
        if constexpr (kAsk) {
          static_assert(!kInt4, "asks step a line per two blocks of int8");
          if (b % 2 == 0)
            for (int r = 0; r < kRows; ++r)
              vllm_cpu_bits::prefetch_to_l2(reinterpret_cast<const char*>(rows + r * rs * row_bytes + b * kBlock) +
                                           kStreamAskAhead);
        }
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
        const __m256i x_bias = block_bias<kInt4>(x);
        const __m256 x_scale = _mm256_broadcast_ss(xs + b);
        for (int r = 0; r < kRows; ++r) {
          const __m256i s = block_dot<kInt4>(rows + r * rs * row_bytes, b, x, x_bias);
          group_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), x_scale, group_acc[r]);
        }
      }
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_fmadd_ps(group_acc[r], _mm256_set1_ps(scale_at(ws + r * rs * G + g)), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r * rs] = hsum(acc[r]);
}

#if defined(VLLM_QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VLLM_QUANT_INT8_ROWS 1
// int8 weights against kX <= 2 rows of x at once (several rows of x: batched decodes, short
// chunks, the LM head of a batch), groups of 32 or more: the same sums as dot_blocks, bit for
// bit, with a third of its instructions per row of x. x comes as x + 128 (xu, unsigned, [1, 255]),
// so one vpdpbusd takes it against w as stored; the 128 w it adds comes off by starting the sum
// at -128 times the block's weight sums, formed once per weight block for every row of x (exact in
// int32: |128 w| sums to at most 65536 a lane). dot_blocks takes |w| against x with w's sign: two
// more instructions per block and row of x. Rows of x i = 0 .. kX - 1 at xu + i K, xs + i nblocks,
// out + i N; weight rows and scales as dot_blocks'.
template <int kRows, int kX, bool kAsk, typename S>
void dot_blocks_rows(const uint8_t* rows, int64_t row_bytes, const S* ws, int64_t G, const uint8_t* xu,
                     const float* xs, int64_t nfull, int64_t group, int64_t K, int64_t nblocks, float* out,
                     int64_t N, int64_t rs) {
  const __m256i c128 = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[kX][kRows];
  for (int i = 0; i < kX; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t per_group = group % kBlock == 0 ? group / kBlock : nfull;
  for (int64_t b0 = 0, g = 0; b0 < nfull; b0 += per_group, ++g) {
    const int64_t b_end = std::min(nfull, b0 + per_group);
    __m256 group_acc[kX][kRows];
    for (int i = 0; i < kX; ++i)
      for (int r = 0; r < kRows; ++r) group_acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b_end; ++b) {
      if constexpr (kAsk) {
        if (b % 2 == 0)
          for (int r = 0; r < kRows; ++r)
            vllm_cpu_bits::prefetch_to_l2(reinterpret_cast<const char*>(rows + r * rs * row_bytes + b * kBlock) +
                                         kStreamAskAhead);
      }
      __m256i w[kRows], start[kRows];
      for (int r = 0; r < kRows; ++r) {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * rs * row_bytes + b * kBlock));
        start[r] = _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8_s8(c128, w[r]));
      }
      for (int i = 0; i < kX; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + i * K + b * kBlock));
        const __m256 x_scale = _mm256_broadcast_ss(xs + i * nblocks + b);
        for (int r = 0; r < kRows; ++r)
          group_acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start[r], x, w[r])), x_scale,
                                            group_acc[i][r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m256 scale = _mm256_set1_ps(scale_at(ws + r * rs * G + g));
      for (int i = 0; i < kX; ++i) acc[i][r] = _mm256_fmadd_ps(group_acc[i][r], scale, acc[i][r]);
    }
  }
  for (int i = 0; i < kX; ++i)
    for (int r = 0; r < kRows; ++r) out[i * N + r * rs] = hsum(acc[i][r]);
}
#endif
#endif  // VLLM_QUANT_AVX2

// sum_i a[i] * b[i] in fp32: eight lanes of products, each summed in order, then the lanes; the
// same inputs give the same bits wherever it runs.
inline float dot_fp32(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#ifdef VLLM_QUANT_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Row n's Offsets (above) against gsums in dot_fp32's order: the same bits from either form.
inline float offsets_dot(const Offsets& offs, int64_t n, int64_t G, const float* gsums) {
  if (offs.fp32 != nullptr) return dot_fp32(offs.fp32 + n * offs.pitch, gsums, G);
  const c10::Half* m = offs.mins + n * offs.pitch;
  const c10::Half* d = offs.scales + n * offs.pitch;
  float s = 0.f;
  int64_t g = 0;
#ifdef VLLM_QUANT_AVX2
  const auto widen = [](const c10::Half* h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  };
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= G; g += 8)
    acc = _mm256_fmadd_ps(_mm256_fmadd_ps(widen(d + g), _mm256_set1_ps(8.f), widen(m + g)),
                          _mm256_loadu_ps(gsums + g), acc);
  s = hsum(acc);
#endif
  for (; g < G; ++g) s += (static_cast<float>(m[g]) + 8.f * static_cast<float>(d[g])) * gsums[g];
  return s;
}

// GGUF K-quants' two-level form as quantization.py keeps it. Q4_K: per row the groups' 6-bit
// mins m (a byte each; the sub-scales sc are `scales`) and per superblock of 8 groups (d, dmin) in
// fp32 [N, G / 8, 2]; a group's scale is d * sc (exact) and its offset 8 d sc - dmin m (rounded
// once). Q6_K (int8, groups of 16): int8 sc as `scales`, d per 16 groups [N, G / 16, 1], no mins.
struct KQuant {
  KQuant() = default;
  KQuant(const uint8_t* m, const at::Tensor& t) : mins(m), superblocks(t.data_ptr<float>()), tensor(t) {}
  const uint8_t* mins = nullptr;
  const float* superblocks = nullptr;  // tensor's data
  at::Tensor tensor;
};

// Row n's Q4_K offsets (8 d sc - dmin m: every product exact, one rounding, as quantization.py's
// group_offsets forms them) against gsums, summed in group order. Only a build without AVX2 gets
// here: with it every Q4_K takes the paired path, which adds its offsets in its loop.
inline float kquant_offsets_dot(const uint8_t* sc, const KQuant& kq, int64_t n, int64_t G, const float* gsums) {
  const uint8_t* scr = sc + n * G;
  const uint8_t* mr = kq.mins + n * G;
  const float* dd = kq.superblocks + n * (G / 4);
  float sum = 0.f;
  for (int64_t g = 0; g < G; ++g)
    sum += (8.f * (dd[g / 8 * 2] * static_cast<float>(scr[g])) - dd[g / 8 * 2 + 1] * static_cast<float>(mr[g])) *
           gsums[g];
  return sum;
}

// The fp32 scales d * sc [N, G], for the paths that read fp32 scales.
inline at::Tensor kquant_scales(const at::Tensor& sc, const KQuant& kq) {
  const at::Tensor d = kq.tensor.select(2, 0);  // [N, superblocks]
  return d.repeat_interleave(sc.size(1) / d.size(1), 1).mul(sc.to(at::kFloat));
}

}  // namespace
}  // namespace vllm_quant_rows
