"""The aLoRA intrinsic pipeline: the base model answers a long conversation, then K
intrinsics (adapters, 16 output tokens each) evaluate the answer. Three modes in the
same run, on fresh conversations of the same length, interleaved round by round:

  alora  the intrinsics are aLoRAs: each reuses the base turn's KV cache up to the last
         full block before its invocation and computes only the few tokens after it;
  lora   the same adapter weights as plain LoRAs (config without
         alora_invocation_tokens): each intrinsic recomputes the whole conversation;
  base   the same calls on the base model (no adapter): the reuse-everything bound.

    python -m benchmarks.alora_pipeline                         # offline, CPU, default ~135M model
    python -m benchmarks.alora_pipeline --launch-server         # online: starts `vllm serve` with the adapters
    python -m benchmarks.alora_pipeline --server http://host:8000 --model MODEL_DIR   # a running server
    python -m benchmarks.alora_pipeline --granite-8b-dummy --context-len 8192         # GPU, Granite-3.3-8B shapes

A running server must serve the adapters as `alora-<name>` and `lora-<name>` (names:
certainty, answerability, hallucination, ...); `--write-adapters DIR` writes them and
prints the `vllm serve` command. Calls stream (openai package) and the time to first
token is the first streamed chunk.

`--concurrency C` runs conversations in rounds of C per mode: offline, each stage of a
round (the base turns, then each intrinsic) is one `LLM.generate` call over the C
conversations, as a batch evaluation over a data set runs; online, C clients each run
a whole pipeline, so the server batches across conversations. Time per conversation is
then the rounds' wall time over the conversations (throughput), next to the latency of
one pipeline.

Intrinsics run one after another (an evaluation pipeline), so the time after k of them
gives the plot of pipeline time against the number of intrinsics (`--plot`);
`--parallel-intrinsics` sends the K calls of a conversation together instead.
Reported per mode: time to first token p50/p90 per intrinsic call (and its ratio to the
floor for the tokens it had to compute), end-to-end time per conversation, prefix-cache
hit rate, and prompt tokens computed against reused.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

from benchmarks.common import (
    ALL_TARGETS,
    INTRINSIC_NAMES,
    Floor,
    add_model_args,
    conversation_ids,
    default_device,
    engine_dtype,
    invocation_ids,
    launch_server,
    load_hf_config,
    load_line,
    machine_load,
    openai_base_url,
    percentile,
    print_table,
    resolve_model,
    save_json,
    server_flags,
    stop_server,
    sync,
    turn_ids,
    write_adapter_pair,
)

MODES = ("alora", "lora", "base")


@dataclass
class Call:
    mode: str
    conversation: int
    round: int  # calls of one round and step run together (one batch offline, in flight together online)
    step: int  # 0: the base turn; k >= 1: the k-th intrinsic (1: all of them with --parallel-intrinsics)
    name: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float
    latency: float


@dataclass
class Pipeline:
    mode: str
    conversation: int
    seconds: float  # end to end
    after_k: list[float]  # time when the base turn and then each intrinsic was done


@dataclass
class Round:
    mode: str
    index: int
    conversations: int
    seconds: float  # wall time of the round, all its conversations' pipelines


class Setup:
    """What both the offline and online runs need: tokenizer, conversations, adapters."""

    def __init__(self, args, tokenizer, hf_config):
        self.args = args
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.names = [INTRINSIC_NAMES[k % len(INTRINSIC_NAMES)] + ("" if k < len(INTRINSIC_NAMES) else str(k))
                      for k in range(args.num_intrinsics)]
        self.invocations = [invocation_ids(tokenizer, n) for n in self.names]
        _, _, self.end_turn = turn_ids(tokenizer)

    def conversation(self, mode: str, index: int) -> list[int]:
        seed = 100_000 * (1 + MODES.index(mode)) + index
        return conversation_ids(self.tokenizer, self.hf_config.vocab_size, self.args.context_len, seed)

    def intrinsic_prompt(self, conversation: list[int], answer: list[int], k: int) -> list[int]:
        return conversation + answer + self.end_turn + self.invocations[k]

    def adapter_name(self, mode: str, k: int) -> Optional[str]:
        return None if mode == "base" else f"{mode}-{self.names[k]}"

    def write_adapters(self, root: str, dtype) -> dict[str, str]:
        paths = {}
        for k, name in enumerate(self.names):
            a, lo = write_adapter_pair(root, self.hf_config, name, self.args.rank, self.args.targets, seed=k,
                                       invocation=self.invocations[k], dtype=dtype)
            paths[f"alora-{name}"], paths[f"lora-{name}"] = a, lo
        return paths


# ------------------------------------------------------------------ offline (LLM)
class OfflineRunner:
    def __init__(self, setup: Setup, model_dir: str, kwargs: dict, root: str):
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        args = setup.args
        self.setup = setup
        self.llm = LLM(model_dir, enable_lora=True, max_loras=2 * args.num_intrinsics, max_lora_rank=args.rank,
                       max_model_len=max_model_len(args),
                       long_prefill_token_threshold=args.long_prefill_token_threshold, **kwargs)
        self.dtype = self.llm.llm_engine.model_config.dtype
        paths = setup.write_adapters(root, self.dtype)
        self.requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(paths.items()))}
        self.device = default_device()

    def _generate(self, prompts, max_tokens, adapter_names):
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        loras = [self.requests[n] if n else None for n in adapter_names]
        sync(self.device)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=loras)
        sync(self.device)
        return outputs, time.perf_counter() - start

    def round(self, mode: str, number: int, indices: list[int]) -> tuple[Round, list[Pipeline], list[Call]]:
        """The pipelines of `indices`' conversations, each stage one batch over all of them."""
        s, args = self.setup, self.setup.args
        conversations = [s.conversation(mode, i) for i in indices]
        if args.context_cached:  # an earlier turn left the context in the cache (untimed)
            self._generate([c[:-args.new_turn_len] for c in conversations], 1, [None] * len(indices))
        calls: list[Call] = []

        def stage(step, prompts, max_tokens, adapters, names, owners):
            outputs, seconds = self._generate(prompts, max_tokens, adapters)
            calls.extend(Call(mode, i, number, step, name, len(o.prompt_token_ids), o.num_cached_tokens,
                              len(o.outputs[0].token_ids), o.metrics.time_to_first_token, seconds)
                         for i, name, o in zip(owners, names, outputs))
            return outputs

        start = time.perf_counter()
        outputs = stage(0, conversations, args.answer_len, [None] * len(indices), ["base turn"] * len(indices),
                        indices)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        after = [time.perf_counter() - start]
        jobs = [(k, i, s.intrinsic_prompt(c, a, k)) for k in range(args.num_intrinsics)
                for i, c, a in zip(indices, conversations, answers)]
        groups = [jobs] if args.parallel_intrinsics else \
            [[j for j in jobs if j[0] == k] for k in range(args.num_intrinsics)]
        for step, group in enumerate(groups, start=1):
            stage(step, [p for _, _, p in group], args.intrinsic_len, [s.adapter_name(mode, k) for k, _, _ in group],
                  [s.names[k] for k, _, _ in group], [i for _, i, _ in group])
            after.append(time.perf_counter() - start)
        pipelines = [Pipeline(mode, i, after[-1], after) for i in indices]
        return Round(mode, number, len(indices), after[-1]), pipelines, calls

    def run(self, modes, bar) -> tuple[list[Round], list[Pipeline], list[Call]]:
        self.llm.llm_engine.engine_core.reset_prefix_cache()
        return run_rounds(self.setup.args, modes, self.round, bar)

    def warm_up(self, modes) -> None:
        """Every adapter loaded and every path run once, on a short conversation."""
        s = self.setup
        for mode in modes:
            conv = conversation_ids(s.tokenizer, s.hf_config.vocab_size, 64, seed=-1 - MODES.index(mode))
            out, _ = self._generate([conv], 4, [None])
            answer = list(out[0].outputs[0].token_ids)
            self._generate([s.intrinsic_prompt(conv, answer, k) for k in range(s.args.num_intrinsics)], 2,
                           [s.adapter_name(mode, k) for k in range(s.args.num_intrinsics)])
        self.llm.llm_engine.engine_core.reset_prefix_cache()

    def engine_stats(self) -> dict:
        return asdict(self.llm.llm_engine.get_stats())


