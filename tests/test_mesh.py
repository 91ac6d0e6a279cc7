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
from tests.helpers import assert_same_greedy_outputs, rel_err


def _expert_parallel(moe, mesh, n_args: int, ep_dispatch: str = "psum", rows_split: bool | None = None):
    """(place, step): `place(pure params)` puts them on the mesh by the sharding table (the routed
    experts split over 'ep', the rest replicated); `step(params, *args)` runs the layer under a jitted
    shard_map over 'ep' with the experts split. The rows are replicated (as the engine's attention
    leaves them) or split over 'ep' (`rows_split`, default with 'all_to_all': each rank its own rows,
    as data-parallel attention leaves them)."""
    rows_split = ep_dispatch == "all_to_all" if rows_split is None else rows_split
    graphdef, state = nnx.split(moe)
    specs = jax.tree_util.tree_map_with_path(
        lambda p, a: param_sharding(tuple(getattr(k, "key", k) for k in p), a.ndim, mesh).spec,
        nnx.to_pure_dict(state))

    def local(pure_state, *args):
        st = nnx.state(nnx.merge(graphdef, state))
        nnx.replace_by_pure_dict(st, pure_state)
        return nnx.merge(graphdef, st)(*args, axes=MeshAxes(experts="ep", ep_dispatch=ep_dispatch,
                                                             ep_rows_split=rows_split))

    def place(pure):
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), pure, specs)
    rows = P("ep") if rows_split else P()
    return place, jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,) + (rows,) * n_args, out_specs=rows,
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


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dispatched_expert_parallel_moe_equals_one_device(ep):
    """Data-parallel rows (each rank its own, some rows padding), experts split ep ways: rows sent to
    their experts' ranks and back (the exact all-to-all on CPU) equal the single-device layer over all
    the rows (fp32); padding rows stay zero."""
    cfg = ModelConfig.named("tiny", n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(ep)
    x = jnp.asarray(rng.standard_normal((ep, 2, 19, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(rng.random((ep, 2, 19)) < 0.8)
    want = moe(x, valid)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    place, step = _expert_parallel(moe, mesh, 2, "all_to_all")
    rows = NamedSharding(mesh, P("ep"))
    got = step(place(nnx.to_pure_dict(nnx.state(moe))), jax.device_put(x, rows), jax.device_put(valid, rows))
    err = rel_err(got, want)
    print(f"ep={ep}: rel err {err:.2e}")
    assert err <= 1e-6
    assert not np.asarray(got)[~np.asarray(valid)].any()


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_replicated_rows_dispatched_over_all_to_all_equal_one_device(ep):
    """The engine's EP MoE with ep_dispatch='all_to_all': every rank holds every row (as attention
    leaves them), each routes and dispatches its own strided 1/ep of them (models.moe.over_own_rows),
    and the combined rows are all-gathered back: equal to the one-device layer over every row (fp32;
    row counts that ep does not divide, padding rows included and left zero)."""
    cfg = ModelConfig.named("tiny", n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(10 + ep)
    x = jnp.asarray(rng.standard_normal((3, 37, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(rng.random((3, 37)) < 0.8)
    want = moe(x, valid)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    place, step = _expert_parallel(moe, mesh, 2, "all_to_all", rows_split=False)
    got = step(place(nnx.to_pure_dict(nnx.state(moe))), x, valid)
    err = rel_err(got, want)
    print(f"ep={ep}: rel err {err:.2e}")
    assert err <= 1e-6
    assert not np.asarray(got)[~np.asarray(valid)].any()


@pytest.mark.parametrize("ep_dispatch, rows_split", [("psum", False), ("all_to_all", False), ("all_to_all", True)])
def test_fp8_experts_under_expert_parallelism_equal_one_device(ep_dispatch, rows_split):
    """Routed experts kept fp8 (stored K-major: gate / up [E, I, D], down [E, D, I], scales
    [E, N/128, K/128]; hidden 128 != expert width 64) split 4 ways over 'ep' by their leading axis,
    values and scales alike: each rank dequantizes its own experts to [E/ep, K, N] and the layer equals
    the one-device layer, through the psum and both all-to-all dispatches."""
    names = ["mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"]
    cfg = ModelConfig.named("tiny", n_routed_experts=8, num_experts_per_tok=4, fp8_linears=names)
    E, D, I, ep = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, 4
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    assert moe.experts_gate[...].shape == (E, I, D) and moe.experts_down[...].shape == (E, D, I)
    assert moe.experts_gate[...].dtype == jnp.float8_e4m3fn
    rng = np.random.default_rng(20)
    x = jnp.asarray(rng.standard_normal((ep, 2, 19, D)), jnp.float32)
    valid = jnp.asarray(rng.random((ep, 2, 19)) < 0.8)
    want = moe(x, valid)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    place, step = _expert_parallel(moe, mesh, 2, ep_dispatch, rows_split=rows_split)
    placed = place(nnx.to_pure_dict(nnx.state(moe)))
    for leaf in ("experts_gate", "experts_down", "experts_up_scale_inv", "experts_down_scale_inv"):
        whole = placed[leaf]
        assert whole.addressable_shards[0].data.shape == (E // ep, *whole.shape[1:]), leaf
    rows = NamedSharding(mesh, P("ep") if rows_split else P())
    got = step(placed, jax.device_put(x, rows), jax.device_put(valid, rows))
    assert rel_err(got, want) <= 1e-6
    assert not np.asarray(got)[~np.asarray(valid)].any()


def test_fp8_dense_linears_under_tensor_parallelism_equal_one_device():
    """Dense linears kept fp8 hold HF's [out, in] (fp8_weight): the sharding table splits them, and
    their block scales, on the reversed axes (gate / up [I, D] by rows, column-parallel; down [D, I] by
    columns, row-parallel), each shard whole 128 x 128 blocks, and the tensor-parallel MLP (one psum)
    equals one device."""
    from models.moe import MLP
    mlp = MLP(256, 512, dtype=jnp.float32, rngs=nnx.Rngs(0), fp8=lambda name: True)
    assert mlp.gate_proj.fp8_weight[...].shape == (512, 256) and mlp.down_proj.fp8_weight[...].shape == (256, 512)
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
    graphdef, state = nnx.split(mlp)
    pure = nnx.to_pure_dict(state)
    specs = jax.tree_util.tree_map_with_path(
        lambda p, a: param_sharding(tuple(getattr(k, "key", k) for k in p), a.ndim, mesh).spec, pure)
    for name, spec in (("gate_proj", P("tp", None)), ("up_proj", P("tp", None)), ("down_proj", P(None, "tp"))):
        assert specs[name]["fp8_weight"] == spec and specs[name]["scale_inv"] == spec, name

    def local(pure_state, x):
        st = nnx.state(nnx.merge(graphdef, state))
        nnx.replace_by_pure_dict(st, pure_state)
        return nnx.merge(graphdef, st)(x, MeshAxes(tp="tp"))

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), pure, specs)
    assert placed["down_proj"]["fp8_weight"].addressable_shards[0].data.shape == (256, 256)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 5, 256)), jnp.float32)
    err = rel_err(step(placed, x), mlp(x))
    print(f"tp=2 fp8 MLP: rel err {err:.2e}")
    assert err <= 1e-6


def test_replicated_rows_send_each_real_rows_slots_once():
    """With the rows on every rank, the dispatch sends each real row's routed slots exactly once over
    all the ranks (not once per rank): rank r sends the slots of its strided rows r, r + ep, ... below
    n_valid, each to its expert's rank, counted here from the routes; dummy rows and the padding to a
    multiple of ep are never sent; the all-gathered result is every row's weighted expert sum."""
    from models.moe import dense_ragged_all_to_all, dispatched_expert_mlp, over_own_rows
    from pallas_kernels.policy import DEFAULT_POLICY
    ep, n, k, D, I, El, n_valid = 4, 30, 3, 16, 8, 2, 23       # 30 rows: not a multiple of ep
    rng = np.random.default_rng(4)
    sent = {}

    def recording(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
        if operand.ndim == 2 and output.shape[0] == ep * operand.shape[0]:   # the rows' dispatch
            jax.debug.callback(lambda r, s: sent.__setitem__(int(r), np.asarray(s)), jax.lax.axis_index(axis_name),
                               send_sizes)
        return dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                       axis_name=axis_name)

    def local(x, idx, w, gate, up, down):
        def dispatch(rows, n_mine):   # the rank's rows' routes and weights, sliced as over_own_rows slices x
            r = jax.lax.axis_index("ep")
            mine = lambda a: jnp.pad(a, ((0, -n % ep), (0, 0))).reshape(-1, ep, a.shape[1])[:, r]  # noqa: E731
            return dispatched_expert_mlp(rows, mine(idx), mine(w), gate, up, down, n_mine, DEFAULT_POLICY, "ep",
                                         exchange=recording)
        return over_own_rows(x, n_valid, "ep", dispatch)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("ep"), P("ep"), P("ep")),
                                 out_specs=P(), check_vma=False))
    x = rng.standard_normal((n, D)).astype(np.float32)
    idx = np.stack([rng.permutation(ep * El)[:k] for _ in range(n)]).astype(np.int32)
    w = rng.random((n, k)).astype(np.float32)
    gate, up = (rng.standard_normal((ep * El, D, I)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((ep * El, I, D)).astype(np.float32)
    got = np.asarray(step(x, idx, w, gate, up, down))
    jax.effects_barrier()
    for r in range(ep):
        routes = idx[r:n_valid:ep]
        assert sent[r].tolist() == np.bincount(routes.reshape(-1) // El, minlength=ep).tolist(), (r, sent[r])
    assert sum(int(s.sum()) for s in sent.values()) == n_valid * k
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = np.zeros_like(x)
    for row in range(n_valid):
        for e, we in zip(idx[row], w[row]):
            want[row] += we * ((silu(x[row] @ gate[e]) * (x[row] @ up[e])) @ down[e])
    assert rel_err(got, want) <= 1e-5


def _dispatch_under_shard_map(mesh, exchange, n: int, k: int, D: int, El: int):
    """dispatched_expert_mlp alone under a jitted shard_map over 'ep' (Auto axes: ragged_all_to_all
    is only lowered, never run, on CPU). Args: x, idx, w, gate, up, down, n_valid per rank."""
    from models.moe import dispatched_expert_mlp
    from pallas_kernels.policy import DEFAULT_POLICY

    def local(x, idx, w, gate, up, down, n_valid):
        return dispatched_expert_mlp(x, idx, w, gate, up, down, n_valid[0], DEFAULT_POLICY, "ep", exchange=exchange)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 7, out_specs=P("ep"), check_vma=False))


def test_the_dispatch_sends_exactly_the_routed_slots_of_real_rows():
    """What each rank sends each other rank (the send sizes the exchange is given) is exactly the
    number of its real rows' routed slots whose expert that rank holds, counted here from the routes:
    no capacity padding, and rows at or beyond n_valid (padding) are never sent; the result is
    still each row's weighted expert sum."""
    from models.moe import dense_ragged_all_to_all
    ep, n, k, D, I, El = 4, 12, 3, 16, 8, 2
    rng = np.random.default_rng(3)
    sent = {}

    def recording(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
        if operand.ndim == 2 and operand.shape[0] == n * k:     # the rows' dispatch (not the ids, not the return)
            me = jax.lax.axis_index(axis_name)
            jax.debug.callback(lambda r, s: sent.__setitem__(int(r), np.asarray(s)), me, send_sizes)
        return dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                       axis_name=axis_name)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    step = _dispatch_under_shard_map(mesh, recording, n, k, D, El)
    x = rng.standard_normal((ep * n, D)).astype(np.float32)
    idx = np.stack([rng.permutation(ep * El)[:k] for _ in range(ep * n)]).astype(np.int32)
    w = rng.random((ep * n, k)).astype(np.float32)
    gate, up = (rng.standard_normal((ep * El, D, I)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((ep * El, I, D)).astype(np.float32)
    n_valid = np.array([n, 7, 0, 11], np.int32)
    got = np.asarray(step(x, idx, w, gate, up, down, n_valid))
    jax.effects_barrier()
    for r in range(ep):
        routes = idx[r * n:r * n + n_valid[r]]
        assert sent[r].tolist() == np.bincount(routes.reshape(-1) // El, minlength=ep).tolist(), (r, sent[r])
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = np.zeros_like(x)
    for row in range(ep * n):
        if row % n < n_valid[row // n]:
            for e, we in zip(idx[row], w[row]):
                want[row] += we * ((silu(x[row] @ gate[e]) * (x[row] @ up[e])) @ down[e])
    assert rel_err(got, want) <= 1e-5


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
    device holds 1/(ep tp) of every routed expert tensor (the experts split over 'ep' and 'tp' alike),
    1/tp of every head-, intermediate- or vocabulary-split tensor, and a replica of the rest (read from
    the arrays' shards)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, n).tolist() for n in (5, 90)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = Engine("tiny-random", EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params,
                                                                                  return_logits=True)
    eng = Engine("tiny-random", EngineConfig(page_size=16, kv_pages=64, **mesh_kw))
    got = eng.generate(prompts, params, return_logits=True)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert rel_err(np.stack(g.logits), np.stack(w.logits)) <= 1e-5
    ep, tp = mesh_kw["ep_size"], mesh_kw["tp_size"]
    split = {"experts_gate": (-3, ep * tp), "q_b_proj": (-1, tp), "o_proj": (-2, tp), "wq_b": (-1, tp),
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


@pytest.fixture(scope="module")
def one_device_reference(tiny):
    """(prompts, sampling params, their greedy outputs with logits on one device)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, n).tolist() for n in (5, 90, 41)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    return prompts, params, Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params,
                                                                                         return_logits=True)


@pytest.mark.parametrize("mesh_kw", [dict(ep_size=2), dict(ep_size=4), dict(ep_size=8),
                                     dict(cp_size=2, ep_size=4), dict(tp_size=4),
                                     dict(ep_size=4, speculative="nextn"),
                                     dict(cp_size=2, ep_size=2, tp_size=2, speculative="nextn")])
def test_engine_with_the_all_to_all_dispatch_equals_one_device(tiny, one_device_reference, mesh_kw):
    """EngineConfig(ep_dispatch='all_to_all'): inside the step's shard_map each ep rank routes its own
    1/ep of the (replicated) rows, sends them to their experts' ranks and all-gathers the combined rows
    back. Greedy tokens equal and logits within 1e-5 of one device at ep 2/4/8, ep x cp, tp 4 (the
    experts split over 'tp' alone), and with speculative decoding (the MTP layer's MoE dispatched too),
    also beside cp and tp (the experts over 'ep' x 'tp': collectives over both axes)."""
    from cpkv_jax.engine import Engine, EngineConfig
    prompts, params, want = one_device_reference
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, ep_dispatch="all_to_all", **mesh_kw))
    assert eng.ep_dispatch == "all_to_all" and eng.runner.ep_dispatch == "all_to_all"
    print(mesh_kw, "rel err", assert_same_greedy_outputs(eng.generate(prompts, params, return_logits=True), want))
    assert eng.stats()["request_pages"] == 0


def test_the_auto_dispatch_takes_the_fewer_bytes():
    """'auto' resolves by ep_dispatch_bytes: for GLM-5 (bf16, top-8) the all-to-all only from ep 8
    (0.75x the psum's bytes; 1.25x at ep 4, 2.25x at ep 2), never for fp32 at these sizes; one rank:
    psum (nothing moves either way); an explicit choice is kept."""
    from models.moe import choose_ep_dispatch, ep_dispatch_bytes
    cfg = ModelConfig.named("glm-5")
    k, D = cfg.num_experts_per_tok, cfg.hidden_size
    ratio = {ep: ep_dispatch_bytes("all_to_all", ep, k, D, 2) / ep_dispatch_bytes("psum", ep, k, D, 2)
             for ep in (2, 4, 8)}
    assert [round(ratio[ep], 2) for ep in (2, 4, 8)] == [2.25, 1.25, 0.75], ratio
    assert [choose_ep_dispatch("auto", ep, k, D, 2) for ep in (1, 2, 4, 8)] == ["psum", "psum", "psum", "all_to_all"]
    assert [choose_ep_dispatch("auto", ep, k, D, 4) for ep in (2, 4, 8)] == ["psum"] * 3
    assert choose_ep_dispatch("all_to_all", 2, k, D, 2) == "all_to_all"
    from cpkv_jax.engine import EngineConfig, EngineConfigError
    with pytest.raises(EngineConfigError, match="ep_dispatch must be 'auto', 'psum' or 'all_to_all', got 'ragged'"):
        EngineConfig(ep_dispatch="ragged").validate()


def test_the_engine_dispatch_moves_each_ranks_share_of_the_routed_rows(tiny, monkeypatch):
    """The engine's compiled step with ep_dispatch='all_to_all' over ep=4 (the GPU program, lowered on
    CPU: ragged-all-to-all in place of the dense fallback): every MoE layer sends its rows by one
    ragged-all-to-all of [ceil(N/ep) k, D] (this rank's share of the N rows' routed slots, no capacity
    factor; what it really sends are the send sizes, the routed slots of real rows), returns them by
    one of the same size, and all-gathers [ceil(N/ep), D] combined rows; nothing of [N, D] is
    all-reduced (no psum of partial sums) and no expert weight moves."""
    import re
    import models.moe
    from cpkv_jax.engine import Engine, EngineConfig
    from models.kv import contiguous_batch
    monkeypatch.setattr(models.moe, "dense_ragged_all_to_all", jax.lax.ragged_all_to_all)
    ep, B, T = 4, 2, 7
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, ep_size=ep, ep_dispatch="all_to_all"))
    cfg = tiny.cfg
    k, D, c = cfg.num_experts_per_tok, cfg.hidden_size, -(-B * T // ep)
    batch = contiguous_batch(np.arange(B * T).reshape(B, T) + 3, kv_width=32)
    lowered = eng.runner.lower(batch, None, attn_path="expanded", last_rank=np.zeros(B, np.int32))
    hlo = lowered.compiler_ir("hlo").as_hlo_text()
    ops = re.findall(r"= (\S+) (ragged-all-to-all|all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)"
                     r"\(([^)]*)\)", hlo)
    kinds = sorted({(shape.split("{")[0], kind) for shape, kind, _ in ops})
    want = sorted({(f"f32[{ep * c * k},{D}]", "ragged-all-to-all"),    # dispatch: into an ep x share buffer
                   (f"s32[{ep * c * k}]", "ragged-all-to-all"),        # the slots' expert ids
                   (f"f32[{c * k},{D}]", "ragged-all-to-all"),         # the return: the rank's own slots
                   (f"s32[{ep},{ep}]", "all-gather"),                  # who sends whom how many
                   (f"f32[{c},{ep},{D}]", "all-gather")})              # the combined rows back to every rank
    assert kinds == want, kinds
    shape_of = dict(re.findall(r"^\s*(?:ROOT )?%?(\S+) = (\S+?)(?:\{[^}]*\})? ", hlo, re.M))
    operands = {shape_of[first] for shape, first in re.findall(r"= (f32\S+) ragged-all-to-all\(%?([^,\s]+)", hlo)}
    assert operands == {f"f32[{c * k},{D}]", f"f32[{ep * c * k},{D}]"}, operands   # out: my slots; back: what I got


def _scramble_every_replica(pool, rng):
    """Different noise in every device's shard of every pool leaf (the replicas of a CP rank's pages
    over 'ep'/'tp' included): a page some device did not load back is read as noise."""
    def noise(x):
        shards = [jax.device_put(jnp.asarray(rng.standard_normal(s.data.shape), x.dtype), s.device)
                  for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    pool.cache = jax.tree.map(noise, pool.cache)


@pytest.fixture(scope="module")
def hicache_reference(tiny):
    """(prompts with shared prefixes, sampling params, their outputs on one device without a host tier)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from tests.helpers import shared_prefix_prompts
    prompts = shared_prefix_prompts(np.random.default_rng(7), tiny.cfg.vocab_size, 2, 2)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    return prompts, params, Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params,
                                                                                         return_logits=True)


@pytest.mark.parametrize("copy, mesh_kw", [("side_stream", dict(cp_size=2, ep_size=2)),
                                           ("jit", dict(ep_size=2, tp_size=2)),
                                           ("side_stream", dict(cp_size=2, ep_size=4, ep_dispatch="all_to_all"))])
def test_hicache_on_an_ep_tp_mesh_reloads_every_replica(tiny, hicache_reference, copy, mesh_kw):
    """HiCache on a mesh whose pool is replicated over 'ep'/'tp': prompts backed up to host, evicted
    from the device, every device's pool overwritten with its own noise, then the prompts again
    (their prefixes loaded back from host, by each device into its own replica): greedy tokens equal
    and logits within 1e-5 of one device without a host tier, through the layer-hook copies (CP x EP)
    and the jitted ones (EP x TP)."""
    from cpkv_jax.engine import Engine, EngineConfig
    prompts, params, want = hicache_reference
    rng = np.random.default_rng(8)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, hicache_pages=64, hicache_copy=copy, **mesh_kw))
    eng.generate(prompts, params)
    eng.radix.evict(10 ** 9, eng.allocator.free, eng.scheduler._free_host)
    assert eng.stats()["radix"]["pages"] == 0
    _scramble_every_replica(eng.pool, rng)
    got = eng.generate(prompts, params, return_logits=True)
    assert eng.hicache.stats["load_pages"] >= 4 and all(o.cached_tokens >= 16 for o in got), eng.hicache.stats
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert rel_err(np.stack(g.logits), np.stack(w.logits)) <= 1e-5
    assert not (eng.runner.copier and eng.runner.copier.errors) and eng.hicache.stats["failed_backups"] == 0


@pytest.mark.parametrize("mesh_kw, message", [
    (dict(ep_size=3), "ep_size 3 does not divide n_routed_experts=8"),
    (dict(tp_size=3), "ep_size 1 x tp_size 3 = 3 does not divide n_routed_experts=8"),   # experts over tp too
    (dict(tp_size=8), "tp_size 8 does not divide num_attention_heads=4"),
    (dict(cp_size=2, ep_size=4, tp_size=2), "needs 16 devices, 8 visible"),
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


def test_the_ragged_dispatch_moves_rows_only_by_ragged_all_to_all():
    """The GPU path's compiled program (lowered here: XLA:CPU does not run ragged-all-to-all): the rows
    go out and come back by ragged-all-to-alls of the routed slots' [n k, D] rows, whose send sizes are
    the dispatch plan's per-rank counts (the return's receive sizes are the same counts); besides them
    only the [ep, ep] count matrix is gathered. Nothing of [n, D] is all-reduced or gathered and no
    expert weight moves."""
    import re
    ep, n, k, D, I, El = 4, 24, 4, 64, 32, 4
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    step = _dispatch_under_shard_map(mesh, jax.lax.ragged_all_to_all, n, k, D, El)
    args = (jnp.zeros((ep * n, D)), jnp.zeros((ep * n, k), jnp.int32), jnp.zeros((ep * n, k)),
            jnp.zeros((ep * El, D, I)), jnp.zeros((ep * El, D, I)), jnp.zeros((ep * El, I, D)),
            jnp.zeros((ep,), jnp.int32))
    hlo = step.lower(*args).compiler_ir("hlo").as_hlo_text()
    ops = re.findall(r"= (\S+) (ragged-all-to-all|all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)"
                     r"\(([^)]*)\)", hlo)
    kinds = sorted((shape.split("{")[0], kind) for shape, kind, _ in ops)
    want = [("s32[4,4]", "all-gather"), (f"f32[{ep * n * k},{D}]", "ragged-all-to-all"),
            (f"s32[{ep * n * k}]", "ragged-all-to-all"), (f"f32[{n * k},{D}]", "ragged-all-to-all")]
    assert kinds == sorted(want), ops
    ragged = {shape.split("{")[0]: args.split(", ") for shape, kind, args in ops if kind == "ragged-all-to-all"}
    out, back = ragged[f"f32[{ep * n * k},{D}]"], ragged[f"f32[{n * k},{D}]"]
    assert out[3] == ragged[f"s32[{ep * n * k}]"][3] == back[5]      # send sizes out = receive sizes back
    assert out[5] == back[3]                                          # what arrives is what is returned
