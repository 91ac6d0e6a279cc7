"""The sparse MLA kernel equals its reference, and the reference equals a float64 loop written another
way: interpret mode on CPU (semantics), compiled on the GPU (marked gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.policy import KernelPolicy
from pallas_kernels.sparse_mla import Tiling, kernel_shape_error, sparse_mla, sparse_mla_pallas, sparse_mla_reference
from pallas_kernels.sparse_mla.dispatch import tiling_for
from pallas_kernels.sparse_mla.kernel_mgpu import ROW_THREADS, SCORES


def make_case(N, H, C, R, K, P=300, L=3, seed=0, dtype=np.float32):
    """Random queries and a pool; each query selects up to K distinct slots in shuffled order, with
    -1 (not selected) anywhere in its row: a full row, a short row, an empty row, a row selecting the
    same slot as others."""
    rng = np.random.default_rng(seed)
    q_lat = rng.standard_normal((N, H, C)).astype(dtype)
    q_rope = rng.standard_normal((N, H, R)).astype(dtype)
    latent = rng.standard_normal((L, P, C)).astype(dtype)
    k_rope = rng.standard_normal((L, P, R)).astype(dtype)
    slots = np.full((N, K), -1, np.int32)
    for n in range(N):
        count = [K, 1, 0, K // 3][n % 4] if n < 4 else int(rng.integers(0, K + 1))
        chosen = rng.choice(P, count, replace=False)
        at = rng.choice(K, count, replace=False)          # selected lanes scattered among the -1s
        slots[n, at] = chosen
    return q_lat, q_rope, latent, k_rope, slots


def loop_reference(q_lat, q_rope, latent, k_rope, layer, slots, scale):
    """Per query and head in float64: the selected rows' softmax-weighted latents."""
    N, H, C = q_lat.shape
    out = np.zeros((N, H, C))
    for n in range(N):
        sel = slots[n][slots[n] >= 0]
        if len(sel) == 0:
            continue
        lat = latent[layer, sel].astype(np.float64)
        rope = k_rope[layer, sel].astype(np.float64)
        for h in range(H):
            s = scale * (lat @ q_lat[n, h].astype(np.float64) + rope @ q_rope[n, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[n, h] = p @ lat / p.sum()
    return out


def test_reference_equals_a_float64_loop():
    q_lat, q_rope, latent, k_rope, slots = make_case(9, 3, 16, 8, 20)
    got = np.asarray(sparse_mla_reference(*map(jnp.asarray, (q_lat, q_rope, latent, k_rope)), 1, jnp.asarray(slots),
                                          0.3))
    want = loop_reference(q_lat, q_rope, latent, k_rope, 1, slots, 0.3)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(got[2] == 0)                                     # nothing selected: zeros


@pytest.mark.parametrize("H,tiling", [
    (4, Tiling(block_h=16, block_k=16, splits=1)),                  # heads padded to the block
    (16, Tiling(block_h=16, block_k=16, splits=3)),                 # splits merged by log-sum-exp
    (20, Tiling(block_h=16, block_k=32, splits=2)),                 # two head blocks, the last padded
])
def test_kernel_interpret_equals_reference(H, tiling):
    q_lat, q_rope, latent, k_rope, slots = make_case(7, H, 32, 16, 70, seed=H)
    args = (*map(jnp.asarray, (q_lat, q_rope, latent, k_rope)), 2, jnp.asarray(slots), 0.25)
    want = loop_reference(q_lat, q_rope, latent, k_rope, 2, slots, 0.25)
    got = np.asarray(sparse_mla_pallas(*args, tiling=tiling, interpret=True))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sparse_mla_reference(*args)), got, rtol=2e-5, atol=2e-5)


def test_kernel_interpret_bf16_is_close():
    q_lat, q_rope, latent, k_rope, slots = make_case(5, 16, 32, 16, 48, seed=3)
    args = (*(jnp.asarray(a, jnp.bfloat16) for a in (q_lat, q_rope, latent, k_rope)), 0, jnp.asarray(slots), 0.2)
    got = np.asarray(sparse_mla_pallas(*args, tiling=Tiling(block_h=16, block_k=16, splits=2), interpret=True),
                     np.float32)
    want = loop_reference(*(np.asarray(a, np.float32) for a in args[:4]), 0, slots, 0.2)
    assert got.dtype == np.float32 and np.max(np.abs(got - want)) < 3e-2 * np.max(np.abs(want))


