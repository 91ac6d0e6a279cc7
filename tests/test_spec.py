"""EAGLE/NextN speculative decoding with the MTP layer: greedy output equals plain greedy decoding;
rejection sampling preserves the target distribution; acceptance is n+1 with a draft that is right
by construction and ~1 with a random one; pages and KV stay consistent."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams, token_probs, verify_tokens
from models.kv import contiguous_batch, empty_kv_cache
from models.model import jit_forward
from tests.helpers import pool_is_clean, rel_err


def copy_draft_model(model):
    """A model whose next token depends only on the current one (every attention / MLP output
    projection zeroed) and whose MTP layer passes the embedding of the token it is given straight to
    the target's norm and lm_head: the draft predicts exactly what the target will, by construction."""
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)

    def zero_outputs(tree):
        for k, v in tree.items():
            if isinstance(v, dict):
                if k in ("o_proj", "down_proj"):
                    v["kernel"] = jnp.zeros_like(v["kernel"])
                else:
                    zero_outputs(v)
            elif k == "experts_down":
                tree[k] = jnp.zeros_like(v)

    zero_outputs(pure["groups"])
    mtp = pure["mtp"]
    zero_outputs(mtp["layer"])
    D = model.cfg.hidden_size
    mtp["eh_proj"]["kernel"] = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]).astype(model.dtype)
    mtp["enorm"]["weight"] = jnp.ones_like(mtp["enorm"]["weight"])
    mtp["norm"]["weight"] = pure["norm"]["weight"]
    mtp["embed_tokens"] = pure["embed_tokens"]
    mtp["head"]["kernel"] = pure["lm_head"]["kernel"]
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def random_prompts(rng, lengths):
    return [rng.integers(2, 500, n).tolist() for n in lengths]


@pytest.mark.parametrize("n, cp", [(1, 1), (3, 1), (2, 2)])
def test_greedy_spec_equals_plain_greedy(tiny, n, cp):
    """Mixed lengths, then prompts sharing cached prefixes (bigram radix keys); with CP on and off."""
    rng = np.random.default_rng(n)
    first = random_prompts(rng, [3, 21, 47, 90])
    second = [first[2] + [7, 7, 7], first[3][:40] + random_prompts(rng, [9])[0], first[0]]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    ref = [plain.generate(w, params) for w in (first, second)]
    spec = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, speculative="nextn", num_draft_tokens=n,
                                     cp_size=cp))
    got = [spec.generate(w, params) for w in (first, second)]
    for r, g in zip(ref, got):
        assert [o.token_ids for o in g] == [o.token_ids for o in r]
    assert sum(o.cached_tokens for o in got[1]) > 0
    assert pool_is_clean(spec)


def acceptance_length(engine):
    return engine.stats()["spec_acceptance_length"]


def test_acceptance_right_by_construction_and_random(tiny):
    n = 3
    params = SamplingParams(max_new_tokens=4 * (n + 1) + 1, ignore_eos=True)
    prompts = random_prompts(np.random.default_rng(0), [5, 30, 64])
    copy = copy_draft_model(tiny)
    plain = Engine(copy, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params)
    eng = Engine(copy, EngineConfig(page_size=16, kv_pages=64, speculative="nextn", num_draft_tokens=n))
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert acceptance_length(eng) == n + 1
    rnd = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, speculative="nextn", num_draft_tokens=n))
    rnd.generate(prompts, params)
    assert acceptance_length(rnd) < 1.2  # a random draft is almost never right; output stays exact (above)


def chi2_ok(counts, probs):
    """(statistic, critical value at significance 1e-3) of a chi-square goodness-of-fit test."""
    counts = np.asarray(counts, np.float64)
    expected = probs * counts.sum()
    m = expected > 0
    assert counts[~m].sum() == 0, "samples outside the support"
    stat = ((counts[m] - expected[m]) ** 2 / expected[m]).sum()
    dof = m.sum() - 1
    # Wilson-Hilferty upper quantile of chi-square(dof) at 1 - alpha (z = 3.09 for 1e-3)
    z = 3.0902
    crit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


