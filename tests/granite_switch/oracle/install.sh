#!/usr/bin/env bash
# Create (or verify) the granite-switch oracle environment used by tests/granite_switch.
#
# Owns <repo>/.venv-granite-switch: a venv made with --system-site-packages so it
# reuses the system torch (CPU) and peft, plus the pins below, which shadow the
# system's newer transformers/huggingface-hub inside the venv only. granite-switch
# 0.1.1 requires transformers>=5.16,<=5.17, hence a separate environment.
#
# Idempotent: when the venv exists and already has the pinned versions it only
# checks them (well under a second) and exits 0. Exits non-zero on any failure.
# Env overrides: PYTHON (interpreter to base the venv on, default python3),
# GRANITE_SWITCH_VENV (venv path).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="${GRANITE_SWITCH_VENV:-$REPO_ROOT/.venv-granite-switch}"
PYTHON="${PYTHON:-python3}"

# Exact pins for what the system environment lacks (or has at an incompatible
# version). setuptools is pinned for the venv only. torch, peft, tokenizers, safetensors, numpy, pyyaml, tqdm, jinja2 and
# packaging come from the system site-packages.
PINS=(
    "transformers==5.17.0"
    "granite-switch[compose]==0.1.1"
    "huggingface-hub==1.33.0"
    # torch needs setuptools>=77 and the venv's bundled one (65.x) shadows the system's.
    "setuptools==84.2.1"
)

check_venv() {
    "$VENV/bin/python" - <<'EOF'
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

want = {"transformers": "5.17.0", "granite-switch": "0.1.1", "huggingface-hub": "1.33.0",
        "setuptools": "84.2.1"}
bad = []
for name, ver in want.items():
    try:
        got = version(name)
    except PackageNotFoundError:
        got = None
    if got != ver:
        bad.append(f"{name}=={got} (want {ver})")
for name in ("torch", "peft", "tokenizers", "safetensors", "numpy", "yaml", "tqdm", "jinja2"):
    if importlib.util.find_spec(name) is None:
        bad.append(f"{name} missing")
if bad:
    print("granite-switch oracle venv incomplete: " + ", ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF
}

if [[ -x "$VENV/bin/python" ]] && check_venv 2>/dev/null; then
    echo "granite-switch oracle venv ready: $VENV"
    exit 0
fi

command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found" >&2; exit 1; }
"$PYTHON" - <<'EOF' || { echo "error: $PYTHON needs torch>=2.11 and peft installed (the venv reuses them)" >&2; exit 1; }
import sys
import torch, peft  # noqa: F401
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) and sys.version_info >= (3, 11) else 1)
EOF

echo "Creating granite-switch oracle venv at $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
# Keep the venv out of git (Python 3.13+ venv does this itself; 3.11 does not).
printf '*\n' > "$VENV/.gitignore"

# --upgrade-strategy only-if-needed (the default) keeps system torch/peft: pip sees
# them through the system site-packages and they satisfy the requirements.
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q "${PINS[@]}"

# Never let the venv pull its own torch (e.g. a CUDA build).
"$VENV/bin/python" - <<EOF
import torch, sys
if not torch.__file__.startswith("$VENV"):
    sys.exit(0)
print("error: pip installed a torch into the venv: " + torch.__file__, file=sys.stderr)
sys.exit(1)
EOF

check_venv
echo "granite-switch oracle venv ready: $VENV"
