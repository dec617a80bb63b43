"""Build the Granite Switch test assets, offline and deterministically (oracle venv side).

Run as `.venv-granite-switch/bin/python build_assets.py OUT_DIR`. Owns everything
written under OUT_DIR:

* `base/`: a tiny float32 GraniteForCausalLM (untied, non-unit Granite multipliers)
  with the code-built tokenizer of `granite_tokenizer.py` (`vocab_size == len(tok)`).
* `adapters/<name>/`: PEFT adapters with random non-zero `lora_B`: two aLoRAs (one
  invoked by the assistant role header, one by text inside a user message), one
  plain LoRA (all composed), and `runtime_lora`, a LoRA that is NOT composed.
* `switch/`: the composed checkpoint, produced by the package's composer CLI module
  (`granite_switch.composer.compose_granite_switch`, run here via `runpy` after
  seeding torch's global generator) with `--create-ioyaml --base-reset-token`.
* `manifest.json`: paths, adapter metadata, control/substitute/reset ids and one
  rendered sample prompt per adapter (see `write_manifest`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import runpy
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoTokenizer, GraniteConfig, GraniteForCausalLM  # noqa: E402

from granite_tokenizer import END, START, build_tokenizer  # noqa: E402  (puts the repository root on sys.path)

from tests.utils.adapters import ALL_LINEAR, ATTN_QKV as QKV  # noqa: E402
from tests.utils.checkpoints import TINY_SHAPE  # noqa: E402
USER_INVOCATION = "<guardian>"  # appears inside a user message
ROLE_INVOCATION = f"{START}assistant{END}"  # the assistant generation prompt

# name -> (technology, rank, alpha, targets, invocation text or None, composed?)
ADAPTERS = {
    "rewrite": ("alora", 4, 8, QKV, ROLE_INVOCATION, True),
    "guardian": ("alora", 8, 16, ALL_LINEAR, USER_INVOCATION, True),
    "citations": ("lora", 4, 8, ALL_LINEAR, None, True),
    "runtime_lora": ("lora", 8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], None, False),
}

SAMPLE_SYSTEM = "You are a helpful assistant."
SAMPLE_USER = "What is the capital of France?"
SAMPLE_GUARDIAN_USER = "Is this request safe?\n<guardian> Please check the last message."


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_base(out: str) -> tuple[GraniteForCausalLM, object]:
    tok = build_tokenizer()
    config = GraniteConfig(
        **TINY_SHAPE,
        vocab_size=len(tok),
        tie_word_embeddings=False,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=0.25,  # divides: logits x4, so greedy margins are clear
        rope_theta=10000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    seed_all(0)
    model = GraniteForCausalLM(config).to(torch.float32).eval()
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return model, tok


def build_adapter(base_dir: str, out: str, rank: int, alpha: int, targets: list[str],
                  invocation_ids: list[int] | None, seed: int) -> None:
    seed_all(seed)
    model = GraniteForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM",
                        alora_invocation_tokens=invocation_ids)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # default init gives B ~ U(+-1/sqrt(r)); make it clearly non-zero
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    peft_model.save_pretrained(out)


def compose(base_dir: str, manifest_yaml: str, out: str, log_path: str) -> None:
    """Run the composer CLI module in-process after seeding torch (it draws the new
    control-token embedding rows from the global generator)."""
    argv = [
        "granite_switch.composer.compose_granite_switch",
        "--base-model", base_dir, "--adapters", manifest_yaml, "--output", out,
        "--create-ioyaml", "--base-reset-token",
    ]
    seed_all(1234)
    old_argv = sys.argv
    sys.argv = argv
    code = 0
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the module ends with exit(main())
        code = exc.code or 0
    finally:
        sys.argv = old_argv
    if code != 0 or not os.path.exists(os.path.join(out, "config.json")):
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"composer failed (exit {code}); log tail:\n{tail}")


def render(tok, messages, adapter_name=None, add_generation_prompt=True) -> list[int]:
    kwargs = {} if adapter_name is None else {"adapter_name": adapter_name}
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                  **kwargs)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def write_manifest(root: str, base_tok, invocations: dict[str, list[int] | None]) -> dict:
    switch_dir = os.path.join(root, "switch")
    with open(os.path.join(switch_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(switch_dir, "adapter_index.json")) as f:
        index = {a["adapter_name"]: a for a in json.load(f)["adapters"]}
    tok = AutoTokenizer.from_pretrained(switch_dir)
    names = list(cfg["adapter_names"])
    has_reset = len(cfg["adapter_token_ids"]) == len(names) + 1
    offset = 1 if has_reset else 0
    adapters = []
    for i, name in enumerate(names):
        tech, rank, alpha, targets, _, _ = ADAPTERS[name]
        user = SAMPLE_GUARDIAN_USER if name == "guardian" else SAMPLE_USER
        msgs = [{"role": "system", "content": SAMPLE_SYSTEM}, {"role": "user", "content": user}]
        ids = render(tok, msgs, adapter_name=name)
        adapters.append({
            "name": name, "index": i + 1, "technology": tech, "rank": rank, "alpha": alpha,
            "target_modules": targets, "path": os.path.join(root, "adapters", name),
            "control_token": f"<|{name}|>", "control_token_id": cfg["adapter_token_ids"][offset + i],
            "substitute_token_id": cfg["adapter_substitute_token_ids"][offset + i],
            "alora_invocation_tokens": invocations[name],
            "adapter_index_entry": index.get(name, {}).get("adapter_index"),
            "sample": {"messages": msgs, "prompt_token_ids": ids,
                       "text": tok.decode(ids, skip_special_tokens=False),
                       "base_prompt_token_ids": render(tok, msgs)},
        })
    runtime = [
        {"name": n, "technology": t, "rank": r, "alpha": a, "target_modules": tg,
         "path": os.path.join(root, "adapters", n)}
        for n, (t, r, a, tg, _, composed) in ADAPTERS.items() if not composed
    ]
    base_msgs = [{"role": "user", "content": SAMPLE_USER}]
    manifest = {
        "root": root,
        "base_dir": os.path.join(root, "base"),
        "switch_dir": switch_dir,
        "base_num_hidden_layers": 2,
        "base_vocab_size": len(base_tok),
        "switch_vocab_size": cfg["vocab_size"],
        "num_adapters": cfg["num_adapters"],
        "adapter_names": names,
        "adapters": adapters,
        "runtime_adapters": runtime,
        "adapter_token_ids": cfg["adapter_token_ids"],
        "adapter_substitute_token_ids": cfg["adapter_substitute_token_ids"],
        "reset_token": "<|base_reset|>" if has_reset else None,
        "reset_token_id": cfg["adapter_token_ids"][0] if has_reset else None,
        "reset_substitute_token_id": cfg["adapter_substitute_token_ids"][0] if has_reset else None,
        "eos_token_id": tok.eos_token_id,
        "base_sample": {"messages": base_msgs, "prompt_token_ids": render(tok, base_msgs)},
    }
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(root: str) -> None:
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    base_dir = os.path.join(root, "base")
    _, base_tok = build_base(base_dir)
    invocations: dict[str, list[int] | None] = {}
    lines = []
    for seed, (name, (tech, rank, alpha, targets, inv_text, composed)) in enumerate(ADAPTERS.items()):
        inv = base_tok.encode(inv_text, add_special_tokens=False) if inv_text else None
        invocations[name] = inv
        path = os.path.join(root, "adapters", name)
        build_adapter(base_dir, path, rank, alpha, targets, inv, seed=100 + seed)
        if composed:
            lines.append(f"{name}:\n  path: {json.dumps(path)}\n  type: {tech}\n")
    manifest_yaml = os.path.join(root, "adapters", "compose.yaml")
    with open(manifest_yaml, "w") as f:
        f.write("".join(lines))
    compose(base_dir, manifest_yaml, os.path.join(root, "switch"), os.path.join(root, "compose.log"))
    write_manifest(root, base_tok, invocations)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_assets.py OUT_DIR")
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (~2 s with torch loaded); files are closed
