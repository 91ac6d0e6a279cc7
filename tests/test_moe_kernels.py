"""The routed experts' grouped matmuls (pallas_kernels/moe): the block plan's layout, the Mosaic GPU
kernel in Mosaic GPU's interpreter against XLA's ragged_dot composition, and the same compiled on the
GPU (marked gpu)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import Tiling, block_plan, expert_mlp, expert_mlp_blocked, expert_mlp_ragged, padded_rows
from pallas_kernels.policy import KernelPolicy


def routings(rng, S, E):
    """Expert ids per slot: random with empty experts and dummies, one expert holding every slot, group
    sizes that are multiples of the tile and ones that are not."""
    yield rng.integers(0, E + 1, S)                               # E: dummies
    yield np.full(S, 2)                                           # one expert holds every slot
    yield np.repeat(np.arange(E), -(-S // E))[:S]                 # near-equal groups
    e = rng.integers(0, E, S)
    e[e == 1] = 0                                                 # expert 1 empty
    yield e


@pytest.mark.parametrize("pairwise_slots", [0, 150], ids=["sorted", "pairwise"])
@pytest.mark.parametrize("block_m", [4, 64])
def test_block_plan_gives_each_expert_whole_tiles(block_m, pairwise_slots):
    rng = np.random.default_rng(1)
    S, E = 150, 6
    for fe in routings(rng, S, E):
        slot_row, row_slot, tile_expert = map(np.asarray, block_plan(jnp.asarray(fe, jnp.int32), E, block_m,
                                                                     pairwise_slots=pairwise_slots))
        P = padded_rows(S, E, block_m)
        assert row_slot.shape == (P,) and tile_expert.shape == (P // block_m,)
        real = fe < E
        assert (slot_row[~real] == -1).all() and (slot_row[real] >= 0).all()
        np.testing.assert_array_equal(row_slot[slot_row[real]], np.flatnonzero(real))   # inverse maps
        assert (row_slot >= 0).sum() == real.sum()
        np.testing.assert_array_equal(tile_expert[slot_row[real] // block_m], fe[real])  # the tile's expert
        sizes = np.bincount(fe[real], minlength=E)
        used = -(-sizes // block_m)
        np.testing.assert_array_equal(tile_expert, np.r_[np.repeat(np.arange(E), used),
                                                         np.full(P // block_m - used.sum(), -1)])
        for g in range(E):                                        # slots of one expert keep their order
            assert (np.diff(slot_row[fe == g]) == 1).all()


@pytest.mark.parametrize("S,E,block_m", [(1, 256, 64), (8, 256, 64), (64, 256, 64), (37, 6, 4), (150, 6, 64)])
def test_pairwise_plan_equals_the_sorted_plan(S, E, block_m):
    """The few-slot plan (every slot against every other) gives the sorted plan's three arrays exactly:
    decode-sized slots over GLM-5's 256 experts, experts with more slots than a tile, dummies (E and
    negative ids), one expert holding every slot, empty experts; and block_plan takes it only up to
    pairwise_slots slots."""
    from pallas_kernels.moe import plan

    rng = np.random.default_rng(S * 1000 + E)
    cases = list(routings(rng, S, E)) + [np.where(rng.random(S) < 0.2, -1, rng.integers(0, E, S))]
    for fe in cases:
        fe = jnp.asarray(fe, jnp.int32)
        want = plan._sorted_plan(fe, E, block_m)
        got = jax.jit(plan._pairwise_plan, static_argnums=(1, 2))(fe, E, block_m)
        for w, g, name in zip(want, got, ("slot_row", "row_slot", "tile_expert")):
            assert g.dtype == w.dtype == jnp.int32 and g.shape == w.shape, name
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name}: {np.asarray(fe)}")
    text = lambda n: jax.jit(functools.partial(block_plan, pairwise_slots=n), static_argnums=(1, 2)).lower(  # noqa: E731
        fe, E, block_m).as_text()
    assert "sort" in text(S - 1) and "sort" not in text(S)


def mlp_inputs(rng, N, D, I, E, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    gate = jnp.asarray(rng.standard_normal((E, D, I)) * D ** -0.5, dtype)
    up = jnp.asarray(rng.standard_normal((E, D, I)) * D ** -0.5, dtype)
    down = jnp.asarray(rng.standard_normal((E, I, D)) * I ** -0.5, dtype)
    return x, gate, up, down


def slot_reference(x, fe, gate, up, down, k):
    """The MLP per slot in fp64 numpy, the intermediate rounded to x's dtype as the kernels store it."""
    xs = np.asarray(x, np.float64)[np.arange(fe.shape[0]) // k]
    E = gate.shape[0]
    g, u, d = (np.asarray(a, np.float64)[np.minimum(fe, E - 1)] for a in (gate, up, down))
    a = np.einsum("sd,sdi->si", xs, g)
    h = a / (1 + np.exp(-a)) * np.einsum("sd,sdi->si", xs, u)
    h = np.asarray(jnp.asarray(h, x.dtype), np.float64)
    return np.where((fe < E)[:, None], np.einsum("si,sid->sd", h, d), 0)


def test_expert_mlp_blocked_interpret_equals_reference():
    """The kernel path (interpreter, race detector on) against an fp64 reference and XLA's ragged_dot
    path, for each routing of `routings` (empty experts, one expert with every slot, groups that are and
    are not multiples of the tile, dummy slots that must come out exactly zero); two tilings. Rows of
    unused tiles stay unwritten (the interpreter fills them with NaN), so a slot mapped to one shows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(2)
    N, k, D, I, E = 45, 3, 128, 128, 5
    x, gate, up, down = mlp_inputs(rng, N, D, I, E)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    tilings = ((Tiling(block_m=64, block_n=64, stages=2, grid_block_n=1, programs=3),
                Tiling(block_m=64, block_n=128, stages=3, grid_block_n=2, programs=5)),
               # two compute warpgroups: split 128 rows (gate_up), split 128 columns of 64 rows (down)
               (Tiling(block_m=128, block_n=64, stages=2, grid_block_n=1, programs=3, compute_wgs=2),
                Tiling(block_m=128, block_n=128, stages=2, grid_block_n=1, programs=2, compute_wgs=2)),
               # (gate_up walked row by row: grid_block_n past its column blocks, as the dispatch's decode tilings)
               (Tiling(block_m=64, block_n=128, stages=2, grid_block_n=64, programs=3, compute_wgs=2),
                Tiling(block_m=64, block_n=128, stages=2, grid_block_n=1, programs=2, compute_wgs=2)),
               # clusters of two programs sharing x by multicast (the down call: its two column blocks)
               (Tiling(block_m=128, block_n=64, stages=2, grid_block_n=2, programs=4, compute_wgs=2, cluster_n=2),
                Tiling(block_m=128, block_n=64, stages=2, grid_block_n=2, programs=2, compute_wgs=2, cluster_n=2)))
    for fe in routings(rng, N * k, E):
        fe = jnp.asarray(fe, jnp.int32)
        ref = slot_reference(x, np.asarray(fe), gate, up, down, k)
        ragged = np.asarray(expert_mlp_ragged(x, fe, gate, up, down, k).slots(), np.float64)
        for up_t, down_t in tilings:
            got = np.asarray(expert_mlp_blocked(x, fe, gate, up, down, k, up_tiling=up_t, down_tiling=down_t,
                                                interpret=interp).slots(), np.float64)
            assert np.isfinite(got).all()
            dummy = np.asarray(fe) == E
            assert (got[dummy] == 0).all()
            scale = np.abs(ref).max()
            assert np.abs(got - ref).max() <= 1e-2 * scale           # bf16 output rounding
            assert np.abs(got - ragged).max() <= 2e-2 * scale


def used_tiles(tile_expert, bm: int, *outs):
    """(rows, expert) of each used row tile of kernel outputs; an unused tile's rows (expert -1) must be,
    in every output, as the interpreter leaves unwritten memory: NaN (interpreter outputs only: compiled,
    unwritten memory holds whatever was there)."""
    for i, e in enumerate(np.asarray(tile_expert)):
        rows = slice(i * bm, (i + 1) * bm)
        if e < 0:
            assert all(np.isnan(out[rows]).all() for out in outs)
        else:
            yield rows, e


def fp8_experts(rng, D, I, E):
    """Random experts as fp8 blocks (models.fp8.quantize), stored K-major [E, N, K] as the model holds
    them (gate / up [E, I, D], down [E, D, I]; scales [E, N/128, K/128])."""
    from models.fp8 import quantize
    from pallas_kernels.moe import expert_shape
    return [tuple(map(jnp.asarray, quantize(rng.standard_normal(expert_shape(E, K, N, fp8=True)) * K ** -0.5)))
            for K, N in ((D, I), (D, I), (I, D))]


def plain_f32(w, scale):
    """fp8 experts [E, N, K] dequantized to the plain [E, K, N] layout in fp32."""
    from pallas_kernels.moe import fp8_experts_as_plain
    return fp8_experts_as_plain(w, scale, jnp.float32)


@pytest.mark.parametrize("bm,bn,compute_wgs,cluster_n,pairs,joint", [
    (64, 64, 1, 1, False, False), (128, 64, 2, 1, False, False), (64, 128, 2, 1, False, False),
    (128, 64, 2, 2, False, False), (64, 128, 2, 2, False, False), (128, 128, 2, 1, True, False),
    (128, 64, 2, 2, True, False), (64, 128, 2, 1, False, True), (64, 128, 2, 2, False, True),
    (128, 64, 2, 1, True, True)])
def test_fp8_grouped_matmul_interpret_equals_block_scaled_reference(bm, bn, compute_wgs, cluster_n, pairs, joint):
    """The fp8 kernel (interpreter, race detector on) against float64 products of the dequantized
    operands: row scales per 128 columns, weight scales per 128 x 128 block (distinct per block:
    K = N = 256), plain and gate/up fused; an unused tile stays unwritten (NaN from the interpreter).
    Two compute warpgroups split a 128-row tile's rows, or a 64-row tile's columns; cluster_n 2 runs
    programs in pairs on neighbouring column blocks, their x tiles and row scales multicast;
    column_pairs computes two column blocks per tile (plain calls only: with up it is refused);
    joint_products issues a step's gate and up (or pair) products together."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    rng = np.random.default_rng(4)
    E, K, N = 3, 256, 256
    tile_expert = jnp.asarray([0, 2, -1, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((bm * 4, K)) * np.repeat(rng.uniform(0.1, 10, (1, 2)), 128, axis=1),
                    jnp.float32)   # the two column groups at different scales
    xq, xs = quantize_rows(x)
    (gq, gs), (uq, us) = fp8_experts(rng, K, N, E)[:2]          # K-major [E, N, K], as the kernel takes them
    xd = np.asarray(dequantize_rows(xq, xs), np.float64)
    gd, ud = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us)))   # [E, K, N]
    t = Tiling(block_m=bm, block_n=bn, block_k=128, stages=2, grid_block_n=cluster_n, programs=3 + (cluster_n == 2),
               compute_wgs=compute_wgs, cluster_n=cluster_n, column_pairs=pairs, joint_products=joint)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    plain = np.asarray(grouped_matmul(xq, gq, tile_expert, tiling=t, interpret=interp, x_scale=xs, w_scale=gs),
                       np.float64)
    if pairs:
        with pytest.raises(ValueError, match="column_pairs takes no up"):
            grouped_matmul(xq, gq, tile_expert, up=uq, tiling=t, interpret=interp, x_scale=xs, w_scale=gs,
                           up_scale=us)
        t = dataclasses.replace(t, column_pairs=False)
    fused = np.asarray(grouped_matmul(xq, gq, tile_expert, up=uq, tiling=t, interpret=interp, x_scale=xs,
                                      w_scale=gs, up_scale=us), np.float64)
    for rows, e in used_tiles(tile_expert, bm, plain, fused):
        a = xd[rows] @ gd[e]
        want = a / (1 + np.exp(-a)) * (xd[rows] @ ud[e])
        assert np.abs(plain[rows] - a).max() <= 8e-3 * np.abs(a).max()            # bf16 output rounding
        assert np.abs(fused[rows] - want).max() <= 8e-3 * np.abs(want).max()
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        grouped_matmul(xq, gq, tile_expert, tiling=t, interpret=interp, x_scale=xs[:1], w_scale=gs)


