"""Build the Granite Switch checkpoint that benchmarks/granite_switch.py times (oracle venv side).

    .venv-granite-switch/bin/python benchmarks/switch_compose.py OUT_DIR --hidden 576 --layers 30 ...

Runs inside the granite-switch venv (`bash tests/granite_switch/oracle/install.sh`), offline,
deterministically (everything seeded). Writes under OUT_DIR:

* `base/`: a GraniteForCausalLM with random weights of the given shape (SmolLM2-135M-like by
  default) and the code-built Granite-4-style tokenizer of the test oracle
  (tests/granite_switch/oracle/granite_tokenizer.py: ~520 tokens, so the LM head is tiny).
* `adapters/query_rewrite/`: a PEFT aLoRA whose invocation is the assistant header
  `<|start_of_role|>assistant<|end_of_role|>`; `adapters/citations/`: a plain PEFT LoRA. Both of
  rank `--rank` on all seven linear projections, A and B random and non-zero, written directly
  in PEFT's format (the composer does not import PEFT).
* `switch/`: both composed into one Switch checkpoint by the package's composer CLI module
  (through the oracle's `compose`, which seeds torch first; YAML manifest `{name: {path, type}}`).
* `bench_manifest.json` (written last: its presence means the build is complete): paths, the
  adapter names and kinds, the aLoRA's invocation ids, control ids and vocabulary sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE_DIR = os.path.join(REPO_ROOT, "tests", "granite_switch", "oracle")
# This folder holds benchmarks/granite_switch.py, which would shadow the granite_switch package;
# the repository root gives `benchmarks.common` instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path[:0] = [ORACLE_DIR, REPO_ROOT]

import torch  # noqa: E402
from transformers import GraniteConfig, GraniteForCausalLM  # noqa: E402

from benchmarks.common import write_random_adapter  # noqa: E402

from build_assets import ALL_LINEAR, ROLE_INVOCATION, compose, seed_all  # noqa: E402
from granite_tokenizer import build_tokenizer  # noqa: E402

ALORA, LORA = "query_rewrite", "citations"


def build_base(out: str, args) -> tuple[object, GraniteConfig]:
    tok = build_tokenizer()
    config = GraniteConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0 / (args.hidden // args.heads),
        logits_scaling=4.0, rope_theta=100000.0,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    seed_all(0)
    dtype = getattr(torch, args.dtype)
    model = GraniteForCausalLM(config).to(dtype).eval()
    model.config.dtype = dtype
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return tok, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-positions", type=int, default=32768)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    root = os.path.abspath(args.out)
    os.makedirs(root, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    base_dir = os.path.join(root, "base")
    tok, config = build_base(base_dir, args)
    invocation = tok.encode(ROLE_INVOCATION, add_special_tokens=False)
    paths = {ALORA: os.path.join(root, "adapters", ALORA), LORA: os.path.join(root, "adapters", LORA)}
    dtype = getattr(torch, args.dtype)
    # Rank-r adapters on every linear projection, A ~ N(0, 1/in), B ~ N(0, 0.02^2).
    write_random_adapter(paths[ALORA], config, args.rank, ALL_LINEAR, 101, invocation, dtype, b_std=0.02)
    write_random_adapter(paths[LORA], config, args.rank, ALL_LINEAR, 102, None, dtype, b_std=0.02)
    manifest_yaml = os.path.join(root, "adapters", "compose.yaml")
    with open(manifest_yaml, "w") as f:
        f.write(f"{ALORA}:\n  path: {json.dumps(paths[ALORA])}\n  type: alora\n"
                f"{LORA}:\n  path: {json.dumps(paths[LORA])}\n  type: lora\n")
    switch_dir = os.path.join(root, "switch")
    compose(base_dir, manifest_yaml, switch_dir, os.path.join(root, "compose.log"))
    with open(os.path.join(switch_dir, "config.json")) as f:
        cfg = json.load(f)
    offset = len(cfg["adapter_token_ids"]) - len(cfg["adapter_names"])  # 1 with <|base_reset|>
    control = {name: cfg["adapter_token_ids"][offset + i] for i, name in enumerate(cfg["adapter_names"])}
    manifest = {
        "root": root, "base_dir": base_dir, "switch_dir": switch_dir,
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "rank")},
        "dtype": args.dtype, "alora": ALORA, "lora": LORA, "adapter_paths": paths,
        "alora_invocation_tokens": invocation, "control_token_ids": control,
        "base_vocab_size": len(tok), "switch_vocab_size": cfg["vocab_size"],
    }
    with open(os.path.join(root, "bench_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (torch loaded); files are closed
