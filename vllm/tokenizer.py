"""Loading the HF tokenizer and the generation stop tokens of a model folder, and the id decoder
the engine calls on every generated token.

`tokenizer_mode` is vLLM's: "auto" loads the fast tokenizer when the folder has one, "slow"
asks for the Python one (`use_fast=False`; transformers falls back to the fast one when
there is no slow implementation). `EngineArgs` has already refused any other mode.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# decode(ids, skip_special_tokens, spaces_between_special_tokens) -> text
IdDecoder = Callable[[list[int], bool, bool], str]


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


def id_decoder(tokenizer: PreTrainedTokenizerBase) -> IdDecoder:
    """`decode(ids, skip_special_tokens, spaces_between_special_tokens)`: the text of
    `tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)` for a list
    of ints, cheaper.

    transformers' `decode` converts its input (`to_py_obj`) and forwards keyword arguments on every
    call: about 4 us, several times the Rust decode itself, and the engine decodes every generated
    token twice. A fast tokenizer that keeps the fast base class's decoding is decoded through
    `_decode` (where `decode` ends for one sequence; fast tokenizers ignore
    spaces_between_special_tokens), and where it also has no tokenization-space cleanup, `_decode`
    is exactly the Rust tokenizer's decode, called directly. Any other tokenizer (slow, or one that
    overrides decoding) keeps its own `decode`."""
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = (isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(backend, Tokenizer)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode)
    if not fast:
        return lambda ids, skip, spaces: tokenizer.decode(ids, skip_special_tokens=skip,
                                                          spaces_between_special_tokens=spaces)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip, spaces: tokenizer._decode(ids, skip_special_tokens=skip)
    return lambda ids, skip, spaces: backend.decode(ids, skip)


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
