"""`LLMEngine`: the synchronous engine API (vLLM's): add_request / step / abort.

It ties the processor (validation, tokenisation), the engine core and the output
processor together, and fans a request with `n > 1` out into n child requests
(ids `"{i}_{request_id}"`, seeds `seed + i`) whose outputs are merged back into one
`RequestOutput`. A request is validated completely before any child reaches the
core, so a rejected request leaves no trace.
"""

from __future__ import annotations

import time
from typing import Optional

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import EngineCore, EngineStats
from vllm.engine.detokenizer import IncrementalDetokenizer
from vllm.engine.output_processor import OutputProcessor, ParentState, SequenceState
from vllm.engine.processor import Processor
from vllm.inputs import PromptType
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestMetrics, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import generation_eos_token_ids, get_tokenizer, id_decoder
from vllm.v1.metrics.reader import Metric, metrics_from_stats

logger = init_logger(__name__)


def _producible_stop_ids(candidates: set[int], vocab_size: int) -> list[int]:
    """The EOS ids the model can produce: an id past its vocabulary (a generation config listing
    ids of a larger vocabulary, a tokenizer that appends its own EOS) can never be sampled, so it
    is dropped with a warning instead of refusing to start; none left is an error."""
    stop_ids = sorted(i for i in candidates if 0 <= i < vocab_size)
    if not stop_ids:
        raise ValueError(f"none of the EOS token ids {sorted(candidates)} (the tokenizer's and "
                         f"generation_config.json's) lies in the model's vocabulary [0, {vocab_size}); the model "
                         "could never end a sequence")
    if len(stop_ids) < len(candidates):
        logger.warning("EOS token ids %s lie outside the model's vocabulary of %d and are ignored: the model cannot "
                       "produce them", sorted(set(candidates) - set(stop_ids)), vocab_size)
    return stop_ids


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig):
        model_config = vllm_config.model_config
        self.tokenizer = get_tokenizer(model_config.tokenizer_dir, model_config.trust_remote_code,
                                       model_config.tokenizer_mode)
        from vllm.structured_output import StructuredOutputManager

        eos_ids = generation_eos_token_ids(model_config.model_dir)
        stop_ids = _producible_stop_ids(eos_ids | {self.tokenizer.eos_token_id} - {None}, model_config.vocab_size)
        self.eos_token_ids = frozenset(stop_ids)  # the tokenizer's EOS and the generation config's
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, model_config.vocab_size,
                                                                 stop_token_ids=stop_ids)
        self.engine_core = EngineCore(vllm_config, self.structured_output_manager)
        self.vllm_config = vllm_config
        self.model_config = model_config
        if model_config.sampling_defaults:
            logger.info("Default sampling parameters from the generation config (--generation-config vllm to "
                        "ignore): %s", model_config.sampling_defaults)
        self.processor = Processor(
            vllm_config,
            self.tokenizer,
            eos_ids,
            lora_adapters=self.engine_core.lora_adapters,
            structured_output_manager=self.structured_output_manager,
        )
        self.decode = id_decoder(self.tokenizer)
        self.output_processor = OutputProcessor(self.decode)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage: str = "llm") -> "LLMEngine":
        return cls(engine_args.create_engine_config(usage))

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> ParentState:
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        text, prompt_ids, salt = self.processor.tokenize_prompt(prompt)
        children, requests = [], []
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + i
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            requests.append(
                self.processor.make_request(child_id, prompt_ids, child_params, arrival_time, lora_request, salt,
                                            priority)
            )
            children.append(
                SequenceState(child_id, i, child_params, IncrementalDetokenizer(self.decode, prompt_ids, child_params))
            )
        parent = ParentState(
            request_id=request_id, prompt=text, prompt_token_ids=prompt_ids, params=params,
            lora_request=lora_request, children=children, metrics=RequestMetrics(arrival_time=arrival_time),
        )
        self.output_processor.add_request(parent)
        for request in requests:
            self.engine_core.add_request(request)
        return parent

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        results, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing done) while requests hold blocks."""
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's metric objects (`vllm.v1.metrics.reader`) from the current stats."""
        return metrics_from_stats(self.get_stats(), self.model_config.served_model_name)

    def start_profile(self) -> None:
        """Profile the following steps (needs VLLM_TORCH_PROFILER_DIR)."""
        self.engine_core.start_profile()

    def stop_profile(self) -> str:
        """End the profile and write its trace; returns the trace file's path."""
        return self.engine_core.stop_profile()

    # ------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and validate an adapter now (errors are ValueErrors naming it)."""
        adapters = self.engine_core.lora_adapters
        if adapters is None:
            raise ValueError("LoRA is not enabled; start the engine with enable_lora=True (--enable-lora).")
        adapters.get(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter for new requests. Requests still running keep the weights they were
        admitted with until they finish."""
        manager = self.engine_core.runner.lora_manager
        if manager is not None:
            manager.remove_adapter(lora_int_id)

    def is_alora(self, lora_request: LoRARequest) -> bool:
        adapters = self.engine_core.lora_adapters
        return adapters is not None and bool(adapters.get(lora_request).invocation_tokens)