# ------------------------------------------------------------------ online (openai client)
class OnlineRunner:
    def __init__(self, setup: Setup, url: str, text_prompts: bool = False):
        """`text_prompts`: send each prompt as its decoded text, not token ids (a router that
        routes by prompt text, like vllm-router's cache_aware, needs the text)."""
        import openai

        self.setup = setup
        self.url = url
        self.text_prompts = text_prompts
        self.client = openai.AsyncOpenAI(base_url=openai_base_url(url), api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                         timeout=3600, max_retries=0)

    async def check_models(self) -> None:
        models = await self.client.models.list()
        ids = [m.id for m in models.data]
        needed = [f"{mode}-{n}" for mode in ("alora", "lora") for n in self.setup.names]
        missing = [n for n in needed if n not in ids]
        if missing:
            raise SystemExit(f"The server at {self.url} does not serve {missing}. Write the adapters with "
                             "--write-adapters DIR and start the server with the command it prints, or use "
                             "--launch-server.")
        self.base = next((m.id for m in models.data if getattr(m, "parent", None) in (None, m.id)
                          and m.id not in needed), ids[0])

    async def call(self, mode, index, number, step, name, prompt, max_tokens, adapter) -> tuple[Call, str]:
        start = time.perf_counter()
        stream = await self.client.completions.create(
            model=adapter or self.base, prompt=self.setup.tokenizer.decode(prompt) if self.text_prompts else prompt,
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        ttft, text, usage = None, [], None
        async for chunk in stream:
            if chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk.choices[0].text or "")
            if chunk.usage is not None:
                usage = chunk.usage
        latency = time.perf_counter() - start
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (getattr(details, "cached_tokens", None) or 0) if details else 0
        return Call(mode, index, number, step, name, usage.prompt_tokens if usage else len(prompt), cached,
                    usage.completion_tokens if usage else 0, ttft if ttft is not None else latency, latency), \
            "".join(text)

    async def pipeline(self, mode: str, number: int, index: int) -> tuple[Pipeline, list[Call]]:
        s, args = self.setup, self.setup.args
        conversation = s.conversation(mode, index)
        if args.context_cached:  # an earlier turn left the context in the cache (untimed)
            await self.call(mode, index, number, -1, "earlier turn", conversation[:-args.new_turn_len], 1, None)
        start = time.perf_counter()
        base_call, answer_text = await self.call(mode, index, number, 0, "base turn", conversation, args.answer_len,
                                                 None)
        calls = [base_call]
        # A client sends text back: re-encode the answer (the cache matches up to any difference).
        answer = s.tokenizer.encode(answer_text, add_special_tokens=False)
        after = [time.perf_counter() - start]
        jobs = [(1 + k, s.names[k], s.intrinsic_prompt(conversation, answer, k), s.adapter_name(mode, k))
                for k in range(args.num_intrinsics)]
        if args.parallel_intrinsics:
            results = await asyncio.gather(*[self.call(mode, index, number, 1, n, p, args.intrinsic_len, a)
                                             for _, n, p, a in jobs])
            calls += [c for c, _ in results]
            after.append(time.perf_counter() - start)
        else:
            for st, n, p, a in jobs:
                c, _ = await self.call(mode, index, number, st, n, p, args.intrinsic_len, a)
                calls.append(c)
                after.append(time.perf_counter() - start)
        return Pipeline(mode, index, after[-1], after), calls

    async def round(self, mode: str, number: int, indices: list[int]) -> tuple[Round, list[Pipeline], list[Call]]:
        """`indices`' conversations, one client each, all in flight together."""
        start = time.perf_counter()
        results = await asyncio.gather(*[self.pipeline(mode, number, i) for i in indices])
        seconds = time.perf_counter() - start
        return Round(mode, number, len(indices), seconds), [p for p, _ in results], [c for _, cs in results for c in cs]

    async def warm_up(self, modes) -> None:
        await self.check_models()
        s = self.setup
        for mode in modes:
            conv = conversation_ids(s.tokenizer, s.hf_config.vocab_size, 64, seed=-1 - MODES.index(mode))
            _, text = await self.call(mode, -1, -1, 0, "warm-up", conv, 4, None)
            answer = s.tokenizer.encode(text, add_special_tokens=False)
            await asyncio.gather(*[self.call(mode, -1, -1, 1 + k, "warm-up", s.intrinsic_prompt(conv, answer, k), 2,
                                             s.adapter_name(mode, k)) for k in range(s.args.num_intrinsics)])

    def run(self, modes, bar) -> tuple[list[Round], list[Pipeline], list[Call]]:
        loop = asyncio.new_event_loop()  # one loop for the client's whole life
        try:
            loop.run_until_complete(self.warm_up(modes))
            return run_rounds(self.setup.args, modes,
                              lambda mode, number, indices: loop.run_until_complete(self.round(mode, number, indices)),
                              bar)
        finally:  # the client's connections and streams belong to this loop
            loop.run_until_complete(self.client.close())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def run_rounds(args, modes, play, bar) -> tuple[list[Round], list[Pipeline], list[Call]]:
    """Rounds of `--concurrency` conversations; within a round every mode plays its own
    fresh conversations of the same length, one mode after another, so no mode inherits
    another's cache and a drift of the machine's speed hits all modes alike."""
    rounds, pipelines, calls = [], [], []
    for number, first in enumerate(range(0, args.num_conversations, args.concurrency)):
        indices = list(range(first, min(first + args.concurrency, args.num_conversations)))
        for mode in modes:
            r, p, c = play(mode, number, indices)
            rounds.append(r)
            pipelines += p
            calls += c
            bar.update(len(indices))
    return rounds, pipelines, calls


