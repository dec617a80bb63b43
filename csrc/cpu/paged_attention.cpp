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
 *     s_t = scale * <query[tok, h, :], k_t>                        for t = 0 .. p_j
 *     out[tok, h, :] = sum_t softmax(s)_t * v_t
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
 *   Lengths, token ranges and the block ids they reach are checked before any work.
 *
 * Work split: one task per (sequence, KV head, run of at most kMaxTokensPerTask query
 * tokens; shorter runs when there would be under two tasks per thread), run by
 * at::parallel_for on torch's intra-op threads. A task computes the rows of its tokens times
 * the G query heads sharing the KV head, reading each key and value row of that head once
 * for all of them. The softmax is exact and two-pass: all logits, then max subtraction and
 * exp, then one pass over the values. Each row's arithmetic is the same whatever the task
 * split and thread count, so results are bitwise reproducible.
 *
 * Inner loops: a key block is transposed to [D, bs] so that one vector FMA advances W keys
 * of a query row at once, and kRowTile query rows share every load of a key or value vector.
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
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// How many blocks ahead of the one being read a task asks for its rows. The rows of one KV
// head are strided (Hkv * D apart) and the blocks scattered, which the hardware prefetchers
// follow poorly; two blocks ahead measured best (1.1x-1.2x over none, flat beyond).
constexpr int64_t kPrefetchBlocks = 2;
// Query tokens per task: more rows share each key and value read, fewer tasks to balance.
constexpr int64_t kMaxTokensPerTask = 16;
// Cap on a task's logits buffer (rows x keys), in opmath values, so long contexts with many
// query heads per KV head keep a bounded per-thread footprint.
constexpr int64_t kMaxLogits = int64_t(1) << 20;
// Query rows computed together in the inner loops (register blocking: with D = 64 and
// AVX-512, 4 rows x 4 vectors of accumulators plus the loaded row fit the 32 registers).
constexpr int kRowTile = 4;
// Sequences with at least this many query rows (tokens x G) transpose each key block for the
// logits; fewer rows (decodes: G rows) take dot products on the keys in place. Decided per
// sequence, not per task, so a row's arithmetic never depends on how tasks are split.
constexpr int64_t kTransposeMinRows = 8;

template <int R>
using RowTile = std::integral_constant<int, R>;

// Calls f(RowTile<r>{}, m) for consecutive tiles of rows m .. m + r - 1 covering [0, M).
template <typename F>
inline void for_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) f(RowTile<kRowTile>{}, m);
  switch (M - m) {
    case 3: f(RowTile<3>{}, m); break;
    case 2: f(RowTile<2>{}, m); break;
    case 1: f(RowTile<1>{}, m); break;
    default: break;
  }
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

// Asks for n rows of `bytes` bytes, `stride` elements apart, to be brought into cache.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* src, int64_t n, int64_t stride, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(src + t * stride) + b);
}

// logits[r][t] = <q[r], k_t> for t < n and the R rows of a tile; kt [D, ldk] holds the n keys
// transposed (column t = key t), so each FMA advances W keys of one row. Four partial sums
// per row (over d mod 4) keep 4R FMA chains in flight instead of R.
template <int R, typename T>
inline void block_logits(T* const* logits, const T* const* q, const T* kt, int64_t ldk, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t kb = 0; kb < n; kb += W) {
    Vec acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = Vec(T(0));
    const T* col = kt + kb;
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
      const Vec k0 = Vec::loadu(col + d * ldk), k1 = Vec::loadu(col + (d + 1) * ldk),
                k2 = Vec::loadu(col + (d + 2) * ldk), k3 = Vec::loadu(col + (d + 3) * ldk);
      for (int r = 0; r < R; ++r) {
        acc[r][0] = at::vec::fmadd(Vec(q[r][d]), k0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(Vec(q[r][d + 1]), k1, acc[r][1]);
        acc[r][2] = at::vec::fmadd(Vec(q[r][d + 2]), k2, acc[r][2]);
        acc[r][3] = at::vec::fmadd(Vec(q[r][d + 3]), k3, acc[r][3]);
      }
    }
    for (; d < D; ++d) {
      const Vec k = Vec::loadu(col + d * ldk);
      for (int r = 0; r < R; ++r) acc[r][0] = at::vec::fmadd(Vec(q[r][d]), k, acc[r][0]);
    }
    const int64_t w = std::min(W, n - kb);
    for (int r = 0; r < R; ++r) ((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3])).store(logits[r] + kb, w);
  }
}

