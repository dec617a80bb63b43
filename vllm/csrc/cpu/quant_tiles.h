/*
 * Quantized weights in row tiles: 16 output rows interleaved in the lanes of one vector, so one
 * vpdpbusd multiplies 4 features of all 16 rows by a broadcast of 4 bytes of x, and a block's
 * integer sums come out as one vector of 16 rows, scaled once, with no sums across lanes. The
 * row layout's loops (quant_rows.h, quant_int4_pairs.h) sum each row's lanes per block before scaling it (int4's
 * paired loop: 9 of its 21 vector operations per 512 multiply-adds on many rows of x). Here an
 * int4 block of 16 rows costs 4 loads and 8 masks, shared by every row of x, then per row of x 8
 * vpdpbusd and ~6 scaling operations; an int8 block 8 loads and 8 vpdpbusd for its weight sums,
 * shared, then per row of x 8 vpdpbusd and ~4 more. One Zen 4 thread: SmolLM2's int4 decode
 * linears from cache 0.42x the row layout's time, 4-32 rows of x 0.40-0.42x; Q4_K from memory
 * 0.69x at one row of x; in the engine a 512-token SmolLM2 int4 prompt 0.39x, a decode 0.88x.
 * Included by quant_linear.cpp where the compiler targets AVX512-VNNI (VLLM_QUANT_OCTS);
 * quantization.py lays weights out this way only where the kernel has it (`tile_rows`).
 *
 * Layouts (quantization.py's `tile`): a weight of N = 16 T rows and K = 32 B features,
 *   int4 qweight uint8 [T, B, 256]: tile t, block b is 4 chunks of 64 bytes; byte 4 r + j of chunk
 *     c holds row 16 t + r's element 32 b + 4 c + j (stored q + 8) in its low nibble and element
 *     32 b + 16 + 4 c + j in its high nibble (the same two elements a row-layout byte pairs);
 *     scales [T, B, 16] (bf16 bits: int4 at load, or fp16: GGUF Q4_0's d, Q4_1's d) and, for
 *     Q4_1, fp16 mins m beside them (views of one [T, B, 2, 16] tensor: one memory stream).
 *   GGUF Q4_K: qweight as int4's; sc and m uint8 [T, B, 16] beside each other (views of one
 *     [T, B, 2, 16] tensor) and superblocks fp32 [T, B / 8, 2, 16] (d, dmin of the 16 rows).
 *   int8 qweight int8 [T, B, 512]: block b is 8 chunks of 64 bytes; byte 4 r + j of chunk c holds
 *     row 16 t + r's element 32 b + 4 c + j; scales per output channel fp32 [T, 1, 16] (group K,
 *     `--quantization int8`) or per block [T, B, 16] (group 32: GGUF Q8_0's fp16 d).
 *   GGUF Q6_K: qweight as int8's, holding the file's unsigned values u = q + 32 (0..63); sc int8
 *     [T, K / 16, 16] (a block's two halves at 2 b and 2 b + 1) and superblocks fp32
 *     [T, B / 8, 1, 16] (d of the 16 rows).
 *
 * Semantics (quant_linear.cpp's, the same reference): per row of x, block b and weight row n,
 *   int4: U = sum_j u[n, j] xq[j] over the block (u the stored nibble, exact in int32),
 *         X = sum_j xq[j];
 *         symmetric: acc[n] += float(U - 8 X) * (d[n] * xs[b])
 *         Q4_1:      acc[n] += (float(U) * d[n] + m[n] * float(X)) * xs[b]     (w = d u + m)
 *         Q4_K:      acc[n] += (float(U) * (d sc)[n] - (dmin m)[n] * float(X)) * xs[b], d sc and
 *                    dmin m exact in fp32 (fp16 d, dmin times 6-bit sc, m)
 *   int8: I = sum_j w[n, j] xq[j], formed as sum_j w (xq + 128) - 128 sum_j w (exact in int32)
 *         per block: acc[n] += float(I) * (d[n] * xs[b]); per channel: acc[n] += float(I) * xs[b],
 *         then out[n] = acc[n] * s[n]
 *   Q6_K: I_lo, I_hi as I over the block's features 0-15 and 16-31, formed as sum_j u xq - 32 sum_j xq;
 *         acc[n] += (float(I_lo) * (d sc_2b)[n] + float(I_hi) * (d sc_2b+1)[n]) * xs[b], d sc exact
 *         in fp32 (fp16 d times int8 sc)
 * over b = 0 .. B - 1 in order, acc starting at 0: each (row of x, weight row) the same operations
 * in the same order however many rows of x or tiles share a pass, so its sum does not depend on
 * the batch, the thread count or the work split.
 */

