"""Per-step attention metadata: how the flat batch of tokens maps onto sequences and
onto the paged KV cache.

Layout contract (shared by the torch reference backend and the Triton kernels):

- The batch is a flat list of `num_actual_tokens` tokens. Sequence i owns tokens
  `query_start_loc[i]:query_start_loc[i+1]`; those are its newest tokens, at
  positions `seq_lens[i] - query_len_i ... seq_lens[i] - 1`.
- Decode sequences (query_len == 1) come first: sequences `0:num_decodes` are
  decodes, the rest are prefills (whole prompts, chunks, or prompts on top of a
  cached prefix).
- The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads,
  head_size]` (keys then values). Token t of the batch is stored at flat slot
  `slot_mapping[t] = block_id * block_size + offset`; -1 means "do not store".
- `block_table[i, j]` is the block holding positions `j*block_size ...
  (j+1)*block_size - 1` of sequence i; unused entries are 0 and never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    num_decodes: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, for code that loops over sequences without a device sync.
    query_start_loc_cpu: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_seqs] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
