"""Loading the HF tokenizer and the generation stop tokens of a model folder.

`tokenizer_mode` is vLLM's: "auto" loads the fast tokenizer when the folder has one, "slow"
asks for the Python one (`use_fast=False`; transformers falls back to the fast one when
there is no slow implementation). `EngineArgs` has already refused any other mode.
"""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto") -> PreTrainedTokenizerBase:
    """`path`: a tokenizer folder, or a GGUF file whose metadata holds the tokenizer."""
    try:
        if path.endswith(".gguf") and os.path.isfile(path):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 trust_remote_code=trust_remote_code)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                             use_fast=tokenizer_mode != "slow")
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e


def generation_eos_token_ids(model_dir: str) -> set[int]:
    """EOS ids from generation_config.json (chat models often end turns with a
    token other than the tokenizer's EOS)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