# ------------------------------------------------------------------ report
def prefill_tokens(c: Call) -> tuple[int, int]:
    """(tokens the call's prefill computes, tokens it found cached); a fully cached prompt
    still computes its last token."""
    return max(1, c.prompt_tokens - c.cached_tokens), c.cached_tokens


def stage_floor(floor: Floor, calls: list[Call]) -> float:
    """The floor of calls that run together (one stage of a round): the prefill of every
    uncached prompt token, then one decode step per further output token of the longest,
    each step reading the weights once and the KV of every sequence still decoding."""
    prefill = floor.prefill_seconds([prefill_tokens(c) for c in calls])
    decode = sum(floor.decode_seconds([c.prompt_tokens + j for c in calls if j < c.output_tokens - 1])
                 for j in range(max(c.output_tokens for c in calls) - 1))
    return prefill + decode


def summarize(rounds: list[Round], pipelines: list[Pipeline], calls: list[Call], modes, floor: Optional[Floor]) -> dict:
    """Per mode: intrinsic TTFT percentiles, pipeline latency, seconds per conversation
    (the rounds' wall time over their conversations), cache reuse and, with a floor, the
    same figures at this machine's floor; then the LoRA / aLoRA ratios."""
    summary = {}
    for mode in modes:
        mine = [c for c in calls if c.mode == mode]
        intrinsic = [c for c in mine if c.step >= 1]
        ttfts = [c.ttft for c in intrinsic]
        prompt = sum(c.prompt_tokens for c in mine)
        cached = sum(c.cached_tokens for c in mine)
        runs = [p for p in pipelines if p.mode == mode]
        my_rounds = [r for r in rounds if r.mode == mode]
        conversations = sum(r.conversations for r in my_rounds)
        curve = [statistics.mean(p.after_k[k] for p in runs) for k in range(len(runs[0].after_k))]
        row = {
            "intrinsic_ttft_p50": percentile(ttfts, 50), "intrinsic_ttft_p90": percentile(ttfts, 90),
            "base_turn_ttft_p50": percentile([c.ttft for c in mine if c.step == 0], 50),
            "pipeline_seconds_mean": statistics.mean(p.seconds for p in runs),
            "pipeline_seconds_p50": percentile([p.seconds for p in runs], 50),
            "seconds_per_conversation": sum(r.seconds for r in my_rounds) / conversations,
            "pipeline_after_k_mean": curve,
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
            "intrinsic_hit_rate": sum(c.cached_tokens for c in intrinsic) / max(1, sum(c.prompt_tokens for c in intrinsic)),
            "prompt_tokens": prompt, "prompt_tokens_reused": cached, "prompt_tokens_computed": prompt - cached,
            "output_tokens": sum(c.output_tokens for c in mine),
            "num_calls": len(mine),
        }
        if floor is not None and intrinsic:
            floors = [floor.seconds(*prefill_tokens(c)) for c in intrinsic]
            row["intrinsic_ttft_floor_p50"] = percentile(floors, 50)
            stages = sorted({(c.round, c.step) for c in mine if c.step >= 0})
            row["floor_seconds_per_conversation"] = sum(
                stage_floor(floor, [c for c in mine if (c.round, c.step) == key]) for key in stages) / conversations
        summary[mode] = row
    if "alora" in summary and "lora" in summary:
        a, lo = summary["alora"], summary["lora"]
        summary["lora_over_alora_ttft_p50"] = lo["intrinsic_ttft_p50"] / a["intrinsic_ttft_p50"]
        summary["lora_over_alora_pipeline"] = lo["seconds_per_conversation"] / a["seconds_per_conversation"]
        if "floor_seconds_per_conversation" in a:  # the best ratio this machine allows with these lengths
            summary["lora_over_alora_pipeline_at_floor"] = \
                lo["floor_seconds_per_conversation"] / a["floor_seconds_per_conversation"]
    return summary


