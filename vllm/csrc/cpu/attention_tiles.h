/*
 * The inner loops of the CPU attention kernel (paged_attention.cpp): register-tiled logits and
 * value sums over the paged KV cache's rows, the softmax numerators, the key transposes, and
 * the loads that widen bf16 rows in registers. Everything here is a function of its arguments
 * (no task split, no threads); the kernel's semantics and work split are paged_attention.cpp's.
 *
 * Two shapes of tile: a decode has few query rows per KV head, so its logits are dot products
 * on the keys in place (kRowTile rows share every key load); a prompt's many rows read keys
 * transposed a chunk at a time (one FMA advances W keys of a row) in kLogitRows x kLogitVecs
 * tiles, and value sums in kValueRows x kValueVecs-vector tiles. Tiles are sized to the vector
 * registers (32 on AVX-512, 16 on AVX2).
 */

#pragma once

// First: it sets the SIMD width the at::vec headers below compile for.
#include "native_vec.h"

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "bf16_bits.h"
#include "prefetch.h"
#include "row_tiles.h"

namespace vllm_attention_tiles {

// Query rows computed together in the inner loops of a decode (keys read in place): with D = 64
// and AVX-512, 4 rows x 4 vectors of accumulators plus the loaded row fit the 32 registers.
constexpr int kRowTile = 4;
// Register tiles of the many-row path (keys transposed), sized to the vector registers (32 on
// AVX-512, 16 on AVX2): the logits take kLogitRows query rows x kLogitVecs vectors of keys
// (each key vector loaded once for all the rows, each query value broadcast once for
// kLogitVecs vectors), the values kValueRows rows x kValueVecs vectors of features. On AVX2,
// 6 x 2: twelve independent FMA chains cover the FMA's latency at two a cycle, where 4 x 2 (eight)
// left prompts 20-35% slower on Zen 3.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLogitRows = 8;
constexpr int kValueRows = 6;
constexpr int kValueVecs = 4;
#else
constexpr int kLogitRows = 6;
constexpr int kValueRows = 6;
constexpr int kValueVecs = 2;  // 4 x 4 accumulators spilled (5-10% slower decodes on Zen 3)
#endif
constexpr int kLogitVecs = 2;

using vllm_cpu_bits::for_row_tiles;

// n rows of D values, `stride` apart, as opmath values: the cache memory itself when it is
// stored in opmath type (no copy), else a converted copy in `scratch` [n, D]. Converting a
// block once serves every query row of the task. Returns the rows and sets `row_stride`.
template <typename scalar_t, typename opmath_t>
inline const opmath_t* rows_as_opmath(const scalar_t* src, int64_t n, int64_t stride, int64_t D,
                                      opmath_t* scratch, int64_t& row_stride) {
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    row_stride = stride;
    return src;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<opmath_t, float>) {
    // bf16 as its bits, widened by a shift: exactly the cast, and a loop the compiler vectorizes
    // (c10::BFloat16's own conversion did not: bf16 decodes ran at a third of fp32's bandwidth).
    for (int64_t t = 0; t < n; ++t) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(src + t * stride);
      float* dst = scratch + t * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = vllm_cpu_bits::widen(row[d]);
    }
    row_stride = D;
    return scratch;
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* row = src + t * stride;
      opmath_t* dst = scratch + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<opmath_t>(row[d]);
    }
    row_stride = D;
    return scratch;
  }
}

// The rows of a block further on, asked for one row per key the inner loops compute rather
// than a block at once: a burst of prefetches stalls on the core's few miss buffers (it was half
// of a decode's time outside the arithmetic). Into L1 (prefetch_line) or, with to_l2, into L2
// only (prefetch_to_l2).
struct Ahead {
  const char* rows = nullptr;            // row 0, or nullptr for none
  int64_t n = 0, stride = 0, bytes = 0;  // rows; bytes from one row to the next; bytes to ask for per row
  bool to_l2 = false;
  void ask(int64_t t) const {
    if (t >= n) return;
    for (int64_t b = 0; b < bytes; b += 64) {
      if (to_l2) vllm_cpu_bits::prefetch_to_l2(rows + t * stride + b);
      else vllm_cpu_bits::prefetch_line(rows + t * stride + b);
    }
  }
};

// w <= W values of a cache row as opmath values (the rest of the vector 0): opmath storage as it
// is; bf16 widened in registers (its bits shifted into the high half: exactly the cast), so
// decodes read bf16 keys and values in place instead of converting each block into a scratch copy
// first (that copy took more of a bf16 decode's attention than the arithmetic).
template <typename T>
inline at::vec::Vectorized<T> load_row(const T* p, int64_t w) {
  return at::vec::Vectorized<T>::loadu(p, w);
}

