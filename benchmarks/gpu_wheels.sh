#!/usr/bin/env bash
# The wheels the lent GPU machine's image lacks, fetched here (it reaches no registry) into
# .device/wheels (ignored by git: add `/.device/` to .git/info/exclude) for the device tool's
# `carry`. The image (see the device tool's KINDS.md) has Python 3.12, torch 2.11, triton 3.6
# and transformers 5.17 but no pydantic, xgrammar or gguf (engine dependencies); transformers
# and PEFT are lifted to the versions CI's references run (5.17 gave Gemma 2 SDPA attention
# without its soft cap and hard-coded gpt-oss's SwiGLU clamp). On the device:
#   python3 -m pip install -q --no-deps --no-index .device/wheels/*.whl && bash benchmarks/gpu_check.sh --no-aot
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/wheels
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .device/wheels \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 gguf==0.19.0 \
  transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 httpx2==2.16.2 httpcore2==2.16.2 tomlkit==0.15.3 \
  truststore==0.10.5 peft==0.21.2
du -sh .device/wheels