def print_summary(summary: dict, modes, title: str) -> None:
    ref = summary.get("alora", summary[modes[0]])
    rows = []
    for mode in modes:
        r = summary[mode]
        floor = r.get("intrinsic_ttft_floor_p50")
        floor_conv = r.get("floor_seconds_per_conversation")
        rows.append((
            mode, f"{r['intrinsic_ttft_p50'] * 1e3:.1f}", f"{r['intrinsic_ttft_p90'] * 1e3:.1f}",
            f"{r['intrinsic_ttft_p50'] / floor:.1f}" if floor else "-",
            f"{r['intrinsic_ttft_p50'] / ref['intrinsic_ttft_p50']:.1f}",
            f"{r['pipeline_seconds_mean']:.2f}", f"{r['seconds_per_conversation']:.2f}",
            f"{floor_conv:.2f}" if floor_conv else "-",
            f"{r['seconds_per_conversation'] / ref['seconds_per_conversation']:.2f}",
            f"{100 * r['prefix_cache_hit_rate']:.1f}%", r["prompt_tokens_computed"], r["prompt_tokens_reused"],
        ))
    print_table(title, rows, ("mode", "intrinsic TTFT p50 ms", "p90 ms", "p50 x floor", "TTFT x aLoRA",
                              "pipeline latency s", "s/conv", "floor s/conv", "s/conv x aLoRA", "prefix hit",
                              "prompt tok computed", "reused"))


