"""`BlockPool`: every KV-cache block, the free-block LRU queue and the prefix-cache map.

Invariants:
- A block is in the free queue iff its `ref_cnt == 0`. The queue is in eviction
  order: the front is evicted first.
- A block with a `block_hash` is in `cached` under that hash (at most one block per
  hash). A free block keeps its hash, so it can be reused until it is evicted, which
  happens only when the block is handed out as a new block.
- Freed request blocks are queued tail-first (callers pass them reversed), so the
  end of a sequence is evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

from vllm.core.kv_cache_utils import BlockHash, KVCacheBlock


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._free):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({len(self._free)} free).")
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget these blocks' hashes (a failed step never wrote them): no later request may
        hit them. Always safe: whoever holds a block keeps it."""
        for block in blocks:
            self._evict(block)

    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Register full blocks under their hashes (blocks[i] holds block_hashes[i])."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                continue
            if block_hash in self.cached:
                # Another block already holds this content; keep that one cached.
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue's end in order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} freed more often than it was taken")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes. Only allowed when no request holds blocks."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