def packed_or_nan(slots, out):
    """out where every row of slots is packed (its selected slots first, -1 after: what the model
    promises the kernel with packed=True), else NaN, so that a comparison after a jitted step fails."""
    from pallas_kernels.sparse_mla.kernel_mgpu import selected_first
    return jnp.where(jnp.all(selected_first(slots.astype(jnp.int32))[0] == slots), out, jnp.nan)


@pytest.mark.parametrize("name", ["glm_tiny"])
def test_model_through_the_kernel_matches_hf(name, monkeypatch):
    """The absorbed path with the kernel (in interpret mode, standing in for the GPU: the dispatch only
    takes it there) against HF transformers, prefill and step decode, fp32: the model's slots, head
    layout and pool reads feed the kernel what the jnp composition reads."""
    import models.attention as attention
    from models.model import jit_forward
    from tests.helpers import hf_model, reference, rel_err
    from tests.test_hf_parity import TOL, decode_logits

    calls = []

    def kernel(q_lat, q_rope, latent, k_rope, layer, slots, scale, *, policy, packed):
        calls.append((q_lat.shape, packed))
        out = sparse_mla_pallas(q_lat, q_rope, latent, k_rope, layer, slots, scale, interpret=True,
                                tiling=tiling_for(*q_lat.shape[:2], slots.shape[1], q_lat.dtype))
        return packed_or_nan(slots, out)
    monkeypatch.setattr(attention, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(attention, "sparse_mla", kernel)
    ref = reference(name)
    model = hf_model(name)
    # a policy value of its own: the jitted step is traced afresh under the patch, not taken from the cache
    policy = KernelPolicy(scores_max_bytes=(4 << 30) - 1)
    tokens = jnp.asarray(ref["prefill_tokens"], jnp.int32)
    from models.kv import contiguous_batch, empty_kv_cache
    B, T = tokens.shape
    logits, _ = jit_forward(model, attn_path="absorbed", kernels=policy)(
        contiguous_batch(tokens), empty_kv_cache(model.cfg, 1 + B * T, model.dtype))
    assert calls and all(packed for _, packed in calls), calls
    assert rel_err(np.asarray(logits), ref["prefill_logits"]) <= TOL
    dec = decode_logits(model, ref["decode_tokens"], int(ref["decode_prefill_len"]), "absorbed", kernels=policy)
    assert rel_err(dec, ref["decode_logits"]) <= TOL


def test_cp_engine_through_the_kernel_equals_single_device(tiny, monkeypatch):
    """Under CP the kernel reads the rows KVAccess.rows_for brought from their owners (every visible row
    for a prefill chunk, the selected ones for decode) as a one-layer pool: a cp = 2 engine with the
    kernel (interpret mode) gives the single-device engine's greedy tokens and logits (fp32)."""
    import cpkv_jax.runner as runner
    import models.attention as attention
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from tests.helpers import rel_err

    calls = []

    def kernel(q_lat, q_rope, latent, k_rope, layer, slots, scale, *, policy, packed):
        assert packed
        calls.append(latent.shape)
        out = sparse_mla_pallas(q_lat, q_rope, latent, k_rope, layer, slots, scale, interpret=True,
                                tiling=tiling_for(*q_lat.shape[:2], slots.shape[1], q_lat.dtype))
        return packed_or_nan(slots, out)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, n).tolist() for n in (20, 45)]   # 45 > top-k 32
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    want = Engine(tiny, EngineConfig(page_size=16, kv_pages=32)).generate(prompts, params, return_logits=True)
    monkeypatch.setattr(attention, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(attention, "sparse_mla", kernel)
    monkeypatch.setattr(runner, "kernel_applies", lambda *a: True)
    # a policy value of its own: the CP step is traced afresh under the patch, not taken from the cache
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=32, cp_size=2,
                                    kernels=KernelPolicy(scores_max_bytes=(4 << 30) - 2)))
    got = eng.generate(prompts, params, return_logits=True)
    assert eng.runner.sparse_kernel and calls
    assert all(shape[0] == 1 for shape in calls)            # the rows brought over, not the stacked pool
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert rel_err(np.stack(g.logits), np.stack(w.logits)) <= 1e-5


