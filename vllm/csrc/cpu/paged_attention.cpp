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
 *   (query, cache and out share it), or fp32 query and out over a bf16 cache (keys and values
 *   widened exactly as they are read); all arithmetic is in fp32 (at::opmath_type), rounded
 *   to the storage type only when writing out, but for bf16 prompts on CPUs with AVX512-BF16,
 *   whose value sums take the probabilities rounded to bf16, as SDPA does for bf16 on the CPU
 *   (attention_bf16_tiles.h; bf16 decodes there too, where D % 32 == 0). exp is native_vec.h's
 *   exp_fast (within 2 ulp of fp32 exp on AVX-512, 20 elsewhere: far below any test tolerance).
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
 * Work split (the tasks and groups: attention_tasks.h): one task per (sequence, KV heads, run of
 * at most kMaxTokensPerTask query tokens, range of kKeysPerTask keys; for decodes an even number
 * of equal ranges of at most that many), run by at::parallel_for on torch's intra-op threads.
 * A task has one KV head, or where the keys are read in place (decodes) all of them, block by
 * block (fewer where that leaves threads idle): see split_tasks.
 * A run's keys start at the block holding its first token's first visible key, so with a
 * sliding window a decode reads only the blocks its window touches.
 * A task computes the rows of its tokens times the G query heads sharing each KV head over
 * its keys, reading each key and value row of a head once for all of them: an exact
 * two-pass softmax (all logits, then max subtraction and exp, then one pass over the values)
 * whose unnormalised output, max and sum are merged across the key ranges (a sink enters
 * that merge as one more partial: max sink, sum 1, no value). With enough (sequence, KV heads,
 * run) groups for the threads (prefills), a thread runs a group's tasks one after the other and
 * merges them at once, the threads taking groups costliest first; otherwise (decodes) each
 * thread runs consecutive tasks, and whichever finishes a group's last task merges the group.
 * The key split depends only on each sequence's own lengths (and the window), and neither which
 * heads share a task nor which thread runs a merge changes any arithmetic, so a row's
 * arithmetic is the same whatever else is in the batch and whatever the thread count: results
 * are bitwise reproducible.
 *
 * Inner loops: with few rows per task (decodes), dot products on the keys in place, kRowTile
 * query rows sharing every load. With many, a chunk of kChunkKeys keys is transposed to
 * [D, keys] (transpose_keys) so that one vector FMA advances W keys of a query row, in register
 * tiles of kLogitRows rows x kLogitVecs vectors of keys (bf16 dot products: kBf16LogitRows x
 * kBf16LogitVecs); the values' tiles (kValueRows rows x kValueVecs vectors of features) keep their
 * accumulators in registers across the chunk's blocks.
 */

#include "attention_tiles.h"  // first: it sets the vector width at::vec builds for
#include "attention_bf16_tiles.h"
#include "attention_tasks.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace vllm_attention_tasks;
using namespace vllm_attention_tiles;

