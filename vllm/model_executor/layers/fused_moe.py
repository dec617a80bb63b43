"""Mixture-of-experts MLP: top-k routing and the fused-experts op.

`FusedMoE` replaces the decoder's dense MLP in an MoE layer. A linear router (`gate`,
weight `[num_experts, hidden]`) scores every expert per token; `select_experts` keeps
`top_k` of them with the config's weighting; `fused_experts` runs each token through
its experts and sums the outputs weighted by the routing weights.

Expert weights are stacked, one tensor per projection over all experts:
    w13 `[num_experts, 2 * intermediate, hidden]`: gate rows first, then up rows
    w2  `[num_experts, hidden, intermediate]`
and each expert computes `w2[e] @ act(w13_gate[e] @ x, w13_up[e] @ x)`, with
`act(gate, up) = silu(gate) * up` unless `MoEOptions.activation` says otherwise.
With `MoEOptions.expert_bias` (gpt-oss) each projection adds its expert's bias,
    w13 bias `[num_experts, 2 * intermediate]` (gate then up), w2 bias `[num_experts, hidden]`,
and with `router_bias` the router adds one too.

Expert activations (`ExpertActivation.kind`):
    "silu":           silu(gate) * up (Mixtral, Qwen3-MoE, GraniteMoe, OLMoE).
    "swiglu_clamped": gpt-oss: gate clamped to at most `limit`, up to [-limit, limit],
                      then gate * sigmoid(alpha * gate) * (up + 1).

Routing variants (as the HF configs spell them):
    "softmax_topk": softmax over all experts, keep the top k probabilities
                    (Mixtral, Qwen3-MoE, OLMoE); `renormalize` rescales the kept
                    ones to sum to 1 (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
    "topk_softmax": keep the top k logits, softmax over those alone (GraniteMoe).

Invariants:
- The torch path groups (token, expert) pairs by expert with one sort and runs one
  pair of matmuls per expert that has tokens: no per-token Python loop, and each
  expert's weights are read once per step.
- Options a family does not use change nothing: with no biases and the "silu"
  activation the computation is exactly the one before those options existed.
- Routing weights are computed in fp32 (as transformers does) and cast to the
  activation dtype only when they scale the expert outputs.
- Checkpoint layouts: per-expert tensors (`experts.N.w1/w2/w3`, or
  `experts.N.gate_proj/up_proj/down_proj`) load as slices of the stacked weights,
  and transformers 5's fused `experts.gate_up_proj` / `experts.down_proj` (and their
  `_bias` tensors) load whole; `rename_expert_weight` and `expert_packed_mapping` give
  the loader both. A family whose fused tensors are laid out otherwise (gpt-oss:
  transposed, gate/up interleaved) converts them before they reach the loader.
- No LoRA wrapper ever sees the experts (their modules have no `output_sizes`), so
  an adapter naming an expert projection finds no target and is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.linear import Linear, copy_checked
from vllm.platforms import use_triton_kernels

ROUTING_SCORES = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' gated activation `(gate, up) -> hidden` (see module docstring).
    `alpha` and `limit` are used by "swiglu_clamped" only."""

    kind: str = "silu"  # one of EXPERT_ACTIVATIONS
    alpha: float = 1.702  # sigmoid gain (gpt-oss `swiglu_alpha`)
    limit: float = 7.0  # clamp bound (gpt-oss `swiglu_limit`)

    def __post_init__(self):
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"Expert activation {self.kind!r} is not supported; supported: {', '.join(EXPERT_ACTIVATIONS)}."
            )
        if not self.limit > 0:
            raise ValueError(f"The expert activation's clamp limit must be positive, got {self.limit}.")

    def __call__(
        self,
        gate: torch.Tensor,  # [n, intermediate]
        up: torch.Tensor,  # [n, intermediate]
    ) -> torch.Tensor:  # [n, intermediate], a fresh tensor; gate and up are never written
        if self.kind == "silu":
            return F.silu(gate).mul_(up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)  # a fresh tensor: safe to add into
        return (gate * torch.sigmoid(gate * self.alpha)).mul_(up.add_(1.0))


SILU = ExpertActivation()


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: str = "softmax_topk"  # one of ROUTING_SCORES
    renormalize: bool = False  # "softmax_topk" only: kept weights rescaled to sum to 1
    router_bias: bool = False  # the router adds a bias to its logits (gpt-oss)
    expert_bias: bool = False  # both expert projections add a per-expert bias (gpt-oss)
    activation: ExpertActivation = SILU

    def __post_init__(self):
        if self.scoring not in ROUTING_SCORES:
            raise ValueError(f"MoE routing {self.scoring!r} is not supported; supported: {', '.join(ROUTING_SCORES)}.")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and the number of experts ({self.num_experts})."
            )


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    scoring: str,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids [num_tokens, top_k] int64
    logits = router_logits.float()
    if scoring == "softmax_topk":
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if scoring == "topk_softmax":
        top_logits, ids = logits.topk(top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), ids
    raise ValueError(f"MoE routing {scoring!r} is not supported; supported: {', '.join(ROUTING_SCORES)}.")


