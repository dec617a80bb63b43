"""Granite Switch (`GraniteSwitchForCausalLM`): a Granite 4 decoder with LoRA/aLoRA
adapters embedded in the checkpoint, each switched on by a control token.

This file adds only what the format adds to Granite 4:
- **Token exchange.** Before the embedding, every control token id is replaced by its
  substitute (`model.switch.control_to_substitute_lut`, -1 for ordinary ids), so the
  decoder sees exactly the tokens the adapter was trained on.
- **Weight names.** Base weights sit under `.base_layer.` in adapted modules; the
  per-adapter banks (`lora_A[_slices.i]` `[num_adapters, 1, max_rank, in]`,
  `lora_B[_slices.i]` `[num_adapters, 1, out, max_rank]`, B already scaled by alpha/r,
  ranks zero-padded) are kept aside as `embedded_adapters()` for the LoRA manager,
  which pins them into LoRA slots that runtime adapters never take. An all-zero A
  means the adapter does not touch that module.
- The switch's attention codebook is not used: which adapter a token uses is computed
  by an exact integer scan (`vllm/lora/control_tokens.py`) into the same per-token
  adapter mapping as PEFT LoRA, so layers and kernels are unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from vllm.attention.metadata import AttentionMetadata
from vllm.lora.lora_model import LoRALayerWeights
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM, rename_checkpoint_weight

LUT_NAME = "model.switch.control_to_substitute_lut"
_BANK = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>A|B)(?:_slices\.(?P<slice>\d+))?$")


class GraniteSwitchForCausalLM(GraniteMoeHybridForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, dtype, device)
        self.switch = hf_config.switch
        lut = torch.full((hf_config.vocab_size,), -1, dtype=torch.int64)
        for control, substitute in zip(self.switch.control_token_ids, self.switch.substitute_token_ids):
            lut[control] = substitute
        if self.switch.reset_token_id is not None:
            lut[self.switch.reset_token_id] = self.switch.reset_substitute_id
        # Rebuilt from the config; a checkpoint's own table must agree with it (checked at load).
        self.register_buffer("control_to_substitute", lut.to(device), persistent=False)
        self._banks: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # module -> A/B -> slice -> bank
        self._dtype = dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        substitute = self.control_to_substitute[input_ids]
        input_ids = torch.where(substitute >= 0, substitute, input_ids)
        return super().forward(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._base_weights(weights))
        self._check_banks()

    def _base_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base weights under our names; banks and the exchange table are kept aside."""
        for name, tensor in weights:
            if name == LUT_NAME:
                self._check_lut(tensor)
                continue
            if name.startswith("model.switch."):  # the attention switch's codebook: not used
                continue
            match = _BANK.match(name)
            if match:
                module = rename_checkpoint_weight(match["module"] + ".").rstrip(".")
                kind = self._banks.setdefault(module, {}).setdefault(match["kind"], {})
                kind[int(match["slice"] or 0)] = tensor.to(self._dtype)
                continue
            yield name.replace(".base_layer.", "."), tensor

    def _check_lut(self, lut: torch.Tensor) -> None:
        ours = self.control_to_substitute.cpu()
        if lut.shape != ours.shape or not torch.equal(lut.to(torch.int64), ours):
            differ = (lut.to(torch.int64) != ours).nonzero().flatten().tolist() if lut.shape == ours.shape else []
            raise ValueError(
                f"The checkpoint's {LUT_NAME} disagrees with the config's control table "
                f"(adapter_token_ids / adapter_substitute_token_ids) at token ids {differ[:8]}."
            )

    def _check_banks(self) -> None:
        modules = dict(self.named_modules())
        count = self.switch.num_adapters
        for module, kinds in self._banks.items():
            layer = modules.get(module)
            if layer is None or not hasattr(layer, "output_sizes"):
                raise ValueError(f"Granite Switch adapter bank for {module!r} matches no adaptable module.")
            slices = len(layer.output_sizes)
            for kind in ("A", "B"):
                banks = kinds.get(kind, {})
                if sorted(banks) != list(range(slices)) or any(b.shape[0] != count for b in banks.values()):
                    raise ValueError(
                        f"Granite Switch adapter bank lora_{kind} of {module!r} should have {slices} slice(s) "
                        f"of {count} adapters; found slices {sorted(banks)}."
                    )

    @property
    def embedded_max_rank(self) -> int:
        return max((bank.shape[2] for kinds in self._banks.values() for bank in kinds["A"].values()), default=0)

    def embedded_adapters(self) -> list[dict[str, LoRALayerWeights]]:
        """Per adapter (index 1..N in order): our module name -> its weights (None slices
        where the adapter does not touch the module)."""
        adapters: list[dict[str, LoRALayerWeights]] = []
        for a in range(self.switch.num_adapters):
            layers = {}
            for module, kinds in self._banks.items():
                a_slices = [kinds["A"][i][a, 0] for i in range(len(kinds["A"]))]  # [max_rank, in]
                b_slices = [kinds["B"][i][a, 0] for i in range(len(kinds["B"]))]  # [out_i, max_rank]
                used = [bool(x.any()) for x in a_slices]
                if any(used):
                    layers[module] = LoRALayerWeights(
                        [x if u else None for x, u in zip(a_slices, used)],
                        [x if u else None for x, u in zip(b_slices, used)],
                    )
            adapters.append(layers)
        return adapters
