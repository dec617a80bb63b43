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
 * Loops: quant_rows.h (the per-block and scalar paths, int8 against several rows of x),
 * quant_int4_pairs.h (int4's paired loop), quant_activations.h (x's rounding and the
 * per-thread workspace); the vector paths need AVX2 + FMA + F16C, the scalar path runs anywhere.
 *
 * Row tiles (quant_tiles.h, AVX512-VNNI builds): a qweight of 3 dims, int4 [N / 16, K / 32, 256]
 * or int8 [N / 16, K / 32, 512], is quantization.py's `tile` layout, 16 rows interleaved per
 * block; linear_int4 and linear_int8 hand it to tiled_linear (x quantized as here, the tasks
 * splitting the tiles). `tile_rows` says whether this build has them.
 *
 * Work split: x is quantized once per call, then at::parallel_for over output features, in
 * tiles of 4 weight rows that share each block of x; a tile is read from memory once per call
 * and stays in L1 across the few rows of x. For one row of x a tile's rows are spread over the
 * task's range, each its own stream for the hardware prefetchers; for several, paired int4 tiles
 * are neighbouring rows asked into L2 ahead. Sums run in a fixed order per (m, n): results do not
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
#include "quant_activations.h"
#include "quant_int4_pairs.h"
#include "quant_rows.h"
#include "row_tiles.h"

#ifdef VLLM_QUANT_OCTS
#include "quant_tiles.h"
#endif

// The op namespace; a test builds this file a second time without AVX2 under another name.
#ifndef VLLM_QUANT_OPS
#define VLLM_QUANT_OPS vllm_quant
#endif

namespace {

using namespace vllm_quant_rows;
using namespace vllm_quant_activations;

constexpr int kRowTile = 4;  // weight rows the vector path runs side by side
// Rows from which one row of x asks each spread int4 row's stream ahead (Asks::kStreams).
constexpr int64_t kStreamAskMinRowBytes = 512;
// int8 rows from which one row of x asks each row's stream ahead (dot_blocks' kAsk): shorter ones
// run from L2 or are too short for an ask 4 KB ahead to land in time.
constexpr int64_t kInt8StreamAskMinRowBytes = 4096;

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
// per call as on the row layout, with the sums per block (int4) or half block (Q6_K) or the x + 128
// (int8) the format reads; the tasks split the tiles.
template <typename F>
void tiled_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor* mins, const at::Tensor* supers = nullptr) {
  using S = typename F::Scale;
  using vllm_quant_tiles::kTileRows;
  constexpr int kSums = F::kXSums;  // xq's sums per block the format reads; none: x + 128 instead
  const int64_t M = x.size(0), K = x.size(1), T = qweight.size(0), B = qweight.size(1), N = T * kTileRows;
  Workspace& work = calling_thread_workspace();
  quantize_x(x, work);
  const int8_t* xq = work.xq.data();
  work.xsum.resize(M * B * kSums);
  work.xu.resize(kSums == 0 ? M * K : 0);
  int32_t* xsum = work.xsum.data();
  uint8_t* xu = work.xu.data();
  at::parallel_for(0, M * B, kPrepRowsPerTask * B, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if constexpr (kSums == 0) {
        for (int64_t j = 0; j < kBlock; ++j) xu[i * kBlock + j] = static_cast<uint8_t>(xq[i * kBlock + j] + 128);
      } else {
        for (int h = 0; h < kSums; ++h) {
          int32_t s = 0;
          for (int64_t j = h * kBlock / kSums; j < (h + 1) * kBlock / kSums; ++j) s += xq[i * kBlock + j];
          xsum[i * kSums + h] = s;
        }
      }
    }
  });
  std::vector<vllm_quant_tiles::XRow> rows(M);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = {xq + m * K, kSums == 0 ? xu + m * K : nullptr, work.xs.data() + m * B,
               kSums == 0 ? nullptr : xsum + m * B * kSums};
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

// GGUF Q6_K in row tiles: sc int8 [T, K / 16, 16], superblocks fp32 [T, K / 256, 1, 16] (d of the
// 16 rows); checked, then tiled_linear.
void tiled_q6_k(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sc,
                int64_t group, const at::Tensor& supers) {
  const int64_t T = qweight.size(0), B = qweight.size(1);
  TORCH_CHECK(group == 16 && B % 8 == 0 && sc.scalar_type() == at::kChar && tiled_scales(sc, qweight, 2 * B),
              "tiled Q6_K sc must be int8 [N / 16, K / 16, 16] in groups of 16, K a multiple of 256");
  TORCH_CHECK(supers.scalar_type() == at::kFloat && supers.is_contiguous() && supers.dim() == 4 &&
                  supers.size(0) == T && supers.size(1) == B / 8 && supers.size(2) == 1 && supers.size(3) == 16,
              "tiled Q6_K superblocks must be contiguous fp32 [N / 16, K / 256, 1, 16]");
#ifdef VLLM_QUANT_OCTS
  tiled_linear<vllm_quant_tiles::Int8K>(out, x, qweight, sc, nullptr, &supers);
#endif
}

// int8 weights in row tiles: qweight [T, B, 512], scales fp32 [T, 1, 16] per output channel (group
// K) or fp32 / fp16 [T, B, 16] per block of 32 (GGUF Q8_0's d), or Q6_K's two-level form
// (tiled_q6_k); checked, then tiled_linear.
void tiled_int8(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                int64_t group, const std::optional<at::Tensor>& supers) {
  check_tiled(out, x, qweight, 512);
  if (supers) {
    tiled_q6_k(out, x, qweight, scales, group, *supers);
    return;
  }
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
    tiled_int8(out, x, qweight, scales, group, superblocks);
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
