/*
 * Consecutive Llama-style decoder layers for a few rows (decodes) on the CPU, as one call: per
 * layer the same kernels the layer's Python runs (fused RMSNorm, dense GEMV or quantized linears,
 * rotary, KV store, paged attention, SiLU and product), in the same order on the same tensors, so
 * the result is bit for bit the Python layers'. Built and loaded by
 * vllm/model_executor/layers/decode_layer.py, which decides which layers qualify and hands their
 * weights to a DecodeStack once; a step then passes only its activations, caches and metadata.
 *
 * Why: a 135M model's layer is ~0.3 ms of arithmetic and ~0.2 ms of Python (module calls, views,
 * dispatch of ~40 ops); here the ops are called through the dispatcher from C++, and the
 * per-layer Python that remained around one native call per layer (the module call, its checks,
 * converting 16 weights: ~20 us a layer) is paid once per run of layers. The activations live in
 * one Workspace per run of same-shaped layers, not ~10 tensors and ~10 views a layer (SmolLM2
 * decode step 2-3% faster, one Zen 3 thread).
 *
 * Semantics (LlamaDecoderLayer.forward with a residual, models/llama.py):
 *   hidden <- hidden + residual;  h = rms_norm(hidden)                       (input_layernorm)
 *   q, k, v = split(linear(h, qkv));  q, k = rotary(q, k)                    (self_attn)
 *   store_kv(k, v);  a = paged_attention(q);  o = linear(a, o_proj) * m
 *   o <- o + hidden;  h2 = rms_norm(o)                                       (post_attention_layernorm)
 *   out = linear(silu_and_mul(linear(h2, gate_up)), down) * m             (mlp: activation.cpp's op)
 *   with m the residual multiplier (Granite's; the product is skipped where m = 1, as in Python)
 *   returns (out, o): the next layer's hidden state and residual.
 *   linear(x, W) is the engine's few-row linear: dense (the GEMV on x in the model dtype, fp32 sums;
 *   bf16 on the vdpbf16ps kernel where the CPU has it, every row there, as dense_gemv.py dispatches)
 *   or int8 / int4 (quantization.py's quantized_linear, GGUF Q4_K's offsets included), bias
 *   included.
 *
 * A fused linear whose quantized slices differ in format (a GGUF file's q/k/v or gate/up in mixed
 * types: llama.cpp's Q4_K_M gives attn_v Q6_K and attn_q/k Q4_K in half the layers) is up to three
 * slices, each its own product written into its columns, the bias (if any) added after in the
 * output's dtype: quantized Linear's forward for slices (torch.cat of the products, then add_).
 *
 * With --enable-lora (lora/layers.py's LinearWithLoRA): a step whose adapted tokens the native LoRA
 * op takes (lora/ops/cpu_native.py's runs_native) passes their runs, and right after each wrapped
 * linear's product (its bias included, before Granite's multiplier) the layer adds the LoRA delta
 * with that op on the same tensors, as the wrapper's forward does; a step without adapter rows
 * passes no runs and adds nothing, as the wrappers then add nothing.
 *
 * A layer's arguments: weights = [input_norm, post_norm, cos, sin, then per slot (qkv's three, o,
 * gate_up's two, down; kSlots) its weight (dense) or qweight, its scales (quantized; empty
 * otherwise), its bias (or empty; a sliced linear's whole bias in its first slot), its offsets
 * (GGUF Q4_K) and superblocks (GGUF Q4_K, Q6_K), empty otherwise]; ints = [H, Hkv, D,
 * sliding_window, then per slot its kind (0 dense, 8 int8, 4 int4, -1 unused) and group (dense:
 * the rows above which the vdpbf16ps kernel runs, -1 for never)]; floats = [input eps, post eps,
 * attention scale, residual multiplier]. A DecodeStack holds them concatenated, layer after layer.
 * The kernels check their own inputs.
 */

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The ops of the other kernel files, each looked up on its first use (decode_layer.py builds a
// layer only once the kernels it calls are loaded; a dense model never loads the quantized one).
using LinearOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&);
using Int8Op = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                    const OptTensor&);
using Int4Op = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                    const OptTensor&, const OptTensor&);
using NormOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotaryOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&);
using StoreOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using AttentionOp = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, double, int64_t, double, const OptTensor&);
using LoraOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                    at::IntArrayRef);
using ActOp = void(const at::Tensor&, const at::Tensor&);

