"""The indexer's scores as a Mosaic GPU kernel (Hopper: TMA + wgmma, warp-specialized): prefill over
gathered keys, and decode reading the pool's pages directly (paged mode, last paragraph).

Same function as scores._scores_kernel on its gathered path (each request's keys already copied into
table order as bf16, with fp8 scales beside them): for query token t and key s,
    score[t, s] = scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])       (w carries D**-0.5)
and -inf where s > positions[t].

Why Mosaic GPU here, when the rest of the indexer uses Pallas's Triton backend: the Triton kernel's
relu x weight x head-sum epilogue waits for each key block's MMA. Mosaic GPU gives explicit warp
specialization with wgmma and TMA: two compute warpgroups, each with its own block_t query tokens
(all their heads: the MMA's N = block_t * H = 256 for GLM-5), and a third that streams key blocks
(and fp8 scales) into `stages` shared-memory slots by TMA. Both compute warpgroups read every key
block, so a block's bytes feed 2 * block_t * H query rows, and while one runs its epilogue the
other's wgmma can run. On the H200 this is the faster prefill scores kernel; the variants measured
and not kept (ping-pong ordering of the two warpgroups' MMAs, split MMAs, block_t = 4, weights
reloaded from shared memory) are in docs/perf.md.

Per key block acc = K Q^T ([block_kv keys, block_t * H]) with the keys as the MMA's M: a token's
heads are adjacent accumulator columns, so its head sum is a row reduction inside each quad (no
shared memory, no cross-warp step). Each warpgroup stages its [block_t, block_kv] score tile in
shared memory and writes it out by TMA, double-buffered. Query tiles run longest first (causal
prefill: the late tokens see the most keys). Key blocks no query of a program's 2 * block_t tokens
sees are skipped, and written as -inf only when write_invisible.

The same kernel has a paged mode (paged_scores_mgpu) for calls of few query tokens (decode), which
read their keys through the page table. Hopper's TMA has no row gather, but the pool's pages hold
64-slot runs of consecutive rows, so one 64-key block is one TMA copy at the row of its first key
(the caller promises that layout: indexer_topk's contiguous_blocks). The memory warpgroup copies the
program's block rows into shared memory once, then streams blocks of the pool's own fp8 (or bf16)
keys; a compute warpgroup loads an fp8 block into registers, upcasts it to bf16 there (via f16: the
H200's ptxas, PTX ISA 9.0, has no direct e4m3 -> bf16) and runs the MMA with it as the register
operand, so nothing is copied or widened in HBM. Both compute warpgroups take the same block_t
tokens (2-8) and alternate key blocks, and a request's keys are split over programs of
blocks_per_program blocks. The mode uses Lane semantics: under Warpgroup semantics a scalar read
from memory cannot be a TMA offset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2
BLOCK_KV = 64                    # keys per block: one warpgroup MMA's M
DEFAULT_TILING = {"block_t": 8, "block_kv": BLOCK_KV, "stages": 4}
# Paged (decode) calls: key blocks per program and pipeline slots.
PAGED_TILING = {"blocks_per_program": 64, "stages": 4}
# A paged program copies its block rows (int32) from `split * blocks_per_program` on: a multiple of 4
# keeps that copy's start 16-byte aligned. On the H200, 2 blocks a program over several programs stopped
# the GPU (illegal instruction) where 4, 8 and 64 ran (docs/perf.md, 2026-12-05).
PAGED_BLOCKS_ALIGN = 4


def mgpu_shape_error(H: int, D: int, q_dtype, *, block_t: int, block_kv: int = 64, key_dtype=None,
                     **_) -> str | None:
    """Why the Mosaic GPU scores kernel cannot take these operands (None: it can). key_dtype: the
    pool's key dtype, for the paged kernel."""
    if key_dtype is not None and jnp.dtype(key_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)):
        return f"the paged kernel reads bf16 or fp8 e4m3 keys (got {jnp.dtype(key_dtype).name})"
    if key_dtype is not None and (block_t < 2 or H % 32):
        # (a [1, 64] score tile is below a warpgroup copy's 128 elements; 8 heads faulted on the H200)
        return f"the paged kernel needs block_t >= 2 and heads a multiple of 32 (got {block_t}, {H})"
    if jnp.dtype(q_dtype) != jnp.dtype(jnp.bfloat16):
        return f"queries must be bf16 (got {jnp.dtype(q_dtype).name})"
    if H % 8 or block_t * H > 256:
        return f"block_t * heads ({block_t} * {H}) must be at most 256, heads a multiple of 8 (the MMA's N)"
    if D % 64:
        return f"head_dim {D} must be a multiple of 64"
    if block_kv != 64:
        return f"block_kv must be 64 (one warpgroup MMA's M), got {block_kv}"
    return None


