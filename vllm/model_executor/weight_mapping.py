"""Filling a model's parameters from a stream of checkpoint tensors `(name, tensor)`.

HF checkpoints store `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`) as
separate tensors; our models fuse them (`qkv_proj`, `gate_up_proj`). A model's
`packed_modules_mapping` ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}) says
which checkpoint module becomes which slice: the i-th listed name is shard i.

Invariants:
- Each tensor is copied into its parameter as it arrives and then dropped, so peak
  memory is the model plus one checkpoint tensor.
- Loading is all-or-error: a checkpoint tensor with no parameter, a shape mismatch,
  or a parameter (or fused slice) the checkpoint never provided raises ValueError
  naming the tensor, instead of leaving uninitialised (`torch.empty`) memory in use.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from vllm.model_executor.layers.linear import default_weight_loader

# Buffers some checkpoints carry that we recompute from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: Mapping[str, Sequence[str]],
    ignored_names: Sequence[str] = (),
) -> None:
    """Copy every checkpoint tensor into `model`'s parameters (see module docstring).
    `ignored_names`: exact checkpoint names to skip (e.g. `lm_head.weight` when tied)."""
    params = dict(model.named_parameters())
    # (checkpoint fragment, fused fragment, shard id); dots on both sides so that
    # ".up_proj." never matches inside ".gate_up_proj.".
    stacked = [
        (f".{sub}.", f".{packed}.", shard)
        for packed, subs in packed_modules_mapping.items()
        for shard, sub in enumerate(subs)
    ]
    loaded: dict[str, set[Optional[int]]] = {}
    with torch.no_grad():
        for name, tensor in weights:
            if name in ignored_names or name.endswith(IGNORED_SUFFIXES):
                continue
            target, shard_id = name, None
            for sub, packed, shard in stacked:
                if sub in name:
                    target, shard_id = name.replace(sub, packed), shard
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"Checkpoint tensor {name!r} has no matching model parameter"
                    f"{f' (looked for {target!r})' if target != name else ''}; "
                    f"the checkpoint does not fit {type(model).__name__}."
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"Cannot load checkpoint tensor {name!r} into {target!r}: {e}") from e
            loaded.setdefault(target, set()).add(shard_id)
    _check_complete(params, loaded, packed_modules_mapping)


def _check_complete(
    params: Mapping[str, nn.Parameter],
    loaded: Mapping[str, set[Optional[int]]],
    packed_modules_mapping: Mapping[str, Sequence[str]],
) -> None:
    missing = []
    for name in params:
        subs = next((s for packed, s in packed_modules_mapping.items() if f".{packed}." in name), None)
        got = loaded.get(name, set())
        if subs is None or None in got:  # a plain parameter, or a fused one stored fused
            if not got:
                missing.append(name)
            continue
        absent = [sub for shard, sub in enumerate(subs) if shard not in got]
        if absent:
            missing.append(f"{name} (slices {', '.join(absent)})")
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"The checkpoint is missing {len(missing)} model parameter(s): {shown}.")
