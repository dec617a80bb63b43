/*
 * Paged attention on the CPU for sequences with few query tokens: decodes, an aLoRA's
 * invocation and first tokens over a long cached conversation, small prefill chunks. Keys
 * and values are read in place from the paged KV cache (no gather copy). Built and loaded
 * by vllm/attention/backends/cpu_native.py.
 *
 * Semantics (identical to vllm/attention/backends/torch_ref.py's paged_attention):
 *   Sequence i < seq_lens.size(0) owns the query tokens query_start_loc[i] ..
 *   query_start_loc[i+1] - 1. With q = their count and L = seq_lens[i] (1 <= q <= L), its
 *   token j sits at position p_j = L - q + j. For query head h, G = H / Hkv and kv = h / G:
 *     k_t = kv_cache[0, block_table[i, t / bs], t % bs, kv, :]     (v_t likewise from kv_cache[1])
 *     s_t = scale * <query[tok, h, :], k_t>                        for t = f_j .. p_j
 *     s_t = soft_cap * tanh(s_t / soft_cap)                        if soft_cap > 0
 *     out[tok, h, :] = sum_t softmax(s ++ [sinks[h]])_t * v_t      (the sink only if sinks given)
 *   with f_j = max(0, p_j - sliding_window + 1) if sliding_window > 0, else 0: the variant of
 *   vllm/attention/variant.py, whose fields map to sliding_window = 0, soft_cap = 0 and no
 *   sinks when unset (then the attention is plain causal).
 *   Only sequences with q <= max_query_len are computed; the rows of the others are not
 *   written (the caller computes them another way). Storage may be fp32, bf16 or fp16
 *   (query, cache and out share it); all arithmetic is in fp32 (at::opmath_type), rounded
 *   to the storage type only when writing out. exp is at::vec's exp_u20 (within 20 ulp of
 *   fp32 exp, far below any test tolerance).
 *
 * Shapes:
 *   out, query       [>= num_tokens, H, D]      any token/head strides, unit stride along D
 *   kv_cache         [2, num_blocks, bs, Hkv, D] contiguous
 *   block_table      [>= num_seqs, max_blocks] int32, unit stride along blocks
 *   seq_lens         [num_seqs] int32, contiguous
 *   query_start_loc  [num_seqs + 1] int32, contiguous, non-decreasing from 0
 *   sinks            [H] floating (read as fp32), or undefined / empty for none
 *   Lengths, token ranges and the block ids they reach are checked before any work.
 *
 * Work split: one task per (sequence, KV head, run of at most kMaxTokensPerTask query
 * tokens, range of kKeysPerTask keys), run by at::parallel_for on torch's intra-op threads.
 * A run's keys start at the block holding its first token's first visible key, so with a
 * sliding window a decode reads only the blocks its window touches.
 * A task computes the rows of its tokens times the G query heads sharing the KV head over
 * its keys, reading each key and value row of that head once for all of them: an exact
 * two-pass softmax (all logits, then max subtraction and exp, then one pass over the values)
 * whose unnormalised output, max and sum are merged across the key ranges (a sink enters
 * that merge as one more partial: max sink, sum 1, no value). With enough (sequence, KV head,
 * run) groups for the threads (prefills), a thread runs a group's tasks one after the other and
 * merges them at once; otherwise (decodes) all tasks run in parallel, then the merges. The split
 * depends only on each sequence's own lengths (and the window), and the merge's arithmetic not
 * on which thread runs it, so a row's arithmetic is the same whatever else is in the batch and
 * whatever the thread count: results are bitwise reproducible.
 *
 * Inner loops: with few rows per task (decodes), dot products on the keys in place, kRowTile
 * query rows sharing every load. With many, a chunk of kChunkKeys keys is transposed to
 * [D, keys] so that one vector FMA advances W keys of a query row, in register tiles of
 * kLogitRows rows x kLogitVecs vectors of keys; the values' tiles (kValueRows rows x 4 vectors
 * of features) keep their accumulators in registers across the chunk's blocks.
 */