// How many blocks ahead of the one being read the many-row path (keys transposed) asks for its rows
// into L1 (prefetch_line). The blocks are scattered and a head's rows strided (Hkv * D apart), which
// the hardware prefetchers follow poorly (decodes took 2x as long without any asks); one block ahead
// measured best on Zen 3 (two: 5-10% slower, four: 15-20%, where a task's block of every head already
// fills much of L1). Decodes took these asks too until asks into L2 two blocks ahead replaced them
// (kFarBlocks, measured on Zen 4 only): on Zen 3, L2 asks one block ahead had read cold scattered
// blocks 25-35% faster in benchmarks/cpu_attention.py but measured the same (SmolLM2) to 46% slower
// (Granite-3.3-2B, 512 tokens, fp32 cache, one thread) in the engine.
constexpr int64_t kPrefetchBlocks = 1;
// How many blocks ahead a task asks for a block into L2 (prefetch_to_l2: no L1 miss buffer held).
// Keys read in place (decodes): a row per key the inner loops compute, consecutive blocks or not, and
// no L1 asks: with the L1 asks one block ahead on top, those loops spent a fifth of their time warm
// on the asks, and read cold blocks slower (Zen 4, one thread, alternating in one process: without
// them 0.84-0.94x the time of a lone decode's attention at 1,024 keys, bf16 and fp32 caches, 9/3 and
// 32/8 heads, blocks shuffled or consecutive; the engine's SmolLM2 int4 / bf16 decode steps at 1,536
// tokens 0.88x / 0.93x, Granite-3.3-2B's 0.97x). The many-row path: all of the block at once, where
// it does not follow the current one in memory (a long-running cache's scattered blocks, which no
// hardware prefetcher foresees). With in-place reads that burst measured 0.70-0.82x the time of no
// L2 asks (SmolLM2's heads, blocks shuffled; 0.84-0.94x Granite-3.3-2B's).
constexpr int64_t kFarBlocks = 2;
// Keys the many-row path transposes, and reads values of, at a time (rounded up to whole
// blocks): the inner loops keep their accumulators in registers across a chunk's blocks, and a
// chunk's transposed keys and values stay in L1 or near it while every row tile reads them. 128 on
// AVX-512 (Zen 4, a 2,048-token prompt: 0.97x the time of 64 in bf16, 0.99x in fp32, fewer loads
// and stores of the value tiles' accumulators); 64 elsewhere, as measured on Zen 3.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kChunkKeys = 128;
#else
constexpr int64_t kChunkKeys = 64;
#endif

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


