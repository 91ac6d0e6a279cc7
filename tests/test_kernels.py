"""Pallas kernels equal their references: interpret mode on CPU (semantics), compiled on the GPU
(marked gpu: interpret mode does not prove a kernel lowers)."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.row_gather import (combine_rows, combine_rows_pallas, combine_rows_reference, compaction_plan,
                                       expert_order, gather_rows, gather_rows_pallas, gather_rows_reference)


def cases():
    rng = np.random.default_rng(0)
    for N, D, M in ((1, 64, 1), (37, 128, 50), (200, 512, 129), (64, 1024, 64)):
        x = rng.standard_normal((N, D)).astype(np.float32)
        idx = rng.integers(-1, N, M).astype(np.int32)
        idx[:3] = -1  # zero rows
        yield x, idx


@pytest.mark.parametrize("dtype,steps", [(jnp.float32, 1), (jnp.bfloat16, 3)])
def test_gather_rows_interpret_equals_reference(dtype, steps):
    for x, idx in cases():
        xd = jnp.asarray(x, dtype)
        out = gather_rows_pallas(xd, jnp.asarray(idx), block_rows=16, block_cols=min(64, x.shape[1]),
                                 steps=steps, interpret=True)
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(gather_rows_reference(xd, jnp.asarray(idx)), np.float32))


def test_gather_rows_rejects_bad_shapes():
    x = jnp.zeros((8, 16), jnp.float32)
    for gather in (gather_rows, lambda *a: gather_rows_pallas(*a, block_cols=16, interpret=True)):
        for bad_x, bad_idx in ((x[0], jnp.zeros((4,), jnp.int32)), (x, jnp.zeros((4, 1), jnp.int32)),
                               (x, jnp.zeros((4,), jnp.float32))):
            with pytest.raises(ValueError, match="gather_rows takes rows x"):
                gather(bad_x, bad_idx)
        assert gather(x, jnp.array([3, -1, 0], jnp.int32)).shape == (3, 16)


def combine_cases():
    """(y rows, idx [N, k], w [N, k]): rows shared by several slots, slots with no row (-1), k of 1 to 8."""
    rng = np.random.default_rng(2)
    for M, D, N, k in ((5, 64, 1, 1), (90, 128, 37, 8), (300, 512, 64, 4), (64, 1024, 17, 3)):
        y = rng.standard_normal((M, D)).astype(np.float32)
        idx = rng.integers(-1, M, (N, k)).astype(np.int32)
        idx[0, 0] = -1
        w = rng.uniform(-2, 2, (N, k)).astype(np.float32)
        yield y, idx, w


def combine_by_hand(y, idx, w):
    """fp64: sum over j of y[idx[:, j]] * w[:, j], nothing for idx < 0."""
    y = np.asarray(y, np.float64)
    w = np.asarray(w, np.float64)
    out = np.zeros((idx.shape[0], y.shape[1]))
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            if idx[t, j] >= 0:
                out[t] += y[idx[t, j]] * w[t, j]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_combine_rows_interpret_equals_reference(dtype):
    """The kernel (interpret mode) equals the reference and both equal the weighted sum computed by
    hand in fp64, to a few fp32 roundings (fp32 weights, fp32 sums; a product may be fused into its
    sum, FMA, so not bit for bit)."""
    for y, idx, w in combine_cases():
        yd = jnp.asarray(y, dtype)
        ref = np.asarray(combine_rows_reference(yd, jnp.asarray(idx), jnp.asarray(w)))
        got = combine_rows_pallas(yd, jnp.asarray(idx), jnp.asarray(w), block_rows=8, block_cols=min(64, y.shape[1]),
                                  interpret=True)
        assert got.dtype == jnp.float32
        want = combine_by_hand(np.asarray(yd, np.float32), idx, w)
        tol = 1e-6 * idx.shape[1] * np.abs(want).max()
        assert np.abs(ref - want).max() <= tol and np.abs(np.asarray(got) - want).max() <= tol


def test_combine_rows_rejects_bad_shapes():
    y = jnp.zeros((8, 16), jnp.float32)
    i2, w2 = jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2), jnp.float32)
    for combine in (combine_rows, lambda *a: combine_rows_pallas(*a, block_cols=16, interpret=True)):
        for args in ((y[0], i2, w2), (y, i2[:, 0], w2[:, 0]), (y, i2, w2[:, :1]), (y, i2.astype(jnp.float32), w2)):
            with pytest.raises(ValueError, match="combine_rows takes rows y"):
                combine(*args)
        assert combine(y, i2, w2).shape == (4, 16)


def test_moe_weighted_sum_matches_the_slot_order_sum():
    """ExpertRows.weighted_sum (combine_rows over the padded rows) equals the slots read out in order,
    weighted by the fp32 weights and summed (fp64 by hand, to fp32 rounding)."""
    from pallas_kernels.moe import expert_mlp
    rng = np.random.default_rng(11)
    N, k, D, I, E = 24, 4, 128, 64, 6
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((E, D, I)) * D ** -0.5, jnp.bfloat16) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, I, D)) * I ** -0.5, jnp.bfloat16)
    fe = jnp.asarray(rng.integers(0, E + 1, N * k), jnp.int32)          # E: joins no expert
    w = rng.uniform(0, 1, (N, k)).astype(np.float32)
    rows = expert_mlp(x, fe, gate, up, down, k)
    slots = np.asarray(rows.slots(), np.float64).reshape(N, k, D)
    assert (slots.reshape(N * k, D)[np.asarray(fe) == E] == 0).all() and np.abs(slots).max() > 0.1
    want = (slots * w[..., None]).sum(1)
    got = np.asarray(rows.weighted_sum(jnp.asarray(w)))
    assert np.abs(got - want).max() <= 1e-6 * k * np.abs(want).max()


def test_compaction_and_expert_order_plans():
    rng = np.random.default_rng(1)
    valid = rng.random(300) < 0.3
    perm, dest, n = (np.asarray(a) for a in compaction_plan(jnp.asarray(valid)))
    assert n == valid.sum()
    np.testing.assert_array_equal(perm[:n], np.flatnonzero(valid))
    assert (perm[n:] == -1).all()
    np.testing.assert_array_equal(dest[valid], np.arange(n))
    assert (dest[~valid] == -1).all()
    e = rng.integers(-1, 9, 500)
    order, sizes = (np.asarray(a) for a in expert_order(jnp.asarray(e, jnp.int32), 8))
    ref = np.argsort(np.where((e >= 0) & (e < 8), e, 8), kind="stable")
    np.testing.assert_array_equal(order, ref)
    np.testing.assert_array_equal(sizes, np.bincount(e[(e >= 0) & (e < 8)], minlength=8))


@pytest.mark.gpu
def test_gather_rows_compiled_on_gpu_equals_reference():
    assert jax.default_backend() == "gpu"
    for x, idx in cases():
        for dtype in (jnp.float32, jnp.bfloat16):
            xd = jnp.asarray(x, dtype)
            bc = min(512, x.shape[1])
            for steps in (1, 4):
                out = jax.jit(lambda a, i: gather_rows_pallas(a, i, block_cols=bc, steps=steps))(xd, jnp.asarray(idx))
                np.testing.assert_array_equal(np.asarray(out, np.float32),
                                              np.asarray(gather_rows_reference(xd, jnp.asarray(idx)), np.float32))


@pytest.mark.gpu
def test_combine_rows_compiled_on_gpu_equals_reference():
    assert jax.default_backend() == "gpu"
    for y, idx, w in combine_cases():
        for dtype in (jnp.float32, jnp.bfloat16):
            yd = jnp.asarray(y, dtype)
            ref = np.asarray(jax.jit(combine_rows_reference)(yd, jnp.asarray(idx), jnp.asarray(w)))
            want = combine_by_hand(np.asarray(yd, np.float32), idx, w)
            tol = 1e-6 * idx.shape[1] * np.abs(want).max()
            assert np.abs(ref - want).max() <= tol
            for block_rows in (16, 32):
                got = jax.jit(functools.partial(combine_rows_pallas, block_rows=block_rows))(
                    yd, jnp.asarray(idx), jnp.asarray(w))
                assert np.abs(np.asarray(got) - want).max() <= tol
            assert np.abs(np.asarray(jax.jit(combine_rows)(yd, jnp.asarray(idx), jnp.asarray(w))) - want).max() <= tol


@pytest.mark.gpu
def test_model_outputs_identical_with_kernels_on_and_off():
    """The MoE path through the Pallas row gather vs the jnp reference: the same greedy tokens and
    logits to fp32 rounding. (Not bit for bit: with the gather as a custom call XLA fuses the
    matmuls around it differently, which reorders their fp32 accumulation.)"""
    from models.model import prefill_logits
    from tests.helpers import hf_model, rel_err

    model = hf_model("glm_indexcache")
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 40))
    on = np.asarray(prefill_logits(model, tokens))
    off = np.asarray(prefill_logits(model, tokens, kernels=KernelPolicy(enabled=False)))
    err = rel_err(on, off)
    print(f"kernels on vs off: rel err {err:.2e}")
    assert err <= 1e-5, err
    np.testing.assert_array_equal(on.argmax(-1), off.argmax(-1))


# ---- indexer top-k ----------------------------------------------------------------------------

from cpkv_jax.kv_pool import paged_slot_table  # noqa: E402
from pallas_kernels.indexer import (PATHS, RESIDENT_MAX_WIDTH, bracket_tiling, dequantize_index_k,  # noqa: E402
                                    index_keys_fp32, index_scores_pallas, index_scores_reference, indexer_topk,
                                    indexer_topk_fused, quantize_index_k, sample_block_start, sample_size,
                                    select_tiling, select_topk, select_topk_pallas, select_topk_reference)


def topk_oracle(scores, k, lengths=None):
    """numpy: stable descending sort (ties to the lower position), -inf and invisible never chosen,
    ascending positions, -1 padding — computed without lax.top_k."""
    s = np.array(scores, np.float64).reshape(-1, scores.shape[-1])
    if lengths is not None:
        s[np.arange(s.shape[1])[None, :] >= np.asarray(lengths).reshape(-1, 1)] = -np.inf
    out = np.full((s.shape[0], k), -1, np.int32)
    for r, row in enumerate(s):
        chosen = [j for j in np.argsort(-row, kind="stable")[:k] if row[j] != -np.inf]
        out[r, :len(chosen)] = np.sort(chosen)
    return out.reshape(scores.shape[:-1] + (k,))


def hide_from_sample(row, length, tiling, k):
    """Raise 2k columns the kernel's sample (blocks of 16 columns spread over the row) never reads, so
    the sampled bracket misses the top-k and the row must take the full search."""
    n_blocks = int(sample_size(length, tiling["sample"], tiling["sub"])) // 16
    seen = np.zeros(length, bool)
    for b in range(n_blocks):
        start = int(sample_block_start(b, length, n_blocks))
        seen[start:start + 16] = True
    hidden = np.flatnonzero(~seen)[:2 * k]
    row[hidden] += 100.0


SELECTION_SHAPES = [(3, 40, 8), (5, 100, 30), (4, 64, 70), (2, 33, 5), (7, 257, 64), (1, 1, 4), (6, 1000, 50),
                    (6, 3000, 20), (64, 8192, 2048), (16, 131072, 2048), (96, 32768, 2048), (33, 5000, 777),
                    (1, 8192, 2048)]   # big=True: all; else the first eight


def selection_cases(rng, big=False, tiling_for=None):
    """(scores, k, lengths): ties, -inf, -0/+0, all-masked rows, fewer visible than k, widths that
    are not multiples of the chunk, rows wider than the kernel's candidate capacity (sampled
    bracket), and a row whose top-k the sample cannot see (full search; `tiling_for(width)`: the
    kernel's parameters)."""
    shapes = SELECTION_SHAPES if big else SELECTION_SHAPES[:8]
    for R, N, k in shapes:
        s = rng.standard_normal((R, N)).astype(np.float32)
        s[0, ::3] = 0.5                                   # ties inside the top-k
        if R > 1:
            s[1, :] = -np.inf                             # fewer visible than k, -0/+0 ties
            s[1, 5:9] = [1.0, -0.0, 0.0, -0.0]
        if R > 2:
            s[2, :] = np.round(s[2, :] * 2)               # many ties at the threshold
        if R > 3:
            s[3, :] = -np.inf                             # nothing visible
        if R > 4 and tiling_for is not None:
            hide_from_sample(s[4], N, tiling_for(N), k)
        lengths = rng.integers(0, N + 1, R).astype(np.int32)
        yield s, k, None
        yield s, k, lengths


# (the last two finish every bracket-held row from registers: held_cands is at least segments x capacity)
SMALL_SELECT = [dict(bits=4, chunk=32, capacity=64, sample=64, sub=16, segments=1),
                dict(bits=2, chunk=16, capacity=32, sample=32, sub=16, segments=8),
                dict(bits=8, chunk=64, capacity=128, sample=128, sub=32, segments=2),
                dict(bits=2, chunk=16, capacity=32, sample=32, sub=16, segments=8, held_cands=256),
                dict(bits=8, chunk=64, capacity=128, sample=128, sub=32, segments=2, held_cands=256, held_bits=4)]


def test_bracket_tilings_keep_random_rows_on_the_sampled_bracket():
    """The two-call tilings in interpret mode at GLM-5's k = 2048 and widths: every random row's
    candidates (keys >= lo) fit the capacity, so every row takes the sampled bracket (one read of the
    row; the full search would be 8), and the result is exact."""
    for rows, width, tiling_rows in ((64, 8192, 64), (64, 32768, 2048), (32, 131072, 64)):
        s = np.random.default_rng(width).standard_normal((rows, width)).astype(np.float32)
        got, path = select_topk_pallas(jnp.asarray(s), 2048, interpret=True, poison=-7, return_path=True,
                                       **bracket_tiling(tiling_rows, width, 2048))
        assert (np.asarray(path) == PATHS.index("sampled bracket")).all(), np.asarray(path)
        np.testing.assert_array_equal(np.asarray(got), topk_oracle(s, 2048))


def test_dispatch_tilings_interpret_equal_reference_on_the_gpu_cases():
    """The GPU test's wide cases, with the tilings the dispatch picks for them, in interpret mode on
    their special rows (ties at the threshold, fewer visible than k, nothing visible, a top-k the
    sample cannot see) and one random row: a bracket of a single key (all ties) included."""
    rng = np.random.default_rng(0)
    for s, k, lengths in selection_cases(rng, big=True, tiling_for=lambda n: bracket_tiling(1, n)):
        if s.shape[1] < 5000 or s.shape[0] == 1:    # (1 x 8192: the 64 x 8192 case's tiling, on the GPU)
            continue
        kw = select_tiling(*s.shape)
        s, lengths = s[:6], None if lengths is None else lengths[:6]
        got = select_topk_pallas(jnp.asarray(s), k, None if lengths is None else jnp.asarray(lengths),
                                 interpret=True, poison=-7, **kw)
        np.testing.assert_array_equal(np.asarray(got), topk_oracle(s, k, lengths), err_msg=f"{s.shape} k={k} {kw}")


def test_bench_select_variant_runs_the_whole_dispatch_tiling(monkeypatch):
    """bench_kernels.py's 'dispatch' and 'bracket' tilings call the kernel with every field the
    dispatch picks (held_cands included: a tiling rebuilt from the string fields dropped it, and the
    benchmark timed another kernel under the dispatch's label); a tiling string keeps its fields."""
    from scripts.bench_kernels import select_variant
    import pallas_kernels.indexer.select as select
    seen = []
    monkeypatch.setattr(select, "select_topk_pallas", lambda s, k, lengths=None, **kw: seen.append(kw))
    for tiling, rows, width, want in (("dispatch", 8, 131072, select_tiling(8, 131072)),
                                      ("bracket", 64, 131072, bracket_tiling(64, 131072)),
                                      ("dispatch", 64, 8192, select_tiling(64, 8192)),
                                      ("4:2048:6144:2048:1024:4:2:1", 2048, 32768,
                                       dict(bits=4, chunk=2048, capacity=6144, sample=2048, sub=1024, num_warps=4,
                                            num_stages=2, segments=1))):
        name, f = select_variant(tiling, rows, width)
        f(None, 2048)
        got = {key: v for key, v in seen.pop().items() if key not in ("return_path", "stop_after")}
        assert got == want, (tiling, got, want)
        assert ("held" in name) == bool(want.get("held_cands")), name
    assert select_tiling(8, 131072)["held_cands"] and select_tiling(8, 131072)["segments"] == 8


@pytest.mark.parametrize("kw", SMALL_SELECT, ids=lambda kw: f"b{kw['bits']}c{kw['chunk']}s{kw['segments']}"
                                                         f"h{kw.get('held_cands', 0)}")
def test_select_topk_interpret_equals_reference(kw):
    """Every case equals the oracle, and every path the kernel has (all visible, sampled bracket,
    full search) is taken by some row."""
    rng = np.random.default_rng(kw["bits"])
    paths = set()
    for s, k, lengths in selection_cases(rng, tiling_for=lambda n: kw):
        want = topk_oracle(s, k, lengths)
        ref_in = s if lengths is None else np.where(np.arange(s.shape[1]) < lengths[:, None], s, -np.inf)
        np.testing.assert_array_equal(np.asarray(select_topk_reference(jnp.asarray(ref_in), k)), want)
        got, path = select_topk_pallas(jnp.asarray(s), k, None if lengths is None else jnp.asarray(lengths),
                                       interpret=True, poison=-7, return_path=True, **kw)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{s.shape} k={k}")
        paths |= set(np.asarray(path).tolist())
    assert paths == set(range(len(PATHS))), paths


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_select_topk_resident_interpret_equals_reference(bits):
    """The resident-row kernel (one call, the row in registers) on every selection case: ties at the
    threshold, -inf, -0/+0, nothing visible, fewer visible than k, lengths; rows of a power of two
    and not. Both paths are taken; wider rows than it holds are refused."""
    rng = np.random.default_rng(10 + bits)
    paths = set()
    for s, k, lengths in selection_cases(rng):
        got, path = select_topk_pallas(jnp.asarray(s), k, None if lengths is None else jnp.asarray(lengths),
                                       bits=bits, resident=True, interpret=True, poison=-7, return_path=True)
        np.testing.assert_array_equal(np.asarray(got), topk_oracle(s, k, lengths), err_msg=f"{s.shape} k={k}")
        paths |= set(np.asarray(path).tolist())
    assert paths == {PATHS.index("all visible"), PATHS.index("full search")}, paths
    with pytest.raises(ValueError, match="resident rows hold at most"):
        select_topk_pallas(jnp.zeros((2, RESIDENT_MAX_WIDTH + 1)), 8, resident=True, interpret=True)


def scores_inputs(rng, B, T, H, D, S, fp8, integer, q_dtype=jnp.float32, L=2, page_size=1):
    """Indexer inputs over a shuffled page table (pages of page_size slots, in random order; 1:
    single slots). integer: small integers (and power-of-two fp8 scales) so every partial sum is
    exact in fp32 whatever the order, making exact equality the right check (and producing many
    ties)."""
    pages = B * -(-S // page_size)                       # whole pages per request, as the engine gives
    slots = page_size * (1 + pages)
    if integer:
        q = rng.integers(-3, 4, (B, T, H, D)).astype(np.float32)
        w = rng.integers(-2, 3, (B, T, H)).astype(np.float32)
        k = rng.integers(-4, 5, (L, slots, D)).astype(np.float32)
    else:
        q = rng.standard_normal((B, T, H, D)).astype(np.float32)
        w = rng.standard_normal((B, T, H)).astype(np.float32)
        k = rng.standard_normal((L, slots, D)).astype(np.float32)
    if fp8:
        if integer:
            index_k, scale = jnp.asarray(k, jnp.float8_e4m3fn), jnp.asarray(2.0 ** rng.integers(-2, 3, (L, slots)),
                                                                            jnp.float32)
        else:
            index_k, scale = quantize_index_k(jnp.asarray(k))
    else:
        index_k, scale = jnp.asarray(k, q_dtype), None
    table = paged_slot_table((1 + rng.permutation(pages)).reshape(B, -1), page_size, S)
    start = rng.integers(0, S - T + 1, B)
    pos = (start[:, None] + np.arange(T)[None, :]).astype(np.int32)
    if T > 1:
        pos[0, T // 2:] = -1                               # padding lanes
    return (jnp.asarray(q, q_dtype), jnp.asarray(w), index_k, scale, jnp.asarray(table), jnp.asarray(pos))


def reference_scores(q, w, index_k, scale, layer, table, pos):
    """In full fp32 (no tf32 on the GPU): the baseline the kernel's rounding is measured against."""
    with jax.default_matmul_precision("highest"):
        return index_scores_reference(q, w, index_keys_fp32(index_k, scale, layer, table), pos, q.shape[-1])


def check_written(got, ref, visible, write_invisible: bool) -> bool:
    """Scores over NaN-initialised output: every visible cell written, everything written with
    write_invisible, -inf exactly where the reference has it among the written. Returns whether any
    cell was left unwritten."""
    unwritten = np.isnan(got)
    assert not (unwritten & visible).any()
    assert not (write_invisible and unwritten.any())
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref) & ~unwritten)
    return bool(unwritten.any())


@pytest.mark.parametrize("fp8", [False, True])
def test_index_scores_interpret_equals_reference(fp8):
    """Both key paths (through the page table, and gathered before the kernel). Integer inputs with
    D**-0.5 a power of two: every sum exact in any order, so scores and top-k set equal exactly."""
    rng = np.random.default_rng(int(fp8))
    saw_unwritten = False
    for B, T, H, D, S in ((2, 5, 4, 16, 40), (1, 20, 2, 64, 70), (3, 1, 4, 32, 16)):
        for integer in (True, False):
            q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer)
            ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
            exact = integer and D in (16, 64)
            visible = np.arange(S)[None, None, :] <= np.asarray(pos)[:, :, None]
            for gather_keys in (False, True):
                for write_invisible in (True, False):
                    got = np.asarray(index_scores_pallas(q, w, ik, sc, 1, table, pos, block_m=16, block_n=16,
                                                         steps=2, gather_keys=gather_keys, interpret=True,
                                                         poison=np.nan, write_invisible=write_invisible))
                    # write_invisible=False: exactly the visible scores are written (and -inf beside them
                    # within their key blocks); the rest keeps the poison
                    saw_unwritten |= check_written(got, ref, visible, write_invisible)
                    fin = np.isfinite(ref)
                    if exact:
                        np.testing.assert_array_equal(got[fin], ref[fin])
                    else:
                        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
                    if exact:  # exact scores -> the selection picks exactly the reference's set, and with
                        # lengths it never reads the unwritten (NaN, which would rank above every score)
                        k = 9
                        sel = select_topk_pallas(jnp.asarray(got), k, pos + 1, chunk=16, interpret=True, poison=-7)
                        np.testing.assert_array_equal(np.asarray(sel), topk_oracle(ref, k))
            if exact:
                np.testing.assert_array_equal(np.asarray(indexer_topk(q, w, ik, sc, 1, table, pos, k)),
                                              topk_oracle(ref, k))
    assert saw_unwritten


