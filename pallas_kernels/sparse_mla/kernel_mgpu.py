"""Sparse MLA prefill as a Mosaic GPU kernel (Hopper: wgmma, warp-specialized), the selected rows
gathered from the pool by cp.async.

Same function as kernel.sparse_mla_pallas with one split: for each query, its heads (the MMA's M, 64)
over its selected rows. One program per query token, three warpgroups:
- a memory warpgroup gathers each block of 64 selected rows (latent [64, C] and rope [64, R]) from the
  pool into a shared-memory stage. Hopper's TMA has no row gather (its gather4 is Blackwell's), so its
  128 threads issue 16-byte cp.async copies, row_threads (4) threads a row, each to the swizzled
  position a TMA copy would have written (the layout wgmma reads), waits for its copies, fences them for the async proxy
  and arrives on the stage's barrier. The wrapper moves each row's selected slots to its front
  (selected_first), so a row's tail is masked by its count alone. Two stages: a block is copied while the one before it is computed.
- two compute warpgroups, each holding its own half of the output columns, O[:, half] += P lat[:, half]
  (acc [64, C/2] fp32 in registers: the whole [64, C] does not fit one warpgroup's registers). The
  scores S = q_lat lat^T + q_rope rope^T ([64 heads, 64 rows], 576 wide: more than half of a block's
  multiply-adds) are shared out one of three ways (`scores`):
  "both": each warpgroup computes every score and the online softmax itself (nothing exchanged; the
  score product runs twice);
  "split_keys": each computes the scores of half the block's rows, the two exchanging their running
  max and probabilities through shared memory every block;
  "alternate": the warpgroups take turns by block (FlashMLA's scheme): the owner of block j computes
  its scores and softmax from the running statistics the other published for block j - 1, publishes
  its probabilities and statistics (max, sum, rescale factor) in shared memory, then both add their
  half of P_j lat_j in block order. One buffer of each serves: a warpgroup overwrites them only after
  its own value product has read what the other published.
The output goes out through the query's shared-memory buffer once both warpgroups are past their last
score product. Decode and verify (row_splits S > 1): program n * S + s takes share s of query n's rows,
so a few queries still fill the SMs; the shares merge by their softmax statistics."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_mla.common import check_sparse_mla_args

BLOCK = 64            # selected rows per step: the scores' N and the value product's K
_HALF_BLOCK = BLOCK // 2   # split_keys: each compute warpgroup's rows of a block
HEADS = 64            # the MMA's M: queries with fewer heads are padded to it
STAGES = 2
_NEG = -1e30          # the running max starts finite: a block with nothing selected gives exp2(-inf) = 0
_CHUNK = 16           # bytes per cp.async
_SWIZZLE = 128        # bytes: the tile row of the (8, 64) bf16 tiling
_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(_SWIZZLE))
# The row reductions of wgmma-layout tiles stay within a warp's quad: the shared memory Pallas reserves
# for cross-warp reductions (2 KiB by default) is not needed, and split_keys' buffers need it.
_NO_REDUCTION_SCRATCH = ({"reduction_scratch_bytes": 0} if "reduction_scratch_bytes" in
                         {f.name for f in dataclasses.fields(plgpu.CompilerParams)} else {})


def mgpu_shape_error(q_lat, q_rope) -> str | None:
    """Why the Mosaic GPU kernel cannot take these operands (None: it can)."""
    H, C, R = q_lat.shape[1], q_lat.shape[-1], q_rope.shape[-1]
    if q_lat.dtype != jnp.bfloat16 or q_rope.dtype != jnp.bfloat16:
        return f"queries must be bf16 (got {q_lat.dtype})"
    if H > HEADS:
        return f"at most {HEADS} heads per query (got {H})"
    if C % 128 or C > 512 or R % 64 or R > 64:
        return f"latent width {C} must be a multiple of 128 up to 512 and rope width {R} 64"
    return None


def _gather_block(layer_gmem, lat_gmem, rope_gmem, slots_gmem, lat_smem, rope_smem, row_threads: int,
                  l2_prefetch: bool):
    """The memory warpgroup's copies of one block: its 128 threads take the block's 64 rows in passes
    of 128 / row_threads rows, row_threads threads a row, thread `lane` of a row copying its 16-byte
    latent and rope chunks row_threads * i + lane (so a warp's copy instruction reads 16 * row_threads
    contiguous bytes, whole 32-byte sectors, of each of 32 / row_threads rows) into the (8, 64)-tiled,
    128-byte-swizzled stage (lat_smem [2, 64, C/2]), where a TMA copy would have put them (an
    unselected slot, -1, copies row 0: the compute masks it). One cp.async group per block.
    l2_prefetch: each copy carries PTX's L2::256B hint (the L2 fetches the 256-byte block around the
    chunk from HBM: a pool row is 1152 contiguous bytes), as FlashMLA's sparse prefill does."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    tiled = plgpu.RefType(transforms=_TILED)
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4 + (tiled, tiled))
    def gather(ctx, layer_ref, lat, rope, slots, lat_dst, rope_dst):
        i32, i64, i8 = (ir.IntegerType.get_signless(w) for w in (32, 64, 8))
        index = ir.IndexType.get()
        c32 = lambda v: arith.constant(i32, v)
        P, C = ir.MemRefType(lat.type).shape[-2:]
        R = ir.MemRefType(rope.type).shape[-1]
        tid = arith.remui(mu.thread_idx(), c32(128))
        lane = arith.remui(tid, c32(row_threads))
        layer = memref.load(layer_ref, [arith.constant(index, 0)])
        pass_rows = [arith.addi(arith.divui(tid, c32(row_threads)), c32(p * 128 // row_threads))
                     for p in range(BLOCK * row_threads // 128)]
        pass_slots = [memref.load(slots, [arith.index_cast(index, row)]) for row in pass_rows]   # loads first

        def copy(src, dst, width, parts, row, pool_row):
            """This thread's chunks row_threads * i + lane of the row of src [L, P, width] into dst
            [parts, 64, width / parts] (row: the block's, pool_row: the pool's)."""
            gptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src))
            gptr = mu.getelementptr(gptr, [arith.muli(pool_row, arith.constant(i64, width * 2))], i8)
            sptr = mu.memref_ptr(dst)
            part_bytes = width * 2 // parts
            chunks = width * 2 // _CHUNK                  # per row
            part_chunks = part_bytes // _CHUNK
            tiles = part_bytes // _SWIZZLE                # 128-byte tile rows per part row
            # tile (row // 8, t) of a part starts at ((row // 8) * tiles + t) * 1024, the row at r8 * 128
            r8 = arith.andi(row, c32(7))
            row_base = arith.addi(arith.muli(arith.shrui(row, c32(3)), c32(tiles * 1024)),
                                  arith.muli(r8, c32(_SWIZZLE)))
            for k in range(chunks // row_threads):
                chunk = arith.addi(c32(row_threads * k), lane)
                part = arith.divui(chunk, c32(part_chunks))
                within_part = arith.remui(chunk, c32(part_chunks))
                t = arith.shrui(within_part, c32(3))
                swz = arith.xori(arith.andi(within_part, c32(7)), r8)
                off = arith.addi(arith.muli(part, c32(64 * part_bytes)),
                                 arith.addi(row_base, arith.addi(arith.muli(t, c32(1024)),
                                                                 arith.muli(swz, c32(_CHUNK)))))
                s = mu.getelementptr(sptr, [off], i8)
                g = mu.getelementptr(gptr, [arith.muli(chunk, c32(_CHUNK))], i8)
                if l2_prefetch:
                    llvm.inline_asm(ir.Type.parse("!llvm.void"), [s, g],
                                    f"cp.async.cg.shared.global.L2::256B [$0], [$1], {_CHUNK};", "r,l",
                                    has_side_effects=True)
                else:
                    nvvm.cp_async_shared_global(s, g, _CHUNK, nvvm.LoadCacheModifierKind.CG)

        for row, slot in zip(pass_rows, pass_slots):
            valid = arith.cmpi(arith.CmpIPredicate.sge, slot, c32(0))
            pool_row = arith.extui(i64, arith.addi(arith.muli(layer, c32(P)), arith.select(valid, slot, c32(0))))
            copy(lat, lat_dst, C, 2, row, pool_row)
            copy(rope, rope_dst, R, 1, row, pool_row)
        nvvm.cp_async_commit_group()

    gather(layer_gmem, lat_gmem, rope_gmem, slots_gmem, lat_smem, rope_smem)


@plgpu.inline_mgpu()
def _await_copies(ctx):
    """Every cp.async group of this thread complete (the block's copies)."""
    from jax._src.lib.mlir.dialects import nvvm
    nvvm.cp_async_wait_group(0)


def _online_softmax_step(s, m_new, m, l, acc):
    """exp2 probabilities of the scaled scores s against the new running max, the running sum and
    output rescaled to it, and the rescale factor alpha (the alternate split publishes it)."""
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    return p, l * alpha + p.sum(axis=1), acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), alpha


def _row_stats(value):
    return plgpu.layout_cast(jnp.full((HEADS,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def _write_out(wg, n, acc, m, l, out_refs, smem):
    """acc / l through the query's shared-memory buffer (free once both warpgroups are past their last
    score product) to the warpgroup's output columns; with a stats output, warpgroup 0 also writes the
    softmax's running max m and sum l (log2 units of the scaled scores) for merging row splits."""
    o_ref, *stats_ref = out_refs
    q_lat_smem, done = smem["q_lat"], smem["done"]
    half = q_lat_smem.shape[-1]
    some = l > 0
    out = acc * lax.broadcast_in_dim(jnp.where(some, 1.0 / jnp.where(some, l, 1.0), 0.0), acc.shape, [0])
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)
    q_lat_smem[wg] = out.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_lat_smem.at[wg], o_ref.at[n, :, pl.ds(wg * half, half)])
    if stats_ref:
        @pl.when(wg == 0)
        def _stats():
            stats_smem = smem["stats"]
            stats_smem[0] = m
            stats_smem[1] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stats_smem, stats_ref[0].at[n])
    plgpu.wait_smem_to_gmem(0)


def _block_scores(smem, slot, rows: pl.Slice):
    """Scores [64 heads, rows] of the query against the stage's selected rows `rows`: the latent's two
    halves and the rope part, three wgmmas into one fp32 accumulator."""
    q_lat_smem, q_rope_smem, lat_smem, rope_smem = smem["q_lat"], smem["q_rope"], smem["lat"], smem["rope"]

    def scores(acc_ref):
        for h in range(2):
            plgpu.wgmma(acc_ref, q_lat_smem.at[h], lat_smem.at[slot, h, rows].transpose((1, 0)))
        plgpu.wgmma(acc_ref, q_rope_smem, rope_smem.at[slot, rows].transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(scores, plgpu.ACC((HEADS, rows.size), jnp.float32))


def _scaled_block_scores(smem, j, end, c):
    """Block j's scores once its rows are in (the stage's barrier awaited), scaled by c (log2 units),
    the keys at or past the query's count `end` masked to -inf."""
    slot = lax.rem(j, STAGES)
    plgpu.barrier_wait(smem["k_bar"].at[slot])
    s = _block_scores(smem, slot, pl.ds(0, BLOCK))
    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + j * BLOCK
    return jnp.where(cols < end, s * c, -jnp.inf)


def _compute_all_keys(wg, n, end, blocks, scale, out_refs, smem):
    """Compute warpgroup wg: the whole block's scores (so it has every probability without exchanging
    any), its own half of the output columns."""
    q_lat_smem, lat_smem = smem["q_lat"], smem["lat"]
    k_free = smem["k_free"]
    half = q_lat_smem.shape[-1]
    c = scale * math.log2(math.e)
    acc = plgpu.layout_cast(jnp.full((HEADS, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def block(j, carry):
        acc, m, l = carry
        slot = lax.rem(j, STAGES)
        s = _scaled_block_scores(smem, j, end, c)
        m_new = jnp.maximum(m, s.max(axis=1))
        p, l, acc, _ = _online_softmax_step(s, m_new, m, l, acc)

        def values(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), lat_smem.at[slot, wg])
        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc, m_new, l

    acc, m, l = lax.fori_loop(0, blocks, block, (acc, _row_stats(_NEG), _row_stats(0.0)))
    _write_out(wg, n, acc, m, l, out_refs, smem)


def _compute_split_keys(w, n, end, blocks, scale, out_refs, smem):
    """Compute warpgroup w (static): the scores of its half of the block's rows only, the running max
    and the probabilities exchanged with the other warpgroup through shared memory (so the 576-wide
    score product is computed once, not twice), then its half of the output columns over all rows.
    One shared buffer each suffices: a warpgroup writes its max of block j + 1 only after passing block
    j's probability barrier, which the other reaches after reading that max; it writes its
    probabilities of block j + 1 only after passing block j + 1's max barrier, which the other reaches
    after its value product of block j completed."""
    q_lat_smem, lat_smem = smem["q_lat"], smem["lat"]
    k_bar, k_free, stat_smem, p_smem = smem["k_bar"], smem["k_free"], smem["stat"], smem["p"]
    x_bar, p_bar = smem["x_bar"], smem["p_bar"]
    half = q_lat_smem.shape[-1]
    rows = pl.ds(w * _HALF_BLOCK, _HALF_BLOCK)
    c = scale * math.log2(math.e)
    acc = plgpu.layout_cast(jnp.full((HEADS, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def other_stat(value):
        stat_smem[w] = value
        plgpu.barrier_arrive(x_bar)
        plgpu.barrier_wait(x_bar)
        return plgpu.load(stat_smem.at[1 - w], layout=plgpu.Layout.WGMMA.reduce(1))

    def block(j, carry):
        acc, m, l = carry
        slot = lax.rem(j, STAGES)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _block_scores(smem, slot, rows)
        cols = (plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                + (j * BLOCK + w * _HALF_BLOCK))
        s = jnp.where(cols < end, s * c, -jnp.inf)
        m_mine = jnp.maximum(m, s.max(axis=1))
        m_new = jnp.maximum(m_mine, other_stat(m_mine))
        p, l, acc, _ = _online_softmax_step(s, m_new, m, l, acc)
        p_smem[:, pl.ds(w * _HALF_BLOCK, _HALF_BLOCK)] = p.astype(jnp.bfloat16)
        plgpu.barrier_arrive(p_bar)
        plgpu.barrier_wait(p_bar)
        p_all = plgpu.load(p_smem, layout=plgpu.Layout.WGMMA)   # A from registers: K = 64 rows

        def values(acc_ref):
            plgpu.wgmma(acc_ref, p_all, lat_smem.at[slot, w])
        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc, m_new, l

    acc, m, l = lax.fori_loop(0, blocks, block, (acc, _row_stats(_NEG), _row_stats(0.0)))
    _write_out(w, n, acc, m, l + other_stat(l), out_refs, smem)


def _compute_alternate(w, n, end, blocks, scale, out_refs, smem):
    """Compute warpgroup w (static) of the "alternate" split: blocks w, w + 2, ... are its own (scores,
    softmax, published), the others' probabilities are read from shared memory; every block's value
    product for its half of the output columns, in block order. `blocks` is even (the last block of
    an odd count is all masked: probabilities 0, rescale 1)."""
    q_lat_smem, lat_smem = smem["q_lat"], smem["lat"]
    k_bar, k_free, p_smem, stat_smem, p_bar = smem["k_bar"], smem["k_free"], smem["p"], smem["stat"], smem["p_bar"]
    half = q_lat_smem.shape[-1]
    c = scale * math.log2(math.e)
    stat_layout = plgpu.Layout.WGMMA.reduce(1)

    def value_product(acc, p, slot):
        def values(acc_ref):
            plgpu.wgmma(acc_ref, p, lat_smem.at[slot, w])
        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

    def own(j, acc, m, l):
        slot = lax.rem(j, STAGES)
        s = _scaled_block_scores(smem, j, end, c)
        m_new = jnp.maximum(m, s.max(axis=1))
        p, l, acc, alpha = _online_softmax_step(s, m_new, m, l, acc)
        p = p.astype(jnp.bfloat16)
        p_smem[...] = p
        stat_smem[0] = m_new
        stat_smem[1] = l
        stat_smem[2] = alpha
        plgpu.commit_smem()               # the stores fenced for the other warpgroup's wgmma
        plgpu.barrier_arrive(p_bar.at[w])
        return value_product(acc, p, slot), m_new, l

    def other(j, acc):
        slot = lax.rem(j, STAGES)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(p_bar.at[1 - w])
        m, l, alpha = (plgpu.load(stat_smem.at[i], layout=stat_layout) for i in range(3))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return value_product(acc, p_smem, slot), m, l

    def pair(i, carry):
        acc, m, l = carry
        if w == 0:
            acc, m, l = own(2 * i, acc, m, l)
            return other(2 * i + 1, acc)
        acc, m, l = other(2 * i, acc)
        return own(2 * i + 1, acc, m, l)

    acc = plgpu.layout_cast(jnp.full((HEADS, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    acc, m, l = lax.fori_loop(0, blocks // 2, pair, (acc, _row_stats(_NEG), _row_stats(0.0)))
    _write_out(w, n, acc, m, l, out_refs, smem)


SCORES = ("both", "split_keys", "alternate")
ROW_THREADS = (2, 4, 8)   # threads a row in one pass of a block's copies: the rope row's 8 chunks at most
DEFAULT_ROW_THREADS = 4   # best or within 2% of it from 8 decode to 8192 prefill queries (docs/perf.md)


def _kernel(layer_ref, ends_ref, q_lat_ref, q_rope_ref, slots_ref, lat_ref, rope_ref, *out_refs, scale: float,
            n_queries: int, scores: str, row_splits: int, row_threads: int, l2_prefetch: bool, **smem):
    q_lat_smem = smem["q_lat"]
    k_bar, k_free, q_bar, done = smem["k_bar"], smem["k_free"], smem["q_bar"], smem["done"]
    v = n_queries * row_splits - 1 - lax.axis_index("n")   # the latest queries first: they select the most rows
    wg = lax.axis_index("wg")
    step = 2 * BLOCK if scores == "alternate" else BLOCK       # alternate: blocks in pairs
    if row_splits == 1:
        n, first, end = v, 0, ends_ref[v]              # the query's selected rows: slots [0, end)
    else:                                              # program v: share v % S of query v // S (split_rows)
        n = lax.div(v, row_splits)
        total = ends_ref[n]
        share = row_share(total, row_splits, step)
        first = jnp.minimum(lax.rem(v, row_splits) * share, total)
        end = jnp.minimum(total - first, share)        # slots [first, first + end)
    blocks = (end + step - 1) // step * (step // BLOCK)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar)
        if scores == "both":
            _compute_all_keys(wg, v, end, blocks, scale, out_refs, smem)
        else:
            compute = _compute_split_keys if scores == "split_keys" else _compute_alternate
            for w in range(2):
                pl.when(wg == w)(functools.partial(compute, w, v, end, blocks, scale, out_refs, smem))

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        q_rope_smem, lat_smem, rope_smem = smem["q_rope"], smem["lat"], smem["rope"]
        half = q_lat_smem.shape[-1]
        for h in range(2):
            plgpu.copy_gmem_to_smem(q_lat_ref.at[n, :, pl.ds(h * half, half)], q_lat_smem.at[h], q_bar)
        plgpu.copy_gmem_to_smem(q_rope_ref.at[n], q_rope_smem, q_bar)

        def issue(i):
            slot = lax.rem(i, STAGES)
            _gather_block(layer_ref, lat_ref, rope_ref, slots_ref.at[n, pl.ds(first + i * BLOCK, BLOCK)], lat_smem.at[slot],
                          rope_smem.at[slot], row_threads, l2_prefetch)

        def ready(i):
            _await_copies()
            plgpu.commit_smem()           # fence the copies for wgmma's async proxy, the warpgroup synced
            plgpu.barrier_arrive(k_bar.at[lax.rem(i, STAGES)])

        @pl.when(blocks > 0)
        def _():
            issue(0)

            @pl.loop(1, blocks)
            def _next(i):
                ready(i - 1)

                @pl.when(i >= STAGES)
                def _():
                    plgpu.barrier_wait(k_free.at[lax.rem(i, STAGES)])
                issue(i)

            ready(blocks - 1)

            @pl.loop(jnp.maximum(blocks - STAGES, 0), blocks)
            def _drain(i):                   # every arrival awaited before the barriers go
                plgpu.barrier_wait(k_free.at[lax.rem(i, STAGES)])


def selected_first(slots):
    """Each row's selected slots (>= 0) moved to its front in their order, -1 after them, and how many
    there are: the kernel then masks a row's tail by a count (its column index against one scalar) and
    never loads a per-row mask (attention does not depend on the rows' order)."""
    N, K = slots.shape
    sel = slots >= 0
    dest = jnp.where(sel, jnp.cumsum(sel, axis=1, dtype=jnp.int32) - 1, K)        # K: dropped
    front = jnp.full((N, K), -1, jnp.int32).at[jnp.arange(N)[:, None], dest].set(slots, mode="drop")
    return front, jnp.sum(sel, axis=1, dtype=jnp.int32)


def packed_slots(slots):
    """selected_first's result for rows that are already packed (selected slots first, -1 after): the
    slots as they are and their count. A sum, where the compaction takes a per-row cumulative sum and a
    scatter (on the H200 a batch-1 decode step spent 31-34 us a layer in one fusion of that cumsum
    and sum, against the kernel's 7.7: docs/perf.md, 2026-12-04 sixth session)."""
    slots = slots.astype(jnp.int32)
    return slots, jnp.sum(slots >= 0, axis=1, dtype=jnp.int32)


def sparse_mla_mgpu(q_lat, q_rope, latent, k_rope, layer, slots, scale: float, *, lane_semantics: bool = False,
                    scores: str = "both", with_stats: bool = False, row_splits: int = 1,
                    row_threads: int = DEFAULT_ROW_THREADS, l2_prefetch: bool = False, packed: bool = False):
    """sparse_mla_reference as one Mosaic GPU kernel call (bf16, prefill-sized N: one program per
    query). q_lat [N, H, C], q_rope [N, H, R], latent [L, P, C], k_rope [L, P, R], slots [N, K].
    scores: how the two compute warpgroups share out the score product ("both", "split_keys",
    "alternate": the module docstring).
    with_stats: also each query's softmax statistics [N, 2, H] fp32 (running max m and sum l in log2
    units of the scaled scores: its log-sum-exp is (m + log2 l) / log2 e), returned second.
    row_splits S > 1 (decode, verify; with_stats): S programs per query, program n * S + s over share s
    of its selected rows (split_rows); outputs and statistics [N * S, ...], for merge_row_splits.
    row_threads (ROW_THREADS): the memory warpgroup's threads per row in one copy pass (_gather_block).
    l2_prefetch: the row copies carry the L2::256B prefetch hint (_gather_block).
    packed: the caller promises each row of slots lists its selected slots first, -1 after them (the
    indexer's selection does): the kernel reads them as they are, without selected_first's
    per-row compaction."""
    check_sparse_mla_args(q_lat, q_rope, latent, k_rope, slots)
    err = mgpu_shape_error(q_lat, q_rope)
    if err is not None:
        raise ValueError(f"sparse_mla_mgpu: {err}")
    if scores not in SCORES:
        raise ValueError(f"sparse_mla_mgpu: scores must be one of {SCORES}, got {scores!r}")
    if row_threads not in ROW_THREADS:
        raise ValueError(f"sparse_mla_mgpu: row_threads must be one of {ROW_THREADS}, got {row_threads}")
    if row_splits < 1 or (row_splits > 1 and not with_stats):
        raise ValueError(f"sparse_mla_mgpu: row_splits {row_splits} must be >= 1, and > 1 only with with_stats "
                         "(the splits are merged by their statistics)")
    N, H, C = q_lat.shape
    R = q_rope.shape[-1]
    if H != HEADS:
        pad = ((0, 0), (0, HEADS - H), (0, 0))
        q_lat, q_rope = jnp.pad(q_lat, pad), jnp.pad(q_rope, pad)
    slots, ends = packed_slots(slots) if packed else selected_first(slots.astype(jnp.int32))
    slots = jnp.pad(slots, ((0, 0), (0, -slots.shape[1] % (2 * BLOCK))), constant_values=-1)
    tiled = _TILED
    smem = dict(q_lat=plgpu.SMEM((2, HEADS, C // 2), jnp.bfloat16, transforms=tiled),
                q_rope=plgpu.SMEM((HEADS, R), jnp.bfloat16, transforms=tiled),
                lat=plgpu.SMEM((STAGES, 2, BLOCK, C // 2), jnp.bfloat16, transforms=tiled),
                rope=plgpu.SMEM((STAGES, BLOCK, R), jnp.bfloat16, transforms=tiled))
    if with_stats:
        smem.update(stats=plgpu.SMEM((2, HEADS), jnp.float32))
    if scores == "split_keys":   # allocated before the barriers: 64 bytes short of the limit otherwise
        smem.update(p=plgpu.SMEM((HEADS, BLOCK), jnp.bfloat16),
                    stat=plgpu.SMEM((2, HEADS), jnp.float32),
                    x_bar=plgpu.Barrier(num_arrivals=2), p_bar=plgpu.Barrier(num_arrivals=2))
    if scores == "alternate":    # the probabilities as wgmma's A operand; p_bar[w]: w published
        smem.update(p=plgpu.SMEM((HEADS, BLOCK), jnp.bfloat16, transforms=tiled),
                    stat=plgpu.SMEM((3, HEADS), jnp.float32),
                    p_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))
    smem.update(k_bar=plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
                k_free=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
                q_bar=plgpu.Barrier(num_arrivals=3),
                done=plgpu.Barrier(num_arrivals=2))
    programs = N * row_splits
    out_type = jax.ShapeDtypeStruct((programs, HEADS, C), jnp.bfloat16)
    if with_stats:
        out_type = (out_type, jax.ShapeDtypeStruct((programs, 2, HEADS), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, n_queries=N, scores=scores, row_splits=row_splits,
                          row_threads=row_threads, l2_prefetch=l2_prefetch),
        out_type=out_type, grid=(programs,), grid_names=("n",),
        num_threads=3, thread_name="wg", scratch_types=smem,
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane if lane_semantics
            else plgpu.LoweringSemantics.Warpgroup, **_NO_REDUCTION_SCRATCH))
    out = kernel(jnp.asarray(layer, jnp.int32).reshape(1), ends, q_lat.astype(jnp.bfloat16),
                 q_rope.astype(jnp.bfloat16), slots, latent.astype(jnp.bfloat16), k_rope.astype(jnp.bfloat16))
    if with_stats:
        return out[0][:, :H], out[1][:, :, :H]
    return out[:, :H]


def row_share(count, row_splits: int, step: int):
    """Rows of each share when `count` selected rows (>= 0; a scalar inside the kernel, an array in
    split_rows) are cut in row_splits shares: ceil(count / row_splits) up to whole blocks of `step`."""
    return ((count + row_splits - 1) // row_splits + step - 1) // step * step


def split_rows(slots, row_splits: int, step: int = BLOCK):
    """[N, K] slots -> [N * S, W]: the rows program n * S + s of a row-split kernel call reads (the
    kernel computes the same shares itself): query n's selected slots moved to the front
    (selected_first), its count c cut in S contiguous shares of ceil(c / S) rounded up to whole
    blocks (`step` rows), the last shares short or empty; -1 pads."""
    N, K = slots.shape
    front, ends = selected_first(slots.astype(jnp.int32))
    S = row_splits
    share = row_share(ends, S, step)                                          # [N]
    width = row_share(K, S, step)
    first = jnp.minimum(jnp.arange(S, dtype=jnp.int32)[None, :] * share[:, None], ends[:, None])   # [N, S]
    count = jnp.minimum(ends[:, None] - first, share[:, None])
    lane = jnp.arange(width, dtype=jnp.int32)
    idx = jnp.minimum(first[:, :, None] + lane, K - 1)                        # [N, S, W]
    rows = jnp.take_along_axis(front[:, None, :], idx, axis=2)
    return jnp.where(lane < count[:, :, None], rows, -1).reshape(N * S, width)


def merge_row_splits(out, stats, row_splits: int, dtype):
    """The attention of each query from its splits' normalized outputs out [N * S, H, C] and softmax
    statistics stats [N * S, 2, H] (max m, sum l; log2 units): sum_s out_s l_s 2^(m_s - M) over
    sum_s l_s 2^(m_s - M), M the largest m of a split with rows; zeros for a query with none."""
    NS, H, C = out.shape
    N = NS // row_splits
    m, l = (stats[:, i].reshape(N, row_splits, H) for i in (0, 1))
    some = l > 0
    top = jnp.max(jnp.where(some, m, -jnp.inf), axis=1, keepdims=True)
    w = jnp.where(some, jnp.exp2(m - jnp.where(jnp.isfinite(top), top, 0.0)) * l, 0.0)      # [N, S, H]
    total = w.sum(axis=1)
    o = jnp.einsum("nsh,nshc->nhc", w, out.reshape(N, row_splits, H, C).astype(jnp.float32))
    return jnp.where(total[..., None] > 0, o / jnp.where(total > 0, total, 1.0)[..., None], 0.0).astype(dtype)


def sparse_mla_mgpu_rows(q_lat, q_rope, latent, k_rope, layer, slots, scale: float, *, row_splits: int,
                         row_threads: int = DEFAULT_ROW_THREADS, l2_prefetch: bool = False, packed: bool = False):
    """sparse_mla_mgpu for few queries (decode, verify): each query's selected rows cut in row_splits
    shares (split_rows), one program each returning its normalized output and softmax statistics,
    merged in fp32 (merge_row_splits); one share is the plain kernel."""
    if row_splits == 1:
        return sparse_mla_mgpu(q_lat, q_rope, latent, k_rope, layer, slots, scale, row_threads=row_threads,
                               l2_prefetch=l2_prefetch, packed=packed)
    out, stats = sparse_mla_mgpu(q_lat, q_rope, latent, k_rope, layer, slots, scale, with_stats=True,
                                 row_splits=row_splits, row_threads=row_threads, l2_prefetch=l2_prefetch,
                                 packed=packed)
    return merge_row_splits(out, stats, row_splits, q_lat.dtype)
