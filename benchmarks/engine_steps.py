"""The engine end to end, one table: decode step at batch 1 and 64, a 2,048-token
prefill, aLoRA and plain-LoRA time to first token after a 2,048-token base conversation
with a 16-token invocation, and decode throughput of a batch mixing base, LoRA and aLoRA
requests against base only. Each figure with its ratio to this machine's floor.

    python -m benchmarks.engine_steps                       # CPU, default ~135M model
    python -m benchmarks.engine_steps --granite-8b-dummy    # GPU (H200), Granite-3.3-8B shapes, bf16
    python -m benchmarks.engine_steps --precision fp32 bf16 int8 int4 --figures decode prefill
    python -m benchmarks.engine_steps --tiny --figures decode --decode-context 128  # the engine's own cost
    python -m benchmarks.engine_steps --precision bf16 int4 fp32 int8 --interleave 7  # robust ratios
    python -m benchmarks.engine_steps --precision bf16 int4 fp32 --interleave 5 --kv-cache-dtype bfloat16

Floors (benchmarks.common.Floor): a decode step reads every weight once plus the KV of
the batch at the measured bandwidth (the fastest of reads and a copy), or costs the batch's
FLOPs at the measured matmul rate, whichever is slower; a prefill costs its FLOPs at the
matmul rate. The KV bytes are the cache's dtype: --kv-cache-dtype bfloat16 gives every
precision a bf16 cache (and its floor). A quantized model's weight bytes are its quantized
linears plus the LM head as it is stored (int8 per channel under --quantization; as
benchmarks/quantization.py counts them).

The decode step is also split twice, each time in a second run with clocks (the figure itself
is timed without them). On the path it runs: the native decoder layers (layers/decode_layer.py's
NativeDecodeStack calls), the LM head, and the rest (embedding, final norm, scheduling, building
inputs, sampling, output processing and detokenizing: the engine's per-step work outside the
model's kernels, as a number). On the per-op path (the native decoder layers off: they call no
module the clocks wrap): linears, attention, the other model ops with their Python, and the
engine's per-step overhead outside the model.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import gc
import tempfile
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Optional

import torch

from benchmarks.common import (
    ALL_TARGETS,
    Floor,
    add_model_args,
    conversation_ids,
    default_device,
    engine_dtype,
    engine_kwargs,
    linear_shapes,
    load_hf_config,
    load_line,
    machine_load,
    measured_bandwidth,
    measured_matmul_flops,
    print_table,
    resolve_model,
    save_json,
    sync,
    write_adapter_pair,
)
from vllm import LLM, SamplingParams
from vllm.attention.layer import Attention
from vllm.lora.layers import LinearWithLoRA
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.decode_layer import NativeDecodeStack
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.vocab_embedding import LMHead
from vllm.platforms import cpu_has_native_bf16

# --precision: (model dtype, quantization); the quantized ones on the --dtype model (default fp32).
PRECISIONS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": (None, "int8"), "int4": (None, "int4")}
FIGURES = ("decode", "prefill", "adapters")
# What the decode and prefill figures time with: wall time, or (--clock cpu, one thread) this
# process's CPU time, which a busy neighbour on a shared machine cannot inflate.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]
INTERLEAVE_KV_BYTES = 256 << 20  # each engine's KV cache under --interleave (batch-1 decodes need little)


class StepClocks:
    """Seconds per part of an engine step, summed by the clocks `_timed` puts around calls (the
    device synchronized around each, timed with `clock`); `reset` zeroes them in place, as the
    clocks hold the dict. A subclass's `parts(step)` gives a timed step's parts, and its `title` and
    `labels` (a row name per part) the table's rows for them."""

    def __init__(self, device: str, parts: tuple[str, ...]):
        self.device = device
        self.seconds = dict.fromkeys(parts, 0.0)

    def reset(self) -> None:
        self.seconds.update(dict.fromkeys(self.seconds, 0.0))

    def _timed(self, fn, part: str):
        def call(*args, **kwargs):
            sync(self.device)
            start = clock()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.seconds[part] += clock() - start
            return out

        return call


