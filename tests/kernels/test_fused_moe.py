"""The MoE op against transformers' own routers and experts (the oracles), fp32 CPU:
every routing variant, expert grouping with experts that get no tokens, and the
refusal of unknown routing."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from vllm.model_executor.layers.fused_moe import MoEOptions, fused_experts_torch, select_experts

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 32, 48, 6, 2, 37


def _router_case(router_cls, config):
    torch.manual_seed(0)
    router = router_cls(config)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(TOKENS, HIDDEN)
    _, ref_weights, ref_ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    return logits, ref_weights, ref_ids


ROUTERS = {
    "mixtral": (MixtralTopKRouter, MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                 num_experts_per_tok=TOP_K), "softmax_topk", True),
    "qwen3_norm": (Qwen3MoeTopKRouter, Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS,
                                                      num_experts_per_tok=TOP_K, norm_topk_prob=True),
                   "softmax_topk", True),
    "qwen3_plain": (Qwen3MoeTopKRouter, Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS,
                                                       num_experts_per_tok=TOP_K, norm_topk_prob=False),
                    "softmax_topk", False),
    "granitemoe": (GraniteMoeTopKRouter, GraniteMoeConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                          num_experts_per_tok=TOP_K), "topk_softmax", False),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_select_experts_matches_transformers_router(name):
    router_cls, config, scoring, renormalize = ROUTERS[name]
    logits, ref_weights, ref_ids = _router_case(router_cls, config)
    weights, ids = select_experts(logits, TOP_K, scoring, renormalize)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), atol=1e-6, rtol=0)


def test_fused_experts_matches_transformers_experts():
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    experts = MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.2)
        experts.down_proj.normal_(std=0.2)
    x = torch.randn(TOKENS, HIDDEN)
    weights = torch.softmax(torch.randn(TOKENS, TOP_K), -1)
    # Experts 0 and 5 get no tokens: their runs are empty.
    ids = torch.stack([torch.randint(1, 5, (TOKENS,)), torch.randint(1, 5, (TOKENS,))], 1)
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], ids[:, 0] % 4 + 1, ids[:, 1])
    with torch.no_grad():
        ref = experts(x, ids, weights)
    out = fused_experts_torch(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_fused_experts_single_token_and_bf16():
    torch.manual_seed(1)
    w13, w2 = torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.2, torch.randn(EXPERTS, HIDDEN, INTER) * 0.2
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = select_experts(torch.randn(TOKENS, EXPERTS), TOP_K, "softmax_topk", True)
    full = fused_experts_torch(x, w13, w2, weights, ids)
    # A decode step of one token computes the same row as the whole batch.
    one = fused_experts_torch(x[5:6], w13, w2, weights[5:6], ids[5:6])
    torch.testing.assert_close(one, full[5:6], atol=1e-5, rtol=0)
    low = fused_experts_torch(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), full, atol=0.1, rtol=0.05)


def test_unknown_routing_and_bad_top_k_are_refused():
    with pytest.raises(ValueError, match="sigmoid.*supported: softmax_topk, topk_softmax"):
        MoEOptions(num_experts=4, top_k=2, intermediate_size=8, scoring="sigmoid")
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        MoEOptions(num_experts=4, top_k=5, intermediate_size=8)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (37, 6, 2), (20, 3, 3)])
def test_triton_experts_match_torch(tokens, experts, top_k):
    """The Triton grouped matmul (interpreter on CPU) against the torch path, including
    experts with no tokens and runs that are not multiples of the row block."""
    from vllm.model_executor.layers.fused_moe_triton import fused_experts_triton

    torch.manual_seed(tokens)
    hidden, inter = 24, 40  # not powers of two: masked edges in N and K
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.2, torch.randn(experts, hidden, inter) * 0.2
    x = torch.randn(tokens, hidden)
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, "softmax_topk", True)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=0)