def plot(path: str, summary: dict, modes, title: str, num_intrinsics: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"alora": "aLoRA intrinsics (base KV reused)", "lora": "plain LoRA intrinsics (full recompute)",
              "base": "base model calls (no adapter)"}
    styles = {"alora": ("tab:blue", "o"), "lora": ("tab:red", "s"), "base": ("tab:gray", "^")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        curve = summary[mode]["pipeline_after_k_mean"]
        xs = list(range(len(curve))) if len(curve) == num_intrinsics + 1 else [0, num_intrinsics]
        color, marker = styles[mode]
        ax.plot(xs, curve, marker=marker, color=color, label=labels[mode],
                linestyle="--" if mode == "base" else "-")
    ax.set_xlabel("number of intrinsics evaluated after the base answer")
    ax.set_ylabel("pipeline latency of a conversation (s)")
    ax.set_xticks(range(num_intrinsics + 1))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    import textwrap

    ax.set_title("\n".join(textwrap.fill(line, 90) for line in title.split("\n")), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def titles(args, device: str, online: bool) -> tuple[str, str]:
    """(table title, plot title) of a run."""
    where = f"online ({args.concurrency} concurrent)" if online else \
        "offline" + (f" ({args.concurrency} conversations per batch)" if args.concurrency > 1 else "")
    if args.context_cached:
        where += f", context cached but the last {args.new_turn_len} tokens"
    if args.long_prefill_token_threshold:
        where += f", prompt chunks <= {args.long_prefill_token_threshold}"
    short = (f"aLoRA intrinsic pipeline, {where}, {device}: {args.num_conversations} conversations x "
             f"{args.context_len} tokens, {args.answer_len}-token answer, intrinsics of {args.intrinsic_len} tokens, "
             f"rank {args.rank}")
    title = (f"aLoRA pipeline, {where}: {args.num_conversations} conversations x {args.context_len} tokens, "
             f"{args.answer_len}-token answer, {args.num_intrinsics} intrinsics x {args.intrinsic_len} tokens "
             f"({'parallel' if args.parallel_intrinsics else 'sequential'}), rank {args.rank}, {device}")
    return title, short


def replot(args) -> None:
    import json

    with open(args.from_json) as f:
        saved = json.load(f)
    run_args = argparse.Namespace(**{**vars(args), **saved["args"]})
    modes = [m for m in MODES if m in saved["summary"]]
    title, short = titles(run_args, saved["device"], saved["online"])
    print_summary(saved["summary"], modes, title)
    print(f"\n{load_line(saved['load_after'])} (before: {load_line(saved['load_before'])})")
    if args.plot:
        load = {**saved["load_after"], "commit": saved["load_before"].get("commit", "?")}
        plot(args.plot, saved["summary"], modes, f"{short}\n{load_line(load)}", run_args.num_intrinsics)


def max_model_len(args) -> int:
    """Room for the conversation, the answer, an intrinsic's invocation and its output."""
    return args.context_len + args.answer_len + args.intrinsic_len + 64


def serve_command(paths: dict, args) -> list[str]:
    flags = ["--enable-lora", "--max-loras", str(2 * args.num_intrinsics), "--max-lora-rank", str(args.rank),
             "--max-model-len", str(max_model_len(args)),
             "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
             "--lora-modules", *[f"{name}={path}" for name, path in sorted(paths.items())]]
    return flags + server_flags(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num-conversations", type=int, default=4, help="conversations per mode")
    parser.add_argument("--context-len", type=int, default=2048, help="conversation tokens (1k-8k)")
    parser.add_argument("--answer-len", type=int, default=256, help="tokens of the base model's answer")
    parser.add_argument("--num-intrinsics", type=int, default=3, help="K intrinsics per conversation")
    parser.add_argument("--intrinsic-len", type=int, default=16, help="output tokens of each intrinsic")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=ALL_TARGETS, help="modules the adapters adapt")
    parser.add_argument("--context-cached", action="store_true",
                        help="multi-turn: an earlier turn already left the context in the prefix cache, so the base "
                             "turn computes only the last --new-turn-len tokens (the cache fill is not timed)")
    parser.add_argument("--new-turn-len", type=int, default=64, help="with --context-cached: new tokens of the turn")
    parser.add_argument("--parallel-intrinsics", action="store_true", help="send the K intrinsic calls together")
    parser.add_argument("--server", default=None, help="URL of a running server (online mode)")
    parser.add_argument("--launch-server", action="store_true", help="start `vllm serve` here (online mode)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="conversations in flight: offline, per generate call; online, concurrent clients")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="the engine's per-request cap of prompt tokens per step (0: none)")
    parser.add_argument("--write-adapters", default=None, metavar="DIR",
                        help="write the adapters to DIR, print the `vllm serve` command and exit")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="print the table and draw the plot of a saved run (--json) without running")
    args = parser.parse_args()
    modes = [m for m in MODES if m in args.modes]
    if args.from_json:
        replot(args)
        return
    device = default_device()
    root = tempfile.mkdtemp(prefix="vllm-bench-pipeline-")
    model_dir, kwargs = resolve_model(args, root)
    hf_config = load_hf_config(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    setup = Setup(args, tokenizer, hf_config)
    dtype = engine_dtype(args, model_dir)

    if args.write_adapters:
        paths = setup.write_adapters(args.write_adapters, dtype)
        print("vllm serve " + " ".join([model_dir, *serve_command(paths, args)]))
        return

    online = bool(args.server or args.launch_server)
    server = None
    floor = None
    try:
        if online:
            url = args.server
            if args.launch_server:
                paths = setup.write_adapters(root, dtype)
                env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
                server, url = launch_server(model_dir, serve_command(paths, args),
                                            os.path.join(root, "server.log"), env=env)
            runner = OnlineRunner(setup, url)
        else:
            runner = OfflineRunner(setup, model_dir, kwargs, root)
            runner.warm_up(modes)
            dtype = runner.dtype
        if not online or args.launch_server:  # the floor of this machine (a remote server's is unknown)
            floor = Floor(hf_config, dtype, device)
        load_before = machine_load()
        print(f"{'online ' + url if online else 'offline'}, {device}, {load_line(load_before)}")
        from tqdm.auto import tqdm

        with tqdm(total=args.num_conversations * len(modes), desc="pipelines", dynamic_ncols=True) as bar:
            rounds, pipelines, calls = runner.run(modes, bar)
        stats = runner.engine_stats() if not online else None
    finally:
        if server is not None:
            stop_server(server)
    load_after = machine_load()

    summary = summarize(rounds, pipelines, calls, modes, floor)
    title, short = titles(args, device, online)
    print_summary(summary, modes, title)
    print(f"\n{load_line(load_after)} (before: {load_line(load_before)})")
    if "lora_over_alora_ttft_p50" in summary:
        t, p = summary["lora_over_alora_ttft_p50"], summary["lora_over_alora_pipeline"]
        print(f"aLoRA intrinsic TTFT p50 {t:.1f}x lower than plain LoRA (target 30x: {'met' if t >= 30 else 'missed'})")
        print(f"aLoRA pipeline {p:.2f}x faster than plain LoRA (target 3x: {'met' if p >= 3 else 'missed'})")
        if "lora_over_alora_pipeline_at_floor" in summary:
            print(f"  at this machine's floor the same pipelines would differ by "
                  f"{summary['lora_over_alora_pipeline_at_floor']:.2f}x (the base turn's decode is common to both)")
    if args.plot:
        # The engine is the code this process imported: the commit at its start.
        plot(args.plot, summary, modes, f"{short}\n{load_line({**load_after, 'commit': load_before['commit']})}",
             args.num_intrinsics)
    save_json(args.json, {
        "device": device, "model": model_dir, "online": online, "server": args.server, "args": vars(args),
        "floor": floor.as_dict() if floor else None, "load_before": load_before, "load_after": load_after,
        "summary": summary, "engine_stats": stats, "rounds": [asdict(r) for r in rounds],
        "pipelines": [asdict(p) for p in pipelines],
        "calls": [asdict(c) for c in calls],
    })


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
