#!/usr/bin/env bash
# One run on a GPU session (an H200): first every Triton kernel compiled ahead of time for
# sm_80 and sm_90 at every launched specialization (no device needed: the committed record
# vouches for most, the sample and anything new compiles here; --no-aot skips it where the
# device's triton differs from CI's, which would make the record stale and compile all 1,674),
# then every Triton kernel against its torch reference and
# its floor (compiled for the GPU, on fresh random bf16 inputs), then engine parity in bf16
# against transformers+PEFT on the device with CUDA graphs on against off (a representative
# set of architectures: dense, sliding window, MoE), then the engine end to end on a
# Granite-3.3-8B-shaped model with random bf16 weights, and with two or more GPUs tensor
# parallelism over NCCL (TP=2 against TP=1, CUDA graphs captured per rank). Prints the tables; meant to stay
# under 8 minutes, each step under its own time limit so one hang cannot eat the lease.
# Logs and the engine_steps JSON go to $OUT when set (the device tool's folder), else /tmp.
# Run from the repository root: bash benchmarks/gpu_check.sh [--no-aot]
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
status=0
step() {  # step SECONDS NAME COMMAND...: run one check under its limit, its log under $out
  local limit=$1 name=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (exit $rc)"; status=1; }
}
[ "${1:-}" = "--no-aot" ] || step 300 triton_aot "$py" benchmarks/triton_aot.py --ci
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || exit 1
step 200 gpu_parity "$py" -m benchmarks.gpu_parity --arch llama qwen3 mistral_window gemma2 gemma3 gpt_oss mixtral
step 120 triton_kernels "$py" -m benchmarks.triton_kernels
step 150 engine_steps "$py" -m benchmarks.engine_steps --granite-8b-dummy --json "$out/engine_steps.json"
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  step 300 tensor_parallel "$py" -m pytest -q tests/distributed/test_tensor_parallel.py
else
  echo "tensor parallelism over NCCL: skipped ($gpus GPU; it needs 2)"
fi
exit "$status"
