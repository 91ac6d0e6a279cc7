"""Context parallelism on 8 simulated CPU devices: the CP engine equals the single-device engine
(greedy tokens exactly; logits and the KV pool by logical page to fp32 rounding); the CP data
movement (owner writes, gathers, fetches) is exact, bit for bit; planner invariants; the narrow tail
collection in the compiled HLO.

Why the engines agree to rounding and not bit for bit: XLA's CPU matmuls round differently for
different row counts, and CP ranks run fewer rows than one device does. The single-device engine
itself gives one request logits that differ by up to 4e-6 when only its batch bucket changes
(measured: 16/32/64/512 lanes vs 1024), and even layer 0's kv_a_proj differs by one ulp between row
counts. A wrong page mapping or a lost write shows as O(1) errors; the data movement itself is
checked bit for bit in test_kv_access_moves_rows_exactly."""

from tests.helpers import pool_is_clean, rel_err

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cpkv_jax import cp as CP
from cpkv_jax.batch import build_batch
from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams


def page_bytes(engine, page):
    """Every layer's latent, rope key, index key (+ scale) of one global page, as host arrays."""
    ps = engine.config.page_size
    sl = slice(page * ps, (page + 1) * ps)
    c = engine.pool.cache
    leaves = [c.latent, c.k_rope, c.index_k] + ([c.index_scale] if c.index_scale is not None else [])
    return [np.asarray(x[:, sl]) for x in leaves]


def run_waves(engine, waves, params):
    return [engine.generate(w, params, return_logits=True) for w in waves]


def workload(rng, vocab, page_size):
    """Two waves: lengths from 1 token to many pages (fallback-sized and zigzag-sized, unequal
    segments), then prompts extending the first wave's (cached prefixes keep their owners)."""
    lengths = [1, 5, 3 * page_size - 7, 4 * page_size + 3, 17 * page_size + 5]
    first = [rng.integers(2, vocab, n).tolist() for n in lengths]
    second = [first[4][:9 * page_size + 2] + rng.integers(2, vocab, 40).tolist(),
              first[3] + rng.integers(2, vocab, 3).tolist(), first[2][:page_size]]
    return [first, second]