// The same logits from the keys in place (row t at rows + t * stride), one dot product and
// horizontal sum per (row, key): cheaper than transposing the block when a task has few
// query rows (decodes), whose keys are each used only a few times.
template <int R, typename T>
inline void row_logits(T* const* logits, const T* const* q, const T* rows, int64_t stride, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t t = 0; t < n; ++t) {
    const T* row = rows + t * stride;
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Vec(T(0));
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      const Vec k = Vec::loadu(row + d);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q[r] + d), k, acc[r]);
    }
    if (d < D) {
      const Vec k = Vec::loadu(row + d, D - d);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q[r] + d, D - d), k, acc[r]);
    }
    for (int r = 0; r < R; ++r)
      logits[r][t] = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc[r]);
  }
}

// acc[r][0:D] += sum over t < n of p[r][t] * rows[t * stride : t * stride + D] for the R rows of
// a tile. Four vectors of each row's acc stay in registers across all n value rows.
template <int R, typename T>
inline void block_values(T* const* acc, const T* const* p, const T* rows, int64_t stride, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    Vec a[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) a[r][v] = Vec::loadu(acc[r] + d + v * W);
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride + d;
      const Vec v0 = Vec::loadu(row), v1 = Vec::loadu(row + W), v2 = Vec::loadu(row + 2 * W),
                v3 = Vec::loadu(row + 3 * W);
      for (int r = 0; r < R; ++r) {
        const Vec pt(p[r][t]);
        a[r][0] = at::vec::fmadd(pt, v0, a[r][0]);
        a[r][1] = at::vec::fmadd(pt, v1, a[r][1]);
        a[r][2] = at::vec::fmadd(pt, v2, a[r][2]);
        a[r][3] = at::vec::fmadd(pt, v3, a[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) a[r][v].store(acc[r] + d + v * W);
  }
  for (; d < D; d += W) {
    const int64_t w = std::min(W, D - d);
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec::loadu(acc[r] + d, w);
    for (int64_t t = 0; t < n; ++t) {
      const Vec v = Vec::loadu(rows + t * stride + d, w);
      for (int r = 0; r < R; ++r) a[r] = at::vec::fmadd(Vec(p[r][t]), v, a[r]);
    }
    for (int r = 0; r < R; ++r) a[r].store(acc[r] + d, w);
  }
}

// In place: row[0:n] = exp(row - max(row)); returns 1 / sum of the result. The exp and the
// sum share one pass over the row.
template <typename opmath_t>
inline opmath_t softmax_numerators(opmath_t* row, int64_t n) {
  using Vec = at::vec::Vectorized<opmath_t>;
  constexpr int64_t W = Vec::size();
  const Vec max(at::vec::reduce_all<opmath_t>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n));
  Vec sum(opmath_t(0));
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    const Vec e = (Vec::loadu(row + t) - max).exp_u20();
    e.store(row + t);
    sum = sum + e;
  }
  if (t < n) {
    const Vec e = Vec::set(Vec(opmath_t(0)), (Vec::loadu(row + t, n - t) - max).exp_u20(), n - t);
    e.store(row + t, n - t);
    sum = sum + e;
  }
  return opmath_t(1) / at::vec::vec_reduce_all<opmath_t>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// A per-thread buffer of at least n values, kept across calls: the scratch of a task that
// attends over a long context is hundreds of KB, which a fresh allocation per call would
// pay for again in page faults.
template <typename T>
inline T* thread_scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// One task: query tokens [j0, j1) of sequence `seq`, KV head `kv`.
struct Task {
  int64_t seq, kv, j0, j1;
};

// The tasks: each (sequence, KV head) split into equal runs of at most `max_tokens` query
// tokens, and into more runs when there would be fewer than two tasks per thread (one
// aLoRA request over a long context has only Hkv of them otherwise).
inline std::vector<Task> split_tasks(const std::vector<int64_t>& seqs, const int32_t* qsl, int64_t Hkv,
                                     int64_t max_tokens) {
  const int64_t wanted = 2 * at::get_num_threads();
  const int64_t per_seq_head = (wanted + Hkv * seqs.size() - 1) / (Hkv * seqs.size());
  std::vector<Task> tasks;
  for (const int64_t i : seqs) {
    const int64_t q = qsl[i + 1] - qsl[i];
    const int64_t runs = std::min(q, std::max((q + max_tokens - 1) / max_tokens, per_seq_head));
    const int64_t step = (q + runs - 1) / runs;
    for (int64_t kv = 0; kv < Hkv; ++kv)
      for (int64_t j0 = 0; j0 < q; j0 += step) tasks.push_back({i, kv, j0, std::min(q, j0 + step)});
  }
  return tasks;
}

