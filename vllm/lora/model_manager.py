"""Adapter residency: a host-memory cache of loaded adapters (`max_cpu_loras`, LRU) and
`max_loras` device slots (LRU) that the model's LoRA layers read.

Adapters embedded in the checkpoint (Granite Switch) are pinned first, one per slot
`0 .. num_embedded - 1`, and never evicted; runtime adapters take the `max_loras`
slots after them, so the two never compete. A model with embedded adapters gets LoRA
layers even when runtime LoRA is off (`lora_config` None; then `adapters` is None).

`LoRAModelManager` wraps every adaptable linear layer of the model in
`LinearWithLoRA` at start-up. Each step, `activate` makes the step's adapters
resident (loading into free or least-recently-used slots that the step does not
need) and returns lora_int_id -> slot. The scheduler guarantees at most `max_loras`
distinct adapters per step and one set of weights per lora_int_id in a step, so a slot is
always available and the mapping is unambiguous. A request carries the host weights
it was validated with, and a slot is filled from those; a slot is reused for a
lora_int_id only while it holds weights with the same fingerprint (`LoRAModel.fingerprint`),
so an adapter reloaded in place (a new lora_int_id, or the same id after `remove_adapter`,
maybe the same path with new files) never mixes into a request already running, nor the
other way round.

Unloading (`remove_adapter`) "waits for" running requests: it forgets the slot and the host
copy at once, so new requests must load the adapter again, while requests already admitted
keep computing with the weights they carry (their slot is refilled from those when needed).

Host memory bound: `AdapterCache` holds at most `max_cpu_loras` adapters (LRU). A request
pins the weights it carries until it finishes, so adapters evicted (or removed) while
requests use them stay in memory until then: the host copies are bounded by
`max_cpu_loras` plus the distinct adapters of unfinished requests.

`AdapterCache` is also what the input processor uses to validate an adapter and read
its invocation tokens, so a bad adapter is rejected before it reaches the engine
loop. It is thread-safe: the server validates on its own thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from vllm.config import LoRAConfig
from vllm.logger import init_logger
from vllm.lora.layers import LinearWithLoRA
from vllm.lora.lora_model import LoRAModel, ModuleSpec, load_lora_model
from vllm.model_executor.hf_files import resolve_adapter_dir
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.punica import PunicaWrapper
from vllm.lora.request import LoRARequest

logger = init_logger(__name__)

_DEFAULT_SLICES = {"o_proj": ("o_proj",), "down_proj": ("down_proj",)}


class AdapterCache:
    def __init__(self, lora_config: LoRAConfig, specs: dict[str, ModuleSpec], dtype: torch.dtype, tokenizer_dir: str):
        self.config = lora_config
        self.specs = specs
        self.dtype = dtype
        self.tokenizer_dir = tokenizer_dir
        self._tokenizer = None
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()
        self._paths: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from vllm.tokenizer import get_tokenizer

            self._tokenizer = get_tokenizer(self.tokenizer_dir)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def get(self, request: LoRARequest) -> LoRAModel:
        """The adapter's host copy, loading (and validating) it on first use."""
        with self._lock:
            known = self._paths.get(request.lora_int_id)
            if known is not None and known != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} already names adapter {known[0]!r} ({known[1]}); "
                    f"use a different id for {request.lora_name!r}."
                )
            model = self._cache.get(request.lora_int_id)
            if model is not None:
                self._cache.move_to_end(request.lora_int_id)
                return model
            path = resolve_adapter_dir(request.lora_name, request.lora_path)
            peft = PEFTHelper.from_dir(request.lora_name, path, self._tokenize)
            if peft.r > self.config.max_lora_rank:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} has rank {peft.r}, greater than "
                    f"max_lora_rank={self.config.max_lora_rank}; raise --max-lora-rank."
                )
            model = load_lora_model(request.lora_int_id, request.lora_name, path, peft, self.specs,
                                    self.config.max_lora_rank, self.dtype)
            while len(self._cache) >= self.config.max_cpu_loras:
                self._cache.popitem(last=False)
            self._cache[request.lora_int_id] = model
            self._paths[request.lora_int_id] = (request.lora_name, request.lora_path)
            kind = f"aLoRA (invocation {list(peft.invocation_tokens)})" if peft.is_alora else "LoRA"
            logger.info("Loaded %s adapter %r (rank %d, %d modules)", kind, request.lora_name, model.rank,
                        len(model.layers))
            return model

    def __len__(self) -> int:
        """Adapters held now (at most max_cpu_loras)."""
        return len(self._cache)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._cache

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._cache.pop(lora_int_id, None)
            self._paths.pop(lora_int_id, None)


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: Optional[LoRAConfig], max_num_tokens: int, dtype: torch.dtype,
                 device: torch.device, tokenizer_dir: str = ""):
        self.config = lora_config
        embedded = model.embedded_adapters() if hasattr(model, "embedded_adapters") else []
        self.num_embedded = len(embedded)
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        max_rank = max(lora_config.max_lora_rank if lora_config is not None else 0,
                       getattr(model, "embedded_max_rank", 0))
        self.punica = PunicaWrapper(max_num_tokens, device)
        lora_dtype = (lora_config.lora_dtype if lora_config is not None else None) or dtype
        self.layers: dict[str, LinearWithLoRA] = {}
        specs: dict[str, ModuleSpec] = {}
        packed = dict(getattr(model, "packed_modules_mapping", {}))
        aliases = dict(getattr(model, "peft_module_aliases", {}))
        for name, module in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            slices = tuple(packed.get(leaf, ())) or _DEFAULT_SLICES.get(leaf)
            if slices is None or not hasattr(module, "output_sizes"):
                continue
            wrapped = LinearWithLoRA(module, self.num_embedded + self.max_loras, max_rank, self.punica,
                                     dtype=lora_dtype)
            model.set_submodule(name, wrapped)
            self.layers[name] = wrapped
            # Adapter files hold whole matrices: validated against the full (unsharded) layer.
            specs[name] = ModuleSpec(module.full_input_size, tuple(module.full_output_sizes), slices, tuple(
                (name[: -len(ours)] + theirs, index)
                for theirs, (ours, index) in aliases.items() if name.endswith("." + ours)
            ))
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no layers LoRA can adapt.")
        for slot, weights in enumerate(embedded):
            for name, layer in self.layers.items():
                layer.set_lora(slot, weights.get(name))
        self.adapters = AdapterCache(lora_config, specs, lora_dtype, tokenizer_dir) if lora_config is not None else None
        # lora_int_id -> (slot, fingerprint of the weights in it), least recently used first.
        self._slots: OrderedDict[int, tuple[int, bytes]] = OrderedDict()

    def activate(self, adapters: list[tuple[Optional[LoRARequest], Optional[LoRAModel]]]) -> dict[int, int]:
        """Make the step's adapters resident; returns lora_int_id -> slot. Each entry is a
        request's adapter and the weights it was admitted with (loaded as they are when given)."""
        needed: dict[int, tuple[LoRARequest, Optional[LoRAModel]]] = {}
        for request, weights in adapters:
            if request is None:
                continue
            seen = needed.setdefault(request.lora_int_id, (request, weights))
            if seen[1] is not None and weights is not None and seen[1].fingerprint != weights.fingerprint:
                raise AssertionError(f"lora_int_id {request.lora_int_id} with two sets of weights in one step")
        if len(needed) > self.max_loras:
            raise AssertionError(f"{len(needed)} adapters in one step exceed max_loras={self.max_loras}")
        for lora_int_id, (request, weights) in needed.items():
            adapter = weights if weights is not None else self.adapters.get(request)
            held = self._slots.get(lora_int_id)
            if held is not None and held[1] == adapter.fingerprint:
                self._slots.move_to_end(lora_int_id)
                continue
            slot = held[0] if held is not None else self._free_slot(needed)
            for name, layer in self.layers.items():
                layer.set_lora(slot, adapter.layers.get(name))
            self._slots[lora_int_id] = (slot, adapter.fingerprint)
            self._slots.move_to_end(lora_int_id)
        return {lora_int_id: self._slots[lora_int_id][0] for lora_int_id in needed}

    def _free_slot(self, needed: dict) -> int:
        used = {slot for slot, _ in self._slots.values()}
        for slot in range(self.num_embedded, self.num_embedded + self.max_loras):
            if slot not in used:
                return slot
        for lora_int_id, (slot, _) in self._slots.items():
            if lora_int_id not in needed:
                del self._slots[lora_int_id]
                return slot
        raise AssertionError("no LoRA slot can be freed")

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter (runtime unload): its slot and host copy. Requests already
        admitted with it finish with the weights they carry."""
        self._slots.pop(lora_int_id, None)
        if self.adapters is not None:
            self.adapters.remove(lora_int_id)
