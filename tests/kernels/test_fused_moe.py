"""The MoE op against transformers' own routers and experts (the oracles), fp32 CPU:
every routing variant, expert grouping with experts that get no tokens, the refusal
of unknown routing, and gpt-oss's options (expert biases, clamped SwiGLU) against a
per-token loop written from their definition, on the torch and Triton paths."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from vllm.model_executor.layers.fused_moe import (
    SILU,
    ExpertActivation,
    MoEOptions,
    fused_experts_torch,
    select_experts,
)

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


# gpt-oss's options of the op: expert biases, the clamped SwiGLU, a router with a bias.

def _per_token_reference(x, w13, w2, weights, ids, b13, b2, act: ExpertActivation):
    """The experts op written from its definition, one (token, expert) pair at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t] + b13[e]  # [2 * inter]: gate then up
            gate, up = h[:inter], h[inter:]
            if act.kind == "silu":
                a = gate * torch.sigmoid(gate) * up
            else:
                g = torch.minimum(gate, torch.tensor(act.limit))
                u = torch.clamp(up, -act.limit, act.limit)
                a = g * torch.sigmoid(act.alpha * g) * (u + 1)
            out[t] += weights[t, k] * (w2[e] @ a + b2[e])
    return out


def _biased_case(tokens, experts, top_k, hidden=24, inter=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.4
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    b13 = torch.randn(experts, 2 * inter, generator=gen)
    b2 = torch.randn(experts, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, "topk_softmax", False)
    return x, w13, w2, b13, b2, weights, ids


# A low limit so the clamp binds on a large share of gates and ups (both sides).
CLAMPED = ExpertActivation("swiglu_clamped", alpha=1.702, limit=1.0)


@pytest.mark.parametrize("act", [CLAMPED, SILU], ids=["swiglu_clamped", "silu"])
def test_biases_and_activation_match_per_token_loop(act):
    x, w13, w2, b13, b2, weights, ids = _biased_case(29, 5, 2)
    gate_up = torch.einsum("eoh,th->teo", w13, x)
    assert (gate_up.abs() > CLAMPED.limit).float().mean() > 0.2  # the clamp matters in this case
    ref = _per_token_reference(x, w13, w2, weights, ids, b13, b2, act)
    out = fused_experts_torch(x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_without_options_the_op_is_unchanged():
    """The defaults (no biases, silu) are the op the other families have always run."""
    x, w13, w2, _, _, weights, ids = _biased_case(17, 4, 2)
    zeros = torch.zeros(4, 2 * w2.shape[2]), torch.zeros(4, w2.shape[1])
    ref = _per_token_reference(x, w13, w2, weights, ids, *zeros, SILU)
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=0)
    assert torch.equal(fused_experts_torch(x, w13, w2, weights, ids),
                       fused_experts_torch(x, w13, w2, weights, ids, None, None, SILU))


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (37, 6, 2), (20, 3, 3)])
def test_triton_experts_with_biases_and_clamped_swiglu(tokens, experts, top_k):
    """The Triton path applies the biases and the activation around its grouped matmuls:
    same result as the per-token loop, experts without tokens and padded runs included."""
    from vllm.model_executor.layers.fused_moe_triton import fused_experts_triton

    x, w13, w2, b13, b2, weights, ids = _biased_case(tokens, experts, top_k, seed=tokens)
    ref = _per_token_reference(x, w13, w2, weights, ids, b13, b2, CLAMPED)
    out = fused_experts_triton(x, w13, w2, weights, ids, b13, b2, CLAMPED)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_gpt_oss_router_and_experts_match_transformers():
    """transformers' GptOssTopKRouter (bias, top-k logits then softmax) and GptOssExperts
    (transposed, gate/up interleaved, biases, clamped SwiGLU) against our op, with the
    weights converted the way the gpt-oss loader converts them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from vllm.model_executor.models.gpt_oss import convert_expert_tensor

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, swiglu_limit=1.5)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    router, experts = GptOssTopKRouter(config), GptOssExperts(config)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.normal_(std=0.3)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        _, ref_weights, ref_ids = router(x)
        ref = experts(x, ref_ids, ref_weights)
    weights, ids = select_experts(torch.nn.functional.linear(x, router.weight, router.bias), TOP_K, "topk_softmax",
                                  False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=0)
    tensors = {n: convert_expert_tensor(f"mlp.experts.{n}", p.data) for n, p in experts.named_parameters()}
    act = ExpertActivation("swiglu_clamped", alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    out = fused_experts_torch(x, tensors["gate_up_proj"], tensors["down_proj"], weights, ids,
                              tensors["gate_up_proj_bias"], tensors["down_proj_bias"], act)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_unknown_expert_activation_is_refused():
    with pytest.raises(ValueError, match="'gelu' is not supported; supported: silu, swiglu_clamped"):
        ExpertActivation("gelu")
    with pytest.raises(ValueError, match="clamp limit must be positive, got 0"):
        ExpertActivation("swiglu_clamped", limit=0)
