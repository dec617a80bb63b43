"""The engine on a Granite Switch checkpoint against granite-switch's own HF model (the
oracle, in its own venv): per-token routing, greedy tokens (identical) and logprobs
(within 1e-4, fp32) for the base model, each aLoRA, the LoRA, two control tokens in one
prompt and `<|base_reset|>`; alone, chunked across steps, and all in one batch with
base requests and a runtime PEFT LoRA (whose reference is PEFT on the base)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.granite_switch.oracle_env import Assets, reference
from tests.utils.adapters import load_peft_model
from tests.utils.reference import hf_greedy
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

MAX_TOKENS = 10
ATOL = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def cases(assets: Assets) -> dict[str, list[int]]:
    """Prompt token ids per case, as the checkpoint's template renders them."""
    guardian, rewrite = assets.adapter("guardian"), assets.adapter("rewrite")
    base = assets.base_sample["prompt_token_ids"]
    two = list(guardian.sample["prompt_token_ids"])
    # The generation prompt's role marker becomes rewrite's control: guardian, then rewrite.
    two[len(two) - 1 - two[::-1].index(rewrite.substitute_token_id)] = rewrite.control_token_id
    citations = assets.adapter("citations").sample["prompt_token_ids"]
    reset = citations[:20] + [assets.reset_token_id] + citations[20:]  # LoRA until the reset, then base
    return {
        "base": base,
        "rewrite": rewrite.sample["prompt_token_ids"],
        "guardian": guardian.sample["prompt_token_ids"],
        "citations": citations,
        "guardian_then_rewrite": two,
        "citations_then_reset": reset,
    }


@pytest.fixture(scope="module")
def oracle(switch_assets):
    prompts = cases(switch_assets)
    outputs = reference(switch_assets.switch_dir, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS}
                                                   for p in prompts.values()])
    return prompts, dict(zip(prompts, outputs))


@pytest.fixture(scope="module")
def runtime_lora_reference(switch_assets):
    """PEFT on the base, with the base's vocabulary widened to the Switch checkpoint's (the
    control tokens' output rows as composed), so logprobs are over the same vocabulary."""
    from safetensors import safe_open

    model = load_peft_model(switch_assets.base_dir, switch_assets.runtime_adapter_dir)
    base = model.get_base_model()
    base.resize_token_embeddings(switch_assets.switch_vocab_size)
    with safe_open(f"{switch_assets.switch_dir}/model.safetensors", "pt") as f:
        head = f.get_tensor("lm_head.weight")
    with torch.no_grad():
        base.lm_head.weight[switch_assets.base_vocab_size:] = head[switch_assets.base_vocab_size:]
    prompt = switch_assets.base_sample["prompt_token_ids"]
    return prompt, hf_greedy(model, prompt, MAX_TOKENS)


def make_llm(assets: Assets, **kwargs) -> LLM:
    return LLM(assets.switch_dir, dtype="float32", max_model_len=256, enable_lora=True, max_loras=1,
               max_lora_rank=8, **kwargs)


@pytest.fixture(scope="module")
def llm(switch_assets):
    return make_llm(switch_assets)


def check(completion, ref_tokens, ref_logprobs):
    assert completion.token_ids == ref_tokens
    ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < ATOL


class RoutingRecorder:
    """Records the engine's per-token adapter mapping (slot + 1 = adapter index) per step."""

    def __init__(self, llm: LLM):
        self.punica = llm.llm_engine.engine_core.runner.lora_manager.punica
        self.steps: list[np.ndarray] = []
        self._update = self.punica.update

    def __enter__(self):
        self.punica.update = lambda mapping: (self.steps.append(mapping.copy()), self._update(mapping))[1]
        return self

    def __exit__(self, *exc):
        self.punica.update = self._update

    def adapter_indices(self) -> list[int]:
        return (np.concatenate(self.steps) + 1).tolist()


def test_each_case_alone_matches_oracle_tokens_logprobs_and_routing(llm, oracle):
    prompts, refs = oracle
    for name, prompt in prompts.items():
        with RoutingRecorder(llm) as recorder:
            out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
        ref = refs[name]
        check(out.outputs[0], ref["token_ids"], ref["logprobs"])
        # Computed tokens: from the prefix-cache hit to all but the last sampled token.
        routed = ref["adapter_indices"][out.num_cached_tokens : len(prompt) + MAX_TOKENS - 1]
        assert recorder.adapter_indices() == routed, name


def test_routing_carries_across_chunked_prefill_steps(switch_assets, oracle):
    prompts, refs = oracle
    llm = make_llm(switch_assets, max_num_batched_tokens=7, enable_prefix_caching=False)
    for name in ("guardian_then_rewrite", "citations_then_reset"):
        with RoutingRecorder(llm) as recorder:
            out = llm.generate([{"prompt_token_ids": prompts[name]}], PARAMS, use_tqdm=False)[0]
        check(out.outputs[0], refs[name]["token_ids"], refs[name]["logprobs"])
        assert len(recorder.steps) > MAX_TOKENS  # the prompt took several steps
        assert recorder.adapter_indices() == refs[name]["adapter_indices"][: len(prompts[name]) + MAX_TOKENS - 1]


def test_one_batch_mixing_every_case_base_requests_and_a_runtime_lora(llm, switch_assets, oracle,
                                                                      runtime_lora_reference):
    prompts, refs = oracle
    runtime_prompt, (runtime_tokens, runtime_logprobs) = runtime_lora_reference
    runtime = LoRARequest("runtime", 1, switch_assets.runtime_adapter_dir)
    names = list(prompts) + ["base"]  # a second base request
    batch = [{"prompt_token_ids": prompts[n]} for n in names] + [{"prompt_token_ids": runtime_prompt}]
    loras = [None] * len(names) + [runtime]
    outputs = llm.generate(batch, PARAMS, lora_request=loras, use_tqdm=False)
    for name, out in zip(names, outputs):
        check(out.outputs[0], refs[name]["token_ids"], refs[name]["logprobs"])
    check(outputs[-1].outputs[0], runtime_tokens, runtime_logprobs)
    assert outputs[-1].outputs[0].token_ids != refs["base"]["token_ids"]  # the runtime LoRA did something


def test_every_embedded_adapter_changes_the_output(oracle):
    _, refs = oracle
    base = refs["base"]["token_ids"]
    for name in ("rewrite", "guardian", "citations"):
        assert refs[name]["token_ids"] != base or refs[name]["logprobs"] != refs["base"]["logprobs"]