def test_dispatch_takes_the_reference_off_the_gpu_and_names_what_does_not_fit():
    q_lat, q_rope, latent, k_rope, slots = make_case(3, 4, 32, 16, 8)
    args = (*map(jnp.asarray, (q_lat, q_rope, latent, k_rope)), 0, jnp.asarray(slots), 0.5)
    np.testing.assert_array_equal(np.asarray(sparse_mla(*args)), np.asarray(sparse_mla_reference(*args)))
    assert "not a power of two" in kernel_shape_error(jnp.zeros((1, 4, 48), jnp.bfloat16), jnp.zeros((1, 4, 16),
                                                                                                    jnp.bfloat16))
    assert "bf16 and fp16" in kernel_shape_error(jnp.zeros((1, 4, 32)), jnp.zeros((1, 4, 16)))
    assert tiling_for(8192, 64, 2048) == Tiling(block_h=64, block_k=128, num_stages=1)   # prefill
    assert tiling_for(8, 64, 2048).splits == 32                      # decode: one 64-row block per program


def test_dispatch_maps_the_policy_to_the_kernel_and_its_mode(monkeypatch):
    """Which kernel the dispatch calls, and how, for each policy (on CPU: the kernels are replaced by
    recorders and the policy reports a GPU): prefill-sized bf16 calls take the Mosaic GPU kernel with
    the scores mode the policy names, decode-sized ones the Mosaic GPU row splits over one wave or,
    with mgpu_sparse_mla_rows off, the Triton kernel's splits; the policy off takes the reference; both
    Mosaic GPU calls are handed mgpu_sparse_mla_l2_prefetch."""
    import pallas_kernels.sparse_mla.dispatch as dispatch
    calls = []
    monkeypatch.setattr(KernelPolicy, "on_gpu", lambda self: self.enabled)
    prefetch = []
    packs = []
    monkeypatch.setattr(dispatch, "sparse_mla_mgpu", lambda *a, scores, l2_prefetch, packed: calls.append(
        ("mgpu", scores)) or prefetch.append(l2_prefetch) or packs.append(packed))
    monkeypatch.setattr(dispatch, "sparse_mla_mgpu_rows", lambda *a, row_splits, l2_prefetch, packed: calls.append(
        ("rows", row_splits)) or prefetch.append(l2_prefetch) or packs.append(packed))
    monkeypatch.setattr(dispatch, "sparse_mla_pallas", lambda *a, tiling: calls.append(("triton", tiling.splits)))
    monkeypatch.setattr(dispatch, "sparse_mla_reference", lambda *a: calls.append(("reference",)))
    sds = jax.ShapeDtypeStruct
    pool = (sds((1, 4096, 512), jnp.bfloat16), sds((1, 4096, 64), jnp.bfloat16))

    def route(N, packed=False, **policy):
        calls.clear()
        sparse_mla(sds((N, 64, 512), jnp.bfloat16), sds((N, 64, 64), jnp.bfloat16), *pool, 0,
                   sds((N, 2048), jnp.int32), 0.1, policy=KernelPolicy(**policy), packed=packed)
        return calls[0]
    assert route(8192) == ("mgpu", "both")
    assert route(8192, mgpu_sparse_mla_alternate=True) == ("mgpu", "alternate")
    assert route(8) == ("rows", dispatch.row_splits_for(8, 2048)) == ("rows", 16)      # one wave: 8 x 16 programs
    assert route(64) == ("rows", 2) and route(1) == ("rows", 32) and route(200) == ("rows", 1)
    assert route(8, mgpu_sparse_mla_rows=False) == ("triton", tiling_for(8, 64, 2048).splits)
    assert route(8192, mgpu_sparse_mla=False)[0] == "triton"
    assert route(8192, enabled=False) == ("reference",)
    assert all(prefetch)                 # on by default
    assert route(8192, mgpu_sparse_mla_l2_prefetch=False)[0] == "mgpu" and prefetch[-1] is False
    assert route(8, mgpu_sparse_mla_l2_prefetch=False)[0] == "rows" and prefetch[-1] is False
    assert not any(packs)                # the caller's promise, passed on as given
    assert route(8192, packed=True)[0] == "mgpu" and packs[-1] is True
    assert route(8, packed=True)[0] == "rows" and packs[-1] is True