@pytest.mark.parametrize("compute_wgs,cluster_n", [(1, 1), (2, 1), (2, 2)])
def test_fp8_block_scales_per_step_equal_reference(compute_wgs, cluster_n):
    """Each K step's weight block scale distinct (5 steps): the fused gate/up call in the interpreter
    (races detected) against float64 products of the dequantized operands, one warpgroup, two, and
    clusters of two sharing their x tiles."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    rng = np.random.default_rng(7)
    E, K, bm = 2, 640, 64
    N = 128 * cluster_n
    tile_expert = jnp.asarray([1, 0, -1, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4 * bm, K)), jnp.float32)
    xq, xs = quantize_rows(x)
    (gq, gs), (uq, us) = fp8_experts(rng, K, N, E)[:2]
    gs = gs * jnp.asarray(rng.uniform(0.25, 4.0, gs.shape), jnp.float32)   # every K step's scale its own
    xd = np.asarray(dequantize_rows(xq, xs), np.float64)
    gd, ud = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us)))
    t = Tiling(block_m=bm, block_n=128 if compute_wgs == 2 else 64, block_k=128, stages=2, grid_block_n=cluster_n,
               programs=2, compute_wgs=compute_wgs, cluster_n=cluster_n)
    out = np.asarray(grouped_matmul(xq, gq, tile_expert, up=uq, tiling=t, x_scale=xs, w_scale=gs, up_scale=us,
                                    interpret=plgpu.InterpretGPUParams(detect_races=True)), np.float64)
    for rows, e in used_tiles(tile_expert, bm, out):
        a = xd[rows] @ gd[e]
        want = a / (1 + np.exp(-a)) * (xd[rows] @ ud[e])
        assert np.abs(out[rows] - want).max() <= 8e-3 * np.abs(want).max()


@pytest.mark.parametrize("bm,bn,cluster_n", [(128, 128, 1), (128, 128, 2), (64, 256, 2)])
def test_interleaved_gate_up_interpret_equals_reference(bm, bn, cluster_n):
    """Tiling.interleaved_gate_up: each step's 64-row gate and up blocks loaded side by side into one
    shared-memory buffer, one m64n128 product a step per warpgroup whose halves take gate's and up's
    block scales (128-row tiles: each warpgroup 64 rows; 64-row decode tiles of 256: each warpgroup
    one gate/up block pair, 64 output columns): the interpreter (races detected) against float64 and
    against the two-weight fused call on the same experts; 2 gate scale blocks, 5 K steps with
    distinct scales (more than the stages: the buffer's slots are reused), an unused tile unwritten;
    refused without `up` and on 64-wide blocks."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    from pallas_kernels.moe.grouped_matmul import shape_error
    rng = np.random.default_rng(13)
    E, K, I = 2, 640, 256
    tile_expert = jnp.asarray([1, -1, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3 * bm, K)), jnp.float32)
    xq, xs = quantize_rows(x)
    (gq, gs), (uq, us) = fp8_experts(rng, K, I, E)[:2]
    gs = gs * jnp.asarray(rng.uniform(0.25, 4.0, gs.shape), jnp.float32)
    us = us * jnp.asarray(rng.uniform(0.25, 4.0, us.shape), jnp.float32)
    xd = np.asarray(dequantize_rows(xq, xs), np.float64)
    gd, ud = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us)))
    interp = plgpu.InterpretGPUParams(detect_races=True)
    t = Tiling(block_m=bm, block_n=bn, block_k=128, stages=2, grid_block_n=2 if bm == 128 else 1, programs=4,
               compute_wgs=2, cluster_n=cluster_n, interleaved_gate_up=True)
    got = np.asarray(grouped_matmul(xq, gq, tile_expert, up=uq, tiling=t, interpret=interp, x_scale=xs, w_scale=gs,
                                    up_scale=us), np.float64)
    assert got.shape == (3 * bm, I)
    two = np.asarray(grouped_matmul(xq, gq, tile_expert, up=uq, interpret=interp, x_scale=xs, w_scale=gs, up_scale=us,
                                    tiling=Tiling(block_m=bm, block_n=64 if bm == 128 else 128, block_k=128, stages=2,
                                                  grid_block_n=1, programs=3, compute_wgs=2,
                                                  joint_products=bm == 128)), np.float64)
    for rows, e in used_tiles(tile_expert, bm, got):
        a = xd[rows] @ gd[e]
        want = a / (1 + np.exp(-a)) * (xd[rows] @ ud[e])
        assert np.abs(got[rows] - want).max() <= 8e-3 * np.abs(want).max()
        assert np.abs(got[rows] - two[rows]).max() <= 8e-3 * np.abs(want).max()
    with pytest.raises(ValueError, match="takes gate in w and up in up"):
        grouped_matmul(xq, gq, tile_expert, tiling=t, interpret=interp, x_scale=xs, w_scale=gs)
    sds = jax.ShapeDtypeStruct
    assert "interleaved_gate_up" in shape_error(sds((3 * bm, K), jnp.float8_e4m3fn), sds(gq.shape, jnp.float8_e4m3fn),
                                                dataclasses.replace(t, block_n=64), fp8=True)