#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_bits.h"

namespace vllm_quant_tiles {

constexpr int64_t kTileRows = 16;     // weight rows a tile interleaves
// Tiles one row of x reads side by side (each format's kStreams), each its own stream or streams
// (weights, scales): the hardware prefetchers keep more lines in flight. One Zen 4 thread, weights
// from memory, 9 alternating rounds, time against 4 tiles: int4 2 tiles 0.73-0.88x (symmetric,
// Q4_1, Q4_K: 0.65x; SmolLM2's and Granite-3.3-2B's shapes; two threads 0.75-0.86x), 1 tile
// 0.66-0.96x; then 3 tiles against 2 (15 alternating rounds): 0.89-0.96x on one thread (Q4_0, bf16
// scales, Q4_K), 0.88-0.96x on two (bf16 scales on Granite's shapes 1.02-1.07x); int8 per channel
// 2 tiles 0.94-1.07x, 1 tile 1.00-1.22x. Against the row layout, where
// a tile has more streams (Llama-3.2-1B's shapes; SmolLM2's): Q6_K (weights, sc, d) 2 tiles
// 0.62-0.70x, 1 tile 0.74x, 3 tiles 0.99x, 4 tiles 1.14x; GGUF Q8_0 (weights, d) 3 tiles 0.80x
// (0.84x), 2 tiles 0.83-0.85x (0.90x), 4 tiles 1.00x; two threads near the memory's rate (~30 GB/s):
// Q6_K 1.00x, Q8_0 0.93x.
constexpr int kStreamsInt4 = 3, kStreamsInt8 = 4, kStreamsQ8Blocks = 3, kStreamsQ6K = 2;
constexpr int kRowsOfX = 4;  // rows of x sharing each unpacked block of a tile (several rows)

// One row of x quantized: xq [K] (int4 and Q6_K read it), xu = xq + 128 [K] (int8 reads it), its
// block scales xs [B] and the sums of xq per block (int4: xsum [B]) or per half block (Q6_K: [2 B]),
// as a format's kXSums says.
struct XRow {
  const int8_t* xq;
  const uint8_t* xu;
  const float* xs;
  const int32_t* xsum;
};

// Where sums go: out [M, N] as fp32, or as bf16 (its bits, rounded to nearest even as torch casts).
struct Out {
  float* fp32;
  uint16_t* bf16;  // used where fp32 is null
  int64_t N;