@pytest.mark.parametrize("fp8", [False, True])
def test_index_scores_mgpu_interpret_equals_reference(fp8):
    """The Mosaic GPU scores kernel (Mosaic GPU's interpreter, race detector on) through
    index_scores_pallas: T and S not multiples of its tiles, padding lanes, more key blocks than
    pipeline slots, block_t 8 and 2. Integer inputs at D = 64
    are exact (scores and top-k set equal the reference); the rest agree to fp32 rounding. Output
    cells start as NaN in the interpreter, so a cell left unwritten shows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(30 + int(fp8))
    interp = plgpu.InterpretGPUParams(detect_races=True)
    saw_unwritten = False
    for (B, T, H, D, S), tiling in (((2, 20, 8, 64, 150), {"block_t": 8, "stages": 2}),
                                    ((1, 13, 16, 128, 300), {"block_t": 2, "stages": 3}),
                                    ((1, 5, 8, 64, 40), {})):   # fewer tokens than one program, keys than a block
        for integer in (True, False):
            q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer, q_dtype=jnp.bfloat16)
            ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
            visible = np.arange(S)[None, None, :] <= np.asarray(pos)[:, :, None]
            for write_invisible in (True, False) if integer else (False,):
                got = np.asarray(index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu=tiling, interpret=interp,
                                                     write_invisible=write_invisible))
                saw_unwritten |= check_written(got, ref, visible, write_invisible)
                fin = np.isfinite(ref)
                if integer and D in (16, 64, 256):   # D**-0.5 a power of two: every sum exact
                    np.testing.assert_array_equal(got[fin], ref[fin])
                    sel = select_topk_pallas(jnp.asarray(got), 9, pos + 1, chunk=16, interpret=True, poison=-7)
                    np.testing.assert_array_equal(np.asarray(sel), topk_oracle(ref, 9))
                else:  # fp32 rounding only (the same bf16 operands): error against the scores' scale
                    assert np.abs(got[fin] - ref[fin]).max() <= 1e-6 * np.abs(ref[fin]).max()
    assert saw_unwritten
    with pytest.raises(ValueError, match="queries must be bf16"):
        index_scores_pallas(q.astype(jnp.float32), w, ik, sc, 1, table, pos, mgpu=True, interpret=interp)
    with pytest.raises(ValueError, match="cannot poison"):
        index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu=True, interpret=interp, poison=np.nan)
    for H, D, match in ((4, 64, "heads a multiple of 8"), (64, 64, "at most 256"), (8, 32, "multiple of 64")):
        q, w, ik, sc, table, pos = scores_inputs(rng, 1, 4, H, D, 16, fp8, True, q_dtype=jnp.bfloat16)
        with pytest.raises(ValueError, match=match):
            index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu=True, interpret=interp)


def test_index_scores_mgpu_paged_interpret_equals_reference():
    """The paged Mosaic GPU scores kernel (keys read from the pool, one TMA copy per 64-key block;
    fp8 keys upcast in registers) in Mosaic GPU's interpreter with its race detector: pages of 64
    slots in random order, fp8 and bf16 pools, one decode token and several, more key blocks than a
    program takes, S not a multiple of 64, padding lanes. Integer inputs at D = 64 are exact; the
    rest agree to fp32 rounding. In the interpreter the upcast keys reach the MMA through shared
    memory (its MMA reads shared memory only); the compiled path is checked on the GPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(40)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    saw_unwritten = False
    for (B, T, D, S), tiling in (((2, 1, 64, 300), {"blocks_per_program": 4, "stages": 2}),
                                 ((1, 9, 128, 700), {"blocks_per_program": 4, "stages": 4}),
                                 ((1, 1, 64, 150), {"blocks_per_program": 3, "stages": 4})):
        for fp8 in (True, False):
            integer = D == 64
            q, w, ik, sc, table, pos = scores_inputs(rng, B, T, 32, D, S, fp8, integer, q_dtype=jnp.bfloat16,
                                                     page_size=64)
            ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
            visible = np.arange(S)[None, None, :] <= np.asarray(pos)[:, :, None]
            for write_invisible in (True, False):
                got = np.asarray(index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu=tiling, contiguous_blocks=True,
                                                     interpret=interp, write_invisible=write_invisible))
                saw_unwritten |= check_written(got, ref, visible, write_invisible)
                fin = np.isfinite(ref)
                if integer:
                    np.testing.assert_array_equal(got[fin], ref[fin])
                else:
                    assert np.abs(got[fin] - ref[fin]).max() <= 1e-6 * np.abs(ref[fin]).max()
    assert saw_unwritten
    q, w, ik, sc, table, pos = scores_inputs(rng, 1, 1, 8, 64, 64, True, True, q_dtype=jnp.bfloat16, page_size=64)
    with pytest.raises(ValueError, match="heads a multiple of 32"):
        index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu=True, contiguous_blocks=True, interpret=interp)
    with pytest.raises(ValueError, match="unknown tiling keys"):
        index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu={"block_m": 4}, interpret=interp)
    q, w, ik, sc, table, pos = scores_inputs(rng, 1, 1, 32, 64, 300, True, True, q_dtype=jnp.bfloat16, page_size=64)
    for per in (2, 3):      # over several programs: refused (2 a program stopped the H200), not run
        with pytest.raises(ValueError, match="multiple of 4 blocks or all of them"):
            index_scores_pallas(q, w, ik, sc, 1, table, pos, mgpu={"blocks_per_program": per}, contiguous_blocks=True,
                                interpret=interp)
    from pallas_kernels.indexer import scores_mgpu        # the kernels' own entry points check too
    rows, bf16_q = ik.reshape(-1, 64), jnp.zeros((1, 2 * 8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="paged_scores_mgpu: .*heads a multiple of 32"):
        scores_mgpu.paged_scores_mgpu(bf16_q, jnp.zeros((1, 16)), jnp.zeros((1, 2), jnp.int32), rows, None,
                                      jnp.zeros((1, 1), jnp.int32), heads=8, block_t=2, interpret=interp)
    with pytest.raises(ValueError, match="gathered_scores_mgpu: queries must be bf16"):
        scores_mgpu.gathered_scores_mgpu(bf16_q.astype(jnp.float32), jnp.zeros((1, 16)), jnp.zeros((1, 2), jnp.int32),
                                         jnp.zeros((1, 64, 64), jnp.bfloat16), None, heads=8, interpret=interp)


def test_mgpu_dispatch_rules():
    """Which scores kernel the dispatch asks for (the rules are host-side: checked without a GPU):
    the gathered Mosaic GPU kernel for calls of enough programs, the paged one for short calls over
    a table of whole 64-slot blocks, the Triton kernel otherwise."""
    from pallas_kernels.indexer import use_mgpu_scores
    bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn
    assert use_mgpu_scores(1, 32768, 32, 128, bf16)                           # prefill: gathered
    assert not use_mgpu_scores(8, 64, 32, 128, bf16, True, fp8)               # 32 programs: Triton
    assert use_mgpu_scores(8, 1, 32, 128, bf16, True, fp8)                    # decode, paged table
    assert use_mgpu_scores(8, 4, 64, 128, bf16, True, jnp.bfloat16)
    assert not use_mgpu_scores(8, 1, 32, 128, bf16, False, fp8)               # no promise: Triton
    assert not use_mgpu_scores(8, 1, 32, 128, jnp.float32, True, fp8)         # fp32 queries
    assert not use_mgpu_scores(8, 1, 32, 128, bf16, True, jnp.float32)        # fp32 pool
    assert not use_mgpu_scores(8, 1, 16, 128, bf16, True, fp8)                # 16 heads


def test_paged_scores_one_wave_rule(monkeypatch):
    """KernelPolicy.mgpu_paged_one_wave: the paged scores kernel's key blocks per program keep a call
    within about one wave of 132 programs (at least 4 blocks, at most the default tiling's 64, which
    the rule also gives at 8 x 131072, where that tiling was measured), and the dispatch passes them to
    the kernel only with the option on."""
    from pallas_kernels.indexer import dispatch, paged_blocks_per_program
    from pallas_kernels.policy import KernelPolicy
    cases = {(8, 1, 131072): 64, (1, 1, 8192): 4, (8, 1, 2048): 4, (1, 1, 131072): 16, (4, 4, 8192): 4,
             (8, 1, 32768): 32, (32, 1, 8192): 32, (1, 1, 256): 4}
    for (B, T, S), per in cases.items():
        assert paged_blocks_per_program(B, T, 32, S) == per, (B, T, S)
        programs = B * -(-S // (64 * per))
        assert programs <= 132 or per == 64, (B, T, S, programs)
    calls = []

    def scores(q, w, index_k, index_scale, layer, table, pos, **kw):
        calls.append(kw["mgpu"])
        return jnp.zeros((q.shape[0], q.shape[1], table.shape[1]), jnp.float32)
    monkeypatch.setattr(dispatch, "index_scores_pallas", scores)
    monkeypatch.setattr(dispatch, "select_topk", lambda s, k, lengths, policy: jnp.zeros((*s.shape[:2], k), jnp.int32))
    monkeypatch.setattr(KernelPolicy, "on_gpu", lambda self: True)
    rng = np.random.default_rng(2)
    q, w, ik, sc, table, pos = scores_inputs(rng, 1, 1, 32, 128, 8192, True, False, q_dtype=jnp.bfloat16,
                                             page_size=64)
    for on, want in ((False, True), (True, {"blocks_per_program": 4})):
        indexer_topk(q, w, ik, sc, 1, table, pos, 64, contiguous_blocks=True,
                     policy=KernelPolicy(mgpu_paged_one_wave=on))
        assert calls.pop() == want


@pytest.mark.gpu
def test_index_scores_mgpu_paged_compiled_on_gpu():
    """The paged Mosaic GPU scores kernel compiled for the H200: GLM-5's 32 heads and DeepSeek's 64,
    decode T = 1 and 3 (T = 64 gathers its keys: the gathered kernel), fp8 and bf16 pools of shuffled
    64-slot pages; exact on integer inputs at D = 64, fp32 rounding beside the reference and the
    Triton kernel otherwise."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(6)
    # (2, 1, 32, 64, 100): a short context, 2 key blocks in one program (what a decode of under 128
    # tokens with 64-slot pages gets)
    for B, T, H, D, S in ((2, 1, 32, 64, 3000), (3, 3, 64, 64, 5000), (2, 64, 32, 128, 3000), (2, 1, 32, 128, 9000),
                          (2, 1, 32, 64, 100)):
        for fp8 in (True, False):
            integer = D == 64
            q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer, q_dtype=jnp.bfloat16,
                                                     page_size=64)
            ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
            fin = np.isfinite(ref)
            triton = np.asarray(jax.jit(lambda *a: index_scores_pallas(*a))(q, w, ik, sc, 1, table, pos))
            for tiling in ({}, {"blocks_per_program": 8, "stages": 4}, {"blocks_per_program": 4, "stages": 4}):
                got = np.asarray(jax.jit(lambda *a, t=tiling: index_scores_pallas(
                    *a, mgpu=t or True, contiguous_blocks=True))(q, w, ik, sc, 1, table, pos))
                np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg=str(tiling))
                if integer:
                    np.testing.assert_array_equal(got[fin], ref[fin])
                else:
                    scale = np.abs(ref[fin]).max()
                    assert np.abs(got[fin] - ref[fin]).max() <= 1e-5 * scale, tiling
                    assert np.abs(got[fin] - triton[fin]).max() <= 1e-5 * scale, tiling


@contextlib.contextmanager
def recorded_score_calls():
    """The query tokens of every call of the indexer's scores (kernel or jnp composition) that the
    dispatch traces while inside: how it split its queries. (Jit caches are cleared on entry: a
    cached trace would not call the recorder.)"""
    import pallas_kernels.indexer.dispatch as dispatch
    seen = []

    def recording(f):
        return lambda q_, *a, **kw: (seen.append(q_.shape[1]), f(q_, *a, **kw))[1]
    with pytest.MonkeyPatch.context() as mp:
        for name in ("index_scores_pallas", "index_scores_reference"):
            mp.setattr(dispatch, name, recording(getattr(dispatch, name)))
        jax.clear_caches()
        yield seen


def in_query_chunks(chunk, q, w, ik, sc, layer, table, pos, k, policy: KernelPolicy = DEFAULT_POLICY):
    """indexer_topk with policy's scores_max_bytes set for `chunk` query tokens per chunk; checks that
    the scores were computed in pieces of at most that many (and more than one)."""
    B, T, H, _ = q.shape
    max_bytes = B * table.shape[1] * 4 * (1 if policy.on_gpu() else H) * chunk
    policy = dataclasses.replace(policy, scores_max_bytes=max_bytes)
    with recorded_score_calls() as seen:
        got = np.asarray(jax.jit(lambda *a: indexer_topk(*a, k, policy=policy))(q, w, ik, sc, layer, table, pos))
    assert len(seen) > 1 and max(seen) <= chunk and sum(seen) == T, seen
    return got


def test_indexer_topk_in_query_chunks_equals_one_call():
    """A call whose scores would pass KernelPolicy.scores_max_bytes runs its query tokens in chunks (T not a
    multiple of the chunk; padding lanes; rows of fewer visible keys than k): the same positions as
    one call."""
    rng = np.random.default_rng(3)
    for B, T, H, D, S, k, fp8 in ((2, 40, 4, 16, 300, 9, True), (1, 37, 2, 64, 50, 20, False)):
        q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, False)
        whole = np.asarray(indexer_topk(q, w, ik, sc, 1, table, pos, k))
        np.testing.assert_array_equal(in_query_chunks(16, q, w, ik, sc, 1, table, pos, k), whole)
        assert (whole == -1).any() and (whole >= 0).any()


FUSED_SMALL = dict(capacity=64, sub=16, sample=64, sample_sub=16, block_m=16, block_n=16)  # small tiles: every path


def test_indexer_topk_fused_interpret_equals_reference():
    """The fused indexer (sampled bracket, candidates kept by the scores kernel, no score rows) against
    the exact selection of the reference scores: integer inputs (exact sums, many ties) and random
    ones, fp8 and plain keys, padding lanes, T not a multiple of the query block, rows of fewer keys
    than k and than the capacity. Rows whose bracket missed are redone in one chunk (fallback_rows 64)
    or in several (fallback_rows 1); the positions buffer is poisoned."""
    rng = np.random.default_rng(0)
    paths, redone_in_one, redone_in_several = np.zeros(3, int), False, False
    for B, T, H, D, S, k, integer, fp8 in ((2, 40, 4, 16, 300, 9, True, True), (1, 70, 2, 64, 500, 20, False, False),
                                           (2, 5, 4, 16, 40, 9, True, False), (1, 33, 4, 16, 260, 40, True, True)):
        q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer)
        ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
        want = topk_oracle(ref, k) if integer and D in (16, 64) else None
        for fallback_rows in (64, 1):
            got, path = indexer_topk_fused(q, w, ik, sc, 1, table, pos, k, fallback_rows=fallback_rows, poison=-7,
                                           interpret=True, return_path=True, **FUSED_SMALL)
            got, path = np.asarray(got), np.asarray(path)
            if want is not None:
                np.testing.assert_array_equal(got, want)
            else:
                assert_same_topk_up_to_near_ties(got, ref, k, 1e-5 * np.abs(ref[np.isfinite(ref)]).max())
            paths += np.bincount(path.ravel(), minlength=3)
            n_redo = int((path == 2).sum())
            redone_in_one |= 0 < n_redo <= fallback_rows
            redone_in_several |= n_redo > fallback_rows
    assert paths.min() > 0 and paths[1] > paths[2], paths    # every path, most rows from their candidates
    assert redone_in_one and redone_in_several


def test_fp8_queries_with_scale_equal_the_dequantized_reference():
    """fp8 queries with their per-token, per-head scale (DeepSeek's indexer format) at every entry
    point: the scores kernel and the fused indexer in interpret mode, and the dispatch's jnp path,
    against the reference scores of the queries dequantized to fp32 (no fold); fp8 and fp32 keys,
    padding lanes. A scale without fp8 queries, fp8 queries without one, or a scale of the wrong
    shape is refused, naming q_scale."""
    rng = np.random.default_rng(5)
    for B, T, H, D, S, k, fp8 in ((2, 5, 4, 16, 40, 9, True), (1, 20, 2, 64, 300, 20, False)):
        q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, False)
        q8, q_scale = quantize_index_k(q * jnp.exp(jnp.asarray(rng.standard_normal((B, T, H, 1)), jnp.float32)))
        assert float(q_scale.max() / q_scale.min()) > 3          # scales differ across heads and tokens
        ref = np.asarray(reference_scores(dequantize_index_k(q8, q_scale), w, ik, sc, 1, table, pos))
        fin = np.isfinite(ref)
        got = np.asarray(index_scores_pallas(q8, w, ik, sc, 1, table, pos, block_m=16, block_n=16, steps=2,
                                             interpret=True, q_scale=q_scale))
        np.testing.assert_array_equal(np.isneginf(got), ~fin)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
        tol = 1e-5 * np.abs(ref[fin]).max()
        assert_same_topk_up_to_near_ties(np.asarray(indexer_topk(q8, w, ik, sc, 1, table, pos, k, q_scale=q_scale)),
                                         ref, k, tol)
        fused = indexer_topk_fused(q8, w, ik, sc, 1, table, pos, k, interpret=True, poison=-7, q_scale=q_scale,
                                   **FUSED_SMALL)
        assert_same_topk_up_to_near_ties(np.asarray(fused), ref, k, tol)
    for args, problem in (((q8, None), "q_scale is given exactly for fp8 queries"),
                          ((q, q_scale), "q_scale is given exactly for fp8 queries"),
                          ((q8, q_scale[:, :3]), "q_scale \\(1, 3, 2\\) must be \\(1, 20, 2\\)")):
        for entry in (lambda a: indexer_topk(a[0], w, ik, sc, 1, table, pos, k, q_scale=a[1]),
                      lambda a: index_scores_pallas(a[0], w, ik, sc, 1, table, pos, interpret=True, q_scale=a[1]),
                      lambda a: indexer_topk_fused(a[0], w, ik, sc, 1, table, pos, k, interpret=True, q_scale=a[1])):
            with pytest.raises(ValueError, match="^" + problem):
                entry(args)


@pytest.mark.gpu
def test_indexer_topk_fused_compiled_on_gpu():
    """Compiled for the GPU, at GLM-5's indexer shape (32 heads x 128, fp8 keys, k = 2048) with the
    default tiling, against the reference scores' selection up to near-ties; and with integer
    inputs over 32 x 64 heads, exactly."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    for B, T, H, D, S, k, integer in ((2, 256, 32, 128, 12000, 2048, False), (1, 64, 32, 64, 9000, 2048, True),
                                      (2, 48, 32, 64, 3000, 64, True)):
        q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, True, integer, jnp.bfloat16)
        if not integer:                                     # the last T rows: most keys visible
            pos = jnp.where(pos < 0, -1, S - T + jnp.arange(T, dtype=jnp.int32)[None, :])
        ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
        got, path = jax.jit(lambda *a: indexer_topk_fused(*a, k, poison=-7, return_path=True))(
            q, w, ik, sc, 1, table, pos)
        got, path = np.asarray(got), np.asarray(path)
        print("fused indexer paths", np.bincount(path.ravel(), minlength=3))
        if integer:
            np.testing.assert_array_equal(got, topk_oracle(ref, k))
        else:
            assert_same_topk_up_to_near_ties(got, ref, k, 1e-5 * np.abs(ref[np.isfinite(ref)]).max())
            assert (path[np.asarray(pos) >= 0] == 1).mean() > 0.9   # padding lanes take path 0


def test_selection_dispatch_takes_the_resident_kernel_from_one_row(monkeypatch):
    """On the GPU, rows narrow enough for the resident-row kernel take it at any row count (a batch-1
    decode's single row included); wider rows take the two-call kernel from MIN_KERNEL_ROWS rows and
    lax.top_k's composition below. The kernel is recorded, and run in Triton's interpreter on one
    decode-sized row: equal to the oracle."""
    import pallas_kernels.indexer.select as select_module
    from pallas_kernels.indexer import MIN_KERNEL_ROWS
    from pallas_kernels.policy import KernelPolicy

    real, taken = select_module.select_topk_pallas, []

    def recorded(scores, k, lengths=None, **kw):
        taken.append((scores.shape, kw))
        return real(scores, k, lengths, interpret=True, **kw) if scores.shape == (1, 2048) else \
            select_topk_reference(scores, k)
    monkeypatch.setattr(select_module, "select_topk_pallas", recorded)
    monkeypatch.setattr(KernelPolicy, "on_gpu", lambda self: True)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2048)), jnp.float32)
    lengths = jnp.asarray([1500], jnp.int32)
    got = select_topk(x, 256, lengths)
    np.testing.assert_array_equal(np.asarray(got), topk_oracle(np.asarray(x), 256, np.asarray(lengths)))
    assert taken == [((1, 2048), select_tiling(1, 2048))] and taken[0][1]["resident"]
    for rows, width, kernel in ((1, 8192, True), (MIN_KERNEL_ROWS - 1, RESIDENT_MAX_WIDTH, True),
                                (1, 2 * RESIDENT_MAX_WIDTH, False), (MIN_KERNEL_ROWS, 2 * RESIDENT_MAX_WIDTH, True)):
        taken.clear()
        select_topk(jnp.zeros((rows, width), jnp.float32), 16)
        assert bool(taken) == kernel, (rows, width)


