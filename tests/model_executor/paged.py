"""Test helper: drive a model step by step over a paged KV cache, building
`AttentionMetadata` by hand (what the model runner does in the engine).

Blocks are handed out from a shuffled pool that never includes block 0, so block
tables are non-contiguous and non-sequential, and a kernel that ignores the block
table (or reads block 0, the "unused" id) gets wrong keys. Caches start filled with
large random values rather than zeros for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.attention.metadata import AttentionMetadata


@dataclass
class SeqChunk:
    block_ids: list[int]  # the sequence's block table (covers num_computed + num_new positions)
    num_computed: int  # tokens of this sequence already in the KV cache
    num_new: int  # tokens computed in this step


def build_attn_metadata(chunks: list[SeqChunk], block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step; decodes (num_new == 1) must come first."""
    is_decode = [c.num_new == 1 for c in chunks]
    num_decodes = sum(is_decode)
    assert is_decode == [True] * num_decodes + [False] * (len(chunks) - num_decodes), "decodes must come first"
    positions, slots = [], []
    for c in chunks:
        assert len(c.block_ids) * block_size >= c.num_computed + c.num_new, "block table too short"
        pos = torch.arange(c.num_computed, c.num_computed + c.num_new)
        table = torch.tensor(c.block_ids, dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    query_lens = torch.tensor([c.num_new for c in chunks], dtype=torch.int32)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor([c.num_computed + c.num_new for c in chunks], dtype=torch.int32)
    width = max(len(c.block_ids) for c in chunks)
    block_table = torch.zeros(len(chunks), width, dtype=torch.int32)  # unused entries are 0
    for i, c in enumerate(chunks):
        block_table[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=int(query_lens.sum()),
        num_decodes=num_decodes,
        slot_mapping=torch.cat(slots),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens.clone(),
    )
    return meta, torch.cat(positions)


class PagedRunner:
    """Runs `model` over sequences of known token ids, a chunk at a time, keeping
    each sequence's block table and computed length like the engine would."""

    def __init__(self, model, num_layers: int, num_kv_heads: int, head_size: int,
                 block_size: int = 4, num_blocks: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen) * 100
            for _ in range(num_layers)
        ]
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, work: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`work`: (sequence id, its next token ids) in batch order. Returns fp32 logits
        [num_new, vocab] per sequence."""
        chunks = []
        for seq_id, tokens in work:
            table = self.block_tables.setdefault(seq_id, [])
            done = self.num_computed.get(seq_id, 0)
            while len(table) * self.block_size < done + len(tokens):
                table.append(self.free_blocks.pop())
            chunks.append(SeqChunk(list(table), done, len(tokens)))
        meta, positions = build_attn_metadata(chunks, self.block_size)
        input_ids = torch.cat([tokens for _, tokens in work])
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for (seq_id, tokens), chunk in zip(work, chunks):
            out[seq_id] = logits[start : start + len(tokens)]
            start += len(tokens)
            self.num_computed[seq_id] = chunk.num_computed + chunk.num_new
        return out