  // Row m's 16 outputs from column n.
  void store(__m512 sums, int64_t m, int64_t n) const {
    if (fp32 != nullptr) {
      _mm512_storeu_ps(fp32 + m * N + n, sums);
      return;
    }
    alignas(64) float row[kTileRows];
    _mm512_store_ps(row, sums);
    vllm_cpu_bits::narrow_row(bf16 + m * N + n, row, kTileRows);
  }
};

// A tile's weights and scales (and mins) as laid out above; pitch: scale elements between blocks.
template <typename S>
struct Tile {
  const uint8_t* q;
  const S* scales;
  const S* mins;        // Q4_1's (or Q4_K's m), or null
  int64_t pitch;
  const float* supers;  // Q4_K's d and dmin per superblock [B / 8, 2, 16], or null
};

// Where a weight's tiles lie: tile t's weights at q + t * B * block_bytes, its scales and mins at
// t * tile_pitch (block_pitch apart per block), its superblocks at supers + t * supers_pitch.
template <typename S>
struct Tiles {
  const uint8_t* q;
  const S* scales;
  const S* mins;
  int64_t tile_pitch, block_pitch;
  const float* supers;
  int64_t supers_pitch;
};

inline __m512 widen_scales(const float* s) { return _mm512_loadu_ps(s); }
inline __m512 widen_scales(const uint16_t* s) {
  return vllm_cpu_bits::widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
inline __m512 widen_scales(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// A block's 4 chunks as v[c] the low nibbles, v[4 + c] the high ones in place.
inline void unpack_nibbles(const uint8_t* block, __m512i* v) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = _mm512_loadu_si512(block + 64 * c);
    v[c] = _mm512_and_si512(raw, low);
    v[4 + c] = _mm512_and_si512(raw, high);
  }
}

// U of the 16 rows (exact): vpdpbusd sums the high nibbles unscaled and one shift takes the 16 off.
inline __m512i nibble_sums(const __m512i* v, const XRow& x, int64_t b) {
  const int32_t* xb = reinterpret_cast<const int32_t*>(x.xq + 32 * b);
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    lo = _mm512_dpbusd_epi32(lo, v[c], _mm512_set1_epi32(xb[c]));
    hi = _mm512_dpbusd_epi32(hi, v[4 + c], _mm512_set1_epi32(xb[4 + c]));
  }
  return _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
}

// What the int4 formats share: the block layout, what they read of x, how many tiles at once.
struct Int4Layout {
  static constexpr int kStreams = kStreamsInt4;
  static constexpr int kXSums = 1;  // reads xq and its sums per block
  static constexpr int64_t kBlockBytes = 256;
  struct Block {
    __m512i v[8];  // unpack_nibbles'
    __m512 d, m;   // the 16 rows' scales and mins (Q4_K: d sc and dmin m)
  };
};

// int4 (the header's formula); S: the scales' type, kMins: Q4_1's mins beside them.
template <bool kMins, typename S>
struct Int4 : Int4Layout {
  using Scale = S;

  static void load(const Tile<S>& tile, int64_t b, Block& k) {
    unpack_nibbles(tile.q + b * kBlockBytes, k.v);
    k.d = widen_scales(tile.scales + b * tile.pitch);
    k.m = kMins ? widen_scales(tile.mins + b * tile.pitch) : _mm512_setzero_ps();
  }

  static __m512 step(__m512 acc, const Block& k, const XRow& x, int64_t b) {
    const __m512i u = nibble_sums(k.v, x, b);
    if constexpr (kMins) {
      const __m512 t =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), k.d, _mm512_mul_ps(k.m, _mm512_set1_ps(float(x.xsum[b]))));
      return _mm512_fmadd_ps(t, _mm512_set1_ps(x.xs[b]), acc);
    } else {
      const __m512i q = _mm512_sub_epi32(u, _mm512_set1_epi32(8 * x.xsum[b]));
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(k.d, _mm512_set1_ps(x.xs[b])), acc);
    }
  }

  static __m512 finish(__m512 acc, const Tile<S>&) { return acc; }
};

// GGUF Q4_K in its two-level form (the header's formula): the block's scale d sc and offset dmin m
// formed from the superblock's d and dmin and the block's 6-bit sc and m (bytes), each exact in fp32.
struct Int4K : Int4Layout {
  using Scale = uint8_t;

  static __m512 widen_bytes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }

  static void load(const Tile<uint8_t>& tile, int64_t b, Block& k) {
    unpack_nibbles(tile.q + b * kBlockBytes, k.v);
    const float* super = tile.supers + (b / 8) * 2 * kTileRows;
    k.d = _mm512_mul_ps(_mm512_loadu_ps(super), widen_bytes(tile.scales + b * tile.pitch));
    k.m = _mm512_mul_ps(_mm512_loadu_ps(super + kTileRows), widen_bytes(tile.mins + b * tile.pitch));
  }

  static __m512 step(__m512 acc, const Block& k, const XRow& x, int64_t b) {
    const __m512i u = nibble_sums(k.v, x, b);
    const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(u), k.d, _mm512_mul_ps(k.m, _mm512_set1_ps(float(x.xsum[b]))));
    return _mm512_fmadd_ps(t, _mm512_set1_ps(x.xs[b]), acc);
  }

  static __m512 finish(__m512 acc, const Tile<uint8_t>&) { return acc; }
};

