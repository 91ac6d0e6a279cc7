"""The routed experts' grouped matmuls (pallas_kernels/moe): the block plan's layout, the Mosaic GPU
kernel in Mosaic GPU's interpreter against XLA's ragged_dot composition, and the same compiled on the
GPU (marked gpu)."""

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


@pytest.mark.parametrize("block_m", [4, 64])
def test_block_plan_gives_each_expert_whole_tiles(block_m):
    rng = np.random.default_rng(1)
    S, E = 150, 6
    for fe in routings(rng, S, E):
        slot_row, row_slot, tile_expert = map(np.asarray, block_plan(jnp.asarray(fe, jnp.int32), E, block_m))
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
                Tiling(block_m=64, block_n=128, stages=3, grid_block_n=2, programs=5)),)
    for fe in routings(rng, N * k, E):
        fe = jnp.asarray(fe, jnp.int32)
        ref = slot_reference(x, np.asarray(fe), gate, up, down, k)
        ragged = np.asarray(expert_mlp_ragged(x, fe, gate, up, down, k), np.float64)
        for up_t, down_t in tilings:
            got = np.asarray(expert_mlp_blocked(x, fe, gate, up, down, k, up_tiling=up_t, down_tiling=down_t,
                                                interpret=interp), np.float64)
            assert np.isfinite(got).all()
            dummy = np.asarray(fe) == E
            assert (got[dummy] == 0).all()
            scale = np.abs(ref).max()
            assert np.abs(got - ref).max() <= 1e-2 * scale           # bf16 output rounding
            assert np.abs(got - ragged).max() <= 2e-2 * scale


def fp8_experts(rng, D, I, E):
    """Random experts as fp8 blocks (models.fp8.quantize), stored [E, K, N] as the model holds them."""
    from models.fp8 import quantize
    return [tuple(map(jnp.asarray, quantize(rng.standard_normal((E, K, N)) * K ** -0.5)))
            for K, N in ((D, I), (D, I), (I, D))]


def test_fp8_grouped_matmul_interpret_equals_block_scaled_reference():
    """The fp8 kernel (interpreter, race detector on) against float64 products of the dequantized
    operands: row scales per 128 columns, weight scales per 128 x 128 block (distinct per block:
    K = N = 256), plain and gate/up fused; an unused tile stays unwritten (NaN from the interpreter)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import dequantize_blocks, grouped_matmul, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    rng = np.random.default_rng(4)
    E, K, N, bm = 3, 256, 256, 64
    tile_expert = jnp.asarray([0, 2, -1, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((bm * 4, K)) * np.repeat(rng.uniform(0.1, 10, (1, 2)), 128, axis=1),
                    jnp.float32)   # the two column groups at different scales
    xq, xs = quantize_rows(x)
    (gq, gs), (uq, us) = [tuple(map(jnp.asarray, w)) for w in fp8_experts(rng, K, N, E)[:2]]
    k_major = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    xd = np.asarray(dequantize_rows(xq, xs), np.float64)
    gd, ud = (np.asarray(dequantize_blocks(w, sc, jnp.float32), np.float64) for w, sc in ((gq, gs), (uq, us)))
    t = Tiling(block_m=bm, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=3)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    plain = np.asarray(grouped_matmul(xq, k_major(gq), tile_expert, tiling=t, interpret=interp, x_scale=xs,
                                      w_scale=k_major(gs)), np.float64)
    fused = np.asarray(grouped_matmul(xq, k_major(gq), tile_expert, up=k_major(uq), tiling=t, interpret=interp,
                                      x_scale=xs, w_scale=k_major(gs), up_scale=k_major(us)), np.float64)
    for i, e in enumerate(np.asarray(tile_expert)):
        rows = slice(i * bm, (i + 1) * bm)
        if e < 0:
            assert np.isnan(plain[rows]).all() and np.isnan(fused[rows]).all()
            continue
        a = xd[rows] @ gd[e]
        want = a / (1 + np.exp(-a)) * (xd[rows] @ ud[e])
        assert np.abs(plain[rows] - a).max() <= 8e-3 * np.abs(a).max()            # bf16 output rounding
        assert np.abs(fused[rows] - want).max() <= 8e-3 * np.abs(want).max()
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        grouped_matmul(xq, k_major(gq), tile_expert, tiling=t, interpret=interp, x_scale=xs[:1], w_scale=k_major(gs))


def test_expert_mlp_fp8_interpret_equals_its_quantized_reference():
    """The fp8 path of the dispatch (interpreter) against the same arithmetic in float64 (rows quantized
    per 128 columns before each matmul, dequantized weights), and within fp8's error of the bf16 path
    on the dequantized weights (what the dispatch runs when the fp8 kernel does not)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe import dequantize_blocks, expert_mlp_blocked_fp8, quantize_rows
    from pallas_kernels.moe.fp8_rows import dequantize_rows
    rng = np.random.default_rng(5)
    N, k, D, I, E = 40, 2, 128, 128, 4
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    (gq, gs), (uq, us), (dq, ds) = fp8_experts(rng, D, I, E)
    fe = jnp.asarray(routings(rng, N * k, E).__next__(), jnp.int32)      # random, with dummies
    t = Tiling(block_m=64, block_n=64, block_k=128, stages=2, grid_block_n=1, programs=3)
    got = np.asarray(expert_mlp_blocked_fp8(x, fe, gq, uq, dq, (gs, us, ds), k, up_tiling=t, down_tiling=t,
                                            interpret=plgpu.InterpretGPUParams(detect_races=True)), np.float64)
    g, u, d = (np.asarray(dequantize_blocks(w, sc, jnp.float32), np.float64) for w, sc in ((gq, gs), (uq, us), (dq, ds)))
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
    bf16 = np.asarray(expert_mlp(x, fe, gq, uq, dq, k, scales=(gs, us, ds)), np.float64)   # CPU: dequantized
    np.testing.assert_array_equal(bf16, np.asarray(expert_mlp_ragged(
        x, fe, *(dequantize_blocks(w, sc, x.dtype) for w, sc in ((gq, gs), (uq, us), (dq, ds))), k), np.float64))
    assert np.abs(got - bf16).max() <= 0.1 * scale      # fp8 activations: a few % of the largest output


