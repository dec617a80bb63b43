"""Granite Switch: time to first token of an embedded adapter after a base turn, on the CPU.

    python -m benchmarks.granite_switch                      # SmolLM2-135M-like shape, 2k-token conversations
    python -m benchmarks.granite_switch --dtype bfloat16 --trials 3
    python -m benchmarks.granite_switch --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 \
        --conversation-len 64 --trials 1                     # quick look

The checkpoint: a Granite base of random weights (default hidden 576, 30 layers, 9 heads, 3 KV
heads, intermediate 1536: SmolLM2-135M's linears), the code-built Granite-4-style tokenizer of
the test oracle (~520 tokens, so the LM head is tiny), a PEFT aLoRA invoked by the assistant
header and a plain PEFT LoRA (rank `--rank` on all seven projections, random non-zero A and B),
composed into one Switch checkpoint by granite-switch's own composer in its venv
(benchmarks/switch_compose.py; `bash tests/granite_switch/oracle/install.sh` creates the venv).
The build is cached under `--work-dir`, one folder per shape, rank and dtype.

One engine (`enable_lora=True`) and, for each trial, a fresh conversation of random text whose
base render is `--conversation-len` tokens (its own system message, then `--turns` user messages
with an assistant answer between each two; no block is shared between conversations):

1. the base turn: `llm.chat(conversation)` (one token; fills the KV cache);
2. in an order that rotates between trials, each one request of one token:
   - Switch aLoRA: `chat_template_kwargs={"adapter_name": <aLoRA>}`; the template puts its
     control token in place of the generation prompt's `<|start_of_role|>`;
   - PEFT aLoRA: the same aLoRA weights as a `LoRARequest` on the same model; its prompt is the
     base render (which ends with the invocation) and has no control token;
   - Switch LoRA: `adapter_name=<LoRA>`; its control token is the sequence's first token.

Both aLoRAs should reuse every full block before the invocation (`num_cached_tokens`) and
compute the rest; the LoRA reuses nothing. TTFT is `RequestOutput.metrics.time_to_first_token`;
each kind's median over trials is given against the floor of the tokens it computes
(benchmarks.common.Floor). Goals: Switch aLoRA within 10% of the PEFT aLoRA, and the Switch
LoRA at least 30x above the Switch aLoRA.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile

import torch

from benchmarks.common import (Floor, default_device, linear_shapes, load_line, machine_load, print_table,
                               save_json)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDER = os.path.join(REPO, "benchmarks", "switch_compose.py")
BUILD_VERSION = 2  # bump when switch_compose.py changes what it writes
KINDS = ("switch_alora", "peft_alora", "switch_lora")
LABELS = {"base_turn": "base turn (conversation)", "switch_alora": "Switch aLoRA (control token)",
          "peft_alora": "PEFT aLoRA (LoRARequest)", "switch_lora": "Switch LoRA (control token at 0)"}


# ------------------------------------------------------------------ the checkpoint (built in the oracle venv)
def build_key(args) -> str:
    return (f"h{args.hidden}-l{args.layers}-a{args.heads}-kv{args.kv_heads}-i{args.intermediate}-r{args.rank}-"
            f"{args.dtype}-v{BUILD_VERSION}")


def ensure_checkpoint(args) -> dict:
    """The build's bench_manifest.json, building it first unless this shape is cached."""
    from tests.granite_switch.oracle_env import venv_python

    root = os.path.join(os.path.abspath(args.work_dir), build_key(args))
    manifest = os.path.join(root, "bench_manifest.json")
    if args.rebuild or not os.path.exists(manifest):
        shutil.rmtree(root, ignore_errors=True)
        cmd = [venv_python(), BUILDER, root, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--intermediate", str(args.intermediate),
               "--rank", str(args.rank), "--dtype", args.dtype]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # keep the system packages' paths out
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        print(f"composing the Switch checkpoint in {root} ...", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(manifest):
            raise RuntimeError(f"switch_compose.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(manifest) as f:
        return json.load(f)


# ------------------------------------------------------------------ conversations
def render_ids(tokenizer, messages: list[dict], adapter_name: str | None = None) -> list[int]:
    """Token ids exactly as `LLM.chat` renders them."""
    from vllm.entrypoints.chat_utils import apply_chat_template

    kwargs = {"adapter_name": adapter_name} if adapter_name else None
    text = apply_chat_template(tokenizer, messages, None, True, False, None, None, kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def conversation(tokenizer, base_vocab: int, length: int, seed: int, turns: int = 3) -> list[dict]:
    """A system message and `turns` user messages with an assistant answer between each two, all
    random text, whose base render with the generation prompt is `length` tokens (or just under,
    when re-tokenizing cannot hit it). Its own system text keeps a conversation from sharing its
    first block with another one (the template's default system message would)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(base_vocab) if i not in special and "\ufffd" not in tokenizer.decode([i])]
    draw = lambda n: [rng.choice(ordinary) for _ in range(n)]  # noqa: E731
    roles = ["system"] + ["user", "assistant"] * (turns - 1) + ["user"]
    overhead = len(render_ids(tokenizer, [{"role": r, "content": ""} for r in roles]))
    share = (length - overhead) // len(roles)
    if share < 1:
        raise ValueError(f"{length} tokens cannot hold {turns} user turns (the markup alone is {overhead} tokens)")
    messages = [{"role": r, "content": tokenizer.decode(draw(share))} for r in roles[:-1]]
    pool = draw(2 * length)
    n, best = share, None
    for _ in range(40):  # the last message's length, until the render is exactly `length`
        n = min(max(n, 1), len(pool))
        last = {"role": roles[-1], "content": tokenizer.decode(pool[:n])}
        got = len(render_ids(tokenizer, messages + [last]))
        if got <= length and (best is None or got > best[0]):
            best = (got, last)
        if got == length:
            break
        n += length - got if abs(length - got) > 1 else (1 if got < length else -1)
    if best is None:
        raise ValueError(f"cannot render a conversation of {length} tokens with {turns} turns")
    return messages + [best[1]]


# ------------------------------------------------------------------ the runs
def one_token():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def run_trial(llm, manifest: dict, peft, messages: list[dict], order: list[str]) -> dict:
    """The base turn, then each kind in `order`: prompt, cached tokens and TTFT per request."""
    def record(out) -> dict:
        return {"prompt_token_ids": list(out.prompt_token_ids), "cached": out.num_cached_tokens,
                "ttft": out.metrics.time_to_first_token}

    calls = {"switch_alora": {"chat_template_kwargs": {"adapter_name": manifest["alora"]}},
             "switch_lora": {"chat_template_kwargs": {"adapter_name": manifest["lora"]}},
             "peft_alora": {"lora_request": peft}}
    row = {"base_turn": record(llm.chat(messages, one_token(), use_tqdm=False)[0])}
    for kind in order:
        row[kind] = record(llm.chat(messages, one_token(), use_tqdm=False, **calls[kind])[0])
    return row


def expected_cached(row: dict, manifest: dict, block_size: int) -> dict:
    """The accounting the engine should show: the aLoRAs reuse every full block before the
    invocation's first token (the Switch aLoRA's control token), the LoRA nothing. Also
    checks each prompt is the base render with its control token where the template puts it."""
    base = row["base_turn"]["prompt_token_ids"]
    alora_ids, lora_ids = row["switch_alora"]["prompt_token_ids"], row["switch_lora"]["prompt_token_ids"]
    control = manifest["control_token_ids"]
    position = alora_ids.index(control[manifest["alora"]])
    invocation = manifest["alora_invocation_tokens"]
    problems = []
    if alora_ids[:position] + [invocation[0]] + alora_ids[position + 1:] != base:
        problems.append("Switch aLoRA prompt is not the base render with its control token at the invocation")
    if base[position:position + len(invocation)] != invocation:
        problems.append("the base render does not hold the aLoRA invocation where the control token goes")
    if lora_ids[0] != control[manifest["lora"]] or lora_ids[1:] != base[1:]:
        problems.append("Switch LoRA prompt is not the base render with its control token at position 0")
    if row["peft_alora"]["prompt_token_ids"] != base:
        problems.append("PEFT aLoRA prompt differs from the base render")
    reused = position // block_size * block_size
    return {"control_position": position, "switch_alora": reused, "peft_alora": reused, "switch_lora": 0,
            "problems": problems}


def summarize(trials: list[dict], floor) -> dict:
    """Medians, ratios (of the medians and per trial) and floors of the measured trials."""
    med = {k: statistics.median(t[k]["ttft"] for t in trials) for k in ("base_turn", *KINDS)}
    first = trials[0]
    kinds = {}
    for k in ("base_turn", *KINDS):
        prompt = len(first[k]["prompt_token_ids"])
        cached = first[k]["cached"]
        floor_s = floor.seconds(prompt - cached, cached)
        kinds[k] = {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
                    "cached_per_trial": [t[k]["cached"] for t in trials],
                    "ttft_per_trial": [t[k]["ttft"] for t in trials], "ttft_median": med[k],
                    "floor_seconds": floor_s, "x_floor": med[k] / floor_s}
    return {
        "kinds": kinds,
        "switch_alora_over_peft_alora": med["switch_alora"] / med["peft_alora"],
        "switch_lora_over_switch_alora": med["switch_lora"] / med["switch_alora"],
        "switch_alora_over_peft_alora_per_trial": [t["switch_alora"]["ttft"] / t["peft_alora"]["ttft"] for t in trials],
        "switch_lora_over_switch_alora_per_trial": [t["switch_lora"]["ttft"] / t["switch_alora"]["ttft"]
                                                    for t in trials],
    }


def table(summary: dict) -> list[tuple]:
    k = summary["kinds"]
    x_alora = lambda name: k[name]["ttft_median"] / k["switch_alora"]["ttft_median"]  # noqa: E731
    ratio = {"base_turn": "", "switch_alora": "1.00", "peft_alora": f"{x_alora('peft_alora'):.2f}",
             "switch_lora": f"{x_alora('switch_lora'):.1f}"}
    return [(LABELS[name], k[name]["prompt_tokens"], k[name]["cached_tokens"], k[name]["computed_tokens"],
             f"{k[name]['ttft_median'] * 1e3:.1f}", f"{k[name]['floor_seconds'] * 1e3:.1f}",
             f"{k[name]['x_floor']:.1f}", ratio[name]) for name in ("base_turn", *KINDS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=16, help="rank of both adapters")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--conversation-len", type=int, default=2048, help="tokens of the base render")
    parser.add_argument("--turns", type=int, default=3, help="user messages per conversation (answers between)")
    parser.add_argument("--trials", type=int, default=5, help="fresh conversations")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "vllm-bench-granite-switch"),
                        help="where the composed checkpoints are cached")
    parser.add_argument("--rebuild", action="store_true", help="compose the checkpoint again")
    parser.add_argument("--json", default=None, help="write results to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    manifest = ensure_checkpoint(args)

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    llm = LLM(manifest["switch_dir"], dtype=args.dtype, enable_lora=True, max_loras=1, max_lora_rank=args.rank,
              max_model_len=max(512, args.conversation_len + 64), cpu_threads=args.threads)
    tokenizer = llm.get_tokenizer()
    config = llm.llm_engine.model_config.hf_config
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    peft = LoRARequest("peft-" + manifest["alora"], 1, manifest["adapter_paths"][manifest["alora"]])
    device, dtype = default_device(), getattr(torch, args.dtype)
    # Warm-up: every path once on a short conversation (the runtime adapter loads into its slot).
    run_trial(llm, manifest, peft, conversation(tokenizer, manifest["base_vocab_size"], 96, seed=999, turns=1), KINDS)
    floor = Floor(config, dtype, device)
    load_before = machine_load()
    params = sum(a * b for a, b in linear_shapes(config)) * config.num_hidden_layers  # decoder linears
    print(f"{device}, {args.dtype}, {load_line(load_before)}; floor: {floor.flops / 1e9:.1f} GFLOP/s matmul, "
          f"{floor.bandwidth / 1e9:.1f} GB/s copy, {floor.bytes / 1e6:.0f} MB of weights per step\n"
          f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, intermediate "
          f"{args.intermediate}, {params / 1e6:.1f}M linear parameters, random weights; vocabulary "
          f"{config.vocab_size} tokens (the code-built Granite-style test tokenizer + control tokens: the LM head "
          f"is tiny); adapters rank {args.rank}, all 7 projections",
          flush=True)
    trials, checks = [], []
    for trial in range(args.trials):
        messages = conversation(tokenizer, manifest["base_vocab_size"], args.conversation_len, seed=1000 + trial,
                                turns=args.turns)
        order = list(KINDS[trial % 3:] + KINDS[:trial % 3])
        row = run_trial(llm, manifest, peft, messages, order)
        check = expected_cached(row, manifest, block_size)
        for kind in KINDS:
            if row[kind]["cached"] != check[kind]:
                check["problems"].append(f"{kind}: {row[kind]['cached']} cached tokens, expected {check[kind]}")
        for problem in check["problems"]:
            print(f"WARNING trial {trial}: {problem}", flush=True)
        trials.append(row)
        checks.append(check)
        print(f"trial {trial} ({len(row['base_turn']['prompt_token_ids'])} tokens, order {', '.join(order)}): "
              + ", ".join(f"{k} {row[k]['ttft'] * 1e3:.1f} ms ({row[k]['cached']} cached)" for k in KINDS), flush=True)
    summary = summarize(trials, floor)
    load_after = machine_load()
    print_table(f"Granite Switch: TTFT after a {args.conversation_len}-token base turn, median of {args.trials} "
                f"(goals: Switch aLoRA <= 1.10x PEFT aLoRA; Switch LoRA >= 30x Switch aLoRA)", table(summary),
                ("request", "prompt tokens", "cached", "computed", "TTFT ms", "floor ms", "x floor", "x Switch aLoRA"))
    r1, r2 = summary["switch_alora_over_peft_alora"], summary["switch_lora_over_switch_alora"]
    print(f"\n{load_line(load_after)}")
    print(f"Switch aLoRA / PEFT aLoRA: {r1:.3f} (goal <= 1.10: {'met' if r1 <= 1.10 else 'missed'})")
    print(f"Switch LoRA / Switch aLoRA: {r2:.1f}x (goal >= 30x: {'met' if r2 >= 30 else 'missed'})")
    for t in trials:  # the prompts are long; keep their lengths and the control position only
        for k in ("base_turn", *KINDS):
            t[k]["prompt_tokens"] = len(t[k].pop("prompt_token_ids"))
    save_json(args.json, {
        "device": device, "dtype": args.dtype, "checkpoint": manifest["switch_dir"], "shape": manifest["shape"],
        "vocab_size": config.vocab_size, "linear_parameters": params, "block_size": block_size,
        "conversation_len": args.conversation_len, "turns": args.turns, "trials": trials, "expected": checks,
        "floor": floor.as_dict(), "load_before": load_before, "load_after": load_after, **summary,
    })


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