// Partial results of one task: per row, the unnormalised output [D], then the max logit and the
// sum of exp(logit - max) over the task's keys (-inf and 0 when the row attends to none of them).
// kTranspose: the many-row path (keys transposed a chunk at a time) or the decode path (keys and
// values read in place, a block at a time); one function each, so that each path's inner loops
// are compiled, and inlined, on their own. kDot (bf16 query and cache, where kHasBf16Dot): the tiles of
// attention_bf16_tiles.h, on the bf16 rows as stored (the decode path's interleave each pair of value
// rows in registers as they are read).
template <typename scalar_t, typename cache_t, bool kTranspose, bool kDot = false>
void partial_attention(const Task& task, const scalar_t* q_base, int64_t q_s0, int64_t q_s1, const cache_t* k_cache,
                       const cache_t* v_cache, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                       const int32_t* qsl, int64_t G, int64_t D, int64_t bs, int64_t Hkv, int64_t keys_per_task,
                       at::opmath_type<scalar_t> scale, const Variant& variant, at::opmath_type<scalar_t>* part_rows) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t W = at::vec::Vectorized<opmath_t>::size();
  const int64_t token_stride = Hkv * D, block_stride = bs * Hkv * D;  // within kv_cache[0 or 1]
  const int64_t ahead = kPrefetchBlocks * bs, far = kFarBlocks * bs;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(cache_t));
  const int64_t L = seq_lens[task.seq], q_len = qsl[task.seq + 1] - qsl[task.seq];
  const int64_t M = task.rows(G), per_head = (task.j1 - task.j0) * G, span = task.k1 - task.k0;
  const int32_t* blocks = tables + task.seq * table_stride;
  // Keys read at a time: a chunk of blocks where the keys are transposed, else one block.
  const int64_t chunk = kTranspose ? (kChunkKeys + bs - 1) / bs * bs : bs;
  constexpr int kLogitTileRows = kTranspose ? (kDot ? kBf16LogitRows : kLogitRows) : kRowTile;
  const int64_t tile_keys = (kDot ? kBf16LogitVecs : kLogitVecs) * W;  // keys a logit tile takes at a time
  const int64_t ldk = (chunk + tile_keys - 1) / tile_keys * tile_keys;     // transposed row length
  const int64_t P = D / 2, chunk_pairs = (chunk + 1) / 2;  // kDot: feature pairs of a row, key pairs of a chunk

  // Per-thread scratch, reused by every task (rows: row_of).
  const int64_t max_rows = std::max(M, kMaxTokensPerTask * G);
  opmath_t* q = thread_scratch<opmath_t>(max_rows * D + max_rows * keys_per_task + chunk * D + D * ldk);
  opmath_t* logits = q + max_rows * D;                 // [rows, span] (q: [rows, D], pre-scaled)
  opmath_t* rows = logits + max_rows * keys_per_task;  // [chunk, D] converted blocks (non-opmath storage)
  opmath_t* kt = rows + chunk * D;                     // [D, ldk] one chunk's keys transposed
  // [2, rows]: the keys of the range each row attends to are lo[m] .. hi[m] - 1 (causal, window)
  int64_t* lo = thread_scratch<int64_t>(2 * max_rows);
  int64_t* hi = lo + max_rows;
  // kDot: the chunk's keys [P, ldk] and values [chunk_pairs, D] by pairs, the rows' probabilities of
  // the chunk [rows, chunk_pairs] (attention_bf16_tiles.h); the rows' queries are read in place
  // (q2_rows: each row's P pairs as stored, unscaled: the tiles scale the logits).
  uint32_t* kt2 = kDot ? thread_scratch<uint32_t>(P * ldk + chunk_pairs * D + max_rows * chunk_pairs) : nullptr;
  const uint32_t** q2_rows = kDot ? thread_scratch<const uint32_t*>(max_rows) : nullptr;
  uint32_t* vt2 = kt2 + P * ldk;
  uint32_t* p2 = vt2 + chunk_pairs * D;

  for (int64_t m = 0; m < M; ++m) {
    const auto [j, h] = row_of(task, m, G);
    const scalar_t* src = q_base + (qsl[task.seq] + j) * q_s0 + h * q_s1;
    if constexpr (kDot)
      q2_rows[m] = reinterpret_cast<const uint32_t*>(src);
    else
      for (int64_t d = 0; d < D; ++d) q[m * D + d] = static_cast<opmath_t>(src[d]) * scale;
    const int64_t p = L - q_len + j;
    hi[m] = std::clamp<int64_t>(p + 1 - task.k0, 0, span);
    lo[m] = std::clamp<int64_t>(first_visible(variant, p) - task.k0, 0, hi[m]);
  }

  // The rows from key k0 + start on of KV head `head` in `cache` (k_cache or v_cache: one block,
  // as k0 is a multiple of bs, rows token_stride apart). `next` gets what the inner loops ask for,
  // a row's worth per key: read in place, from the block kFarBlocks further on into L2; transposed,
  // from the block kPrefetchBlocks further on into L1, the block kFarBlocks on, where it is not the
  // next in memory, asked into L2 here, each head its share at once. Where the task has every head,
  // a block is read whole, so each head asks for its share of it in address order (the whole block,
  // past the context's last key too); else this head's own rows, token_stride apart. The
  // address-order asks measured 1.2-1.3x faster cold than each head asking for its rows (Zen 3, 8 KV
  // heads), which the hardware prefetchers do not follow.
  const bool whole_rows = task.kv1 - task.kv == Hkv;
  // The cache in the order the task reads it: its keys, then its values, then its run's next key
  // range (which a thread running consecutive tasks mostly reads next). `later(cache, start + d)`
  // is the block read d keys after key k0 + start of `cache`, with the rows of it that exist, or
  // none: the asks (both of them) cross the end of a pass, so no pass starts on blocks nobody asked
  // for. Zen 4, one thread, cold, lone decodes: 0.93-0.95x the time with ranges of 512 keys.
  const int64_t run_keys = L - q_len + task.j1 - task.k0;  // the run's keys from k0 on
  auto later = [&](const cache_t* cache, int64_t pos) -> std::pair<const cache_t*, int64_t> {
    if (pos >= span && cache == k_cache) cache = v_cache, pos -= span;
    else if (pos >= span) cache = k_cache;  // the next range's keys: pos counts on from k0
    const int64_t limit = cache == v_cache ? span : (pos < span ? span : run_keys);
    if (pos >= limit) return {nullptr, 0};
    return {cache + blocks[(task.k0 + pos) / bs] * block_stride, std::min(bs, limit - pos)};
  };
  // Head `head`'s rows of `at` (a block and how many of its rows exist: later's), as an Ahead.
  auto rows_of = [&](std::pair<const cache_t*, int64_t> at, int64_t head, bool to_l2) {
    const auto [block, rows] = at;
    if (!block) return Ahead{};
    const char* bytes = reinterpret_cast<const char*>(block);
    return whole_rows ? Ahead{bytes + head * bs * row_bytes, bs, row_bytes, row_bytes, to_l2}
                      : Ahead{bytes + head * row_bytes, rows, token_stride * static_cast<int64_t>(sizeof(cache_t)),
                              row_bytes, to_l2};
  };
  auto block_at = [&](const cache_t* cache, int64_t head, int64_t start, Ahead& next) {
    const cache_t* here = cache + blocks[(task.k0 + start) / bs] * block_stride;
    if constexpr (!kTranspose) {  // in place: the block `far` on, into L2, a row per key
      next = rows_of(later(cache, start + far), head, true);
      return here + head * D;
    }
    next = rows_of(later(cache, start + ahead), head, false);
    const auto far_at = later(cache, start + far);
    if (far_at.first && far_at.first != here + kFarBlocks * block_stride) {
      const Ahead burst = rows_of(far_at, head, true);
      for (int64_t t = 0; t < burst.n; ++t) burst.ask(t);
    }
    return here + head * D;
  };
  // Pass 1: logits of the task's keys, one chunk at a time.
  for (int64_t start = 0; start < span; start += chunk) {
    const int64_t n = std::min(chunk, span - start);
    for (int64_t head = task.kv; head < task.kv1; ++head) {  // each head's rows of the chunk in turn
      const int64_t m0 = (head - task.kv) * per_head;
      Ahead next;
      const cache_t* block = nullptr;
      int64_t stride = token_stride;
      const opmath_t* k = nullptr;
      if constexpr (kDot && kTranspose) {
        for (int64_t b = 0; b * bs < n; ++b) {  // each block's pairs, as 32-bit units, transposed into the chunk
          const int64_t nb = std::min(bs, n - b * bs);
          block = block_at(k_cache, head, start + b * bs, next);
          for (int64_t t = 0; t < next.n; ++t) next.ask(t);
          at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(block), token_stride / 2,
                                        reinterpret_cast<float*>(kt2 + b * bs), ldk, nb, P);
        }
      } else if constexpr (kTranspose) {
        for (int64_t b = 0; b * bs < n; ++b) {  // each block transposed into the chunk as opmath values
          const int64_t nb = std::min(bs, n - b * bs);
          block = block_at(k_cache, head, start + b * bs, next);
          for (int64_t t = 0; t < next.n; ++t) next.ask(t);  // many rows share each key: one burst is fine
          transpose_keys(block, token_stride, nb, D, rows, kt + b * bs, ldk);
        }
      } else {
        block = block_at(k_cache, head, start, next);
        // The block as opmath rows where the inner loops do not read it in place.
        if constexpr (!kReadInPlace<cache_t>) k = rows_as_opmath(block, n, token_stride, D, rows, stride);
      }
      for_row_tiles<kLogitTileRows>(m0, m0 + per_head, [&](auto tile, int64_t m) {
        constexpr int R = decltype(tile)::value;
        opmath_t* lp[R];
        const opmath_t* qp[R];
        const uint32_t* q2p[R];
        for (int r = 0; r < R; ++r) {
          lp[r] = logits + (m + r) * keys_per_task + start;
          qp[r] = q + (m + r) * D;
          q2p[r] = q2_rows[m + r];
        }
        if constexpr (kDot && kTranspose) {
          bf16_block_logits<R>(lp, q2p, kt2, ldk, n, P, scale);
        } else if constexpr (kTranspose) {
          block_logits<R>(lp, qp, kt, ldk, n, D);
        } else {
          if constexpr (kDot)
            bf16_row_logits<R>(lp, q2p, block, token_stride, n, P, scale, m == m0 ? next : Ahead{});
          else if constexpr (kReadInPlace<cache_t>)
            row_logits<R>(lp, qp, block, token_stride, n, D, m == m0 ? next : Ahead{});
          else
            row_logits<R>(lp, qp, k, stride, n, D, m == m0 ? next : Ahead{});
        }
      });
    }
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
  const cache_t* in_place[kChunkKeys];  // a chunk's value blocks (at most one per key)
  const opmath_t* converted[kChunkKeys];  // the same, converted where not read in place
  for (int64_t start = 0; start < span; start += chunk) {
    const int64_t n = std::min(chunk, span - start);
    for (int64_t head = task.kv; head < task.kv1; ++head) {
      const int64_t m0 = (head - task.kv) * per_head;
      Ahead next;
      int64_t stride = token_stride;
      for (int64_t b = 0; b * bs < n; ++b) {
        in_place[b] = block_at(v_cache, head, start + b * bs, next);
        if constexpr (kTranspose)
          for (int64_t t = 0; t < next.n; ++t) next.ask(t);
        if constexpr (!kReadInPlace<cache_t>)
          converted[b] = rows_as_opmath(in_place[b], std::min(bs, n - b * bs), token_stride, D, rows + b * bs * D,
                                        stride);
      }
      if constexpr (kTranspose) next = Ahead{};  // asked for above
      if constexpr (kDot) {  // each row's probabilities by pairs, and the chunk's values where transposed
        const auto row = [&](int64_t t) {
          return reinterpret_cast<const uint16_t*>(in_place[t / bs] + (t % bs) * token_stride);
        };
        if constexpr (kTranspose) bf16_interleave_values(row, n, D, vt2);
        for (int64_t m = m0; m < m0 + per_head; ++m)
          bf16_pack_pairs(logits + m * keys_per_task + start, n, p2 + m * chunk_pairs);
      }
      for_row_tiles<kTranspose ? kValueRows : kRowTile>(m0, m0 + per_head, [&](auto tile, int64_t m) {
        constexpr int R = decltype(tile)::value;
        opmath_t* ap[R];
        const opmath_t* pp[R];
        const uint32_t* p2p[R];
        for (int r = 0; r < R; ++r) {
          ap[r] = part_rows + (m + r) * (D + 2);
          pp[r] = logits + (m + r) * keys_per_task + start;
          p2p[r] = p2 + (m + r) * chunk_pairs;
        }
        if constexpr (kDot && kTranspose)
          bf16_block_values<R>(ap, p2p, vt2, (n + 1) / 2, D);
        else if constexpr (kDot)
          bf16_row_values<R>(ap, p2p, in_place[0], token_stride, n, D, m == m0 ? next : Ahead{});
        else if constexpr (kReadInPlace<cache_t>)
          block_values<R>(ap, pp, in_place, bs, stride, n, D, m == m0 ? next : Ahead{});
        else
          block_values<R>(ap, pp, converted, bs, stride, n, D, m == m0 ? next : Ahead{});
      });
    }
  }
  if constexpr (kUnpackedValues<cache_t>)  // the value tiles' sums are in the unpacked feature order
    if (values_unpacked<cache_t>(D))
      for (int64_t m = 0; m < M; ++m) unpermute_values(part_rows + m * (D + 2), D);
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
  const int64_t M = first.rows(G);
  for (int64_t m = 0; m < M; ++m) {
    auto part = [&](int64_t s) { return part_rows(s) + m * (D + 2); };
    const auto [j, h] = row_of(first, m, G);
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

template <typename scalar_t, typename cache_t>
void attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const int32_t* seq_lens, const int32_t* qsl,
                      const std::vector<int64_t>& seqs, double scale, const Variant& variant) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3), G = H / Hkv;
  const int64_t keys_per_task = (kKeysPerTask + bs - 1) / bs * bs;
  std::vector<Task> tasks;
  std::vector<Group> groups;
  split_tasks(seqs, qsl, seq_lens, Hkv, G, bs, keys_per_task,
              decode_heads_per_task(seqs, qsl, seq_lens, Hkv, G, keys_per_task, bs), variant, tasks, groups);
  const cache_t* k_cache = kv_cache.const_data_ptr<cache_t>();
  const cache_t* v_cache = k_cache + num_blocks * bs * Hkv * D;
  const scalar_t* q_base = query.const_data_ptr<scalar_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const opmath_t op_scale = static_cast<opmath_t>(scale);
  scalar_t* out_base = out.data_ptr<scalar_t>();
  // Task t's partial results into `rows` [M, D + 2].
  auto run_task = [&](int64_t t, opmath_t* rows) {
    const bool transpose = !reads_keys_in_place(qsl[tasks[t].seq + 1] - qsl[tasks[t].seq], G);
    auto* attend = transpose ? partial_attention<scalar_t, cache_t, true> : partial_attention<scalar_t, cache_t, false>;
    if constexpr (kHasBf16Dot && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)
      if (bf16_dot_head_size(D))
        attend = transpose ? partial_attention<scalar_t, cache_t, true, true>
                           : partial_attention<scalar_t, cache_t, false, true>;
    attend(
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
    // The threads take groups one at a time, costliest first: a causal prompt's later runs attend
    // over more keys, and halves of the group list in order left one of two threads with 3/4 of
    // the work.
    const std::vector<int64_t> order = costliest_first(groups, tasks, G);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < num_groups; i = next++) {
        const int64_t g = order[i];
        const Task& first = tasks[groups[g].first];
        const int64_t task_values = first.rows(G) * (D + 2);
        opmath_t* local = thread_scratch<opmath_t, Use::kPartials>(groups[g].count * task_values);
        for (int64_t s = 0; s < groups[g].count; ++s)
          run_task(groups[g].first + s * groups[g].stride, local + s * task_values);
        merge(g, [&](int64_t s) { return local + s * task_values; });
      }
    });
    return;
  }
  // Too few groups to share out (decodes): every task in parallel, each thread a run of
  // consecutive ones (its asks reach into the next range, which it reads next), and the thread
  // that finishes a group's last task merges it, in the same parallel region.
  const Task& last = tasks.back();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::vector<opmath_t> partials((last.part + last.rows(G)) * (D + 2));
  std::vector<int64_t> group_of(num_tasks);
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[num_groups]);
  for (int64_t g = 0; g < num_groups; ++g) {
    pending[g].store(groups[g].count, std::memory_order_relaxed);
    for (int64_t s = 0; s < groups[g].count; ++s) group_of[groups[g].first + s * groups[g].stride] = g;
  }
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      run_task(t, partials.data() + tasks[t].part * (D + 2));
      const int64_t g = group_of[t];
      if (pending[g].fetch_sub(1, std::memory_order_acq_rel) == 1)  // the group's other tasks are done
        merge(g, [&](int64_t s) {
          return partials.data() + tasks[groups[g].first + s * groups[g].stride].part * (D + 2);
        });
    }
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
  TORCH_CHECK(out.scalar_type() == query.scalar_type() &&
                  (kv_cache.scalar_type() == query.scalar_type() ||
                   (query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kBFloat16)),
              "paged_attention: out and query must share a dtype, and kv_cache have it too (or be bf16 under fp32)");
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

  if (query.scalar_type() != kv_cache.scalar_type())  // fp32 over a bf16 cache, as checked above
    return attention_kernel<float, at::BFloat16>(out, query, kv_cache, block_table, lens, qsl, computed, scale,
                                                 variant);
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return attention_kernel<float, float>(out, query, kv_cache, block_table, lens, qsl, computed, scale, variant);
    case at::kBFloat16:
      return attention_kernel<at::BFloat16, at::BFloat16>(out, query, kv_cache, block_table, lens, qsl, computed,
                                                          scale, variant);
    case at::kHalf:
      return attention_kernel<at::Half, at::Half>(out, query, kv_cache, block_table, lens, qsl, computed, scale,
                                                  variant);
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