// int8 (the header's formula); kPerBlock: a scale per block of 32 (S fp16 or fp32), else one fp32
// scale per output channel.
template <bool kPerBlock, typename S>
struct Int8 {
  using Scale = S;
  static constexpr int kStreams = kPerBlock ? kStreamsQ8Blocks : kStreamsInt8;
  static constexpr int kXSums = 0;  // reads xu
  static constexpr int64_t kBlockBytes = 512;
  struct Block {
    __m512i w[8];
    __m512i bias;  // 128 times the block's weight sums, what x + 128 adds
    __m512 d;
  };

  static void load(const Tile<S>& tile, int64_t b, Block& k) {
    const __m512i ones = _mm512_set1_epi8(1);
    const uint8_t* block = tile.q + b * kBlockBytes;
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      k.w[c] = _mm512_loadu_si512(block + 64 * c);
      k.w[c + 1] = _mm512_loadu_si512(block + 64 * (c + 1));
      even = _mm512_dpbusd_epi32(even, ones, k.w[c]);
      odd = _mm512_dpbusd_epi32(odd, ones, k.w[c + 1]);
    }
    k.bias = _mm512_slli_epi32(_mm512_add_epi32(even, odd), 7);
    k.d = kPerBlock ? widen_scales(tile.scales + b * tile.pitch) : _mm512_setzero_ps();
  }

  static __m512 step(__m512 acc, const Block& k, const XRow& x, int64_t b) {
    const int32_t* xb = reinterpret_cast<const int32_t*>(x.xu + 32 * b);
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(xb[c]), k.w[c]);
      odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(xb[c + 1]), k.w[c + 1]);
    }
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even, odd), k.bias));  // I, exact
    const __m512 xs = _mm512_set1_ps(x.xs[b]);
    return _mm512_fmadd_ps(sums, kPerBlock ? _mm512_mul_ps(k.d, xs) : xs, acc);
  }

  static __m512 finish(__m512 acc, const Tile<S>& tile) {
    return kPerBlock ? acc : _mm512_mul_ps(acc, widen_scales(tile.scales));
  }
};

// GGUF Q6_K in its two-level form (the header's formula): int8's block layout holding the file's
// unsigned 6-bit values u = q + 32, which vpdpbusd takes as its unsigned operand against xq: each half
// block (16 features, chunks 0-3 and 4-7) sums U = sum u xq on its own, and I = U - 32 X comes from
// x's own half sums X, formed once per row of x (int8's x + 128 would take 8 more vpdpbusd a block
// for the weight sums). Each half is scaled by its d sc, formed from the superblock's d and the
// half's int8 sc (exact in fp32). The two halves' chains of 4 vpdpbusd stand for int8's even and odd.
struct Int8K {
  using Scale = int8_t;
  static constexpr int kStreams = kStreamsQ6K;
  static constexpr int kXSums = 2;  // reads xq and its sums per half block
  static constexpr int64_t kBlockBytes = 512;
  struct Block {
    __m512i u[8];
    __m512 d_lo, d_hi;  // the 16 rows' d sc of each half
  };

  static __m512 widen_bytes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }

  static void load(const Tile<int8_t>& tile, int64_t b, Block& k) {
    const uint8_t* block = tile.q + b * kBlockBytes;
    for (int c = 0; c < 8; ++c) k.u[c] = _mm512_loadu_si512(block + 64 * c);
    const __m512 d = _mm512_loadu_ps(tile.supers + (b / 8) * kTileRows);
    k.d_lo = _mm512_mul_ps(d, widen_bytes(tile.scales + 2 * b * tile.pitch));
    k.d_hi = _mm512_mul_ps(d, widen_bytes(tile.scales + (2 * b + 1) * tile.pitch));
  }

  static __m512 step(__m512 acc, const Block& k, const XRow& x, int64_t b) {
    const int32_t* xb = reinterpret_cast<const int32_t*>(x.xq + 32 * b);
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      lo = _mm512_dpbusd_epi32(lo, k.u[c], _mm512_set1_epi32(xb[c]));
      hi = _mm512_dpbusd_epi32(hi, k.u[4 + c], _mm512_set1_epi32(xb[4 + c]));
    }
    const __m512 i_lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, _mm512_set1_epi32(32 * x.xsum[2 * b])));  // exact
    const __m512 i_hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, _mm512_set1_epi32(32 * x.xsum[2 * b + 1])));
    const __m512 t = _mm512_fmadd_ps(i_lo, k.d_lo, _mm512_mul_ps(i_hi, k.d_hi));
    return _mm512_fmadd_ps(t, _mm512_set1_ps(x.xs[b]), acc);
  }

  static __m512 finish(__m512 acc, const Tile<int8_t>&) { return acc; }
};

