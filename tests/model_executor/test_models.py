"""Every architecture against the transformers model (fp32, CPU): whole-prompt
prefill, chunked prefill over a cached prefix, batched decodes, and a decode mixed
with a prefill, all over a paged KV cache with shuffled block ids."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.checkpoints import ARCHITECTURES, load_hf_model
from vllm.model_executor.model_loader import get_model

ATOL = 1e-4
LEN_A, LEN_B, NUM_DECODES = 37, 13, 4  # prompt lengths; A spans many blocks of 4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, checkpoints):
    """(runner factory, tokens per sequence, HF logits at every position per sequence)."""
    path = checkpoints[request.param]
    config = model_config_for(path)
    model = get_model(config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    tokens = {
        "a": torch.randint(0, config.vocab_size, (LEN_A + NUM_DECODES,), generator=gen),
        "b": torch.randint(0, config.vocab_size, (LEN_B + NUM_DECODES,), generator=gen),
    }
    hf = load_hf_model(path)
    with torch.inference_mode():
        ref = {seq: hf(ids[None]).logits[0].float() for seq, ids in tokens.items()}

    def new_runner() -> PagedRunner:
        return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_size)

    return new_runner, tokens, ref


def check(logits: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], spans: dict[str, tuple[int, int]]):
    for seq, (start, end) in spans.items():
        assert logits[seq].dtype == torch.float32
        torch.testing.assert_close(logits[seq], ref[seq][start:end], atol=ATOL, rtol=0)


def test_prefill_two_sequences_in_one_batch(case):
    new_runner, tokens, ref = case
    runner = new_runner()
    out = runner.step([("a", tokens["a"][:LEN_A]), ("b", tokens["b"][:LEN_B])])
    check(out, ref, {"a": (0, LEN_A), "b": (0, LEN_B)})


def test_chunked_prefill_on_cached_prefix(case):
    new_runner, tokens, ref = case
    runner = new_runner()
    # Chunk boundaries (10, 30) fall inside blocks of 4, so a block is shared by two steps.
    out = runner.step([("a", tokens["a"][:10]), ("b", tokens["b"][:LEN_B])])
    check(out, ref, {"a": (0, 10), "b": (0, LEN_B)})
    out = runner.step([("a", tokens["a"][10:30])])
    check(out, ref, {"a": (10, 30)})
    out = runner.step([("a", tokens["a"][30:LEN_A])])
    check(out, ref, {"a": (30, LEN_A)})


def test_batched_decodes(case):
    new_runner, tokens, ref = case
    runner = new_runner()
    runner.step([("a", tokens["a"][:LEN_A]), ("b", tokens["b"][:LEN_B])])
    for i in range(NUM_DECODES):
        pa, pb = LEN_A + i, LEN_B + i
        out = runner.step([("b", tokens["b"][pb : pb + 1]), ("a", tokens["a"][pa : pa + 1])])
        check(out, ref, {"a": (pa, pa + 1), "b": (pb, pb + 1)})


def test_decode_mixed_with_prefill(case):
    new_runner, tokens, ref = case
    runner = new_runner()
    runner.step([("a", tokens["a"][:LEN_A])])
    # One decode (first, per the metadata contract) and one whole prompt in the same batch.
    out = runner.step([("a", tokens["a"][LEN_A : LEN_A + 1]), ("b", tokens["b"][:LEN_B])])
    check(out, ref, {"a": (LEN_A, LEN_A + 1), "b": (0, LEN_B)})
    # Then a decode next to a prefill chunk on top of a cached prefix.
    out = runner.step([("b", tokens["b"][LEN_B : LEN_B + 1]), ("a", tokens["a"][LEN_A + 1 : LEN_A + 4])])
    check(out, ref, {"b": (LEN_B, LEN_B + 1), "a": (LEN_A + 1, LEN_A + 4)})
