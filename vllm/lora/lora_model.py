"""`LoRAModel`: one adapter's weights in host memory, mapped onto our modules.

PEFT names a weight `base_model.model.<module path>.lora_A.weight` ([r, in]) or
`.lora_B.weight` ([out, r]) for the unfused modules (q_proj, gate_proj, ...). We map
each onto our fused module and slice (q_proj -> qkv_proj slice 0) and fold PEFT's
scaling into B, so the kernels compute `(x @ A.T) @ B.T` with no extra factor.
Invariants: every module's shapes are checked against the model, every slice the
adapter does not target stays absent (the layer zeroes it), and rank <= max_lora_rank.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vllm import fault_injection
from vllm.lora.peft_helper import PEFTHelper


@dataclass(frozen=True)
class ModuleSpec:
    """What an adaptable module looks like: its input size and fused output slices."""

    input_size: int
    output_sizes: tuple[int, ...]
    slice_names: tuple[str, ...]  # PEFT module names of the slices, e.g. (q_proj, k_proj, v_proj)
    # Other full PEFT module paths that land here: (path, slice index), or (path, None) for a
    # fused PEFT module covering every slice (one A, B split by rows), e.g. Granite 4's
    # `shared_mlp.input_linear` on our gate_up_proj.
    aliases: tuple[tuple[str, Optional[int]], ...] = ()


@dataclass
class LoRALayerWeights:
    """Per slice: A [r, in] and scaled B [out_i, r]; None where not targeted."""

    lora_a: list[Optional[torch.Tensor]]
    lora_b: list[Optional[torch.Tensor]]


@dataclass
class LoRAModel:
    lora_int_id: int
    name: str
    rank: int
    peft: PEFTHelper
    layers: dict[str, LoRALayerWeights] = field(default_factory=dict)  # our module name -> weights
    # sha256 of the loaded weights (see `weights_fingerprint`), set once at load: the adapter's
    # identity for prefix-cache keys and LoRA slots, so a name or id reused for other weights never
    # reaches blocks or a slot filled with the old ones.
    fingerprint: bytes = b""

    @property
    def invocation_tokens(self) -> Optional[tuple[int, ...]]:
        return self.peft.invocation_tokens


_PREFIX = "base_model.model."


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    st_path = os.path.join(path, "adapter_model.safetensors")
    bin_path = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st_path):
            return load_file(st_path, device="cpu")
        if os.path.isfile(bin_path):
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights in {path!r}: {e}") from e
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {path!r}.")


def _split_name(name: str, key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> (module path, 'lora_A')."""
    path = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
    parts = path.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r} (only lora_A / lora_B of linear layers).")
    return ".".join(parts[:-2]), parts[-2]


