"""`LLM`: the offline API (vLLM's): `generate`, `chat` and `beam_search` over a batch of
prompts, plus `get_metrics`, `start_profile`/`stop_profile` and `from_engine_args`.

Outputs come back in input order. Each call runs the engine until its own requests
finish; a prompt that fails validation raises ValueError before anything runs. Per-prompt
options (`sampling_params`, `lora_request`, `priority`) are one value for every prompt or
a list with one per prompt.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from vllm.beam_search import BeamSearchInstance, BeamSearchOutput, run_beam_search
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.chat_utils import apply_chat_template, check_adapter_name, load_chat_template
from vllm.inputs import PromptType, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from vllm.v1.metrics.reader import Metric


class LLM:
    def __init__(self, model: str, tokenizer: Optional[str] = None, **kwargs: Any):
        if kwargs.get("seed") is None:
            kwargs.pop("seed", None)  # vLLM's LLM takes seed=None; ours defaults to 0
        try:
            engine_args = EngineArgs(model=model, tokenizer=tokenizer, **kwargs)
        except TypeError as e:
            raise TypeError(f"Unknown LLM option: {e}") from e
        self.llm_engine = LLMEngine.from_engine_args(engine_args, usage="llm")
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        return cls(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. between benchmark runs); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (`vllm.v1.metrics.reader` objects, the server's names)."""
        return self.llm_engine.get_metrics()

    def start_profile(self) -> None:
        """Profile the engine steps of the following calls (torch profiler; needs VLLM_TORCH_PROFILER_DIR)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """End the profile; its trace is then in VLLM_TORCH_PROFILER_DIR."""
        self.llm_engine.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation config (`--generation-config`)."""
        return SamplingParams(**self.llm_engine.model_config.sampling_defaults)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
        priority: Union[int, Sequence[int], None] = None,
    ) -> list[RequestOutput]:
        """`priority` (lower runs earlier) needs scheduling_policy="priority"."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a prompt (a string, {{'prompt': str}} or {{'prompt_token_ids': "
                             f"list[int]}}) or a list of them, got {type(prompts).__name__} (decode bytes to str).")
        prompts = list(prompts)
        params = self._per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts),
                                  "sampling_params")
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        priorities = self._per_prompt(0 if priority is None else priority, len(prompts), "priority")
        return self._run(prompts, params, loras, priorities, use_tqdm)

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        documents: Optional[list[dict]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        priority: Union[int, Sequence[int], None] = None,
    ) -> list[RequestOutput]:
        """`chat_template` None: the LLM's (`LLM(chat_template=...)`), else the tokenizer's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        check_adapter_name(self.llm_engine.model_config, chat_template_kwargs)
        template = load_chat_template(chat_template) or self.llm_engine.model_config.chat_template
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = apply_chat_template(tokenizer, conversation, template, add_generation_prompt,
                                       continue_final_message, tools, documents, chat_template_kwargs)
            # The template already placed any special tokens.
            prompts.append(TokensPrompt(prompt=text, prompt_token_ids=tokenizer.encode(text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best sequences of each prompt, best first (vllm/beam_search.py);
        at most `concurrency_limit` prompts are searched together."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        instances = [BeamSearchInstance(engine.processor.tokenize_prompt(prompt)[1], lora)
                     for prompt, lora in zip(prompts, loras)]
        chunk = concurrency_limit or max(len(instances), 1)
        outputs: list[BeamSearchOutput] = []
        for start in tqdm(range(0, len(instances), chunk), desc="Beam search", disable=not use_tqdm):
            outputs += run_beam_search(self._beam_step, instances[start:start + chunk], params, engine.eos_token_ids,
                                       engine.model_config.max_model_len, self.get_tokenizer().decode)
        return outputs

    def _beam_step(self, prompts, params, loras) -> list[RequestOutput]:
        return self._run(prompts, [params] * len(prompts), loras, [0] * len(prompts), use_tqdm=False)

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts.")
            return list(value)
        return [value] * n

    def _run(self, prompts, params, loras, priorities, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, lora, priority in zip(prompts, params, loras, priorities):
                p = p.clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, p, lora_request=lora, priority=priority)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Optional[RequestOutput]] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        done = 0
        try:
            while done < len(ids):
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        done += 1
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return results