class ModelTimer(StepClocks):
    """Inside engine steps, where the model's time goes: `seconds["model"]` (the runner's forward
    and the LM head's `compute_logits`), and within it `seconds["linears"]` (every Linear, with
    its LoRA when on, and the LM head: the weight reads) and `seconds["attention"]` (the
    Attention layers: KV store and kernel). Wraps them on the instances while entered (an
    instance attribute shadows a method)."""

    title = "  the same step on the per-op path, timed part by part"
    labels = {"linears": "linears + LM head", "attention": "attention (KV store + kernel)",
              "other model": "other model ops + Python (norms, rotary, activations)",
              "engine": "engine per-step overhead (schedule, inputs, sampling, outputs)"}

    def __init__(self, llm: LLM, device: str):
        super().__init__(device, ("model", "linears", "attention"))
        self.runner = llm.llm_engine.engine_core.runner
        modules = list(self.runner.model.modules())
        # With LoRA on, the wrapper is timed (base product and adapter together), not its base
        # layer, which it calls without going through the module.
        wrapped = {id(m.base_layer) for m in modules if isinstance(m, LinearWithLoRA)}
        self._timed_modules = [(m, "linears") for m in modules
                               if isinstance(m, (Linear, LMHead, LinearWithLoRA)) and id(m) not in wrapped]
        self._timed_modules += [(m, "attention") for m in modules if isinstance(m, Attention)]

    def __enter__(self) -> "ModelTimer":
        model = self.runner.model
        self._saved = (self.runner._forward, model.compute_logits)
        # Decoder layers that run as one native call (layers/decode_layer.py) call no Linear or
        # Attention module: time the per-op path they replace, bit for bit the same arithmetic.
        self._native_layers = [m for m in model.modules() if getattr(m, "native_decode_allowed", False)]
        for layer in self._native_layers:
            layer.native_decode_allowed = False
        self.runner._forward = self._timed(self.runner._forward, "model")
        model.compute_logits = self._timed(model.compute_logits, "model")
        for module, part in self._timed_modules:
            module.forward = self._timed(module.forward, part)
        return self

    def __exit__(self, *exc) -> None:
        self.runner._forward, self.runner.model.compute_logits = self._saved
        for layer in self._native_layers:
            layer.native_decode_allowed = True
        for module, _ in self._timed_modules:
            del module.forward

    def parts(self, step: float) -> dict[str, float]:
        """A timed step's parts (`labels`' keys, plus "step")."""
        parts = dict(self.seconds, engine=step - self.seconds["model"], step=step)
        parts["other model"] = parts["model"] - parts["linears"] - parts["attention"]
        return parts