def load_lora_model(
    lora_int_id: int,
    name: str,
    path: str,
    peft: PEFTHelper,
    specs: dict[str, ModuleSpec],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAModel:
    """`specs` maps our module names (e.g. model.layers.0.self_attn.qkv_proj) to their shapes."""
    targets = _peft_targets(specs)
    model = LoRAModel(lora_int_id, name, 0, peft)
    peft_paths: dict[tuple[str, int], str] = {}  # (our module, slice) -> PEFT module path, for scaling
    tensors = _read_tensors(name, path)
    for index, (key, tensor) in enumerate(tensors.items()):
        fault_injection.on_adapter_tensor(name, index, len(tensors))
        peft_module, which = _split_name(name, key)
        if peft_module not in targets:
            raise ValueError(
                f"LoRA adapter {name!r} targets {peft_module!r}, which this model cannot adapt "
                "(supported: q/k/v/o/gate/up/down projections of the decoder layers)."
            )
        module_name, index = targets[peft_module]
        spec = specs[module_name]
        layer = model.layers.setdefault(
            module_name, LoRALayerWeights([None] * len(spec.output_sizes), [None] * len(spec.output_sizes))
        )
        for i, part in _slice_parts(name, peft_module, which, tensor, spec, index):
            (layer.lora_a if which == "lora_A" else layer.lora_b)[i] = part
            peft_paths[(module_name, i)] = peft_module

    for module_name, layer in model.layers.items():
        spec = specs[module_name]
        for i, (a, b) in enumerate(zip(layer.lora_a, layer.lora_b)):
            peft_module = peft_paths.get((module_name, i), f"{module_name.rsplit('.', 1)[0]}.{spec.slice_names[i]}")
            if (a is None) != (b is None):
                raise ValueError(f"LoRA adapter {name!r}: {peft_module} has only one of lora_A / lora_B.")
            if a is None:
                continue
            rank = a.shape[0]
            expected_a, expected_b = (rank, spec.input_size), (spec.output_sizes[i], rank)
            if a.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
                raise ValueError(
                    f"LoRA adapter {name!r} does not fit this model: {peft_module} has lora_A {tuple(a.shape)} and "
                    f"lora_B {tuple(b.shape)}, expected {expected_a} and {expected_b}."
                )
            if rank > max_rank:
                raise ValueError(
                    f"LoRA adapter {name!r} has rank {rank} on {peft_module}, greater than max_lora_rank={max_rank}; "
                    "raise --max-lora-rank."
                )
            model.rank = max(model.rank, rank)
            layer.lora_a[i] = a.to(dtype).contiguous()
            layer.lora_b[i] = (b.float() * peft.scaling(peft_module, rank)).to(dtype).contiguous()
    if not model.layers:
        raise ValueError(f"LoRA adapter {name!r} in {path!r} has no LoRA weights.")
    model.fingerprint = weights_fingerprint(model)
    return model


def weights_fingerprint(model: LoRAModel) -> bytes:
    """sha256 over every module's slices as the kernels see them (A and scaled B, with names,
    dtypes and shapes): equal fingerprints compute equal KV. One pass over the weights at load
    (about a millisecond per MB)."""
    h = hashlib.sha256()
    for module_name in sorted(model.layers):
        layer = model.layers[module_name]
        for i, (a, b) in enumerate(zip(layer.lora_a, layer.lora_b)):
            if a is None:
                continue
            h.update(f"{module_name}:{i}:{a.dtype}:{tuple(a.shape)}:{tuple(b.shape)}".encode())
            for tensor in (a, b):
                h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def _peft_targets(specs: dict[str, ModuleSpec]) -> dict[str, tuple[str, Optional[int]]]:
    """PEFT module path -> (our module, slice index; None: every slice)."""
    targets: dict[str, tuple[str, Optional[int]]] = {}
    for module_name, spec in specs.items():
        parent = module_name.rsplit(".", 1)[0]
        for i, slice_name in enumerate(spec.slice_names):
            targets[f"{parent}.{slice_name}"] = (module_name, i)
        for peft_path, index in spec.aliases:
            targets[peft_path] = (module_name, index)
    return targets


def _slice_parts(name: str, peft_module: str, which: str, tensor: torch.Tensor, spec: ModuleSpec,
                 index: Optional[int]) -> list[tuple[int, torch.Tensor]]:
    """(slice, tensor) pairs of one PEFT weight: itself for one slice; for a fused PEFT
    module, the same A for every slice and B's rows split by the slices' output sizes."""
    if index is not None:
        return [(index, tensor)]
    count = len(spec.output_sizes)
    if which == "lora_A":
        return [(i, tensor) for i in range(count)]
    if tensor.dim() != 2 or tensor.shape[0] != sum(spec.output_sizes):
        raise ValueError(
            f"LoRA adapter {name!r} does not fit this model: {peft_module} has lora_B {tuple(tensor.shape)}, "
            f"expected {sum(spec.output_sizes)} rows."
        )
    return list(enumerate(tensor.split(list(spec.output_sizes), dim=0)))
