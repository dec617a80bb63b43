"""The shared server of the entrypoint tests: the tiny llama with every test adapter
preloaded (two plain LoRAs, two aLoRAs) and runtime adapter loading enabled, started once
per session and driven through the official `openai` client."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.utils import RemoteOpenAIServer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512  # the tiny llama's max_position_embeddings: long streams for disconnect tests


@pytest.fixture(scope="session")
def server_args(adapters) -> list[str]:
    answerability = json.dumps({"name": "alora_answerability", "path": adapters["alora_answerability"],
                                "base_model_name": MODEL})
    return [
        "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--enable-lora",
        "--enable-activated-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "8",
        "--lora-modules", f"lora_qkv={adapters['lora_qkv']}", f"lora_all={adapters['lora_all']}",
        f"alora_certainty={adapters['alora_certainty']}",
        "--lora-modules", answerability,
    ]


@pytest.fixture(scope="session")
def server(llama_dir, server_args, tmp_path_factory):
    # Runtime loads may read the test adapters and every test's temporary folder.
    args = [*server_args, "--allowed-lora-root", str(tmp_path_factory.getbasetemp())]
    with RemoteOpenAIServer(llama_dir, args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as remote:
        yield remote


@pytest.fixture
def client(server):
    return server.client()
