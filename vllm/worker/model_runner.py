"""`ModelRunner`: runs one scheduled step on the device.

It keeps per-request state between steps (the scheduler sends only changes),
builds the step's flat inputs and attention metadata, activates the step's
adapters, runs the model, and samples. Invariants:
- batch order is decodes (one token) first, as the attention metadata requires;
- only rows that sample (a request whose computed tokens reach its known tokens) or
  need prompt logprobs go through the LM head;
- a seeded request's generator lives until the request finishes, so preemption
  does not restart its random stream.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from vllm import fault_injection
from vllm.attention.metadata import AttentionMetadata
from vllm.config import VllmConfig
from vllm.core.kv_cache_utils import cdiv
from vllm.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from vllm.logger import init_logger
from vllm.model_executor.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from vllm.model_executor.model_loader import get_model
from vllm.platforms import use_onednn_linear
from vllm.worker import huge_pages
from vllm.worker.input_batch import CachedRequestState, StepInputs, build_step_inputs
from vllm.worker.kv_cache import allocate_kv_caches, zero_blocks
from vllm.worker.sampling_inputs import build_sampling_metadata


logger = init_logger(__name__)

# oneDNN packs weights for a typical row count; any row count works with the packing.
_ONEDNN_BATCH_HINT = 64


def _model_tensors(model: torch.nn.Module):
    """Every tensor the model's forward reads: parameters, buffers and quantized weights."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        for q in getattr(module, "quantized_weights", list)():
            yield from q.tensors()


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig):
        self.config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.block_size = self.cache_config.block_size
        self.device = vllm_config.device_config.device
        if vllm_config.device_config.cpu_threads is not None:
            torch.set_num_threads(vllm_config.device_config.cpu_threads)  # process-wide: this is the engine's process
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(self.device)
        self.model: Optional[torch.nn.Module] = None
        self.lora_manager = None
        self.router = None  # ControlTokenRouter for checkpoints with embedded adapters
        self.kv_caches: list[torch.Tensor] = []
        self.num_model_steps = 0  # steps that ran scheduled requests (fault injection counts them)
        self.graphs = None  # CudaGraphRunner once captured (CUDA, not enforce_eager)
        fault_injection.check_spec()  # a bad VLLM_FAULT_INJECTION fails the launch, not a request

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device)
        self._wrap_lora()
        if use_onednn_linear(self.device, self.model_config.dtype):
            for module in self.model.modules():
                if hasattr(module, "pack_for_onednn"):  # Linear, LMHead
                    module.pack_for_onednn(batch_hint=_ONEDNN_BATCH_HINT)
        if self.device.type == "cpu":
            moved = huge_pages.move_to_huge_pages(_model_tensors(self.model))
            if moved:
                logger.info("Weights (%.0f MiB) on transparent huge pages", moved / 2**20)

    def _wrap_lora(self) -> None:
        switch = getattr(self.model_config.hf_config, "switch", None)
        if switch is not None:
            from vllm.lora.control_tokens import ControlTokenRouter

            self.router = ControlTokenRouter(self.model_config.vocab_size, switch.control_to_adapter())
        if self.config.lora_config is not None or switch is not None:
            from vllm.lora.model_manager import LoRAModelManager

            self.lora_manager = LoRAModelManager(
                self.model,
                self.config.lora_config,
                max_num_tokens=self.config.scheduler_config.max_num_batched_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
                tokenizer_dir=self.model_config.tokenizer_dir,
            )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model_config, self.cache_config, num_blocks, self.device)
        if self.device.type == "cuda" and not self.model_config.enforce_eager:
            self.capture_cuda_graphs()

    @torch.inference_mode()
    def capture_cuda_graphs(self, backend=None) -> None:
        """Decode graphs over the allocated KV caches (vllm/worker/cuda_graph.py). `backend`:
        tests pass EagerReplayBackend to run the graph path on the CPU."""
        from vllm.worker.cuda_graph import CudaGraphRunner

        punica = self.lora_manager.punica if self.lora_manager is not None else None
        self.graphs = CudaGraphRunner(
            self.model, self.model_config.hf_config.hidden_size, self.model_config.dtype,
            self.config.scheduler_config.max_num_seqs, self.model_config.max_model_len, self.block_size, self.device,
            punica=punica, backend=backend,
        )
        self.graphs.capture(self.kv_caches)

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """Peak device memory of a forward pass over a full token budget (CUDA only)."""
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        num_blocks = cdiv(num_tokens, self.block_size)
        caches = allocate_kv_caches(self.model_config, self.cache_config, num_blocks, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        inputs = StepInputs(
            req_ids=["profile"], input_ids=np.zeros(num_tokens, dtype=np.int64),
            positions=np.arange(num_tokens) % self.model_config.max_model_len,
            slot_mapping=np.arange(num_tokens, dtype=np.int64), query_start_loc=np.array([0, num_tokens], dtype=np.int32),
            seq_lens=np.array([num_tokens], dtype=np.int32), block_table=np.arange(num_blocks, dtype=np.int32)[None],
            num_decodes=0, token_lora_mapping=None, sample_rows=[0], logits_indices=np.array([num_tokens - 1]),
            prompt_logprob_spans={},
        )
        hidden = self.model(*self._device_inputs(inputs), caches, self._attention_metadata(inputs))
        self.model.compute_logits(hidden[-256:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    # -------------------------------------------------------------------- step
    def apply_driver_samples(self, samples: dict[str, list[int]]) -> None:
        """Tensor-parallel ranks other than 0: replace this rank's samples of the previous step
        with rank 0's (req_id -> the tokens it sampled), which are the step's."""
        for req_id, tokens in samples.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.token_ids[-len(tokens):] = tokens

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        zero_blocks(self.kv_caches, sched.new_block_ids)
        if sched.is_empty:
            return ModelRunnerOutput([], [])
        self.num_model_steps += 1
        fault_injection.on_model_step(self.num_model_steps)
        lora_slots = None
        if self.lora_manager is not None:
            lora_slots = self.lora_manager.activate(
                [(self.requests[r].lora_request, self.requests[r].lora_weights) for r in sched.num_scheduled_tokens])
        order = self._batch_order(sched, lora_slots)
        states = [self.requests[r] for r in order]
        inputs = build_step_inputs(states, [sched.num_scheduled_tokens[r] for r in order], self.block_size, lora_slots,
                                   self.router)
        hidden = self._forward(inputs)

        sampled_lists: list[list[int]] = [[] for _ in states]
        output = ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled_lists)
        if inputs.sample_rows:
            self._sample(states, inputs, hidden, sched, output)
        for i, (start, count) in inputs.prompt_logprob_spans.items():
            output.prompt_logprobs[states[i].req_id] = self._prompt_logprobs(states[i], hidden[start : start + count])
        return output

    def _forward(self, inputs: StepInputs) -> torch.Tensor:  # [num_tokens, hidden]
        if self.graphs is not None and self.graphs.can_run(inputs, bool(inputs.prompt_logprob_spans)):
            return self.graphs.run(inputs)  # updates the adapter mapping buffer itself
        if self.lora_manager is not None:
            self.lora_manager.punica.update(inputs.token_lora_mapping)
        input_ids, positions = self._device_inputs(inputs)
        return self.model(input_ids, positions, self.kv_caches, self._attention_metadata(inputs))

    def _batch_order(self, sched: SchedulerOutput, lora_slots: Optional[dict[int, int]]) -> list[str]:
        """Decodes first (the attention contract), then by adapter slot, so each
        adapter's tokens are contiguous runs; stable, so FCFS order holds otherwise."""
        def key(req_id: str) -> tuple[bool, int]:
            lora = self.requests[req_id].lora_request
            slot = lora_slots[lora.lora_int_id] if lora is not None and lora_slots else -1
            return sched.num_scheduled_tokens[req_id] != 1, slot

        return sorted(sched.num_scheduled_tokens, key=key)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            seed = new.sampling_params.seed
            if seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator(device=self.device).manual_seed(seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_request=new.lora_request,
                lora_weights=new.lora_weights,
                alora_invocation_start=new.alora_invocation_start,
                generator=self.generators.get(new.req_id),
            )
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU step input on the model's device: on the CPU the tensor itself, no `.to` call (each
        costs a few microseconds of a decode step, with caches cold)."""
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return self._on_device(torch.from_numpy(array))

    def _device_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self._to_device(inputs.input_ids), self._to_device(inputs.positions)

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        query_start_loc = torch.from_numpy(inputs.query_start_loc)
        seq_lens = torch.from_numpy(inputs.seq_lens)
        only_decodes = inputs.num_decodes == len(inputs.seq_lens)  # one token each: no pass over the starts
        return AttentionMetadata(
            num_actual_tokens=int(inputs.input_ids.shape[0]),
            num_decodes=inputs.num_decodes,
            slot_mapping=self._to_device(inputs.slot_mapping),
            query_start_loc=self._on_device(query_start_loc),
            seq_lens=self._on_device(seq_lens),
            block_table=self._to_device(inputs.block_table),
            max_query_len=1 if only_decodes else int(np.diff(inputs.query_start_loc).max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )

    def _sample(self, states, inputs: StepInputs, hidden: torch.Tensor, sched: SchedulerOutput, output) -> None:
        rows = [states[i] for i in inputs.sample_rows]
        if len(rows) == hidden.shape[0]:  # every token samples (decodes): the indices are 0 .. n - 1
            sampled_hidden = hidden
        else:
            sampled_hidden = hidden.index_select(0, self._to_device(inputs.logits_indices))
        logits = self.model.compute_logits(sampled_hidden)  # [num_rows, vocab]
        if sched.grammar_bitmask is not None:
            from vllm.structured_output import apply_bitmask

            # apply_bitmask pairs bitmask row j with logits row j.
            pairs = [(j, sched.grammar_rows[s.req_id]) for j, s in enumerate(rows) if s.req_id in sched.grammar_rows]
            bitmask = torch.full((len(rows), sched.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
            bitmask[[j for j, _ in pairs]] = sched.grammar_bitmask[[b for _, b in pairs]]
            apply_bitmask(logits, bitmask, [j for j, _ in pairs])
        meta: SamplingMetadata = build_sampling_metadata(rows, self.model_config.vocab_size, self.device)
        sampled, logprobs = self.sampler(logits, meta)
        for j, token_id in enumerate(sampled.tolist()):
            state = rows[j]
            state.token_ids.append(token_id)
            output.sampled_token_ids[inputs.sample_rows[j]].append(token_id)
            if logprobs is not None and state.sampling_params.logprobs is not None:
                entry = logprobs[j]
                k = state.sampling_params.logprobs
                output.logprobs[state.req_id] = [
                    LogprobsEntry(entry.token_ids[: k + 1], entry.logprobs[: k + 1], entry.rank)
                ]

    def _prompt_logprobs(self, state: CachedRequestState, hidden: torch.Tensor) -> list[LogprobsEntry]:
        """Logprobs of prompt tokens p+1 for the positions p computed this step."""
        first = state.num_computed_tokens
        targets = torch.tensor(state.token_ids[first + 1 : first + 1 + hidden.shape[0]], device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        return gather_logprobs(logprobs, targets, state.sampling_params.prompt_logprobs)