def test_topk_entry_points_reject_bad_input():
    """The kernels index their operands unchecked (a short lengths or positions would be read out of
    bounds on the GPU), so every entry point checks shapes first and names the problem."""
    x = jnp.zeros((4, 100), jnp.float32)
    for select in (select_topk, lambda *a: select_topk_pallas(*a, interpret=True)):
        with pytest.raises(ValueError, match="lengths \\(3,\\) must have the shape"):
            select(x, 8, jnp.ones((3,), jnp.int32))
        with pytest.raises(ValueError, match="k must be a non-negative int"):
            select(x, -1)
        with pytest.raises(TypeError, match="scores must be a float array"):
            select(x.astype(jnp.int32), 8)
    assert select_topk(x, np.int64(8), jnp.full((4,), 50, jnp.int32)).shape == (4, 8)
    rng = np.random.default_rng(0)
    q, w, ik, sc, table, pos = scores_inputs(rng, 2, 5, 4, 16, 40, True, True)
    bad = {"w ": (q, w[:, :3], ik, sc, 1, table, pos), "positions ": (q, w, ik, sc, 1, table, pos[:, :3]),
           "slot_table ": (q, w, ik, sc, 1, table[:1], pos), "index_scale ": (q, w, ik, sc[:, :5], 1, table, pos),
           "index_k ": (q, w, ik[..., :8], sc, 1, table, pos), "layer 2 out of range": (q, w, ik, sc, 2, table, pos)}
    for problem, args in bad.items():
        for entry in (lambda *a: indexer_topk(*a, 8), lambda *a: index_scores_pallas(*a, interpret=True)):
            with pytest.raises(ValueError, match="^" + problem):
                entry(*args)
    assert indexer_topk(q, w, ik, sc, 1, table, pos, 8).shape == (2, 5, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SELECTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_select_topk_compiled_on_gpu_equals_reference(shape):
    """selection_cases(big=True) compiled, one (rows, width, k) a test (each compiles up to 18
    variants: all of them in one test ran past 330 s on the H200). Rows wider than the resident kernel
    take the two-call bracket kernel, whose three paths (all visible, sampled bracket, full search:
    the row hidden from the sample) those cases must each show."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    paths = set()
    cases = [c for c in selection_cases(rng, big=True, tiling_for=lambda n: bracket_tiling(1, n))
             if (*c[0].shape, c[1]) == shape]
    assert len(cases) == 2, f"selection_cases has no {shape}"
    for s, k, lengths in cases:
        want = topk_oracle(s, k, lengths)
        ln = None if lengths is None else jnp.asarray(lengths)
        small = s.size < 10 ** 5
        variants = [select_tiling(*s.shape)] + SMALL_SELECT
        variants = variants[:len(variants) if small else 1]
        if s.shape[1] <= RESIDENT_MAX_WIDTH:         # the resident-row kernel at every digit width
            variants += [dict(resident=True, bits=b, num_warps=w) for b, w in ((1, 8), (2, 8), (4, 16))]
        for kw in variants:
            got, path = jax.jit(lambda x, l: select_topk_pallas(x, k, l, poison=-7, return_path=True, **kw))(
                jnp.asarray(s), ln)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{s.shape} k={k} {kw}")
            if kw is variants[0]:
                paths |= set(np.asarray(path).tolist())
            if s.shape[1] >= 8192 and lengths is None and kw is variants[0] and not kw.get("resident"):
                fast = np.asarray(path)[5:] == PATHS.index("sampled bracket")  # wide random rows
                assert fast.mean() >= 0.9, np.asarray(path)
    if shape[1] > RESIDENT_MAX_WIDTH:
        assert paths == set(range(len(PATHS))), paths


def assert_same_topk_up_to_near_ties(got, scores, k, tol):
    """got equals the exact selection, except that a position may swap with another whose score is
    within tol of the k-th selected score (the kernel's scores round differently)."""
    want = topk_oracle(scores, k)
    s = scores.reshape(-1, scores.shape[-1])
    for g, w_, row in zip(got.reshape(-1, k), want.reshape(-1, k), s):
        assert (g >= 0).sum() == (w_ >= 0).sum()
        diff = set(g[g >= 0]) ^ set(w_[w_ >= 0])
        if diff:
            kth = np.sort(row[w_[w_ >= 0]])[0]
            assert all(abs(row[j] - kth) <= tol for j in diff), (sorted(diff), kth)


@pytest.mark.gpu
def test_index_scores_compiled_on_gpu():
    """bf16, fp32 and fp8 (with their scale) queries, fp8 and plain keys, GLM-5's 32 x 128 indexer and
    a 32 x 64 one. With integer inputs and D a power of 4 (D**-0.5 a power of two) every sum is exact
    in any order: the scores and the top-k set must equal the reference exactly. Otherwise the scores
    agree to rounding and the set up to near-ties."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    for B, T, H, D, S in ((2, 5, 4, 16, 40), (2, 64, 32, 64, 1000), (2, 64, 32, 128, 1000),
                          (1, 1, 32, 128, 4096)):
        for fp8 in (False, True):
            for q_dtype in (jnp.float32, jnp.bfloat16):
                for integer in (True, False):
                    q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer, q_dtype)
                    ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
                    got = np.asarray(jax.jit(lambda *a: index_scores_pallas(*a, poison=np.nan))(
                        q, w, ik, sc, 1, table, pos))
                    assert not np.isnan(got).any()
                    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
                    fin = np.isfinite(ref)
                    k = min(64, S)
                    sel = np.asarray(jax.jit(lambda *a: indexer_topk(*a, k))(q, w, ik, sc, 1, table, pos))
                    chunked = None
                    if T > 1:   # in query chunks (of 16: 2 x 4 + ...); with the Triton kernel alone,
                        # bit-identical to one call (the gathered and page-table paths compute alike)
                        with mgpu_scores(False) as (triton_only, _):
                            one_call = np.asarray(jax.jit(lambda *a: indexer_topk(*a, k, policy=triton_only))(
                                q, w, ik, sc, 1, table, pos))
                            np.testing.assert_array_equal(in_query_chunks(16, q, w, ik, sc, 1, table, pos, k,
                                                                          triton_only), one_call)
                        # by default a long call may take the Mosaic GPU kernel and its chunks the Triton one
                        chunked = in_query_chunks(16, q, w, ik, sc, 1, table, pos, k)
                    if integer and D in (16, 64):
                        np.testing.assert_array_equal(got[fin], ref[fin])
                        np.testing.assert_array_equal(sel, topk_oracle(ref, k))
                        if chunked is not None:
                            np.testing.assert_array_equal(chunked, sel)
                    else:
                        scale = np.abs(ref[fin]).max()
                        np.testing.assert_allclose(got[fin], ref[fin], rtol=0, atol=1e-5 * scale)
                        for picked in (sel,) if chunked is None else (sel, chunked):
                            assert_same_topk_up_to_near_ties(picked, ref, k, 1e-5 * scale)
        # fp8 queries with their scale, against the dequantized queries' reference
            q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, True, False)
        q8, q_scale = quantize_index_k(q)
        ref = np.asarray(reference_scores(dequantize_index_k(q8, q_scale), w, ik, sc, 1, table, pos))
        fin = np.isfinite(ref)
        got = np.asarray(jax.jit(lambda *a: index_scores_pallas(*a[:-1], q_scale=a[-1]))(q8, w, ik, sc, 1, table, pos,
                                                                                         q_scale))
        np.testing.assert_allclose(got[fin], ref[fin], rtol=0, atol=1e-5 * np.abs(ref[fin]).max())
        sel = np.asarray(jax.jit(lambda *a: indexer_topk(*a[:-1], min(64, S), q_scale=a[-1]))(
            q8, w, ik, sc, 1, table, pos, q_scale))
        assert_same_topk_up_to_near_ties(sel, ref, min(64, S), 1e-5 * np.abs(ref[fin]).max())


@pytest.mark.gpu
def test_index_scores_mgpu_compiled_on_gpu():
    """The Mosaic GPU scores kernel compiled for the GPU, at GLM-5's 32 x 128 indexer and a 32 x 64
    one, fp8 and plain keys, several tilings: exact on integer inputs at D = 64, fp32 rounding
    otherwise, against the fp32 reference and beside the Triton kernel; -inf exactly where the
    reference has it; and the dispatch with the kernel on and off (KernelPolicy.mgpu_scores) picks the
    reference's top-k set."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(5)
    tilings = ({}, {"block_t": 4}, {"block_t": 8, "stages": 2})
    for B, T, H, D, S in ((2, 300, 32, 128, 1000), (1, 64, 32, 64, 200), (2, 1000, 32, 128, 3000)):
        for fp8 in (True, False):
            for integer in (True, False):
                q, w, ik, sc, table, pos = scores_inputs(rng, B, T, H, D, S, fp8, integer, q_dtype=jnp.bfloat16)
                ref = np.asarray(reference_scores(q, w, ik, sc, 1, table, pos))
                fin = np.isfinite(ref)
                triton = np.asarray(jax.jit(lambda *a: index_scores_pallas(*a))(q, w, ik, sc, 1, table, pos))
                for tiling in tilings:
                    got = np.asarray(jax.jit(lambda *a, t=tiling: index_scores_pallas(*a, mgpu=t or True))(
                        q, w, ik, sc, 1, table, pos))
                    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg=str(tiling))
                    if integer and D == 64:
                        np.testing.assert_array_equal(got[fin], ref[fin])
                    else:
                        scale = np.abs(ref[fin]).max()
                        assert np.abs(got[fin] - ref[fin]).max() <= 1e-5 * scale, tiling
                        assert np.abs(got[fin] - triton[fin]).max() <= 1e-5 * scale, tiling
                if integer and D == 64:                    # the dispatch, with the kernel on and off
                    k = 64
                    for on in (True, False):
                        with mgpu_scores(on) as (policy, calls):
                            sel = np.asarray(jax.jit(lambda *a: indexer_topk(*a, k, policy=policy))(
                                q, w, ik, sc, 1, table, pos))
                        assert bool(calls) == on, calls
                        np.testing.assert_array_equal(sel, topk_oracle(ref, k))


@contextlib.contextmanager
def mgpu_scores(on: bool):
    """(policy, calls): a KernelPolicy with the gathered Mosaic GPU scores kernel `on` (and
    mgpu_min_programs 1, so the tests' small calls take it), and the padded query tokens of every
    gathered Mosaic GPU scores call traced while inside (jit caches are cleared on entry: a cached
    trace would not call the recorder)."""
    from pallas_kernels.indexer import scores_mgpu
    seen, kernel = [], scores_mgpu.gathered_scores_mgpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scores_mgpu, "gathered_scores_mgpu",
                   lambda q_, w_, pos_, *a, **kw: (seen.append(pos_.shape[1]), kernel(q_, w_, pos_, *a, **kw))[1])
        jax.clear_caches()
        yield KernelPolicy(mgpu_scores=on, mgpu_min_programs=1), seen