inline at::vec::Vectorized<float> load_row(const c10::BFloat16* p, int64_t w) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i bits = w == Vec::size() ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                        : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << w) - 1), p);
  return vllm_cpu_bits::widen16(bits);
#elif defined(CPU_CAPABILITY_AVX2)
  uint16_t part[8] = {};
  const uint16_t* src = reinterpret_cast<const uint16_t*>(p);
  if (w < Vec::size()) src = static_cast<const uint16_t*>(std::memcpy(part, p, w * sizeof(uint16_t)));
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return vllm_cpu_bits::widen8(bits);
#else
  float part[Vec::size()] = {};
  for (int64_t i = 0; i < w; ++i) part[i] = static_cast<float>(p[i]);
  return Vec::loadu(part);
#endif
}

// Storage a decode's inner loops read in place (load_row widens it); other half types are
// converted a block at a time (rows_as_opmath).
template <typename scalar_t>
constexpr bool kReadInPlace =
    std::is_same_v<scalar_t, at::opmath_type<scalar_t>> || std::is_same_v<scalar_t, c10::BFloat16>;

// The value sums' "unpacked order", where bf16 value rows are widened (here) or paired
// (attention_bf16_tiles.h) by in-lane unpacks (vpunpck{l,h}wd: of each 128-bit lane L, its words 0-3,
// then 4-7): of each 32 features, position 16 s + 4 L + i holds feature 8 L + 4 s + i. One in-lane
// op per 16 features where widening in feature order took two (vpmovzxwd across lanes, then a
// shift); each feature's sum is the same sequence of multiply-adds, only held in another lane, and
// a row goes back to feature order once its sums are done (unpermute_values). On AVX-512, for bf16
// caches of head sizes D % 32 == 0.
template <typename S>
constexpr bool kUnpackedValues =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<S, c10::BFloat16>;
#else
    false;
#endif

template <typename S>
inline bool values_unpacked(int64_t D) {
  return kUnpackedValues<S> && D % 32 == 0;
}

#if defined(CPU_CAPABILITY_AVX512)
// vpermt2ps indices that put 32 features in the unpacked order back in feature order:
// output k < 16 takes position kUnpackedLow[k] of the 32, output 16 + k position kUnpackedHigh[k].
alignas(64) inline constexpr uint32_t kUnpackedLow[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) inline constexpr uint32_t kUnpackedHigh[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                           12, 13, 14, 15, 28, 29, 30, 31};

// row[0:D] (D % 32 == 0) in feature order, from the unpacked order.
inline void unpermute_values(float* row, int64_t D) {
  const __m512i low = _mm512_load_si512(kUnpackedLow), high = _mm512_load_si512(kUnpackedHigh);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 a = _mm512_loadu_ps(row + d), b = _mm512_loadu_ps(row + d + 16);
    _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(a, low, b));
    _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(a, high, b));
  }
}
#else
// Declared only, for `if constexpr (kUnpackedValues<S>)` branches to name: never called.
void unpermute_values(float* row, int64_t D);
#endif

#if defined(CPU_CAPABILITY_AVX2)
// out[j] = column j of the 8 x 8 tile in[0..7] (rows): unpack pairs, then quads, then halves.
inline void transpose_8x8(const __m256 (&in)[8], __m256 (&out)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3, lanes 0-1 and 2-3 of each pair
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    out[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}
#endif

// kt[d * ldk + t] = row t's feature d as an opmath value, for t < n and d < D (row t at
// src + t * stride): a block's keys transposed for block_logits. On AVX2 in 8 x 8 register tiles
// over the rows as stored (bf16 widened as it is loaded): at::vec's transpose is scalar there,
// a sixth of a prompt's attention. Elsewhere at::vec's, over the rows converted into `scratch`
// [n, D] where they are not in opmath type.
template <typename scalar_t, typename opmath_t>
inline void transpose_keys(const scalar_t* src, int64_t stride, int64_t n, int64_t D, opmath_t* scratch,
                           opmath_t* kt, int64_t ldk) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<opmath_t, float> && kReadInPlace<scalar_t>) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        __m256 in[8], out[8];
        for (int i = 0; i < 8; ++i) in[i] = load_row(src + (t + i) * stride + d, 8);
        transpose_8x8(in, out);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (d + j) * ldk + t, out[j]);
      }
      for (; d < D; ++d)
        for (int i = 0; i < 8; ++i) kt[d * ldk + t + i] = static_cast<float>(src[(t + i) * stride + d]);
    }
    for (; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) kt[d * ldk + t] = static_cast<float>(src[t * stride + d]);
    return;
  }