// kS tiles against row m of x, block by block, each tile its own stream: their 16 outputs each from
// column cols[i].
template <int kS, typename F>
inline void tiles_one_row(const Tile<typename F::Scale>* tiles, int64_t B, const XRow& x, const Out& out, int64_t m,
                          const int64_t* cols) {
  __m512 acc[kS];
  for (int i = 0; i < kS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b)
    for (int i = 0; i < kS; ++i) {
      typename F::Block k;
      F::load(tiles[i], b, k);
      acc[i] = F::step(acc[i], k, x, b);
    }
  for (int i = 0; i < kS; ++i) out.store(F::finish(acc[i], tiles[i]), m, cols[i]);
}

// One tile against rows m .. m + kX - 1 of x, each block unpacked once for all of them: their 16
// outputs from column n.
template <int kX, typename F>
inline void tile_rows_of_x(const Tile<typename F::Scale>& tile, int64_t B, const XRow* x, const Out& out, int64_t m,
                           int64_t n) {
  __m512 acc[kX];
  for (int j = 0; j < kX; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    typename F::Block k;
    F::load(tile, b, k);
    for (int j = 0; j < kX; ++j) acc[j] = F::step(acc[j], k, x[j], b);
  }
  for (int j = 0; j < kX; ++j) out.store(F::finish(acc[j], tile), m + j, n);
}

// out [M, N] = the sums of rows of x [m0, m1) (x[m]: row m) against tiles [t0, t1) of a weight in
// format F.
template <typename F>
void tiles_range(const Tiles<typename F::Scale>& w, int64_t B, const XRow* x, int64_t m0, int64_t m1, const Out& out,
                 int64_t t0, int64_t t1) {
  using S = typename F::Scale;
  const auto tile = [&](int64_t t) {
    return Tile<S>{w.q + t * B * F::kBlockBytes, w.scales + t * w.tile_pitch,
                   w.mins == nullptr ? nullptr : w.mins + t * w.tile_pitch, w.block_pitch,
                   w.supers == nullptr ? nullptr : w.supers + t * w.supers_pitch};
  };
  if (m1 - m0 == 1) {
    constexpr int kStreams = F::kStreams;
    const int64_t part = (t1 - t0) / kStreams;
    Tile<S> tiles[kStreams];
    int64_t cols[kStreams];
    for (int64_t j = 0; j < part; ++j) {
      for (int i = 0; i < kStreams; ++i) {
        const int64_t t = t0 + i * part + j;
        tiles[i] = tile(t), cols[i] = kTileRows * t;
      }
      tiles_one_row<kStreams, F>(tiles, B, x[m0], out, m0, cols);
    }
    for (int64_t t = t0 + kStreams * part; t < t1; ++t) {
      tiles[0] = tile(t), cols[0] = kTileRows * t;
      tiles_one_row<1, F>(tiles, B, x[m0], out, m0, cols);
    }
    return;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const Tile<S> one = tile(t);
    int64_t m = m0;
    for (; m + kRowsOfX <= m1; m += kRowsOfX) tile_rows_of_x<kRowsOfX, F>(one, B, x + m, out, m, kTileRows * t);
    for (; m < m1; ++m) tile_rows_of_x<1, F>(one, B, x + m, out, m, kTileRows * t);
  }
}

}  // namespace vllm_quant_tiles
