"""Shared pieces of the benchmarks: model choice, prompt generation, random PEFT
adapters written directly (no PEFT model needed, so 8B shapes are cheap), the
machine's measured matmul rate, and table printing.

Every benchmark reports ratios measured within one run (against a reference run in
the same process or against the physical floor), never a lone absolute time.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from typing import Optional

import torch
from safetensors.torch import save_file

GRANITE_8B_SHAPE = dict(
    architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096, intermediate_size=12800,
    num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=49159,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0, tie_word_embeddings=True,
    embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=16.0,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="bfloat16",
)
# Granite-3.3-2B's shapes: a model a laptop runs, whose linears dominate a decode step (on the
# packaged 135M model the embedding-sized LM head and the KV weigh as much as the linears).
GRANITE_2B_SHAPE = {**GRANITE_8B_SHAPE, "hidden_size": 2048, "intermediate_size": 8192,
                    "attention_multiplier": 0.015625, "logits_scaling": 8.0}
DUMMY_SHAPES = {"granite-3.3-8b": GRANITE_8B_SHAPE, "granite-3.3-2b": GRANITE_2B_SHAPE}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def dummy_dir(root: str, shape: str) -> str:
    """A folder with the config of DUMMY_SHAPES[shape] and the default model's tokenizer
    (token ids are random anyway): for `load_format="dummy"` runs."""
    from vllm.model_executor.default_model import ensure_default_model

    path = os.path.join(root, f"{shape}-shape")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(DUMMY_SHAPES[shape], f)
    source = ensure_default_model()
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            with open(os.path.join(source, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def random_prompts(vocab_size: int, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int = 0, lengths: str = "uniform") -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs with lengths in the ranges: "uniform",
    or "longtail" (log-normal, median near the low end with a long tail up to the high
    end, like chat traffic such as ShareGPT's)."""
    rng = random.Random(seed)
    low = min(100, vocab_size - 1)

    def length(lo: int, hi: int) -> int:
        if lengths == "uniform":
            return rng.randint(lo, hi)
        median = lo + (hi - lo) / 8
        return int(min(max(rng.lognormvariate(math.log(median), 0.8), lo), hi))

    pairs = []
    for _ in range(n):
        prompt_len, output_len = length(*input_range), length(*output_range)
        pairs.append(([rng.randrange(low, vocab_size) for _ in range(prompt_len)], output_len))
    return pairs


def write_random_adapter(path: str, hf_config, rank: int, targets: list[str], seed: int,
                         invocation_tokens: Optional[list[int]] = None, dtype=torch.float32,
                         b_std: float = 0.01) -> str:
    """A PEFT-format LoRA (or aLoRA) adapter for `hf_config`: A ~ N(0, 1/in), B ~ N(0, b_std^2)."""
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h = hf_config.hidden_size
    head = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head, hf_config.num_key_value_heads * head
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, hf_config.intermediate_size), "up_proj": (h, hf_config.intermediate_size),
              "down_proj": (hf_config.intermediate_size, h)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in targets:
            parent = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            n_in, n_out = shapes[name]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * b_std).to(dtype)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
              "task_type": "CAUSAL_LM", "bias": "none", "alora_invocation_tokens": invocation_tokens}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def measured_matmul_flops(shapes: list[tuple[int, int]], num_tokens: int, dtype: torch.dtype, device: str) -> float:
    """FLOP/s of this machine on the model's own linear shapes ([tokens, in] x [in, out]),
    with the fastest implementation available here: F.linear, and on CPU also oneDNN
    with pre-packed weights wherever it packs the dtype (whether or not the engine uses it),
    and bf16 widened to fp32 tiles where bf16 matmuls are emulated (what the engine runs), so
    the floor is never flattering."""
    from vllm.model_executor.layers import dense_gemv
    from vllm.model_executor.layers.linear import onednn_linear, pack_onednn_weight
    from vllm.platforms import onednn_packs

    use_onednn = device == "cpu" and onednn_packs(dtype)
    total_flops, total_time = 0.0, 0.0
    for n_in, n_out in shapes:
        x = torch.randn(num_tokens, n_in, dtype=dtype, device=device)
        w = torch.randn(n_out, n_in, dtype=dtype, device=device)
        candidates = [lambda: torch.nn.functional.linear(x, w)]
        if use_onednn:
            packed = pack_onednn_weight(w, num_tokens)
            candidates.append(lambda: onednn_linear(x, packed, None))
        if device == "cpu" and dense_gemv.uses_widened(x, w):  # bf16 without native bf16: fp32 tiles
            candidates.append(lambda: dense_gemv.widened_linear(x, w, None))
        best = min(best_time(fn, device) for fn in candidates)
        total_time += best
        total_flops += 2.0 * num_tokens * n_in * n_out
    return total_flops / total_time


