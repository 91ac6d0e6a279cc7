#!/usr/bin/env bash
# The kernels lowered for CUDA under the oldest jax pyproject allows (the GPU box's 0.11.2; CI and
# make venv run 0.12), on this CPU machine: Mosaic GPU's lowering differs between them (0.11.2 refuses
# an optimized load from global memory that 0.12 accepts), so run this before a device call that
# times new kernel code. Runs every `lower_for_cuda` test in a venv of its own (kept in $VENV).
#   scripts/check_jax_floor.sh [JAX_VERSION]     (default 0.11.2; needs pip access to PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-0.11.2}
VENV=${VENV:-/tmp/cpkv-jax-$V}
[ -x "$VENV/bin/python" ] || "$(scripts/find_python.sh)" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "jax==$V" "jaxlib==$V" "flax==0.12.10" numpy ml_dtypes safetensors tqdm \
  tokenizers "orbax-checkpoint>=0.12.4,<=0.12.8" pytest pytest-xdist hypothesis
JAX_PLATFORMS=cpu PYTHONPATH=. "$VENV/bin/python" -m pytest -q -p no:cacheprovider -k lower_for_cuda \
  tests/test_moe_kernels.py tests/test_fp8_linear.py tests/test_kernels.py tests/test_sparse_mla.py
