import pytest

from tests.conftest import INVOCATION, INVOCATION_2
from tests.utils.adapters import load_peft_model
from tests.utils.reference import hf_greedy
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def lora_requests(adapters):
    names = ["lora_qkv", "lora_all", "alora_certainty", "alora_answerability"]
    return {name: LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def lora_llm(llama_dir):
    return LLM(llama_dir, max_model_len=512, enable_lora=True, enable_activated_lora=True, max_loras=4,
               max_lora_rank=8)


@pytest.fixture(scope="module")
def invocations(tokenizer):
    return {
        "alora_certainty": tokenizer.encode(INVOCATION),
        "alora_answerability": tokenizer.encode(INVOCATION_2),
    }


@pytest.fixture(scope="module")
def peft_reference(llama_dir, adapters):
    """name -> function(prompt_ids) -> (tokens, logprobs) from PEFT (None: base model)."""
    models = {}

    def run(name, prompt_ids):
        if name not in models:
            models[name] = load_peft_model(llama_dir, adapters[name]) if name else None
            if name is None:
                from tests.utils.checkpoints import load_hf_model

                models[name] = load_hf_model(llama_dir)
        return hf_greedy(models[name], prompt_ids, MAX_NEW)

    return run


def generate_one(llm, prompt_ids, lora_request=None, params=GREEDY):
    return llm.generate([{"prompt_token_ids": prompt_ids}], params, lora_request=lora_request, use_tqdm=False)[0]


def check_against_reference(out, ref) -> None:
    """Greedy tokens identical and logprobs within 1e-4 of a (tokens, logprobs) reference."""
    tokens, logprobs = ref
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-4
