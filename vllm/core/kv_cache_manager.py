"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, and
allocation of room for a step's new tokens.

Invariants:
- `req_to_blocks[id][j]` holds positions j*block_size .. (j+1)*block_size - 1 of the
  request; the list is exactly as long as the request's computed-or-scheduled tokens
  need.
- A prefix hit never covers the request's last known token: at least one token is
  computed so the step produces logits.
- Blocks are registered in the prefix cache as soon as they are allocated and full
  of known tokens. A later request in the same step may hit them: every layer
  stores the whole batch's keys and values before any attention reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vllm.core.block_pool import BlockPool
from vllm.core.kv_cache_utils import KVCacheBlock, cdiv
from vllm.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache
    alora_reused: int = 0  # hits by aLoRA requests (base-model blocks they reused)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt token.
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup once the request is actually scheduled with its hit."""
        if not self.enable_caching:
            return
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        if request.alora_invocation_start is not None:
            base_part = request.alora_invocation_start // self.block_size * self.block_size
            self.stats.alora_reused += min(num_hit_tokens, base_part)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` after the request's computed tokens (plus the
        prefix hit `new_computed_blocks`). Returns the new blocks, or None (nothing
        changed) when the pool cannot provide them."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(new_computed_blocks), 0)
        # Hit blocks that sit in the free queue stop being available for new blocks.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.get_num_free_blocks() - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            self.pool.cache_blocks(blocks[start:end], request.block_hashes[start:end])
            self._num_cached_blocks[request.request_id] = end

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Take the request's blocks from token `num_tokens` on out of the prefix cache: a step
        that failed registered them (allocation does) but never wrote their KV."""
        first = num_tokens // self.block_size
        self.pool.uncache(self.req_to_blocks.get(request.request_id, [])[first:])
        if self._num_cached_blocks.get(request.request_id, 0) > first:
            self._num_cached_blocks[request.request_id] = first

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