#define VLLM_CACHED_OP(fn, Sig, name)                            \
  const c10::TypedOperatorHandle<Sig>& fn() {                    \
    static const c10::TypedOperatorHandle<Sig> op = find_op<Sig>(name); \
    return op;                                                   \
  }
VLLM_CACHED_OP(gemv_op, LinearOp, "vllm_dense::dense_gemv")
VLLM_CACHED_OP(bf16_dot_op, LinearOp, "vllm_bf16_dot::bf16_dot_linear")
VLLM_CACHED_OP(int8_op, Int8Op, "vllm_quant::linear_int8")
VLLM_CACHED_OP(int4_op, Int4Op, "vllm_quant::linear_int4")
VLLM_CACHED_OP(add_norm_op, NormOp, "vllm_norm::fused_add_rms_norm")
VLLM_CACHED_OP(rotary_op, RotaryOp, "vllm_rotary_kv::rotary")
VLLM_CACHED_OP(store_op, StoreOp, "vllm_rotary_kv::store_kv")
VLLM_CACHED_OP(attention_op, AttentionOp, "vllm_cpu::paged_attention")
VLLM_CACHED_OP(lora_op, LoraOp, "vllm_lora::add_lora_runs")
VLLM_CACHED_OP(silu_mul_op, ActOp, "vllm_act::silu_and_mul")
#undef VLLM_CACHED_OP

// The engine's few-row linear (dense_gemv.py's dense_linear / quantization.py's quantized_linear)
// into `out` [rows, N] in x's dtype: a dense one takes fp32 or bf16 x as it is (more than `group`
// bf16 rows, where group >= 0: the vdpbf16ps kernel, else the GEMV); so does a quantized one
// without a bias (the kernel widens bf16 x and rounds a bf16 out itself); with one, it runs on fp32
// copies, the bias added before the rounding, as quantized_linear does.
void linear_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const at::Tensor& bias, const at::Tensor& offsets, const at::Tensor& superblocks, int64_t kind,
                 int64_t group) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (kind == 0 && group >= 0 && x.size(0) > group && x.scalar_type() == at::kBFloat16) {
    OptTensor b;  // bf16_dot_linear as dense_gemv.py calls it: a bf16 bias
    if (has_bias)
      b = bias.scalar_type() == at::kBFloat16 && bias.is_contiguous() ? bias : bias.to(at::kBFloat16).contiguous();
    bf16_dot_op().call(out, x, weight, b);
    return;
  }
  if (kind == 0) {
    OptTensor b;
    if (has_bias)
      b = bias.scalar_type() == at::kFloat && bias.is_contiguous() ? bias : bias.to(at::kFloat).contiguous();
    gemv_op().call(out, x, weight, b);
    return;
  }
  const OptTensor offs = offsets.numel() > 0 ? OptTensor(offsets) : std::nullopt;
  const OptTensor supers = superblocks.numel() > 0 ? OptTensor(superblocks) : std::nullopt;
  const auto quant = [&](const at::Tensor& o, const at::Tensor& in) {
    if (kind == 8)
      int8_op().call(o, in, weight, scales, group, supers);
    else
      int4_op().call(o, in, weight, scales, group, offs, supers);
  };
  const bool fp32 = x.scalar_type() == at::kFloat;
  if (!has_bias && (fp32 || x.scalar_type() == at::kBFloat16)) {
    quant(out, x);
    return;
  }
  const at::Tensor xf = fp32 ? x : x.to(at::kFloat);
  const at::Tensor of = fp32 ? out : at::empty(out.sizes(), xf.options());
  quant(of, xf);
  if (has_bias) of.add_(bias.to(at::kFloat));
  if (!fp32) out.copy_(of);
}