#endif
  int64_t row_stride = stride;
  const opmath_t* rows = rows_as_opmath(src, n, stride, D, scratch, row_stride);
  at::vec::transpose_mxn<opmath_t>(rows, row_stride, kt, ldk, n, D);
}

// logits[r][t] = <q[r], k_t> for t < n and the R rows of a tile; kt [D, ldk] holds the n keys
// transposed (column t = key t; ldk >= n rounded up to kLogitVecs vectors), so each FMA advances
// W keys of one row: per feature, kLogitVecs key vectors and R broadcast query values feed
// R * kLogitVecs independent FMA chains.
template <int R, typename T>
inline void block_logits(T* const* logits, const T* const* q, const T* kt, int64_t ldk, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int NV = kLogitVecs;
  for (int64_t kb = 0; kb < n; kb += NV * W) {
    Vec acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
    const T* col = kt + kb;
    for (int64_t d = 0; d < D; ++d) {
      Vec k[NV];
      for (int v = 0; v < NV; ++v) k[v] = Vec::loadu(col + d * ldk + v * W);
      for (int r = 0; r < R; ++r) {
        const Vec qd(q[r][d]);
        for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(qd, k[v], acc[r][v]);
      }
    }
    for (int v = 0; v < NV && kb + v * W < n; ++v) {
      const int64_t w = std::min(W, n - kb - v * W);
      for (int r = 0; r < R; ++r) acc[r][v].store(logits[r] + kb + v * W, w);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// out[0:4] = the sums of the 8 lanes of a0 .. a3: three horizontal adds for four sums.
inline void sums_of_four(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 t2 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Lane 4 k + j of the result = the sum of a[4 j + k]'s 16 lanes: 16 horizontal sums at once, in a
// tree of 15 adds and 30 shuffles (halves, quarters, pairs of lanes, lanes), about 3 instructions
// a sum where one vector at a time took about 10. Always inlined: GCC had kept it out of line, its 16
// vectors passed through memory on every call (SmolLM2's decode attention, 512 keys, one Zen 4
// thread, alternating: 0.90-0.95x the time inlined, fp32 and bf16 queries, caches cold and hot).
__attribute__((always_inline)) inline __m512 lane_sums_16(const __m512 (&a)[16]) {
  __m512 s[8], u[4], w[2];
  // quarters [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3] of a, b = a[2i], a[2i + 1]
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter k: four lanes that sum to a[4 i + k]'s
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: two lanes each for a[8 i + k], a[8 i + 4 + k]
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // quarter k: the sums of a[k], a[4 + k], a[8 + k], a[12 + k]
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

// lane_sums_16 over a tile's R x KS <= 4 x 4 accumulators (V: __m512 or at::vec's float vector):
// lane 4 r + j of the result = the sum of acc[r][j]'s lanes, the lanes of missing rows and keys 0.
template <int R, int KS, typename V>
inline __m512 tile_sums(const V (&acc)[R][KS]) {
  static_assert(R <= 4 && KS <= 4, "one tree of 16 sums");
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < KS; ++j) a[4 * j + r] = acc[r][j];
  return lane_sums_16(a);
}

// dst[r][t + j] = lane j of quarter r of v, for r < sizeof...(r) and the lanes j in `lanes`.
template <size_t... r>
inline void store_quarters(__m512 v, float* const* dst, int64_t t, unsigned lanes, std::index_sequence<r...>) {
  (_mm_mask_storeu_ps(dst[r] + t, static_cast<__mmask8>(lanes), _mm512_extractf32x4_ps(v, r)), ...);
}
#endif

// out[j] = the sum of a[j]'s lanes, for KS vectors.
template <int KS, typename T>
inline void lane_sums(at::vec::Vectorized<T>* a, T* out) {
  using Vec = at::vec::Vectorized<T>;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float> && KS == 4) {
    sums_of_four(a[0], a[1], a[2], a[3], out);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && KS == 4) {  // each vector's halves added first
    __m256 h[4];
    for (int j = 0; j < 4; ++j) {
      const __m512 v = a[j];
      h[j] = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    }
    sums_of_four(h[0], h[1], h[2], h[3], out);
    return;
  }
#endif
  for (int j = 0; j < KS; ++j) out[j] = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, a[j]);
}

// logits[r][t + j] = <q[r], key t + j> for j < KS and the R rows of a tile, keys in place (row t
// at rows + t * stride): R * KS independent FMA chains, each key vector loaded once for R rows.
template <int R, int KS, typename T, typename S>
inline void keys_logits(T* const* logits, const T* const* q, const S* rows, int64_t stride, int64_t t, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec acc[R][KS];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < KS; ++j) acc[r][j] = Vec(T(0));
  const auto step = [&](int64_t d, int64_t w) {  // features d .. d + w - 1
    Vec k[KS];
    for (int j = 0; j < KS; ++j) k[j] = load_row(rows + (t + j) * stride + d, w);
    for (int r = 0; r < R; ++r) {
      const Vec qv = Vec::loadu(q[r] + d, w);
      for (int j = 0; j < KS; ++j) acc[r][j] = at::vec::fmadd(qv, k[j], acc[r][j]);
    }
  };
  int64_t d = 0;
  for (; d + W <= D; d += W) step(d, W);
  if (d < D) step(d, D - d);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && KS == 4 && R <= 4) {  // the tile's R x 4 sums in one tree
    store_quarters(tile_sums(acc), logits, t, 0xF, std::make_index_sequence<R>{});
    return;
  }
#endif
  T sums[KS];
  for (int r = 0; r < R; ++r) {
    lane_sums<KS>(acc[r], sums);
    for (int j = 0; j < KS; ++j) logits[r][t + j] = sums[j];
  }
}

