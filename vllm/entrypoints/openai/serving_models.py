"""`OpenAIServingModels`: which model names the server answers to.

What it owns: the base model name, the registry of served adapters (name -> LoRARequest:
those from `--lora-modules` and those loaded at runtime through /v1/load_lora_adapter),
the `/v1/models` listing, and the resolution of a request's `model` field.

Invariants:
- A request naming the base model (or no model) uses no adapter; a request naming an
  adapter uses it; any other name is a 404 "The model `x` does not exist.".
- Adapters embedded in the checkpoint (Granite Switch) are listed and addressed by name
  like runtime adapters, but select no `LoRARequest`: a chat request naming one renders
  with `chat_template_kwargs.adapter_name` set to it (the checkpoint's template places the
  control token); a completion request's prompt carries its control tokens itself.
- Every registered adapter was loaded and validated by the engine first
  (`AsyncLLM.add_lora`), so a bad adapter is refused when it is registered, not when
  the first request uses it.
- `lora_int_id`s are handed out in increasing order and never reused, so a reloaded
  adapter never shares prefix-cache blocks with an older one of the same name.
- Load and unload run one at a time (two concurrent loads of one name cannot both win).
- A runtime load reads only inside `allowed_lora_root` (`--allowed-lora-root`): the
  adapter path's real path (symlinks and `..` resolved) must lie inside the root's, and
  that resolved path is what is loaded and registered, so a symlink swapped after the
  check cannot redirect the read. Without a root every runtime load is a 400 naming the
  flag. `--lora-modules` adapters (chosen by the operator) are not restricted.
- The load/unload answers use vLLM's texts (mellea matches "has already been loaded.").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.errors import BadRequestError, NotFoundError
from vllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.entrypoints.openai.response_models import ModelCard, ModelList
from vllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's forms)."""
    value = value.strip()
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"Invalid JSON for --lora-modules: {value!r} ({e})") from e
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise ValueError(f"--lora-modules JSON needs 'name' and 'path': {value!r}")
        return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules expects name=path or a JSON object, got {value!r}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, base_model_names: Union[str, Sequence[str]], base_model_path: str,
                 max_model_len: int, lora_modules: Optional[list[LoRAModulePath]] = None,
                 allowed_lora_root: Optional[str] = None):
        self.engine = engine
        self.allowed_lora_root = os.path.realpath(allowed_lora_root) if allowed_lora_root is not None else None
        # Every alias (--served-model-name a b) is the base model; the first names it in responses.
        self.base_model_names = (base_model_names,) if isinstance(base_model_names, str) else tuple(base_model_names)
        self.base_model_name = self.base_model_names[0]
        self.base_model_path = base_model_path
        self.max_model_len = max_model_len
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        switch = getattr(engine.model_config.hf_config, "switch", None)
        self.embedded_adapters: tuple[str, ...] = switch.adapter_names if switch is not None else ()
        self._next_id = itertools.count(1)
        self._lock = asyncio.Lock()

    async def init_static_loras(self) -> None:
        """Load every `--lora-modules` adapter; raises ValueError naming a bad one."""
        for module in self.static_lora_modules:
            if self._taken(module.name):
                raise ValueError(f"--lora-modules names {module.name!r} twice (or it is the base model's name).")
            request = LoRARequest(module.name, next(self._next_id), module.path,
                                  base_model_name=module.base_model_name)
            await self.engine.add_lora(request)
            self.lora_requests[module.name] = request

    async def describe_adapters(self) -> list[str]:
        """One line per adapter for the start-up log."""
        lines = []
        for request in self.lora_requests.values():
            kind = "aLoRA" if await self.engine.is_alora(request) else "LoRA"
            lines.append(f"{request.lora_name} ({kind}, {request.lora_path})")
        return lines

    def is_base_model(self, name: Optional[str]) -> bool:
        return name is None or name in self.base_model_names

    def _taken(self, name: str) -> bool:
        return name in self.lora_requests or name in self.base_model_names or name in self.embedded_adapters

    def chat_template_kwargs(self, name: Optional[str], kwargs: Optional[dict]) -> Optional[dict]:
        """The request's template kwargs, with `adapter_name` set when `name` is an embedded adapter."""
        if name not in self.embedded_adapters:
            return kwargs
        given = (kwargs or {}).get("adapter_name")
        if given is not None and given != name:
            raise BadRequestError(f"model {name!r} and chat_template_kwargs.adapter_name {given!r} name different "
                                  "adapters.", param="chat_template_kwargs")
        return {**(kwargs or {}), "adapter_name": name}

    def resolve(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's `model` field selects (None: the base model)."""
        if self.is_base_model(name) or name in self.embedded_adapters:
            return None
        request = self.lora_requests.get(name)
        if request is None:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        return request

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.base_model_path, max_model_len=self.max_model_len)
                 for name in self.base_model_names]
        for name in self.embedded_adapters:
            cards.append(ModelCard(id=name, root=self.base_model_path, parent=self.base_model_name,
                                   max_model_len=self.max_model_len))
        for lora in self.lora_requests.values():
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path,
                                   parent=lora.base_model_name or self.base_model_name))
        return ModelList(data=cards)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        if not request.lora_name or not request.lora_path:
            raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput")
        lora_path = self._allowed_path(request.lora_name, request.lora_path)
        async with self._lock:
            old = self.lora_requests.get(request.lora_name) if request.load_inplace else None
            if old is None and self._taken(request.lora_name):
                raise BadRequestError(f"The lora adapter '{request.lora_name}' has already been loaded.",
                                      err_type="InvalidUserInput")
            # A reload gets a new lora_int_id: its KV blocks and slot are its own, and requests
            # already running keep the weights they were admitted with (they travel with them).
            lora = LoRARequest(request.lora_name, next(self._next_id), lora_path,
                               base_model_name=old.base_model_name if old else None)
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                raise BadRequestError(f"Failed to load LoRA adapter '{request.lora_name}': {e}",
                                      param="lora_path") from e
            self.lora_requests[request.lora_name] = lora
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    def _allowed_path(self, name: str, path: str) -> str:
        """The real path of a runtime load's `lora_path`, if it lies inside the allowed root."""
        if self.allowed_lora_root is None:
            raise BadRequestError(f"Cannot load LoRA adapter '{name}': runtime adapter loading reads only under an "
                                  "allowed folder; start the server with --allowed-lora-root DIR.",
                                  param="lora_path")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.allowed_lora_root]) != self.allowed_lora_root:
            raise BadRequestError(f"Cannot load LoRA adapter '{name}': {path!r} (real path {real!r}) is not inside "
                                  f"--allowed-lora-root {self.allowed_lora_root!r}.", param="lora_path")
        return real

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if not request.lora_name:
            raise BadRequestError("'lora_name' needs to be provided to unload a LoRA adapter.",
                                  err_type="InvalidUserInput")
        async with self._lock:
            lora = self.lora_requests.get(request.lora_name)
            if lora is None:
                raise NotFoundError(f"The lora adapter '{request.lora_name}' cannot be found.")
            await self.engine.remove_lora(lora.lora_int_id)
            del self.lora_requests[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
