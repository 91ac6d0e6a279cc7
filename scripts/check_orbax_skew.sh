#!/usr/bin/env bash
# Checkpoints travel between the oldest and newest orbax-checkpoint that pyproject allows: converts the
# fp8 fixture with each, loads it with the other and compares the logits with HF's reference.
#   scripts/check_orbax_skew.sh [OLD_VERSION]     (default 0.12.4; needs pip access to PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-0.12.4}
PY=.venv/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
$PY -m pip download -q --no-deps "orbax-checkpoint==$OLD" -d "$WORK/whl"
$PY -m pip install -q --no-deps --target "$WORK/old" "$WORK"/whl/*.whl
export JAX_PLATFORMS=cpu
check='
import sys, numpy as np, orbax.checkpoint as o
from models.weights import load_checkpoint
from models.model import prefill_logits
from tests.helpers import reference
ref = reference("glm_tiny_fp8")
err = np.abs(np.asarray(prefill_logits(load_checkpoint(sys.argv[1]), ref["prefill_tokens"])) - ref["prefill_logits"]).max()
err /= np.abs(ref["prefill_logits"]).max()
print(f"orbax {o.__version__} loads {sys.argv[1]}: rel err {err:.2e}")
assert err <= 1e-5'
$PY -m cpkv_jax.cli convert --hf tests/fixtures/glm_tiny_fp8 --out "$WORK/new" --quiet > /dev/null
PYTHONPATH="$WORK/old:$PWD" $PY -c "$check" "$WORK/new"
PYTHONPATH="$WORK/old:$PWD" $PY -m cpkv_jax.cli convert --hf tests/fixtures/glm_tiny_fp8 --out "$WORK/old_ck" --quiet > /dev/null
PYTHONPATH="$PWD" $PY -c "$check" "$WORK/old_ck"
