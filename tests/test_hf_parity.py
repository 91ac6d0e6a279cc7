"""The JAX model against HF transformers (fixtures from scripts/make_hf_fixtures.py, transformers 5.17 /
torch 2.11 CPU), fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kv import contiguous_batch, empty_kv_cache
from models.model import jit_forward, matmul_precision, prefill_logits
from pallas_kernels.policy import DEFAULT_POLICY
from tests.helpers import hf_model, reference, rel_err

TOL = 1e-5
# Parity at TOL holds only while no top-k decision (indexer keys, router experts) in the references sits
# on a near-tie: our paths and HF's agree to ~1e-6 relative, and a tie broken differently changes every
# later position of that row. The generator redraws inputs until the narrowest margin clears this.
MIN_TOPK_MARGIN = 1e-5
MODELS = ("glm_tiny", "glm_indexcache", "dsv32_tiny")
PATHS = ("expanded", "absorbed")
WORST: dict = {}


def _record(key, err):
    WORST[key] = max(WORST.get(key, 0.0), err)
    print(f"{key}: rel err {err:.2e}")


@pytest.fixture(autouse=True)
def _report_errors(request):
    """Attach the errors to the test report, so the summary (conftest) sees them from any worker."""
    WORST.clear()
    yield
    request.node.user_properties.extend((f"rel_err/{k}", v) for k, v in WORST.items())


@pytest.mark.parametrize("name", MODELS + ("glm_tiny_fp8",))
def test_fixtures_are_clear_of_topk_near_ties(name):
    """The margin the parity tests rely on, recorded by the generator for these inputs (a fixture made
    without the check, like the one whose position 38 tied at 8.5e-7, fails here)."""
    assert float(reference(name)["topk_margin"]) >= MIN_TOPK_MARGIN


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODELS + ("glm_tiny_fp8",))
def test_prefill_logits_match_hf(name, path):
    ref = reference(name)
    logits = np.asarray(prefill_logits(hf_model(name), ref["prefill_tokens"], attn_path=path))
    err = rel_err(logits, ref["prefill_logits"])
    _record(f"prefill/{name}/{path}", err)
    assert err <= TOL, f"{name} {path}: rel err {err:.3e}"
    assert (logits.argmax(-1) == ref["prefill_logits"].argmax(-1)).all()


def decode_logits(model, tokens, prefill_len, path, index_dtype="same", kernels=DEFAULT_POLICY):
    """Prefill `prefill_len` tokens, then one token per step through the cache."""
    tokens = np.asarray(tokens)
    B, total = tokens.shape
    table = 1 + np.arange(B)[:, None] * total + np.arange(total)[None]
    cache = empty_kv_cache(model.cfg, 1 + B * total, model.dtype, index_dtype)
    fwd = jit_forward(model, attn_path=path, kernels=kernels)
    out, cache = fwd(contiguous_batch(tokens[:, :prefill_len], 0, table), cache)
    steps = [np.asarray(out)]
    for s in range(prefill_len, total):
        out, cache = fwd(contiguous_batch(tokens[:, s:s + 1], s, table), cache)
        steps.append(np.asarray(out))
    return np.concatenate(steps, axis=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MODELS)
def test_decode_steps_match_hf(name, path):
    ref = reference(name)
    logits = decode_logits(hf_model(name), ref["decode_tokens"], int(ref["decode_prefill_len"]), path)
    err = rel_err(logits, ref["decode_logits"])
    _record(f"decode/{name}/{path}", err)
    assert err <= TOL, f"{name} {path}: rel err {err:.3e}"


@pytest.mark.parametrize("name", MODELS)
def test_mtp_layer_matches_definition(name):
    """h' = eh_proj(cat(enorm(embed(t[i+1])), hnorm(h_i))) -> decoder layer -> shared_head (torch ref)."""
    ref = reference(name)
    model = hf_model(name)
    toks = ref["mtp_tokens"]
    B, T = toks.shape[0], toks.shape[1] - 1
    batch = contiguous_batch(toks[:, :T])
    hidden, _ = jit_forward(model, with_logits=False)(batch, empty_kv_cache(model.cfg, 1 + B * T, model.dtype))
    draft_cache = empty_kv_cache(model.cfg, 1 + B * T, model.dtype, num_layers=1, num_full=1)
    for path in PATHS:
        with jax.default_matmul_precision(matmul_precision(model.dtype)):
            logits, _, _ = model.mtp_forward(hidden, jnp.asarray(toks[:, 1:]), batch, draft_cache,
                                             attn_path=path)
        err = rel_err(logits, ref["mtp_logits"])
        _record(f"mtp/{name}/{path}", err)
        assert err <= TOL, f"{name} {path}: rel err {err:.3e}"


