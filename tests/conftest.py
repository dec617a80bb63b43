"""Session fixtures: the test tokenizer, tiny checkpoints and PEFT adapters, built
once per test session in a temporary folder (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run in the interpreter on CPU; this must precede any triton import
# (transformers imports it through torch._dynamo).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.utils.adapters import ALL_LINEAR, ATTN_QKV, make_adapter  # noqa: E402
from tests.utils.checkpoints import ARCHITECTURES, make_checkpoint  # noqa: E402
from tests.utils.tokenizer import build_tokenizer  # noqa: E402

INVOCATION = "<|start_of_role|>certainty<|end_of_role|>"
INVOCATION_2 = "<|start_of_role|>answerability<|end_of_role|>"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Architecture name -> folder of a tiny random checkpoint."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(str(root / arch), arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> str:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, llama_dir, tokenizer) -> dict[str, str]:
    """Adapters for the tiny llama: plain LoRAs (q/k/v only, all linear) and two aLoRAs."""
    root = tmp_path_factory.mktemp("adapters")
    inv1 = tokenizer.encode(INVOCATION, add_special_tokens=False)
    inv2 = tokenizer.encode(INVOCATION_2, add_special_tokens=False)
    return {
        "lora_qkv": make_adapter(llama_dir, str(root / "lora_qkv"), ATTN_QKV, r=8, seed=11),
        "lora_all": make_adapter(llama_dir, str(root / "lora_all"), ALL_LINEAR, r=8, seed=12),
        "alora_certainty": make_adapter(llama_dir, str(root / "alora_certainty"), ALL_LINEAR, r=8, seed=13,
                                        invocation_tokens=inv1),
        "alora_answerability": make_adapter(llama_dir, str(root / "alora_answerability"), ["q_proj", "v_proj", "down_proj"],
                                            r=4, seed=14, invocation_tokens=inv2),
    }
