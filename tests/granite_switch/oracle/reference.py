"""Reference runs of granite-switch's own HF model (oracle venv side).

Usage (inside `.venv-granite-switch`):

    python reference.py generate SWITCH_DIR REQUESTS.json OUT.json
    python reference.py render   SWITCH_DIR RENDERS.json  OUT.json

`generate`: REQUESTS.json is a list of `{"prompt_token_ids": [...], "max_tokens": N}`
(optional `"stop_token_ids": [...]`: stop after emitting one, it is kept). Each
request runs alone through `AutoModelForCausalLM` (after `import granite_switch.hf`),
float32, eval, greedy, re-running the full sequence at every step (no KV cache, so
each step's logits are exactly what the model returns for that prefix). Output per
request: `token_ids`, `logprobs` (log_softmax of the fp32 step logits at the chosen
token), `margins` (top-1 minus top-2 logit), `adapter_indices`
(`model.model._last_adapter_indices` of one final forward over prompt + generated
tokens) and `prompt_logprobs` (from that same forward; `null` for position 0).

`render`: RENDERS.json is a list of `{"messages": [...], "adapter_name": str|null,
"add_generation_prompt": bool}`; output is one id list per item, from the switch
tokenizer's `apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _ids(out) -> list[int]:
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def render_all(switch_dir: str, items: list[dict]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(switch_dir)
    results = []
    for item in items:
        kwargs = {}
        if item.get("adapter_name") is not None:
            kwargs["adapter_name"] = item["adapter_name"]
        out = tok.apply_chat_template(
            item["messages"], tokenize=True,
            add_generation_prompt=item.get("add_generation_prompt", True), **kwargs)
        results.append(_ids(out))
    return results


def generate_all(switch_dir: str, requests: list[dict]) -> list[dict]:
    import torch

    import granite_switch.hf  # noqa: F401  (registers granite_switch with the Auto classes)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(switch_dir, dtype=torch.float32).eval()

    def forward(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
        return out.logits[0].float()

    results = []
    with torch.inference_mode():
        for req in requests:
            seq = [int(t) for t in req["prompt_token_ids"]]
            n_prompt = len(seq)
            stops = set(int(t) for t in req.get("stop_token_ids") or [])
            tokens, logprobs, margins = [], [], []
            for _ in range(int(req["max_tokens"])):
                logits = forward(seq)[-1]
                token = int(torch.argmax(logits))
                top2 = torch.topk(logits, 2).values
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
                margins.append(float(top2[0] - top2[1]))
                seq.append(token)
                if token in stops:
                    break
            full_logits = forward(seq)
            routing = model.model._last_adapter_indices[0].tolist()
            lp = torch.log_softmax(full_logits, dim=-1)
            prompt_lp = [None] + [float(lp[i - 1, seq[i]]) for i in range(1, n_prompt)]
            results.append({
                "prompt_token_ids": seq[:n_prompt],
                "token_ids": tokens,
                "logprobs": logprobs,
                "margins": margins,
                "adapter_indices": [int(a) for a in routing],
                "prompt_logprobs": prompt_lp,
            })
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[1] not in ("generate", "render"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, switch_dir, in_path, out_path = argv[1:]
    with open(in_path) as f:
        payload = json.load(f)
    if mode == "generate":
        result = generate_all(switch_dir, payload)
    else:
        result = render_all(switch_dir, payload)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (~2 s with torch loaded); files are closed