template <typename scalar_t>
void attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const int32_t* seq_lens, const int32_t* qsl,
                      const std::vector<Task>& tasks, int64_t max_tokens, int64_t max_len, double scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<opmath_t>;
  constexpr int64_t W = Vec::size();
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = H / Hkv, max_rows = max_tokens * G;
  const int64_t token_stride = Hkv * D, block_stride = bs * Hkv * D;  // within kv_cache[0 or 1]
  const int64_t ldk = (bs + W - 1) / W * W;  // a transposed key block's row length
  const scalar_t* k_cache = kv_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_cache = k_cache + num_blocks * block_stride;
  const scalar_t* q_base = query.const_data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t table_stride = block_table.stride(0);
  const opmath_t op_scale = static_cast<opmath_t>(scale);
  const int64_t ahead = kPrefetchBlocks * bs, row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // Per-thread scratch, reused by every task. Row m of a task is its token j0 + m / G and
    // query head kv * G + m % G.
    opmath_t* q = thread_scratch<opmath_t>(2 * max_rows * D + max_rows * max_len + max_rows + bs * D + D * ldk);
    opmath_t* acc = q + max_rows * D;               // [rows, D] unnormalised outputs (q: [rows, D], pre-scaled)
    opmath_t* logits = acc + max_rows * D;          // [rows, max_len]
    opmath_t* inv_sums = logits + max_rows * max_len;  // [rows]
    opmath_t* rows = inv_sums + max_rows;           // [bs, D] one converted block (non-opmath storage)
    opmath_t* kt = rows + bs * D;                   // [D, ldk] one transposed key block
    int64_t* limits = thread_scratch<int64_t>(max_rows);  // [rows] keys each row attends to

    for (int64_t task_id = begin; task_id < end; ++task_id) {
      const Task& task = tasks[task_id];
      const int64_t L = seq_lens[task.seq], q_len = qsl[task.seq + 1] - qsl[task.seq];
      const int64_t M = (task.j1 - task.j0) * G;
      const int32_t* blocks = tables + task.seq * table_stride;
      const scalar_t* k_head = k_cache + task.kv * D;
      const scalar_t* v_head = v_cache + task.kv * D;
      const int64_t n_keys = L - q_len + task.j1;  // keys the task's last token attends to
      const bool transpose = q_len * G >= kTransposeMinRows;

      for (int64_t m = 0; m < M; ++m) {
        const int64_t j = task.j0 + m / G, h = task.kv * G + m % G;
        const scalar_t* src = q_base + (qsl[task.seq] + j) * q_s0 + h * q_s1;
        for (int64_t d = 0; d < D; ++d) q[m * D + d] = static_cast<opmath_t>(src[d]) * op_scale;
        limits[m] = L - q_len + j + 1;
      }

      // Pass 1: logits of every position, one block at a time.
      for (int64_t start = 0; start < n_keys; start += bs) {
        const int64_t n = std::min(bs, n_keys - start);
        if (start + ahead < n_keys)
          prefetch_rows(k_head + blocks[(start + ahead) / bs] * block_stride, std::min(bs, n_keys - start - ahead),
                        token_stride, row_bytes);
        int64_t stride;
        const opmath_t* k =
            rows_as_opmath(k_head + blocks[start / bs] * block_stride, n, token_stride, D, rows, stride);
        if (transpose) at::vec::transpose_mxn<opmath_t>(k, stride, kt, ldk, n, D);
        for_row_tiles(M, [&](auto tile, int64_t m) {
          constexpr int R = decltype(tile)::value;
          opmath_t* lp[R];
          const opmath_t* qp[R];
          for (int r = 0; r < R; ++r) {
            lp[r] = logits + (m + r) * max_len + start;
            qp[r] = q + (m + r) * D;
          }
          if (transpose)
            block_logits<R>(lp, qp, kt, ldk, n, D);
          else
            row_logits<R>(lp, qp, k, stride, n, D);
        });
      }
      // Causal: row m attends to limits[m] keys; the rest of its n_keys get probability 0.
      for (int64_t m = 0; m < M; ++m) {
        opmath_t* row = logits + m * max_len;
        inv_sums[m] = softmax_numerators(row, limits[m]);
        std::fill(row + limits[m], row + n_keys, opmath_t(0));
      }

      // Pass 2: probability-weighted sum of the values.
      std::fill(acc, acc + M * D, opmath_t(0));
      for (int64_t start = 0; start < n_keys; start += bs) {
        const int64_t n = std::min(bs, n_keys - start);
        if (start + ahead < n_keys)
          prefetch_rows(v_head + blocks[(start + ahead) / bs] * block_stride, std::min(bs, n_keys - start - ahead),
                        token_stride, row_bytes);
        int64_t stride;
        const opmath_t* v =
            rows_as_opmath(v_head + blocks[start / bs] * block_stride, n, token_stride, D, rows, stride);
        for_row_tiles(M, [&](auto tile, int64_t m) {
          constexpr int R = decltype(tile)::value;
          opmath_t* ap[R];
          const opmath_t* pp[R];
          for (int r = 0; r < R; ++r) {
            ap[r] = acc + (m + r) * D;
            pp[r] = logits + (m + r) * max_len + start;
          }
          block_values<R>(ap, pp, v, stride, n, D);
        });
      }

      for (int64_t m = 0; m < M; ++m) {
        const int64_t j = task.j0 + m / G, h = task.kv * G + m % G;
        scalar_t* dst = out_base + (qsl[task.seq] + j) * o_s0 + h * o_s1;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[m * D + d] * inv_sums[m]);
      }
    }
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t max_query_len, double scale) {
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

  // Lengths, token ranges and block ids are checked here, once, so the parallel loop never
  // reads outside a table row, the cache or the query.
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const int64_t bs = kv_cache.size(2), num_blocks = kv_cache.size(1), capacity = block_table.size(1) * bs;
  const int64_t G = H / Hkv;
  TORCH_CHECK(qsl[0] == 0, "paged_attention: query_start_loc[0] must be 0");
  std::vector<int64_t> computed;
  int64_t max_len = 0, longest_query = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q = qsl[i + 1] - qsl[i];
    TORCH_CHECK(q >= 0 && qsl[i + 1] <= std::min(query.size(0), out.size(0)), "paged_attention: query_start_loc[",
                i + 1, "] = ", qsl[i + 1], " is outside [", qsl[i], ", ", std::min(query.size(0), out.size(0)), "]");
    if (q == 0 || q > max_query_len) continue;
    TORCH_CHECK(lens[i] >= q && lens[i] <= capacity, "paged_attention: seq_lens[", i, "] = ", lens[i],
                " is outside [", q, ", ", capacity, "]");
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j) {
      const int32_t block = tables[i * block_table.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block_table[", i, ", ", j, "] = ", block,
                  " is outside [0, ", num_blocks, ")");
    }
    computed.push_back(i);
    max_len = std::max<int64_t>(max_len, lens[i]);
    longest_query = std::max(longest_query, q);
  }
  if (computed.empty()) return;

  const int64_t cap = std::max<int64_t>(1, kMaxLogits / (G * max_len));
  const int64_t max_tokens = std::min({kMaxTokensPerTask, cap, longest_query});
  const std::vector<Task> tasks = split_tasks(computed, qsl, Hkv, max_tokens);
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return attention_kernel<float>(out, query, kv_cache, block_table, lens, qsl, tasks, max_tokens, max_len, scale);
    case at::kBFloat16:
      return attention_kernel<at::BFloat16>(out, query, kv_cache, block_table, lens, qsl, tasks, max_tokens, max_len,
                                            scale);
    case at::kHalf:
      return attention_kernel<at::Half>(out, query, kv_cache, block_table, lens, qsl, tasks, max_tokens, max_len, scale);
    default: TORCH_CHECK(false, "paged_attention: dtype ", kv_cache.scalar_type(), " is not fp32, bf16 or fp16");
  }
}

}  // namespace

TORCH_LIBRARY(vllm_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int max_query_len, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_cpu, CPU, m) { m.impl("paged_attention", TORCH_FN(paged_attention)); }
