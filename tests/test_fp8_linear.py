"""Dense fp8 x fp8 linears (pallas_kernels/fp8_linear.py: the expert kernel with one expert) against the
same arithmetic in float64 (rows quantized per 128 columns, weights dequantized from their blocks), in
Mosaic GPU's interpreter on CPU and compiled on the GPU (marked gpu); the model's Dense hands its
stored [out, in] fp8 weight to it as it is; GLM-5's projections lower for CUDA with the default tilings."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import fp8
from pallas_kernels import fp8_linear as fp8_linear_module
from pallas_kernels.fp8_linear import (GLM5_LINEARS, fp8_linear, fp8_linear_applies, fp8_linear_reference, linear_tiling,
                                      shape_error)
from pallas_kernels.moe.fp8_rows import dequantize_rows, quantize_rows
from pallas_kernels.policy import KernelPolicy


def fp8_weight(rng, N, K):
    """A random [N, K] weight as e4m3 blocks with a distinct scale per 128 x 128 block."""
    w = rng.standard_normal((N, K)) * K ** -0.5
    w *= np.repeat(np.repeat(rng.uniform(0.2, 5, (-(-N // 128), -(-K // 128))), 128, 0), 128, 1)[:N, :K]
    return tuple(map(jnp.asarray, fp8.quantize(w)))


def reference(x, w, s):
    """float64 x @ W^T with x's rows quantized as the kernel quantizes them."""
    lead, K = x.shape[:-1], x.shape[-1]
    xr = np.asarray(dequantize_rows(*quantize_rows(x.reshape(-1, K).astype(jnp.float32))), np.float64)
    return (xr @ np.asarray(fp8.dequantize(w, s, jnp.float32), np.float64).T).reshape(*lead, -1)