def test_expert_mlp_dispatch_takes_ragged_dot_off_the_gpu(monkeypatch):
    """On CPU (and with the policy off) the dispatch runs XLA's ragged_dot path."""
    import pallas_kernels.moe.dispatch as dispatch
    calls = []
    monkeypatch.setattr(dispatch, "expert_mlp_blocked", lambda *a, **kw: calls.append("blocked"))
    rng = np.random.default_rng(3)
    x, gate, up, down = mlp_inputs(rng, 8, 128, 128, 4)
    fe = jnp.asarray(rng.integers(0, 4, 16), jnp.int32)
    for policy in (KernelPolicy(), KernelPolicy(moe_kernel=False)):
        out = expert_mlp(x, fe, gate, up, down, 2, policy=policy)
        np.testing.assert_array_equal(out, expert_mlp_ragged(x, fe, gate, up, down, 2))
    assert calls == [] or jax.default_backend() == "gpu"


@pytest.mark.gpu
def test_expert_mlp_kernel_compiled_equals_reference():
    """Compiled on the GPU through the dispatch, at prefill and decode row counts, 16 and 256 experts,
    skewed and one-expert routings, and a shape the kernel cannot take (hidden 96: the dispatch falls
    back instead of failing)."""
    rng = np.random.default_rng(4)
    for N, k, D, I, E in ((512, 8, 1024, 512, 16), (4, 8, 1024, 512, 256), (300, 8, 512, 256, 256),
                          (64, 4, 96, 64, 6)):
        x, gate, up, down = mlp_inputs(rng, N, D, I, E)
        for fe in (rng.integers(0, E + 1, N * k), np.full(N * k, E - 1)):
            fe = jnp.asarray(fe, jnp.int32)
            ref = slot_reference(x, np.asarray(fe), gate, up, down, k)
            got = np.asarray(jax.jit(expert_mlp, static_argnums=5)(x, fe, gate, up, down, k), np.float64)
            assert np.isfinite(got).all()
            assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max(), (N, k, D, I, E)


@pytest.mark.gpu
def test_expert_mlp_fp8_kernel_compiled_equals_the_dequantized_path():
    """fp8 experts through the compiled fp8 kernel (policy.fp8_moe_kernel) against the same weights
    dequantized to bf16 (the bf16 kernel path): prefill and decode row counts, 16 and 256 experts."""
    from pallas_kernels.moe import fp8_kernel_applies
    rng = np.random.default_rng(6)
    on, off = KernelPolicy(fp8_moe_kernel=True), KernelPolicy(fp8_moe_kernel=False)
    run = jax.jit(expert_mlp, static_argnums=5, static_argnames="policy")
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
def test_model_logits_with_the_moe_kernel_are_as_close_to_fp32_as_ragged_dot():
    """A bf16 GLM-5-shaped model (hidden 1024, 64 experts, top-8; the kernel's shapes) on the GPU: its
    teacher-forced logits with the grouped_matmul kernel and with XLA's ragged_dot path, each against
    the same weights run in fp32 (ragged_dot). The two bf16 paths round the experts' intermediate at
    different points and random weights amplify any difference through the indexer's top-k, so they
    are compared by their distance to fp32: the kernel's error at most 1.25x ragged_dot's."""
    from flax import nnx

    from models.config import ModelConfig
    from models.model import DsaModel, prefill_logits
    cfg = ModelConfig.named("glm-5", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=64,
                            hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048, vocab_size=4096,
                            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, index_n_heads=32,
                            index_topk=64)
    model = DsaModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    wide = nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, state))
    wide.dtype = jnp.float32
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 200))
    run = lambda m, **kw: np.asarray(prefill_logits(m, tokens, attn_path="absorbed", kernels=KernelPolicy(**kw)))  # noqa: E731
    ref = run(wide, moe_kernel=False)
    errs = {name: np.abs(run(model, moe_kernel=on) - ref).max() / np.abs(ref).max()
            for name, on in (("kernel", True), ("ragged_dot", False))}
    print(f"bf16 logits vs fp32: {errs}")
    assert errs["kernel"] <= 1.25 * errs["ragged_dot"]
