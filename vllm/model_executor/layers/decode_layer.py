"""Llama-style decoder layers' few-row forward (decodes) as one native call on the CPU
(vllm/csrc/cpu/decode_layer.cpp): per layer the kernels its Python runs, in the same order on the
same tensors, so the output is bit for bit the Python layers'; only the Python between them
(module calls, views, the dispatch of ~40 ops: ~0.2 ms a layer on a 2-core EPYC) is gone. A run
of consecutive qualifying layers is one `NativeDecodeStack`, one call per step for all of them
(`runs` finds the runs; models/llama.py's LlamaModel calls them).

When a layer qualifies (`NativeDecodeLayer.build` decides once per layer, the stack's `takes`
per step for its whole run):
  - on the CPU, every kernel it calls built, not under VLLM_USE_TORCH_REFERENCE_OPS;
  - a plain layer: native RMSNorm for both norms, no q/k norm or clipping, native rotary, no
    attention sinks or soft cap (a sliding window is fine), LlamaMLP with SiLU on the native
    SiLU-and-mul kernel (layers/activation.py), the native CPU attention and KV store (Granite's
    residual and attention multipliers are fine);
  - its four linears `Linear`s, or LoRA wrappers of them (lora/layers.py), without a
    tensor-parallel shard, each dense (fp32 / bf16, row-major) or quantized int8 / int4 (GGUF
    Q4_K's offsets included), as one weight or, for qkv and gate_up, as the slices a GGUF file's
    mixed formats leave (one product per slice, then the bias, as Linear's forward does);
  - its `native_decode_allowed` (True unless a test or benchmark turns the native path off);
  - per step: no more rows than each of its linears takes natively (dense_gemv.layer_rows: the
    GEMV's rows, and bf16 rows up to 16 where the vdpbf16ps kernel runs; quantization.native_max_rows)
    in the layer's dtype, no padding rows, and either no adapter row in the step (`punica.meta.has_lora`
    false: a wrapper then adds nothing to its base layer's product) or adapted tokens the native LoRA
    op takes (lora/ops/cpu_native.py's `runs_native`: runs, few tokens) with every wrapper of the run
    holding B transposed in the layer's dtype: the stack then adds each wrapper's delta with that op
    after its product, as the wrapper does. Other adapter steps (many adapted tokens, fragmented
    mappings, another --lora-dtype) run Python. The first layer takes a zero residual.
Anything else runs the Python layer, which stays the reference.

Invariant: a layer's native form is built at the model's first CPU forward, after
ModelRunner.load_model has wrapped the linears for LoRA and packed them for oneDNN; nothing
replaces a layer's modules after that, so the per-step check does not look at them (it did, at
~0.14 ms a step for 120 linears).
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm import envs, native_build
from vllm.attention.backends import cpu_native
from vllm.attention.metadata import AttentionMetadata
from vllm.lora.layers import LinearWithLoRA
from vllm.lora.ops import cpu_native as lora_native
from vllm.model_executor.layers import dense_gemv, quantization
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.rotary import RotaryEmbedding

_SOURCE, _WHAT = "decode_layer.cpp", "CPU decoder-layer kernel"
_KINDS = {"int8": 8, "int4": 4}  # a dense weight is kind 0
_SLOTS = (3, 1, 2, 1)  # the kernel's slots for qkv, o, gate_up and down (kSlots in decode_layer.cpp)
_EMPTY = torch.empty(0)


def native_available() -> bool:
    return native_build.unavailable_reason(_SOURCE, _WHAT) is None


def _linear_args(linear, slots: int) -> Optional[tuple[list[torch.Tensor], list[int], int]]:
    """(per slot [weight or qweight, scales, bias, offsets, superblocks], per slot [kind, group], rows
    it runs natively) for the kernel's `slots` slots of this linear, or None if it does not qualify.
    A quantized linear kept as slices (GGUF slices of mixed formats) fills one slot per slice, its
    bias in the first; unused slots are empty, kind -1. A dense weight's second int is not a group:
    the rows above which the layer runs the vdpbf16ps kernel instead of the GEMV (-1: never), as
    dense_linear does."""
    if type(linear) is LinearWithLoRA:  # its base layer's product, on steps without adapters
        linear = linear.base_layer
    if type(linear) is not Linear or linear.shard is not None or linear._packed is not None:
        return None
    bias = _EMPTY if linear.bias is None else linear.bias
    if not linear._quantized:
        weight = linear.weight
        if weight.dtype not in dense_gemv.WEIGHT_DTYPES or weight.dim() != 2 or not weight.is_contiguous():
            return None
        native_rows, dot_above = dense_gemv.layer_rows(weight)
        tensors, ints = [weight, _EMPTY, bias, _EMPTY, _EMPTY], [0, dot_above]
    else:
        quantized = linear._quantized
        if len(quantized) > slots or any(q is None for q in quantized) or not quantization.native_available():
            return None
        tensors, ints, native_rows = [], [], min(quantization.native_max_rows(q) for q in quantized)
        for i, q in enumerate(quantized):
            optional = [_EMPTY if t is None else t for t in (q.offsets, q.superblocks)]
            tensors += [q.qweight, q.scales, bias if i == 0 else _EMPTY, *optional]
            ints += [_KINDS[q.method], q.group]
    free = slots - len(ints) // 2
    return tensors + free * [_EMPTY] * 5, ints + free * [-1, 0], native_rows


class NativeDecodeLayer:
    def __init__(self, layer, weights: list[torch.Tensor], ints: list[int], floats: list[float], max_rows: int):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # The adapter mappings of wrapped linears (one per engine): `takes` reads their step metadata.
        self._punicas = list({id(m.punica): m.punica for m in linears if type(m) is LinearWithLoRA}.values())
        self.dtype = layer.input_layernorm.weight.dtype
        self.weights, self.ints, self.floats = weights, ints, floats
        self.max_rows = max_rows  # more rows than a linear runs natively: Python's product would differ
        # Per linear its LoRA slots for the native op (A, B^T, blocks; empty where not wrapped), or
        # None where a wrapper cannot take it (adapter steps then run Python).
        self.lora: Optional[list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = []
        for m in linears:
            if type(m) is not LinearWithLoRA:
                self.lora.append((_EMPTY, _EMPTY, []))
            elif m.lora_b_t is not None and m.lora_dtype == self.dtype:
                self.lora.append((m.lora_a[0], m.lora_b_t, m._blocks))
            else:
                self.lora = None
                break

    @classmethod
    def build(cls, layer) -> Optional["NativeDecodeLayer"]:
        """The native form of a LlamaDecoderLayer (models/llama.py), or None where it does not
        qualify (the module docstring)."""
        from vllm.model_executor.models.llama import LlamaMLP

        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        variant = attn.attn.variant
        plain = (all(type(n) is RMSNorm and n._native for n in norms)
                 and not attn.qk_norm and attn.clip_qkv is None and type(attn.rotary_emb) is RotaryEmbedding
                 and attn.rotary_emb._native and variant.sinks is None and variant.soft_cap is None
                 and attn.attn._attend is cpu_native.paged_attention and attn.attn._store_kv is cpu_native.store_kv
                 and type(mlp) is LlamaMLP and mlp.act_and_mul is not None and mlp.act_and_mul.native)
        if not plain or envs.VLLM_USE_TORCH_REFERENCE_OPS or not dense_gemv.native_available():
            return None
        linears = [_linear_args(m, slots) for m, slots in zip((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                mlp.down_proj), _SLOTS)]
        if any(args is None for args in linears) or not native_available():
            return None
        rotary = attn.rotary_emb
        weights = [norms[0].weight, norms[1].weight, rotary.cos_cache, rotary.sin_cache]
        ints = [attn.num_heads, attn.num_kv_heads, attn.head_size, variant.sliding_window or 0]
        for tensors, numbers, _ in linears:
            weights += tensors
            ints += numbers
        floats = [norms[0].eps, norms[1].eps, attn.attn.scale, layer.residual_multiplier]
        return cls(layer, weights, ints, floats, min(rows for _, _, rows in linears))


class NativeDecodeStack:
    """Consecutive decoder layers, each with a native form, run by one native call (the
    DecodeStack of decode_layer.cpp, which holds their weights)."""

    def __init__(self, layers: list, natives: list[NativeDecodeLayer]):
        self.layers = layers
        self.dtype = natives[0].dtype
        self.max_rows = min(native.max_rows for native in natives)
        self._punicas = list({id(p): p for native in natives for p in native._punicas}.values())
        self._stack = torch.classes.vllm_layer.DecodeStack([w for native in natives for w in native.weights],
                                                           [i for native in natives for i in native.ints],
                                                           [f for native in natives for f in native.floats])
        # Adapter steps natively: one adapter mapping, every wrapper's slots readable by the native op.
        self._lora = len(self._punicas) == 1 and all(native.lora is not None for native in natives)
        if self._lora:
            slots = [slot for native in natives for slot in native.lora]
            self._stack.set_lora([t for a, b_t, _ in slots for t in (a, b_t)],
                                 [v for _, _, blocks in slots for v in blocks], [len(blocks) for _, _, blocks in slots])

    def __len__(self) -> int:
        return len(self.layers)

    def takes(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata) -> bool:
        n = hidden.shape[0]
        return (n <= self.max_rows and meta.num_actual_tokens == n
                and hidden.dtype == self.dtype and hidden.is_contiguous()
                and (residual is None or residual.is_contiguous())
                and all(layer.native_decode_allowed for layer in self.layers)
                and all(not punica.meta.has_lora or (self._lora and lora_native.runs_native(punica.meta, self.dtype))
                        for punica in self._punicas))

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """residual None (the first layer): a zero residual, which the fused add-norm turns into the
        Python layer's norm of the hidden state and the hidden state as the residual, the same values."""
        n = hidden.shape[0]
        if residual is None:
            residual = torch.zeros_like(hidden)
        adapted = [p.meta for p in self._punicas if p.meta.has_lora]
        runs = adapted[0].flat_runs if adapted else []
        return self._stack.forward(hidden, residual, positions, kv_caches, meta.slot_mapping[:n], meta.block_table,
                                   meta.seq_lens, meta.query_start_loc, runs)


def runs(layers) -> dict[int, NativeDecodeStack]:
    """First layer index -> the stack of each maximal run of consecutive layers with a native form
    (other decoder classes, without `native_decode_allowed`, have none)."""
    natives = [layer._native_decode_layer() if hasattr(layer, "native_decode_allowed") else None for layer in layers]
    stacks: dict[int, NativeDecodeStack] = {}
    start = None
    for i, native in enumerate(natives + [None]):
        if native is not None and start is None:
            start = i
        elif native is None and start is not None:
            stacks[start] = NativeDecodeStack(list(layers[start:i]), natives[start:i])
            start = None
    return stacks