// Slots of the four linears (qkv, o, gate_up, down): a fused linear may come as slices.
constexpr int64_t kSlots = 7, kTensorsPerSlot = 5;
constexpr int64_t kFirstSlot[5] = {0, 3, 4, 6, kSlots};  // linear i's slots: [kFirstSlot[i], kFirstSlot[i + 1])
constexpr size_t kWeights = 4 + kSlots * kTensorsPerSlot, kInts = 4 + 2 * kSlots, kFloats = 4;  // one layer's

// Slot s's first tensor (its weight or qweight), and its kind (-1: unused).
const at::Tensor& slot_weight(at::TensorList weights, int64_t s) { return weights[4 + kTensorsPerSlot * s]; }
int64_t slot_kind(at::IntArrayRef ints, int64_t s) { return ints[4 + 2 * s]; }

// Output features of slot s: its weight's rows, or an int4 weight in row tiles' 16 per tile
// (quantization.py's `tile`: [N / 16, K / 32, 256]).
int64_t slot_rows(at::TensorList weights, int64_t s) {
  const at::Tensor& w = slot_weight(weights, s);
  return w.dim() == 3 ? w.size(0) * 16 : w.size(0);
}

// Linear i's used slots: [kFirstSlot[i], the returned end).
int64_t used_slots_end(at::IntArrayRef ints, int i) {
  int64_t s = kFirstSlot[i];
  while (s < kFirstSlot[i + 1] && slot_kind(ints, s) >= 0) ++s;
  return s;
}

// Output features of linear i: the rows of its used slots.
int64_t linear_rows(at::TensorList weights, at::IntArrayRef ints, int i) {
  int64_t rows = 0;
  for (int64_t s = kFirstSlot[i], end = used_slots_end(ints, i); s < end; ++s) rows += slot_rows(weights, s);
  return rows;
}

// Linear i of a layer into out [rows, N]: one slot as linear_into; several, each slot's product
// into its columns (through a buffer where those columns are not contiguous: more than one row),
// then the bias in out's dtype.
void linear_slots(const at::Tensor& out, const at::Tensor& x, at::TensorList weights, at::IntArrayRef ints, int i) {
  const auto call = [&](const at::Tensor& o, int64_t s, bool with_bias) {
    const int64_t k = 4 + kTensorsPerSlot * s;
    linear_into(o, x, weights[k], weights[k + 1], with_bias ? weights[k + 2] : at::Tensor(), weights[k + 3],
                weights[k + 4], slot_kind(ints, s), ints[5 + 2 * s]);
  };
  const int64_t first = kFirstSlot[i], end = used_slots_end(ints, i);
  if (end - first == 1) {
    call(out, first, true);
    return;
  }
  int64_t col = 0;
  for (int64_t s = first; s < end; ++s) {
    const int64_t cols = slot_rows(weights, s);
    at::Tensor part = out.narrow(1, col, cols);
    if (part.is_contiguous()) {
      call(part, s, false);
    } else {
      const at::Tensor buffer = at::empty({out.size(0), cols}, out.options());
      call(buffer, s, false);
      part.copy_(buffer);
    }
    col += cols;
  }
  const at::Tensor& bias = weights[4 + kTensorsPerSlot * first + 2];
  if (bias.numel() > 0) out.add_(bias);
}

// What every layer of a step shares: the positions as int64 and the metadata, contiguous, and the
// adapted tokens' runs (flat slot, start, end; empty: no adapter row).
struct Step {
  at::Tensor positions, slot_mapping, block_table, seq_lens, query_start_loc;
  at::IntArrayRef runs;
};

// A layer's LoRA slots per linear (qkv, o, gate_up, down): A and B^T (undefined: not wrapped) and
// the blocks of B^T each slice reads (lora_runs.cpp's arguments).
struct LayerLora {
  at::Tensor a[4], b_t[4];
  std::vector<int64_t> blocks[4];
};