def _check_shapes(entry: str, H: int, D: int, q_dtype, **tiling):
    err = mgpu_shape_error(H, D, q_dtype, **tiling)
    if err is not None:
        raise ValueError(f"{entry}: {err}")


def visible_key_blocks(positions, block: int, block_kv: int, n_blocks: int):
    """Per (request, program of `block` query tokens): how many key blocks hold a key any of its
    tokens sees. positions [B, Tp] (-1 = padding lane); Tp a multiple of block."""
    B, Tp = positions.shape
    last = jnp.max(positions.reshape(B, Tp // block, block), axis=-1)
    return jnp.clip(last // block_kv + 1, 0, n_blocks).astype(jnp.int32)


def _fp8_to_bf16(keys):
    """fp8 e4m3 -> bf16 in registers, exact: through f16 (Hopper converts e4m3 to f16 directly; to
    bf16 only from PTX ISA 9.2) and f32."""
    return keys.astype(jnp.float16).astype(jnp.float32).astype(jnp.bfloat16)


def _kernel(nvis_ref, pos_ref, w_ref, q_ref, k_ref, *refs, heads: int, block_t: int, block_kv: int, stages: int,
            n_qt: int, fp8: bool, write_invisible: bool, per_program: int | None, **smem):
    """per_program None (gathered): k_ref [B, Sp, D] bf16 in table order; the two compute warpgroups
    take block_t tokens each and both read every key block. per_program n (paged): k_ref the pool's
    rows [rows, D] (fp8 or bf16), base_ref [B, splits * n] the row of each key block's first key;
    program (b, qt, split) takes key blocks [split * n, split * n + n), both warpgroups the same
    block_t tokens and alternate key blocks."""
    refs = list(refs)
    scale_ref = refs.pop(0) if fp8 else None
    base_ref = refs.pop(0) if per_program else None
    (o_ref,) = refs
    q_smem, w_smem, k_smem, o_smem = smem["q"], smem["w"], smem["k"], smem["o"]
    q_bar, k_bar, k_free = smem["q_bar"], smem["k_bar"], smem["k_free"]
    b, it = lax.axis_index("b"), n_qt - 1 - lax.axis_index("qt")
    wg = lax.axis_index("wg")
    n_blocks = o_ref.shape[2] // block_kv
    m = block_t * heads
    paged = per_program is not None
    if paged:
        first = lax.axis_index("split") * per_program
        n_vis = jnp.clip(nvis_ref[b, it] - first, 0, per_program)          # this program's visible blocks
        n_own = jnp.clip(n_blocks - first, 0, per_program)
        t0 = it * block_t
    else:
        first, n_vis, n_own = 0, nvis_ref[b, it], n_blocks

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        t0_ = t0 if paged else (it * COMPUTE_WGS + wg) * block_t
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(t0_ * heads, m)], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(w_ref.at[b, pl.ds(t0_ * heads, m)], w_smem.at[wg], q_bar.at[wg])
        pos = [pos_ref[b, t0_ + t] for t in range(block_t)]
        rows = plgpu.broadcasted_iota(jnp.int32, (block_kv,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        plgpu.barrier_wait(q_bar.at[wg])
        w = [lax.broadcast_in_dim(       # in registers: reloading them per key block measured 18% slower
                 plgpu.load(w_smem.at[wg, pl.ds(t * heads, heads)], layout=plgpu.Layout.WGMMA.reduce(0)),
                 (block_kv, heads), (1,))
             for t in range(block_t)]

        def block(i, n_done):
            """Key block `first + i`, in pipeline slot i % stages; n_done: this warpgroup's blocks
            before it (picks the output buffer)."""
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            scale = plgpu.load(smem["s"].at[slot], layout=plgpu.Layout.WGMMA.reduce(1)) if fp8 else None
            a = k_smem.at[slot]
            if paged and fp8:          # fp8 rows: upcast in registers, the MMA reads them from there
                a = _fp8_to_bf16(plgpu.load(a, layout=plgpu.Layout.WGMMA))
                plgpu.barrier_arrive(k_free.at[slot])                # the slot is free once read
                if "a" in smem:        # (the interpreter's MMA reads shared memory only)
                    smem["a"][wg] = a
                    plgpu.commit_smem()
                    a = smem["a"].at[wg]

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a, q_smem.at[wg].transpose((1, 0)))
                return acc_ref[...]
            acc = pl.run_scoped(mma, plgpu.ACC((block_kv, m), jnp.float32))
            if not (paged and fp8):
                plgpu.barrier_arrive(k_free.at[slot])
            buf = lax.rem(n_done, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)         # this buffer's last store has read it
            j = first + i
            cols = rows + j * block_kv
            for t in range(block_t):
                s = jnp.sum(jnp.maximum(acc[:, t * heads:(t + 1) * heads], 0.0) * w[t], axis=1)
                if fp8:
                    s = s * scale
                o_smem[wg, buf, t] = jnp.where(cols <= pos[t], s, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg, buf],
                                    o_ref.at[b, pl.ds(t0_, block_t), pl.ds(j * block_kv, block_kv)])
            return n_done + 1

        if paged:
            pl.loop(wg, n_vis, step=COMPUTE_WGS, init_carry=jnp.int32(0))(block)
        else:
            pl.loop(0, n_vis, init_carry=jnp.int32(0))(block)

        if write_invisible:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg, 0] = jnp.full((block_t, block_kv), -jnp.inf, jnp.float32)
            plgpu.commit_smem()

            @pl.loop(n_vis + (wg if paged else 0), n_own, step=COMPUTE_WGS if paged else 1)
            def _masked(i):
                plgpu.copy_smem_to_gmem(o_smem.at[wg, 0], o_ref.at[b, pl.ds(t0_, block_t),
                                                                   pl.ds((first + i) * block_kv, block_kv)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        if paged:
            plgpu.copy_gmem_to_smem(base_ref.at[b, pl.ds(first, smem["base"].shape[0])], smem["base"],
                                    smem["base_bar"])
            plgpu.barrier_wait(smem["base_bar"])

        def load(i, slot):
            if paged:
                row = smem["base"][i]
                src = (k_ref.at[pl.ds(row, block_kv)], scale_ref.at[pl.ds(row, block_kv)] if fp8 else None)
            else:
                src = (k_ref.at[b, pl.ds(i * block_kv, block_kv)],
                       scale_ref.at[b, pl.ds(i * block_kv, block_kv)] if fp8 else None)
            plgpu.copy_gmem_to_smem(src[0], k_smem.at[slot], k_bar.at[slot])
            if fp8:
                plgpu.copy_gmem_to_smem(src[1], smem["s"].at[slot], k_bar.at[slot])

        for i in range(stages):
            pl.when(i < n_vis)(functools.partial(load, i, i))

        @pl.loop(stages, jnp.maximum(n_vis, stages))
        def _refill(i):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_free.at[slot])               # the compute is done with block i - stages
            if fp8:
                plgpu.commit_smem()              # order their plain reads of the slot before the TMA's write
            load(i, slot)

        @pl.loop(jnp.maximum(n_vis - stages, 0), n_vis)
        def _drain(i):                                               # every arrival is awaited before the barriers go
            plgpu.barrier_wait(k_free.at[lax.rem(i, stages)])


def _bases_per_copy(per_program: int) -> int:
    """Block rows a paged program copies into shared memory: its blocks, rounded up to a TMA copy of a
    multiple of 128 bytes (what a warpgroup's copy moves)."""
    return -(-per_program // 32) * 32


def _scratch(m: int, D: int, block_t: int, block_kv: int, stages: int, fp8: bool, key_dtype,
             per_program: int | None, interpret) -> dict:
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    size = jnp.dtype(key_dtype).itemsize
    swizzle = plgpu.find_swizzle(D * size * 8, "keys")
    key_tiling = (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))
    consumers = 1 if per_program else COMPUTE_WGS                  # paged: one warpgroup reads each block
    smem = dict(q=plgpu.SMEM((COMPUTE_WGS, m, D), jnp.bfloat16, transforms=tiling),
                w=plgpu.SMEM((COMPUTE_WGS, m), jnp.float32),
                k=plgpu.SMEM((stages, block_kv, D), key_dtype, transforms=key_tiling),
                o=plgpu.SMEM((COMPUTE_WGS, 2, block_t, block_kv), jnp.float32),
                q_bar=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
                k_bar=plgpu.Barrier(num_arrivals=2 if fp8 else 1, num_barriers=stages),
                k_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages))
    if fp8:
        smem["s"] = plgpu.SMEM((stages, block_kv), jnp.float32)
    if per_program and fp8 and interpret:
        smem["a"] = plgpu.SMEM((COMPUTE_WGS, block_kv, D), jnp.bfloat16, transforms=tiling)
    if per_program:
        smem["base"] = plgpu.SMEM((_bases_per_copy(per_program),), jnp.int32)
        smem["base_bar"] = plgpu.Barrier(num_arrivals=1)
    return smem


def _run(q, w, positions, keys, scale, bases, *, heads: int, block_t: int, block_kv: int, stages: int,
         write_invisible: bool, per_program: int | None, interpret, Sp: int):
    B, _, D = q.shape
    Tp = positions.shape[1]
    m, fp8 = block_t * heads, scale is not None
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    n_blocks = Sp // block_kv
    tokens = block_t if per_program else COMPUTE_WGS * block_t          # per program
    grid, names = (B, Tp // tokens), ("b", "qt")
    if per_program:
        grid, names = grid + (pl.cdiv(n_blocks, per_program),), names + ("split",)
        # even: slot i % stages then holds blocks of one warpgroup only (i % 2); at least 4, the fewest
        # run on the H200 (a sweep with 2-stage tilings in it ran past its time limit, unexplained)
        stages = max(4, stages + stages % 2)
    else:
        stages = min(stages, n_blocks)
    kernel = plgpu.kernel(
        functools.partial(_kernel, heads=heads, block_t=block_t, block_kv=block_kv, stages=stages,
                          n_qt=Tp // tokens, fp8=fp8, write_invisible=write_invisible, per_program=per_program),
        out_type=jax.ShapeDtypeStruct((B, Tp, Sp), jnp.float32), grid=grid, grid_names=names,
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        scratch_types=_scratch(m, D, block_t, block_kv, stages, fp8, keys.dtype, per_program, interpret),
        interpret=interpret,
        # paged: Lane semantics (explicit layouts), where a loaded scalar can be a TMA copy's offset
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane) if per_program else None)
    args = [visible_key_blocks(positions, tokens, block_kv, n_blocks), positions, w, q, keys]
    args += ([scale] if fp8 else []) + ([bases] if per_program else [])
    return kernel(*args)


def gathered_scores_mgpu(q, w, positions, keys, scale, *, heads: int, block_t: int = 8, block_kv: int = 64,
                         stages: int = 4, write_invisible: bool = False, interpret=False):
    """The scores on padded operands: q [B, Tp * H, D] bf16 (token-major, heads adjacent), w [B, Tp * H]
    fp32 (D**-0.5 folded in), positions [B, Tp] int32, keys [B, Sp, D] bf16 in table order, scale
    [B, Sp] fp32 or None; Tp a multiple of 2 * block_t, Sp of block_kv. Returns [B, Tp, Sp] fp32;
    key blocks no query of a program sees are left unwritten unless write_invisible. interpret: True
    (or plgpu.InterpretGPUParams, e.g. with detect_races) runs Mosaic GPU's interpreter, on any
    backend."""
    B, TH, D = q.shape
    Tp, Sp = positions.shape[1], keys.shape[1]
    _check_shapes("gathered_scores_mgpu", heads, D, q.dtype, block_t=block_t, block_kv=block_kv)
    if TH != Tp * heads or Tp % (COMPUTE_WGS * block_t) or Sp % block_kv:
        raise ValueError(f"gathered_scores_mgpu: q {q.shape} / positions {positions.shape} / keys {keys.shape} "
                         f"not padded to {COMPUTE_WGS * block_t} tokens x {heads} heads, {block_kv} keys")
    return _run(q, w, positions, keys, scale, None, heads=heads, block_t=block_t, block_kv=block_kv, stages=stages,
                write_invisible=write_invisible, per_program=None, interpret=interpret, Sp=Sp)


def paged_scores_mgpu(q, w, positions, rows, scale, bases, *, heads: int, block_t: int, block_kv: int = 64,
                      blocks_per_program: int = PAGED_TILING["blocks_per_program"],
                      stages: int = PAGED_TILING["stages"], write_invisible: bool = False, interpret=False):
    """The scores with the keys read from the pool itself, one TMA copy per key block: rows [R, D] (the
    pool's rows, fp8 e4m3 or bf16), scale [R] fp32 or None, bases [B, Sp // block_kv] the row of each
    key block's first key, whose block_kv keys must be consecutive rows (a page table of pages of a
    multiple of block_kv slots; TMA reads rows past the pool's end as zeros). q, w, positions as for
    gathered_scores_mgpu with Tp a multiple of block_t. Each program takes block_t tokens and
    blocks_per_program key blocks (a multiple of PAGED_BLOCKS_ALIGN, or every block); fp8 keys are
    upcast to bf16 in registers."""
    B, TH, D = q.shape
    Tp, n_blocks = positions.shape[1], bases.shape[1]
    _check_shapes("paged_scores_mgpu", heads, D, q.dtype, block_t=block_t, block_kv=block_kv, key_dtype=rows.dtype)
    if TH != Tp * heads or Tp % block_t or rows.shape[1] != D:
        raise ValueError(f"paged_scores_mgpu: q {q.shape} / positions {positions.shape} / rows {rows.shape} "
                         f"not padded to {block_t} tokens x {heads} heads")
    per = min(blocks_per_program, n_blocks)
    if per < n_blocks and per % PAGED_BLOCKS_ALIGN:
        raise ValueError(f"paged_scores_mgpu: blocks_per_program {blocks_per_program} over {n_blocks} key blocks: "
                         f"a program takes a multiple of {PAGED_BLOCKS_ALIGN} blocks or all of them (its block "
                         f"rows' copy must start 16-byte aligned)")
    width = (pl.cdiv(n_blocks, per) - 1) * per + _bases_per_copy(per)    # the last program's copy ends here,
    width += -width % 4                                  # and TMA needs rows of a multiple of 16 bytes
    bases = jnp.pad(bases.astype(jnp.int32), ((0, 0), (0, width - n_blocks)))
    return _run(q, w, positions, rows, scale, bases, heads=heads, block_t=block_t, block_kv=block_kv, stages=stages,
                write_invisible=write_invisible, per_program=per, interpret=interpret, Sp=n_blocks * block_kv)
