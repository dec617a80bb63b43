/*
 * How the CPU attention kernel (paged_attention.cpp, which states the semantics and the work split)
 * cuts a batch into tasks: runs of query tokens per sequence and KV heads, key ranges merged
 * afterwards, and the groups whose partials merge into one output row. Pure bookkeeping on the
 * sequences' lengths: no tensors, no arithmetic on values, so that a row's arithmetic depends only
 * on its own sequence (the kernel's bitwise reproducibility).
 */

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace vllm_attention_tasks {
namespace {  // internal linkage, as the kernel's own functions (one translation unit)


// Query tokens per task: more rows share each key and value read.
constexpr int64_t kMaxTokensPerTask = 32;
// Keys per task (rounded up to whole blocks): a long context is split into ranges whose
// partial softmax results are merged, so one request (Hkv tasks otherwise) keeps every
// thread busy, and a task's logits buffer stays small.
constexpr int64_t kKeysPerTask = 512;
// Groups (a run of tokens and a KV head, all its key ranges) per thread from which a thread runs
// whole groups rather than single key ranges: enough that the threads stay evenly busy.
constexpr int64_t kGroupsPerThread = 8;
// Sequences with at least this many query rows (tokens x G) transpose each key block for the
// logits; fewer rows (decodes: G rows) take dot products on the keys in place. Decided per
// sequence, not per task, so a row's arithmetic never depends on how tasks are split.
constexpr int64_t kTransposeMinRows = 8;

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

// One task: query tokens [j0, j1) of sequence `seq`, KV heads [kv, kv1), keys [k0, k1). Its rows
// are its heads' in turn, each head's its tokens' G query heads (row_of). Where all tasks run
// before the merges, its rows' partial results start at row `part` of the shared buffer.
struct Task {
  int64_t seq, kv, kv1, j0, j1, k0, k1, part;
  int64_t rows(int64_t G) const { return (kv1 - kv) * (j1 - j0) * G; }
};

// Row m of a task: its query token j (within the sequence) and query head h.
struct Row {
  int64_t j, h;
};
inline Row row_of(const Task& task, int64_t m, int64_t G) {
  const int64_t per_head = (task.j1 - task.j0) * G, r = m % per_head;
  return {task.j0 + r / G, (task.kv + m / per_head) * G + r % G};
}

// Whether a sequence of q query tokens takes dot products on its keys in place (the decode path)
// rather than transposing them: decided per sequence, not per task, so that a row's arithmetic
// never depends on how tasks are split.
inline bool reads_keys_in_place(int64_t q, int64_t G) { return q * G < kTransposeMinRows; }

// The key ranges of a decode's `keys` keys (where keys are read in place): an even number of
// equal ranges of at most keys_per_task keys, in whole blocks (one range within a block). Ranges
// of keys_per_task and a remainder left one of two threads 1024 keys to the other's 76 on a lone
// decode of 1100, and an odd count of ranges one of them two; even halves of the work share out
// on two threads (and on four, from four ranges). Zen 4, 2 threads, cold, lone decodes of
// 600-2600 tokens: 0.69-0.97x the time; one thread 0.89-0.97x with the asks across ranges below.
inline int64_t decode_range(int64_t keys, int64_t keys_per_task, int64_t bs) {
  int64_t ranges = (keys + keys_per_task - 1) / keys_per_task;
  if (keys > bs) ranges += ranges % 2;
  return ((keys + ranges - 1) / ranges + bs - 1) / bs * bs;
}

// The tasks of one (sequence, KV head, run of tokens): `count` tasks, `stride` apart from
// `first`, one per key range, whose partials are merged into the output rows.
struct Group {
  int64_t first, count, stride;
};

// Each (sequence, KV head) split into equal runs of at most kMaxTokensPerTask query tokens, and
// each run's keys (from the block of its first token's first visible key up to the last token's
// own) into ranges of `keys_per_task` (decode_range's where keys are read in place), each
// starting on a block boundary. The key split depends only on the sequence, so a row's
// arithmetic is the same whatever else is in the batch and however many threads run it. A task
// takes one KV head, or `decode_heads` of them where the keys are read in place: its loops then
// read each block's rows of all its heads before the next block, so the cache is read in runs of
// whole blocks rather than each head's slice of every token row (1.2-1.3x faster cold on Zen 3
// with 8 KV heads; with partial_attention's asks in address order 1.5-1.7x). Which heads share a
// task changes no row's arithmetic. A key range's tasks are consecutive: neighbouring lines back
// to back.
inline void split_tasks(const std::vector<int64_t>& seqs, const int32_t* qsl, const int32_t* lens, int64_t Hkv,
                        int64_t G, int64_t bs, int64_t keys_per_task, int64_t decode_heads, const Variant& variant,
                        std::vector<Task>& tasks, std::vector<Group>& groups) {
  int64_t rows = 0;
  for (const int64_t i : seqs) {
    const int64_t q = qsl[i + 1] - qsl[i], L = lens[i];
    const int64_t runs = (q + kMaxTokensPerTask - 1) / kMaxTokensPerTask, step = (q + runs - 1) / runs;
    const bool in_place = reads_keys_in_place(q, G);
    const int64_t heads = in_place ? decode_heads : 1, parts = (Hkv + heads - 1) / heads;
    for (int64_t j0 = 0; j0 < q; j0 += step) {
      const int64_t j1 = std::min(q, j0 + step), n_keys = L - q + j1;
      const int64_t first = first_visible(variant, L - q + j0) / bs * bs;  // skip whole blocks before
      const int64_t range = in_place ? decode_range(n_keys - first, keys_per_task, bs) : keys_per_task;
      for (int64_t part = 0; part < parts; ++part)
        groups.push_back({static_cast<int64_t>(tasks.size()) + part, 0, parts});
      for (int64_t k0 = first; k0 < n_keys; k0 += range)
        for (int64_t part = 0; part < parts; ++part) {
          const Task task{i, part * heads, std::min(Hkv, (part + 1) * heads), j0, j1, k0,
                          std::min(n_keys, k0 + range), rows};
          tasks.push_back(task);
          rows += task.rows(G);
          ++groups[groups.size() - parts + part].count;
        }
    }
  }
}

// KV heads per task where keys are read in place: all of them, unless that leaves threads idle
// (a batch of one decode on several threads): then the heads are shared out among the threads.
inline int64_t decode_heads_per_task(const std::vector<int64_t>& seqs, const int32_t* qsl, const int32_t* lens,
                                     int64_t Hkv, int64_t G, int64_t keys_per_task, int64_t bs) {
  int64_t units = 0;  // (sequence, key range) pairs of the in-place sequences (a window aside)
  for (const int64_t i : seqs)
    if (reads_keys_in_place(qsl[i + 1] - qsl[i], G)) {
      const int64_t range = decode_range(lens[i], keys_per_task, bs);
      units += (lens[i] + range - 1) / range;
    }
  const int64_t threads = at::get_num_threads();
  if (units == 0 || units >= threads) return Hkv;
  const int64_t parts = std::min(Hkv, (threads + units - 1) / units);
  return (Hkv + parts - 1) / parts;
}

// The groups' indices by decreasing work (rows times keys over their tasks), ties in order.
inline std::vector<int64_t> costliest_first(const std::vector<Group>& groups, const std::vector<Task>& tasks,
                                            int64_t G) {
  std::vector<int64_t> work(groups.size(), 0), order(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    order[g] = static_cast<int64_t>(g);
    for (int64_t s = 0; s < groups[g].count; ++s) {
      const Task& task = tasks[groups[g].first + s * groups[g].stride];
      work[g] += task.rows(G) * (task.k1 - task.k0);
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  return order;
}

}  // namespace
}  // namespace vllm_attention_tasks