def fused_experts_torch(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    w13_bias: Optional[torch.Tensor] = None,  # [num_experts, 2 * intermediate]
    w2_bias: Optional[torch.Tensor] = None,  # [num_experts, hidden]
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Reference and CPU path: (token, expert) pairs sorted by expert, one matmul pair per
    expert over its contiguous run of pairs, outputs weighted and summed per token."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
    order = flat_ids.argsort(stable=True)  # pair indices grouped by expert
    token_of = order // top_k  # [num_pairs] the token each sorted pair belongs to
    # One host sync for the run lengths; the loop is over experts, never over tokens.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    xs = x.index_select(0, token_of)  # [num_pairs, hidden] tokens in expert order
    out = torch.empty_like(xs)  # [num_pairs, hidden]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        gate, up = F.linear(xs[start:end], w13[expert], b13).chunk(2, dim=-1)  # [count, intermediate] each
        out[start:end] = F.linear(activation(gate, up), w2[expert], b2)
        start = end
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    result = torch.zeros_like(x)
    return result.index_add_(0, token_of, out)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The dispatch point for the experts op (see `fused_experts_torch` for shapes): the
    Triton grouped matmul on CUDA, the torch path elsewhere."""
    if use_triton_kernels(x.device):
        from vllm.model_executor.layers.fused_moe_triton import fused_experts_triton

        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)


class StackedExpertWeight(nn.Module):
    """One projection of every expert, `weight [num_experts, num_slices * rows, cols]` and,
    with `bias`, `bias [num_experts, num_slices * rows]`.

    Loader shard ids number the per-expert slices: shard `e * num_slices + s` is slice
    `s` (e.g. gate 0, up 1) of expert `e`; shard None is the whole stacked tensor. The
    same numbering holds for the bias.
    No `output_sizes`: the LoRA manager never wraps it.
    """

    def __init__(self, num_experts: int, num_slices: int, rows: int, cols: int, dtype: torch.dtype,
                 device: torch.device, bias: bool = False):
        super().__init__()
        self.num_experts, self.num_slices, self.rows = num_experts, num_slices, rows
        self.weight = nn.Parameter(
            torch.empty(num_experts, num_slices * rows, cols, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(num_experts, num_slices * rows, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int]) -> None:
        if shard_id is None:
            copy_checked(param.data, loaded_weight)
            return
        expert, part = divmod(shard_id, self.num_slices)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range for a layer with {self.num_experts} experts")
        copy_checked(param.data[expert].narrow(0, part * self.rows, self.rows), loaded_weight)


class FusedExperts(nn.Module):
    def __init__(self, hidden: int, options: MoEOptions, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inter, bias = options.intermediate_size, options.expert_bias
        self.w13 = StackedExpertWeight(options.num_experts, 2, inter, hidden, dtype, device, bias)
        self.w2 = StackedExpertWeight(options.num_experts, 1, hidden, inter, dtype, device, bias)


class FusedMoE(nn.Module):
    """Router + experts: the MLP of an MoE decoder layer. `shared_mlp`, when given, is a
    dense MLP every token also runs through (shared experts), added to the experts' sum;
    being an ordinary dense MLP, it takes LoRA like any other."""

    def __init__(self, hidden: int, options: MoEOptions, dtype: torch.dtype, device: torch.device,
                 shared_mlp: Optional[nn.Module] = None):
        super().__init__()
        self.options = options
        self.gate = Linear(hidden, [options.num_experts], options.router_bias, dtype, device)
        self.experts = FusedExperts(hidden, options, dtype, device)
        self.shared_mlp = shared_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        router_logits = self.gate(x)  # [num_tokens, num_experts]
        weights, ids = select_experts(router_logits, self.options.top_k, self.options.scoring, self.options.renormalize)
        w13, w2 = self.experts.w13, self.experts.w2
        out = fused_experts(x, w13.weight, w2.weight, weights, ids, w13.bias, w2.bias, self.options.activation)
        if self.shared_mlp is not None:
            out.add_(self.shared_mlp(x))  # a fresh tensor: safe in place
        return out


def check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Only the 'silu' expert activation is supported, the config has hidden_act={act!r}.")


# Per-expert checkpoint spellings -> Mixtral's (w1 gate, w3 up, w2 down), which
# `expert_packed_mapping` lists; transformers 5's fused tensors -> our stacked weights.
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
_PER_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_FUSED = ((".experts.gate_up_proj", ".experts.w13.weight"), (".experts.down_proj", ".experts.w2.weight"),
          (".experts.gate_up_proj_bias", ".experts.w13.bias"), (".experts.down_proj_bias", ".experts.w2.bias"))


def rename_expert_weight(name: str) -> str:
    """A checkpoint expert tensor's name in the form the loader maps (others unchanged)."""
    name = _PER_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_PER_EXPERT_NAMES[m.group(2)]}.", name)
    for theirs, ours in _FUSED:
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def expert_packed_mapping(num_experts: int) -> dict[str, list[str]]:
    """`packed_modules_mapping` entries for the stacked expert weights: list index i is
    loader shard i (expert e's gate is 2e, its up 2e + 1; its down is e)."""
    return {
        "experts.w13": [f"experts.{e}.{w}" for e in range(num_experts) for w in ("w1", "w3")],
        "experts.w2": [f"experts.{e}.w2" for e in range(num_experts)],
    }