@pytest.mark.gpu
def test_model_outputs_with_mgpu_scores_on_and_off():
    """A bf16 model with GLM-5's 32 x 128 indexer (other dims tiny): prefill logits with the indexer's
    prefill scores through the Mosaic GPU kernel vs the Triton kernel, bf16 and fp8 index keys. The
    two round differently, so a near-tie may pick another key: logits to bf16 rounding, greedy tokens
    nearly all equal; and the Mosaic GPU kernel did run."""
    from flax import nnx

    from models.config import ModelConfig
    from models.model import DsaModel, prefill_logits
    from tests.helpers import rel_err

    cfg = ModelConfig.named("tiny", index_n_heads=32, index_head_dim=128, index_topk=64)
    model = DsaModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 300))
    out = {}
    for on in (True, False):
        with mgpu_scores(on) as (policy, calls):
            out[on] = {d: np.asarray(prefill_logits(model, tokens, index_dtype=d, kernels=policy))
                       for d in ("same", "fp8")}
        assert bool(calls) == on and (not on or min(calls) >= 300), calls
    for d in out[True]:
        err = rel_err(out[True][d], out[False][d])
        agree = (out[True][d].argmax(-1) == out[False][d].argmax(-1)).mean()
        print(f"mgpu scores on vs off ({d} keys): logits rel err {err:.2e}, greedy agree {agree:.4f}")
        assert err <= 2e-2 and agree >= 0.98, (d, err, agree)