// The at::vec headers pick their SIMD width from CPU_CAPABILITY_* macros, which torch's own
// build sets per kernel file; here they follow the instruction sets -march=native enabled.
// CPU_CAPABILITY names the inline namespace of the vector types: a name of our own keeps
// them apart from any copy compiled into libtorch.
#define CPU_CAPABILITY vllm_cpu_native
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_bits.h"
#include "prefetch.h"

namespace {

// How many blocks ahead of the one being read a task asks for its rows. The rows of one KV
// head are strided (Hkv * D apart) and the blocks scattered, which the hardware prefetchers
// follow poorly; two blocks ahead measured best (1.1x-1.2x over none, flat beyond).
constexpr int64_t kPrefetchBlocks = 2;
// Query tokens per task: more rows share each key and value read.
constexpr int64_t kMaxTokensPerTask = 32;
// Keys per task (rounded up to whole blocks): a long context is split into ranges whose
// partial softmax results are merged, so one request (Hkv tasks otherwise) keeps every
// thread busy, and a task's logits buffer stays small.
constexpr int64_t kKeysPerTask = 512;
// Groups (a run of tokens and a KV head, all its key ranges) per thread from which a thread runs
// whole groups rather than single key ranges: enough that the threads stay evenly busy.
constexpr int64_t kGroupsPerThread = 8;
// Query rows computed together in the inner loops of a decode (keys read in place): with D = 64
// and AVX-512, 4 rows x 4 vectors of accumulators plus the loaded row fit the 32 registers.
constexpr int kRowTile = 4;
// Register tiles of the many-row path (keys transposed), sized to the vector registers (32 on
// AVX-512, 16 on AVX2): the logits take kLogitRows query rows x kLogitVecs vectors of keys
// (each key vector loaded once for all the rows, each query value broadcast once for
// kLogitVecs vectors), the values kValueRows rows x 4 vectors of features.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLogitRows = 8;
constexpr int kValueRows = 6;
#else
constexpr int kLogitRows = 4;
constexpr int kValueRows = 4;
#endif
constexpr int kLogitVecs = 2;
// Keys the many-row path transposes, and reads values of, at a time (rounded up to whole
// blocks): the inner loops keep their accumulators in registers across a chunk's blocks, and a
// chunk's transposed keys and values stay in L1 while every row tile reads them.
constexpr int64_t kChunkKeys = 64;
// Sequences with at least this many query rows (tokens x G) transpose each key block for the
// logits; fewer rows (decodes: G rows) take dot products on the keys in place. Decided per
// sequence, not per task, so a row's arithmetic never depends on how tasks are split.
constexpr int64_t kTransposeMinRows = 8;

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

// Calls f(RowTile<r>{}, m) for consecutive tiles of rows m .. m + r - 1 covering [0, M), r = R
// but for the last tile.
template <int R, typename F>
inline void for_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + R <= M; m += R) f(RowTile<R>{}, m);
  if (m < M) last_row_tile<R - 1>(M - m, m, f);
}

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
// of a decode's time outside the arithmetic).
struct Ahead {
  const char* rows = nullptr;            // row 0, or nullptr for none
  int64_t n = 0, stride = 0, bytes = 0;  // rows; bytes from one row to the next; bytes to ask for per row
  void ask(int64_t t) const {
    if (t < n)
      for (int64_t b = 0; b < bytes; b += 64) vllm_cpu_bits::prefetch_line(rows + t * stride + b);
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
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  uint16_t part[8] = {};
  const uint16_t* src = reinterpret_cast<const uint16_t*>(p);
  if (w < Vec::size()) src = static_cast<const uint16_t*>(std::memcpy(part, p, w * sizeof(uint16_t)));
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
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
  T sums[KS];
  for (int r = 0; r < R; ++r) {
    lane_sums<KS>(acc[r], sums);
    for (int j = 0; j < KS; ++j) logits[r][t + j] = sums[j];
  }
}

// The same logits as block_logits from the keys in place: cheaper than transposing the block
// when a task has few query rows (decodes), whose keys are each used only a few times. Four keys
// at a time (two for 4-row tiles, to stay within 16 vector registers): one key at a time was a
// single FMA chain per row, bound by its latency.
template <int R, typename T, typename S>
inline void row_logits(T* const* logits, const T* const* q, const S* rows, int64_t stride, int64_t n, int64_t D,
                       const Ahead& ahead) {
  constexpr int KS = R <= 3 ? 4 : 2;
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

// acc[r][0:D] += sum over t < n of p[r][t] * v_t for the R rows of a tile, where value row t is
// blocks[t / bs] + (t % bs) * stride (a chunk of blocks, or one). Four vectors of each row's acc
// stay in registers across all n value rows.
template <int R, typename T, typename S>
inline void block_values(T* const* acc, const T* const* p, const S* const* blocks, int64_t bs, int64_t stride,
                         int64_t n, int64_t D, const Ahead& ahead) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  // f(t, row) for every value row t < n, block by block.
  const auto for_rows = [&](auto&& f) {
    for (int64_t b = 0; b * bs < n; ++b) {
      const S* rows = blocks[b];
      const int64_t t0 = b * bs, nb = std::min(bs, n - t0);
      for (int64_t t = 0; t < nb; ++t) f(t0 + t, rows + t * stride);
    }
  };
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    Vec a[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) a[r][v] = Vec::loadu(acc[r] + d + v * W);
    for_rows([&](int64_t t, const S* row) {
      if (d == 0) ahead.ask(t);
      row += d;
      const Vec v0 = load_row(row, W), v1 = load_row(row + W, W), v2 = load_row(row + 2 * W, W),
                v3 = load_row(row + 3 * W, W);
      for (int r = 0; r < R; ++r) {
        const Vec pt(p[r][t]);
        a[r][0] = at::vec::fmadd(pt, v0, a[r][0]);
        a[r][1] = at::vec::fmadd(pt, v1, a[r][1]);
        a[r][2] = at::vec::fmadd(pt, v2, a[r][2]);
        a[r][3] = at::vec::fmadd(pt, v3, a[r][3]);
      }
    });
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) a[r][v].store(acc[r] + d + v * W);
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
  const auto max_of = [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); };
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
  for (t = 0; t < n; t += W) {
    const int64_t w = std::min(W, n - t);
    const Vec e = Vec::set(Vec(opmath_t(0)), (Vec::loadu(row + t, w) - max).exp_u20(), w);
    e.store(row + t, w);
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

// What the layer adds to plain causal attention (see the header): 0, 0 and nullptr for none.
struct Variant {
  int64_t window;      // positions a query sees, itself included
  float soft_cap;      // logit soft cap
  const float* sinks;  // [H] one extra logit per query head
};

// The first key a query token at position p attends to.
inline int64_t first_visible(const Variant& variant, int64_t p) {
  return variant.window > 0 ? std::max<int64_t>(0, p - variant.window + 1) : 0;
}

// A per-thread buffer of at least n values, kept across calls: the scratch of a task that
// attends over a long context is hundreds of KB, which a fresh allocation per call would
// pay for again in page faults. Buffers of different Use are distinct.
enum class Use { kTask, kPartials };
template <typename T, Use use = Use::kTask>
inline T* thread_scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// One task: query tokens [j0, j1) of sequence `seq`, KV head `kv`, keys [k0, k1). Where all tasks
// run before the merges, its rows' partial results start at row `part` of the shared buffer.
struct Task {
  int64_t seq, kv, j0, j1, k0, k1, part;
};

// The tasks of one (sequence, KV head, run of tokens): `count` tasks, `stride` apart from
// `first`, one per key range, whose partials are merged into the output rows.
struct Group {
  int64_t first, count, stride;
};

// Each (sequence, KV head) split into equal runs of at most kMaxTokensPerTask query tokens, and
// each run's keys (from the block of its first token's first visible key up to the last token's
// own) into ranges of `keys_per_task`, each starting on a block boundary. The split depends only
// on the sequence, so a row's arithmetic is the same whatever else is in the batch and however
// many threads run it. The KV heads of a key range are consecutive tasks: the heads of a token
// sit side by side in the cache, so a thread runs tasks that read neighbouring lines back to back.
inline void split_tasks(const std::vector<int64_t>& seqs, const int32_t* qsl, const int32_t* lens, int64_t Hkv,
                        int64_t G, int64_t bs, int64_t keys_per_task, const Variant& variant, std::vector<Task>& tasks,
                        std::vector<Group>& groups) {
  int64_t rows = 0;
  for (const int64_t i : seqs) {
    const int64_t q = qsl[i + 1] - qsl[i], L = lens[i];
    const int64_t runs = (q + kMaxTokensPerTask - 1) / kMaxTokensPerTask, step = (q + runs - 1) / runs;
    for (int64_t j0 = 0; j0 < q; j0 += step) {
      const int64_t j1 = std::min(q, j0 + step), n_keys = L - q + j1;
      const int64_t first = first_visible(variant, L - q + j0) / bs * bs;  // skip whole blocks before
      for (int64_t kv = 0; kv < Hkv; ++kv)
        groups.push_back({static_cast<int64_t>(tasks.size()) + kv, 0, Hkv});
      for (int64_t k0 = first; k0 < n_keys; k0 += keys_per_task)
        for (int64_t kv = 0; kv < Hkv; ++kv) {
          tasks.push_back({i, kv, j0, j1, k0, std::min(n_keys, k0 + keys_per_task), rows});
          rows += (j1 - j0) * G;
          ++groups[groups.size() - Hkv + kv].count;
        }
    }
  }
}

// Partial results of one task: per row, the unnormalised output [D], then the max logit and the
// sum of exp(logit - max) over the task's keys (-inf and 0 when the row attends to none of them).
// kTranspose: the many-row path (keys transposed a chunk at a time) or the decode path (keys and
// values read in place, a block at a time); one function each, so that each path's inner loops
// are compiled, and inlined, on their own.
template <typename scalar_t, bool kTranspose>
void partial_attention(const Task& task, const scalar_t* q_base, int64_t q_s0, int64_t q_s1, const scalar_t* k_cache,
                       const scalar_t* v_cache, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                       const int32_t* qsl, int64_t G, int64_t D, int64_t bs, int64_t Hkv, int64_t keys_per_task,
                       at::opmath_type<scalar_t> scale, const Variant& variant, at::opmath_type<scalar_t>* part_rows) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t W = at::vec::Vectorized<opmath_t>::size();
  const int64_t token_stride = Hkv * D, block_stride = bs * Hkv * D;  // within kv_cache[0 or 1]
  const int64_t ahead = kPrefetchBlocks * bs, row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t L = seq_lens[task.seq], q_len = qsl[task.seq + 1] - qsl[task.seq];
  const int64_t M = (task.j1 - task.j0) * G, span = task.k1 - task.k0;
  const int32_t* blocks = tables + task.seq * table_stride;
  const scalar_t* k_head = k_cache + task.kv * D;
  const scalar_t* v_head = v_cache + task.kv * D;
  // Keys read at a time: a chunk of blocks where the keys are transposed, else one block.
  const int64_t chunk = kTranspose ? (kChunkKeys + bs - 1) / bs * bs : bs;
  const int64_t ldk = (chunk + kLogitVecs * W - 1) / (kLogitVecs * W) * (kLogitVecs * W);  // transposed row length

  // Per-thread scratch, reused by every task. Row m is token j0 + m / G, query head kv * G + m % G.
  const int64_t max_rows = kMaxTokensPerTask * G;
  opmath_t* q = thread_scratch<opmath_t>(max_rows * D + max_rows * keys_per_task + chunk * D + D * ldk);
  opmath_t* logits = q + max_rows * D;                 // [rows, span] (q: [rows, D], pre-scaled)
  opmath_t* rows = logits + max_rows * keys_per_task;  // [chunk, D] converted blocks (non-opmath storage)
  opmath_t* kt = rows + chunk * D;                     // [D, ldk] one chunk's keys transposed
  // [2, rows]: the keys of the range each row attends to are lo[m] .. hi[m] - 1 (causal, window)
  int64_t* lo = thread_scratch<int64_t>(2 * max_rows);
  int64_t* hi = lo + max_rows;

  for (int64_t m = 0; m < M; ++m) {
    const int64_t j = task.j0 + m / G, h = task.kv * G + m % G;
    const scalar_t* src = q_base + (qsl[task.seq] + j) * q_s0 + h * q_s1;
    for (int64_t d = 0; d < D; ++d) q[m * D + d] = static_cast<opmath_t>(src[d]) * scale;
    const int64_t p = L - q_len + j;
    hi[m] = std::clamp<int64_t>(p + 1 - task.k0, 0, span);
    lo[m] = std::clamp<int64_t>(first_visible(variant, p) - task.k0, 0, hi[m]);
  }

  // The rows from key k0 + start on of `head` (keys or values: one block, as k0 is a multiple of
  // bs, rows token_stride apart); `next` gets this head's rows kPrefetchBlocks blocks further on,
  // for the inner loops to ask for. (Asking for every head's rows from the first head's task,
  // whole token rows, measured slower.)
  auto block_at = [&](const scalar_t* head, int64_t start, Ahead& next) {
    const int64_t key = task.k0 + start;
    next = Ahead{};
    if (start + ahead < span)
      next = Ahead{reinterpret_cast<const char*>(head + blocks[(key + ahead) / bs] * block_stride),
                   std::min(bs, span - start - ahead), token_stride * static_cast<int64_t>(sizeof(scalar_t)),
                   row_bytes};
    return head + blocks[key / bs] * block_stride;
  };
  // Pass 1: logits of the task's keys, one chunk at a time.
  for (int64_t start = 0; start < span; start += chunk) {
    const int64_t n = std::min(chunk, span - start);
    Ahead next;
    const scalar_t* block = nullptr;
    int64_t stride = token_stride;
    const opmath_t* k = nullptr;
    if constexpr (kTranspose) {
      for (int64_t b = 0; b * bs < n; ++b) {  // each block as opmath rows, transposed into the chunk
        const int64_t nb = std::min(bs, n - b * bs);
        k = rows_as_opmath(block_at(k_head, start + b * bs, next), nb, token_stride, D, rows, stride);
        for (int64_t t = 0; t < next.n; ++t) next.ask(t);  // many rows share each key: one burst is fine
        at::vec::transpose_mxn<opmath_t>(k, stride, kt + b * bs, ldk, nb, D);
      }
    } else {
      block = block_at(k_head, start, next);
      // The block as opmath rows where the inner loops do not read it in place.
      if constexpr (!kReadInPlace<scalar_t>) k = rows_as_opmath(block, n, token_stride, D, rows, stride);
    }
    for_row_tiles<kTranspose ? kLogitRows : kRowTile>(M, [&](auto tile, int64_t m) {
      constexpr int R = decltype(tile)::value;
      opmath_t* lp[R];
      const opmath_t* qp[R];
      for (int r = 0; r < R; ++r) {
        lp[r] = logits + (m + r) * keys_per_task + start;
        qp[r] = q + (m + r) * D;
      }
      if constexpr (kTranspose) {
        block_logits<R>(lp, qp, kt, ldk, n, D);
      } else {
        if constexpr (kReadInPlace<scalar_t>)
          row_logits<R>(lp, qp, block, token_stride, n, D, m == 0 ? next : Ahead{});
        else
          row_logits<R>(lp, qp, k, stride, n, D, m == 0 ? next : Ahead{});
      }
    });
  }
  // Softmax numerators over each row's keys (soft-capped first); the rest of the range gets
  // probability 0.
  const opmath_t cap = static_cast<opmath_t>(variant.soft_cap);
  for (int64_t m = 0; m < M; ++m) {
    opmath_t* row = logits + m * keys_per_task;
    opmath_t* part = part_rows + m * (D + 2);
    if (hi[m] > lo[m]) {
      if (cap > 0) soft_cap_logits(row + lo[m], hi[m] - lo[m], cap);
      std::tie(part[D], part[D + 1]) = softmax_numerators(row + lo[m], hi[m] - lo[m]);
    } else {
      part[D] = -std::numeric_limits<opmath_t>::infinity();
      part[D + 1] = opmath_t(0);
    }
    std::fill(row, row + lo[m], opmath_t(0));
    std::fill(row + hi[m], row + span, opmath_t(0));
    std::fill(part, part + D, opmath_t(0));
  }

  // Pass 2: probability-weighted sum of the values into the partial rows, one chunk at a time.
  const scalar_t* in_place[kChunkKeys];  // a chunk's value blocks (at most one per key)
  const opmath_t* converted[kChunkKeys];  // the same, converted where not read in place
  for (int64_t start = 0; start < span; start += chunk) {
    const int64_t n = std::min(chunk, span - start);
    Ahead next;
    int64_t stride = token_stride;
    for (int64_t b = 0; b * bs < n; ++b) {
      in_place[b] = block_at(v_head, start + b * bs, next);
      if constexpr (kTranspose)
        for (int64_t t = 0; t < next.n; ++t) next.ask(t);
      if constexpr (!kReadInPlace<scalar_t>)
        converted[b] = rows_as_opmath(in_place[b], std::min(bs, n - b * bs), token_stride, D, rows + b * bs * D,
                                      stride);
    }
    if constexpr (kTranspose) next = Ahead{};  // asked for above
    for_row_tiles<kTranspose ? kValueRows : kRowTile>(M, [&](auto tile, int64_t m) {
      constexpr int R = decltype(tile)::value;
      opmath_t* ap[R];
      const opmath_t* pp[R];
      for (int r = 0; r < R; ++r) {
        ap[r] = part_rows + (m + r) * (D + 2);
        pp[r] = logits + (m + r) * keys_per_task + start;
      }
      if constexpr (kReadInPlace<scalar_t>)
        block_values<R>(ap, pp, in_place, bs, stride, n, D, m == 0 ? next : Ahead{});
      else
        block_values<R>(ap, pp, converted, bs, stride, n, D, m == 0 ? next : Ahead{});
    });
  }
}

