/*
 * Paged decode attention on the CPU, reading keys and values in place from the paged KV
 * cache (no gather copy). Built and loaded by vllm/attention/backends/cpu_native.py.
 *
 * Semantics (identical to the decode part of vllm/attention/backends/torch_ref.py):
 *   For decode sequence i < out.size(0) with KV length L = seq_lens[i] (1 <= L), query head h,
 *   G = H / Hkv query heads per KV head and KV head kv = h / G:
 *     k_t = kv_cache[0, block_table[i, t / bs], t % bs, kv, :]     (v_t likewise from kv_cache[1])
 *     s_t = scale * <query[i, h, :], k_t>                          for t = 0 .. L-1
 *     out[i, h, :] = sum_t softmax(s)_t * v_t
 *   Storage may be fp32, bf16 or fp16 (query, cache and out share it); all arithmetic is in
 *   fp32 (at::opmath_type), rounded to the storage type only when writing out. exp is at::vec's
 *   exp_u20 (within 20 ulp of fp32 exp, far below any test tolerance).
 *
 * Shapes:
 *   out          [num_decodes, H, D]            any token/head strides, unit stride along D
 *   query        [>= num_decodes, H, D]         likewise
 *   kv_cache     [2, num_blocks, bs, Hkv, D]    contiguous
 *   block_table  [num_seqs >= num_decodes, max_blocks] int32, unit stride along blocks
 *   seq_lens     [num_seqs >= num_decodes] int32, contiguous
 *   Lengths and the block ids they reach are checked against block_table and kv_cache.
 *
 * Work split: one task per (sequence, KV head), run by at::parallel_for, i.e. torch's intra-op
 * threads (torch.set_num_threads applies). A task reads each key and value row of its KV head
 * from memory once and uses it for all G query heads that share it. The softmax is exact and
 * two-pass: all logits first, then max subtraction and exp, then one pass over the values.
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
#include <type_traits>
#include <vector>

namespace {

// How many blocks ahead of the one being read a task asks for its rows. The rows of one KV
// head are strided (Hkv * D apart) and the blocks scattered, which the hardware prefetchers
// follow poorly; two blocks ahead measured best (1.1x-1.2x over none, flat beyond).
constexpr int64_t kPrefetchBlocks = 2;

// logits[t] = <q, rows[t * stride : t * stride + D]> for t < n.
template <typename T>
inline void row_dots(T* logits, const T* q, const T* rows, int64_t stride, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t t = 0; t < n; ++t) {
    const T* row = rows + t * stride;
    Vec acc(T(0));
    int64_t d = 0;
    for (; d + W <= D; d += W) acc = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(row + d), acc);
    if (d < D) acc = at::vec::fmadd(Vec::loadu(q + d, D - d), Vec::loadu(row + d, D - d), acc);
    logits[t] = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc);
  }
}

// acc[0:D] += sum over t < n of p[t] * rows[t * stride : t * stride + D]. Four vectors of acc
// stay in registers across all n rows (independent FMA chains), rather than a load-FMA-store
// of acc per row.
template <typename T>
inline void weighted_row_sum(T* acc, const T* p, const T* rows, int64_t stride, int64_t n, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    Vec a0 = Vec::loadu(acc + d), a1 = Vec::loadu(acc + d + W), a2 = Vec::loadu(acc + d + 2 * W),
        a3 = Vec::loadu(acc + d + 3 * W);
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride + d;
      const Vec pt(p[t]);
      a0 = at::vec::fmadd(pt, Vec::loadu(row), a0);
      a1 = at::vec::fmadd(pt, Vec::loadu(row + W), a1);
      a2 = at::vec::fmadd(pt, Vec::loadu(row + 2 * W), a2);
      a3 = at::vec::fmadd(pt, Vec::loadu(row + 3 * W), a3);
    }
    a0.store(acc + d);
    a1.store(acc + d + W);
    a2.store(acc + d + 2 * W);
    a3.store(acc + d + 3 * W);
  }
  for (; d < D; d += W) {
    const int64_t w = std::min(W, D - d);
    Vec a = Vec::loadu(acc + d, w);
    for (int64_t t = 0; t < n; ++t) a = at::vec::fmadd(Vec(p[t]), Vec::loadu(rows + t * stride + d, w), a);
    a.store(acc + d, w);
  }
}

// n rows of D values, `stride` apart, as opmath values: the cache memory itself when it is
// stored in opmath type (no copy), else a converted copy in `scratch` [n, D]. Converting a
// block once serves all G query heads. Returns the rows and sets `row_stride`.
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

// In place: row[0:n] = exp(row - max(row)); returns 1 / sum of the result.
template <typename opmath_t>
inline opmath_t softmax_numerators(opmath_t* row, int64_t n) {
  using Vec = at::vec::Vectorized<opmath_t>;
  const opmath_t max = at::vec::reduce_all<opmath_t>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
  at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, row, row, n);
  const opmath_t sum = at::vec::reduce_all<opmath_t>([](Vec& a, Vec& b) { return a + b; }, row, n);
  return opmath_t(1) / sum;
}

template <typename scalar_t>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_table, const int32_t* seq_lens, int64_t max_len, double scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t num_decodes = out.size(0), H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = bs * Hkv * D;  // within kv_cache[0 or 1]
  const scalar_t* k_cache = kv_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_cache = k_cache + num_blocks * block_stride;
  const scalar_t* q_base = query.const_data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t table_stride = block_table.stride(0);
  const opmath_t op_scale = static_cast<opmath_t>(scale);
  const int64_t ahead = kPrefetchBlocks * bs, row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));

  at::parallel_for(0, num_decodes * Hkv, 1, [&](int64_t begin, int64_t end) {
    // Per-thread scratch, reused by every task of the chunk.
    std::vector<opmath_t> q_buf(G * D);             // [G, D] this KV head's queries, pre-scaled
    std::vector<opmath_t> acc_buf(G * D);           // [G, D] unnormalised outputs
    std::vector<opmath_t> logits_buf(G * max_len);  // [G, max_len]
    std::vector<opmath_t> inv_sums(G);              // [G]
    std::vector<opmath_t> rows_buf(bs * D);         // [bs, D] one converted block (non-opmath storage)
    opmath_t *q = q_buf.data(), *acc = acc_buf.data(), *logits = logits_buf.data(), *rows = rows_buf.data();

    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / Hkv, kv = task % Hkv;
      const int64_t L = seq_lens[i];
      const int32_t* blocks = tables + i * table_stride;
      const scalar_t* k_head = k_cache + kv * D;
      const scalar_t* v_head = v_cache + kv * D;

      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = q_base + i * q_s0 + (kv * G + g) * q_s1;
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<opmath_t>(src[d]) * op_scale;
      }

      // Pass 1: logits of every position, one block at a time.
      for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = std::min(bs, L - start);
        if (start + ahead < L)
          prefetch_rows(k_head + blocks[(start + ahead) / bs] * block_stride, std::min(bs, L - start - ahead),
                        token_stride, row_bytes);
        int64_t stride;
        const opmath_t* k =
            rows_as_opmath(k_head + blocks[start / bs] * block_stride, n, token_stride, D, rows, stride);
        for (int64_t g = 0; g < G; ++g) row_dots(logits + g * max_len + start, q + g * D, k, stride, n, D);
      }
      for (int64_t g = 0; g < G; ++g) inv_sums[g] = softmax_numerators(logits + g * max_len, L);

      // Pass 2: probability-weighted sum of the values.
      std::fill(acc, acc + G * D, opmath_t(0));
      for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = std::min(bs, L - start);
        if (start + ahead < L)
          prefetch_rows(v_head + blocks[(start + ahead) / bs] * block_stride, std::min(bs, L - start - ahead),
                        token_stride, row_bytes);
        int64_t stride;
        const opmath_t* v =
            rows_as_opmath(v_head + blocks[start / bs] * block_stride, n, token_stride, D, rows, stride);
        for (int64_t g = 0; g < G; ++g) weighted_row_sum(acc + g * D, logits + g * max_len + start, v, stride, n, D);
      }

      for (int64_t g = 0; g < G; ++g) {
        scalar_t* dst = out_base + i * o_s0 + (kv * G + g) * o_s1;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * D + d] * inv_sums[g]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(out.dim() == 3 && query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_decode_attention: expected out/query [n, H, D] and kv_cache [2, num_blocks, bs, Hkv, D]");
  TORCH_CHECK(out.device().is_cpu() && query.device().is_cpu() && kv_cache.device().is_cpu() &&
                  block_table.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "paged_decode_attention: out, query and kv_cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_table and seq_lens must be int32");
  const int64_t num_decodes = out.size(0), H = query.size(1), D = query.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(query.size(0) >= num_decodes && out.size(1) == H && out.size(2) == D && kv_cache.size(4) == D,
              "paged_decode_attention: shape mismatch between out, query and kv_cache");
  TORCH_CHECK(H % Hkv == 0, "paged_decode_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(kv_cache.is_contiguous() && seq_lens.is_contiguous() && block_table.stride(1) == 1 &&
                  query.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode_attention: kv_cache and seq_lens contiguous, unit stride along D and blocks");
  TORCH_CHECK(block_table.size(0) >= num_decodes && seq_lens.size(0) >= num_decodes,
              "paged_decode_attention: fewer block_table rows or seq_lens than decodes");

  // Lengths and block ids are checked here, once, so the parallel loop never reads outside
  // a table row or the cache.
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const int64_t bs = kv_cache.size(2), num_blocks = kv_cache.size(1), capacity = block_table.size(1) * bs;
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_decodes; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= capacity, "paged_decode_attention: seq_lens[", i, "] = ", lens[i],
                " is outside [1, ", capacity, "]");
    max_len = std::max<int64_t>(max_len, lens[i]);
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j) {
      const int32_t block = tables[i * block_table.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_table[", i, ", ", j, "] = ", block,
                  " is outside [0, ", num_blocks, ")");
    }
  }
  if (num_decodes == 0) return;

  switch (kv_cache.scalar_type()) {
    case at::kFloat: return decode_kernel<float>(out, query, kv_cache, block_table, lens, max_len, scale);
    case at::kBFloat16: return decode_kernel<at::BFloat16>(out, query, kv_cache, block_table, lens, max_len, scale);
    case at::kHalf: return decode_kernel<at::Half>(out, query, kv_cache, block_table, lens, max_len, scale);
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", kv_cache.scalar_type(), " is not fp32, bf16 or fp16");
  }
}

}  // namespace

TORCH_LIBRARY(vllm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_cpu, CPU, m) { m.impl("paged_decode_attention", TORCH_FN(paged_decode_attention)); }
