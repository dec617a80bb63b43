/*
 * Tiles of the CPU attention kernel for bf16 caches on CPUs with AVX512-BF16, for prompts and
 * decodes (keys and values read in place): vdpbf16ps multiplies two bf16 pairs per
 * fp32 lane and adds both products to it, so one instruction does the work of two fp32 FMAs and
 * the operands are read as stored (half the bytes, no widening).
 *
 * Semantics (paged_attention.cpp's, with two differences, both as torch's SDPA has them for bf16
 * on the CPU):
 *   logits  s = scale * <q, k>: each pair's two products (exact in fp32) are added to the fp32
 *           sum one after the other, rounding to nearest even; bf16 subnormal inputs count as 0
 *           and subnormal sums are flushed to 0 (the instruction's DAZ/FTZ).
 *   values  out += p_t * v_t with the probabilities p rounded to bf16 (nearest even), summed in
 *           fp32 like the logits.
 * Everything else (softmax, merge) stays fp32.
 *
 * Layout: a bf16 row of D features is read as D/2 uint32 "pairs" (features 2i, 2i + 1 in the low
 * and high halves). A prompt's keys are transposed by pair, [D/2, keys], a decode's read in place;
 * values are paired by key pair, [keys/2, D] (value rows 2i and 2i + 1 side by side by in-lane
 * unpacks, whose feature order the sums keep until unpermute_values; a decode's in registers);
 * probabilities are packed by key pair. Needs D % 32 == 0 (bf16_dot_head_size). Measured on Zen 4,
 * one thread, hot: bf16 decodes 0.77-0.88x the time of the fp32 tiles at 4-7 query heads per KV
 * head, the same at 3 (SmolLM2's 9/3).
 */

#pragma once

#include "attention_tiles.h"

#include <cstdint>

namespace vllm_attention_tiles {

// Head sizes the bf16 tiles take: whole 64-byte halves of a row per interleave step.
inline bool bf16_dot_head_size(int64_t D) { return D % 32 == 0; }

// Register tiles of bf16_block_logits: kBf16LogitRows query rows x kBf16LogitVecs vectors of keys,
// 24 accumulators. Per feature pair a tile loads 4 key vectors and broadcasts 6 query pairs for 24
// vdpbf16ps, as the value tiles (6 x 4) do; the fp32 tiles' 8 x 2 took 10 loads per 16, and the
// logits took 1.3x the value sums' time for the same multiply-adds (Zen 4).
constexpr int kBf16LogitRows = 6;
constexpr int kBf16LogitVecs = 4;

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// Whether this build has the tiles (the CPU it is built for has AVX512-BF16).
constexpr bool kHasBf16Dot = true;

using vllm_cpu_bits::as_bf16_pairs;

// Value rows are paired by in-lane unpacks (vpunpck{l,h}wd of two rows' 32 features), so the value
// tiles' sums come out in the unpacked order of attention_tiles.h (values_unpacked), which
// unpermute_values puts back once a row's sums are done. The same sums, feature by feature, as
// pairing the rows in feature order (which took a cross-lane vpermt2w per 16 pairs): a decode's
// attention took 0.91-0.96x the time with SmolLM2's 9/3 heads, the same within the runs' spread with
// Granite-3.3-2B's 32/8 (Zen 4, one thread).

// logits[r][t] = scale * <q[r], k_t> for t < n and the R rows of a tile. q2[r]: row r's P = D/2
// feature pairs; kt2 [P, ldk]: the keys' pairs transposed (column t = key t; ldk >= n rounded up
// to kBf16LogitVecs vectors).
template <int R>
inline void bf16_block_logits(float* const* logits, const uint32_t* const* q2, const uint32_t* kt2, int64_t ldk,
                              int64_t n, int64_t P, float scale) {
  constexpr int64_t W = 16;
  constexpr int KV = kBf16LogitVecs;
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t kb = 0; kb < n; kb += KV * W) {
    __m512 acc[R][KV];  // keys kb + j * W .. kb + j * W + 15 in acc[r][j]
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < KV; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint32_t* col = kt2 + kb;
    for (int64_t p = 0; p < P; ++p) {
      __m512bh k[KV];
      for (int j = 0; j < KV; ++j) k[j] = as_bf16_pairs(_mm512_loadu_si512(col + p * ldk + j * W));
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(q2[r][p])));
        for (int j = 0; j < KV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qp, k[j]);
      }
    }
    for (int j = 0; j < KV && kb + j * W < n; ++j) {
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min(W, n - kb - j * W)) - 1);
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(logits[r] + kb + j * W, mask, _mm512_mul_ps(acc[r][j], s));
    }
  }
}

