"""Engine parity on the device: every test architecture in bf16 against transformers (and PEFT,
for a LoRA and an aLoRA) in bf16 on the same device, and CUDA graphs on against off.

Not a test (CI has no GPU): `benchmarks/gpu_check.sh` runs it on the first machine with one.
Tiny random checkpoints and adapters are built here, as the tests build them (nothing is
downloaded). Per row: greedy tokens equal on how many prompts, the largest |logprob difference|
over the tokens both sides produced, and whether graph replays gave the same tokens as eager
steps. bf16 sums round differently in each implementation, so a near-tie may flip a token and the
texts part from there; the stated bar is: on every prompt the tokens are equal up to the end or up
to a near-tie (where transformers' own logprobs of the two tokens differ by less than
BF16_LOGPROB_ATOL), logprobs within BF16_LOGPROB_ATOL before it, and graph tokens equal to eager.

    python -m benchmarks.gpu_parity [--device cuda|cpu] [--arch llama qwen3 ...]

`--device cpu` runs the same comparisons on the CPU in fp32 (graphs simulated by re-running the
captured closure over its buffers), to check the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.conftest import INVOCATION  # noqa: E402
from tests.utils.adapters import ALL_LINEAR, load_peft_model, make_adapter  # noqa: E402
from tests.utils.checkpoints import ARCHITECTURES, load_hf_model, make_checkpoint  # noqa: E402
from tests.utils.reference import hf_greedy  # noqa: E402
from tests.utils.tokenizer import build_tokenizer  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

BF16_LOGPROB_ATOL = 0.1
MAX_NEW = 16
TEXTS = [
    "What is the capital of France?",
    "one two three four five six seven eight nine ten eleven twelve " * 3,
    "Please answer the question using the documents provided. " * 4,
    "Large language models generate text one token at a time from a key value cache.",
]
KV_BYTES = 256 << 20  # a small cache: several engines share the device in turn


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _engine(path: str, device: str, eager: bool, lora: bool) -> LLM:
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8) if lora else {}
    llm = LLM(path, dtype=str(_dtype(device)).removeprefix("torch."), device=device, max_model_len=256, enforce_eager=eager, max_num_seqs=8,
              kv_cache_memory_bytes=KV_BYTES, **kwargs)
    if device == "cpu" and not eager:
        from vllm.worker.cuda_graph import EagerReplayBackend

        llm.llm_engine.engine_core.runner.capture_cuda_graphs(EagerReplayBackend())
    return llm


def _generate(llm: LLM, prompts: list[list[int]], request=None) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        result.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return result


@torch.no_grad()
def _near_tie(reference, prefix: list[int], ours: int, theirs: int, device: str) -> bool:
    """Whether the reference itself nearly ties between the two tokens after `prefix`."""
    logits = reference(torch.tensor([prefix], device=device)).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1)
    return abs(float(logprobs[ours] - logprobs[theirs])) < BF16_LOGPROB_ATOL


def _compare(ours, refs, reference, prompts, device) -> tuple[int, int, float]:
    """(prompts equal to the end, prompts equal up to a near-tie, worst |dlogprob| before any split)."""
    equal, tied, worst = 0, 0, 0.0
    for (tokens, logprobs), (ref_tokens, ref_logprobs), prompt in zip(ours, refs, prompts):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        worst = max([worst] + [abs(a - b) for a, b in zip(logprobs[:same], ref_logprobs[:same])])
        if same == len(tokens):
            equal += 1
        elif _near_tie(reference, prompt + ref_tokens[:same], tokens[same], ref_tokens[same], device):
            tied += 1
    return equal, tied, worst


def _graphs_used(llm: LLM) -> bool:
    graphs = llm.llm_engine.engine_core.runner.graphs
    return graphs is not None and graphs.enabled


def check_arch(arch: str, root: str, device: str, prompts: list[list[int]], inv: list[int],
               adapters: bool) -> list[dict]:
    path = make_checkpoint(os.path.join(root, arch), arch)
    hf = load_hf_model(path).to(device=device, dtype=_dtype(device))
    cases = [("base", None, hf)]
    if adapters:
        for name, kwargs in (("lora", {}), ("alora", {"invocation_tokens": inv})):
            adapter = make_adapter(path, os.path.join(root, f"{arch}_{name}"), ALL_LINEAR, r=8, seed=7, **kwargs)
            peft = load_peft_model(path, adapter).to(device=device, dtype=_dtype(device))
            cases.append((name, LoRARequest(name, len(cases), adapter), peft))
    rows = []
    engines = {eager: _engine(path, device, eager, lora=adapters) for eager in (True, False)}
    for name, request, reference in cases:
        case_prompts = [p + inv for p in prompts] if name == "alora" else prompts
        with torch.device(device):
            refs = [hf_greedy(reference, p, MAX_NEW) for p in case_prompts]
        eager = _generate(engines[True], case_prompts, request)
        graph = _generate(engines[False], case_prompts, request)
        equal, tied, worst = _compare(eager, refs, reference, case_prompts, device)
        graph_same = all(g[0] == e[0] for g, e in zip(graph, eager))
        rows.append(dict(arch=arch, case=name, equal=f"{equal}/{len(prompts)} (+{tied} to a tie)", logprob=worst,
                         graphs="on" if _graphs_used(engines[False]) else "eager (capture failed)",
                         graph_same=graph_same,
                         ok=equal + tied == len(prompts) and worst < BF16_LOGPROB_ATOL and graph_same))
    del engines, hf, cases
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--arch", nargs="*", default=list(ARCHITECTURES))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu to check the script", file=sys.stderr)
        return 2
    unknown = sorted(set(args.arch) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"unknown --arch {unknown}; known: {', '.join(ARCHITECTURES)}")
    tokenizer = build_tokenizer()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    inv = tokenizer.encode(INVOCATION, add_special_tokens=False)
    rows, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for arch in args.arch:
            try:
                rows += check_arch(arch, root, args.device, prompts, inv, adapters=arch == "llama")
            except Exception as e:  # noqa: BLE001 - one broken architecture must not hide the others
                rows.append(dict(arch=arch, case="-", equal="-", logprob=float("nan"), graphs="-", graph_same=False,
                                 ok=False, error=f"{type(e).__name__}: {e}"))
    print(f"\n## Engine parity, {str(_dtype(args.device)).removeprefix('torch.')} on {args.device} "
          f"({time.perf_counter() - start:.0f} s); bar: tokens equal (or to a near-tie), "
          f"|dlogprob| < {BF16_LOGPROB_ATOL}, graphs == eager\n")
    print("| arch | case | tokens equal | max abs dlogprob | graphs | graph tokens == eager | status |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        status = "ok" if r["ok"] else "FAIL " + r.get("error", "")
        print(f"| {r['arch']} | {r['case']} | {r['equal']} | {r['logprob']:.4f} | {r['graphs']} | "
              f"{'yes' if r['graph_same'] else 'NO'} | {status} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