// The same logits as block_logits from the keys in place: cheaper than transposing the block
// when a task has few query rows (decodes), whose keys are each used only a few times. Four keys
// at a time (on AVX2 two for 4-row tiles, to stay within 16 vector registers): one key at a time
// was a single FMA chain per row, bound by its latency.
template <int R, typename T, typename S>
inline void row_logits(T* const* logits, const T* const* q, const S* rows, int64_t stride, int64_t n, int64_t D,
                       const Ahead& ahead) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int KS = 4;
#else
  constexpr int KS = R <= 3 ? 4 : 2;
#endif
  int64_t t = 0;
  for (; t + KS <= n; t += KS) {
    for (int j = 0; j < KS; ++j) ahead.ask(t + j);
    keys_logits<R, KS>(logits, q, rows, stride, t, D);
  }
  for (; t < n; ++t) {
    ahead.ask(t);
    keys_logits<R, 1>(logits, q, rows, stride, t, D);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// block_values over features d .. d + 16 NV - 1 (NV = 4 or 2) of bf16 value rows, each 32 of a row
// widened by two in-lane unpacks against zero (its bits in the high halves: exactly the fp32
// values), so acc holds them in the unpacked order (kUnpackedValues); the same multiply-adds per
// feature as block_values' own loop.
template <int R, int NV>
inline void unpacked_values_part(float* const* acc, const float* const* p, const c10::BFloat16* const* blocks,
                                 int64_t bs, int64_t stride, int64_t n, int64_t d, const Ahead& ahead) {
  constexpr int64_t W = 16;
  const __m512i zero = _mm512_setzero_si512();
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc[r] + d + j * W);
  for (int64_t b = 0; b * bs < n; ++b) {
    const c10::BFloat16* rows = blocks[b] + d;
    const int64_t t0 = b * bs, nb = std::min(bs, n - t0);
    for (int64_t t = 0; t < nb; ++t) {
      if (d == 0) ahead.ask(t0 + t);
      for (int h = 0; h < NV / 2; ++h) {  // 32 features: two vectors, each used by every row at once
        const __m512i bits = _mm512_loadu_si512(rows + t * stride + 2 * h * W);
        const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, bits));
        const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, bits));
        for (int r = 0; r < R; ++r) {
          const __m512 pt = _mm512_set1_ps(p[r][t0 + t]);
          a[r][2 * h] = _mm512_fmadd_ps(pt, lo, a[r][2 * h]);
          a[r][2 * h + 1] = _mm512_fmadd_ps(pt, hi, a[r][2 * h + 1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc[r] + d + j * W, a[r][j]);
}
#endif

// acc[r][0:D] += sum over t < n of p[r][t] * v_t for the R rows of a tile, where value row t is
// blocks[t / bs] + (t % bs) * stride (a chunk of blocks, or one). kValueVecs vectors of each
// row's acc stay in registers across all n value rows. Where values_unpacked<S>(D), acc's features
// are in the unpacked order.
template <int R, typename T, typename S>
inline void block_values(T* const* acc, const T* const* p, const S* const* blocks, int64_t bs, int64_t stride,
                         int64_t n, int64_t D, const Ahead& ahead) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && kUnpackedValues<S>) {
    if (values_unpacked<S>(D)) {
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) unpacked_values_part<R, 4>(acc, p, blocks, bs, stride, n, d, ahead);
      if (d < D) unpacked_values_part<R, 2>(acc, p, blocks, bs, stride, n, d, ahead);
      return;
    }
  }
