"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it
every step with that step's inputs written in place into persistent buffers.

A replay runs the captured kernels on the captured tensors: nothing a step builds fresh
reaches them. So everything a decode forward reads lives in `DecodeGraphBuffers`, allocated
once, and each step writes its inputs there (token ids, positions, slot mapping, block table,
sequence lengths, query starts; the per-token adapter mapping lives in the LoRA manager's
persistent buffer, see `PunicaWrapper.update(..., graph_size=...)`).

Invariants:
- Only pure-decode steps (one token per sequence, no prompt logprobs) of at most the largest
  captured size replay; the batch is padded to the next captured size. Pad rows read one
  cached position through block 0 (harmless: nothing is written, slot -1) and use no adapter
  (mapping -1); their outputs are dropped before sampling.
- Host-side values the forward reads at capture (num_decodes, num_actual_tokens, the padded
  size) are functions of the captured size only; per-step host values are never read by a
  replay. The LoRA ops of a graph step always run over the whole padded mapping, so a graph
  captured while no adapter was active still applies the adapters of a later step.
- A capture that fails (an op that syncs with the host or changes shape with the data, such as
  the MoE expert grouping) logs one warning and leaves the engine eager; `enforce_eager`
  never captures.

`CudaGraphBackend` records real graphs; `EagerReplayBackend` re-runs the recorded callable over
the same buffers and metadata objects, which is how CPU tests check that a replay reads this
step's values and not the captured ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from vllm.attention.metadata import AttentionMetadata
from vllm.logger import init_logger
from vllm.worker.input_batch import StepInputs

logger = init_logger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (at most 512), as vLLM does."""
    limit = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_tokens: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size that holds the batch; None if none does."""
    return next((s for s in sizes if s >= num_tokens), None)


class DecodeGraphBuffers:
    """The persistent inputs of a decode forward, one row per sequence (= per token)."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device):
        self.max_size = max_size
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # one token each
        self.block_table = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Host copies for backends that loop on the host (the torch reference); a CUDA replay never reads them.
        self.seq_lens_cpu = torch.ones(max_size, dtype=torch.int32)
        self.query_start_loc_cpu = torch.arange(max_size + 1, dtype=torch.int32)

    def write(self, inputs: StepInputs, size: int) -> None:
        """This step's decode inputs into rows 0:n, pad rows n:size reset, all in place."""
        n = int(inputs.input_ids.shape[0])
        if n > size or size > self.max_size or inputs.num_decodes != n:
            raise ValueError(f"A graph step takes {size} decode rows at most, got {n} tokens "
                             f"({inputs.num_decodes} decodes).")
        self.input_ids[:n].copy_(torch.from_numpy(inputs.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(inputs.slot_mapping), non_blocking=True)
        seq_lens = torch.from_numpy(inputs.seq_lens)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens_cpu[:n].copy_(seq_lens)
        width = inputs.block_table.shape[1]
        self.block_table[:n, :width].copy_(torch.from_numpy(inputs.block_table), non_blocking=True)
        self.block_table[:n, width:].zero_()
        self.reset_rows(n, size)

    def reset_rows(self, start: int, end: int) -> None:
        """Rows start:end become pad rows (no token, no store, one position through block 0)."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)  # never stored
        self.seq_lens[start:end].fill_(1)  # one position through block 0: finite, and dropped
        self.seq_lens_cpu[start:end].fill_(1)
        self.block_table[start:end].zero_()

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        """Views of the buffers for a `size`-row graph; built once at capture, valid for every replay."""
        return AttentionMetadata(
            num_actual_tokens=size,
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
            max_seq_len=max_model_len,  # an upper bound: the real lengths change every step
            query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=self.seq_lens_cpu[:size],
        )


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None], meta: AttentionMetadata) -> Graph: ...


@dataclass
class _CudaGraph:
    graph: "torch.cuda.CUDAGraph"

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """Real capture: one warm-up run (Triton compiles, allocator settles), then the capture
    into a memory pool shared by every size."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn: Callable[[], None], meta: AttentionMetadata) -> Graph:
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self.pool = graph.pool()
        return _CudaGraph(graph)


@dataclass
class _EagerReplay:
    fn: Callable[[], None]
    meta: AttentionMetadata

    def replay(self) -> None:
        # Python-side memos of a backend (torch_ref caches gather indices per step) do not exist
        # in a real replay; everything else is the captured objects, as in a graph.
        self.meta.__dict__.pop("_torch_ref_cache", None)
        self.fn()


class EagerReplayBackend:
    """A stand-in for graphs on the CPU: "replay" calls the captured closure again, over the
    captured buffers and metadata objects."""

    def capture(self, fn: Callable[[], None], meta: AttentionMetadata) -> Graph:
        fn()
        return _EagerReplay(fn, meta)


class CudaGraphRunner:
    """Captures and replays decode forwards of one model over one set of KV caches."""

    def __init__(self, model: torch.nn.Module, hidden_size: int, dtype: torch.dtype, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device, punica=None,
                 backend: Optional[GraphBackend] = None):
        self.model = model
        self.punica = punica  # the LoRA manager's PunicaWrapper, or None
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeGraphBuffers(self.sizes[-1], -(-max_model_len // block_size), device)
        self.hidden = torch.zeros(self.sizes[-1], hidden_size, dtype=dtype, device=device)
        self.backend = backend or CudaGraphBackend(device)
        self.graphs: dict[int, Graph] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.graphs)

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Every size, largest first (its pool then holds the smaller ones). On any failure:
        a warning, no graphs, eager steps."""
        try:
            for size in reversed(self.sizes):
                self.graphs[size] = self._capture_one(size, kv_caches)
        except Exception as e:  # noqa: BLE001 - any capture failure means "run eagerly"
            self.graphs.clear()
            logger.warning("CUDA graph capture failed, running every step eagerly: %s: %s", type(e).__name__, e)

    def _capture_one(self, size: int, kv_caches: list[torch.Tensor]) -> Graph:
        self.buffers.reset_rows(0, size)
        if self.punica is not None:
            self.punica.update(np.full(0, -1, dtype=np.int32), graph_size=size)
        meta = self.buffers.metadata(size, self.max_model_len)
        input_ids, positions, hidden = self.buffers.input_ids[:size], self.buffers.positions[:size], self.hidden[:size]

        def forward() -> None:
            hidden.copy_(self.model(input_ids, positions, kv_caches, meta))

        return self.backend.capture(forward, meta)

    def can_run(self, inputs: StepInputs, needs_prompt_logprobs: bool) -> bool:
        n = int(inputs.input_ids.shape[0])
        return (self.enabled and not needs_prompt_logprobs and inputs.num_decodes == n
                and padded_size(n, self.sizes) is not None)

    def run(self, inputs: StepInputs) -> torch.Tensor:  # [num_tokens, hidden], a view of the output buffer
        n = int(inputs.input_ids.shape[0])
        size = padded_size(n, self.sizes)
        self.buffers.write(inputs, size)
        if self.punica is not None:
            self.punica.update(inputs.token_lora_mapping, graph_size=size)
        self.graphs[size].replay()
        return self.hidden[:n]
