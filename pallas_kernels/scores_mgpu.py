"""The indexer's prefill scores as a Mosaic GPU kernel (Hopper: TMA + wgmma, warp-specialized).

Same function as topk._scores_kernel on its gathered path (each request's keys already copied into
table order as bf16, with fp8 scales beside them): for query token t and key s,
    score[t, s] = scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])       (w carries D**-0.5)
and -inf where s > positions[t].

Why Mosaic GPU here, when the rest of topk.py uses Pallas's Triton backend: on the H200 the Triton
kernel's loads and MMAs alone run at 80% of the bf16 matmul rate, but its relu x weight x head-sum
epilogue waits for each key block's MMA, costing 2.1 of its 9.4 ms at a T = N = 32768 prefill
(docs/perf.md). Mosaic GPU gives explicit warp specialization with wgmma and TMA: two compute
warpgroups, each with its own block_t query tokens (all their heads: the MMA's N = block_t * H = 256
for GLM-5), and a third that streams key blocks (and fp8 scales) into `stages` shared-memory slots
by TMA. Both compute warpgroups read every key block, so a block's bytes feed 2 * block_t * H query
rows, and while one runs its epilogue the other's wgmma can run. On the H200 this runs the GLM-5
prefill scores in 7.1-7.3 ms (74-78% of the matmul rate) against 9.2-9.7 ms for the Triton kernel.
Measured and not kept (docs/perf.md): FlashAttention-3-style ping-pong ordering of the two
warpgroups' MMAs (by a shared rendezvous, or by issue order: 7.7 ms), each block's MMA split in two
halves so the first half's epilogue overlaps the second's MMA (8.2 ms: N = 128 re-reads the keys
from shared memory twice), block_t = 4 (8.9 ms), and the weights reloaded from shared memory per key
block instead of held in registers (8.4 ms; 168 registers, no spills, with them held).

Per key block acc = K Q^T ([block_kv keys, block_t * H]) with the keys as the MMA's M: a token's
heads are adjacent accumulator columns, so its head sum is a row reduction inside each quad (no
shared memory, no cross-warp step). Each warpgroup stages its [block_t, block_kv] score tile in
shared memory and writes it out by TMA, double-buffered. Query tiles run longest first (causal
prefill: the late tokens see the most keys). Key blocks no query of a program's 2 * block_t tokens
sees are skipped, and written as -inf only when write_invisible.

Only the gathered path (keys copied into table order first, as the Triton kernel does for calls of
many query blocks) can take it: Hopper's TMA has no row gather through a page table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2
DEFAULT_TILING = {"block_t": 8, "block_kv": 64, "stages": 4}


def mgpu_shape_error(H: int, D: int, q_dtype, *, block_t: int, block_kv: int = 64, **_) -> str | None:
    """Why the Mosaic GPU scores kernel cannot take these operands (None: it can)."""
    if jnp.dtype(q_dtype) != jnp.dtype(jnp.bfloat16):
        return f"queries must be bf16 (got {jnp.dtype(q_dtype).name})"
    if H % 8 or block_t * H > 256:
        return f"block_t * heads ({block_t} * {H}) must be at most 256, heads a multiple of 8 (the MMA's N)"
    if D % 64:
        return f"head_dim {D} must be a multiple of 64"
    if block_kv != 64:
        return f"block_kv must be 64 (one warpgroup MMA's M), got {block_kv}"
    return None


def visible_key_blocks(positions, block: int, block_kv: int, n_blocks: int):
    """Per (request, program of `block` query tokens): how many key blocks hold a key any of its
    tokens sees. positions [B, Tp] (-1 = padding lane); Tp a multiple of block."""
    B, Tp = positions.shape
    last = jnp.max(positions.reshape(B, Tp // block, block), axis=-1)
    return jnp.clip(last // block_kv + 1, 0, n_blocks).astype(jnp.int32)


def _kernel(nvis_ref, pos_ref, w_ref, q_ref, k_ref, *refs, heads: int, block_t: int, block_kv: int, stages: int,
            n_qt: int, fp8: bool, write_invisible: bool):
    if fp8:
        scale_ref, o_ref, q_smem, w_smem, k_smem, s_smem, o_smem, q_bar, k_bar, k_free = refs
    else:
        (o_ref, q_smem, w_smem, k_smem, o_smem, q_bar, k_bar, k_free), scale_ref, s_smem = refs, None, None
    b, it = lax.axis_index("b"), n_qt - 1 - lax.axis_index("qt")
    wg = lax.axis_index("wg")
    n_blocks = o_ref.shape[2] // block_kv
    n_vis = nvis_ref[b, it]
    m = block_t * heads

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        t0 = (it * COMPUTE_WGS + wg) * block_t
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(t0 * heads, m)], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(w_ref.at[b, pl.ds(t0 * heads, m)], w_smem.at[wg], q_bar.at[wg])
        pos = [pos_ref[b, t0 + t] for t in range(block_t)]
        rows = plgpu.broadcasted_iota(jnp.int32, (block_kv,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        plgpu.barrier_wait(q_bar.at[wg])
        w = [lax.broadcast_in_dim(       # in registers: reloading them per key block measured 18% slower
                 plgpu.load(w_smem.at[wg, pl.ds(t * heads, heads)], layout=plgpu.Layout.WGMMA.reduce(0)),
                 (block_kv, heads), (1,))
             for t in range(block_t)]

        @pl.loop(0, n_vis)
        def _block(j):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_bar.at[slot])

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.at[wg].transpose((1, 0)))
                return acc_ref[...]
            acc = pl.run_scoped(mma, plgpu.ACC((block_kv, m), jnp.float32))
            scale = plgpu.load(s_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1)) if fp8 else None
            plgpu.barrier_arrive(k_free.at[slot])
            buf = lax.rem(j, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)         # this buffer's last store has read it
            cols = rows + j * block_kv
            for t in range(block_t):
                s = jnp.sum(jnp.maximum(acc[:, t * heads:(t + 1) * heads], 0.0) * w[t], axis=1)
                if fp8:
                    s = s * scale
                o_smem[wg, buf, t] = jnp.where(cols <= pos[t], s, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg, buf],
                                    o_ref.at[b, pl.ds(t0, block_t), pl.ds(j * block_kv, block_kv)])

        if write_invisible:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg, 0] = jnp.full((block_t, block_kv), -jnp.inf, jnp.float32)
            plgpu.commit_smem()

            @pl.loop(n_vis, n_blocks)
            def _masked(j):
                plgpu.copy_smem_to_gmem(o_smem.at[wg, 0],
                                        o_ref.at[b, pl.ds(t0, block_t), pl.ds(j * block_kv, block_kv)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(j, slot):
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * block_kv, block_kv)], k_smem.at[slot], k_bar.at[slot])
            if fp8:
                plgpu.copy_gmem_to_smem(scale_ref.at[b, pl.ds(j * block_kv, block_kv)], s_smem.at[slot],
                                        k_bar.at[slot])

        for j in range(stages):
            pl.when(j < n_vis)(functools.partial(load, j, j))

        @pl.loop(stages, jnp.maximum(n_vis, stages))
        def _refill(j):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_free.at[slot])               # both warpgroups are done with block j - stages
            if fp8:
                plgpu.commit_smem()              # order their plain reads of the scales before the TMA's write
            load(j, slot)

        @pl.loop(jnp.maximum(n_vis - stages, 0), n_vis)
        def _drain(j):                                               # every arrival is awaited before the barriers go
            plgpu.barrier_wait(k_free.at[lax.rem(j, stages)])


def gathered_scores_mgpu(q, w, positions, keys, scale, *, heads: int, block_t: int = 8, block_kv: int = 64,
                         stages: int = 4, write_invisible: bool = False,
                         interpret=False):
    """The scores on padded operands: q [B, Tp * H, D] bf16 (token-major, heads adjacent), w [B, Tp * H]
    fp32 (D**-0.5 folded in), positions [B, Tp] int32, keys [B, Sp, D] bf16 in table order, scale
    [B, Sp] fp32 or None; Tp a multiple of 2 * block_t, Sp of block_kv. Returns [B, Tp, Sp] fp32;
    key blocks no query of a program sees are left unwritten unless write_invisible. interpret: True
    (or plgpu.InterpretGPUParams, e.g. with detect_races) runs Mosaic GPU's interpreter, on any
    backend."""
    B, TH, D = q.shape
    Tp, Sp = positions.shape[1], keys.shape[1]
    if TH != Tp * heads or Tp % (COMPUTE_WGS * block_t) or Sp % block_kv:
        raise ValueError(f"gathered_scores_mgpu: q {q.shape} / positions {positions.shape} / keys {keys.shape} "
                         f"not padded to {COMPUTE_WGS * block_t} tokens x {heads} heads, {block_kv} keys")
    m, fp8 = block_t * heads, scale is not None
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    n_blocks = Sp // block_kv
    stages = min(stages, n_blocks)
    nvis = visible_key_blocks(positions, COMPUTE_WGS * block_t, block_kv, n_blocks)
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [plgpu.SMEM((COMPUTE_WGS, m, D), jnp.bfloat16, transforms=tiling),
               plgpu.SMEM((COMPUTE_WGS, m), jnp.float32),
               plgpu.SMEM((stages, block_kv, D), jnp.bfloat16, transforms=tiling)]
    scratch += [plgpu.SMEM((stages, block_kv), jnp.float32)] if fp8 else []
    scratch += [plgpu.SMEM((COMPUTE_WGS, 2, block_t, block_kv), jnp.float32),
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
                plgpu.Barrier(num_arrivals=2 if fp8 else 1, num_barriers=stages),
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages)]
    kernel = plgpu.kernel(
        functools.partial(_kernel, heads=heads, block_t=block_t, block_kv=block_kv, stages=stages,
                          n_qt=Tp // (COMPUTE_WGS * block_t), fp8=fp8, write_invisible=write_invisible),
        out_type=jax.ShapeDtypeStruct((B, Tp, Sp), jnp.float32),
        grid=(B, Tp // (COMPUTE_WGS * block_t)), grid_names=("b", "qt"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        scratch_types=scratch, interpret=interpret)
    args = [nvis, positions, w, q, keys] + ([scale] if fp8 else [])
    return kernel(*args)