// A layer's activations for n rows, with the views the kernels take. Consecutive layers of one
// shape reuse one Workspace: each buffer is dead by the time the next layer writes it (out and
// o, the next layer's hidden and residual, are consumed by its first fused add-norm and its
// second, before its o_proj and down_proj write them again), so a step allocates them once
// instead of about ten tensors and ten views a layer.
struct Workspace {
  std::vector<int64_t> key;  // n, H, Hkv, D and the linears' output sizes it was made for
  at::Tensor h, qkv, q, k, v, rq, rk, attn, attn_rows, o, h2, gate_up, act, out;

  Workspace(const at::Tensor& hidden, int64_t H, int64_t Hkv, int64_t D, int64_t qkv_n, int64_t o_n, int64_t gu_n,
            int64_t down_n)
      : key{hidden.size(0), H, Hkv, D, qkv_n, o_n, gu_n, down_n} {
    const int64_t n = hidden.size(0), inter = gu_n / 2;
    const auto opts = hidden.options();
    h = at::empty_like(hidden);
    qkv = at::empty({n, qkv_n}, opts);
    q = qkv.narrow(1, 0, H * D).view({n, H, D});
    k = qkv.narrow(1, H * D, Hkv * D).view({n, Hkv, D});
    v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({n, Hkv, D});
    rq = at::empty({n, H, D}, opts);
    rk = at::empty({n, Hkv, D}, opts);
    attn = at::empty({n, H, D}, opts);
    attn_rows = attn.view({n, H * D});
    o = at::empty({n, o_n}, opts);
    h2 = at::empty({n, o_n}, opts);
    gate_up = at::empty({n, gu_n}, opts);
    act = at::empty({n, inter}, opts);
    out = at::empty({n, down_n}, opts);
  }
};

// Layer l's Workspace: the previous layer's where the shapes match, else a new one.
Workspace& workspace_for(std::optional<Workspace>& ws, const at::Tensor& hidden, at::TensorList weights,
                         at::IntArrayRef ints) {
  const auto rows = [&](int i) { return linear_rows(weights, ints, i); };
  const std::vector<int64_t> key{hidden.size(0), ints[0], ints[1], ints[2], rows(0), rows(1), rows(2), rows(3)};
  if (!ws || ws->key != key || ws->h.scalar_type() != hidden.scalar_type())
    ws.emplace(hidden, ints[0], ints[1], ints[2], rows(0), rows(1), rows(2), rows(3));
  return *ws;
}

// One layer; returns (out, o) in `w`: the next layer's hidden state and residual.
void decode_layer(const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& kv_cache, const Step& step,
                  at::TensorList weights, at::IntArrayRef ints, at::ArrayRef<double> floats, const LayerLora* lora,
                  Workspace& w) {
  const int64_t window = ints[3], n = hidden.size(0);
  const auto lin = [&](const at::Tensor& out, const at::Tensor& x, int i) {
    linear_slots(out, x, weights, ints, i);
    if (!step.runs.empty() && lora != nullptr && lora->a[i].defined())
      lora_op().call(out, x, lora->a[i], lora->b_t[i], lora->blocks[i], step.runs);
  };

  add_norm_op().call(w.h, hidden, residual, weights[0], floats[0]);  // hidden <- hidden + residual
  lin(w.qkv, w.h, 0);                                                  // [n, (H + 2 Hkv) D]
  rotary_op().call(w.rq, w.rk, w.q, w.k, step.positions, weights[2], weights[3]);
  store_op().call(kv_cache, w.rk, w.v, step.slot_mapping);
  // max_query_len n: no sequence has more query rows than the step, so every row is computed.
  attention_op().call(w.attn, w.rq, kv_cache, step.block_table, step.seq_lens, step.query_start_loc, n, floats[2],
                       window, 0.0, std::nullopt);

  const double multiplier = floats[3];
  lin(w.o, w.attn_rows, 1);
  if (multiplier != 1.0) w.o.mul_(multiplier);
  add_norm_op().call(w.h2, w.o, hidden, weights[1], floats[1]);  // o <- o + (hidden + residual)

  lin(w.gate_up, w.h2, 2);
  silu_mul_op().call(w.act, w.gate_up);
  lin(w.out, w.act, 3);
  if (multiplier != 1.0) w.out.mul_(multiplier);
}