def best_time(fn, device: str, reps: int = 5) -> float:
    """Fastest of `reps` timed calls after one warm-up call (seconds)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def linear_shapes(hf_config) -> list[tuple[int, int]]:
    h = hf_config.hidden_size
    head = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head, hf_config.num_key_value_heads * head
    i = hf_config.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def forward_flops(hf_config, num_tokens: int, context: int = 0) -> float:
    """FLOPs of a forward pass over `num_tokens` new tokens after `context` cached ones
    (linear layers plus causal attention; the LM head only for the last token)."""
    linear = sum(a * b for a, b in linear_shapes(hf_config)) * hf_config.num_hidden_layers
    h = hf_config.num_attention_heads * (getattr(hf_config, "head_dim", None) or
                                         hf_config.hidden_size // hf_config.num_attention_heads)
    attention_pairs = num_tokens * context + num_tokens * (num_tokens + 1) / 2
    attention = 4.0 * attention_pairs * h * hf_config.num_hidden_layers
    return 2.0 * linear * num_tokens + attention + 2.0 * hf_config.hidden_size * hf_config.vocab_size


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_table(title: str, rows: list[tuple], headers: tuple) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def save_json(path: Optional[str], payload: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


# ----------------------------------------------------------------- shared by the aLoRA benchmarks
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INTRINSIC_NAMES = ["certainty", "answerability", "hallucination", "citation", "safety", "relevance", "context",
                   "query_rewrite"]


def add_model_args(parser) -> None:
    """The flags every benchmark shares: model choice, threads, JSON output."""
    parser.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--granite-8b-dummy", dest="dummy", action="store_const", const="granite-3.3-8b",
                        help="Granite-3.3-8B shapes, random bf16 weights (load_format=dummy; for a GPU)")
    shapes.add_argument("--granite-2b-dummy", dest="dummy", action="store_const", const="granite-3.3-2b",
                        help="Granite-3.3-2B shapes, random bf16 weights (load_format=dummy; a CPU's size)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: the engine's, fp32 on CPU and bf16 on GPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", default=None, help="write results to this JSON file")


def engine_kwargs(args) -> dict:
    """LLM kwargs of --dtype / --threads; --threads also sets this process's torch threads
    (the transformers side of a comparison runs here)."""
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    if args.threads:
        torch.set_num_threads(args.threads)
        kwargs["cpu_threads"] = args.threads  # the engine sets torch's threads itself: pass the choice on
    return kwargs


def resolve_model(args, root: Optional[str] = None) -> tuple[str, dict]:
    """(model folder, extra LLM kwargs) for --model / --granite-*-dummy / the default model."""
    kwargs = engine_kwargs(args)
    if args.dummy:
        return dummy_dir(root or _tmpdir(), args.dummy), {"load_format": "dummy", **kwargs}
    from vllm.model_executor.default_model import ensure_default_model

    return args.model or ensure_default_model(), kwargs


def engine_dtype(args, model_dir: str) -> torch.dtype:
    """The dtype the engine will run in (for adapters written ahead and for the floor): --dtype,
    else what dtype="auto" resolves to on this machine for the model's checkpoint (on a CPU: bf16
    for a bf16/fp16 checkpoint where the CPU has native bf16, else fp32)."""
    if args.dtype:
        return getattr(torch, args.dtype)
    from vllm.platforms import checkpoint_dtype, current_platform

    return current_platform(default_device()).auto_dtype(checkpoint_dtype(load_hf_config(model_dir)))


def server_flags(args) -> list[str]:
    """`vllm serve` flags for --granite-*-dummy / --dtype."""
    flags = ["--load-format", "dummy"] if args.dummy else []
    return flags + (["--dtype", args.dtype] if args.dtype else [])


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="vllm-bench-")


def load_hf_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def machine_load() -> dict:
    """The machine's state next to every number: load average and CPU count."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "commit": engine_commit()}


