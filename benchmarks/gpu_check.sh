#!/usr/bin/env bash
# One run on a GPU session (an H200): first every Triton kernel compiled ahead of time for
# sm_80 and sm_90 at every launched specialization (no device needed: the committed record
# vouches for most, the sample and anything new compiles here),
# then every Triton kernel against its torch reference and
# its floor (compiled for the GPU, on fresh random bf16 inputs), then engine parity in bf16
# against transformers+PEFT on the device with CUDA graphs on against off (a representative
# set of architectures: dense, sliding window, MoE), then the engine end to end on a
# Granite-3.3-8B-shaped model with random bf16 weights, and with two or more GPUs tensor
# parallelism over NCCL (TP=2 against TP=1, CUDA graphs captured per rank). Prints the tables; meant to stay
# under 8 minutes. Run from the repository root: bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
python benchmarks/triton_aot.py --ci || status=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || exit 1
python benchmarks/kernels.py || status=1
python -m benchmarks.gpu_parity --arch llama qwen3 mistral_window gemma2 gemma3 gpt_oss mixtral || status=1
python -m benchmarks.engine_steps --granite-8b-dummy --json /tmp/engine_steps.json || status=1
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  python -m pytest -q tests/distributed/test_tensor_parallel.py || status=1
else
  echo "tensor parallelism over NCCL: skipped ($gpus GPU; it needs 2)"
fi
exit "$status"
