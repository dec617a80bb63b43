"""LoRA and aLoRA adapters written with PEFT's `save_pretrained`, and PEFT models as oracles.

`init_lora_weights=False` keeps PEFT from zeroing `lora_B`, so every adapter
changes the model's output and parity tests are meaningful.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.utils.checkpoints import load_hf_model

ATTN_QKV = ["q_proj", "k_proj", "v_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str,
    out_dir: str,
    target_modules: Sequence[str] | str = ALL_LINEAR,
    r: int = 8,
    lora_alpha: int = 16,
    seed: int = 1,
    invocation_tokens: Optional[list[int]] = None,
    use_rslora: bool = False,
    scale_b: float = 1.0,
) -> str:
    """Save a random PEFT adapter for the checkpoint at `base_dir`; an aLoRA when
    `invocation_tokens` is given."""
    model = load_hf_model(base_dir)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        init_lora_weights=False,
        use_rslora=use_rslora,
        alora_invocation_tokens=invocation_tokens,
        task_type="CAUSAL_LM",
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale_b)
    peft_model.save_pretrained(out_dir)
    return out_dir


def load_peft_model(base_dir: str, adapter_dir: str) -> PeftModel:
    return PeftModel.from_pretrained(load_hf_model(base_dir), adapter_dir).eval()