class NativeStepTimer(StepClocks):
    """Inside engine steps on the path they run, where the time goes: `seconds["layers"]` (every
    NativeDecodeStack call: a run of decoder layers in one native call) and `seconds["lm head"]` (the
    model's compute_logits). The model calls a stack as `stack(...)`, which Python looks up on the
    class, so the class's __call__ is wrapped while entered (and the model's compute_logits on the
    instance)."""

    title = "  the same step with clocks around its native layers and LM head"
    labels = {"layers": "native decoder layers (NativeDecodeStack calls: linears, attention, norms)",
              "lm head": "LM head",
              "rest": "the rest (embedding, final norm, schedule, inputs, sampling, outputs)"}

    def __init__(self, llm: LLM, device: str):
        super().__init__(device, ("layers", "lm head"))
        self.model = llm.llm_engine.engine_core.runner.model

    def __enter__(self) -> "NativeStepTimer":
        self._saved = (NativeDecodeStack.__call__, self.model.compute_logits)
        NativeDecodeStack.__call__ = self._timed(NativeDecodeStack.__call__, "layers")
        self.model.compute_logits = self._timed(self.model.compute_logits, "lm head")
        return self

    def __exit__(self, *exc) -> None:
        NativeDecodeStack.__call__, self.model.compute_logits = self._saved

    def parts(self, step: float) -> dict[str, float]:
        """A timed step's parts (`labels`' keys, plus "step")."""
        return dict(self.seconds, rest=step - self.seconds["layers"] - self.seconds["lm head"], step=step)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def decode_step_seconds(llm: LLM, batch: int, context: int, device: str, lora_requests=None,
                        split: Optional[dict[str, list[float]]] = None, timer=ModelTimer) -> float:
    """Median time (`clock`: wall unless --clock cpu) of a decode step with `batch` sequences of
    `context` tokens. With `split`, each timed step's parts (`timer(llm, device).parts`: ModelTimer's
    or NativeStepTimer's, with "step") are appended to its lists."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(batch):
        prompt = conversation_ids(engine.get_tokenizer(), vocab, context, seed=1000 + i)
        lora = lora_requests[i % len(lora_requests)] if lora_requests else None
        if lora is not None and "alora" in lora.lora_name:
            prompt = prompt + lora_requests.invocation
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params,
                           lora_request=lora)
    while any(len(o.outputs[0].token_ids) == 0 for o in engine.step()) or _prefilling(engine):
        pass  # run the prefills (and the first token) before timing decode
    times = []
    with timer(llm, device) if split is not None else nullcontext() as clocks:
        while engine.has_unfinished_requests():
            if clocks is not None:
                clocks.reset()
            sync(device)
            start = clock()
            engine.step()
            sync(device)
            times.append(clock() - start)
            if clocks is not None:
                for part, seconds in clocks.parts(times[-1]).items():
                    split.setdefault(part, []).append(seconds)
    if not times:
        raise ValueError(f"no decode step left to time: a {context}-token context plus {params.max_tokens} new tokens "
                         f"must fit max_model_len ({engine.model_config.max_model_len}); pass a shorter "
                         "--decode-context")
    return median(times)


def _prefilling(engine) -> bool:
    scheduler = engine.engine_core.scheduler
    return bool(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


class AdapterRequests(list):
    """LoRA requests plus the aLoRA invocation their prompts end with."""

    invocation: list[int] = []


def ttft(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> tuple[float, int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                       lora_request=lora, use_tqdm=False)[0]
    return out.metrics.time_to_first_token, out.num_cached_tokens


def tiny_checkpoint(root: str) -> str:
    """The tests' tiny Llama (2 layers, hidden 64) and tokenizer: a model whose forward costs
    almost nothing, so a step is mostly the engine's own work."""
    from tests.utils.checkpoints import make_checkpoint

    return make_checkpoint(os.path.join(root, "tiny-llama"), "llama")


@contextmanager
def floor_clock():
    """Floor's timings read common.time.perf_counter: within this, under --clock cpu they read
    this clock too, so a figure and its floor are measured alike."""
    import benchmarks.common as common

    saved, common.time = common.time, SimpleNamespace(perf_counter=clock)
    try:
        yield
    finally:
        common.time = saved


def precision_floor(llm: LLM, hf_config, dtype: torch.dtype, quantization: Optional[str], device: str,
                    kv_cache_dtype: str = "auto", num_tokens: int = 2048) -> Floor:
    """The floor on this machine; a quantized model reads its quantized linears and the LM head.
    num_tokens: the rows its matmul rate is measured at."""
    with floor_clock():
        floor = Floor(hf_config, dtype, device, num_tokens=num_tokens,
                      kv_dtype=torch.bfloat16 if kv_cache_dtype == "bfloat16" else None)
    if quantization is not None:
        from benchmarks.quantization import linear_weight_bytes, lm_head_bytes

        floor.bytes = float(linear_weight_bytes(llm) + lm_head_bytes(llm))
    return floor