def engine_commit() -> str:
    """The engine's git commit (with "+dirty" when vllm/ has uncommitted changes): numbers
    belong to a version of the code."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vllm"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + ("+dirty" if dirty else "")


def load_line(load: dict) -> str:
    return (f"load average {load['loadavg_1m']:.2f}/{load['loadavg_5m']:.2f}/{load['loadavg_15m']:.2f} on "
            f"{load['cpus']} CPUs, {load['torch_threads']} torch threads, engine {load.get('commit', '?')}")


def invocation_ids(tokenizer, name: str) -> list[int]:
    """Invocation tokens of an intrinsic: the start of an assistant-like turn with the
    intrinsic's name as its role (the IBM Granite intrinsics style, in this tokenizer's
    chat markup when it has one)."""
    start = "<|im_start|>" if "<|im_start|>" in tokenizer.get_vocab() else "<|start_of_role|>"
    return tokenizer.encode(f"{start}{name}", add_special_tokens=False)


def turn_ids(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(user turn opening, end of turn + assistant opening, end of turn) in the chat markup."""
    if "<|im_start|>" in tokenizer.get_vocab():
        user, end, assistant = "<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n"
    else:
        user, end, assistant = "<|start_of_role|>user<|end_of_role|>", "<|end_of_text|>\n", \
            "<|start_of_role|>assistant<|end_of_role|>"
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return enc(user), enc(end) + enc(assistant), enc(end)


def conversation_ids(tokenizer, vocab_size: int, length: int, seed: int) -> list[int]:
    """A `length`-token chat prompt (user turn of random ordinary tokens, then the
    assistant opening) ready for the base model to answer. Random ids come from above
    the special tokens, so no invocation sequence occurs by chance."""
    user, closing, _ = turn_ids(tokenizer)
    rng = random.Random(seed)
    low = min(100, vocab_size - 1)
    body = [rng.randrange(low, vocab_size) for _ in range(max(1, length - len(user) - len(closing)))]
    return user + body + closing


def write_adapter_pair(root: str, hf_config, name: str, rank: int, targets: list[str], seed: int,
                       invocation: list[int], dtype=torch.float32) -> tuple[str, str]:
    """The same random weights twice: as an aLoRA (with `invocation`) and as a plain LoRA."""
    alora = write_random_adapter(os.path.join(root, f"alora-{name}"), hf_config, rank, targets, seed, invocation, dtype)
    lora = write_random_adapter(os.path.join(root, f"lora-{name}"), hf_config, rank, targets, seed, None, dtype)
    return alora, lora


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def weight_bytes(hf_config, dtype: torch.dtype) -> float:
    """Bytes of weights one forward step reads: every linear layer plus the LM head
    (the embedding rows it gathers are negligible)."""
    linear = sum(a * b for a, b in linear_shapes(hf_config)) * hf_config.num_hidden_layers
    head = hf_config.hidden_size * hf_config.vocab_size
    return float(linear + head) * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds in the KV cache, all layers."""
    head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head * \
        torch.empty((), dtype=dtype).element_size()


def measured_bandwidth(device: str, megabytes: int = 256) -> float:
    """Bytes/s this machine moves through memory: the faster of a read-only pass (what a decode
    step does: it reads weights and KV) and a copy (read + write counted). A floor at the copy
    rate alone was beaten (bf16 decode at 0.90x of it on a Zen 3 EPYC, where a read runs
    1.17-1.2x faster than a copy)."""
    return max(measured_read_bandwidth(device, megabytes), measured_copy_bandwidth(device, megabytes))


def measured_read_bandwidth(device: str, megabytes: int = 256) -> float:
    """Bytes/s of a large sum (every byte read once, nothing written): torch's, one sequential
    stream per thread, and on the CPU also benchmarks/stream_read.cpp's, each thread reading
    several streams pages apart as the decode kernels read weights (a Zen 3 core: 10-12 GB/s
    against 15-17); the faster."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    rate = src.numel() * 4 / _seconds_per_call(src.sum, device)
    stream_sum = _native_stream_sum() if device == "cpu" else None
    if stream_sum is not None:
        for streams in STREAM_COUNTS:
            rate = max(rate, src.numel() * 4 / _seconds_per_call(lambda: stream_sum(src, streams), device))
    return rate


