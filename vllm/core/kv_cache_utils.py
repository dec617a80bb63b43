"""Prefix-cache block hashing and the `KVCacheBlock` record.

A full block of `block_size` tokens is identified by a chained hash:
    hash_i = H(hash_{i-1}, tokens of block i, extra keys of block i)
so equal hashes mean equal whole prefixes. Extra keys carry what else changes the
block's KV: the LoRA adapter and the request's cache salt.

The adapter key is ("lora", identity, adapter start). The identity is the content
fingerprint of the weights the request computes with (`Request.adapter_identity`), not
its `lora_int_id` or name: an id or name reused for other weights after `remove_lora`
(or files changed on disk and reloaded) never hits blocks of the old weights, and two ids
loading the very same weights share blocks, which is correct since they compute the same KV.
The start is in the key because the KV of a block after it depends on where the adapter
began: two aLoRA requests whose invocation starts differ inside one block must not share it.

aLoRA rule (one of the three places that know aLoRA exists): a block [start, end)
with end <= alora_invocation_start was computed with the base weights, so it gets
no adapter key and is the very same block as the base model's, both ways. Every
later block carries the adapter key; chaining makes it request-specific. A plain
LoRA behaves as if its invocation started at 0.

Adapters embedded in the checkpoint (Granite Switch) need no key: a token's adapter is
a function of the token ids before it (the last control token), and a control id
differs from the substitute id the base sequence holds there, so the chained hash
already makes blocks before a request's first control token the base model's blocks
and every block from it on specific to the request.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from vllm.core.request import Request

BlockHash = bytes

_ROOT_HASH: BlockHash = b"\x00" * 32


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def hash_block_tokens(parent: Optional[BlockHash], token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_extra_keys(request: "Request", start: int, end: int) -> tuple:
    """Extra hash keys of the block [start, end) of `request`."""
    keys: tuple = ()
    if start == 0 and request.cache_salt:
        keys += (("salt", request.cache_salt),)
    if request.lora_request is not None:
        adapter_start = request.alora_invocation_start or 0
        if end > adapter_start:
            keys += (("lora", request.adapter_identity, adapter_start),)
    return keys


def make_block_hasher(block_size: int) -> Callable[["Request"], list[BlockHash]]:
    """A function that returns the hashes of the request's full blocks not yet hashed."""

    def hash_new_full_blocks(request: "Request") -> list[BlockHash]:
        tokens = request.all_token_ids
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes = []
        while start + block_size <= len(tokens):
            end = start + block_size
            parent = hash_block_tokens(parent, tokens[start:end], block_extra_keys(request, start, end))
            new_hashes.append(parent)
            start = end
        return new_hashes

    return hash_new_full_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
