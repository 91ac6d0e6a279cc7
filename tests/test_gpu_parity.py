"""HF parity on the GPU (run through the device tool: `JAX_PLATFORMS=cuda pytest -m gpu`). fp32 models
must compute in true fp32 there (models.model.matmul_precision); TF32 would flip top-k choices."""

import jax
import numpy as np
import pytest

from models.model import prefill_logits
from tests.helpers import hf_model, reference, rel_err
from tests.test_hf_parity import MODELS, PATHS, TOL, decode_logits

pytestmark = pytest.mark.gpu


def test_running_on_gpu():
    assert jax.default_backend() == "gpu", "gpu tests must run with JAX_PLATFORMS=cuda on a GPU machine"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODELS)
def test_gpu_prefill_and_decode_match_hf(name, path):
    assert jax.default_backend() == "gpu"
    ref = reference(name)
    model = hf_model(name)
    err = rel_err(prefill_logits(model, ref["prefill_tokens"], attn_path=path), ref["prefill_logits"])
    print(f"gpu prefill {name}/{path}: rel err {err:.2e}")
    assert err <= TOL
    dec = decode_logits(model, ref["decode_tokens"], int(ref["decode_prefill_len"]), path)
    err = rel_err(dec, ref["decode_logits"])
    print(f"gpu decode {name}/{path}: rel err {err:.2e}")
    assert err <= TOL
    assert np.isfinite(dec).all()