STREAM_COUNTS = (1, 4, 8)  # streams per thread the native read tries


@functools.cache
def _native_stream_sum():
    """benchmarks/stream_read.cpp's stream_sum op, built once for this CPU (vllm/native_build.py),
    or None where it does not build (then floors use torch's read alone, with a warning)."""
    from vllm import native_build

    try:
        native_build.build_and_load("stream_read.cpp", "benchmark stream reader", folder=os.path.dirname(__file__))
    except Exception as e:  # noqa: BLE001 - no compiler: torch's rate still measures the machine
        print(f"warning: the native stream reader does not build here ({e}); floors use torch's read rate")
        return None
    return torch.ops.vllm_bench.stream_sum


def measured_copy_bandwidth(device: str, megabytes: int = 256) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _seconds_per_call(lambda: dst.copy_(src), device)


def _seconds_per_call(fn, device: str, reps: int = 5) -> float:
    """Mean seconds of `reps` calls after a warm-up call."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


class Floor:
    """The physical floor of forward passes on this machine: FLOPs over the measured
    matmul rate, or the bytes a step must read (every weight once, and the KV of every
    position attended to) over the measured bandwidth, whichever is larger."""

    def __init__(self, hf_config, dtype: torch.dtype, device: str, num_tokens: int = 2048, tries: int = 3,
                 kv_dtype: Optional[torch.dtype] = None):
        """kv_dtype: the KV cache's (--kv-cache-dtype), default `dtype`."""
        # Best of a few tries: on a shared machine a slow try measures the neighbours, not the hardware.
        self.hf_config = hf_config
        self.flops = max(measured_matmul_flops(linear_shapes(hf_config), num_tokens, dtype, device)
                         for _ in range(tries))
        self.bandwidth = max(measured_bandwidth(device) for _ in range(tries))
        self.bytes = weight_bytes(hf_config, dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(hf_config, kv_dtype or dtype)

    def seconds(self, num_tokens: int, context: int = 0) -> float:
        """One sequence: `num_tokens` new tokens after `context` cached ones."""
        return self.prefill_seconds([(num_tokens, context)])

    def prefill_seconds(self, sequences: list[tuple[int, int]], bandwidth: Optional[float] = None,
                        flops: Optional[float] = None) -> float:
        """One step over several sequences, each (new tokens, cached tokens). bandwidth, flops:
        bytes/s and FLOP/s in place of the measured `self.bandwidth` and `self.flops` (rates
        measured beside one figure)."""
        work = sum(forward_flops(self.hf_config, n, c) for n, c in sequences)
        kv = sum(n + c for n, c in sequences) * self.kv_bytes_per_token
        return max(work / (flops or self.flops), (self.bytes + kv) / (bandwidth or self.bandwidth))

    def decode_seconds(self, contexts: list[int], bandwidth: Optional[float] = None) -> float:
        """One decode step of a batch: a new token for each sequence of `contexts` tokens."""
        return self.prefill_seconds([(1, c) for c in contexts], bandwidth) if contexts else 0.0

    def as_dict(self) -> dict:
        return {"matmul_flops": self.flops, "bandwidth_bytes_per_s": self.bandwidth, "weight_bytes": self.bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token}


# ----------------------------------------------------------------- a local `vllm serve` for online runs
def launch_server(model_dir: str, extra_args: list[str], log_path: str, timeout: float = 600.0,
                  env: Optional[dict] = None):
    """Start `vllm serve model_dir ...` on a free local port and wait for /health.
    Returns (process, base URL); stop it with `stop_server`."""
    import subprocess
    import sys
    import urllib.request

    from vllm.executor.multiproc import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--port", str(port),
           "--host", "127.0.0.1", "--disable-uvicorn-access-log", *extra_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    print(f"server up at {url} (log: {log_path})")
                    return proc, url
        except OSError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"vllm serve did not become healthy within {timeout:.0f}s; see {log_path}")


def stop_server(proc) -> None:
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def openai_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url