// A run of layers' arguments, concatenated, held for the engine's lifetime (the weights are the
// model's own tensors, not copies).
struct DecodeStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<LayerLora> lora;  // per layer, once set_lora has been called (else no step passes runs)

  DecodeStack(std::vector<at::Tensor> weights_, std::vector<int64_t> ints_, std::vector<double> floats_)
      : weights(std::move(weights_)), ints(std::move(ints_)), floats(std::move(floats_)) {
    const size_t layers = ints.size() / kInts;
    TORCH_CHECK(layers > 0 && weights.size() == layers * kWeights && ints.size() == layers * kInts &&
                    floats.size() == layers * kFloats,
                "DecodeStack: expected ", kWeights, " weights, ", kInts, " ints and ", kFloats,
                " floats per layer, got ", weights.size(), ", ", ints.size(), " and ", floats.size());
  }

  int64_t num_layers() const { return static_cast<int64_t>(ints.size() / kInts); }

  // Per layer and linear (layer-major): A and B^T, both empty where the linear is not wrapped, and
  // its blocks' ints (block_counts of them each, flat in blocks).
  void set_lora(std::vector<at::Tensor> tensors, std::vector<int64_t> blocks, std::vector<int64_t> block_counts) {
    const int64_t linears = 4 * num_layers();
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 2 * linears &&
                    static_cast<int64_t>(block_counts.size()) == linears,
                "DecodeStack.set_lora: expected ", 2 * linears, " tensors and ", linears, " block counts, got ",
                tensors.size(), " and ", block_counts.size());
    std::vector<LayerLora> layers(num_layers());
    size_t at = 0;
    for (int64_t j = 0; j < linears; ++j) {
      LayerLora& layer = layers[j / 4];
      const int i = static_cast<int>(j % 4);
      TORCH_CHECK(block_counts[j] % 4 == 0 && at + block_counts[j] <= blocks.size(),
                  "DecodeStack.set_lora: block counts must be whole (c0, nc, r0, nr) blocks within blocks");
      if (tensors[2 * j].numel() > 0) {
        layer.a[i] = tensors[2 * j];
        layer.b_t[i] = tensors[2 * j + 1];
        layer.blocks[i].assign(blocks.begin() + at, blocks.begin() + at + block_counts[j]);
      }
      at += block_counts[j];
    }
    lora = std::move(layers);
  }

  // The layers one after the other: returns (hidden, residual) after the last.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, at::Tensor residual, const at::Tensor& positions,
                                             std::vector<at::Tensor> kv_caches, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                                             const at::Tensor& query_start_loc, std::vector<int64_t> runs) const {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "DecodeStack: ", num_layers(),
                " layers, got ", kv_caches.size(), " KV caches");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes(),
                "DecodeStack: hidden and residual must be contiguous [rows, hidden] of one shape");
    TORCH_CHECK(runs.empty() || !lora.empty(), "DecodeStack: adapter runs given, but no LoRA slots set");
    const Step step{positions.to(at::kLong).contiguous(), slot_mapping.contiguous(), block_table, seq_lens,
                    query_start_loc, runs};
    const at::TensorList all_weights(weights);
    const at::IntArrayRef all_ints(ints);
    const at::ArrayRef<double> all_floats(floats);
    std::optional<Workspace> ws;
    for (int64_t l = 0; l < num_layers(); ++l) {
      const at::TensorList layer_weights = all_weights.slice(l * kWeights, kWeights);
      const at::IntArrayRef layer_ints = all_ints.slice(l * kInts, kInts);
      Workspace& w = workspace_for(ws, hidden, layer_weights, layer_ints);
      decode_layer(hidden, residual, kv_caches[l], step, layer_weights, layer_ints,
                   all_floats.slice(l * kFloats, kFloats), lora.empty() ? nullptr : &lora[l], w);
      hidden = w.out;
      residual = w.o;
    }
    return {hidden, residual};
  }
};

}  // namespace

TORCH_LIBRARY(vllm_layer, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("set_lora", &DecodeStack::set_lora)
      .def("forward", &DecodeStack::forward);
}