@pytest.mark.gpu
def test_engine_decode_with_paged_scores_on_and_off(monkeypatch):
    """The engine's single-device decode with its indexer scores read from the pool by page block (the
    paged Mosaic GPU kernel, pages of 64 slots) vs the Triton kernel (KernelPolicy.mgpu_paged off): a bf16 model
    with GLM-5's 32 x 128 indexer and a top-k of 64 over prompts of 130-400 tokens, fp8 index keys.
    The kernels round differently, so a near-tie may pick another key: step logits to bf16 rounding
    and mostly bit-identical (equal top-k sets), greedy tokens nearly all equal; and the paged kernel
    ran at decode."""
    from flax import nnx

    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from models.config import ModelConfig
    from models.model import DsaModel
    from pallas_kernels.indexer import scores_mgpu
    from tests.helpers import rel_err

    cfg = ModelConfig.named("tiny", index_n_heads=32, index_head_dim=128, index_topk=64)
    model = DsaModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (130, 257, 400)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs, calls = {}, []
    kernel = scores_mgpu.paged_scores_mgpu
    monkeypatch.setattr(scores_mgpu, "paged_scores_mgpu",
                        lambda q_, *a, **kw: (calls.append(q_.shape[1]), kernel(q_, *a, **kw))[1])
    jax.clear_caches()                                  # (a cached trace would not call the recorder)
    for on in (True, False):
        calls.clear()
        engine = Engine(model, EngineConfig(page_size=64, kv_pages=64, index_dtype="fp8", dtype="bfloat16",
                                            kernels=KernelPolicy(mgpu_paged=on)))
        outs[on] = engine.generate(prompts, params, return_logits=True)
        assert bool(calls) == on, calls
    # (steps up to the first differing token have the same context in both runs; after it they diverge.
    # The scores only choose the keys: a step whose top-k sets agree has bit-identical logits)
    same, exact, err = [], 0, 0.0
    for a, b in zip(outs[True], outs[False]):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids) - 1) + 1
        same.append(n)
        exact += sum(np.array_equal(x, y) for x, y in zip(a.logits[:n], b.logits[:n]))
        err = max(err, rel_err(np.stack(a.logits[:n]), np.stack(b.logits[:n])))
    print(f"paged scores on vs off (engine decode): logits rel err {err:.2e} over the steps of equal context "
          f"{same} of {params.max_new_tokens}, {exact} of them bit-identical")
    assert err <= 2e-2 and sum(same) >= len(same) * params.max_new_tokens // 2, (err, same)
    assert exact >= sum(same) // 2, (exact, same)


