"""Expert and tensor parallelism (models/sharding.py:MeshAxes, models/moe.py:expert_parallel_mlp) on 8
simulated CPU devices against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.moe import MoE
from models.sharding import MeshAxes, param_sharding
from tests.helpers import rel_err


def _expert_parallel(moe, mesh, n_args: int):
    """(place, step): `place(pure params)` puts them on the mesh by the sharding table (the routed
    experts split over 'ep', the rest replicated); `step(params, *args)` runs the layer under a jitted
    shard_map over 'ep' with the experts split."""
    graphdef, state = nnx.split(moe)
    specs = jax.tree_util.tree_map_with_path(
        lambda p, a: param_sharding(tuple(getattr(k, "key", k) for k in p), a.ndim, mesh).spec,
        nnx.to_pure_dict(state))

    def local(pure_state, *args):
        st = nnx.state(nnx.merge(graphdef, state))
        nnx.replace_by_pure_dict(st, pure_state)
        return nnx.merge(graphdef, st)(*args, axes=MeshAxes(experts="ep"))

    def place(pure):
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), pure, specs)
    return place, jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,) + (P(),) * n_args, out_specs=P(),
                                        check_vma=False))


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
    place, step = _expert_parallel(moe, mesh, 2)
    placed = place(nnx.to_pure_dict(nnx.state(moe)))
    assert placed["experts_gate"].addressable_shards[0].data.shape[0] == cfg.n_routed_experts // ep
    got = step(placed, x, valid)
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
    place, step = _expert_parallel(moe, mesh, 1)
    pure = nnx.to_pure_dict(nnx.state(moe))
    swapped = dict(pure, **{k: jnp.roll(pure[k], cfg.n_routed_experts // 2, axis=0)
                            for k in ("experts_gate", "experts_up", "experts_down")})
    assert rel_err(step(place(pure), x), want) <= 1e-6
    assert rel_err(step(place(swapped), x), want) > 1e-2


@pytest.mark.parametrize("mesh_kw", [dict(cp_size=2, ep_size=2, tp_size=2),
                                     dict(ep_size=2, tp_size=4, speculative="nextn")])
def test_engine_on_a_cp_ep_tp_mesh_equals_one_device(mesh_kw):
    """The whole engine, its checkpoint restored straight into the mesh's shards and its step under a
    shard_map over ('cp', 'ep', 'tp'): greedy tokens equal and logits within 1e-5 of the one-device
    engine, with CP, and with speculative decoding (the MTP layer split too). Each
    device holds 1/ep of every routed expert tensor, 1/tp of every head-, intermediate- or
    vocabulary-split tensor, and a replica of the rest (read from the arrays' shards)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, n).tolist() for n in (5, 90)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = Engine("tiny", EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params, return_logits=True)
    eng = Engine("tiny", EngineConfig(page_size=16, kv_pages=64, **mesh_kw))
    got = eng.generate(prompts, params, return_logits=True)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert rel_err(np.stack(g.logits), np.stack(w.logits)) <= 1e-5
    ep, tp = mesh_kw["ep_size"], mesh_kw["tp_size"]
    split = {"experts_gate": (-3, ep), "q_b_proj": (-1, tp), "o_proj": (-2, tp), "wq_b": (-1, tp),
             "embed_tokens": (0, tp), "lm_head": (-1, tp), "down_proj": (-2, tp)}
    seen = set()
    for p, x in jax.tree_util.tree_leaves_with_path(eng.runner.state):
        name = next((n for n in split if n in jax.tree_util.keystr(p)), None)
        if name is None or "scale_inv" in jax.tree_util.keystr(p):
            continue
        dim, n = split[name]
        assert x.addressable_shards[0].data.shape[dim] == x.shape[dim] // n, jax.tree_util.keystr(p)
        seen.add(name)
    assert seen == set(split)
    norms = [x for p, x in jax.tree_util.tree_leaves_with_path(eng.runner.state) if "norm" in jax.tree_util.keystr(p)]
    assert norms and all(x.sharding.is_fully_replicated for x in norms)
    assert eng.stats()["request_pages"] == 0


@pytest.mark.parametrize("mesh_kw, message", [
    (dict(ep_size=3), "ep_size 3 does not divide n_routed_experts=8"),
    (dict(tp_size=3), "tp_size 3 does not divide num_attention_heads=4"),
    (dict(tp_size=8), "tp_size 8 does not divide num_attention_heads=4"),
    (dict(cp_size=2, ep_size=4, tp_size=2), "needs 16 devices, 8 visible"),
    (dict(tp_size=2, hicache_pages=16), "hicache_pages with ep_size or tp_size > 1 is not supported yet"),
])
def test_a_mesh_that_does_not_divide_the_model_is_refused_naming_the_count(tiny, mesh_kw, message):
    from cpkv_jax.engine import Engine, EngineConfig, EngineConfigError
    with pytest.raises(EngineConfigError, match=message):
        Engine(tiny, EngineConfig(page_size=16, kv_pages=64, **mesh_kw))


def test_expert_parallel_moves_one_fp32_row_block_and_never_the_experts():
    """The compiled EP layer's only collective is one all-reduce of the [N, D] fp32 partial sums: no
    expert weight is gathered (each rank keeps its 1/ep) and nothing is padded to a capacity."""
    import re
    cfg = ModelConfig.named("tiny", n_routed_experts=16)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    place, step = _expert_parallel(moe, mesh, 1)
    x = jnp.zeros((50, cfg.hidden_size), jnp.float32)
    hlo = step.lower(place(nnx.to_pure_dict(nnx.state(moe))), x).compile().as_text()
    collectives = re.findall(r"= (\S+) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)\(", hlo)
    assert [c for _, c in collectives] == ["all-reduce"], collectives
    assert collectives[0][0].startswith(f"f32[50,{cfg.hidden_size}]"), collectives