#endif
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int NV = kValueVecs;
  // f(t, row) for every value row t < n, block by block.
  const auto for_rows = [&](auto&& f) {
    for (int64_t b = 0; b * bs < n; ++b) {
      const S* rows = blocks[b];
      const int64_t t0 = b * bs, nb = std::min(bs, n - t0);
      for (int64_t t = 0; t < nb; ++t) f(t0 + t, rows + t * stride);
    }
  };
  int64_t d = 0;
  for (; d + NV * W <= D; d += NV * W) {
    Vec a[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc[r] + d + v * W);
    for_rows([&](int64_t t, const S* row) {
      if (d == 0) ahead.ask(t);
      Vec x[NV];
      for (int v = 0; v < NV; ++v) x[v] = load_row(row + d + v * W, W);
      for (int r = 0; r < R; ++r) {
        const Vec pt(p[r][t]);
        for (int v = 0; v < NV; ++v) a[r][v] = at::vec::fmadd(pt, x[v], a[r][v]);
      }
    });
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) a[r][v].store(acc[r] + d + v * W);
  }
  for (; d < D; d += W) {
    const int64_t w = std::min(W, D - d);
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec::loadu(acc[r] + d, w);
    for_rows([&](int64_t t, const S* row) {
      if (d == 0) ahead.ask(t);
      const Vec v = load_row(row + d, w);
      for (int r = 0; r < R; ++r) a[r] = at::vec::fmadd(Vec(p[r][t]), v, a[r]);
    });
    for (int r = 0; r < R; ++r) a[r].store(acc[r] + d, w);
  }
}

// In place: row[0:n] = exp(row - max(row)) for n >= 1; returns {max(row), sum of the result}.
// The exp and the sum share one pass over the row. Four running maxima: one was a chain of
// dependent instructions that bound the loop.
template <typename opmath_t>
inline std::pair<opmath_t, opmath_t> softmax_numerators(opmath_t* row, int64_t n) {
  using Vec = at::vec::Vectorized<opmath_t>;
  constexpr int64_t W = Vec::size();
  const auto max_of = [](const Vec& a, const Vec& b) { return vllm_cpu_bits::max_fast(a, b); };
  Vec m[4];
  for (auto& v : m) v = Vec(-std::numeric_limits<opmath_t>::infinity());
  int64_t t = 0;
  for (; t + 4 * W <= n; t += 4 * W)
    for (int u = 0; u < 4; ++u) m[u] = max_of(m[u], Vec::loadu(row + t + u * W));
  for (; t + W <= n; t += W) m[0] = max_of(m[0], Vec::loadu(row + t));
  if (t < n) m[1] = max_of(m[1], Vec::set(m[1], Vec::loadu(row + t, n - t), n - t));
  const opmath_t max_value =
      at::vec::vec_reduce_all<opmath_t>(max_of, max_of(max_of(m[0], m[1]), max_of(m[2], m[3])));
  const Vec max(max_value);
  Vec sum(opmath_t(0));
  for (t = 0; t + W <= n; t += W) {
    const Vec e = vllm_cpu_bits::exp_fast(Vec::loadu(row + t) - max);
    e.store(row + t);
    sum = sum + e;
  }
  if (t < n) {
    const Vec e = Vec::set(Vec(opmath_t(0)), vllm_cpu_bits::exp_fast(Vec::loadu(row + t, n - t) - max), n - t);
    e.store(row + t, n - t);
    sum = sum + e;
  }
  return {max_value, at::vec::vec_reduce_all<opmath_t>([](const Vec& a, const Vec& b) { return a + b; }, sum)};
}

// In place: row[0:n] = cap * tanh(row / cap), the logit soft cap (Gemma 2).
template <typename opmath_t>
inline void soft_cap_logits(opmath_t* row, int64_t n, opmath_t cap) {
  using Vec = at::vec::Vectorized<opmath_t>;
  constexpr int64_t W = Vec::size();
  const Vec c(cap);
  int64_t t = 0;
  for (; t + W <= n; t += W) (c * (Vec::loadu(row + t) / c).tanh()).store(row + t);
  if (t < n) (c * (Vec::loadu(row + t, n - t) / c).tanh()).store(row + t, n - t);
}

}  // namespace vllm_attention_tiles