def test_verify_tokens_distribution():
    """Small vocabulary, 2 drafts drawn from q, 200k trials: the first emitted token ~ p0 and, when
    draft 1 is accepted, the second ~ p1 (chi-square, significance 1e-3 each)."""
    V, n, N = 6, 2, 200_000
    rng = np.random.default_rng(0)
    target = rng.standard_normal((n + 1, V)).astype(np.float32) * 1.5
    draft = rng.standard_normal((V,)).astype(np.float32)
    temp, top_p, top_k = 0.9, 1.0, 0
    q = np.asarray(token_probs(jnp.asarray(draft[None]), jnp.asarray([temp]), jnp.asarray([top_p]),
                               jnp.asarray([top_k])))[0]
    p = np.asarray(token_probs(jnp.asarray(target), jnp.full((n + 1,), temp), jnp.full((n + 1,), top_p),
                               jnp.full((n + 1,), top_k, jnp.int32)))
    drafts = rng.choice(V, size=(N, n), p=q / q.sum())
    f = lambda x: jnp.broadcast_to(jnp.asarray(x), (N,) + np.shape(x))  # noqa: E731
    a, tok, *_ = verify_tokens(f(target), f(np.stack([q] * n)), jnp.asarray(drafts, jnp.int32),
                              f(np.float32(temp)), f(np.float32(top_p)), f(np.int32(top_k)),
                              jnp.arange(N, dtype=jnp.uint32), jnp.full((N,), 5, jnp.int32))
    a, tok = np.asarray(a), np.asarray(tok)
    first = np.where(a >= 1, drafts[:, 0], tok)
    stat, crit = chi2_ok(np.bincount(first, minlength=V), p[0])
    assert stat < crit, (stat, crit)
    # second token given draft 1 accepted: draft 2 if accepted, else the residual/bonus draw
    sel = a >= 1
    second = np.where(a[sel] >= 2, drafts[sel, 1], tok[sel])
    stat, crit = chi2_ok(np.bincount(second, minlength=V), p[1])
    assert stat < crit, (stat, crit)
    assert 0.2 < sel.mean() < 0.95  # drafts are accepted sometimes and rejected sometimes


def test_spec_sampling_is_seeded_and_leaks_no_pages(tiny):
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, rng.integers(1, 60, 12))
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 9)), temperature=0.8, top_p=0.9, seed=int(s),
                             ignore_eos=True) for s in rng.integers(0, 1000, 12)]
    cfg = EngineConfig(page_size=16, kv_pages=48, max_running=8, speculative="nextn", num_draft_tokens=2)
    a = Engine(tiny, cfg).generate(prompts, params)
    eng = Engine(tiny, cfg)
    b = eng.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == p.max_new_tokens for o, p in zip(b, params))
    assert eng.compilations() <= eng.max_compilations()
    assert pool_is_clean(eng)


def test_accepted_kv_equals_a_non_speculative_run(tiny):
    """Target KV of the cached pages equals the plain engine's (same positions and tokens), and the
    draft KV equals a teacher-forced MTP pass over the final sequence with the target's hidden."""
    n = 2
    copy = copy_draft_model(tiny)  # high acceptance, so the cached pages hold accepted tokens
    prompts = random_prompts(np.random.default_rng(4), [37, 50])
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = Engine(copy, EngineConfig(page_size=16, kv_pages=64, index_dtype="same"))
    ref = plain.generate(prompts, params)
    spec = Engine(copy, EngineConfig(page_size=16, kv_pages=64, index_dtype="same", speculative="nextn",
                                     num_draft_tokens=n))
    out = spec.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert spec.metrics["spec_accepted"] > 0
    ps = 16
    plain_pages = plain.radix.prefixes()
    checked = 0
    for key, page in spec.radix.prefixes().items():
        tokens = tuple(t for t, _ in key)
        sl = slice(page * ps, (page + 1) * ps)
        ref_sl = slice(plain_pages[tokens] * ps, (plain_pages[tokens] + 1) * ps)
        for x, y in ((spec.pool.cache.latent, plain.pool.cache.latent), (spec.pool.cache.k_rope, plain.pool.cache.k_rope)):
            assert rel_err(np.asarray(x[:, sl]), np.asarray(y[:, ref_sl])) <= 1e-5
        checked += 1
    assert checked >= 6
    # draft KV: teacher-forced MTP over each full sequence
    for p, o in zip(prompts, out):
        seq = np.asarray([p + o.token_ids])
        T = seq.shape[1] - 1
        batch = contiguous_batch(seq[:, :T])
        hidden, _ = jit_forward(copy, with_logits=False)(batch, empty_kv_cache(copy.cfg, 1 + T, copy.dtype))
        dcache = empty_kv_cache(copy.cfg, 1 + T, copy.dtype, num_layers=1, num_full=1)
        _, _, dcache = copy.mtp_forward(hidden, jnp.asarray(seq[:, 1:T + 1]), batch, dcache)
        key = spec.radix.key_of(list(seq[0]))
        for m in range(ps, len(key) + 1, ps):
            page = spec.radix.prefixes()[key[:m]]
            got = np.asarray(spec.pool.draft.latent[0, page * ps:(page + 1) * ps])
            want = np.asarray(dcache.latent[0, 1 + m - ps:1 + m])
            assert rel_err(got, want) <= 1e-5