@pytest.mark.parametrize("kind", ["joint", "interleaved_c2", "interleaved_64x256", "down_pairs"])
def test_unscaled_probe_interpret_equals_the_unscaled_products(kind):
    """Tiling.unscaled_probe (a benchmark probe: the fp8 products accumulated in place, no block scales):
    the interpreter (races detected) against float64 products of the raw e4m3 values, for the gate_up
    call (joint products, interleaved in clusters, 64 x 256 decode tiles) and a plain call in column
    pairs; 5 K steps over 2 stages; refused with one compute warpgroup. Its output must not equal the
    scaled call's (the scales are ignored, not silently applied)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.grouped_matmul import shape_error
    rng = np.random.default_rng(37)
    E, K, N = 2, 640, 256
    bm = 64 if kind == "interleaved_64x256" else 128
    t = Tiling(block_m=bm, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=4, compute_wgs=2,
               joint_products=True, unscaled_probe=True)
    if kind.startswith("interleaved"):
        t = dataclasses.replace(t, block_n=128 if bm == 128 else 256, cluster_n=2, joint_products=False,
                                interleaved_gate_up=True)
    if kind == "down_pairs":
        t = dataclasses.replace(t, block_n=128, column_pairs=True, joint_products=False)
    te = jnp.asarray([1, -1, 0], jnp.int32)
    xq, xs = quantize_rows(jnp.asarray(rng.standard_normal((3 * bm, K)), jnp.float32))
    (gq, gs), (uq, us) = fp8_experts(rng, K, N, E)[:2]
    two = kind != "down_pairs"
    interp = plgpu.InterpretGPUParams(detect_races=True)
    call = lambda tt: np.asarray(grouped_matmul(  # noqa: E731
        xq, gq, te, up=uq if two else None, tiling=tt, interpret=interp, x_scale=xs, w_scale=gs,
        up_scale=us if two else None), np.float64)
    got, scaled = call(t), call(dataclasses.replace(t, unscaled_probe=False))
    x64, g64, u64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (xq, gq, uq))
    for rows, e in used_tiles(te, bm, got):
        a = x64[rows] @ g64[e].T
        with np.errstate(over="ignore"):      # raw e4m3 products are large: exp(-a) overflows to inf, silu to 0
            want = a / (1 + np.exp(-a)) * (x64[rows] @ u64[e].T) if two else a
        assert np.abs(got[rows] - want).max() <= 8e-3 * np.abs(want).max()
        assert np.abs(scaled[rows] - want).max() > 0.1 * np.abs(want).max()
    sds = jax.ShapeDtypeStruct
    one_wg = Tiling(block_m=64, block_n=64, block_k=128, stages=2, unscaled_probe=True)
    assert "unscaled_probe" in shape_error(sds((128, K), jnp.float8_e4m3fn), sds(gq.shape, jnp.float8_e4m3fn),
                                           one_wg, fp8=True)


@pytest.mark.parametrize("interleaved", [False, True])
def test_unscaled_probe_lowers_for_cuda_at_glm5_widths(interleaved):
    """The probe as bench_moe_tilings times it (`_u`): the prefill gate_up tilings (joint n64, interleaved
    in clusters) at GLM-5's widths, 8192 tokens x top-8 over 256 experts, lowered for CUDA from shapes."""
    from pallas_kernels.moe import grouped_matmul
    sds = jax.ShapeDtypeStruct
    E, D, I, P = 256, 6144, 2048, 8192 * 8 + 256 * 128
    t = Tiling(block_m=128, block_n=128 if interleaved else 64, block_k=128, stages=4, compute_wgs=2, grid_block_n=16,
               cluster_n=2 if interleaved else 1, joint_products=not interleaved, interleaved_gate_up=interleaved,
               unscaled_probe=True)
    f = jax.jit(lambda x, w, u, te, xs, gs, us: grouped_matmul(x, w, te, up=u, tiling=t, x_scale=xs, w_scale=gs,
                                                                up_scale=us))
    w, ws = sds((E, I, D), jnp.float8_e4m3fn), sds((E, I // 128, D // 128), jnp.float32)
    text = f.trace(sds((P, D), jnp.float8_e4m3fn), w, w, sds((P // 128,), jnp.int32), sds((D // 128, P), jnp.float32),
                   ws, ws).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("kind", ["fp8_joint", "fp8_interleaved_c2", "fp8_down_pairs_c2", "bf16"])
def test_chained_tiles_interpret_are_bit_equal(kind):
    """Tiling.chained_tiles (a program's tiles as one continued K pipeline: START, STEADY..., STOP)
    does the same arithmetic as a pipeline a tile: the interpreter (races detected) gives bit-equal
    outputs, over row tiles whose experts leave programs with several used tiles between unused ones,
    exactly one, or none (the rest unwritten), 4 K steps over 2 stages; refused where the K steps are
    not a multiple of the stages."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.grouped_matmul import shape_error
    rng = np.random.default_rng(31)
    E, K, N = 3, 512, 512 if kind == "fp8_down_pairs_c2" else 256
    fp8 = kind != "bf16"
    t = Tiling(block_m=128, block_n=64, block_k=128 if fp8 else 64, stages=2, grid_block_n=2, programs=4,
               compute_wgs=2, joint_products=kind == "fp8_joint")
    if kind == "fp8_interleaved_c2":
        t = dataclasses.replace(t, block_n=128, cluster_n=2, interleaved_gate_up=True)
    if kind == "fp8_down_pairs_c2":
        t = dataclasses.replace(t, block_m=64, block_n=128, cluster_n=2, column_pairs=True, joint_products=True,
                                grid_block_n=1)
    if not fp8:
        t = dataclasses.replace(t, stages=4, block_n=128)       # 8 K steps of 64
    interp = plgpu.InterpretGPUParams(detect_races=True)
    for tile_expert in ([1, -1, 0, 2, -1, 1], [-1, -1, 2, -1, -1, -1]):
        te = jnp.asarray(tile_expert, jnp.int32)
        x = jnp.asarray(rng.standard_normal((len(tile_expert) * t.block_m, K)), jnp.float32)
        if fp8:
            (gq, gs), (uq, us) = fp8_experts(rng, K, N, E)[:2]
            xq, xs = quantize_rows(x)
            two = kind != "fp8_down_pairs_c2"
            call = lambda tt: grouped_matmul(xq, gq, te, up=uq if two else None, tiling=tt, interpret=interp,  # noqa: E731
                                             x_scale=xs, w_scale=gs, up_scale=us if two else None)
        else:
            g, u = (jnp.asarray(rng.standard_normal((E, K, N)) * K ** -0.5, jnp.bfloat16) for _ in range(2))
            call = lambda tt: grouped_matmul(x.astype(jnp.bfloat16), g, te, up=u, tiling=tt, interpret=interp)  # noqa: E731
        plain, chained = (np.asarray(call(dataclasses.replace(t, chained_tiles=c)), np.float32) for c in (False, True))
        assert list(used_tiles(te, t.block_m, plain, chained)) and np.abs(plain[np.isfinite(plain)]).max() > 0
        np.testing.assert_array_equal(chained, plain)
    sds = jax.ShapeDtypeStruct
    odd = dataclasses.replace(t, stages=3, chained_tiles=True)
    assert "chained_tiles" in shape_error(sds((128, K), xq.dtype if fp8 else jnp.bfloat16),
                                          sds((E, N, K) if fp8 else (E, K, N), gq.dtype if fp8 else jnp.bfloat16),
                                          odd, fp8=fp8)


@pytest.mark.parametrize("bm,cluster_n,stages", [(128, 1, 4), (128, 2, 4), (128, 1, 5), (64, 2, 4)])
def test_interleaved_gate_up_lowers_for_cuda_at_glm5_widths(bm, cluster_n, stages):
    """The interleaved gate_up call at GLM-5's widths (hidden 6144, expert width 2048, 256 experts;
    prefill 8192 tokens x top-8 on 128-row tiles, decode 64 tokens on 64 x 256 tiles), traced and
    lowered for CUDA from shapes: the column-half scales and the epilogue's column slices lower, and
    the stages fit the shared memory."""
    from pallas_kernels.moe import grouped_matmul
    sds = jax.ShapeDtypeStruct
    E, D, I = 256, 6144, 2048
    P = 8192 * 8 + 256 * 128 if bm == 128 else 64 * 8 * 64
    t = Tiling(block_m=bm, block_n=128 if bm == 128 else 256, block_k=128, stages=stages, compute_wgs=2,
               grid_block_n=16 if bm == 128 else 1, cluster_n=cluster_n, interleaved_gate_up=True)
    f = jax.jit(lambda x, w, u, te, xs, gs, us: grouped_matmul(x, w, te, up=u, tiling=t, x_scale=xs, w_scale=gs,
                                                                up_scale=us))
    w = sds((E, I, D), jnp.float8_e4m3fn)
    text = f.trace(sds((P, D), jnp.float8_e4m3fn), w, w, sds((P // bm,), jnp.int32),
                   sds((D // 128, P), jnp.float32), sds((E, I // 128, D // 128), jnp.float32),
                   sds((E, I // 128, D // 128), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("fp8,compute_wgs,cluster_n", [(True, 2, 1), (True, 2, 2), (True, 1, 1), (False, 2, 1),
                                                   (False, 1, 1)])
def test_k_splits_interpret_equal_reference(fp8, compute_wgs, cluster_n):
    """K split over programs (Tiling.k_splits: each sums its consecutive K steps into an fp32 partial,
    the call adds them): plain calls over several experts' row tiles, an unused tile left unwritten,
    in the interpreter (races detected) against float64 products; fp8 with a distinct scale per K
    block; refused with `up` and where the splits do not divide the K steps."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    from pallas_kernels.moe.grouped_matmul import shape_error
    rng = np.random.default_rng(11)
    E, bm, splits = 3, 64, 3
    K, N = (768, 256) if fp8 else (384, 256)              # 6 K steps either way
    tile_expert = jnp.asarray([2, -1, 0, 2], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4 * bm, K)), jnp.float32)
    bn = 128 if compute_wgs == 2 else 64
    t = Tiling(block_m=bm, block_n=bn, block_k=128 if fp8 else 64, stages=2, grid_block_n=cluster_n, programs=4,
               compute_wgs=compute_wgs, cluster_n=cluster_n, k_splits=splits)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    if fp8:
        xq, xs = quantize_rows(x)
        (gq, gs), = fp8_experts(rng, K, N, E)[:1]
        gs = gs * jnp.asarray(rng.uniform(0.25, 4.0, gs.shape), jnp.float32)
        xd, wd = np.asarray(dequantize_rows(xq, xs), np.float64), np.asarray(plain_f32(gq, gs), np.float64)
        run = lambda t, **kw: grouped_matmul(xq, gq, tile_expert, tiling=t, interpret=interp, x_scale=xs,  # noqa: E731
                                             w_scale=gs, **kw)
        up = dict(up=gq, up_scale=gs)
    else:
        xb, wb = x.astype(jnp.bfloat16), jnp.asarray(rng.standard_normal((E, K, N)) * K ** -0.5, jnp.bfloat16)
        xd, wd = np.asarray(xb, np.float64), np.asarray(wb, np.float64)
        run = lambda t, **kw: grouped_matmul(xb, wb, tile_expert, tiling=t, interpret=interp, **kw)  # noqa: E731
        up = dict(up=wb)
    out = np.asarray(run(t), np.float64)
    for rows, e in used_tiles(tile_expert, bm, out):
        want = xd[rows] @ wd[e]
        assert np.abs(out[rows] - want).max() <= 8e-3 * np.abs(want).max()
    with pytest.raises(ValueError, match="k_splits takes no up"):
        run(t, **up)
    sds = jax.ShapeDtypeStruct
    w_sds = sds((E, N, K) if fp8 else (E, K, N), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    x_sds = sds((4 * bm, K), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    assert "k_splits 4" in shape_error(x_sds, w_sds, dataclasses.replace(t, k_splits=4), fp8=fp8)


def test_expert_mlp_fp8_interpret_equals_its_quantized_reference():
    """The fp8 path of the dispatch (interpreter) on K-major experts (hidden 256 != expert width 128, so
    gate / up [E, 128, 256] and down [E, 256, 128] are told apart by shape) against the same arithmetic
    in float64 (rows quantized per 128 columns before each matmul, dequantized weights), and within
    fp8's error of the bf16 path on the dequantized weights (what the dispatch runs when the fp8 kernel
    does not: fp8_experts_as_plain, [E, K, N])."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import expert_mlp_blocked_fp8, fp8_experts_as_plain, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    rng = np.random.default_rng(5)
    N, k, D, I, E = 40, 2, 256, 128, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    assert gq.shape == (E, I, D) and dq.shape == (E, D, I) and gs.shape == (E, 1, 2) and ds.shape == (E, 2, 1)
    fe = jnp.asarray(routings(rng, N * k, E).__next__(), jnp.int32)      # random, with dummies
    t = Tiling(block_m=64, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=3)
    got = np.asarray(expert_mlp_blocked_fp8(x, fe, gq, uq, dq, (gs, us, ds), k, up_tiling=t, down_tiling=t,
                                            interpret=plgpu.InterpretGPUParams(detect_races=True)).slots(), np.float64)
    g, u, d = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us), (dq, ds)))
    fe_np = np.asarray(fe)
    want = np.zeros((N * k, D))
    for s_, e in enumerate(fe_np):
        if e == E:
            continue
        xr = np.asarray(dequantize_rows(*quantize_rows(x[s_ // k][None].astype(jnp.float32))), np.float64)[0]
        a = xr @ g[e]
        h = np.asarray(jnp.asarray(a / (1 + np.exp(-a)) * (xr @ u[e]), jnp.bfloat16), np.float32)
        hr = np.asarray(dequantize_rows(*quantize_rows(jnp.asarray(h)[None])), np.float64)[0]
        want[s_] = hr @ d[e]
    assert (got[fe_np == E] == 0).all()
    scale = np.abs(want).max()
    # the bulk agrees to bf16 rounding; an intermediate h on an fp8 rounding boundary may round one step
    # (1/8 relative) the other way in one of the two, which moves its outputs by up to a few %
    assert np.abs(got - want).mean() <= 2e-3 * scale and np.abs(got - want).max() <= 4e-2 * scale
    bf16 = np.asarray(expert_mlp(x, fe, gq, uq, dq, k, scales=(gs, us, ds)).slots(), np.float64)   # CPU: dequantized
    np.testing.assert_array_equal(bf16, np.asarray(expert_mlp_ragged(
        x, fe, *(fp8_experts_as_plain(w, sc, x.dtype) for w, sc in ((gq, gs), (uq, us), (dq, ds))), k).slots(), np.float64))
    assert np.abs(got - bf16).max() <= 0.1 * scale      # fp8 activations: a few % of the largest output


def test_fp8_interleaved_gate_up_policy():
    """KernelPolicy.fp8_moe_interleaved_gate_up: the dispatch's gate_up tiling at GLM-5's widths is the
    interleaved one (128 x 128 at prefill, 64 x 256 walked row by row over its 16 column blocks at
    decode, clusters of two) and fits; and the fp8 expert path with it (interpreter, races detected)
    equals float64 and the default tilings' path to fp8 rounding."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import expert_mlp_blocked_fp8, quantize_rows
    from pallas_kernels.moe.dispatch import expert_tilings, fp8_shape_error
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    sds = jax.ShapeDtypeStruct
    E, D, I = 256, 6144, 2048
    gate, down = sds((E, I, D), jnp.float8_e4m3fn), sds((E, D, I), jnp.float8_e4m3fn)
    for slots, (bm, bn, walk) in ((8192 * 8, (128, 128, 16)), (64 * 8, (64, 256, 16))):
        up_t, down_t = expert_tilings(slots, gate, True, 2, interleaved=True)
        assert (up_t.interleaved_gate_up, up_t.block_m, up_t.block_n, up_t.grid_block_n, up_t.cluster_n) == (
            True, bm, bn, walk, 2)
        assert down_t == expert_tilings(slots, gate, True, 2)[1]
        assert not expert_tilings(slots, gate, True, 2)[0].interleaved_gate_up
        assert not expert_tilings(slots, gate, True, 1, interleaved=True)[0].interleaved_gate_up
        assert fp8_shape_error(sds((slots // 8, D), jnp.bfloat16), gate, down, slots, interleaved=True) is None
    rng = np.random.default_rng(8)
    N, k, D, I, E = 40, 2, 256, 256, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(routings(rng, N * k, E).__next__(), jnp.int32)
    t = Tiling(block_m=64, block_n=128, block_k=128, stages=2, grid_block_n=1, programs=4, compute_wgs=2)
    il = dataclasses.replace(t, block_n=256, cluster_n=2, interleaved_gate_up=True)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    got, plain = (np.asarray(expert_mlp_blocked_fp8(x, fe, gq, uq, dq, (gs, us, ds), k, up_tiling=u, down_tiling=t,
                                                    interpret=interp).slots(), np.float64) for u in (il, t))
    xd = np.asarray(dequantize_rows(*quantize_rows(x)), np.float64)
    gd, ud, dd = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us), (dq, ds)))
    used = np.asarray(fe) < E
    a = np.einsum("sd,sdi->si", xd[np.arange(N * k) // k][used], gd[np.asarray(fe)[used]])
    h = a / (1 + np.exp(-a)) * np.einsum("sd,sdi->si", xd[np.arange(N * k) // k][used], ud[np.asarray(fe)[used]])
    want = np.einsum("si,sid->sd", h, dd[np.asarray(fe)[used]])   # h unquantized: the kernels round it to fp8
    assert np.abs(got[used] - want).mean() <= 1e-2 * np.abs(want).max()
    assert np.abs(got[used] - want).max() <= 0.1 * np.abs(want).max()
    assert np.abs(got).max() > 0
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-2 * np.abs(plain).max())


def test_fp8_experts_in_the_plain_layout_are_refused():
    """The layout is checked where the experts enter the dispatch: fp8 experts given [E, K, N] (the
    plain layout, as before they were stored K-major) are a ValueError naming the K-major layout, on
    the fp8 kernel's path and on the dequantizing one; plain experts given K-major likewise. (Where
    D == I the shapes cannot tell; the numeric tests above would then go red, see
    test_fp8_experts_transposed_change_the_result.)"""
    from pallas_kernels.moe import expert_mlp_blocked_fp8
    rng = np.random.default_rng(7)
    N, k, D, I, E = 8, 2, 256, 128, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(rng.integers(0, E, N * k), jnp.int32)
    t = jnp.swapaxes
    swapped = dict(gate=(t(gq, 1, 2), uq, dq, (t(gs, 1, 2), us, ds)), up=(gq, t(uq, 1, 2), dq, (gs, t(us, 1, 2), ds)),
                   down=(gq, uq, t(dq, 1, 2), (gs, us, t(ds, 1, 2))),
                   all=(t(gq, 1, 2), t(uq, 1, 2), t(dq, 1, 2), tuple(t(s, 1, 2) for s in (gs, us, ds))))
    tiling = Tiling(block_m=64, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=3)
    for name, (g, u, d, sc) in swapped.items():
        with pytest.raises(ValueError, match=r"fp8 experts are K-major \[E, N, K\]"):
            expert_mlp(x, fe, g, u, d, k, scales=sc)
        with pytest.raises(ValueError, match=r"fp8 experts are K-major \[E, N, K\]"):
            expert_mlp_blocked_fp8(x, fe, g, u, d, sc, k, up_tiling=tiling, down_tiling=tiling, interpret=True)
    with pytest.raises(ValueError, match="scales"):                        # scales that do not match
        expert_mlp(x, fe, gq, uq, dq, k, scales=(gs, us, t(ds, 1, 2)))
    _, gate, up, down = mlp_inputs(rng, N, D, I, E)
    with pytest.raises(ValueError, match=r"plain experts are \[E, K, N\]"):
        expert_mlp(x, fe, t(gate, 1, 2), t(up, 1, 2), t(down, 1, 2), k)
    with pytest.raises(ValueError, match="scales are given exactly"):      # fp8 weights without scales
        expert_mlp(x, fe, gq.reshape(E, D, I), uq.reshape(E, D, I), dq.reshape(E, I, D), k)


def test_fp8_experts_transposed_change_the_result():
    """Where D == I a transposed fp8 expert has the right shape: the dispatch's result then differs
    from the K-major one by far more than the fp8 tests' tolerance, so a layout slip goes red there."""
    rng = np.random.default_rng(8)
    N, k, D, I, E = 16, 2, 128, 128, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(rng.integers(0, E, N * k), jnp.int32)
    good = np.asarray(expert_mlp(x, fe, gq, uq, dq, k, scales=(gs, us, ds)).slots())
    want = np.asarray(expert_mlp_ragged(x, fe, *(plain_f32(w, s) for w, s in ((gq, gs), (uq, us), (dq, ds))), k).slots())
    np.testing.assert_allclose(good, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    t = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    bad = np.asarray(expert_mlp(x, fe, t(gq), t(uq), t(dq), k, scales=(t(gs), t(us), t(ds))).slots())
    assert np.abs(bad - want).max() > 0.3 * np.abs(want).max()


def test_expert_mlp_hands_fp8_experts_to_the_kernel_as_stored(monkeypatch):
    """With the fp8 kernel chosen (the GPU and policy.fp8_moe_kernel, faked here), the dispatch passes
    the stored K-major arrays to expert_mlp_blocked_fp8 untouched (the same arrays: no transpose, no
    copy), with the dispatch's tilings (expert_tilings)."""
    import pallas_kernels.moe.dispatch as dispatch
    rng = np.random.default_rng(9)
    N, k, D, I, E = 8, 2, 256, 128, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(rng.integers(0, E, N * k), jnp.int32)
    seen = []
    monkeypatch.setattr(KernelPolicy, "on_gpu", lambda self: self.enabled)
    monkeypatch.setattr(dispatch, "expert_mlp_blocked_fp8",
                        lambda x, fe, g, u, d, sc, *a, up_tiling, down_tiling, **kw:
                        seen.append((g, u, d, sc, (up_tiling, down_tiling))))
    dispatch.expert_mlp(x, fe, gq, uq, dq, k, policy=KernelPolicy(fp8_moe_kernel=True), scales=(gs, us, ds))
    (g, u, d, sc, tilings), = seen
    assert g is gq and u is uq and d is dq and all(a is b for a, b in zip(sc, (gs, us, ds)))
    p = KernelPolicy()
    assert tilings == dispatch.expert_tilings(N * k, gq, True, **dispatch.fp8_tiling_options(p))
    assert tilings[0].interleaved_gate_up          # the default since the 2026-12-05 H100 timings
    assert tilings[0].step_blocks == 2             # the default since the 2026-12-06 H100 timings
    odd = jax.ShapeDtypeStruct((8, 192, D), jnp.float8_e4m3fn)   # 16 slots over 8 experts: decode tiles, whose
    #                                                              interleaved form takes 128 columns of 192
    up_t, _ = dispatch.expert_tilings(N * k, odd, True, 2, True)
    assert not up_t.interleaved_gate_up and up_t == dispatch.expert_tilings(N * k, odd, True, 2, False)[0]


@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_expert_mlp_fp8_lowers_for_cuda_reading_the_stored_weights(compute_wgs):
    """The fp8 kernel path traced and lowered for CUDA on this machine (Mosaic GPU lowering errors show
    here): the two kernel calls take the function's weight and scale arguments themselves (gate, up and
    their scales in the first, down and its scale in the second), and no fp8 tensor is transposed."""
    import re

    from pallas_kernels.moe import expert_mlp_blocked_fp8
    from pallas_kernels.moe.dispatch import fp8_tilings
    rng = np.random.default_rng(10)
    N, k, D, I, E = 16, 4, 256, 128, 8
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(rng.integers(0, E, N * k), jnp.int32)
    up_t, down_t = fp8_tilings(N * k, E, compute_wgs)
    f = functools.partial(expert_mlp_blocked_fp8, topk=k, up_tiling=up_t, down_tiling=down_t)
    text = jax.jit(lambda x, fe, g, u, d, sg, su, sd: f(x, fe, g, u, d, (sg, su, sd))).trace(
        x, fe, gq, uq, dq, gs, us, ds).lower(lowering_platforms=("cuda",)).as_text()
    calls = [set(re.findall(r"%arg\d+", line.split("{")[0])) for line in text.splitlines()
             if "custom_call @mosaic_gpu" in line]
    # args: x 0, fe 1, gate 2, up 3, down 4, their scales 5, 6, 7
    assert calls == [{"%arg2", "%arg3", "%arg5", "%arg6"}, {"%arg4", "%arg7"}], calls
    assert not [line for line in text.splitlines() if "stablehlo.transpose" in line and "f8E4M3FN" in line]


def test_expert_mlp_dispatch_takes_ragged_dot_off_the_gpu(monkeypatch):
    """On CPU (and with the policy off) the dispatch runs XLA's ragged_dot path."""
    import pallas_kernels.moe.dispatch as dispatch
    calls = []
    monkeypatch.setattr(dispatch, "expert_mlp_blocked", lambda *a, **kw: calls.append("blocked"))
    rng = np.random.default_rng(3)
    x, gate, up, down = mlp_inputs(rng, 8, 128, 128, 4)
    fe = jnp.asarray(rng.integers(0, 4, 16), jnp.int32)
    for policy in (KernelPolicy(), KernelPolicy(moe_kernel=False)):
        out = expert_mlp(x, fe, gate, up, down, 2, policy=policy).slots(policy)
        np.testing.assert_array_equal(out, expert_mlp_ragged(x, fe, gate, up, down, 2).slots())
    assert calls == [] or jax.default_backend() == "gpu"


def test_one_program_a_tile_interpret_bit_equal_persistent():
    """Tiling.programs 0 (one program a tile, KernelPolicy.moe_tile_program_rows at bf16 prefill) in the interpreter
    (races detected): the bf16 path's gate_up and clustered down calls (down chained too), and the fp8 gate_up
    call in clusters of two, give the persistent programs' outputs bit for bit (each tile's sums are the same either way)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    from pallas_kernels.moe.dispatch import expert_tilings
    from pallas_kernels.moe.grouped_matmul import chained, program_count
    rng = np.random.default_rng(5)
    N, k, D, I, E = 45, 3, 128, 128, 5
    x, gate, up, down = mlp_inputs(rng, N, D, I, E)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    fe = jnp.asarray(rng.integers(0, E + 1, N * k), jnp.int32)
    up_t = Tiling(block_m=128, block_n=64, stages=2, grid_block_n=1, programs=3, compute_wgs=2)
    down_t = Tiling(block_m=128, block_n=64, stages=2, grid_block_n=2, programs=2, compute_wgs=2, cluster_n=2)
    one_tile = functools.partial(dataclasses.replace, programs=0)
    # (chained, each program's one tile is its chain's first and last: the fp8 prefill down call's default)
    outs = [np.asarray(expert_mlp_blocked(x, fe, gate, up, down, k, up_tiling=u, down_tiling=d, interpret=interp).slots(),
                       np.float64) for u, d in ((up_t, down_t), (one_tile(up_t), one_tile(down_t)),
                                                (one_tile(up_t), one_tile(chained(down_t, I))))]
    assert chained(down_t, I).chained_tiles
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    (gq, gs), (uq, us) = fp8_experts(rng, 256, 256, 3)[:2]
    tile_expert = jnp.asarray([0, 2, -1, 1], jnp.int32)
    xq, xs = quantize_rows(jnp.asarray(rng.standard_normal((4 * 128, 256)), jnp.float32))
    t = Tiling(block_m=128, block_n=64, block_k=128, stages=2, grid_block_n=2, programs=2, compute_wgs=2,
               cluster_n=2)
    fp8 = [np.asarray(grouped_matmul(xq, gq, tile_expert, up=uq, tiling=dataclasses.replace(t, programs=p),
                                     interpret=interp, x_scale=xs, w_scale=gs, up_scale=us), np.float64)
           for p in (2, 0)]
    used = np.repeat(np.asarray(tile_expert) >= 0, 128)
    assert np.isfinite(fp8[0][used]).all() and np.isnan(fp8[1][~used]).all()   # the unused tile left unwritten
    np.testing.assert_array_equal(fp8[1][used], fp8[0][used])
    assert program_count(one_tile(up_t), 10) == 10 and program_count(up_t, 10) == 3
    assert program_count(dataclasses.replace(up_t, programs=0, k_splits=4), 10) == 40
    # the policy's prefill tilings take it, its decode tilings (64 rows) stay persistent
    assert [t.programs for t in expert_tilings(2048, gate, False, 2, one_tile=True)] == [0, 0]
    assert [t.programs for t in expert_tilings(2048, gate, False, 2)] == [132, 132]
    assert [t.programs for t in expert_tilings(8, gate, False, 2, one_tile=True)] == [132, 132]
    # KernelPolicy.moe_tile_program_rows: bf16 prefill calls of at most that many rows an expert (E = 5 here)
    from pallas_kernels.moe.dispatch import bf16_tilings, fp8_tiling_options
    for slots, rows, programs in ((1280, 256, 0), (1281, 256, 132), (1280, 255, 132), (2560, 512, 0),
                                  (1280, 0, 132), (8, 256, 132)):
        policy = KernelPolicy(moe_tile_program_rows=rows)
        assert [t.programs for t in bf16_tilings(slots, gate, policy)] == [programs] * 2, (slots, rows)
    gq = fp8_experts(rng, D, I, E)[0][0]
    assert [t.programs for t in expert_tilings(1280, gq, True, **fp8_tiling_options(KernelPolicy()))] == [132, 132]


@functools.partial(jax.jit, static_argnums=5, static_argnames="policy")
def slots_compiled(x, fe, gate, up, down, k, *, policy, scales=None):
    """The dispatch's outputs in slot order, compiled."""
    return expert_mlp(x, fe, gate, up, down, k, policy=policy, scales=scales).slots(policy)


@pytest.mark.gpu
@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_expert_mlp_kernel_compiled_equals_reference(compute_wgs):
    """Compiled on the GPU through the dispatch (one compute warpgroup or the warp-specialized two), at
    prefill and decode row counts, 16 and 256 experts, skewed and one-expert routings, and a shape the
    kernel cannot take (hidden 96: the dispatch falls back instead of failing)."""
    policy = KernelPolicy(moe_compute_wgs=compute_wgs)
    rng = np.random.default_rng(4)
    for N, k, D, I, E in ((512, 8, 1024, 512, 16), (4, 8, 1024, 512, 256), (300, 8, 512, 256, 256),
                          (64, 4, 96, 64, 6)):
        x, gate, up, down = mlp_inputs(rng, N, D, I, E)
        for fe in (rng.integers(0, E + 1, N * k), np.full(N * k, E - 1)):
            fe = jnp.asarray(fe, jnp.int32)
            ref = slot_reference(x, np.asarray(fe), gate, up, down, k)
            got = np.asarray(slots_compiled(x, fe, gate, up, down, k, policy=policy), np.float64)
            assert np.isfinite(got).all()
            assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max(), (N, k, D, I, E)


@pytest.mark.gpu
@pytest.mark.parametrize("compute_wgs,interleaved,chain", [
    (1, False, False), (2, False, False), (2, True, False), (2, False, True)])
def test_expert_mlp_fp8_kernel_compiled_equals_the_dequantized_path(compute_wgs, interleaved, chain):
    """fp8 experts through the compiled fp8 kernel (policy.fp8_moe_kernel; one compute warpgroup or the
    warp-specialized two, with gate_up's blocks side by side or not, tiles chained or not) against the
    same weights dequantized to bf16 (the bf16 kernel path, chained as well): prefill and decode row
    counts, 16 and 256 experts."""
    from pallas_kernels.moe import fp8_kernel_applies
    rng = np.random.default_rng(6)
    on = KernelPolicy(fp8_moe_kernel=True, fp8_moe_compute_wgs=compute_wgs, fp8_moe_interleaved_gate_up=interleaved,
                      chained_tiles=chain)
    off = KernelPolicy(fp8_moe_kernel=False, chained_tiles=chain)
    run = slots_compiled
    for N, k, D, I, E in ((512, 8, 1024, 512, 16), (4, 8, 1024, 512, 256), (300, 8, 512, 256, 256)):
        x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
        (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
        assert fp8_kernel_applies(x, gq, dq, N * k, on) and not fp8_kernel_applies(x, gq, dq, N * k, off)
        fe = jnp.asarray(rng.integers(0, E + 1, N * k), jnp.int32)
        got = np.asarray(run(x, fe, gq, uq, dq, k, policy=on, scales=(gs, us, ds)), np.float64)
        want = np.asarray(run(x, fe, gq, uq, dq, k, policy=off, scales=(gs, us, ds)), np.float64)
        assert np.isfinite(got).all()
        assert np.abs(got - want).mean() <= 1e-2 * np.abs(want).max(), (N, k, D, I, E)
        assert np.abs(got - want).max() <= 0.1 * np.abs(want).max(), (N, k, D, I, E)


@pytest.mark.gpu
def test_moe_tile_programs_compiled_bit_equal():
    """KernelPolicy.moe_tile_program_rows (one program a bf16 prefill tile; on by default at these rows an
    expert: 256 and ~9) through the compiled dispatch, bf16 and fp8 experts, 16 and 256 experts: the
    persistent programs' outputs bit for bit."""
    rng = np.random.default_rng(14)
    off, on = KernelPolicy(moe_tile_program_rows=0), KernelPolicy()
    for N, k, D, I, E in ((512, 8, 1024, 512, 16), (300, 8, 1024, 512, 256)):
        x, gate, up, down = mlp_inputs(rng, N, D, I, E)
        fe = jnp.asarray(rng.integers(0, E + 1, N * k), jnp.int32)
        (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
        xb = jnp.asarray(x, jnp.bfloat16)
        for args, kw in (((x, fe, gate, up, down, k), {}), ((xb, fe, gq, uq, dq, k), dict(scales=(gs, us, ds)))):
            want = np.asarray(slots_compiled(*args, policy=off, **kw), np.float64)
            assert np.abs(want).max() > 0, (N, E)
            got = np.asarray(slots_compiled(*args, policy=on, **kw), np.float64)
            assert np.isfinite(got).all(), (N, E)
            np.testing.assert_array_equal(got, want, err_msg=f"{N} tokens over {E} experts")


@pytest.mark.gpu
def test_expert_mlp_fp8_three_wgs_compiled_bit_equal_two():
    """KernelPolicy.fp8_three_wgs through the compiled dispatch (2048 rows an expert: 192-row tiles in three
    compute warpgroups for both calls) gives the default two-warpgroup path's outputs bit for bit, slot by
    slot (hidden 1024 takes no 192-column down tiles, so both downs are 128 columns; the default's two-block
    gate_up steps add in the same order as one block a step)."""
    from pallas_kernels.moe.dispatch import expert_tilings
    rng = np.random.default_rng(8)
    N, k, D, I, E = 4096, 8, 1024, 512, 16
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(rng.integers(0, E + 1, N * k), jnp.int32)
    on, off = KernelPolicy(), KernelPolicy(fp8_three_wgs=False)
    assert expert_tilings(N * k, gq, True, 2, True, three_wgs=True)[0].compute_wgs == 3
    got = np.asarray(slots_compiled(x, fe, gq, uq, dq, k, policy=on, scales=(gs, us, ds)), np.float64)
    want = np.asarray(slots_compiled(x, fe, gq, uq, dq, k, policy=off, scales=(gs, us, ds)), np.float64)
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("bm,bn,cluster_n", [(128, 128, 1), (128, 128, 2), (64, 256, 2)])
def test_interleaved_gate_up_compiled_equals_the_two_weight_call(bm, bn, cluster_n):
    """Tiling.interleaved_gate_up compiled on the GPU (prefill 128-row and decode 64 x 256 tiles), 64
    experts with rows routed by block_plan (empty experts, a skewed expert): equal, to bf16 rounding of
    the output, to the two-weight fused gate_up call on the same fp8 experts."""
    from pallas_kernels.moe import grouped_matmul, quantize_rows
    rng = np.random.default_rng(21)
    E, D, I, slots = 64, 1024, 512, (3000 if bm == 128 else 96)
    (gq, gs), (uq, us) = fp8_experts(rng, D, I, E)[:2]
    fe = jnp.asarray(np.where(rng.random(slots) < 0.3, 5, rng.integers(0, E, slots)), jnp.int32)
    _, row_slot, tile_expert = block_plan(fe, E, bm)
    xq, xs = quantize_rows(jnp.asarray(rng.standard_normal((row_slot.shape[0], D)), jnp.bfloat16))
    t = Tiling(block_m=bm, block_n=bn, block_k=128, stages=4, compute_wgs=2, grid_block_n=16 if bm == 128 else 1,
               cluster_n=cluster_n, interleaved_gate_up=True)
    two = Tiling(block_m=bm, block_n=64 if bm == 128 else 128, block_k=128, stages=4, compute_wgs=2,
                 grid_block_n=t.grid_block_n, joint_products=bm == 128)
    got = grouped_matmul(xq, gq, tile_expert, up=uq, tiling=t, x_scale=xs, w_scale=gs, up_scale=us)
    want = grouped_matmul(xq, gq, tile_expert, up=uq, tiling=two, x_scale=xs, w_scale=gs, up_scale=us)
    used = np.repeat(np.asarray(tile_expert) >= 0, bm)
    got, want = (np.asarray(a, np.float64)[used] for a in (got, want))
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.gpu
def test_model_logits_with_the_moe_kernel_are_as_close_to_fp32_as_ragged_dot():
    """A bf16 GLM-5-shaped model (hidden 1024, 64 experts, top-8; the kernel's shapes) on the GPU: its
    teacher-forced logits with the grouped_matmul kernel and with XLA's ragged_dot path, each against
    the same weights run in fp32 (ragged_dot). The two bf16 paths round the experts' intermediate at
    different points and random weights amplify any difference through the indexer's top-k, so they
    are compared by their distance to fp32: the kernel's error at most 1.25x ragged_dot's."""
    from tests.helpers import glm5_kernel_slice
    model, wide, run = glm5_kernel_slice()
    ref = run(wide, moe_kernel=False)
    errs = {name: np.abs(run(model, moe_kernel=on) - ref).max() / np.abs(ref).max()
            for name, on in (("kernel", True), ("ragged_dot", False))}
    print(f"bf16 logits vs fp32: {errs}")
    assert errs["kernel"] <= 1.25 * errs["ragged_dot"]


def test_clusters_apply_only_where_the_column_blocks_pair_up():
    """A tiling of two-program clusters or of column pairs is kept for an even number of column blocks
    and dropped (to single programs, one block per tile) for an odd one, where the kernel would refuse
    it; at GLM-5's widths every default tiling is kept."""
    from pallas_kernels.moe.dispatch import blocked_tilings, expert_tilings, fp8_tilings, paired
    from pallas_kernels.moe.grouped_matmul import shape_error
    t = fp8_tilings(64, 256)[0]                 # decode fp8 gate_up: clusters of two programs
    assert t.cluster_n == 2 and paired(t, 6144) is t and paired(t, 6144 - 128).cluster_n == 1
    x = jax.ShapeDtypeStruct((128, 128), jnp.float8_e4m3fn)
    assert "even number of column blocks" in shape_error(x, jax.ShapeDtypeStruct((1, 384, 128), jnp.float8_e4m3fn),
                                                        t, fp8=True)
    assert shape_error(x, jax.ShapeDtypeStruct((1, 384, 128), jnp.float8_e4m3fn), paired(t, 384), fp8=True) is None
    pairs = dataclasses.replace(fp8_tilings(65536, 256)[1], cluster_n=1, column_pairs=True)   # two column blocks a tile
    assert pairs.column_pairs and paired(pairs, 6144) is pairs and not paired(pairs, 6144 - 128).column_pairs
    assert "column_pairs" in shape_error(x, jax.ShapeDtypeStruct((1, 384, 128), jnp.float8_e4m3fn), pairs, fp8=True)
    assert shape_error(x, jax.ShapeDtypeStruct((1, 384, 128), jnp.float8_e4m3fn), paired(pairs, 384), fp8=True) is None
    joint = fp8_tilings(64, 256)[1]             # decode fp8 down: clustered column pairs, products issued jointly
    assert joint.cluster_n == 2 and joint.column_pairs and joint.joint_products and paired(joint, 6144) is joint
    assert paired(joint, 6144 - 128).cluster_n == 1 and not paired(joint, 6144 - 128).column_pairs
    for slots in (8, 65536):
        for fp8 in (False, True):
            gate = jax.ShapeDtypeStruct((256, 2048, 6144) if fp8 else (256, 6144, 2048), jnp.bfloat16)
            want = (fp8_tilings if fp8 else blocked_tilings)(slots, 256)
            got = expert_tilings(slots, gate, fp8, 2)
            assert [(t.cluster_n, t.column_pairs) for t in got] == [(t.cluster_n, t.column_pairs) for t in want]


def test_decode_tiles_are_walked_row_by_row():
    """The dispatch's decode tilings (64-row tiles) visit the padded buffer's row tiles in order, all of
    a row tile's column blocks before the next row tile (the kernel's planar_snake over its tile loop,
    evaluated here), so the unused row tiles at the buffer's end come after every used one; prefill
    tilings keep their 16-column bands (L2 reuse of x tiles across a band)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe.dispatch import blocked_tilings, expert_tilings, fp8_tilings
    from pallas_kernels.moe.plan import padded_rows
    for fp8 in (False, True):
        gate = jax.ShapeDtypeStruct((256, 2048, 6144) if fp8 else (256, 6144, 2048), jnp.bfloat16)
        for slots in (8, 64, 512):
            for t, N in zip(expert_tilings(slots, gate, fp8, 2), (2048, 6144)):
                assert t.block_m == 64
                cn = t.cluster_n
                grid_m, grid_n = padded_rows(slots, 256, 64) // 64, N // t.block_n // (2 if t.column_pairs else 1) // cn
                walk = jax.vmap(lambda i: plgpu.planar_snake(i, (grid_m, grid_n), 1, max(1, t.grid_block_n // cn)))
                rows, cols = (np.asarray(a) for a in walk(jnp.arange(grid_m * grid_n, dtype=jnp.int32)))
                assert (np.diff(rows) >= 0).all() and (np.bincount(rows) == grid_n).all()
                assert len(set(zip(rows.tolist(), cols.tolist()))) == grid_m * grid_n
        assert expert_tilings(65536, gate, fp8, 2) == (fp8_tilings if fp8 else blocked_tilings)(65536, 256)


def lower_fp8_experts_for_cuda(tokens: int, experts: int, up_t, down_t, D: int = 6144, I: int = 2048, k: int = 8):
    """expert_mlp_blocked_fp8 at these widths with these tilings, traced and lowered for CUDA from
    shapes alone (fp8 experts K-major, block scales)."""
    from pallas_kernels.moe import expert_mlp_blocked_fp8, expert_shape
    sds = jax.ShapeDtypeStruct
    shapes = [expert_shape(experts, K, N, fp8=True) for K, N in ((D, I), (D, I), (I, D))]
    q8 = [sds(s, jnp.float8_e4m3fn) for s in shapes]
    sc = [sds((e, n // 128, kk // 128), jnp.float32) for e, n, kk in shapes]
    f = functools.partial(expert_mlp_blocked_fp8, topk=k, up_tiling=up_t, down_tiling=down_t)
    jax.jit(lambda x, fe, g, u, d, sg, su, sd: f(x, fe, g, u, d, (sg, su, sd))).trace(
        sds((tokens, D), jnp.bfloat16), sds((tokens * k,), jnp.int32), *q8, *sc).lower(lowering_platforms=("cuda",))


def lower_fp8_grouped_for_cuda(t, rows: int, K: int, N: int, E: int, up: bool = False) -> str:
    """grouped_matmul with fp8 tiling t over `rows` rows of K inputs against E K-major experts [E, N, K]
    (up: gate and up, both that shape), traced and lowered for CUDA from shapes alone; its text."""
    from pallas_kernels.moe import grouped_matmul
    sds = jax.ShapeDtypeStruct
    w, ws = sds((E, N, K), jnp.float8_e4m3fn), sds((E, N // 128, K // 128), jnp.float32)

    def f(x, te, xs, w, ws, u=None, us=None):
        return grouped_matmul(x, w, te, tiling=t, x_scale=xs, w_scale=ws, **(dict(up=u, up_scale=us) if up else {}))
    args = (sds((rows, K), jnp.float8_e4m3fn), sds((rows // t.block_m,), jnp.int32), sds((K // 128, rows), jnp.float32),
            w, ws, *((w, ws) if up else ()))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("compute_wgs", [1, 2])
@pytest.mark.parametrize("tokens,experts", [(8192, 16), (8192, 256), (64, 256), (1, 256)])
def test_default_tilings_lower_for_cuda_at_glm5_widths(tokens, experts, compute_wgs):
    """The dispatch's tilings (expert_tilings: decode ones walked row by row) at GLM-5's widths (hidden
    6144, expert width 2048, top-8), prefill and decode row counts, bf16 and fp8, traced and lowered
    for CUDA on this machine from shapes alone: a tiling over the shared memory (Mosaic GPU checks it
    while lowering) fails here instead of on the GPU."""
    from pallas_kernels.moe import expert_mlp_blocked
    from pallas_kernels.moe.dispatch import expert_tilings
    D, I, k = 6144, 2048, 8
    sds = jax.ShapeDtypeStruct
    x, fe = sds((tokens, D), jnp.bfloat16), sds((tokens * k,), jnp.int32)
    plain = [sds((experts, D, I), jnp.bfloat16)] * 2 + [sds((experts, I, D), jnp.bfloat16)]
    up_t, down_t = expert_tilings(tokens * k, plain[0], False, compute_wgs)
    f = functools.partial(expert_mlp_blocked, topk=k, up_tiling=up_t, down_tiling=down_t)
    jax.jit(f).trace(x, fe, *plain).lower(lowering_platforms=("cuda",))
    fp8_gate = sds((experts, I, D), jnp.float8_e4m3fn)
    lower_fp8_experts_for_cuda(tokens, experts, *expert_tilings(tokens * k, fp8_gate, True, compute_wgs), D, I, k)


def test_chained_tiles_policy_and_lowering_at_glm5_widths():
    """KernelPolicy.chained_tiles: the dispatch's warp-specialized tilings chain their tiles where a
    tile's K steps are a multiple of the stages (fp8: 48 and 16 steps over 4 stages; bf16 prefill
    gate_up 96 over 3, not its down's 32 over 3; bf16 decode gate_up keeps one compute warpgroup),
    nothing else changes, and the chained expert calls
    lower for CUDA at GLM-5's widths (prefill 8192 and decode 64 tokens over 256 experts)."""
    from pallas_kernels.moe import expert_mlp_blocked
    from pallas_kernels.moe.dispatch import expert_tilings
    D, I, E, k = 6144, 2048, 256, 8
    sds = jax.ShapeDtypeStruct
    fp8_gate, bf16_gate = sds((E, I, D), jnp.float8_e4m3fn), sds((E, D, I), jnp.bfloat16)
    for tokens, want_fp8, want_bf16 in ((8192, (True, True), (True, False)), (64, (True, True), (False, True))):
        for gate, fp8, want in ((fp8_gate, True, want_fp8), (bf16_gate, False, want_bf16)):
            plain = expert_tilings(tokens * k, gate, fp8, 2)
            chain = expert_tilings(tokens * k, gate, fp8, 2, chain=True)
            assert [t.chained_tiles for t in chain] == list(want), (tokens, fp8)
            assert [dataclasses.replace(t, chained_tiles=False) for t in chain] == list(plain)
            assert not any(t.chained_tiles for t in expert_tilings(tokens * k, gate, fp8, 1, chain=True))
        lower_fp8_experts_for_cuda(tokens, E, *expert_tilings(tokens * k, fp8_gate, True, 2, chain=True), D, I, k)
        up_t, down_t = expert_tilings(tokens * k, bf16_gate, False, 2, chain=True)
        f = functools.partial(expert_mlp_blocked, topk=k, up_tiling=up_t, down_tiling=down_t)
        jax.jit(f).trace(sds((tokens, D), jnp.bfloat16), sds((tokens * k,), jnp.int32), bf16_gate, bf16_gate,
                         sds((E, I, D), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


def test_joint_products_lower_for_cuda_at_glm5_decode_widths_and_are_refused_where_they_would_spill():
    """The fp8 gate_up call with joint_products (both products of a step issued together) at GLM-5's
    decode tiling, lowered for CUDA from shapes; refused where a warpgroup's part of the tile exceeds
    64 x 64 (128-row tiles of 128 columns: two fresh [64, 128] fp32 accumulators beside the two sums
    would not fit its registers) and for bf16 or one compute warpgroup."""
    from pallas_kernels.moe import expert_shape
    from pallas_kernels.moe.dispatch import fp8_tilings
    from pallas_kernels.moe.grouped_matmul import shape_error
    D, I, k, E, tokens = 6144, 2048, 8, 256, 1
    sds = jax.ShapeDtypeStruct
    up_t, down_t = fp8_tilings(tokens * k, E, 2)
    assert up_t.block_m == 64
    lower_fp8_experts_for_cuda(tokens, E, dataclasses.replace(up_t, joint_products=True), down_t, D, I, k)
    x8, w8 = sds((128, D), jnp.float8_e4m3fn), sds(expert_shape(E, D, I, fp8=True), jnp.float8_e4m3fn)
    wide = Tiling(block_m=128, block_n=128, block_k=128, compute_wgs=2, joint_products=True)
    assert "joint_products" in shape_error(x8, w8, wide, fp8=True)
    assert shape_error(x8, w8, dataclasses.replace(wide, block_n=64), fp8=True) is None
    assert "joint_products" in shape_error(x8, w8, dataclasses.replace(wide, block_n=64, compute_wgs=1), fp8=True)
    xb, wb = sds((128, D), jnp.bfloat16), sds((E, D, I), jnp.bfloat16)
    assert "joint_products" in shape_error(xb, wb, Tiling(block_m=128, block_n=64, compute_wgs=2,
                                                           joint_products=True))


def test_unfenced_row_scale_read_is_a_race_the_interpreter_reports():
    """Tiling.fence_row_scales stays on because, without its fence and warpgroup barrier, the compute
    warpgroups' read of a step's row scales is not ordered before the producer's next TMA write into
    that slot (the slot's release is one arrival a warpgroup): the interpreter's race detector reports
    it, and the fenced kernel (the default) passes the same call."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul, quantize_rows
    rng = np.random.default_rng(5)
    E, K, N = 2, 384, 128
    tile_expert = jnp.asarray([0, 1], jnp.int32)
    xq, xs = quantize_rows(jnp.asarray(rng.standard_normal((256, K)), jnp.float32))
    (gq, gs), = fp8_experts(rng, K, N, E)[:1]
    t = Tiling(block_m=128, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=2, compute_wgs=2)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    fenced = np.asarray(grouped_matmul(xq, gq, tile_expert, tiling=t, interpret=interp, x_scale=xs, w_scale=gs))
    assert np.isfinite(fenced).all()
    with pytest.raises(Exception, match="RACE DETECTED"):
        unfenced = dataclasses.replace(t, fence_row_scales=False)
        jax.block_until_ready(grouped_matmul(xq, gq, tile_expert, tiling=unfenced, interpret=interp, x_scale=xs,
                                             w_scale=gs))


def interleaved_case(bm: int, seed: int = 53, E: int = 2, K: int = 640, I: int = 256):
    """A gate_up call for the interleaved kernel's variants' tests: experts with distinct block scales
    per K step, an unused row tile between two used ones; (interleaved tiling, operands)."""
    from pallas_kernels.moe import quantize_rows
    rng = np.random.default_rng(seed)
    tile_expert = jnp.asarray([1, -1, 0], jnp.int32)
    xq, xs = quantize_rows(jnp.asarray(rng.standard_normal((3 * bm, K)), jnp.float32))
    (gq, gs), (uq, us) = fp8_experts(rng, K, I, E)[:2]
    gs = gs * jnp.asarray(rng.uniform(0.25, 4.0, gs.shape), jnp.float32)
    us = us * jnp.asarray(rng.uniform(0.25, 4.0, us.shape), jnp.float32)
    il = Tiling(block_m=bm, block_n=128 if bm == 128 else 256, block_k=128, stages=2, grid_block_n=1, programs=4,
                compute_wgs=2, cluster_n=2, interleaved_gate_up=True)
    return il, (xq, xs, gq, gs, uq, us, tile_expert)


def interleaved_check(got, ref, operands, bm):
    """got (a variant's call) against ref (the interleaved kernel's) and float64."""
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    xq, xs, gq, gs, uq, us, tile_expert = operands
    xd = np.asarray(dequantize_rows(xq, xs), np.float64)
    gd, ud = (np.asarray(plain_f32(w, sc), np.float64) for w, sc in ((gq, gs), (uq, us)))
    for i, e in enumerate(np.asarray(tile_expert)):
        if e < 0:
            continue
        rows = slice(i * bm, (i + 1) * bm)
        a = xd[rows] @ gd[e]
        want = a / (1 + np.exp(-a)) * (xd[rows] @ ud[e])
        assert np.abs(got[rows] - want).max() <= 8e-3 * np.abs(want).max()
        np.testing.assert_allclose(got[rows], ref[rows], rtol=0, atol=1e-2 * np.abs(want).max() / 256)


def variant_fn(t, interpret=False, one_weight=False):
    """The gate_up call under tiling t as a function of interleaved_case's operands (interpret: in the
    interpreter with these params; one_weight: gate's weight alone, the down call's shape)."""
    from pallas_kernels.moe import grouped_matmul

    def f(xq, xs, gq, gs, uq, us, tile_expert):
        up = {} if one_weight else dict(up=uq, up_scale=us)
        return grouped_matmul(xq, gq, tile_expert, tiling=t, x_scale=xs, w_scale=gs, interpret=interpret, **up)
    return f


def variant_call(operands, interpret=False, one_weight=False):
    """A gate_up call on interleaved_case's operands under a tiling, as float64 (variant_fn; without
    interpret, compiled)."""
    def call(t):
        f = variant_fn(t, interpret, one_weight)
        return np.asarray((f if interpret else jax.jit(f))(*operands), np.float64)
    return call


@pytest.mark.parametrize("bm", [128, 64])
def test_two_block_steps_interpret_bit_equal_one_block_steps(bm):
    """Tiling.step_blocks 2 (two K blocks a pipeline step, the first's product added while the second's
    runs) makes the same additions in the same order as one block a step: the interpreter (races
    detected) gives bit-equal outputs, gate_up interleaved and one weight (down's shape), over 6 K steps
    with distinct block scales, the unused tile unwritten; K steps not a multiple of the blocks, 3 blocks,
    joint products, and gate and up not interleaved are refused; chained tiles bit-equal for one weight,
    refused for interleaved gate_up. (The unscaled probe's two-block steps: the compiled test and the bench's
    err.)"""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul
    from pallas_kernels.moe.grouped_matmul import shape_error
    il, operands = interleaved_case(bm, K=768)
    call = variant_call(operands, plgpu.InterpretGPUParams(detect_races=True))
    ref = call(il)
    got = call(dataclasses.replace(il, step_blocks=2))
    assert len(list(used_tiles(operands[-1], bm, got, ref))) == 2
    np.testing.assert_array_equal(got, ref)
    interleaved_check(got, ref, operands, bm)
    # one weight (the down call's shape): each warpgroup's 64 x 128 part, the same bit-equality
    xq, xs, gq, gs, _, _, tile_expert = operands
    one = dataclasses.replace(il, interleaved_gate_up=False, block_n=128)
    down = variant_call(operands, plgpu.InterpretGPUParams(detect_races=True), one_weight=True)
    got, ref = down(dataclasses.replace(one, step_blocks=2)), down(one)
    assert len(list(used_tiles(tile_expert, bm, got, ref))) == 2
    np.testing.assert_array_equal(got, ref)
    # chained (a program's tiles as one pipeline): one weight in two-block steps takes it; interleaved
    # gate_up in two-block steps is refused (chained, it never finished in the interpreter)
    np.testing.assert_array_equal(down(dataclasses.replace(one, step_blocks=2, stages=3, chained_tiles=True)), ref)
    chained_k2 = dataclasses.replace(il, step_blocks=2, stages=3, chained_tiles=True)
    with pytest.raises(ValueError, match="chained_tiles"):
        grouped_matmul(xq, gq, tile_expert, up=operands[4], tiling=chained_k2, x_scale=xs, w_scale=gs,
                       up_scale=operands[5], interpret=True)
    with pytest.raises(ValueError, match="interleaved"):
        grouped_matmul(xq, gq, tile_expert, up=operands[4], tiling=dataclasses.replace(one, step_blocks=2),
                       x_scale=xs, w_scale=gs, up_scale=operands[5], interpret=True)
    sds = jax.ShapeDtypeStruct
    w = sds(operands[2].shape, jnp.float8_e4m3fn)
    for K, blocks, bad in ((640, 2, {}), (768, 3, {}),
                           (768, 2, dict(interleaved_gate_up=False, block_n=64, cluster_n=1, joint_products=True))):
        t = dataclasses.replace(il, step_blocks=blocks, **bad)
        assert "step_blocks" in shape_error(sds((3 * bm, K), jnp.float8_e4m3fn), sds(w.shape[:2] + (K,), w.dtype), t,
                                            fp8=True)


def stagger_cases(K: int):
    """(name, plain tiling, its staggered twin, rows a tile, operands as interleaved_case gives them, one
    weight) for stagger_warpgroups, as the defaults run: interleaved gate_up in two warpgroups (two K blocks
    a step) and in three, and one weight (down's shape) in three, chained, over several tiles a program."""
    _, operands = interleaved_case(128, K=K)
    te192, _, ops192 = three_wg_case(K=K)
    two = Tiling(block_m=128, block_n=128, block_k=128, stages=2, grid_block_n=1, programs=2, compute_wgs=2,
                 cluster_n=2, interleaved_gate_up=True)
    three = dataclasses.replace(two, block_m=192, compute_wgs=3, programs=4)
    down3 = dataclasses.replace(three, interleaved_gate_up=False, chained_tiles=True)
    for name, t, bm, ops, one in (("two_k2", dataclasses.replace(two, step_blocks=2), 128, operands, False),
                                  ("three", three, 192, (*ops192, te192), False),
                                  ("three_down_chained", down3, 192, (*ops192, te192), True)):
        yield name, t, dataclasses.replace(t, stagger_warpgroups=True), bm, ops, one


def test_staggered_warpgroups_interpret_bit_equal():
    """Tiling.stagger_warpgroups (compute warpgroup w issues a tile's first products after w - 1's are done)
    orders only when each warpgroup starts: in the interpreter (races detected) every case gives the
    unstaggered tiling's outputs bit for bit, with unused tiles between used ones and several tiles a
    program (a wait without its arrival would hang here); the kernel holds the extra barrier waits; the
    unscaled probe and bf16 are refused."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe.grouped_matmul import shape_error
    interp = plgpu.InterpretGPUParams(detect_races=True)
    for name, plain, staggered, bm, ops, one in stagger_cases(K=512):
        call = variant_call(ops, interp, one_weight=one)
        ref, got = call(plain), call(staggered)
        te = ops[-1]
        assert len(list(used_tiles(te, bm, got, ref))) == int((np.asarray(te) >= 0).sum()), name
        np.testing.assert_array_equal(got, ref, err_msg=name)
        waits = [str(jax.make_jaxpr(variant_fn(t, interp, one))(*ops)).count("barrier_wait")
                 for t in (plain, staggered)]
        bodies = 2 if plain.chained_tiles else 1      # chained: the one-tile and the chained pipeline
        assert waits[1] == waits[0] + bodies * (plain.compute_wgs - 1), (name, waits)
    sds = jax.ShapeDtypeStruct
    two = next(stagger_cases(K=512))[2]
    x, w = sds((384, 768), jnp.float8_e4m3fn), sds((2, 256, 768), jnp.float8_e4m3fn)
    assert "stagger_warpgroups" in shape_error(x, w, dataclasses.replace(two, unscaled_probe=True), fp8=True)
    assert "stagger_warpgroups" in shape_error(sds((384, 768), jnp.bfloat16), sds((2, 768, 256), jnp.bfloat16),
                                               dataclasses.replace(two, interleaved_gate_up=False))


def test_staggered_warpgroups_lower_for_cuda_at_glm5_widths():
    """The defaults' expert tilings with stagger_warpgroups (three warpgroups: gate_up interleaved, down
    chained; two: interleaved gate_up in two-block steps) lower for CUDA at GLM-5's widths on this machine."""
    from pallas_kernels.moe.dispatch import three_wg_tilings
    from pallas_kernels.moe.grouped_matmul import with_step_blocks
    up3, down3 = three_wg_tilings()
    up2 = with_step_blocks(Tiling(block_m=128, block_n=128, block_k=128, stages=4, compute_wgs=2, grid_block_n=16,
                                  cluster_n=2, interleaved_gate_up=True), 6144, 2)
    assert up2.step_blocks == 2
    for t, rows, K, N, up in ((up3, 192 * 8, 6144, 2048, True), (down3, 192 * 8, 2048, 6144, False),
                              (up2, 128 * 8, 6144, 2048, True)):
        lower_fp8_grouped_for_cuda(dataclasses.replace(t, stagger_warpgroups=True), rows, K, N, 4, up=up)


@pytest.mark.gpu
def test_staggered_warpgroups_compiled_bit_equal():
    """stagger_warpgroups compiled on the GPU: every stagger_cases case bit-equal to its unstaggered tiling
    compiled (and no hang)."""
    for name, plain, staggered, _, ops, one in stagger_cases(K=768):
        call = variant_call(ops, one_weight=one)
        np.testing.assert_array_equal(call(staggered), call(plain), err_msg=name)


def wide_tile_case(K: int = 384):
    """One weight of N = 384 (three 128-wide scale blocks, each K step's scale its own) for 192-column
    tiles: tile 0 straddles blocks 0 and 1 at column 128, tile 1 blocks 1 and 2 at column 256 (its
    first slice in block 1); (the 128-column tiling, the 192-column one, operands)."""
    il, operands = interleaved_case(128, K=K, I=384)
    one = dataclasses.replace(il, interleaved_gate_up=False, block_n=128, cluster_n=1)
    return one, dataclasses.replace(one, block_n=192, cluster_n=2), operands


def test_wide_tiles_interpret_bit_equal_128_column_tiles():
    """192-column fp8 tiles (scale_slices: each warpgroup promotes its product's 64-column slices with
    their own weight block scales) give the 128-column tiles' outputs bit for bit in the interpreter
    (races detected), in clusters of two and without, scaled and as the unscaled probe, and float64's
    within bf16 rounding; gate and up, two-block steps, 64-row tiles and joint products are refused with
    them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    from pallas_kernels.moe.grouped_matmul import scale_slices, shape_error
    one, wide, operands = wide_tile_case()
    assert scale_slices(one) == 1 and scale_slices(wide) == 3
    down = variant_call(operands, plgpu.InterpretGPUParams(detect_races=True), one_weight=True)
    ref = down(one)
    for t in (wide, dataclasses.replace(wide, cluster_n=1)):
        got = down(t)
        assert len(list(used_tiles(operands[-1], 128, got, ref))) == 2
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(down(dataclasses.replace(wide, unscaled_probe=True)),
                                  down(dataclasses.replace(one, unscaled_probe=True)))
    xq, xs, gq, gs, uq, us, tile_expert = operands
    xd, gd = np.asarray(dequantize_rows(xq, xs), np.float64), np.asarray(plain_f32(gq, gs), np.float64)
    for rows, e in used_tiles(tile_expert, 128, ref):
        a = xd[rows] @ gd[e]
        assert np.abs(ref[rows] - a).max() <= 8e-3 * np.abs(a).max()
    with pytest.raises(ValueError, match="straddle"):
        grouped_matmul(xq, gq, tile_expert, up=uq, tiling=wide, x_scale=xs, w_scale=gs, up_scale=us, interpret=True)
    sds = jax.ShapeDtypeStruct
    for bad in (dict(step_blocks=2), dict(block_m=64), dict(joint_products=True)):
        t = dataclasses.replace(wide, **bad)
        assert scale_slices(t) == 0
        assert shape_error(sds((256, 384), jnp.float8_e4m3fn), sds((2, 384, 384), jnp.float8_e4m3fn), t, fp8=True)


@pytest.mark.parametrize("variant", [{}, dict(unscaled_probe=True), dict(chained_tiles=True)])
def test_wide_tiles_lower_for_cuda_at_glm5_down_widths(variant):
    """The 192-column down tiles (clusters of two, four stages) and their variants lowered for CUDA here
    at GLM-5's down widths (8192 tokens x top-8 over 16 experts: K 2048, N 6144): Mosaic GPU's wgmma
    (m64n192), layout and shared-memory checks run on this machine."""
    from pallas_kernels.moe.grouped_matmul import ws_fp8_smem_bytes, SMEM_BYTES
    E = 16
    t = Tiling(block_m=128, block_n=192, block_k=128, stages=4, compute_wgs=2, grid_block_n=16, cluster_n=2, **variant)
    assert ws_fp8_smem_bytes(t) <= SMEM_BYTES
    assert "mosaic_gpu" in lower_fp8_grouped_for_cuda(t, 8192 * 8 + E * 128, K=2048, N=6144, E=E)


def test_wide_down_tiles_policy():
    """KernelPolicy.fp8_wide_tiles gives the prefill down call 192-column tiles in clusters of two,
    chained, one K block a step (two-block steps leave it alone), the gate_up call and the
    decode tiles unchanged; a hidden size not a multiple of 192 keeps 128."""
    from pallas_kernels.moe.dispatch import expert_tilings, fp8_shape_error
    from pallas_kernels.policy import KernelPolicy
    sds = jax.ShapeDtypeStruct
    E, D, I = 16, 6144, 2048
    gate, down = sds((E, I, D), jnp.float8_e4m3fn), sds((E, D, I), jnp.float8_e4m3fn)
    for slots in (8192 * 8, 8):          # prefill; one token (64-row tiles)
        base = expert_tilings(slots, gate, True, 2, interleaved=True, step_blocks=2)
        up_t, down_t = expert_tilings(slots, gate, True, 2, interleaved=True, step_blocks=2, wide_down=True)
        assert up_t.block_m == base[0].block_m
        if slots == 8:
            assert down_t == base[1]
            continue
        assert (down_t.block_n, down_t.cluster_n, down_t.step_blocks) == (192, 2, 1)
        assert down_t == dataclasses.replace(base[1], block_n=192, chained_tiles=True)
        assert fp8_shape_error(sds((8192, D), jnp.bfloat16), gate, down, slots, 2, interleaved=True, step_blocks=2,
                               wide_down=True) is None
    odd = sds((E, I, 6016), jnp.float8_e4m3fn)       # 47 x 128: not a multiple of 192
    assert expert_tilings(8192 * 8, odd, True, 2, wide_down=True)[1].block_n == 128
    assert KernelPolicy().fp8_wide_tiles and not KernelPolicy.parse("fp8_wide_tiles=false").fp8_wide_tiles


@pytest.mark.gpu
def test_wide_tiles_compiled_bit_equal_128_column_tiles():
    """The 192-column fp8 tiles compiled on the GPU: bit-equal to the compiled 128-column tiles, scaled
    (clusters of two and without, chained and not) and as the unscaled probe."""
    one, wide, operands = wide_tile_case(K=768)
    down = variant_call(operands, one_weight=True)
    ref = down(one)
    for t in (wide, dataclasses.replace(wide, cluster_n=1), dataclasses.replace(wide, chained_tiles=True),
              dataclasses.replace(wide, cluster_n=1, chained_tiles=True)):
        np.testing.assert_array_equal(down(t), ref)
    np.testing.assert_array_equal(down(dataclasses.replace(wide, unscaled_probe=True)),
                                  down(dataclasses.replace(one, unscaled_probe=True)))


def three_wg_case(K: int = 512):
    """Operands for 192-row tiles in three compute warpgroups laid out so that 128-row tiles cover the same
    rows: 1152 rows, expert 1's then an unused stretch then expert 0's, 384 rows each (192-row tiles
    [1, 1, -1, -1, 0, 0], 128-row ones [1, 1, 1, -1, -1, -1, 0, 0, 0]); (the 192-row tiles' expert, the
    128-row ones', interleaved_case's operands with x over the 1152 rows)."""
    from pallas_kernels.moe import quantize_rows
    _, (_, _, gq, gs, uq, us, _) = interleaved_case(128, K=K)
    xq, xs = quantize_rows(jnp.asarray(np.random.default_rng(71).standard_normal((1152, K)), jnp.float32))
    te192, te128 = (jnp.asarray(np.repeat([1, -1, 0], n), jnp.int32) for n in (2, 3))
    return te192, te128, (xq, xs, gq, gs, uq, us)


@pytest.mark.parametrize("cluster_n", [1, 2])
def test_three_compute_warpgroups_interpret_bit_equal_two(cluster_n):
    """192-row tiles in three compute warpgroups (64 rows each) give, in the interpreter (races detected),
    the two-warpgroup kernel's outputs on 128-row tiles over the same rows bit for bit: interleaved gate_up
    (and float64's within bf16 rounding) and one weight (down's shape), the unused rows unwritten;
    192 rows in two warpgroups and 128 in three are refused."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import grouped_matmul
    from pallas_kernels.moe.grouped_matmul import shape_error
    te192, te128, (xq, xs, gq, gs, uq, us) = three_wg_case()
    interp = plgpu.InterpretGPUParams(detect_races=True)
    two = Tiling(block_m=128, block_n=128, block_k=128, stages=2, grid_block_n=1, programs=4, compute_wgs=2,
                 cluster_n=cluster_n, interleaved_gate_up=True)
    three = dataclasses.replace(two, block_m=192, compute_wgs=3)

    def call(t, te, up=True):
        extra = dict(up=uq, up_scale=us) if up else {}
        return np.asarray(grouped_matmul(xq, gq, te, tiling=t, x_scale=xs, w_scale=gs, interpret=interp, **extra),
                          np.float64)
    ref, got = call(two, te128), call(three, te192)
    assert len(list(used_tiles(te192, 192, got, ref))) == 4
    np.testing.assert_array_equal(got, ref)
    interleaved_check(got, ref, (xq, xs, gq, gs, uq, us, te192), 192)
    one2, one3 = (dataclasses.replace(t, interleaved_gate_up=False) for t in (two, three))
    np.testing.assert_array_equal(call(one3, te192, up=False), call(one2, te128, up=False))
    sds = jax.ShapeDtypeStruct
    x, w = sds((1152, 512), jnp.float8_e4m3fn), sds(gq.shape, jnp.float8_e4m3fn)
    assert "split 128 rows" in shape_error(x, w, dataclasses.replace(two, block_m=192), fp8=True)
    assert "split 192 rows" in shape_error(x, w, dataclasses.replace(three, block_m=128), fp8=True)


@pytest.mark.parametrize("call", ["gate_up", "down"])
def test_three_compute_warpgroups_lower_for_cuda_at_glm5_widths(call):
    """192-row tiles in three compute warpgroups at GLM-5's widths (8192 tokens x top-8 over 16 experts):
    interleaved gate_up (K 6144, N 2048) and down (K 2048, N 6144), 128 columns, clusters of two, four
    stages, lowered for CUDA here within the shared memory."""
    from pallas_kernels.moe.grouped_matmul import SMEM_BYTES, ws_fp8_smem_bytes
    E = 16
    t = Tiling(block_m=192, block_n=128, block_k=128, stages=4, compute_wgs=3, grid_block_n=16, cluster_n=2,
               interleaved_gate_up=call == "gate_up")
    assert ws_fp8_smem_bytes(t) <= SMEM_BYTES
    K, N = (6144, 2048) if call == "gate_up" else (2048, 6144)
    assert "mosaic_gpu" in lower_fp8_grouped_for_cuda(t, 192 * 352, K=K, N=N, E=E, up=call == "gate_up")


def test_three_wgs_policy():
    """KernelPolicy.fp8_three_wgs gives prefill calls with at least THREE_WG_ROWS rows an expert (8192 tokens
    x top-8 over 16 and 64 experts) 192-row tiles in three compute warpgroups for both calls (gate_up
    interleaved, down chained, clusters of two) and leaves 256 experts (256 rows each), decode and the policy
    without it as they were."""
    from pallas_kernels.moe.dispatch import THREE_WG_ROWS, expert_tilings, fp8_shape_error, three_wg_tilings
    from pallas_kernels.policy import KernelPolicy
    sds = jax.ShapeDtypeStruct
    D, I = 6144, 2048
    kw = dict(interleaved=True, step_blocks=2, wide_down=True)
    for E in (16, 64, 256):
        gate, down = sds((E, I, D), jnp.float8_e4m3fn), sds((E, D, I), jnp.float8_e4m3fn)
        for slots in (8192 * 8, 64 * 8):
            base = expert_tilings(slots, gate, True, 2, **kw)
            got = expert_tilings(slots, gate, True, 2, three_wgs=True, **kw)
            if slots >= THREE_WG_ROWS * E:
                assert got == three_wg_tilings() and got[0].compute_wgs == got[1].compute_wgs == 3
                assert fp8_shape_error(sds((8192, D), jnp.bfloat16), gate, down, slots, 2, interleaved=True,
                                       step_blocks=2, wide_down=True, three_wgs=True) is None
            else:
                assert got == base
        assert (E == 256) == (8192 * 8 < THREE_WG_ROWS * E)
    assert KernelPolicy().fp8_three_wgs and not KernelPolicy.parse("fp8_three_wgs=false").fp8_three_wgs


def test_expert_mlp_fp8_three_wgs_interpret_bit_equal_two():
    """The fp8 expert path (interpreter, races detected) with both calls in 192-row tiles of three compute
    warpgroups gives the two-warpgroup 128-row path's outputs bit for bit, slot by slot (another row
    layout: block_plan at 192 rows), dummies zero."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import expert_mlp_blocked_fp8
    rng = np.random.default_rng(9)
    N, k, D, I, E = 400, 2, 384, 256, 3      # ~266 rows an expert: two 192-row tiles, three 128-row
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(routings(rng, N * k, E).__next__(), jnp.int32)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    two = Tiling(block_m=128, block_n=128, block_k=128, stages=2, grid_block_n=1, programs=4, compute_wgs=2)
    three = dataclasses.replace(two, block_m=192, compute_wgs=3)

    def run(t):
        il = dataclasses.replace(t, interleaved_gate_up=True)
        return np.asarray(expert_mlp_blocked_fp8(x, fe, gq, uq, dq, (gs, us, ds), k, up_tiling=il, down_tiling=t,
                                                 interpret=interp).slots(), np.float64)
    got, ref = run(three), run(two)
    assert (got[np.asarray(fe) == E] == 0).all() and np.abs(ref).max() > 0
    np.testing.assert_array_equal(got, ref)


@pytest.mark.gpu
def test_three_compute_warpgroups_compiled_bit_equal_two():
    """192-row tiles in three compute warpgroups compiled on the GPU: bit-equal to the compiled
    two-warpgroup kernel on 128-row tiles over the same rows, interleaved gate_up (clustered and not,
    scaled and unscaled) and one weight."""
    from pallas_kernels.moe import grouped_matmul
    te192, te128, (xq, xs, gq, gs, uq, us) = three_wg_case(K=768)

    def call(t, te, up=True):
        extra = dict(up=uq, up_scale=us) if up else {}
        f = jax.jit(lambda: grouped_matmul(xq, gq, te, tiling=t, x_scale=xs, w_scale=gs, **extra))
        return np.asarray(f(), np.float64)[np.repeat(np.asarray(te128) >= 0, 128)]
    for c in (1, 2):
        for probe in (False, True):
            two = Tiling(block_m=128, block_n=128, block_k=128, stages=4, grid_block_n=1, programs=4, compute_wgs=2,
                         cluster_n=c, interleaved_gate_up=True, unscaled_probe=probe)
            three = dataclasses.replace(two, block_m=192, compute_wgs=3)
            np.testing.assert_array_equal(call(three, te192), call(two, te128))
            one2, one3 = (dataclasses.replace(t, interleaved_gate_up=False) for t in (two, three))
            np.testing.assert_array_equal(call(one3, te192, up=False), call(one2, te128, up=False))


@pytest.mark.gpu
@pytest.mark.parametrize("bm", [128, 64])
def test_two_block_steps_compiled_bit_equal_one_block_steps(bm):
    """step_blocks 2 compiled on the GPU against the compiled one-block kernel (bit-equal: the same
    products and additions in the same order) and float64: interleaved gate_up scaled and the unscaled
    probe, and one weight (down's shape)."""
    il, operands = interleaved_case(bm, K=768)
    call = variant_call(operands)
    for base in (il, dataclasses.replace(il, unscaled_probe=True)):
        np.testing.assert_array_equal(call(dataclasses.replace(base, step_blocks=2)), call(base))
    interleaved_check(call(dataclasses.replace(il, step_blocks=2)), call(il), operands, bm)
    one = dataclasses.replace(il, interleaved_gate_up=False, block_n=128)
    down = variant_call(operands, one_weight=True)
    np.testing.assert_array_equal(down(dataclasses.replace(one, step_blocks=2)), down(one))


def test_step_blocks_policy_picks_the_tilings_that_take_it():
    """KernelPolicy.fp8_step_blocks 2 (expert_tilings' step_blocks): the interleaved gate_up call at
    prefill (128-row tiles, 3 stages) and decode (64 x 256 tiles, 2 stages) take two K blocks a step; the
    clustered prefill down call (three stages do not fit), decode's joint column-pair down, the joint
    gate_up (interleaving off) and an odd number of K blocks keep one; each picked tiling passes shape_error."""
    from pallas_kernels.moe.dispatch import expert_tilings
    from pallas_kernels.moe.grouped_matmul import shape_error
    sds = jax.ShapeDtypeStruct
    D, I = 6144, 2048
    for E, rows, stages in ((16, 8192 * 8, 3), (256, 64 * 8, 2)):
        gate = sds((E, I, D), jnp.float8_e4m3fn)
        one = expert_tilings(rows, gate, True, 2, interleaved=True)
        up_t, down_t = expert_tilings(rows, gate, True, 2, interleaved=True, step_blocks=2)
        assert (up_t.step_blocks, up_t.stages) == (2, stages)
        assert dataclasses.replace(up_t, step_blocks=1, stages=one[0].stages) == one[0]
        P = padded_rows(rows, E, up_t.block_m)
        assert shape_error(sds((P, D), jnp.float8_e4m3fn), gate, up_t, fp8=True) is None
        assert down_t.step_blocks == 1
        assert shape_error(sds((P, I), jnp.float8_e4m3fn), sds((E, D, I), jnp.float8_e4m3fn), down_t, fp8=True) is None
    E, gate = 16, sds((16, I, D), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="step_blocks 3"):
        expert_tilings(8192 * 8, gate, True, 2, interleaved=True, step_blocks=3)
    with pytest.raises(ValueError, match="fp8_step_blocks takes 1 or 2"):
        KernelPolicy.parse("fp8_step_blocks=3")
    assert expert_tilings(8192 * 8, gate, True, 2, step_blocks=2)[0].step_blocks == 1          # joint gate_up
    up_t, down_t = expert_tilings(8192 * 8, gate, True, 2, interleaved=True, chain=True, step_blocks=2)
    assert (up_t.step_blocks, up_t.chained_tiles, down_t.step_blocks, down_t.chained_tiles) == (2, False, 1, True)
    odd = sds((E, I, 640), jnp.float8_e4m3fn)
    assert expert_tilings(8192 * 8, odd, True, 2, interleaved=True, step_blocks=2)[0].step_blocks == 1


@pytest.mark.parametrize("bm", [128, 64])
def test_interleaved_two_block_steps_lower_for_cuda_at_glm5_widths(bm):
    """The interleaved gate_up kernel in two-block steps (in with_step_blocks' stages) lowered for CUDA on
    this machine at GLM-5's gate_up widths (8192 tokens x top-8 over 16 experts), the dispatch's interleaved
    tiles: Mosaic GPU's layout, wgmma and shared-memory checks run here."""
    from pallas_kernels.moe.grouped_matmul import with_step_blocks
    E, D, I = 16, 6144, 2048
    t = Tiling(block_m=bm, block_n=128 if bm == 128 else 256, block_k=128, stages=4, compute_wgs=2,
               grid_block_n=16 if bm == 128 else 1, cluster_n=2, interleaved_gate_up=True)
    t = with_step_blocks(t, D, 2)
    assert t.step_blocks == 2
    assert "mosaic_gpu" in lower_fp8_grouped_for_cuda(t, 8192 * 8 + E * bm, D, I, E, up=True)


def test_step_block_stages_fit_shared_memory_as_mosaic_counts_it():
    """ws_fp8_smem_bytes against Mosaic GPU's own check, lowering for CUDA here at the edge the H100
    found (8192 x 16, down): two blocks a step in three stages with the row scales in shared memory do
    not fit (233520 bytes), and two lower but lost on the H100, so with_step_blocks leaves that tile one
    block a step. The interleaved gate_up tile (half the output tile) fits three."""
    from pallas_kernels.moe.grouped_matmul import SMEM_BYTES, with_step_blocks, ws_fp8_smem_bytes
    E, D, I = 16, 6144, 2048
    down = Tiling(block_m=128, block_n=128, block_k=128, stages=4, compute_wgs=2, grid_block_n=16, cluster_n=2)
    il = dataclasses.replace(down, interleaved_gate_up=True)
    lower = functools.partial(lower_fp8_grouped_for_cuda, rows=8192 * 8 + E * 128, K=I, N=D, E=E)
    over = dataclasses.replace(down, step_blocks=2, stages=3)
    assert ws_fp8_smem_bytes(over) > SMEM_BYTES
    with pytest.raises(Exception, match="shared memory"):
        lower(over)
    assert with_step_blocks(down, I, 2) == down and "mosaic_gpu" in lower(dataclasses.replace(over, stages=2))
    assert with_step_blocks(il, D, 2).stages == 3


@pytest.mark.parametrize("tokens,experts", [(8192, 16), (8192, 256), (64, 256), (1, 256)])
def test_device_plan_k2_policies_lower_for_cuda_at_glm5_widths(tokens, experts):
    """The tilings the policies device_plan's k2 part runs end to end give the fp8 experts and GLM-5's
    fp8 dense linears (fp8_step_blocks 2), at prefill and decode row counts, lowered for CUDA on this
    machine: a shared-memory or layout failure shows here, not in the GPU call."""
    from pallas_kernels.fp8_linear import GLM5_LINEARS, fp8_linear
    from pallas_kernels.moe.dispatch import expert_tilings, fp8_tiling_options
    from pallas_kernels.policy import KernelPolicy
    D, I, k = 6144, 2048, 8
    sds = jax.ShapeDtypeStruct
    gate = sds((experts, I, D), jnp.float8_e4m3fn)
    p = KernelPolicy.parse("fp8_step_blocks=2,fp8_three_wgs=false")     # two-block steps: two compute warpgroups
    up_t, down_t = expert_tilings(tokens * k, gate, True, **fp8_tiling_options(p))
    assert up_t.step_blocks > 1
    lower_fp8_experts_for_cuda(tokens, experts, up_t, down_t, D, I, k)
    if (tokens, experts) not in ((8192, 16), (1, 256)):   # the dense linears at prefill and decode rows
        return
    for name, (K, N) in GLM5_LINEARS.items():
        f = functools.partial(fp8_linear, step_blocks=p.fp8_step_blocks)
        jax.jit(f).trace(sds((tokens, K), jnp.bfloat16), sds((N, K), jnp.float8_e4m3fn),
                         sds((-(-N // 128), K // 128), jnp.float32)).lower(lowering_platforms=("cuda",))