@pytest.mark.gpu
def test_model_outputs_with_topk_kernels_on_and_off():
    """The indexer through the kernels (unfused, in query chunks of 16, and the fused path forced) vs
    the jnp composition inside the model: greedy tokens and logits to rounding (score rounding differs,
    so a near-tie may pick another key)."""
    from models.model import prefill_logits
    from tests.helpers import hf_model, rel_err

    model = hf_model("glm_indexcache")
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 40))
    out = {}
    with recorded_score_calls() as score_calls:
        for mode, policy in (("kernels", DEFAULT_POLICY),
                             ("chunked", KernelPolicy(scores_max_bytes=2 * 40 * 4 * 16)),  # B x S x fp32 x 16
                             ("fused", KernelPolicy(fused_indexer=True)),
                             ("off", KernelPolicy(enabled=False))):
            score_calls.clear()
            out[mode] = {p: np.asarray(prefill_logits(model, tokens, attn_path=p, index_dtype=d, kernels=policy))
                         for p, d in (("expanded", "same"), ("absorbed", "fp8"))}
            if mode == "kernels":              # the 40 query tokens in one call, or in chunks of 16 or fewer
                assert max(score_calls) == 40, score_calls
            if mode == "chunked":
                assert len(score_calls) > 1 and max(score_calls) <= 16, score_calls
    for mode in ("kernels", "chunked", "fused"):
        for p in out[mode]:
            err = rel_err(out[mode][p], out["off"][p])
            print(f"top-k {mode} vs off ({p}): rel err {err:.2e}")
            assert err <= 1e-4, (mode, p, err)
            np.testing.assert_array_equal(out[mode][p].argmax(-1), out["off"][p].argmax(-1))


