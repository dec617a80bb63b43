/*
 * Walking rows in register tiles whose size is a compile-time constant, for the CPU kernels of
 * this folder: whole tiles of R rows, then one tile of the rows left (fewer than R), each call
 * getting its tile's row count as a type so the kernel's loops over it unroll; or tiles whose
 * rows lie evenly apart (weight rows streamed from memory).
 */

#pragma once

#include <cstdint>
#include <type_traits>

namespace vllm_cpu_bits {

template <int R>
using RowTile = std::integral_constant<int, R>;

// f(RowTile<rest>{}, m) for the last rows of for_row_tiles, 0 < rest <= R.
template <int R, typename F>
inline void last_row_tile(int64_t rest, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (rest == R)
      f(RowTile<R>{}, m);
    else
      last_row_tile<R - 1>(rest, m, f);
  }
}

// Calls f(RowTile<r>{}, m) for consecutive tiles of rows m .. m + r - 1 covering [begin, end),
// r = R but for the last tile.
template <int R, typename F>
inline void for_row_tiles(int64_t begin, int64_t end, F&& f) {
  int64_t m = begin;
  for (; m + R <= end; m += R) f(RowTile<R>{}, m);
  if (m < end) last_row_tile<R - 1>(end - m, m, f);
}

// The same over [0, M).
template <int R, typename F>
inline void for_row_tiles(int64_t M, F&& f) {
  for_row_tiles<R>(0, M, f);
}

// Tiles of R rows lying evenly apart over [begin, end): with q = (end - begin) / R, calls
// f(RowTile<R>{}, begin + i, q) for i < q, tile i taking rows begin + i + j q (j < R). Each row of
// a tile is then a sequential stream pages from the others, which the hardware prefetchers
// follow; R neighbouring short rows read side by side are a pattern they barely learn (one Zen 3
// thread, weights far beyond cache: dense_gemv.cpp and quant_linear.cpp measure it). Returns the
// first row left: fewer than R remain from it.
template <int R, typename F>
inline int64_t for_strided_tiles(int64_t begin, int64_t end, F&& f) {
  const int64_t q = (end - begin) / R;
  for (int64_t i = 0; i < q; ++i) f(RowTile<R>{}, begin + i, q);
  return begin + q * R;
}

}  // namespace vllm_cpu_bits