def precision_engine(args, precision: Optional[str], model_dir: str,
                     kwargs: dict) -> tuple[dict, torch.dtype, Optional[str]]:
    """(LLM kwargs, model dtype, quantization method) of one --precision (None: the defaults)."""
    dtype_name, quantization = PRECISIONS[precision] if precision else (None, None)
    kwargs = dict(kwargs)
    if dtype_name is not None:
        kwargs["dtype"] = dtype_name
    if quantization is not None:
        kwargs["quantization"] = quantization
    dtype = getattr(torch, kwargs["dtype"]) if "dtype" in kwargs else engine_dtype(args, model_dir)
    return kwargs, dtype, quantization


def run_precision(args, precision: Optional[str], model_dir: str, kwargs: dict, device: str) -> tuple[list, dict]:
    """Every asked figure for one precision: (table rows, JSON results)."""
    kwargs, dtype, quantization = precision_engine(args, precision, model_dir, kwargs)
    hf_config = load_hf_config(model_dir)
    adapters = "adapters" in args.figures
    lora_kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank) if adapters else {}
    max_len = max([4096, args.context + 64, *(n + 64 for n in args.prefill_lengths)])
    llm = LLM(model_dir, max_model_len=min(max_len, hf_config.max_position_embeddings), **lora_kwargs, **kwargs)
    floor = precision_floor(llm, hf_config, dtype, quantization, device, args.kv_cache_dtype)
    rows, results = [], {"floor": floor.as_dict()}

    def add(name: str, seconds: float, floor_seconds: Optional[float]) -> None:
        ratio = f"{seconds / floor_seconds:.2f}" if floor_seconds else ""
        rows.append((name, f"{seconds * 1000:.2f}", f"{floor_seconds * 1000:.2f}" if floor_seconds else "", ratio))
        results[name] = {"ms": seconds * 1000, "floor_ms": floor_seconds * 1000 if floor_seconds else None}

    def decode_floor(batch: int) -> float:
        """Weights and the batch's KV read once, or the batch's FLOPs, whichever is slower."""
        return floor.decode_seconds([args.decode_context] * batch)

    if "decode" in args.figures:
        for batch in args.batches:
            # The figure is timed bare; then two more runs time its parts: on its own path (clocks
            # around the native decoder layers and the LM head only), and on the per-op path (no native
            # decoder layers), with a clock around every linear and attention layer (about 150 per
            # SmolLM2 step), so its steps run longer: the difference is the Python those layers save.
            step = decode_step_seconds(llm, batch, args.decode_context, device)
            add(f"decode step, batch {batch} ({args.decode_context} ctx)", step, decode_floor(batch))
            for timer in (NativeStepTimer, ModelTimer):
                split: dict[str, list[float]] = {}
                timed_step = decode_step_seconds(llm, batch, args.decode_context, device, split=split, timer=timer)
                if timer is NativeStepTimer and not any(split["layers"]):
                    continue  # no native decoder layers ran (no kernels, or not a CPU)
                # The parts of the timed steps at or below their median (a step a neighbour preempted
                # puts its delay in a random part): their means add up to those steps' mean.
                calm = [i for i, t in enumerate(split["step"]) if t <= timed_step]
                calm_step = sum(split["step"][i] for i in calm) / len(calm)
                add(f"{timer.title} (the parts add up to it)", calm_step, None)
                for part, what in timer.labels.items():
                    seconds = sum(split[part][i] for i in calm) / len(calm)
                    add(f"  {what} ({100 * seconds / calm_step:.0f}%)", seconds, None)
    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    if "prefill" in args.figures:
        for length in args.prefill_lengths:
            # A first prefill of this length sets up what later ones reuse (oneDNN's primitives
            # for the new shapes, SDPA's buffers): it is warm-up, not the figure.
            llm.llm_engine.engine_core.reset_prefix_cache()
            timed_ttft(llm, conversation_ids(tokenizer, vocab, length, seed=2), None)
            seconds, same_minute = prefill_rounds(args, llm, tokenizer, vocab, length, floor, dtype, device)
            add(f"prefill {length} tokens", seconds, floor.seconds(length))
            # The same prefills, each against the matmul rate read just before and after it.
            add(f"  against the floor of its own minute ({args.prefill_rounds} rounds, median)", seconds,
                seconds / same_minute)
            results[f"prefill {length} tokens"]["x_floor_same_minute"] = same_minute
    if adapters:
        adapter_figures(args, llm, hf_config, dtype, floor, add, device)
    del llm
    gc.collect()
    return rows, results