// logits[r][t + j] = scale * <q[r], k_{t+j}> for j < KS <= 4 and the R <= 4 rows of a tile, the keys
// in place (key t + j at rows + (t + j) * stride, bf16 as stored): a decode's logits with the same
// arithmetic as bf16_block_logits, the R x KS sums of each lane's pairs added in one tree.
template <int R, int KS>
inline void bf16_keys_logits(float* const* logits, const uint32_t* const* q2, const c10::BFloat16* rows,
                             int64_t stride, int64_t t, int64_t P, float scale) {
  constexpr int64_t W = 16;
  __m512 acc[R][KS];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < KS; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; p += W) {  // P % 16 == 0 (bf16_dot_head_size)
    __m512bh k[KS];
    for (int j = 0; j < KS; ++j)
      k[j] = as_bf16_pairs(_mm512_loadu_si512(reinterpret_cast<const uint32_t*>(rows + (t + j) * stride) + p));
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = as_bf16_pairs(_mm512_loadu_si512(q2[r] + p));
      for (int j = 0; j < KS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qp, k[j]);
    }
  }
  store_quarters(_mm512_mul_ps(tile_sums(acc), _mm512_set1_ps(scale)), logits, t, (1u << KS) - 1,
                 std::make_index_sequence<R>{});
}

// bf16_keys_logits over keys 0 .. n - 1, four at a time, asking for `ahead`'s row t with key t.
template <int R>
inline void bf16_row_logits(float* const* logits, const uint32_t* const* q2, const c10::BFloat16* rows,
                            int64_t stride, int64_t n, int64_t P, float scale, const Ahead& ahead) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    for (int j = 0; j < 4; ++j) ahead.ask(t + j);
    bf16_keys_logits<R, 4>(logits, q2, rows, stride, t, P, scale);
  }
  for (; t < n; ++t) {
    ahead.ask(t);
    bf16_keys_logits<R, 1>(logits, q2, rows, stride, t, P, scale);
  }
}

// acc[r][0:D] += sum over key pairs i < pairs of the two keys' p[r] * v, for the R rows of a tile.
// p2[r]: row r's probabilities packed by key pair; vt2 [pairs, D]: the value rows interleaved by
// key pair (bf16_interleave_values); acc's features in the unpacked order. Four vectors of each
// row's acc stay in registers across all the pairs.
template <int R>
inline void bf16_block_values(float* const* acc, const uint32_t* const* p2, const uint32_t* vt2, int64_t pairs,
                              int64_t D) {
  constexpr int64_t W = 16;
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc[r] + d + j * W);
    for (int64_t i = 0; i < pairs; ++i) {
      const uint32_t* row = vt2 + i * D + d;
      __m512i v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(row + j * W);
      for (int r = 0; r < R; ++r) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(p2[r][i]));
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], as_bf16_pairs(pp), as_bf16_pairs(v[j]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[r] + d + j * W, a[r][j]);
  }
  for (; d < D; d += W) {  // D % 32 == 0: whole vectors
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc[r] + d);
    for (int64_t i = 0; i < pairs; ++i) {
      const __m512bh v = as_bf16_pairs(_mm512_loadu_si512(vt2 + i * D + d));
      for (int r = 0; r < R; ++r)
        a[r] = _mm512_dpbf16_ps(a[r], as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(p2[r][i]))), v);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[r] + d, a[r]);
  }
}

// out[0 : ceil(n/2)] = p[0:n] rounded to bf16 (nearest even) and packed by pairs, an odd last
// one paired with 0.
inline void bf16_pack_pairs(const float* p, int64_t n, uint32_t* out) {
  for (int64_t t = 0; t < n; t += 32) {
    const int64_t w = std::min<int64_t>(32, n - t);
    const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::min<int64_t>(w, 16)) - 1), p + t);
    const __m512 hi = w > 16 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (w - 16)) - 1), p + t + 16)
                             : _mm512_setzero_ps();
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    _mm512_mask_storeu_epi32(out + t / 2, static_cast<__mmask16>((1u << ((w + 1) / 2)) - 1), packed);
  }
}