# Every cp size and mode at 16-slot pages (more pages per request: more owners, more page boundaries
# inside a segment); at 64-slot pages (the kernels' block) one size, with exact and fp8 indexer keys.
@pytest.mark.parametrize("page_size, index_dtype, cp_configs", [
    (16, "same", [dict(cp_size=2), dict(cp_size=8),
                  dict(cp_size=4, cp_short_policy="token_balanced"), dict(cp_size=4, cp_mode="round_robin")]),
    (64, "same", [dict(cp_size=4)]),
    (64, "fp8", [dict(cp_size=4)]),   # fp8 indexer keys travel as bytes + scale (gather_index_keys)
])
def test_cp_engine_equals_single_device(tiny, page_size, index_dtype, cp_configs):
    rng = np.random.default_rng(page_size)
    waves = workload(rng, tiny.cfg.vocab_size, page_size)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    base = dict(page_size=page_size, kv_pages=8 * (1600 // page_size + 8), max_prefill_tokens=512,
                index_dtype=index_dtype)
    single = Engine(tiny, EngineConfig(**base))
    ref = run_waves(single, waves, params)
    ref_pages = single.radix.prefixes()
    worst = 0.0
    for extra in cp_configs:
        cp = extra["cp_size"]
        eng = Engine(tiny, EngineConfig(**base, **extra))
        got = run_waves(eng, waves, params)
        for rw, gw in zip(ref, got):
            assert [o.token_ids for o in gw] == [o.token_ids for o in rw], cp
            assert [o.cached_tokens for o in gw] == [o.cached_tokens for o in rw]
            for r, g in zip(rw, gw):
                worst = max(worst, rel_err(np.stack(g.logits), np.stack(r.logits)))
        pages = eng.radix.prefixes()
        assert pages.keys() == ref_pages.keys()
        for key, p in pages.items():
            for a, b in zip(page_bytes(eng, p), page_bytes(single, ref_pages[key])):
                worst = max(worst, rel_err(a, b))
        # the pool really is split: each rank holds 1/cp of it, and every rank owns cached pages
        shard = eng.pool.cache.latent.addressable_shards[0].data
        assert shard.nbytes * cp == eng.pool.cache.latent.nbytes
        assert {int(eng.allocator.owner(p)) for p in pages.values()} == set(range(cp))
        assert pool_is_clean(eng)
        m = eng.metrics   # every rank's lanes count: lanes of all steps = tokens + padding, in cp-sized rows
        assert m["padded_lanes"] >= 0 and (m["prefill_tokens"] + m["decode_tokens"] + m["padded_lanes"]) % cp == 0
        del eng
        jax.clear_caches()  # every config compiles its own variants; keep the mapped code bounded (conftest)
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("page_aligned", [True, False])
def test_kv_access_moves_rows_exactly(page_aligned):
    """write / gather / fetch / pick under shard_map over 4 ranks vs plain indexing of one unsharded pool:
    identical bits, and each rank's shard holds exactly the pages it owns."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from models.kv import KVAccess

    cp, n_local, D, B, T, S, K = 4, 32, 8, 3, 5, 40, 6
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((2, cp * n_local, D)).astype(np.float32)
    # distinct target slots (never a rank's slot 0); with page_aligned, rank r's rows only hit rank r
    owned = [np.setdiff1d(np.arange(r * n_local, (r + 1) * n_local), [r * n_local]) for r in range(cp)]
    if page_aligned:
        slots = np.stack([rng.choice(owned[r], (B, T), replace=False) for r in range(cp)])
    else:
        slots = rng.choice(np.concatenate(owned), (cp, B, T), replace=False)
    rows = rng.standard_normal((cp, B, T, D)).astype(np.float32)
    real = np.concatenate(owned)  # every slot but the ranks' dummies (which absorb off-owner writes)
    table = rng.choice(real, (B, S))
    picks = rng.choice(real, (cp, B, T, K))
    # positions into the slot table (-1 reads position 0): over all S columns (T·K < S: fetched) and over
    # the first S/2 (T·K > S/2: every visible row gathered, then picked locally)
    positions = rng.integers(-1, S // 2, (cp, B, T, K))

    expect = pool.copy()
    expect[1, slots.reshape(-1)] = rows.reshape(-1, D)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    access = KVAccess("cp", page_aligned)

    def body(pool, slots, rows, table, picks, positions):
        pool = access.write(pool, 1, slots[0], rows[0])
        got = access.gather(lambda s: pool[1][s], table, pool.shape[1])
        fetched = access.fetch(lambda s: pool[1][s], picks[0], pool.shape[1])
        picked = [access.pick(lambda s: pool[1][s], t, positions[0], pool.shape[1]) for t in (table, table[:, :S // 2])]
        return pool, got[None], fetched[None], jnp.stack(picked)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "cp"), P("cp"), P("cp"), P(), P("cp"), P("cp")),
                              out_specs=(P(None, "cp"), P("cp"), P("cp"), P("cp")), check_vma=False))
    new_pool, got, fetched, picked = f(jax.device_put(pool, NamedSharding(mesh, P(None, "cp"))), slots, rows, table,
                                       picks, positions)
    assert T * K < S and T * K > S // 2  # one call per branch of pick
    np.testing.assert_array_equal(np.asarray(new_pool)[:, real], expect[:, real])
    for r in range(cp):
        np.testing.assert_array_equal(np.asarray(got)[r], expect[1][table])
        np.testing.assert_array_equal(np.asarray(fetched)[r], expect[1][picks[r]])
        want = expect[1][np.take_along_axis(table[:, None, :], np.maximum(positions[r], 0), axis=2)]
        np.testing.assert_array_equal(np.asarray(picked)[r, 0], want)
        np.testing.assert_array_equal(np.asarray(picked)[r, 1], want)
    for shard in new_pool.addressable_shards:
        r = shard.index[1].start // n_local
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 1:], expect[:, r * n_local + 1:(r + 1) * n_local])


@settings(max_examples=300, deadline=None)
@given(cp=st.sampled_from([1, 2, 4, 8]), page_size=st.sampled_from([1, 4, 16, 64]),
       mode=st.sampled_from(CP.MODES), short=st.sampled_from(CP.SHORT_POLICIES),
       reqs=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 900)), min_size=1, max_size=6),
       data=st.data())
def test_planner_invariants(cp, page_size, mode, short, reqs, data):
    """Every new token computed exactly once; every new page has one owner, taken from a rank with a
    free page; page-aligned plans compute every token on its page's owner; zigzag balance bound."""
    def known(s, n):  # a partial page at s, maybe pages allocated ahead
        span = (s + n - 1) // page_size + 1 - s // page_size
        k = min(span, (s % page_size > 0) + data.draw(st.integers(0, 2)))
        return tuple(data.draw(st.integers(0, cp - 1)) for _ in range(k))
    requests = [CP.CPRequest(s, n, known(s, n)) for s, n in reqs]
    need = sum(max(0, (r.start + r.num_tokens - 1) // page_size + 1 - (r.start // page_size + len(r.known_owners)))
               for r in requests)
    free = np.array(data.draw(st.lists(st.integers(0, need + 2), min_size=cp, max_size=cp)))
    if free.sum() < need:
        free[0] += need - free.sum()
    plan = CP.plan(requests, page_size, cp, free, mode=mode, short_policy=short)
    used = np.zeros(cp, np.int64)
    for b, r in enumerate(requests):
        ranks = plan.token_rank[b]
        assert len(ranks) == r.num_tokens and ((0 <= ranks) & (ranks < cp)).all()
        assert plan.local_lengths[:, b].sum() == r.num_tokens
        first = r.start // page_size + len(r.known_owners)
        n_new = (r.start + r.num_tokens - 1) // page_size + 1 - first
        assert plan.first_new_page[b] == first and len(plan.new_page_owner[b]) == n_new
        used += np.bincount(plan.new_page_owner[b], minlength=cp)
        owners = plan.page_owner(b, r)
        if plan.page_aligned:
            assert (owners == ranks).all()
        if mode == "zigzag" and n_new >= 2 * cp and (free >= need).all():
            counts = np.bincount(plan.new_page_owner[b], minlength=cp)
            assert counts.max() - counts.min() <= 2  # pages per rank: 2 segments of floor/ceil(P / 2cp)
    assert (used <= free).all()
    assert plan.page_aligned == all((plan.page_owner(b, r) == plan.token_rank[b]).all()
                                    for b, r in enumerate(requests))
    if mode == "zigzag" and short == "owner":
        assert plan.page_aligned


def test_moe_compaction_excludes_dummy_rows(tiny):
    """Valid rows interleaved with dummy lane slots: outputs at valid rows equal the unpadded
    computation, and poisoning the dummies (NaN, 1e30) changes no bit of them."""
    import jax.numpy as jnp
    from flax import nnx

    from models.moe import MoE

    g = next(i for i, grp in enumerate(tiny.groups_plan) if grp.unit[0][0] == "sparse")
    stacked = tiny.groups[g].unit[0].mlp  # parameters stacked over the group's repeats: take the first
    moe = nnx.merge(nnx.graphdef(stacked), jax.tree.map(lambda a: a[0], nnx.state(stacked)))
    assert isinstance(moe, MoE)
    rng = np.random.default_rng(0)
    valid = rng.random((3, 16)) < 0.4
    x = rng.standard_normal((3, 16, tiny.cfg.hidden_size)).astype(np.float32)
    clean = np.where(valid[..., None], x, 0.0)
    poisoned = np.where(valid[..., None], x, np.where(rng.random(x.shape) < 0.5, np.nan, 1e30)).astype(np.float32)
    out_clean = np.asarray(moe(jnp.asarray(clean), jnp.asarray(valid)))
    out_poison = np.asarray(moe(jnp.asarray(poisoned), jnp.asarray(valid)))
    np.testing.assert_array_equal(out_poison[valid], out_clean[valid])
    assert not np.isnan(out_poison).any() and (out_poison[~valid] == 0).all()
    unpadded = np.asarray(moe(jnp.asarray(x[valid])[None]))[0]
    assert rel_err(out_clean[valid], unpadded) <= 1e-6


def test_tail_collection_is_narrow_in_the_compiled_hlo(tiny):
    """The last-token path all-gathers cp x B x hidden; the all-positions flag gathers every token."""
    import re

    from cpkv_jax.kv_pool import KVPool, PageAllocator
    from cpkv_jax.runner import ModelRunner
    from jax.sharding import Mesh

    cp, ps, B = 4, 16, 2
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    alloc = PageAllocator(16 * cp, cp)
    pool = KVPool.create(tiny.cfg, 16 * cp, ps, tiny.dtype, "same", mesh=mesh)
    runner = ModelRunner(tiny, pool, mesh=mesh)
    reqs = [CP.CPRequest(0, 200), CP.CPRequest(0, 150)]
    plan = CP.plan(reqs, ps, cp, alloc.free_per_rank())
    assert plan.page_aligned
    tables = [np.array([alloc.alloc(1, int(o))[0] for o in owners]) for owners in plan.new_page_owner]
    T = int(plan.local_lengths.max())
    toks = [np.arange(r.num_tokens) % 500 for r in reqs]
    batch, lane, rank = build_batch(plan, reqs, toks, tables, rows=B, lanes=T, table_pages=16)
    D = tiny.cfg.hidden_size

    def hidden_gathers(all_logits):
        hlo = runner.lower(batch, lane, attn_path="expanded", all_logits=all_logits, last_rank=rank).compile().as_text()
        shapes = re.findall(r"= f32\[([0-9,]+)\][^=]*? all-gather(?:-start)?\(", hlo)
        return [tuple(map(int, s.split(","))) for s in shapes if s.split(",")[-1] == str(D)]

    narrow, full = hidden_gathers(False), hidden_gathers(True)
    assert narrow and all(int(np.prod(s)) == cp * B * D for s in narrow), narrow
    assert any(int(np.prod(s)) == cp * B * T * D for s in full), full
    assert pool.cache.latent.addressable_shards[0].data.nbytes * cp == pool.cache.latent.nbytes


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_gives_rank_r_segments_r_and_2cp_minus_1_minus_r(cp):
    """Page-aligned zigzag over 2cp segments of pages: rank r computes (and owns) segments r and
    2cp-1-r, so every rank gets one early and one late segment of causal work. Also with segments of
    unequal length (one extra page on the first ones) and a token-balanced short request."""
    ps = 4
    for pages_per_seg, extra in ((1, 0), (3, 0), (2, 3)):
        n_pages = 2 * cp * pages_per_seg + extra
        p = CP.plan([CP.CPRequest(0, n_pages * ps)], ps, cp, [10 ** 6] * cp)
        sizes = [pages_per_seg + (s < extra) for s in range(2 * cp)]
        want = np.concatenate([np.full(n, s if s < cp else 2 * cp - 1 - s) for s, n in enumerate(sizes)])
        assert p.page_aligned
        np.testing.assert_array_equal(p.new_page_owner[0], want)
        np.testing.assert_array_equal(p.token_rank[0], np.repeat(want, ps))
    short = CP.plan([CP.CPRequest(0, 4 * cp)], 64, cp, [10 ** 6] * cp, short_policy="token_balanced")
    want = np.concatenate([np.full(2, s if s < cp else 2 * cp - 1 - s) for s in range(2 * cp)])
    np.testing.assert_array_equal(short.token_rank[0], want)