def test_sparse_selection_is_real():
    """Counter-check that the parity tests can fail: attending to every key (index_topk >= T) instead of
    the top-16 moves the logits far from HF's."""
    ref = reference("glm_tiny")
    model = hf_model("glm_tiny")
    dense = type(model)(model.cfg.replace(index_topk=10_000), rngs=__import__("flax").nnx.Rngs(0))
    from flax import nnx
    nnx.update(dense, nnx.state(model))
    logits = np.asarray(prefill_logits(dense, ref["prefill_tokens"]))
    assert rel_err(logits, ref["prefill_logits"]) > 1e-2
    assert rel_err(logits[:, :16], ref["prefill_logits"][:, :16]) <= TOL  # first 16 positions see all keys


def test_fp8_index_cache_decode_equals_fp8_prefill():
    """fp8 indexer keys are not an HF-parity property (a 1/16 quantization step flips near-tied top-k
    choices in a random model), so the fp8 cache is checked against itself computed another way: step
    decode through the cache equals a one-shot prefill that quantizes the same keys."""
    ref = reference("glm_tiny")
    model = hf_model("glm_tiny")
    toks = ref["decode_tokens"]
    step = decode_logits(model, toks, int(ref["decode_prefill_len"]), "absorbed", index_dtype="fp8")
    full = np.asarray(prefill_logits(model, toks, attn_path="expanded", index_dtype="fp8"))
    assert rel_err(step, full) <= TOL
    exact = np.asarray(prefill_logits(model, toks))
    assert rel_err(full, exact) > 1e-3  # the fp8 path really quantized


def test_fp8_index_key_roundtrip_bound():
    from pallas_kernels.indexer import dequantize_index_k, quantize_index_k
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 128)).astype(np.float32) * rng.uniform(0.01, 100, size=(512, 1))
    q, scale = quantize_index_k(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (512,)
    assert q.nbytes // 512 + scale.nbytes // 512 == 132  # 128 fp8 + one fp32 scale per token
    y = np.asarray(dequantize_index_k(q, scale))
    # e4m3: 3 mantissa bits -> relative rounding <= 2^-4; below the normal range, half a subnormal step
    # (2^-10 in units of the per-token scale amax/448).
    bound = np.abs(x) / 16 + np.abs(x).max(-1, keepdims=True) / 448 * 2.0 ** -10
    assert (np.abs(y - x) <= bound + 1e-12).all()


def test_bf16_compute_runs_close():
    """--dtype bfloat16 on an fp32 checkpoint: params and compute in bf16. Parity is an fp32 property:
    bf16 flips near-tied top-k choices, so closeness is checked on the first index_topk positions,
    where every visible key is selected and no choice can flip."""
    ref = reference("glm_tiny")
    model = hf_model("glm_tiny", "bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    logits = np.asarray(prefill_logits(model, ref["prefill_tokens"]))
    assert np.isfinite(logits).all()
    k = model.cfg.index_topk
    assert 1e-4 < rel_err(logits[:, :k], ref["prefill_logits"][:, :k]) < 0.05


def test_default_dtype_is_checkpoint_dtype():
    assert hf_model("glm_tiny").embed_tokens[...].dtype == jnp.float32
