"""`LoRARequest`: which adapter a request uses (vLLM's class and field names).

`lora_int_id` identifies the adapter's weights: two requests with the same id use
the same weights, and prefix-cache blocks computed with an adapter are keyed by it.
It must be >= 1 (0 would read as "no adapter").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: Optional[int] = None
    base_model_name: Optional[str] = field(default=None)
    tensorizer_config_dict: Optional[dict] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must be given.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)