def test_packed_slots_equal_the_compaction_on_packed_rows_and_lower():
    """kernel_mgpu.packed_slots (the kernel's operands for rows the caller promises packed) equals
    selected_first's on the rows the indexer's selection produces (its positions ascending, -1 after;
    full, short and empty rows), and differs on an unpacked row (the promise matters); the kernel
    lowers for the GPU with packed=True."""
    import functools

    from pallas_kernels.indexer import select_topk_reference
    from pallas_kernels.sparse_mla.kernel_mgpu import packed_slots, selected_first, sparse_mla_mgpu
    rng = np.random.default_rng(5)
    scores = jnp.asarray(rng.standard_normal((6, 300)), jnp.float32)
    lengths = jnp.asarray([300, 40, 1, 0, 64, 65])
    scores = jnp.where(jnp.arange(300) < lengths[:, None], scores, -jnp.inf)
    topk = select_topk_reference(scores, 64)
    table = jnp.asarray(rng.permutation(1000)[:300], jnp.int32)
    slots = jnp.where(topk >= 0, table[jnp.maximum(topk, 0)], -1)
    got, want = packed_slots(slots), selected_first(slots)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert list(np.asarray(got[1])) == [64, 40, 1, 0, 64, 64]
    unpacked = slots.at[0, 3].set(-1)
    assert not np.array_equal(np.asarray(packed_slots(unpacked)[0]), np.asarray(selected_first(unpacked)[0]))
    sds = jax.ShapeDtypeStruct
    args = (sds((8, 64, 512), jnp.bfloat16), sds((8, 64, 64), jnp.bfloat16), sds((2, 4096, 512), jnp.bfloat16),
            sds((2, 4096, 64), jnp.bfloat16), 1, sds((8, 2048), jnp.int32), 0.1)
    fn = jax.jit(functools.partial(sparse_mla_mgpu, packed=True, with_stats=True, row_splits=4),
                 static_argnums=(4, 6))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,K,P", [(1, 64, 2048, 4096), (8, 64, 2048, 8192), (300, 64, 2048, 4096),
                                     (64, 8, 512, 1024), (33, 5, 40, 100), (450, 4, 32, 600)])
