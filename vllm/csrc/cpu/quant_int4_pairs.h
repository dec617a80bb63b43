/*
 * int4 in groups of 32 over an even number of blocks (the engine's own int4, GGUF Q4_0, Q4_1 and
 * Q4_K in the row layout) against rows of x: the paired loop of the CPU quantized linear
 * (quant_linear.cpp states the semantics and the work split; quant_rows.h the per-block path it
 * replaces for these weights). Two blocks per 32-byte load, x laid out once per call to match the
 * nibbles (layout_int4_pairs), the integer sums of four pairs reduced to their eight blocks' sums
 * and scaled at once by the blocks' x and weight scales: 1.5-2.5x the per-block path's speed,
 * 15-19 GB/s of weights on one Zen 3 thread (where the compiler targets AVX512-VNNI, eight pairs at
 * a time in 512-bit vectors first). It reads the scales as stored, fp32, bf16 (int4 quantized at
 * load) or fp16 (GGUF Q4_0's): 4-8% faster than fp32 scales on cold megabyte-sized matrices, 10%
 * fewer bytes. For one row of x the caller's tiles take rows spread over its range, each its own
 * stream for the hardware prefetchers; for several, neighbouring rows asked into L2 8 KB ahead
 * (Asks, below).
 */

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_rows.h"

#ifdef VLLM_QUANT_AVX2
namespace vllm_quant_rows {
namespace {  // internal linkage: see quant_rows.h

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

inline void layout_int4_pairs(const int8_t* xq, const float* xs, int64_t npairs, Int4Pairs& out, const float* gsums) {
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
      _mm256_set_m128i(_mm_and_si128(bits, _mm_set1_epi32(static_cast<int32_t>(0xFFFF0000u))),
                       _mm_slli_epi32(bits, 16)));
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

}  // namespace
}  // namespace vllm_quant_rows
#endif  // VLLM_QUANT_AVX2