def interleaved_decode(args, model_dir: str, kwargs: dict, device: str) -> tuple[list, dict]:
    """Batch-1 decode of every --precision, one engine each, timed in turns for --interleave
    rounds: a slow minute of a shared host slows every precision of that round alike, so the
    ratios to the first precision (the median of the rounds' own ratios) hold where absolute
    figures move 10-40% run to run. The bandwidth is measured before and after each timing and
    every floor takes the fastest measured in the run: a floor from a slow minute at the start put
    figures from faster minutes under it (0.88-0.92x on Granite-3.3-2B's shapes on one Zen 3 VM).
    That floor is the machine's best minute against the steps' median one, so each timing is also
    put against its own minute's floor (the faster of the reads just before and after it): the
    median of those ratios is "x floor, same minute" (on a Zen 4 VM whose reads moved 33-70 GB/s
    from one minute to the next, the two columns parted by up to 1.5x).
    Each engine gets a small KV cache (INTERLEAVE_KV_BYTES) so that all fit in memory at once."""
    hf_config = load_hf_config(model_dir)
    engines = {}
    for precision in args.precision:
        kw, dtype, quantization = precision_engine(args, precision, model_dir,
                                                   dict(kwargs, kv_cache_memory_bytes=INTERLEAVE_KV_BYTES))
        # Room for the one timed request only, so a 2B model's cache fits in INTERLEAVE_KV_BYTES too.
        llm = LLM(model_dir, max_model_len=min(args.decode_context + 64, hf_config.max_position_embeddings), **kw)
        # A batch-1 decode's floor is its bytes; the matmul rate, measured at 2,048 rows, would take
        # minutes per precision on a 2B model in emulated bf16, so it is measured at 128 here.
        floor = precision_floor(llm, hf_config, dtype, quantization, device, args.kv_cache_dtype, num_tokens=128)
        engines[precision] = (llm, floor)
    times = {precision: [] for precision in engines}
    same_minute = {precision: [] for precision in engines}  # each timing / its own minute's floor
    with floor_clock():
        before = measured_bandwidth(device)
    bandwidth = max([before] + [floor.bandwidth for _, floor in engines.values()])
    for _ in range(args.interleave):
        for precision, (llm, floor) in engines.items():
            times[precision].append(decode_step_seconds(llm, 1, args.decode_context, device))
            with floor_clock():
                after = measured_bandwidth(device)
            minute_floor = floor.decode_seconds([args.decode_context], bandwidth=max(before, after))
            same_minute[precision].append(times[precision][-1] / minute_floor)
            bandwidth, before = max(bandwidth, after), after  # the floors read at the run's fastest minute
    for _, floor in engines.values():
        floor.bandwidth = bandwidth
    first = args.precision[0]
    rows, results = [], {}
    for precision, (_, floor) in engines.items():
        step, floor_s = median(times[precision]), floor.decode_seconds([args.decode_context])
        speedup = median([a / b for a, b in zip(times[first], times[precision])])
        rows.append((precision, f"{step * 1000:.2f}",
                     f"{min(times[precision]) * 1000:.2f}-{max(times[precision]) * 1000:.2f}",
                     f"{floor_s * 1000:.2f}", f"{step / floor_s:.2f}", f"{median(same_minute[precision]):.2f}",
                     f"{speedup:.2f}"))
        results[precision] = {"ms": [t * 1000 for t in times[precision]], "floor_ms": floor_s * 1000,
                              "floor_bandwidth_bytes_per_s": floor.bandwidth, f"speedup_over_{first}": speedup,
                              "x_floor_same_minute": same_minute[precision]}
    return rows, results