// out rows of a group: its tasks' partials merged in key order,
// out = sum_s exp(max_s - max) acc_s / (sum_s exp(max_s - max) sum_s + exp(sink - max)),
// max taken over the partials and the sink (the sink terms only with sinks). part_rows(s): the
// partials of the group's task s, [M, D + 2].
template <typename scalar_t, typename PartRows>
void merge_partials(const Group& group, const std::vector<Task>& tasks, const PartRows& part_rows,
                    scalar_t* out_base, int64_t o_s0, int64_t o_s1, const int32_t* qsl, int64_t G, int64_t D,
                    const float* sinks) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<opmath_t>;
  constexpr int64_t W = Vec::size();
  const Task& first = tasks[group.first];
  const int64_t M = (first.j1 - first.j0) * G;
  for (int64_t m = 0; m < M; ++m) {
    auto part = [&](int64_t s) { return part_rows(s) + m * (D + 2); };
    const int64_t j = first.j0 + m / G, h = first.kv * G + m % G;
    opmath_t max = -std::numeric_limits<opmath_t>::infinity();
    for (int64_t s = 0; s < group.count; ++s) max = std::max(max, part(s)[D]);
    if (sinks) max = std::max(max, static_cast<opmath_t>(sinks[h]));
    // With one range and no sink the weight is exp(0) = 1 and the merge is exact: out = acc / sum.
    opmath_t* weights = thread_scratch<opmath_t>(group.count + D);  // [count] exp(max_s - max)
    opmath_t* acc = weights + group.count;                          // [D] the merged output
    opmath_t sum = sinks ? std::exp(static_cast<opmath_t>(sinks[h]) - max) : opmath_t(0);
    for (int64_t s = 0; s < group.count; ++s) {
      weights[s] = std::exp(part(s)[D] - max);
      sum += weights[s] * part(s)[D + 1];
    }
    const Vec inv(opmath_t(1) / sum);
    for (int64_t d = 0; d < D; d += W) {
      const int64_t w = std::min(W, D - d);
      Vec a(opmath_t(0));
      for (int64_t s = 0; s < group.count; ++s) a = at::vec::fmadd(Vec(weights[s]), Vec::loadu(part(s) + d, w), a);
      (a * inv).store(acc + d, w);
    }
    scalar_t* dst = out_base + (qsl[first.seq] + j) * o_s0 + h * o_s1;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d]);
  }
}

