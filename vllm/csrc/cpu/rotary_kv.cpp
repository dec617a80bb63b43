/*
 * The two small per-layer ops around CPU attention: rotary position embedding of q and k, and
 * the store of this step's keys and values into the paged KV cache. Built and loaded through
 * vllm/native_build.py by vllm/model_executor/layers/rotary.py (`rotary`) and
 * vllm/attention/backends/cpu_native.py (`store_kv`).
 *
 * Why: in torch, a layer's rotary is about twelve small ops (two cache lookups, products,
 * sums, an allocation each) and the store three more plus a host sync to skip padding slots;
 * at batch 1 their dispatch, not their arithmetic, is what costs. Here each is one call.
 *
 * Semantics of `rotary(out_q, out_k, q, k, positions, cos, sin)` (rotary.py's torch path,
 * GPT-NeoX rotate-half style as HF Llama): with h = cos.size(1) = rotary_dim / 2, for every
 * token t, head and feature i < h, c = cos[positions[t], i], s = sin[positions[t], i]:
 *     out[t, head, i]     = x[t, head, i] * c - x[t, head, i + h] * s
 *     out[t, head, i + h] = x[t, head, i + h] * c + x[t, head, i] * s
 *     out[t, head, j]     = x[t, head, j]                      for j >= rotary_dim (partial rotary)
 * each product and the sum rounded to the model dtype exactly as torch's elementwise ops round
 * them (never fused into an FMA), so the result equals the torch path bit for bit.
 *   q [T, Hq, D], k [T, Hk, D]: any token and head strides, features contiguous; out_q, out_k
 *   contiguous of the same shapes; cos, sin contiguous [max_position, h]; positions int64 [T],
 *   each in [0, max_position); one dtype (fp32 or bf16) for all but positions.
 *
 * Semantics of `store_kv(kv_cache, key, value, slot_mapping)` (torch_ref.store_kv):
 *     kv_cache[0].flat[slot] = key[t], kv_cache[1].flat[slot] = value[t]  for slot = slot_mapping[t] >= 0
 * (a negative slot is a padding token: skipped), flat = [num_blocks * block_size, Hk, D].
 *   kv_cache contiguous [2, num_blocks, block_size, Hk, D]; key, value [T, Hk, D] of its dtype,
 *   or fp32 into a bf16 cache (rounded as torch's cast rounds); each token's [Hk, D] contiguous
 *   (any token stride); slot_mapping int64 [T], every slot below num_blocks * block_size.
 *
 * Everything is checked before any work. At one token (a decode) the ops stay on the calling
 * thread; many tokens (a prefill) split over at::parallel_for by token. Results do not depend on
 * the thread count.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "bf16_bits.h"

namespace {

using namespace vllm_cpu_bits;  // widen, narrow, elements: bf16 handled as its bits

// Every product and sum rounded to T, as torch's elementwise ops round them. fp-contract=off
// keeps GCC (whose default is -ffp-contract=fast) from fusing a product and the following sum
// into one FMA, which would round once where torch rounds twice.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_head(T* out, const T* x, const T* cos, const T* sin,
                                                              int64_t half, int64_t head_size) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[i + half]), c = widen(cos[i]), s = widen(sin[i]);
    const float a = widen(narrow<T>(x1 * c)), b = widen(narrow<T>(x2 * s));
    const float d = widen(narrow<T>(x2 * c)), e = widen(narrow<T>(x1 * s));
    out[i] = narrow<T>(a - b);
    out[i + half] = narrow<T>(d + e);
  }
  if (2 * half < head_size) {
    std::memcpy(out + 2 * half, x + 2 * half, (head_size - 2 * half) * sizeof(T));
  }
}

void check_rotary_input(const at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, " must be [tokens, heads, head_size] with contiguous features");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type(), name, " must have the cos/sin cache's dtype ",
              cos.scalar_type(), ", got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == x.sizes(),
              "the output for ", name, " must be contiguous, of its shape and dtype");
  TORCH_CHECK(2 * cos.size(1) <= x.size(2), "rotary_dim ", 2 * cos.size(1), " exceeds ", name, "'s head size ",
              x.size(2));
}

template <typename T>
void rotary_impl(const at::Tensor& out_q, const at::Tensor& out_k, const at::Tensor& q, const at::Tensor& k,
                 const int64_t* pos, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = cos.size(1), head_size = q.size(2);
  const T *qp = elements<T>(q), *kp = elements<T>(k), *cp = elements<T>(cos), *sp = elements<T>(sin);
  T *oq = elements<T>(out_q), *ok = elements<T>(out_k);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + pos[t] * half;
      const T* s = sp + pos[t] * half;
      for (int64_t h = 0; h < q.size(1); ++h) {
        rotate_head<T>(oq + (t * q.size(1) + h) * head_size, qp + t * q.stride(0) + h * q.stride(1), c, s, half,
                       head_size);
      }
      for (int64_t h = 0; h < k.size(1); ++h) {
        rotate_head<T>(ok + (t * k.size(1) + h) * head_size, kp + t * k.stride(0) + h * k.stride(1), c, s, half,
                       head_size);
      }
    }
  });
}

void rotary(const at::Tensor& out_q, const at::Tensor& out_k, const at::Tensor& q, const at::Tensor& k,
            const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat || cos.scalar_type() == at::kBFloat16,
              "rotary runs float32 or bfloat16, got ", cos.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  sin.scalar_type() == cos.scalar_type(),
              "cos and sin must be contiguous [max_position, rotary_dim / 2] of one dtype");
  check_rotary_input(out_q, q, cos, "q");
  check_rotary_input(out_k, k, cos, "k");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "q and k must have the same tokens and head size");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == q.size(0),
              "positions must be contiguous int64 [", q.size(0), "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary cache's [0, ",
                cos.size(0), ")");
  }
  if (cos.scalar_type() == at::kFloat) {
    rotary_impl<float>(out_q, out_k, q, k, pos, cos, sin);
  } else {
    rotary_impl<uint16_t>(out_q, out_k, q, k, pos, cos, sin);
  }
}

void check_kv_input(const at::Tensor& x, const at::Tensor& kv_cache, const char* name) {
  TORCH_CHECK(x.scalar_type() == kv_cache.scalar_type() ||
                  (x.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kBFloat16),
              name, " must have the KV cache's dtype ", kv_cache.scalar_type(),
              " (or float32 into a bfloat16 cache), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == kv_cache.size(3) && x.size(2) == kv_cache.size(4) && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              name, " must be [tokens, ", kv_cache.size(3), ", ", kv_cache.size(4),
              "] with each token's heads contiguous");
}

// Each token's key and value row (`row` units of T from key / value, token strides in T units) into
// slot slot[t] of the cache's key and value halves (`slots` slots each) through `put(dst, src, row)`;
// negative slots skipped.
template <typename T, typename S, typename Put>
void store_rows(T* cache, const S* kp, const S* vp, int64_t k_stride, int64_t v_stride, const int64_t* slot,
                int64_t tokens, int64_t slots, int64_t row, const Put& put) {
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      put(cache + slot[t] * row, kp + t * k_stride, row);
      put(cache + (slots + slot[t]) * row, vp + t * v_stride, row);
    }
  });
}

void store_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, block_size, num_kv_heads, head_size]");
  check_kv_input(key, kv_cache, "key");
  check_kv_input(value, kv_cache, "value");
  TORCH_CHECK(value.size(0) == key.size(0), "key and value must have the same tokens");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 [", key.size(0), "]");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " beyond the KV cache's ", slots, " slots");
  }
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "key and value must share a dtype");
  if (key.scalar_type() == kv_cache.scalar_type()) {
    const int64_t row = kv_cache.size(3) * kv_cache.size(4) * kv_cache.element_size();  // bytes per slot
    store_rows(static_cast<char*>(kv_cache.data_ptr()), static_cast<const char*>(key.data_ptr()),
               static_cast<const char*>(value.data_ptr()), key.stride(0) * key.element_size(),
               value.stride(0) * value.element_size(), slot, key.size(0), slots, row,
               [](char* dst, const char* src, int64_t bytes) { std::memcpy(dst, src, bytes); });
    return;
  }
  const int64_t n = kv_cache.size(3) * kv_cache.size(4);  // values per slot
  store_rows(elements<uint16_t>(kv_cache), key.data_ptr<float>(), value.data_ptr<float>(), key.stride(0),
             value.stride(0), slot, key.size(0), slots, n, narrow_row);
}

}  // namespace

TORCH_LIBRARY(vllm_rotary_kv, m) {
  m.def("rotary(Tensor(a!) out_q, Tensor(b!) out_k, Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("store_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_rotary_kv, CPU, m) {
  m.impl("rotary", TORCH_FN(rotary));
  m.impl("store_kv", TORCH_FN(store_kv));
}
