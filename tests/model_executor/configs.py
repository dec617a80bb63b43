"""Test helper: a `ModelConfig` for a checkpoint folder, built by hand (what
`EngineArgs.create_engine_config` does in the engine)."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from vllm.config import ModelConfig


def model_config_for(path: str, **overrides) -> ModelConfig:
    hf_config = AutoConfig.from_pretrained(path)
    fields = dict(model=path, model_dir=path, tokenizer_dir=path, hf_config=hf_config,
                  architecture=hf_config.architectures[0], dtype=torch.float32, max_model_len=512)
    fields.update(overrides)
    return ModelConfig(**fields)