def test_kernel_compiled_equals_reference(N, H, K, P):
    """GLM-5's widths (latent 512, rope 64), decode to prefill-sized calls, heads split by tensor
    parallelism (8) and odd (5), bf16; the tiny model's widths (latent 32, rope 16) in bf16 and fp32."""
    C, R = (32, 16) if H == 4 else (512, 64)                          # H = 4: the tiny model's widths
    q_lat, q_rope, latent, k_rope, slots = make_case(N, H, C, R, K, P=P, L=2, seed=N)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(q_lat) * 0.05, bf(q_rope) * 0.05, bf(latent), bf(k_rope), 1, jnp.asarray(slots), 0.1)
    want = np.asarray(sparse_mla_reference(*args), np.float32)
    got = np.asarray(sparse_mla(*args, policy=KernelPolicy()), np.float32)
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-2, err
    off = np.asarray(sparse_mla(*args, policy=KernelPolicy(sparse_mla_kernel=False)), np.float32)
    np.testing.assert_array_equal(off, want)
    if C <= 128:   # fp32 (exact dots): the tiny model's widths
        args32 = tuple(a.astype(jnp.float32) if hasattr(a, "dtype") and a.dtype == jnp.bfloat16 else a for a in args)
        got32 = np.asarray(sparse_mla_pallas(*args32, tiling=tiling_for(N, H, K, jnp.float32)))
        np.testing.assert_allclose(got32, np.asarray(sparse_mla_reference(*args32)), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("N,H,K,P", [(300, 64, 2048, 4096), (64, 8, 512, 1024), (450, 16, 100, 600), (5, 64, 64, 64)])
def test_mgpu_kernel_compiled_equals_reference(N, H, K, P, scores):
    """The Mosaic GPU prefill kernel (rows gathered by cp.async), each way of sharing the scores between
    its compute warpgroups (the alternate split with odd and even block counts): GLM-5's widths, full /
    short / empty rows with -1 anywhere, K not a multiple of its 64-row blocks, heads fewer than 64 (padded), layer 1 of a two-layer pool; its output written
    whole (no row left as the buffer held it)."""
    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu

    q_lat, q_rope, latent, k_rope, slots = make_case(N, H, 512, 64, K, P=P, L=2, seed=N + K)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(q_lat) * 0.05, bf(q_rope) * 0.05, bf(latent), bf(k_rope), 1, jnp.asarray(slots), 0.1)
    want = np.asarray(sparse_mla_reference(*args), np.float32)
    got = np.asarray(sparse_mla_mgpu(*args, scores=scores), np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-2, err
    empty = np.all(slots < 0, axis=1)
    assert np.all(got[empty] == 0)
    routed = np.asarray(sparse_mla(*args, policy=KernelPolicy()), np.float32)     # the dispatch's choice
    assert np.max(np.abs(routed - want)) / np.max(np.abs(want)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("row_threads,l2_prefetch", [(t, False) for t in ROW_THREADS] + [(4, True)])
@pytest.mark.parametrize("N,K,P,row_splits", [(300, 2048, 4096, 1), (5, 64, 64, 1), (8, 2048, 8192, 16)])
def test_mgpu_row_copies_compiled_equal_reference(N, K, P, row_splits, row_threads, l2_prefetch):
    """Each way of laying the memory warpgroup's threads over a block's rows (row_threads a row, in
    64 * row_threads / 128 passes; the copies with or without the L2::256B prefetch hint) copies every
    selected row to where the compute reads it: full / short / empty rows with -1 anywhere, one program
    per query and row shares."""
    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu_rows

    q_lat, q_rope, latent, k_rope, slots = make_case(N, 64, 512, 64, K, P=P, L=2, seed=N + row_threads)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(q_lat) * 0.05, bf(q_rope) * 0.05, bf(latent), bf(k_rope), 1, jnp.asarray(slots), 0.1)
    want = np.asarray(sparse_mla_reference(*args), np.float32)
    got = np.asarray(sparse_mla_mgpu_rows(*args, row_splits=row_splits, row_threads=row_threads,
                                          l2_prefetch=l2_prefetch), np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 2e-2
    assert np.all(got[np.all(slots < 0, axis=1)] == 0)


def test_selected_first_keeps_each_rows_selection_in_order():
    """The Mosaic GPU kernel's wrapper moves each row's selected slots to the front (the kernel masks by
    a count); the reference gives the same attention either way."""
    from pallas_kernels.sparse_mla.kernel_mgpu import selected_first

    q_lat, q_rope, latent, k_rope, slots = make_case(12, 3, 16, 8, 20)
    front, count = map(np.asarray, selected_first(jnp.asarray(slots)))
    for row, f, c in zip(slots, front, count):
        assert c == np.sum(row >= 0)
        np.testing.assert_array_equal(f[:c], row[row >= 0])
        assert np.all(f[c:] == -1)
    args = (*map(jnp.asarray, (q_lat, q_rope, latent, k_rope)), 1)
    np.testing.assert_allclose(np.asarray(sparse_mla_reference(*args, jnp.asarray(front), 0.3)),
                               np.asarray(sparse_mla_reference(*args, jnp.asarray(slots), 0.3)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("row_splits", [1, 3, 8])
def test_row_splits_merged_equal_the_whole_rows(row_splits):
    """Decode-sized calls cut each query's selected rows in row_splits contiguous shares (split_rows,
    what the kernel's programs read) and merge their normalized outputs by their softmax statistics:
    with the kernel stood in for by the jnp reference and its statistics (the same conventions: log2
    units, m = -1e30 and l = 0 for no row), the merged attention equals the whole rows' reference on
    full, short and empty rows (shares of 4-row blocks here, so 20 rows split; shares with no row
    at all merge as nothing)."""
    from pallas_kernels.sparse_mla.kernel_mgpu import merge_row_splits, split_rows
    from pallas_kernels.sparse_mla.reference import sparse_mla_stats_reference

    q_lat, q_rope, latent, k_rope, slots = make_case(9, 4, 32, 16, 20, seed=row_splits)
    args = (*map(jnp.asarray, (q_lat, q_rope, latent, k_rope)), 1)
    shares = np.asarray(split_rows(jnp.asarray(slots), row_splits, step=4))
    W = shares.shape[1]
    assert shares.shape[0] == 9 * row_splits and W % 4 == 0 and W >= -(-20 // row_splits)
    for n in range(9):                       # each query's rows, every one exactly once, in contiguous shares
        mine = shares[n * row_splits:(n + 1) * row_splits]
        np.testing.assert_array_equal(mine[mine >= 0], slots[n][slots[n] >= 0])
        counts = (mine >= 0).sum(axis=1)
        per_split = -(-counts.sum() // row_splits)
        share = -(-per_split // 4) * 4                                # ceil(c / S) up to whole 4-row blocks
        assert np.all(counts <= share) and np.all(np.diff(counts) <= 0)
        assert counts.sum() == (slots[n] >= 0).sum()
    rep = lambda a: jnp.repeat(a, row_splits, axis=0)   # noqa: E731
    split = (rep(args[0]), rep(args[1]), *args[2:], jnp.asarray(shares), 0.3)
    got = merge_row_splits(sparse_mla_reference(*split), sparse_mla_stats_reference(*split), row_splits,
                           jnp.float32)
    want = sparse_mla_reference(*args, jnp.asarray(slots), 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.asarray(got)[2].any()                              # the empty row: zeros


@pytest.mark.parametrize("scores,row_threads,l2_prefetch",
                         [(s, 2, False) for s in SCORES] + [("both", 4, False), ("both", 8, False), ("both", 4, True)])
def test_mgpu_kernel_lowers_for_cuda(scores, row_threads, l2_prefetch):
    """Each way of sharing the scores in the Mosaic GPU kernel traces and lowers for CUDA on any machine
    (layout inference, shared memory within the H100/H200 limit); the gpu test above runs them. With
    l2_prefetch the row copies are the inline PTX with the L2::256B hint."""
    import functools

    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu

    N, H, C, R, L, P, K = 300, 64, 512, 64, 2, 4096, 2048
    sds = jax.ShapeDtypeStruct
    args = (sds((N, H, C), jnp.bfloat16), sds((N, H, R), jnp.bfloat16), sds((L, P, C), jnp.bfloat16),
            sds((L, P, R), jnp.bfloat16), 1, sds((N, K), jnp.int32), 0.1)
    fn = jax.jit(functools.partial(sparse_mla_mgpu, scores=scores, row_threads=row_threads, l2_prefetch=l2_prefetch),
                 static_argnums=(4, 6))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    fn = jax.jit(functools.partial(sparse_mla_mgpu, scores=scores, with_stats=True, row_threads=row_threads,
                                   l2_prefetch=l2_prefetch), static_argnums=(4, 6))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("opts,named", [(dict(row_threads=3), "row_threads"), (dict(scores="odd"), "scores"),
                                        (dict(row_splits=2), "row_splits")])
def test_mgpu_kernel_refuses_what_it_cannot_lay_out(opts, named):
    """Copy layouts the kernel has no pass plan for, unknown score splits and row shares without the
    statistics that merge them are named before anything is traced."""
    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu

    q_lat, q_rope, latent, k_rope, slots = make_case(4, 64, 512, 64, 128, P=256, L=1)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match=named):
        sparse_mla_mgpu(bf(q_lat), bf(q_rope), bf(latent), bf(k_rope), 0, jnp.asarray(slots), 0.1, **opts)


def test_mgpu_row_splits_lower_for_cuda():
    """The decode-sized call through row splits (8 queries x 33 splits of GLM-5's 2048 rows) traces and
    lowers for CUDA: the kernel with its statistics output, then the merge."""
    import functools

    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu_rows

    N, H, C, R, L, P, K = 8, 64, 512, 64, 2, 4096, 2048
    sds = jax.ShapeDtypeStruct
    args = (sds((N, H, C), jnp.bfloat16), sds((N, H, R), jnp.bfloat16), sds((L, P, C), jnp.bfloat16),
            sds((L, P, R), jnp.bfloat16), 1, sds((N, K), jnp.int32), 0.1)
    fn = jax.jit(functools.partial(sparse_mla_mgpu_rows, row_splits=33), static_argnums=(4, 6))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64])
def test_mgpu_row_splits_compiled_equal_reference(N, monkeypatch):
    """Decode-sized calls through the Mosaic GPU kernel with row splits (the dispatch's count), compiled:
    GLM-5's widths, full / short / empty rows; the kernel's statistics output against the reference's
    statistics on split_rows' shares (the kernel computes its shares itself); the dispatch with
    policy.mgpu_sparse_mla_rows takes this path."""
    from pallas_kernels.sparse_mla.dispatch import row_splits_for
    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu, sparse_mla_mgpu_rows, split_rows
    from pallas_kernels.sparse_mla.reference import sparse_mla_stats_reference

    q_lat, q_rope, latent, k_rope, slots = make_case(N, 64, 512, 64, 2048, P=8192, L=2, seed=N)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(q_lat) * 0.05, bf(q_rope) * 0.05, bf(latent), bf(k_rope), 1, jnp.asarray(slots), 0.1)
    S = row_splits_for(N, 2048)
    want = np.asarray(sparse_mla_reference(*args), np.float32)
    got = np.asarray(jax.jit(sparse_mla_mgpu_rows, static_argnums=(4, 6), static_argnames="row_splits")(
        *args, row_splits=S), np.float32)
    assert np.all(np.isfinite(got)) and np.max(np.abs(got - want)) / np.max(np.abs(want)) < 2e-2
    assert np.all(got[np.all(slots < 0, axis=1)] == 0)
    rep = lambda a: jnp.repeat(a, S, axis=0)   # noqa: E731
    shares = (rep(args[0]), rep(args[1]), *args[2:5], split_rows(args[5], S), args[6])
    _, stats = sparse_mla_mgpu(*args, with_stats=True, row_splits=S)     # the kernel's own shares
    ref = np.asarray(sparse_mla_stats_reference(*shares))
    some = ref[:, 1] > 0
    np.testing.assert_allclose(np.asarray(stats)[:, 0][some], ref[:, 0][some], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(stats)[:, 1][some], ref[:, 1][some], rtol=2e-2)
    assert np.all(np.asarray(stats)[:, 1][~some] == 0)
    import pallas_kernels.sparse_mla.dispatch as dispatch
    calls = []
    monkeypatch.setattr(dispatch, "sparse_mla_mgpu_rows", lambda *a, **kw: calls.append(kw) or sparse_mla_mgpu_rows(*a, **kw))
    routed = np.asarray(sparse_mla(*args, policy=KernelPolicy(mgpu_sparse_mla_rows=True)), np.float32)
    assert calls == [{"row_splits": S, "l2_prefetch": KernelPolicy().mgpu_sparse_mla_l2_prefetch, "packed": False}]
    assert np.max(np.abs(routed - want)) / np.max(np.abs(want)) < 2e-2
    from pallas_kernels.sparse_mla.kernel_mgpu import selected_first    # packed rows read as they are:
    front = selected_first(args[5])[0]                                 # the same rows in the same order
    packed = jax.jit(sparse_mla_mgpu_rows, static_argnums=(4, 6), static_argnames=("row_splits", "packed"))(
        *args[:5], front, args[6], row_splits=S, packed=True)
    np.testing.assert_array_equal(np.asarray(packed, np.float32), got)
