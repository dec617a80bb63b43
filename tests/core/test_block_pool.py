"""Block pool and block hashing, without a model."""

import pytest

from vllm.core.block_pool import BlockPool
from vllm.core.kv_cache_utils import hash_block_tokens, make_block_hasher
from vllm.core.request import Request
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams


def test_allocation_and_free_order():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.get_num_free_blocks() == 1
    # Freed tail-first: block 2 is evicted before 1 before 0, after the never-used 3.
    pool.free_blocks(reversed(a))
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 2, 1, 0]


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_blocks([b0], [h])
    pool.free_blocks([b0])
    assert pool.get_cached_block(h) is b0  # free but still cached
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([b0])
    pool.get_new_blocks(2)  # evicts both, including b0
    assert pool.get_cached_block(h) is None and b0.block_hash is None


def test_over_allocation_and_double_free_are_errors():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="free blocks"):
        pool.get_new_blocks(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_chained_hashes_depend_on_whole_prefix():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 2]), [3, 4])
    assert hash_block_tokens(None, [1, 2], (("lora", 1),)) != h1


def _request(tokens, lora=None, alora_start=None, salt=None):
    return Request("r", tokens, SamplingParams(), max_tokens=4, lora_request=lora,
                   alora_invocation_start=alora_start, cache_salt=salt, block_hasher=make_block_hasher(4))


def test_alora_blocks_before_invocation_hash_as_base():
    tokens = list(range(1, 17))  # 4 full blocks of 4
    lora = LoRARequest("a", 1, "/x")
    base = _request(tokens)
    alora = _request(tokens, lora, alora_start=8)  # blocks [0,4) and [4,8) end <= 8
    plain = _request(tokens, lora)
    assert alora.block_hashes[:2] == base.block_hashes[:2]
    assert alora.block_hashes[2:] != base.block_hashes[2:] and len(alora.block_hashes) == 4
    assert all(p != b for p, b in zip(plain.block_hashes, base.block_hashes))
    # Start inside a block: that block already carries the adapter.
    assert _request(tokens, lora, alora_start=7).block_hashes[1] != base.block_hashes[1]
    # Two different aLoRAs share the base part.
    other = _request(tokens, LoRARequest("b", 2, "/y"), alora_start=8)
    assert other.block_hashes[:2] == alora.block_hashes[:2] and other.block_hashes[2] != alora.block_hashes[2]


def test_cache_salt_and_growth():
    tokens = list(range(1, 9))
    assert _request(tokens, salt="s").block_hashes[0] != _request(tokens).block_hashes[0]
    req = _request(tokens[:7])
    assert len(req.block_hashes) == 1
    req.append_output_token_id(8)
    assert req.block_hashes == _request(tokens).block_hashes