@pytest.mark.parametrize("lead,N", [((3, 45), 192), ((1, 5), 256), ((5,), 192)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_linear_interpret_equals_the_quantized_reference(lead, N, dtype):
    """Interpreter with the race detector, each default tiling shape: 135 rows (two 128-row tiles, the
    last padded; two compute warpgroups on 64 rows each; N = 192 = 128 + 64 needs 64-wide column
    blocks and a partial last scale block), 5 rows at N = 256 (a 64-row tile, the two warpgroups on
    half the columns each) and at N = 192 (one warpgroup). K = 256 holds two scale blocks per row."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(N + len(lead))
    K = 256
    x = jnp.asarray(rng.standard_normal((*lead, K)) * np.repeat(rng.uniform(0.1, 10, 2), 128), dtype)
    w, s = fp8_weight(rng, N, K)
    assert s.shape == (2, 2)
    t = dataclasses.replace(linear_tiling(int(np.prod(lead)), N), programs=3, stages=2)
    got = fp8_linear(x, w, s, tiling=t, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert got.shape == (*lead, N) and got.dtype == dtype
    want = reference(x, w, s)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= (1e-6 if dtype == jnp.float32 else 8e-3), err
    ref = np.asarray(fp8_linear_reference(x, w, s), np.float64)             # the same arithmetic in XLA
    assert np.abs(ref - want).max() / np.abs(want).max() <= (1e-6 if dtype == jnp.float32 else 8e-3)


def test_fp8_linear_two_block_steps_interpret_bit_equal_one_block_steps():
    """Two blocks a step on the linear's prefill tiling (135 rows: two 128-row tiles, K = 512: four
    blocks) make the same additions in the same order: bit-equal in the interpreter with the race
    detector. with_step_blocks gives them to the 64-row tiling (three stages fit), not to the 128-row
    one (three stages do not fit; two lost on the H100) nor the 64-wide one-warpgroup tiling (N = 192)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe.grouped_matmul import with_step_blocks
    rng = np.random.default_rng(7)
    K, N = 512, 256
    x = jnp.asarray(rng.standard_normal((135, K)), jnp.bfloat16)
    w, s = fp8_weight(rng, N, K)
    t = dataclasses.replace(linear_tiling(135, N, K), programs=3, stages=2)
    t2 = dataclasses.replace(t, step_blocks=2)
    assert with_step_blocks(linear_tiling(135, N, K), K, 2) == linear_tiling(135, N, K)
    assert with_step_blocks(linear_tiling(5, 192, K), K, 2) == linear_tiling(5, 192, K)
    decode = with_step_blocks(linear_tiling(5, N, K), K, 2)
    assert (decode.step_blocks, decode.stages) == (2, 3)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    got, ref = (np.asarray(fp8_linear(x, w, s, tiling=u, interpret=interp), np.float32) for u in (t2, t))
    np.testing.assert_array_equal(got, ref)
    want = reference(x, w, s)
    assert np.abs(got - want).max() <= 8e-3 * np.abs(want).max()


def test_fp8_linear_wide_tiles_interpret_bit_equal_128_column_tiles():
    """wide (KernelPolicy.fp8_wide_tiles): a prefill-sized linear of N = 384 (three scale blocks) in
    192-column tiles, chained and not, is bit-equal to its 128-column tiles in the interpreter (races
    detected) and within bf16 rounding of float64; linear_tiling gives them only to 128-row calls whose N
    is a multiple of 384 (o_proj, the dense MLP's, the down projections), not to kv_a_proj (576) nor to decode."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(19)
    K, N = 384, 384
    x = jnp.asarray(rng.standard_normal((135, K)), jnp.bfloat16)
    w, s = fp8_weight(rng, N, K)
    narrow = dataclasses.replace(linear_tiling(135, N, K), programs=3, stages=2)
    wide = dataclasses.replace(linear_tiling(135, N, K, wide=True), programs=3, stages=2)
    assert (narrow.block_n, wide.block_n) == (128, 192)
    interp = plgpu.InterpretGPUParams(detect_races=True)
    ref = np.asarray(fp8_linear(x, w, s, tiling=narrow, interpret=interp), np.float32)
    for t in (wide, dataclasses.replace(wide, stages=3, chained_tiles=True)):     # 3 K steps: 3 stages chain
        np.testing.assert_array_equal(np.asarray(fp8_linear(x, w, s, tiling=t, interpret=interp), np.float32), ref)
    want = reference(x, w, s)
    assert np.abs(ref - want).max() <= 8e-3 * np.abs(want).max()
    widths = {name: linear_tiling(8192, N, K, wide=True).block_n for name, (K, N) in GLM5_LINEARS.items()}
    assert {n for n, b in widths.items() if b == 192} == {"o_proj", "shared_experts.down_proj", "mlp.gate_proj",
                                                          "mlp.down_proj", "eh_proj"}
    assert linear_tiling(64, 6144, 2048, wide=True).block_n == 128


@pytest.mark.parametrize("N", [256, 192])
def test_fp8_linear_split_k_interpret_equals_the_quantized_reference(N):
    """A decode-sized call (5 rows: one 64-row tile) with K split over programs (split_k: K = 1024 is
    eight 128-deep steps -> four splits of two; N = 256: two column tiles of two warpgroups, N = 192:
    three 64-wide tiles of one), in the interpreter with the race detector: the summed fp32 partials
    against the float64 reference, every block scale distinct."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rng = np.random.default_rng(N)
    K = 1024
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    w, s = fp8_weight(rng, N, K)
    t = linear_tiling(5, N, K, split_k=True)
    assert t.k_splits == 4 and linear_tiling(5, N, K).k_splits == 1
    got = fp8_linear(x, w, s, tiling=dataclasses.replace(t, programs=4, stages=2),
                     interpret=plgpu.InterpretGPUParams(detect_races=True))
    want = reference(x, w, s)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 8e-3 * np.abs(want).max()


def test_decode_k_splits_fill_one_wave_at_glm5_widths():
    """The split counts the policy's split_k gives GLM-5's linears at decode: tiles x splits within the
    132 programs, splits dividing K's 128-deep steps with two steps each at least; no split where the
    output tiles fill the wave (q_b_proj's 128) or at prefill row counts."""
    got = {name: linear_tiling(8, N, K, split_k=True).k_splits for name, (K, N) in GLM5_LINEARS.items()}
    assert got == {"q_a_proj": 8, "q_b_proj": 1, "kv_a_proj_with_mqa": 12, "o_proj": 2, "indexer.wq_b": 4,
                   "indexer.wk": 24, "shared_experts.gate_proj": 8, "shared_experts.down_proj": 2,
                   "mlp.gate_proj": 1, "mlp.down_proj": 2, "eh_proj": 2}, got
    assert all(linear_tiling(8192, N, K, split_k=True).k_splits == 1 for K, N in GLM5_LINEARS.values())


def test_fp8_linear_refuses_what_it_cannot_take():
    """Shapes the kernel cannot take give a named reason (and the Dense then dequantizes instead)."""
    rng = np.random.default_rng(0)
    w, s = fp8_weight(rng, 256, 256)
    x = jnp.zeros((4, 256), jnp.bfloat16)
    assert shape_error(x, w, s) is None
    assert "K 192" in shape_error(jnp.zeros((4, 192)), *fp8_weight(rng, 256, 192))
    assert "scale_inv must be fp32 (2, 2)" in shape_error(x, w, s[:1])
    assert "not [..., K] and [N, K]" in shape_error(jnp.zeros((4, 128)), w, s)
    assert shape_error(jnp.zeros((0, 256)), w, s) == "no rows"
    assert not fp8_linear_applies(x, w, s, KernelPolicy())      # CPU: never
    with pytest.raises(ValueError, match="fp8_linear: scale_inv"):
        fp8_linear(x, w, s[:1])


def test_dense_hands_its_stored_fp8_weight_to_the_kernel(monkeypatch):
    """A kept-fp8 Dense stores HF's [out, in] (fp8_weight) and, where the kernel applies, passes it and
    its scales to fp8_linear as they are, with the policy's fp8_linear_split_k, step blocks, row scales
    and wide tiles (which fp8_linear passes to its tiling); with the policy's fp8_linear_kernel off (and on CPU) it
    multiplies by the dequantized [in, out] weight."""
    from flax import nnx

    import models.layers as layers
    dense = layers.Dense(256, 192, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8=True)
    assert dense.kernel is None and dense.fp8_weight[...].shape == (192, 256) and dense.scale_inv[...].shape == (2, 2)
    seen = []
    monkeypatch.setattr(KernelPolicy, "on_gpu", lambda self: self.enabled)
    monkeypatch.setattr(layers, "fp8_linear", lambda x, w, s, split_k, chain, step_blocks, wide:
                        seen.append((w, s, split_k, chain, step_blocks, wide))
                        or jnp.zeros((*x.shape[:-1], 192)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 7, 256)), jnp.bfloat16)
    dense(x)
    assert len(seen) == 1 and seen[0][0] is dense.fp8_weight[...] and seen[0][1] is dense.scale_inv[...]
    dense(x, KernelPolicy(fp8_linear_split_k=False, chained_tiles=True, fp8_step_blocks=1, fp8_wide_tiles=False))
    assert [a[2:] for a in seen] == [(True, False, 2, True), (False, True, 1, False)]   # default: split K
    del seen[1:]
    tilings = []

    def kernel(xq, w, tile_expert, *, tiling, out_dtype, **kw):   # fp8_linear's kernel call, recorded
        tilings.append(tiling)
        return jnp.zeros((xq.shape[0], w.shape[1]), out_dtype)

    monkeypatch.setattr(fp8_linear_module, "grouped_matmul", kernel)
    w, sc = jnp.zeros((256, 768), jnp.float8_e4m3fn), jnp.ones((2, 6), jnp.float32)   # 6 K steps
    fp8_linear(x[..., :1].repeat(768, -1), w, sc, split_k=True)
    fp8_linear(x[..., :1].repeat(768, -1), w, sc)
    fp8_linear(x[..., :1].repeat(768, -1), w, sc, chain=True)          # 6 K steps over 4 stages: not chained
    w8, sc8 = jnp.zeros((256, 1024), jnp.float8_e4m3fn), jnp.ones((2, 8), jnp.float32)   # 8 K steps: chained
    fp8_linear(x[..., :1].repeat(1024, -1), w8, sc8, chain=True)
    fp8_linear(x[..., :1].repeat(768, -1), w, sc, step_blocks=2)     # two blocks a step in three stages
    w384, sc384 = jnp.zeros((384, 1024), jnp.float8_e4m3fn), jnp.ones((3, 8), jnp.float32)
    fp8_linear(jnp.zeros((200, 1024), jnp.bfloat16), w384, sc384, wide=True)   # prefill rows: wide, chained
    fp8_linear(x[..., :1].repeat(1024, -1), w384, sc384, wide=True)             # 21 rows: a 64-row tile
    assert tilings[-2:] == [dataclasses.replace(linear_tiling(200, 384, 1024, wide=True), chained_tiles=True),
                            linear_tiling(21, 384, 1024)] and tilings[-2].block_n == 192
    del tilings[-2:]
    assert tilings == [linear_tiling(21, 256, 768, split_k=True), linear_tiling(21, 256, 768),
                       linear_tiling(21, 256, 768), dataclasses.replace(linear_tiling(21, 256, 1024), chained_tiles=True),
                       dataclasses.replace(linear_tiling(21, 256, 768), step_blocks=2, stages=3)]
    assert tilings[0].k_splits > 1 == tilings[1].k_splits
    off = dense(x, KernelPolicy(fp8_linear_kernel=False))
    want = np.asarray(x, np.float32) @ np.asarray(fp8.dequantize(dense.fp8_weight[...], dense.scale_inv[...],
                                                                 jnp.float32)).T
    assert len(seen) == 1
    np.testing.assert_allclose(np.asarray(off, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("rows,split_k,chain,wide", [
    (8192, False, False, False), (64, False, False, False), (1, False, False, False), (64, True, False, False),
    (1, True, False, False), (8192, False, True, False), (64, True, True, False), (8192, False, False, True)])
def test_glm5_linears_lower_for_cuda_with_the_default_tilings(rows, split_k, chain, wide):
    """Each of GLM-5's fp8 dense linears at prefill and decode row counts (decode also with K split; tiles
    chained or not; prefill in wide tiles where N takes them), traced and lowered for CUDA on this machine
    from shapes alone (Mosaic GPU checks shared memory while lowering): one kernel call, the weight
    argument reaching it untransposed."""
    sds = jax.ShapeDtypeStruct
    for name, (K, N) in GLM5_LINEARS.items():
        x, w, s = sds((rows, K), jnp.bfloat16), sds((N, K), jnp.float8_e4m3fn), sds((-(-N // 128), K // 128), jnp.float32)
        assert shape_error(x, w, s) is None, name
        text = jax.jit(functools.partial(fp8_linear, split_k=split_k, chain=chain, wide=wide)).trace(x, w, s).lower(
            lowering_platforms=("cuda",)).as_text()
        lines = text.splitlines()
        assert sum("custom_call @mosaic_gpu" in line for line in lines) == 1, name
        # the weight reaches the call only with its one-expert axis added (a free broadcast), untransposed
        uses = [line for line in lines if re.search(r"%arg1\b", line) and "f8E4M3FN" in line and "func.func" not in line]
        assert len(uses) == 1 and "stablehlo.broadcast_in_dim %arg1, dims = [1, 2]" in uses[0], (name, uses)
        assert not [line for line in lines if "stablehlo.transpose" in line and "f8E4M3FN" in line]


@pytest.mark.gpu
def test_fp8_linear_compiled_equals_the_quantized_reference():
    """Compiled on the GPU, GLM-5's widths at prefill and decode row counts (bf16 in and out), decode
    also with K split over programs (split_k), and tiles chained (chain)."""
    rng = np.random.default_rng(7)
    for rows, split_k, chain in ((1000, False, False), (64, False, False), (3, False, False), (64, True, False),
                                 (3, True, False), (1000, False, True), (64, True, True)):
        run = jax.jit(functools.partial(fp8_linear, split_k=split_k, chain=chain))
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            K, N = GLM5_LINEARS[name]
            x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
            w, s = fp8_weight(rng, N, K)
            got = np.asarray(run(x, w, s), np.float64)
            want = reference(x, w, s)
            assert np.abs(got - want).max() <= 8e-3 * np.abs(want).max(), (rows, name)


@pytest.mark.gpu
def test_fp8_linear_wide_tiles_compiled_bit_equal_128_column_tiles():
    """KernelPolicy.fp8_wide_tiles' linears compiled on the GPU at GLM-5's widths (1000 rows: 192-column
    tiles, chained) bit-equal to the 128-column tiles."""
    rng = np.random.default_rng(13)
    narrow, wide = (jax.jit(functools.partial(fp8_linear, wide=b)) for b in (False, True))
    for name in ("o_proj", "shared_experts.down_proj"):
        K, N = GLM5_LINEARS[name]
        x = jnp.asarray(rng.standard_normal((1000, K)), jnp.bfloat16)
        w, s = fp8_weight(rng, N, K)
        np.testing.assert_array_equal(np.asarray(wide(x, w, s)), np.asarray(narrow(x, w, s)), err_msg=name)


@pytest.mark.gpu
def test_fp8_linear_two_block_steps_compiled_bit_equal_one_block_steps():
    """KernelPolicy.fp8_step_blocks' linears compiled on the GPU at GLM-5's widths: decode-sized calls
    (64-row tiles in three stages, K split over programs or not) bit-equal to one block a step; a
    prefill-sized call keeps one block a step where three stages do not fit (with_step_blocks): the same
    kernel; kv_a_proj_with_mqa (64-wide blocks) takes it at prefill and not at decode."""
    from pallas_kernels.moe.grouped_matmul import with_step_blocks
    rng = np.random.default_rng(11)
    taken = set()
    for rows, split_k in ((64, False), (3, True), (64, True), (1000, False)):
        one, two = (jax.jit(functools.partial(fp8_linear, split_k=split_k, step_blocks=b)) for b in (1, 2))
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            K, N = GLM5_LINEARS[name]
            x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
            w, s = fp8_weight(rng, N, K)
            if with_step_blocks(linear_tiling(rows, N, K, split_k=split_k), K, 2).step_blocks == 2:
                taken.add((rows, split_k, name))
            np.testing.assert_array_equal(np.asarray(two(x, w, s)), np.asarray(one(x, w, s)), err_msg=f"{rows} {name}")
    # (K splits follow the device's programs: only the unsplit calls' choices are fixed)
    assert {(64, False, n) for n in ("q_a_proj", "q_b_proj", "o_proj")} | {(1000, False, "kv_a_proj_with_mqa")} <= taken
    assert not {(64, False, "kv_a_proj_with_mqa"), (1000, False, "q_a_proj")} & taken


@pytest.mark.gpu
def test_fp8_model_logits_with_the_fp8_linear_kernel_are_as_close_to_fp32_as_xla_quantized(monkeypatch):
    """A bf16 GLM-5-shaped model with every DeepSeek fp8 linear kept fp8 (kernel shapes): teacher-forced
    logits with its dense linears through the kernel, and through the same quantized arithmetic in XLA
    (fp8_linear_reference), each against the same weights run in fp32 (dequantized at use, no kernel).
    fp8 activations move the logits by themselves, and random weights amplify any difference through
    the indexer's top-k, so the two are compared by their distance to fp32: the kernel's at most 1.25x
    XLA's."""
    import models.layers as layers
    from models.config import FP8_LINEARS_ALL
    from tests.helpers import glm5_kernel_slice
    model, wide, run = glm5_kernel_slice(fp8_linears=FP8_LINEARS_ALL)
    ref = run(wide, fp8_linear_kernel=False, fp8_moe_kernel=False, moe_kernel=False)
    kernel = run(model)
    monkeypatch.setattr(layers, "fp8_linear", fp8_linear_reference)
    jax.clear_caches()                   # the jitted forward traces again, through the reference
    xla = run(model)
    assert not np.array_equal(kernel, xla)
    errs = {name: np.abs(got - ref).max() / np.abs(ref).max() for name, got in (("kernel", kernel), ("xla", xla))}
    agree = {name: (got.argmax(-1) == ref.argmax(-1)).mean() for name, got in (("kernel", kernel), ("xla", xla))}
    print(f"fp8 linears vs fp32: rel err {errs}, argmax agreement {agree}")
    assert errs["kernel"] <= 1.25 * errs["xla"]
