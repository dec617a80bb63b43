import pytest

from vllm import LLM


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256)