template <typename scalar_t>
void attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const int32_t* seq_lens, const int32_t* qsl,
                      const std::vector<int64_t>& seqs, double scale, const Variant& variant) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3), G = H / Hkv;
  const int64_t keys_per_task = (kKeysPerTask + bs - 1) / bs * bs;
  std::vector<Task> tasks;
  std::vector<Group> groups;
  split_tasks(seqs, qsl, seq_lens, Hkv, G, bs, keys_per_task, variant, tasks, groups);
  const scalar_t* k_cache = kv_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_cache = k_cache + num_blocks * bs * Hkv * D;
  const scalar_t* q_base = query.const_data_ptr<scalar_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const opmath_t op_scale = static_cast<opmath_t>(scale);
  scalar_t* out_base = out.data_ptr<scalar_t>();
  // Task t's partial results into `rows` [M, D + 2].
  auto run_task = [&](int64_t t, opmath_t* rows) {
    // Decided per sequence, not per task, so a row's arithmetic never depends on how tasks are split.
    const bool transpose = (qsl[tasks[t].seq + 1] - qsl[tasks[t].seq]) * G >= kTransposeMinRows;
    (transpose ? partial_attention<scalar_t, true> : partial_attention<scalar_t, false>)(
        tasks[t], q_base, query.stride(0), query.stride(1), k_cache, v_cache, tables, block_table.stride(0), seq_lens,
        qsl, G, D, bs, Hkv, keys_per_task, op_scale, variant, rows);
  };
  auto merge = [&](int64_t g, const auto& part_rows) {
    merge_partials<scalar_t>(groups[g], tasks, part_rows, out_base, out.stride(0), out.stride(1), qsl, G, D,
                             variant.sinks);
  };
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  if (num_groups >= kGroupsPerThread * at::get_num_threads()) {
    // Enough groups to share out (prefills): a thread runs a group's tasks into a buffer of its own
    // and merges them right away, while they are in its cache (merged later, they were read back
    // from memory), and no buffer grows with the prompt. The arithmetic is the same either way.
    at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const Task& first = tasks[groups[g].first];
        const int64_t task_values = (first.j1 - first.j0) * G * (D + 2);
        opmath_t* local = thread_scratch<opmath_t, Use::kPartials>(groups[g].count * task_values);
        for (int64_t s = 0; s < groups[g].count; ++s) run_task(groups[g].first + s * groups[g].stride, local + s * task_values);
        merge(g, [&](int64_t s) { return local + s * task_values; });
      }
    });
    return;
  }
  const Task& last = tasks.back();
  std::vector<opmath_t> partials((last.part + (last.j1 - last.j0) * G) * (D + 2));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_task(t, partials.data() + tasks[t].part * (D + 2));
  });
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      merge(g, [&](int64_t s) { return partials.data() + tasks[groups[g].first + s * groups[g].stride].part * (D + 2); });
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t max_query_len, double scale, int64_t sliding_window, double soft_cap,
                     const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(out.dim() == 3 && query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_attention: expected out/query [n, H, D] and kv_cache [2, num_blocks, bs, Hkv, D]");
  TORCH_CHECK(out.device().is_cpu() && query.device().is_cpu() && kv_cache.device().is_cpu() &&
                  block_table.device().is_cpu() && seq_lens.device().is_cpu() && query_start_loc.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "paged_attention: out, query and kv_cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_attention: block_table, seq_lens and query_start_loc must be int32");
  const int64_t H = query.size(1), D = query.size(2), Hkv = kv_cache.size(3), num_seqs = seq_lens.size(0);
  TORCH_CHECK(out.size(1) == H && out.size(2) == D && kv_cache.size(4) == D,
              "paged_attention: shape mismatch between out, query and kv_cache");
  TORCH_CHECK(H % Hkv == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(kv_cache.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  block_table.stride(1) == 1 && query.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: kv_cache, seq_lens and query_start_loc contiguous, unit stride along D and blocks");
  TORCH_CHECK(block_table.size(0) >= num_seqs && query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: block_table needs a row and query_start_loc an entry (plus one) per sequence");
  TORCH_CHECK(max_query_len >= 1, "paged_attention: max_query_len must be at least 1");
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(soft_cap >= 0 && std::isfinite(soft_cap),
              "paged_attention: soft_cap must be finite and >= 0 (0: none), got ", soft_cap);
  at::Tensor sink_logits;  // [H] fp32, kept alive while the kernel reads it
  if (sinks.has_value() && sinks->defined() && sinks->numel() > 0) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->device().is_cpu() &&
                    at::isFloatingType(sinks->scalar_type()),
                "paged_attention: sinks must be a floating CPU tensor of shape [num_heads] = [", H, "], got ",
                sinks->sizes(), " ", sinks->scalar_type(), " on ", sinks->device());
    sink_logits = sinks->to(at::kFloat).contiguous();
  }
  const Variant variant{sliding_window, static_cast<float>(soft_cap),
                        sink_logits.defined() ? sink_logits.const_data_ptr<float>() : nullptr};

  // Lengths, token ranges and the block ids the kernel reads (from the first token's window on)
  // are checked here, once, so the parallel loop never reads outside a table row, the cache or
  // the query.
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const int64_t bs = kv_cache.size(2), num_blocks = kv_cache.size(1), capacity = block_table.size(1) * bs;
  TORCH_CHECK(qsl[0] == 0, "paged_attention: query_start_loc[0] must be 0");
  std::vector<int64_t> computed;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q = qsl[i + 1] - qsl[i];
    TORCH_CHECK(q >= 0 && qsl[i + 1] <= std::min(query.size(0), out.size(0)), "paged_attention: query_start_loc[",
                i + 1, "] = ", qsl[i + 1], " is outside [", qsl[i], ", ", std::min(query.size(0), out.size(0)), "]");
    if (q == 0 || q > max_query_len) continue;
    TORCH_CHECK(lens[i] >= q && lens[i] <= capacity, "paged_attention: seq_lens[", i, "] = ", lens[i],
                " is outside [", q, ", ", capacity, "]");
    for (int64_t j = first_visible(variant, lens[i] - q) / bs; j < (lens[i] + bs - 1) / bs; ++j) {
      const int32_t block = tables[i * block_table.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block_table[", i, ", ", j, "] = ", block,
                  " is outside [0, ", num_blocks, ")");
    }
    computed.push_back(i);
  }
  if (computed.empty()) return;

  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return attention_kernel<float>(out, query, kv_cache, block_table, lens, qsl, computed, scale, variant);
    case at::kBFloat16:
      return attention_kernel<at::BFloat16>(out, query, kv_cache, block_table, lens, qsl, computed, scale, variant);
    case at::kHalf:
      return attention_kernel<at::Half>(out, query, kv_cache, block_table, lens, qsl, computed, scale, variant);
    default: TORCH_CHECK(false, "paged_attention: dtype ", kv_cache.scalar_type(), " is not fp32, bf16 or fp16");
  }
}

}  // namespace

TORCH_LIBRARY(vllm_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int max_query_len, float scale, int sliding_window=0, float soft_cap=0., "
      "Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_cpu, CPU, m) { m.impl("paged_attention", TORCH_FN(paged_attention)); }