def prefill_rounds(args, llm: LLM, tokenizer, vocab: int, length: int, floor: Floor, dtype: torch.dtype,
                   device: str) -> tuple[float, float]:
    """(median seconds, median of each prefill over the floor of its own minute) of
    --prefill-rounds prefills of `length` fresh tokens, the matmul rate on the model's shapes read
    before and after each (the faster of the two sets its floor). A prefill's floor is FLOPs over
    that rate, and this host's rate moves with its neighbours: the run's best reading against a
    prefill of a slow minute (or the reverse) mixes the host into the engine's figure."""
    shapes = linear_shapes(floor.hf_config)
    with floor_clock():
        before = measured_matmul_flops(shapes, 2048, dtype, device)
    times, same_minute = [], []
    for r in range(args.prefill_rounds):
        llm.llm_engine.engine_core.reset_prefix_cache()
        seconds, _ = timed_ttft(llm, conversation_ids(tokenizer, vocab, length, seed=1 + r), None)
        with floor_clock():
            after = measured_matmul_flops(shapes, 2048, dtype, device)
        times.append(seconds)
        same_minute.append(seconds / floor.prefill_seconds([(length, 0)], flops=max(before, after)))
        before = after
    return median(times), median(same_minute)


def adapter_figures(args, llm: LLM, hf_config, dtype: torch.dtype, floor: Floor, add, device: str) -> None:
    """aLoRA and plain-LoRA time to first token after a base conversation, and decode of a
    batch mixing base, LoRA and aLoRA requests against base only."""
    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    root = tempfile.mkdtemp(prefix="vllm-engine-steps-")
    # A 16-token invocation: a special-token start, then ordinary tokens.
    invocation = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    invocation += conversation_ids(tokenizer, vocab, args.invocation_len + 8, seed=7)[-args.invocation_len:]
    invocation = invocation[: args.invocation_len]
    alora_dir, lora_dir = write_adapter_pair(root, hf_config, "certainty", args.rank, ALL_TARGETS, 0, invocation, dtype)
    alora, lora = LoRARequest("alora-certainty", 1, alora_dir), LoRARequest("lora-certainty", 2, lora_dir)
    for adapter in (alora, lora):  # loaded and run once, so no timed call pays for reading an adapter
        ttft(llm, conversation_ids(tokenizer, vocab, 64, seed=3) + invocation, adapter)
    conversation = conversation_ids(tokenizer, vocab, args.context, seed=1)
    llm.llm_engine.engine_core.reset_prefix_cache()
    seconds, _ = timed_ttft(llm, conversation, None)
    add(f"prefill {args.context} tokens (base turn)", seconds, floor.seconds(args.context))
    prompt = conversation + invocation
    alora_ttft, cached = timed_ttft(llm, prompt, alora)
    add(f"aLoRA TTFT after the base turn ({cached} cached)", alora_ttft, floor.seconds(len(prompt) - cached, cached))
    lora_ttft, _ = timed_ttft(llm, prompt, lora)
    add("plain-LoRA TTFT, same conversation", lora_ttft, floor.seconds(len(prompt)))

    mixed = AdapterRequests([None, lora, alora])
    mixed.invocation = invocation
    base_step = decode_step_seconds(llm, 63, args.decode_context, device)
    mixed_step = decode_step_seconds(llm, 63, args.decode_context, device, mixed)
    add("decode step, 63 base", base_step, floor.decode_seconds([args.decode_context] * 63))
    add("decode step, 21 base + 21 LoRA + 21 aLoRA", mixed_step, floor.decode_seconds([args.decode_context] * 63))
    print(f"aLoRA TTFT is {lora_ttft / alora_ttft:.1f}x lower than plain LoRA's; "
          f"mixed-adapter decode throughput is {base_step / mixed_step:.2f} of base-only")


