"""The mesh issue's paths on one GPU (run through the device tool: `JAX_PLATFORMS=cuda pytest -m gpu`):
the all-to-all expert dispatch runs XLA:GPU's ragged-all-to-all (on CPU only its dense stand-in runs),
and two-batch overlap compiles and gives the plain engine's outputs, both at mesh size 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.moe import MoE
from tests.helpers import assert_same_greedy_outputs, rel_err
from tests.test_mesh import _expert_parallel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows_split", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_all_to_all_dispatch_on_gpu_equals_the_one_device_layer(rows_split, dtype):
    """The routed experts' rows sent by lax.ragged_all_to_all over a one-GPU 'ep' axis (each rank's own
    rows, or the replicated rows' strided share, models.moe.over_own_rows) equal the layer without a
    mesh; padding rows stay zero."""
    assert jax.default_backend() == "gpu"
    cfg = ModelConfig.named("tiny", n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(cfg, dtype=dtype, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 3, 37, cfg.hidden_size)), dtype)
    valid = jnp.asarray(rng.random((1, 3, 37)) < 0.8)
    want = moe(x, valid)
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    place, step = _expert_parallel(moe, mesh, 2, "all_to_all", rows_split=rows_split)
    if rows_split:
        rows = NamedSharding(mesh, P("ep"))
        x, valid = jax.device_put(x, rows), jax.device_put(valid, rows)
    hlo = step.lower(place(nnx.to_pure_dict(nnx.state(moe))), x, valid).compile().as_text()
    assert "ragged-all-to-all" in hlo
    got = step(place(nnx.to_pure_dict(nnx.state(moe))), x, valid)
    err = rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32))
    print(f"{jnp.dtype(dtype).name} rows_split={rows_split}: rel err {err:.2e}")
    assert err <= (1e-6 if dtype == jnp.float32 else 1e-2)
    assert not np.asarray(got, np.float32)[~np.asarray(valid)].any()


@pytest.mark.parametrize("kw", [dict(), dict(max_running=1), dict(speculative="nextn")])
def test_two_batch_overlap_on_gpu_equals_the_plain_engine(tiny, kw):
    """EngineConfig(two_batch_overlap=True) on one GPU, fp32: greedy tokens equal and logits within 1e-5
    of the engine without it (batches cut along requests; with max_running=1 along one request's lanes;
    with the draft's MTP layer in micro-batches too)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    assert jax.default_backend() == "gpu"
    model = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in (70, 9, 45, 100)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    base = dict(page_size=16, kv_pages=64, **kw)
    want = Engine(model, EngineConfig(**base)).generate(prompts, params, return_logits=True)
    eng = Engine(model, EngineConfig(two_batch_overlap=True, **base))
    assert eng.runner.micro_batches == 2
    print(kw, "rel err", assert_same_greedy_outputs(eng.generate(prompts, params, return_logits=True), want))