// acc[r][0:D] += sum over t < n of p[r][t] * v_t for the R rows of a tile, value row t in place at
// rows + t * stride (bf16 as stored) and p2[r] row r's probabilities packed by key pair: the same
// arithmetic as bf16_block_values, each pair of value rows interleaved in registers as it is read
// (a decode's few rows would not repay writing the interleaved values out). NV vectors of features
// (64 or the last 32) a pass, their accumulators in registers across the rows; acc's features in the
// unpacked order.
template <int R, int NV>
inline void bf16_row_values_part(float* const* acc, const uint32_t* const* p2, const c10::BFloat16* rows,
                                 int64_t stride, int64_t n, int64_t d, const Ahead& ahead) {
  constexpr int64_t W = 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc[r] + d + j * W);
  for (int64_t i = 0; 2 * i < n; ++i) {
    if (d == 0) {
      ahead.ask(2 * i);
      ahead.ask(2 * i + 1);
    }
    const c10::BFloat16* even = rows + 2 * i * stride;
    const bool odd = 2 * i + 1 < n;
    __m512bh v[NV];
    for (int h = 0; h < NV / 2; ++h) {  // 32 features of both rows
      const __m512i x = _mm512_loadu_si512(even + d + 2 * h * W);
      const __m512i y = odd ? _mm512_loadu_si512(even + stride + d + 2 * h * W) : _mm512_setzero_si512();
      v[2 * h] = as_bf16_pairs(_mm512_unpacklo_epi16(x, y));
      v[2 * h + 1] = as_bf16_pairs(_mm512_unpackhi_epi16(x, y));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh pp = as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(p2[r][i])));
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], pp, v[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc[r] + d + j * W, a[r][j]);
}

// bf16_row_values_part over all D features (D % 32 == 0), asking for `ahead`'s row t with value t.
template <int R>
inline void bf16_row_values(float* const* acc, const uint32_t* const* p2, const c10::BFloat16* rows, int64_t stride,
                            int64_t n, int64_t D, const Ahead& ahead) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) bf16_row_values_part<R, 4>(acc, p2, rows, stride, n, d, ahead);
  if (d < D) bf16_row_values_part<R, 2>(acc, p2, rows, stride, n, d, ahead);
}

// vt2[i] [D] = value rows 2i and 2i + 1 (row(t): key t's D bf16 values) paired by in-lane unpacks
// (the pairs in the unpacked order), for i < ceil(n/2); an odd last row is paired with zeros.
template <typename RowOf>
inline void bf16_interleave_values(const RowOf& row, int64_t n, int64_t D, uint32_t* vt2) {
  for (int64_t i = 0; 2 * i < n; ++i) {
    const uint16_t* even = row(2 * i);
    const uint16_t* odd = 2 * i + 1 < n ? row(2 * i + 1) : nullptr;
    uint32_t* dst = vt2 + i * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(even + d);
      const __m512i b = odd ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
}

#else
constexpr bool kHasBf16Dot = false;
// Declared only, for the kernel's `if constexpr (kHasBf16Dot)` branches to name: never called.
template <int R>
void bf16_block_logits(float* const* logits, const uint32_t* const* q2, const uint32_t* kt2, int64_t ldk, int64_t n,
                       int64_t P, float scale);
template <int R>
void bf16_block_values(float* const* acc, const uint32_t* const* p2, const uint32_t* vt2, int64_t pairs, int64_t D);
template <int R>
void bf16_row_values(float* const* acc, const uint32_t* const* p2, const c10::BFloat16* rows, int64_t stride,
                     int64_t n, int64_t D, const Ahead& ahead);
template <int R>
void bf16_row_logits(float* const* logits, const uint32_t* const* q2, const c10::BFloat16* rows, int64_t stride,
                     int64_t n, int64_t P, float scale, const Ahead& ahead);
void bf16_pack_pairs(const float* p, int64_t n, uint32_t* out);
template <typename RowOf>
void bf16_interleave_values(const RowOf& row, int64_t n, int64_t D, uint32_t* vt2);
#endif

}  // namespace vllm_attention_tiles