def test_batched_time_calls_each_argument_set_once_per_batch():
    """perf.batched_time (decode sparse MLA's timer in bench_kernels): one executable calls fn on every
    argument set (each traced into it), and the time is per call."""
    from cpkv_jax.perf import batched_time

    traced = []

    def fn(x, y):
        traced.append(x.shape)
        return x * y

    sets = [(jnp.full((4,), float(i)), jnp.float32(2.0)) for i in range(3)]
    t = batched_time(fn, sets)
    assert len(traced) == 3 and 0 < t < 1.0


def test_traced_device_time_is_per_call_busy_time(monkeypatch):
    """bench_kernels.traced_device_time (decode sparse MLA's device busy time): a real trace on this
    machine yields device ops (the CPU's executor threads stand for the device lanes), 64x the work
    takes clearly longer; and from a given trace the busy time is the ops' sum per call (over the runs
    and the 8 argument sets) and the costliest op its mean duration."""
    import scripts.profile_prefill as profile_prefill
    from scripts.bench_kernels import traced_device_time

    fn = lambda x, y: jnp.tanh(x @ y)  # noqa: E731
    times = {}
    for n in (256, 1024):
        sets = [(jax.random.normal(jax.random.key(i), (n, n)), jax.random.normal(jax.random.key(99), (n, n)))
                for i in range(8)]
        times[n] = traced_device_time(fn, sets)
        assert times[n]["device_s"] > 0 and times[n]["top_op_s"] > 0
    assert times[1024]["device_s"] > 8 * times[256]["device_s"], times
    ops = {("m", "kernel", ""): [400.0, 40], ("m", "merge", ""): [80.0, 40]}       # us, count: 5 runs x 8 calls
    ops.update({("m", f"fusion.{i}", ""): [30.0, 5] for i in range(8)})          # one op per argument set
    monkeypatch.setattr(profile_prefill, "device_op_times", lambda trace_dir: (ops, 1e3, ["/device:GPU:0"]))
    got = traced_device_time(fn, sets, reps=5)
    ops_listed = got.pop("ops")
    assert got.pop("lanes") == ["/device:GPU:0"] and got.pop("top_op") == "kernel"
    assert got == pytest.approx({"device_s": 720e-6 / 40, "top_op_s": 10e-6})
    # each kind of op by its share of a call, costliest first (the argument sets' copies fusion.0..7 as one)
    assert [(o["op"], o["us_per_call"], o["events_per_call"]) for o in ops_listed] == [
        ("kernel", 10.0, 1.0), ("fusion", 6.0, 1.0), ("merge", 2.0, 1.0)]