def timed_ttft(llm: LLM, prompt: list[int], lora: Optional[LoRARequest]) -> tuple[float, int]:
    """ttft's figure; under --clock cpu the CPU time of the whole call instead (one token out),
    since the request's own metric is wall time."""
    if clock is CLOCKS["wall"]:
        return ttft(llm, prompt, lora)
    start = clock()
    _, cached = ttft(llm, prompt, lora)
    return clock() - start, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny 2-layer Llama instead of --model")
    parser.add_argument("--precision", nargs="+", default=None, choices=list(PRECISIONS),
                        help="one table per precision (default: the --dtype / engine default only); int8 and "
                             "int4 quantize the --dtype model at load (quantization=)")
    parser.add_argument("--figures", nargs="+", default=list(FIGURES), choices=FIGURES,
                        help="decode: decode steps (batch 1 split into model and engine time); prefill: "
                             "--prefill-lengths; adapters: aLoRA/LoRA TTFT and mixed-adapter decode")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64], help="decode-step batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="conversation tokens (adapters figures)")
    parser.add_argument("--prefill-lengths", nargs="+", type=int, default=[2048], help="prefill lengths to time")
    parser.add_argument("--prefill-rounds", type=int, default=3,
                        help="prefills timed per length, each between two readings of the matmul rate")
    parser.add_argument("--decode-context", type=int, default=512, help="context of the decode-step batches")
    parser.add_argument("--invocation-len", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="batch-1 decode of every --precision (two or more), one engine each, timed in "
                             "turns for ROUNDS rounds; reports each precision's speed-up over the first")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                        help="the engines' KV cache (the engine option of that name) and the floors' KV bytes")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="decode/prefill and their floors timed in wall time or in CPU time (with "
                             "--threads 1: immune to a busy machine)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (the CPU time of several threads adds up)")
    global clock
    clock = CLOCKS[args.clock]
    if args.precision and args.dtype and any(PRECISIONS[p][0] for p in args.precision):
        parser.error("--dtype only sets the model dtype of int8/int4; fp32 and bf16 in --precision set their own")
    device = default_device()
    if args.tiny:
        kwargs = engine_kwargs(args)
        model_dir = tiny_checkpoint(tempfile.mkdtemp(prefix="vllm-engine-steps-tiny-"))
    else:
        model_dir, kwargs = resolve_model(args)
    kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    name = load_hf_config(model_dir).architectures[0] + (" (tiny)" if args.tiny else "")
    results = {"device": device, "machine": machine_load(), "model": name, "clock": args.clock}
    if args.interleave:
        if not args.precision or len(args.precision) < 2:
            parser.error("--interleave needs two or more --precision values")
        rows, results["interleaved"] = interleaved_decode(args, model_dir, kwargs, device)
        columns = ("precision", "ms (median)", "range", "floor ms", "x floor", "x floor, same minute",
                   f"x faster than {args.precision[0]}")
        print_table(f"Batch-1 decode ({args.decode_context} ctx), {device}, {name}, {args.interleave} rounds in turns, "
                    f"{torch.get_num_threads()} threads, {args.clock} time", rows, columns)
    for precision in [] if args.interleave else args.precision or [None]:
        rows, results[precision or "default"] = run_precision(args, precision, model_dir, kwargs, device)
        label = precision or str(engine_dtype(args, model_dir)).removeprefix("torch.")
        if precision == "bf16" and device == "cpu" and not cpu_has_native_bf16():
            label += " (emulated: this CPU has neither AVX512-BF16 nor AMX)"
        print_table(f"Engine end to end, {device}, {name} {label}, {torch.get_num_threads()} threads, "
                    f"{args.clock} time",
                    rows, ("figure", "ms", "floor ms", "x floor"))
    results["machine_after"] = machine_load()
    print(f"{load_line(results['machine'])}; after: {load_line(results['machine_after'])}")
    save_json(args.json, results)


if __name__ == "__main__":
    main()
