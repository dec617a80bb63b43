/*
 * Walking rows in register tiles whose size is a compile-time constant, for the CPU kernels of
 * this folder: whole tiles of R rows, then one tile of the rows left (fewer than R), each call
 * getting its tile's row count as a type so the kernel's loops over it unroll.
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

}  // namespace vllm_cpu_bits
