"""RoPE scaling variants against transformers: inverse frequencies and attention
factors against `ROPE_INIT_FUNCTIONS` for configs spelled the transformers 5 way
(`rope_parameters`) and the 4.x way (`rope_scaling` with `type`, top-level
`rope_theta` / `original_max_position_embeddings` / `partial_rotary_factor`), and a tiny
Llama per rope type end to end over a paged KV cache against the transformers model,
at positions past the original context."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.checkpoints import TINY_SHAPE
from tests.utils.reference import hf_incremental_logits
from vllm.model_executor.layers.rotary import (
    RotaryEmbedding,
    attention_factor_of,
    compute_inv_freq,
    position_inv_freq,
    rope_parameters,
)
from vllm.model_executor.model_loader import get_model

HEAD = 16  # TINY_SHAPE: hidden 64 / 4 heads
MAX_POS = 64
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.3, 1.5, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]}
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                              "attention_factor": 1.25},
    "longrope": LONGROPE,
    "longrope_factor": {**LONGROPE, "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def hf_config(rope: dict, **extra) -> LlamaConfig:
    return LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": MAX_POS}, vocab_size=64,
                       rope_parameters={**rope, "rope_theta": 5000.0}, **extra)


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_attention_factor_match_transformers(name):
    config = hf_config(ROPES[name])
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    init = ROPE_INIT_FUNCTIONS[rope_type]
    # seq_len as transformers passes it: None at init, the new length when it recomputes.
    for seq_len in (None, 16, 17, 64, 100):
        theirs, their_factor = init(config, None, seq_len=seq_len)
        assert torch.equal(compute_inv_freq(HEAD, params, seq_len), theirs), seq_len
        assert attention_factor_of(params) == their_factor


@pytest.mark.parametrize("name", ["yarn_mscale", "longrope"])
def test_legacy_spelling_matches_transformers_5(name):
    """4.x: `rope_scaling` with `type`, `rope_theta` and (Phi-3) the original context at
    the top level, where it wins over the dict's value."""
    rope = dict(ROPES[name])
    orig = rope.pop("original_max_position_embeddings")
    in_dict = {"type": rope.pop("rope_type"), **rope, "original_max_position_embeddings": 999}
    legacy = types.SimpleNamespace(rope_scaling=in_dict, rope_theta=5000.0, max_position_embeddings=MAX_POS,
                                   original_max_position_embeddings=orig)
    ours, theirs = rope_parameters(legacy), rope_parameters(hf_config(ROPES[name]))
    assert torch.equal(compute_inv_freq(HEAD, ours), compute_inv_freq(HEAD, theirs))
    assert attention_factor_of(ours) == attention_factor_of(theirs)
    if name == "longrope":  # early Phi-3-128k configs call it "su"
        legacy.rope_scaling["type"] = "su"
        assert torch.equal(compute_inv_freq(HEAD, rope_parameters(legacy), 100), compute_inv_freq(HEAD, theirs, 100))


def test_partial_rotary_matches_transformers():
    config = hf_config(LONGROPE | {"short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}, partial_rotary_factor=0.25)
    params = rope_parameters(config)
    assert params["partial_rotary_factor"] == 0.25
    theirs, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    assert torch.equal(compute_inv_freq(4, params), theirs)
    rope = RotaryEmbedding(HEAD, MAX_POS, params, torch.float32, torch.device("cpu"))
    q, k = torch.randn(3, 4, HEAD), torch.randn(3, 2, HEAD)
    out_q, out_k = rope(torch.tensor([0, 5, 40]), q, k)
    assert torch.equal(out_q[..., 4:], q[..., 4:]) and torch.equal(out_k[..., 4:], k[..., 4:])
    # Position 0: no rotation, only longrope's attention factor on the rotated part.
    torch.testing.assert_close(out_q[0, :, :4], q[0, :, :4] * attention_factor_of(params))
    assert not torch.allclose(out_q[1:, :, :4], q[1:, :, :4])


def test_position_indexed_frequencies():
    """dynamic: position p uses the frequencies of a sequence of length max(p + 1, max
    positions); longrope: short factors below the original context, long ones from it."""
    params = rope_parameters(hf_config(ROPES["dynamic"]))
    per_pos = position_inv_freq(HEAD, params, 3 * MAX_POS)
    assert torch.equal(per_pos[MAX_POS - 1], compute_inv_freq(HEAD, {**params, "rope_type": "default"}))
    for p in (MAX_POS, 100, 3 * MAX_POS - 1):
        torch.testing.assert_close(per_pos[p], compute_inv_freq(HEAD, params, p + 1), rtol=1e-6, atol=0)
    params = rope_parameters(hf_config(LONGROPE))
    per_pos = position_inv_freq(HEAD, params, MAX_POS)
    assert torch.equal(per_pos[15], compute_inv_freq(HEAD, params, 16))
    assert torch.equal(per_pos[16], compute_inv_freq(HEAD, params, 17))


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "ntk", "factor": 2.0}, "'ntk' is not supported. Supported: default, linear, dynamic, yarn"),
    ({"type": "dynamic"}, "'dynamic' needs factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "'longrope' needs long_factor"),
])
def test_bad_rope_configs_are_refused(bad, match):
    config = types.SimpleNamespace(rope_scaling=bad, rope_theta=1e4, max_position_embeddings=MAX_POS)
    with pytest.raises(ValueError, match=match):
        rope_parameters(config)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.2 gives a rotary dimension of 3"):
        RotaryEmbedding(HEAD, MAX_POS, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2,
                                        "max_position_embeddings": MAX_POS}, torch.float32, torch.device("cpu"))


# Position-indexed types (dynamic, longrope) match transformers' generation for a prompt
# within the original context and generation past it (see vllm/model_executor/layers/rotary.py).
E2E = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn_mscale", "longrope": "longrope", "llama3": "llama3"}
PROMPT = {"dynamic": MAX_POS - 4, "longrope": 12}  # others: a prompt past the original context of 16


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 64, (MAX_POS + 8,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("rope_type", list(E2E))
def test_llama_matches_transformers(rope_type, tokens, tmp_path):
    config = hf_config(ROPES[E2E[rope_type]], bos_token_id=0, eos_token_id=0,
                       architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    prompt_len = PROMPT.get(rope_type, 40)
    total = prompt_len + 8
    ids = tokens[:total]
    ref = hf_incremental_logits(hf, ids, prompt_len)  # [total, vocab]

    model_config = model_config_for(str(tmp_path), max_model_len=MAX_POS)
    model = get_model(model_config, torch.device("cpu"))
    runner = PagedRunner(model, model_config.num_layers, model_config.num_kv_heads, model_config.head_size)
    split = prompt_len // 2  # chunked prefill
    logits = [runner.step([("s", ids[:split])])["s"], runner.step([("s", ids[split:prompt_len])])["s"]]
    logits += [runner.step([("s", ids[p : p + 1])])["s"] for p in range(prompt_len, total)]
    logits = torch.cat(logits)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
