/*
 * Weight-only quantized linear layers on the CPU for few rows of x (decodes, short chunks): int8
 * and int4 weights with one fp32 scale per group of `group` input features, activations rounded
 * to int8 per block of 32 (GGUF Q8_0's scheme), integer dot products, fp32 accumulation. Built and
 * loaded by vllm/model_executor/layers/quantization.py through vllm/native_build.py.
 *
 * Semantics (quantization.py's `reference_linear` computes the same in torch):
 *   weights:
 *     int8:  wq[n, k] = qweight[n, k]                                       qweight int8 [N, K]
 *     int4:  within each block of 32 (GGUF Q4_0's block layout; group is a multiple of 32),
 *            byte j of block b of row n holds element 32 b + j in its low nibble and element
 *            32 b + j + 16 in its high nibble, both stored as q + 8:
 *            wq[n, k] = nibble - 8 in [-8, 7]                               qweight uint8 [N, K / 2]
 *     ws[n, k] = scales[n, k / group]                     scales fp32, bf16 or fp16 [N, K / group]
 *     GGUF Q4_K's two-level form (int4, group 32, `superblocks` fp32 [N, K / 256, 2] = d, dmin;
 *     scales and offsets uint8 [N, K / 32] = the 6-bit sc, m): ws[n, k] = d * sc (exact) and
 *     offsets[n, g] = 8 d sc - dmin m (rounded once), as quantization.py's group_scales /
 *     group_offsets form them; Q6_K's (int8, group 16, superblocks [N, K / 256, 1] = d, scales
 *     int8 sc): ws = d * sc
 *   activations, per row m and block b of 32 input features (the last block may be shorter):
 *     xs[m, b] = max_k |x[m, k]| / 127,  xq[m, k] = round_half_even(x[m, k] * (1 / xs[m, b]))
 *     (both fp32, 1 / xs taken as 0 for an all-zero block), clamped to [-127, 127]
 *   out[m, n] = sum_k xs[m, k / 32] * ws[n, k] * xq[m, k] * wq[n, k]   out fp32 or bf16 [M, N]
 *               (+ sum_g offsets[n, g] * gsums[m, g], int4 with offsets: GGUF Q4_K's, fp32 [N, G],
 *               or GGUF Q4_1's fp16 mins m [N, G] with fp16 scales d, offsets = m + 8d in fp32;
 *               gsums[m, g] = sum of xs * xq over group g: every weight of the group moved by it)
 *     computed as integer sums over each run of k sharing a block and a weight group, each
 *     scaled once and added in fp32 (offsets: in the paired loop, Q4_K's per superblock; on the
 *     other paths in a dot after a row's sums): equal to the formula up to
 *     fp32 rounding of those terms; a bf16 out holds those fp32 sums rounded to nearest even
 *     (torch's cast, bit for bit).
 *
 * Shapes: x fp32 or bf16 [M, K] contiguous (bf16 widened exactly: the fp32 values x.float()
 * holds); K a multiple of group; scales' rows each contiguous but possibly apart, offsets' rows
 * as far apart (Q4_1's scales and mins side by side per row, one stream: quantization.py's
 * q4_1_scales_and_mins). Checked before any work. A bf16 model's decode passes its
 * activations and output buffers as they are: no conversion ops around each call.
 *
 * Vector path (AVX2 + FMA + F16C, the compiler targeting them through -march=native): a block of
 * 32 weights meets 32 int8 activations in _mm256_maddubs_epi16 + _mm256_madd_epi16 (unsigned x
 * signed bytes), or one vpdpbusd where the compiler targets AVX512-VNNI or AVX-VNNI. int8: |w|
 * against x with w's sign, so w = -128 from a GGUF file stays exact; int4: the stored nibbles
 * (q + 8, unsigned) against x, less 8 x summed once per block of x. Each int32 lane holds 4
 * consecutive products, so lanes 0-3 are features 0-15 and lanes 4-7 features 16-31: groups of
 * 16 (GGUF Q6_K's) get one scale per half. Other groups (not 16, not a multiple of 32, not one
 * per row) and a last short block take the scalar path, which does the same integer math and is
 * the whole kernel where AVX2 is absent. int4 in groups of 32 over an even number of blocks (this
 * engine's own int4, GGUF Q4_0 and Q4_1) takes a paired path instead: two blocks per 32-byte load, x laid
 * out once per call to match the nibbles (layout_int4_pairs), the integer sums of four pairs
 * reduced to their eight blocks' sums and scaled at once by the blocks' x and weight scales:
 * 1.5-2.5x the per-block path's speed, 15-19 GB/s of weights on one Zen 3 thread (where the
 * compiler targets AVX512-VNNI, eight pairs at a time in 512-bit vectors first). It reads the
 * scales as stored, fp32, bf16 (int4 quantized at load) or fp16 (GGUF Q4_0's): 4-8% faster than
 * fp32 scales on cold megabyte-sized matrices, 10% fewer bytes; so does the per-block path
 * (GGUF Q8_0's fp16 d); only the scalar path and K-quant scales outside their own loops read an
 * fp32 copy made per call. int8 against several rows of x (dot_blocks_rows, AVX512-VNNI): x + 128
 * unsigned against w as stored, less 128 times the weight sums formed once per block for all rows
 * of x, two rows of x at a time: the same integer sums in fewer instructions. For one row of x,
 * tiles of both paths take rows spread over the task's range, each its own stream for the
 * hardware prefetchers; for
 * several, paired int4 tiles are neighbouring rows asked into L2 8 KB ahead by software prefetch
 * (see the work split and quant_linear's comments).
 *
 * Row tiles (quant_tiles.h, AVX512-VNNI builds): a qweight of 3 dims, int4 [N / 16, K / 32, 256]
 * or int8 [N / 16, K / 32, 512], is quantization.py's `tile` layout, 16 rows interleaved per
 * block; linear_int4 and linear_int8 hand it to tiled_linear (x quantized as here, the tasks
 * splitting the tiles). `tile_rows` says whether this build has them.
 *
 * Work split: x is quantized once per call, then at::parallel_for over output features, in
 * tiles of 4 weight rows that share each block of x; a tile is read from memory once per call
 * and stays in L1 across the few rows of x. Sums run in a fixed order per (m, n): results do not
 * depend on the thread count, nor on which rows share a tile.
 *
 * `round_activations` writes x' = xs * xq (fp32) for the torch path, which multiplies it by
 * dequantized weight tiles for many rows: one pass over x instead of torch's several.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "prefetch.h"
#include "row_tiles.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLLM_QUANT_AVX2 1
#endif
// The paired int4 path's eight pairs at a time in 512-bit vectors (dot_int4_pairs).
#if defined(VLLM_QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VLLM_QUANT_OCTS 1
#include "quant_tiles.h"
#endif

// The op namespace; a test builds this file a second time without AVX2 under another name.
#ifndef VLLM_QUANT_OPS
#define VLLM_QUANT_OPS vllm_quant
#endif

namespace {

constexpr int64_t kBlock = 32;  // activation block, and the int4 packing block
constexpr int kRowTile = 4;     // weight rows the vector path runs side by side
constexpr int64_t kPrepRowsPerTask = 32;  // rows of x a thread quantizes and lays out at a time
// Rows from which one row of x asks each spread int4 row's stream ahead (Asks::kStreams).
constexpr int64_t kStreamAskMinRowBytes = 512;
// int8 rows from which one row of x asks each row's stream ahead (dot_blocks' kAsk): shorter ones
// run from L2 or are too short for an ask 4 KB ahead to land in time.
constexpr int64_t kInt8StreamAskMinRowBytes = 4096;
// How far ahead of a row's reads the asks of one row of x go.
constexpr int64_t kStreamAskAhead = 4096;

// One row of x -> xq [K] and xs [ceil(K / 32)], as the header states.
void quantize_row(const float* x, int64_t K, int8_t* xq, float* xs) {
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

// Lanes as dot_u8_s8 lays them out, of u1 x s1 + u2 x s2. The int16 pair sums of the two products
// must fit int16 together, as they do for int4: 2 * 2 * 15 * 127 < 32768.
inline __m256i dot2_u8_s8(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)),
                           _mm256_set1_epi16(1));
#endif
}

// One row of x laid out for int4 weights in groups of 32, two blocks (32 bytes of nibbles) at a
// time. Loaded as one 32-byte vector, blocks 2p and 2p + 1 sit in its two 128-bit halves, so their
// low nibbles (features 0-15 of each) are one vector and their high nibbles (16-31) another; x is
// arranged to match once per call instead of shuffling the nibbles of every weight row:
//   lo = [x(2p)[0:16], x(2p+1)[0:16]], hi = [x(2p)[16:32], x(2p+1)[16:32]]   (int8)
//   bias = the lanes of 8 x (what the stored q + 8 adds), per pair; bias8 the same summed per
//   block, eight blocks (four pairs) a vector in block_sums8's order; xs8 x's block scales in
//   that order, eight blocks a vector; xs x's block scales as they are [2 npairs]
struct Int4Pairs {
  std::vector<__m256i> lo, hi, bias, bias8;
  std::vector<__m256> xs8;
  std::vector<__m256> gsums8;  // x' summed per block (group_sums), in xs8's order: what Q4_K's offsets meet
  const float* xs;
  const float* gsums;  // x' summed per block as they are [2 npairs], where weights have offsets
#ifdef VLLM_QUANT_OCTS
  // The same two pairs a vector (lo2[t] = [lo[2t], lo[2t + 1]]) over the whole eights of pairs;
  // bias16 and xs16 sixteen blocks (eight pairs) a vector, in block_sums16's order.
  std::vector<__m512i> lo2, hi2, bias16;
  std::vector<__m512> xs16;
  std::vector<__m512i> bias2;  // layout_int4_pairs' scratch: the bias two pairs a vector
#endif
};

// The int32 lanes of four consecutive pairs (dot_u8_s8's layout: lanes 0-3 of pair p sum block
// 2p, lanes 4-7 block 2p + 1) -> the eight blocks' sums, even blocks then odd ones:
// [B0 B2 B4 B6 | B1 B3 B5 B7]. Unpacks and adds stay within each 128-bit half; putting the sums in
// block order would take a cross-half permute per row, which measured 15-20% of the paired loop on
// Zen 3, so the scales are read in this order instead (scales8_even_odd). Exact integer sums.
inline __m256i block_sums8(const __m256i* pair_lanes) {
  const auto interleave_add = [](__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  };
  // per half: [p0 p1 p0 p1], [p2 p3 p2 p3] (two of each pair's four lanes summed)
  const __m256i s01 = interleave_add(pair_lanes[0], pair_lanes[1]);
  const __m256i s23 = interleave_add(pair_lanes[2], pair_lanes[3]);
  return _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
}

#ifdef VLLM_QUANT_OCTS
// block_sums8 on two pairs a vector: four vectors (pairs 8o .. 8o + 7, 16 blocks; 128-bit lane j
// of vector q holds block 4q + j's lanes) -> the 16 blocks' sums, element 4j + e = block 4e + j.
inline __m512i block_sums16(const __m512i* lanes) {
  const auto interleave_add = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  };
  const __m512i s01 = interleave_add(lanes[0], lanes[1]);
  const __m512i s23 = interleave_add(lanes[2], lanes[3]);
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}
// Element i of block_sums16's order is block 4 (i % 4) + i / 4.
inline __m512i order16() { return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); }
inline __m512 scales16(const float* ws) { return _mm512_permutexvar_ps(order16(), _mm512_loadu_ps(ws)); }
inline __m512 scales16(const uint16_t* ws) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws)));
  return _mm512_permutexvar_ps(order16(), _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
}
inline __m512 scales16(const c10::Half* ws) {
  return _mm512_permutexvar_ps(order16(), _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws))));
}
#endif

void layout_int4_pairs(const int8_t* xq, const float* xs, int64_t npairs, Int4Pairs& out, const float* gsums) {
  out.lo.resize(npairs), out.hi.resize(npairs), out.bias.resize(npairs);
  out.xs = xs, out.gsums = gsums;
  const auto half = [&](int64_t offset) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + offset)); };
  const __m256i eight = _mm256_set1_epi8(8);
  for (int64_t p = 0; p < npairs; ++p) {
    const int64_t k = 2 * kBlock * p;
    out.lo[p] = _mm256_set_m128i(half(k + kBlock), half(k));
    out.hi[p] = _mm256_set_m128i(half(k + kBlock + 16), half(k + 16));
    out.bias[p] = dot2_u8_s8(eight, out.lo[p], eight, out.hi[p]);
  }
  out.bias8.resize(npairs / 4), out.xs8.resize(npairs / 4);
  const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t g = 0; g < npairs / 4; ++g) {
    out.bias8[g] = block_sums8(&out.bias[4 * g]);
    out.xs8[g] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xs + 8 * g), even_odd);
  }
#ifdef VLLM_QUANT_OCTS
  const int64_t twos = npairs / 8 * 4;
  out.lo2.resize(twos), out.hi2.resize(twos);
  std::vector<__m512i>& bias2 = out.bias2;
  bias2.resize(twos);
  const auto join = [](__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); };
  for (int64_t t = 0; t < twos; ++t) {
    out.lo2[t] = join(out.lo[2 * t], out.lo[2 * t + 1]);
    out.hi2[t] = join(out.hi[2 * t], out.hi[2 * t + 1]);
    bias2[t] = join(out.bias[2 * t], out.bias[2 * t + 1]);
  }
  out.bias16.resize(twos / 4), out.xs16.resize(twos / 4);
  for (int64_t o = 0; o < twos / 4; ++o) {
    out.bias16[o] = block_sums16(&bias2[4 * o]);
    out.xs16[o] = scales16(xs + 16 * o);
  }
#endif
  out.gsums8.resize(gsums != nullptr ? npairs / 4 : 0);
  for (int64_t g = 0; g < static_cast<int64_t>(out.gsums8.size()); ++g)
    out.gsums8[g] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(gsums + 8 * g), even_odd);
}

// Eight blocks' weight scales, stored fp32, bf16 (its bits) or fp16 (GGUF's d), as fp32 lanes in
// block_sums8's order [s0 s2 s4 s6 | s1 s3 s5 s7]. bf16: an even block's bits are the low half of
// a 32-bit lane (shifted up they are its fp32), an odd block's the high half (masked they are).
inline __m256 scales8_even_odd(const float* ws) {
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(ws), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
inline __m256 scales8_even_odd(const uint16_t* ws) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws));
  return _mm256_castsi256_ps(
      _mm256_set_m128i(_mm_and_si128(bits, _mm_set1_epi32(static_cast<int32_t>(0xFFFF0000u))), _mm_slli_epi32(bits, 16)));
}
inline __m256 scales8_even_odd(const c10::Half* ws) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws));
  return _mm256_cvtph_ps(_mm_shuffle_epi8(bits, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)));
}
// GGUF Q4_K's 6-bit sub-scales (a byte each), to be multiplied by their superblock's d.
inline __m256 scales8_even_odd(const uint8_t* sc) {
  const __m128i bytes = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)),
                                         _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}
// Two blocks' weight scales as fp32 in the low lanes.
inline __m128i two_halves(const void* ws) {
  int32_t bits;
  std::memcpy(&bits, ws, sizeof(bits));
  return _mm_cvtsi32_si128(bits);
}
inline __m128 scales2(const float* ws) { return _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(ws)); }
inline __m128 scales2(const uint16_t* ws) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(two_halves(ws)), 16));
}
inline __m128 scales2(const c10::Half* ws) { return _mm_cvtph_ps(two_halves(ws)); }

// Weight rows n, n + rs, ..., n + (kRows - 1) rs (int4, group 32, an even number of blocks; their
// scales, and offsets where given, `pitch` elements from one row to the next: K / 32, or twice that
// for Q4_1's scales and mins, which quantization.py keeps side by side per row, one memory stream)
// against kX consecutive rows of x laid out by layout_int4_pairs (x[0 .. kX - 1]):
// out[j * out_stride + r * rs] = their sums. Per pair of blocks and row: one load, two masks, and
// per row of x one integer dot. Per four pairs, row and row of x: their eight blocks' integer sums
// gathered into one vector (block_sums8: six in-half unpacks, three adds), less x's bias, converted
// once and multiplied-added once by the eight blocks' scales (weight's times x's, one vector, in
// the same even-then-odd order). Converting, permuting scales and adding per pair instead
// measured 5-30% slower at one row of x (one Zen 3 thread, cold and hot; the same within noise at
// 2-16 rows). The pairs past the last four are scaled one by one. Two rows of x (kX = 2) share each
// load, unpacking and scale conversion of the weights; each (row, row of x) runs the same
// operations in the same order as with one, so its sum is bitwise the same whatever kX.
// Software prefetch into L2 (prefetch_to_l2: asks into L1 held its few miss buffers), by kAsks:
//   kTile (neighbouring rows, rs = 1; the first rows of x): the weights and scales 8 KB (of
//     weights) ahead of the tile, in memory order, a tile of short rows being one run of memory
//     (Granite-3.3-2B's shapes in the engine, int4 decode of 4 rows, one Zen 3 thread: step 259 ->
//     218 ms against asks into L1; SmolLM2 the same).
//   kStreams (rows spread rs apart, one row of x): each row's own stream 4 KB ahead, weights and
//     scales, the next tiles' rows lying right after this one's. For rows of 512 bytes or more
//     (quant_linear): Granite-3.3-2B int4 decode step 75 -> 71 ms in the engine (its 8192-feature
//     rows 30% faster cold alone); SmolLM2's 288-byte rows were 10-20% slower with the asks.
// With more rows of x than one call takes, the first call also keeps the tile's unpacked nibbles
// in `unpacked` [kRows, npairs, 2] and the others read them there (kNibbles) instead of unpacking
// the same weights again (3 of the loop's 11 vector operations; 3-7% faster at 8 rows of x on Zen 3).
enum class Nibbles { kUnpack, kUnpackAndKeep, kKept };
// A row of x's layout_int4_pairs bytes per pair of blocks (lo, hi, bias; with VLLM_QUANT_OCTS their
// copies two pairs a vector too), and the layout the rows of x of one pass over a range's weight
// tiles take at most (several rows of x): many rows' layouts would not stay in L2 while every tile
// passes over them.
#ifdef VLLM_QUANT_OCTS
constexpr int64_t kPairLayoutBytes = 6 * sizeof(__m256i);
#else
constexpr int64_t kPairLayoutBytes = 3 * sizeof(__m256i);
#endif
constexpr int64_t kXChunkBytes = 512 * 1024;
enum class Asks { kNone, kTile, kStreams };

template <int kRows, Asks kAsks, Nibbles kNibbles, typename S, int kX = 1>
void dot_int4_pairs(const uint8_t* rows, int64_t row_bytes, const S* ws, int64_t pitch, const Int4Pairs* x,
                    int64_t npairs, float* out, int64_t out_stride, __m256i* unpacked, int64_t rs, const float* dd,
                    const uint8_t* mins, const Offsets& offs) {
  constexpr int64_t kScaleBytes = 2 * sizeof(S);  // a row's per pair, against 32 of weights
  // Q4_1's mins: d q + m, the stored nibbles q against x as they are (no 8 x taken off) plus m
  // against x' summed per block: the value of d (q - 8) + (m + 8d) without the subtraction.
  const bool q4_1_mins = offs.mins != nullptr;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[kRows][kX];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kX; ++j) acc[r][j] = _mm256_setzero_ps();
  // kTile: pair p of the tile, 8 KB on.
  const auto ask = [&](int64_t p) {
    if constexpr (kAsks == Asks::kTile) {
      constexpr int64_t kAhead = 8192;
      const char* ahead = reinterpret_cast<const char*>(rows) + kAhead + p * kRows * kBlock;
      for (int64_t o = 0; o < kRows * kBlock; o += 64) vllm_cpu_bits::prefetch_to_l2(ahead + o);
      if (p % 2 == 0)
        vllm_cpu_bits::prefetch_to_l2(reinterpret_cast<const char*>(ws) + kAhead * kScaleBytes / kBlock +
                                     p * kRows * kScaleBytes);
    }
  };
  // kStreams: pairs p .. p + 3 of every row (two lines), 4 KB on; their scales every 32 pairs.
  const auto ask_streams = [&](int64_t p) {
    if constexpr (kAsks == Asks::kStreams) {
      constexpr int64_t kAhead = kStreamAskAhead;
      for (int r = 0; r < kRows; ++r) {
        const char* ahead = reinterpret_cast<const char*>(rows + r * rs * row_bytes + p * kBlock) + kAhead;
        vllm_cpu_bits::prefetch_to_l2(ahead);
        vllm_cpu_bits::prefetch_to_l2(ahead + 64);
        if (p % 32 == 0)
          vllm_cpu_bits::prefetch_to_l2(reinterpret_cast<const char*>(ws + r * rs * pitch) + p * kScaleBytes +
                                       kAhead * kScaleBytes / kBlock);
      }
    }
  };
  // Q4_K (S = uint8_t): row r's d (0) or dmin (1) of the superblock of pairs p .. p + 3.
  const auto superblock = [&](int r, int64_t p, int which) {  // Q4_K's scales are dense: pitch = G
    return dd[r * rs * (pitch / 4) + (p / 4) * 2 + which];
  };
  // Pair p of row r unpacked: its low nibbles and its high ones, as dot2_u8_s8 takes them.
  const auto pair_nibbles = [&](int64_t p, int r, __m256i& lo, __m256i& hi) {
    const int64_t kept = 2 * (r * npairs + p);  // an index: `unpacked` is null where nothing is kept
    if constexpr (kNibbles == Nibbles::kKept) {
      lo = unpacked[kept], hi = unpacked[kept + 1];
    } else {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * rs * row_bytes + p * kBlock));
      lo = _mm256_and_si256(w, mask), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
      if constexpr (kNibbles == Nibbles::kUnpackAndKeep) unpacked[kept] = lo, unpacked[kept + 1] = hi;
    }
  };
  int64_t p = 0;
#ifdef VLLM_QUANT_OCTS
  // Eight pairs at a time (not K-quants: their superblocks span four): the same steps on two pairs
  // a vector, sixteen blocks' sums scaled at once (kept nibbles: two pairs' lo, then their hi).
  // Half the instructions of two fours; one Zen 4 thread, alone: hot 0.76-0.95x the time, cold
  // 0.89-0.99x, four rows of x (bound by arithmetic) 0.80-0.94x; two threads cold 0.96-1.01x.
  __m512 acc16[kRows][kX];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kX; ++j) acc16[r][j] = _mm512_setzero_ps();
  if constexpr (!std::is_same_v<S, uint8_t>) {
    const __m512i mask16 = _mm512_set1_epi8(0x0F);
    for (; p + 8 <= npairs; p += 8) {
      const int64_t o = p / 8;
      for (int q = 0; q < 8; ++q) ask(p + q);
      ask_streams(p);
      ask_streams(p + 4);
      for (int r = 0; r < kRows; ++r) {
        const __m512 s16 = scales16(ws + r * rs * pitch + 2 * p);
        if (offs.any()) {  // in group order, as x[j].gsums: the lanes' order does not matter here
          const int64_t at = r * rs * pitch + 2 * p;
          const __m512 o16 =
              offs.fp32 != nullptr
                  ? _mm512_loadu_ps(offs.fp32 + at)
                  : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offs.mins + at)));
          for (int j = 0; j < kX; ++j)
            acc16[r][j] = _mm512_fmadd_ps(o16, _mm512_loadu_ps(x[j].gsums + 2 * p), acc16[r][j]);
        }
        __m512i lo[4], hi[4];
        for (int q = 0; q < 4; ++q) {
          // kept: two pairs' lo, then their hi
          const auto kept = [&] { return reinterpret_cast<__m512i*>(unpacked + 2 * (r * npairs + p + 2 * q)); };
          if constexpr (kNibbles == Nibbles::kKept) {
            lo[q] = _mm512_loadu_si512(kept()), hi[q] = _mm512_loadu_si512(kept() + 1);
          } else {
            const __m512i w = _mm512_loadu_si512(rows + r * rs * row_bytes + (p + 2 * q) * kBlock);
            lo[q] = _mm512_and_si512(w, mask16), hi[q] = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask16);
            if constexpr (kNibbles == Nibbles::kUnpackAndKeep) {
              _mm512_storeu_si512(kept(), lo[q]);
              _mm512_storeu_si512(kept() + 1, hi[q]);
            }
          }
        }
        for (int j = 0; j < kX; ++j) {
          const __m512 d16 = _mm512_mul_ps(x[j].xs16[o], s16);
          __m512i lanes[4];
          for (int q = 0; q < 4; ++q)
            lanes[q] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[q], x[j].lo2[4 * o + q]),
                                           hi[q], x[j].hi2[4 * o + q]);
          const __m512i block = block_sums16(lanes);
          const __m512i sums = q4_1_mins ? block : _mm512_sub_epi32(block, x[j].bias16[o]);
          acc16[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), d16, acc16[r][j]);
        }
      }
    }
  }
#endif
  for (; p + 4 <= npairs; p += 4) {
    for (int q = 0; q < 4; ++q) ask(p + q);
    ask_streams(p);
    for (int r = 0; r < kRows; ++r) {
      // [8 blocks, even then odd] weight scale x x scale
      __m256 s8 = scales8_even_odd(ws + r * rs * pitch + 2 * p);
      if constexpr (std::is_same_v<S, uint8_t>) {
        // Q4_K: a superblock (these 8 groups) of d * sc and its offsets 8 d sc - dmin m against x'
        // summed per group, every product exact and one rounding each, as group_offsets forms them.
        s8 = _mm256_mul_ps(s8, _mm256_set1_ps(superblock(r, p, 0)));
        const __m256 m8 = scales8_even_odd(mins + r * rs * pitch + 2 * p);
        const __m256 off8 = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(8.f), s8),
                                          _mm256_mul_ps(_mm256_set1_ps(superblock(r, p, 1)), m8));
        for (int j = 0; j < kX; ++j) acc[r][j] = _mm256_fmadd_ps(off8, x[j].gsums8[p / 4], acc[r][j]);
      } else if (offs.any()) {  // in group order, as x[j].gsums
        const int64_t at = r * rs * pitch + 2 * p;
        const __m256 o8 = offs.fp32 != nullptr
                              ? _mm256_loadu_ps(offs.fp32 + at)
                              : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offs.mins + at)));
        for (int j = 0; j < kX; ++j) acc[r][j] = _mm256_fmadd_ps(o8, _mm256_loadu_ps(x[j].gsums + 2 * p), acc[r][j]);
      }
      __m256i lo[4], hi[4];
      for (int q = 0; q < 4; ++q) pair_nibbles(p + q, r, lo[q], hi[q]);
      for (int j = 0; j < kX; ++j) {
        const __m256 d8 = _mm256_mul_ps(x[j].xs8[p / 4], s8);
        __m256i lanes[4];
        for (int q = 0; q < 4; ++q) lanes[q] = dot2_u8_s8(lo[q], x[j].lo[p + q], hi[q], x[j].hi[p + q]);
        const __m256i block = block_sums8(lanes);
        const __m256i sums = q4_1_mins ? block : _mm256_sub_epi32(block, x[j].bias8[p / 4]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d8, acc[r][j]);
      }
    }
  }
  // The pairs past the last four (up to three; one on SmolLM2's 576 features), one at a time. A
  // K-quant has none: its superblocks of 8 blocks make npairs a multiple of four.
  __m128 tail[kRows][kX];  // those pairs' offsets against x' summed per block, in the low two lanes
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kX; ++j) tail[r][j] = _mm_setzero_ps();
  if constexpr (!std::is_same_v<S, uint8_t>) {
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // block 2p's scale, then 2p + 1's
    for (; p < npairs; ++p) {
      ask(p);
      for (int r = 0; r < kRows; ++r) {
        const __m128 s2 = scales2(ws + r * rs * pitch + 2 * p);
        if (offs.any()) {
          const int64_t at = r * rs * pitch + 2 * p;
          const __m128 o2 = offs.fp32 != nullptr ? scales2(offs.fp32 + at) : scales2(offs.mins + at);
          for (int j = 0; j < kX; ++j) tail[r][j] = _mm_fmadd_ps(o2, scales2(x[j].gsums + 2 * p), tail[r][j]);
        }
        __m256i lo, hi;
        pair_nibbles(p, r, lo, hi);
        for (int j = 0; j < kX; ++j) {
          const __m128 x2 = _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(x[j].xs + 2 * p));
          const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(x2, s2)), halves);
          const __m256i dot = dot2_u8_s8(lo, x[j].lo[p], hi, x[j].hi[p]);
          const __m256i s = q4_1_mins ? dot : _mm256_sub_epi32(dot, x[j].bias[p]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kX; ++j)
#ifdef VLLM_QUANT_OCTS
      out[j * out_stride + r * rs] = hsum(acc[r][j]) + _mm512_reduce_add_ps(acc16[r][j]) + hsum2(tail[r][j]);
#else
      out[j * out_stride + r * rs] = hsum(acc[r][j]) + hsum2(tail[r][j]);
#endif
}
#endif

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
float offsets_dot(const Offsets& offs, int64_t n, int64_t G, const float* gsums) {
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
float kquant_offsets_dot(const uint8_t* sc, const KQuant& kq, int64_t n, int64_t G, const float* gsums) {
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
at::Tensor kquant_scales(const at::Tensor& sc, const KQuant& kq) {
  const at::Tensor d = kq.tensor.select(2, 0);  // [N, superblocks]
  return d.repeat_interleave(sc.size(1) / d.size(1), 1).mul(sc.to(at::kFloat));
}

// What GGUF Q4_K's offsets meet: x' summed per weight group, gsums[m, g] = the sum over the group's
// blocks b of xs[m, b] times the integer sum of xq over block b (fp32, in block order). K is a
// multiple of group, group of 32.
void group_sums(const int8_t* xq, const float* xs, int64_t M, int64_t K, int64_t group, std::vector<float>& sums) {
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

// Rows a tile of quant_tiles.h interleaves where this build has them (AVX512-VNNI), else 0:
// quantization.py lays weights out in tiles only where the kernel reads them.
int64_t tile_rows() {
#ifdef VLLM_QUANT_OCTS
  return vllm_quant_tiles::kTileRows;
#else
  return 0;
#endif
}

// byte_scales: a K-quant's sub-scales, which must be of that byte type, instead of fp32, bf16 or fp16 ones.
void check_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  int64_t group, int64_t k_per_row_byte, std::optional<at::ScalarType> byte_scales = std::nullopt) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x must be contiguous fp32 or bf16 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous 2-D");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * k_per_row_byte == K, "qweight holds ", qweight.size(1) * k_per_row_byte,
              " input features per row, x has ", K);
  TORCH_CHECK(group > 0 && K % group == 0, "group (", group, ") must divide K (", K, ")");
  const auto scale_type = scales.scalar_type();
  const bool typed = byte_scales ? scale_type == *byte_scales
                                 : scale_type == at::kFloat || scale_type == at::kBFloat16 || scale_type == at::kHalf;
  // Rows of scales may lie apart (Q4_1's scales beside their mins), each row dense; K-quants' dense.
  const bool rows_dense = scales.dim() == 2 && (scales.stride(1) == 1 || scales.size(1) == 1) &&
                          scales.stride(0) >= scales.size(1) && (!byte_scales || scales.is_contiguous());
  TORCH_CHECK(typed && rows_dense && scales.size(0) == N && scales.size(1) == K / group,
              !byte_scales                ? "scales must be fp32, bf16 or fp16 [N, K / group], each row contiguous"
              : *byte_scales == at::kByte ? "with superblocks, int4 scales must be contiguous uint8 [N, K / group]"
                                          : "with superblocks, int8 scales must be contiguous int8 [N, K / group]");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N,
              "out must be contiguous fp32 or bf16 [M, N]");
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
  std::vector<int32_t> xsum;    // [M, K / 32] block sums of xq (row tiles only)
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
    const auto bytes = [](const auto& v) { return v.capacity() * sizeof(typename std::decay_t<decltype(v)>::value_type); };
    drop(xq, bytes(xq)), drop(xs, bytes(xs)), drop(gsums, bytes(gsums)), drop(sums, bytes(sums)), drop(xu, bytes(xu));
    drop(xsum, bytes(xsum));
#ifdef VLLM_QUANT_AVX2
    drop(pairs, pairs.empty() ? 0 : pairs.size() * pairs[0].lo.capacity() * kPairLayoutBytes);
#endif
  }
};

Workspace& calling_thread_workspace() {
  thread_local Workspace workspace;
  return workspace;
}

// Every row of x (fp32 or bf16 [M, K]) quantized into work.xq [M, K] and work.xs [M, ceil(K / 32)]:
// on the intra-op threads where there are many rows (a prompt's); a decode's few on the calling
// thread.
void quantize_x(const at::Tensor& x, Workspace& work) {
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

template <bool kInt4>
void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& given_scales,
                  int64_t group, const Offsets& offsets, const KQuant& kq) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  const int64_t row_bytes = qweight.size(1), nblocks = (K + kBlock - 1) / kBlock;
#ifdef VLLM_QUANT_AVX2
  // int4 in groups of 32 (this file's own quantization, GGUF Q4_0 and Q4_1) over an even number of
  // blocks: the paired path, x laid out once per call.
  const bool paired = kInt4 && group == kBlock && nblocks % 2 == 0;
#else
  const bool paired = false;
#endif
  // Scales with rows apart (Q4_1's, beside their mins) as they are for the paired path; the other
  // paths index them densely and take a dense copy.
  const at::Tensor scales = paired ? given_scales : given_scales.contiguous();
  [[maybe_unused]] const int64_t pitch = scales.stride(0);
  // References, not the thread_local itself: the parallel tasks below must read this thread's.
  Workspace& work = calling_thread_workspace();
  std::vector<int8_t>& xq = work.xq;
  std::vector<float>& xs = work.xs;
  quantize_x(x, work);
  const bool has_offsets = offsets.any() || kq.mins != nullptr;
  std::vector<float>& gsums = work.gsums;
  if (has_offsets) group_sums(xq.data(), xs.data(), M, K, group, gsums);
#ifdef VLLM_QUANT_AVX2
  const bool q6_in_loop = !kInt4 && kq.superblocks != nullptr;  // dot_blocks forms Q6_K's d * sc itself
#else
  const bool q6_in_loop = false;
#endif
#ifdef VLLM_QUANT_AVX2
  const bool vector = group == 16 || group % kBlock == 0 || G == 1;  // what dot_blocks handles
  const int64_t k_vector = vector ? (K / kBlock) * kBlock : 0;  // features the vector path covers
  std::vector<Int4Pairs>& pairs = work.pairs;
  pairs.resize(paired ? M : 0);
  // The paired int4 path. One row of x (decodes of one sequence): tiles of four rows spread over
  // the task's range (vllm_cpu_bits::for_strided_tiles), each row a stream of its own for the
  // hardware prefetchers, no software prefetch: in the engine, Granite-3.3-2B's int4 decode step
  // 9-10% faster than neighbouring rows asked 8 KB ahead (one Zen 3 thread, alternating steps in
  // one process), SmolLM2's 1-5%. Several rows of x: neighbouring tiles of four, asked ahead,
  // their nibbles unpacked once for all rows of x; there the loop is bound by arithmetic, and
  // spread rows measured 5-25% slower. A row's sums are the same either way.
  // Rows of x per pass over the weight tiles (several rows): as many as kXChunkBytes of layout.
  const int64_t x_chunk = std::max<int64_t>(2, kXChunkBytes / std::max<int64_t>(1, nblocks * kPairLayoutBytes / 2));
  at::parallel_for(0, static_cast<int64_t>(pairs.size()), kPrepRowsPerTask, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      layout_int4_pairs(xq.data() + m * K, xs.data() + m * nblocks, nblocks / 2, pairs[m],
                        has_offsets ? gsums.data() + m * G : nullptr);
  });
#else
  const int64_t k_vector = 0;
#endif
#ifdef VLLM_QUANT_INT8_ROWS
  // Several rows of int8: x + 128 for dot_blocks_rows, once per call. Not for two or three rows
  // of short weight rows, where it measured 1.09-1.16x slower (49152 x 576, SmolLM2's head, two
  // rows of x; three 0.95-1.02x; one Zen 4 thread), while 4-16 rows took 0.72-0.86x the time on
  // SmolLM2's shapes and 2-16 rows of 2048 features 0.72-0.84x.
  const bool int8_rows = !kInt4 && group != 16 && (M >= 4 || (M >= 2 && K >= 2048)) && k_vector > 0;
  std::vector<uint8_t>& xu = work.xu;
  xu.resize(int8_rows ? M * K : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xu.size()); ++i) xu[i] = static_cast<uint8_t>(xq[i] + 128);
#endif
  // Scales read as stored: by the paired path and Q6_K's loop, and by dot_blocks where it covers
  // every feature (no scalar tail) in groups of 32 or more; else an fp32 copy (K-quants: d * sc).
  const bool as_stored = scales.scalar_type() == at::kFloat || paired || q6_in_loop ||
                         (kq.superblocks == nullptr && group != 16 && k_vector == K);
  const at::Tensor read_scales = as_stored ? scales
                                 : kq.superblocks != nullptr ? kquant_scales(scales, kq)
                                                             : scales.to(at::kFloat);
  const float* sp = read_scales.scalar_type() == at::kFloat ? read_scales.data_ptr<float>() : nullptr;
  [[maybe_unused]] const int8_t* q6_sc = q6_in_loop ? scales.data_ptr<int8_t>() : nullptr;
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  // The fp32 sums; a bf16 out gets them rounded once a task's range is done.
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  work.sums.resize(bf16_out ? M * N : 0);
  float* op = bf16_out ? work.sums.data() : out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
#ifdef VLLM_QUANT_AVX2
    // A tile of weight rows first, first + rs, ... against every row of x: the tile stays in L1
    // while the rows of x pass over it.
    // The first row of x asks long int8 rows' streams ahead; the others find the tile in cache.
    const bool ask = !kInt4 && group != 16 && row_bytes >= kInt8StreamAskMinRowBytes;
    // f(the scales as dot_blocks and dot_blocks_rows read them: fp32 (none for Q6_K's), bf16 bits, fp16)
    const auto with_read_scales = [&](const auto& f) {
      if (sp != nullptr || q6_sc != nullptr)
        f(sp);
      else if (read_scales.scalar_type() == at::kBFloat16)
        f(static_cast<const uint16_t*>(read_scales.data_ptr()));
      else
        f(read_scales.data_ptr<c10::Half>());
    };
    const auto tile = [&](auto rows_tag, int64_t first, int64_t rs) {
      constexpr int kRows = decltype(rows_tag)::value;
      const auto rows_of_x = [&](auto ask_tag, int64_t m) {
        const auto run = [&](const auto* ws) {
          using S = std::remove_const_t<std::remove_pointer_t<decltype(ws)>>;
          dot_blocks<kInt4, kRows, decltype(ask_tag)::value, S>(
              qp + first * row_bytes, row_bytes, ws == nullptr ? nullptr : ws + first * G, G, xq.data() + m * K,
              xs.data() + m * nblocks, k_vector / kBlock, group, op + m * N + first, rs,
              q6_sc == nullptr ? nullptr : q6_sc + first * G,
              q6_sc == nullptr ? nullptr : kq.superblocks + first * (G / 16));
        };
        with_read_scales(run);
      };
#ifdef VLLM_QUANT_INT8_ROWS
      if (int8_rows) {  // two rows of x at a time
        const auto run = [&](const auto* ws) {
          using S = std::remove_const_t<std::remove_pointer_t<decltype(ws)>>;
          const auto rows_at = [&](auto x_tag, auto ask_tag, int64_t m) {
            dot_blocks_rows<kRows, decltype(x_tag)::value, decltype(ask_tag)::value, S>(
                qp + first * row_bytes, row_bytes, ws + first * G, G, xu.data() + m * K, xs.data() + m * nblocks,
                k_vector / kBlock, group, K, nblocks, op + m * N + first, N, rs);
          };
          int64_t m = 0;
          for (; m + 2 <= M; m += 2)
            if (m == 0 && ask)
              rows_at(std::integral_constant<int, 2>{}, std::true_type{}, m);
            else
              rows_at(std::integral_constant<int, 2>{}, std::false_type{}, m);
          if (m < M) rows_at(std::integral_constant<int, 1>{}, std::false_type{}, m);
        };
        with_read_scales(run);  // no Q6_K here (groups of 16 take dot_blocks)
        return;
      }
#endif
      for (int64_t m = 0; m < M; ++m)
        if (m == 0 && ask)
          rows_of_x(std::bool_constant<!kInt4>{}, m);
        else
          rows_of_x(std::false_type{}, m);
    };
    if (!pairs.empty()) {
      // A tile's unpacked nibbles, kept for the rows of x after the first ([kRows, npairs, 2]).
      // Kept by the thread running the task (the workspace above is the calling thread's).
      thread_local std::vector<__m256i> kept;
      kept.resize(M > 1 ? kRowTile * nblocks : 0);
      __m256i* unpacked = kept.data();
      const auto pair_tiles = [&](const auto* ws) {  // the scales as stored: fp32, bf16 bits or fp16
        using S = std::remove_const_t<std::remove_pointer_t<decltype(ws)>>;
        // Weight rows first, first + rs, ... against row m of x.
        const auto call = [&](auto kernel, int64_t first, int64_t rs, int64_t m) {
          const Offsets row_offsets = offsets.from_row(first);
          kernel(qp + first * row_bytes, row_bytes, ws + first * pitch, pitch, &pairs[m], nblocks / 2,
                 op + m * N + first, N, unpacked, rs,
                 kq.superblocks == nullptr ? nullptr : kq.superblocks + first * (G / 4),
                 kq.mins == nullptr ? nullptr : kq.mins + first * G, row_offsets);
        };
        if (M == 1) {
          const auto spread = [&](auto asks_tag) {
            n = vllm_cpu_bits::for_strided_tiles<kRowTile>(n, end, [&](auto rows_tag, int64_t first, int64_t rs) {
              call(dot_int4_pairs<decltype(rows_tag)::value, decltype(asks_tag)::value, Nibbles::kUnpack, S>, first,
                   rs, 0);
            });
          };
          if (row_bytes >= kStreamAskMinRowBytes)
            spread(std::integral_constant<Asks, Asks::kStreams>{});
          else
            spread(std::integral_constant<Asks, Asks::kNone>{});
          for (; n < end; ++n) call(dot_int4_pairs<1, Asks::kNone, Nibbles::kUnpack, S>, n, 1, 0);
          return;
        }
        // Rows m0 .. m1 - 1 of x two at a time, the first two unpacking the tile (and keeping it
        // for the others where there are more).
        const auto rows_of_x = [&](auto rows_tag, int64_t first, int64_t m0, int64_t m1) {
          constexpr int kRows = decltype(rows_tag)::value;
          if (m1 - m0 <= 2) {
            if (m1 - m0 == 2)
              call(dot_int4_pairs<kRows, Asks::kTile, Nibbles::kUnpack, S, 2>, first, 1, m0);
            else
              call(dot_int4_pairs<kRows, Asks::kTile, Nibbles::kUnpack, S, 1>, first, 1, m0);
            return;
          }
          call(dot_int4_pairs<kRows, Asks::kTile, Nibbles::kUnpackAndKeep, S, 2>, first, 1, m0);
          int64_t m = m0 + 2;
          for (; m + 2 <= m1; m += 2) call(dot_int4_pairs<kRows, Asks::kNone, Nibbles::kKept, S, 2>, first, 1, m);
          if (m < m1) call(dot_int4_pairs<kRows, Asks::kNone, Nibbles::kKept, S, 1>, first, 1, m);
        };
        // The rows of x in chunks whose layout stays in L2 while every tile of the range passes
        // over it; the tiles' weights are read again per chunk, from L3 or memory.
        for (int64_t m0 = 0; m0 < M; m0 += x_chunk) {
          const int64_t m1 = std::min(M, m0 + x_chunk);
          for (n = begin; n + kRowTile <= end; n += kRowTile) rows_of_x(vllm_cpu_bits::RowTile<kRowTile>{}, n, m0, m1);
          for (; n < end; ++n) rows_of_x(vllm_cpu_bits::RowTile<1>{}, n, m0, m1);
        }
      };
      if (kq.superblocks != nullptr)
        pair_tiles(scales.data_ptr<uint8_t>());
      else if (scales.scalar_type() == at::kBFloat16)
        pair_tiles(static_cast<const uint16_t*>(scales.data_ptr()));
      else if (scales.scalar_type() == at::kHalf)
        pair_tiles(scales.data_ptr<c10::Half>());
      else
        pair_tiles(sp);
    } else if (k_vector > 0) {
      // Tiles of four rows spread over the range (vllm_cpu_bits::for_strided_tiles), then single
      // rows. One Zen 3 thread, cold, int8: SmolLM2's shapes 7-14 GB/s with neighbouring rows and
      // software prefetch 8 KB ahead, 8-21 spread with none; its LM head 8-13 -> 10-19; Granite's
      // 2048 and 8192 features 11-12 -> 12-15. At several rows of x too (5-15% faster at 4). Rows
      // of 4 KB and more are asked ahead into L2 besides (kInt8StreamAskMinRowBytes).
      n = vllm_cpu_bits::for_strided_tiles<kRowTile>(n, end, tile);
      for (; n < end; ++n) tile(vllm_cpu_bits::RowTile<1>{}, n, 1);
    }
#endif
    for (; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = 0.f;
    if (k_vector < K) {
      for (n = begin; n < end; ++n)
        for (int64_t m = 0; m < M; ++m)
          op[m * N + n] += dot_scalar<kInt4>(qp + n * row_bytes, sp + n * G, xq.data() + m * K,
                                             xs.data() + m * nblocks, k_vector, K, group);
    }
    if (has_offsets && !paired)  // the paired path adds them in its loop
      for (n = begin; n < end; ++n)
        for (int64_t m = 0; m < M; ++m)
          op[m * N + n] += offsets.any() ? offsets_dot(offsets, n, G, gsums.data() + m * G)
                                         : kquant_offsets_dot(scales.data_ptr<uint8_t>(), kq, n, G,
                                                                   gsums.data() + m * G);
    if (bf16_out) {
      uint16_t* ob = static_cast<uint16_t*>(out.data_ptr());
      for (int64_t m = 0; m < M; ++m)
        vllm_cpu_bits::narrow_row(ob + m * N + begin, op + m * N + begin, end - begin);
    }
  });
  work.trim();
}


#ifdef VLLM_QUANT_OCTS
// Rows of x per pass over a task's tiles (several rows): as many as fit kXChunkBytes of xq, which
// then stays in L2 while each tile's blocks pass over it.
int64_t tile_x_chunk(int64_t K) { return std::max<int64_t>(vllm_quant_tiles::kRowsOfX, kXChunkBytes / K); }

// A weight in row tiles of format F (quant_tiles.h): out [M, N] = x' @ W'.T. x is quantized once
// per call as on the row layout, with the block sums (int4) or x + 128 (int8) the format reads;
// the tasks split the tiles.
template <typename F>
void tiled_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor* mins, const at::Tensor* supers = nullptr) {
  using S = typename F::Scale;
  using vllm_quant_tiles::kTileRows;
  constexpr bool kInt8 = F::kInt8;
  const int64_t M = x.size(0), K = x.size(1), T = qweight.size(0), B = qweight.size(1), N = T * kTileRows;
  Workspace& work = calling_thread_workspace();
  quantize_x(x, work);
  const int8_t* xq = work.xq.data();
  work.xsum.resize(kInt8 ? 0 : M * B);
  work.xu.resize(kInt8 ? M * K : 0);
  int32_t* xsum = work.xsum.data();
  uint8_t* xu = work.xu.data();
  at::parallel_for(0, M * B, kPrepRowsPerTask * B, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if constexpr (kInt8) {
        for (int64_t j = 0; j < kBlock; ++j) xu[i * kBlock + j] = static_cast<uint8_t>(xq[i * kBlock + j] + 128);
      } else {
        int32_t s = 0;
        for (int64_t j = 0; j < kBlock; ++j) s += xq[i * kBlock + j];
        xsum[i] = s;
      }
    }
  });
  std::vector<vllm_quant_tiles::XRow> rows(M);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = {xq + m * K, kInt8 ? xu + m * K : nullptr, work.xs.data() + m * B, kInt8 ? nullptr : xsum + m * B};
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  const vllm_quant_tiles::Out to{bf16_out ? nullptr : out.data_ptr<float>(),
                                 bf16_out ? static_cast<uint16_t*>(out.data_ptr()) : nullptr, N};
  const vllm_quant_tiles::Tiles<S> tiles{static_cast<const uint8_t*>(qweight.data_ptr()),
                                         reinterpret_cast<const S*>(scales.data_ptr()),
                                         mins == nullptr ? nullptr : reinterpret_cast<const S*>(mins->data_ptr()),
                                         scales.stride(0), scales.stride(1),
                                         supers == nullptr ? nullptr : supers->data_ptr<float>(),
                                         supers == nullptr ? 0 : supers->stride(0)};
  const int64_t chunk = M == 1 ? 1 : tile_x_chunk(K);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      vllm_quant_tiles::tiles_range<F>(tiles, B, rows.data(), m0, std::min(M, m0 + chunk), to, t0, t1);
  });
  work.trim();
}
#endif

// What every tiled weight's call checks: x, out and the tiles' shape against K (qweight
// [N / 16, K / 32, block_bytes]).
void check_tiled(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t block_bytes) {
  TORCH_CHECK(tile_rows() > 0, "quantized weights in row tiles need the AVX512-VNNI build of this kernel");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x must be contiguous fp32 or bf16 [M, K]");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(2) == block_bytes && x.size(1) == qweight.size(1) * kBlock,
              "tiled weights are contiguous [N / 16, K / 32, ", block_bytes, "], got ", qweight.sizes(), " for K = ",
              x.size(1));
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == qweight.size(0) * 16,
              "out must be contiguous fp32 or bf16 [M, N]");
}

// Scales of a tiled weight: [N / 16, G, 16], each 16 contiguous, G the groups per row.
bool tiled_scales(const at::Tensor& t, const at::Tensor& qweight, int64_t groups) {
  return t.dim() == 3 && t.size(0) == qweight.size(0) && t.size(1) == groups && t.size(2) == 16 && t.stride(2) == 1;
}

// GGUF Q4_K in row tiles: sc and m uint8 [T, B, 16] (each block's beside each other, as Q4_1's scales
// and mins), superblocks fp32 [T, B / 8, 2, 16] (d, then dmin, of the 16 rows); checked, then
// tiled_linear.
void tiled_q4_k(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sc,
                const std::optional<at::Tensor>& m, const at::Tensor& supers) {
  const int64_t T = qweight.size(0), B = qweight.size(1);
  TORCH_CHECK(B % 8 == 0 && sc.scalar_type() == at::kByte && tiled_scales(sc, qweight, B) && m &&
                  m->scalar_type() == at::kByte && tiled_scales(*m, qweight, B) && m->strides() == sc.strides(),
              "tiled Q4_K sc and m must be uint8 [N / 16, K / 32, 16] strided alike, K a multiple of 256");
  TORCH_CHECK(supers.scalar_type() == at::kFloat && supers.is_contiguous() && supers.dim() == 4 &&
                  supers.size(0) == T && supers.size(1) == B / 8 && supers.size(2) == 2 && supers.size(3) == 16,
              "tiled Q4_K superblocks must be contiguous fp32 [N / 16, K / 256, 2, 16]");
#ifdef VLLM_QUANT_OCTS
  tiled_linear<vllm_quant_tiles::Int4K>(out, x, qweight, sc, &*m, &supers);
#endif
}

// int4 weights in row tiles (quantization.py's `tile`): qweight [T, B, 256], scales [T, B, 16]
// bf16 or fp16, Q4_1's fp16 mins as the scales' neighbours, or Q4_K's two-level form (tiled_q4_k);
// checked, then tiled_linear.
void tiled_int4(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                int64_t group, const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& supers) {
  check_tiled(out, x, qweight, 256);
  TORCH_CHECK(group == kBlock, "tiled int4 weights come in groups of 32, got ", group);
  if (supers) {
    tiled_q4_k(out, x, qweight, scales, mins, *supers);
    return;
  }
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(tiled_scales(scales, qweight, qweight.size(1)) && (half || scales.scalar_type() == at::kBFloat16),
              "tiled int4 scales must be bf16 or fp16 [N / 16, K / 32, 16], each 16 contiguous");
  TORCH_CHECK(!mins || (half && mins->scalar_type() == at::kHalf && tiled_scales(*mins, qweight, qweight.size(1)) &&
                        mins->strides() == scales.strides()),
              "tiled int4 offsets must be fp16 mins [N / 16, K / 32, 16] with fp16 scales, strided as the scales");
#ifdef VLLM_QUANT_OCTS
  using vllm_quant_tiles::Int4;
  const at::Tensor* m = mins ? &*mins : nullptr;
  if (m != nullptr)
    tiled_linear<Int4<true, c10::Half>>(out, x, qweight, scales, m);
  else if (half)
    tiled_linear<Int4<false, c10::Half>>(out, x, qweight, scales, m);
  else
    tiled_linear<Int4<false, uint16_t>>(out, x, qweight, scales, m);
#endif
}

// int8 weights in row tiles: qweight [T, B, 512], scales fp32 [T, 1, 16] per output channel (group
// K) or fp32 / fp16 [T, B, 16] per block of 32 (GGUF Q8_0's d); checked, then tiled_linear.
void tiled_int8(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                int64_t group) {
  check_tiled(out, x, qweight, 512);
  const int64_t K = x.size(1);
  const bool per_channel = group == K, half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((per_channel || group == kBlock) &&
                  tiled_scales(scales, qweight, per_channel ? 1 : qweight.size(1)) &&
                  (scales.scalar_type() == at::kFloat || (half && !per_channel)),
              "tiled int8 scales must be fp32 [N / 16, 1, 16] per output channel (group K) or fp32 / fp16 "
              "[N / 16, K / 32, 16] in groups of 32, each 16 contiguous");
#ifdef VLLM_QUANT_OCTS
  using vllm_quant_tiles::Int8;
  if (per_channel)
    tiled_linear<Int8<false, float>>(out, x, qweight, scales, nullptr);
  else if (half)
    tiled_linear<Int8<true, c10::Half>>(out, x, qweight, scales, nullptr);
  else
    tiled_linear<Int8<true, float>>(out, x, qweight, scales, nullptr);
#endif
}

// out = x' (xs * xq per element, fp32) for the torch path's dense matmuls, one pass over x.
void round_activations(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be contiguous fp32 shaped as x");
  const int64_t M = x.size(0), K = x.size(1), nblocks = (K + kBlock - 1) / kBlock;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> xq(K);
    std::vector<float> xs(nblocks);
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K, K, xq.data(), xs.data());
      float* o = op + m * K;
      for (int64_t k0 = 0, b = 0; k0 < K; k0 += kBlock, ++b) {
        const int64_t len = std::min(kBlock, K - k0);
        for (int64_t j = 0; j < len; ++j) o[k0 + j] = static_cast<float>(xq[k0 + j]) * xs[b];
      }
    }
  });
}

void quant_linear_int8(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group, const std::optional<at::Tensor>& superblocks) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "int8 qweight must be int8");
  if (qweight.dim() == 3) {
    TORCH_CHECK(!superblocks, "Q6_K stays in the row layout");
    tiled_int8(out, x, qweight, scales, group);
    return;
  }
  if (superblocks.has_value()) {  // GGUF Q6_K: int8 sc per 16, d per 256
    const int64_t N = qweight.size(0), G = x.dim() == 2 ? x.size(1) / group : 0;
    TORCH_CHECK(group == 16 && G % 16 == 0 && superblocks->scalar_type() == at::kFloat &&
                    superblocks->is_contiguous() && superblocks->dim() == 3 && superblocks->size(0) == N &&
                    superblocks->size(1) == G / 16 && superblocks->size(2) == 1,
                "superblocks must be contiguous fp32 [N, K / 256, 1] with groups of 16");
    check_inputs(out, x, qweight, scales, group, 1, at::kChar);
    quant_linear<false>(out, x, qweight, scales, group, Offsets{}, KQuant(nullptr, *superblocks));
    return;
  }
  check_inputs(out, x, qweight, scales, group, 1);
  quant_linear<false>(out, x, qweight, scales, group, Offsets{}, KQuant{});
}

void quant_linear_int4(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group, const std::optional<at::Tensor>& offsets,
                       const std::optional<at::Tensor>& superblocks) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "int4 qweight must be uint8 (two values per byte)");
  if (qweight.dim() == 3) {
    tiled_int4(out, x, qweight, scales, group, offsets, superblocks);
    return;
  }
  TORCH_CHECK(group % kBlock == 0, "int4 group (", group, ") must be a multiple of 32");
  const int64_t N = qweight.size(0), G = x.size(1) / group;
  if (superblocks.has_value()) {  // GGUF Q4_K: sc and m as bytes, d and dmin per 8 groups
    check_inputs(out, x, qweight, scales, group, 2, at::kByte);
    TORCH_CHECK(group == kBlock && G % 8 == 0 && superblocks->scalar_type() == at::kFloat &&
                    superblocks->is_contiguous() && superblocks->dim() == 3 && superblocks->size(0) == N &&
                    superblocks->size(1) == G / 8 && superblocks->size(2) == 2,
                "superblocks must be contiguous fp32 [N, K / 256, 2] with groups of 32");
    TORCH_CHECK(offsets.has_value() && offsets->scalar_type() == at::kByte && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(),
                "with superblocks, offsets must be contiguous uint8 [N, K / group]");
    quant_linear<true>(out, x, qweight, scales, group, Offsets{}, KQuant(offsets->data_ptr<uint8_t>(), *superblocks));
    return;
  }
  check_inputs(out, x, qweight, scales, group, 2);
  Offsets given;
  if (offsets.has_value()) {
    const bool mins = offsets->scalar_type() == at::kHalf;
    TORCH_CHECK((offsets->scalar_type() == at::kFloat || (mins && scales.scalar_type() == at::kHalf)) &&
                    offsets->dim() == 2 && offsets->size(0) == N && offsets->size(1) == G &&
                    (offsets->stride(1) == 1 || G == 1) && offsets->stride(0) == scales.stride(0),
                "offsets must be [N, K / group] with the scales' row pitch, each row contiguous, fp32 or (with fp16 "
                "scales) fp16 mins");
    given.pitch = scales.stride(0);
    if (mins)
      given.mins = offsets->data_ptr<c10::Half>(), given.scales = scales.data_ptr<c10::Half>();
    else
      given.fp32 = offsets->data_ptr<float>();
  }
  quant_linear<true>(out, x, qweight, scales, group, given, KQuant{});
}

}  // namespace

TORCH_LIBRARY(VLLM_QUANT_OPS, m) {
  m.def("linear_int8(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, int group, Tensor? superblocks=None) "
        "-> ()");
  m.def("linear_int4(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, int group, Tensor? offsets=None, "
        "Tensor? superblocks=None) -> ()");
  m.def("round_activations(Tensor(a!) out, Tensor x) -> ()");
  m.def("tile_rows() -> int");
}

TORCH_LIBRARY_IMPL(VLLM_QUANT_OPS, CPU, m) {
  m.impl("linear_int8", TORCH_FN(quant_linear_int8));
  m.impl("linear_int4", TORCH_FN(quant_linear_int4));
  m.impl("round_activations", TORCH_FN(round_activations));
}

TORCH_LIBRARY_IMPL(VLLM_QUANT_OPS, CatchAll, m) { m.impl("tile_rows", TORCH_FN(tile_rows)); }
