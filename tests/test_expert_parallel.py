"""Expert parallelism (models/moe.py:expert_parallel_mlp) on 8 simulated CPU devices against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.moe import MoE
from models.sharding import param_sharding
from tests.helpers import rel_err


def _expert_parallel(moe, mesh, **call):
    """(placed params, f(params, *args)): the layer run under a shard_map over 'ep' with its params
    placed by the sharding table (the routed experts split, the rest replicated)."""
    graphdef, state = nnx.split(moe)
    pure = nnx.to_pure_dict(state)
    specs = jax.tree_util.tree_map_with_path(
        lambda p, a: param_sharding(tuple(getattr(k, "key", k) for k in p), a.ndim, mesh).spec, pure)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), pure, specs)

    def local(pure_state, *args):
        st = nnx.state(nnx.merge(graphdef, state))
        nnx.replace_by_pure_dict(st, pure_state)
        return nnx.merge(graphdef, st)(*args, expert_axis="ep", **call)

    def run(params, *args):
        params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,) + (P(),) * len(args), out_specs=P(),
                                     check_vma=False))(params, *args)
    return placed, run


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_moe_equals_one_device(ep):
    """Rows replicated, experts split ep ways: each rank's partial sum over its own experts, added over
    the ranks, equals the single-device layer (fp32; padding rows included, and a row routed wholly to
    one rank's experts as well as rows spread over several). Each rank holds 1/ep of the experts."""
    cfg = ModelConfig.named("tiny", n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 37, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(rng.random((3, 37)) < 0.8)
    want = moe(x, valid)

    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    placed, run = _expert_parallel(moe, mesh)
    assert placed["experts_gate"].addressable_shards[0].data.shape[0] == cfg.n_routed_experts // ep
    got = run(placed, x, valid)
    err = rel_err(got, want)
    print(f"ep={ep}: rel err {err:.2e}")
    assert err <= 1e-6
    assert np.array_equal(np.asarray(got)[~np.asarray(valid)], np.zeros_like(np.asarray(got)[~np.asarray(valid)]))


def test_a_wrong_expert_split_is_caught():
    """The check has teeth: experts given to the ranks in the wrong order (each rank computing the
    slots of another's experts) changes the output."""
    cfg = ModelConfig.named("tiny", n_routed_experts=8)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20, cfg.hidden_size)), jnp.float32)
    want = moe(x)
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    placed, run = _expert_parallel(moe, mesh)
    swapped = dict(placed, **{k: np.roll(np.asarray(placed[k]), cfg.n_routed_experts // 2, axis=0)
                              for k in ("experts_gate", "experts_up", "experts_down")})
    assert rel_err(run(placed, x), want) <= 1e-6
    assert rel_err(run(swapped, x), want) > 1e-2
