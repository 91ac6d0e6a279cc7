"""The routed experts' grouped matmul as a Mosaic GPU kernel (Hopper: TMA + wgmma), over the padded
row layout of `plan.block_plan`: row tile t of x belongs to expert tile_expert[t] (or to none, -1).

    out[t-th tile] = x[t-th tile] @ w[tile_expert[t]]                               (plain)
    out[t-th tile] = silu(x[tile] @ gate[e]) * (x[tile] @ up[e]),  e = tile_expert[t]  (gate_up)

One persistent program per SM walks the (row tile, column block) grid; a tile of no expert costs a
scalar read and a branch, never a weight read (jax's ragged_dot_mgpu instead runs the whole K loop
for the empty and straddling tiles of a ragged layout: at 256 experts that was half its time,
docs/perf.md). Each tile is one expert's, so loads and stores are whole TMA tiles. gate_up keeps two
accumulators fed by one x block per K step and applies SiLU * up in fp32 before the one bf16 store:
the [rows, 2 * width] intermediate never reaches HBM.

fp8 (DeepSeek/DeepGEMM's block scaling): x is e4m3 with one fp32 scale per row per 128 columns, the
weights e4m3 stored K-major ([E, N, K], as the checkpoints hold them: 8-bit wgmma takes both operands
K-major) with one fp32 scale per 128 x 128 block. Each 128-wide K step's product goes to a fresh
accumulator and is added to the fp32 sum in registers times its row scales and its block's scale.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.fp8_rows import GROUP as FP8_BLOCK


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 8
    """Column blocks walked together before moving to the next row tiles (L2 reuse of the x tiles)."""
    programs: int = 132
    """Persistent programs: one per SM of the H100/H200. 0: one program a tile, which the hardware starts in
    tile order as SMs free up, so neighbouring tiles (an expert's row tiles, reading the same weight blocks)
    run together instead of drifting apart over persistent programs' many tiles (the L2 keeps a block
    ~17 us of a 256-expert prefill call's traffic: docs/perf.md, 2026-12-06 twenty-fourth session)."""
    compute_wgs: int = 1
    """2 runs the warp-specialized kernel (_kernel_ws): a producer warpgroup issues the
    TMA loads and two compute warpgroups each take half of a tile (rows when block_m is 128, columns
    otherwise), so one rescales its step's product while the other's wgmma runs (DeepGEMM's scheme).
    3 (192-row tiles, 64 rows each): while one promotes, two have products on the tensor cores; each
    compute thread gets 160 registers (the producer 24) instead of 232."""
    cluster_n: int = 1
    """2 (warp-specialized kernel only): programs run in clusters of two on neighbouring column blocks
    of one row tile, and each x tile is loaded once for both by TMA multicast (half the x traffic
    from L2)."""
    column_pairs: bool = False
    """fp8, warp-specialized, without `up`: each program takes two neighbouring column blocks of w as
    two accumulators fed by one x block per step (the gate_up call's shape: a [block_m, 2 block_n]
    output tile, half the x loads and pipeline fills per output column)."""
    joint_products: bool = False
    """fp8, warp-specialized: a step's products with both weights (gate and up, or a column pair) are
    issued together, each into its own fresh accumulator, and awaited once, instead of one after the
    other with a wait between. Half the per-step chain of issue, wait and rescale, which bounds a call
    with few rows per expert (decode); twice the fresh accumulators in registers, so only where a
    warpgroup's part of the tile is at most 64 x 64."""
    interleaved_gate_up: bool = False
    """fp8 gate_up (w and up given), warp-specialized, 128 x 128 tiles (each warpgroup 64 rows) or 64 x 256
    (each warpgroup 128 columns): each step's 64-row blocks of gate and up are loaded side by side into
    one shared-memory buffer (gate, up, gate, up: the tile's block_n rows), so a warpgroup's one m64n128
    product holds 64 gate and 64 up columns (the x tile read from shared memory once, not once per
    weight); its halves are summed apart with their own block scales and paired by the epilogue. A
    tile computes block_n / 2 output columns."""
    chained_tiles: bool = False
    """Warp-specialized: a program's tiles run as one continued K pipeline (emit_pipeline_warp_specialized's
    pipeline_state: its first used tile START, the next STEADY, its last STOP), so the producer loads
    the next tile's first K blocks while the compute warpgroups finish and store this one, instead of
    waiting at each tile's end for them to consume the last. Needs the K steps a multiple of the stages."""
    unscaled_probe: bool = False
    """Benchmark probe, never a model's tiling (fp8, warp-specialized): each step's products accumulate in
    place with no block scales, as bf16's do (issued together, awaited once) - the same pipeline and
    wgmma shapes without the per-step promotion (a fresh zeroed accumulator, its wait, the scaled add).
    Its output ignores the scales (x_q @ w_q); timed beside the scaled tiling it says what promotion costs."""
    fence_row_scales: bool = True
    """fp8, warp-specialized: a proxy fence and warpgroup barrier (commit_smem) after each step's read of its
    row scales from shared memory, so every thread's read is ordered before the slot's release (one
    arrival a warpgroup) and the producer's next TMA write there. False (a probe, `_nf` in
    bench_moe_tilings) drops it: in SASS a MEMBAR.ALL.CTA, FENCE.VIEW.ASYNC.S and BAR.SYNC a step; on the
    H100 (docs/perf.md, 2026-12-05 fourteenth session) 8192 x 16 gate_up 3.31 -> 3.13 ms (128 columns),
    3.14 -> 3.02 (interleaved), down 1.60 -> 1.56, at 256 experts within +-1.4%. Not the default: the
    interpreter's race detector reports the unfenced read against that TMA write, as the PTX memory
    model does (CUTLASS and DeepGEMM release a slot once per warp, after each warp's own reads)."""
    step_blocks: int = 1
    """fp8, warp-specialized, one product a K block (interleaved gate_up, or one weight: down): 128-deep
    K blocks a pipeline step loads (1 or 2). With two a compute warpgroup issues each block's product
    into a fresh accumulator and adds the first's into its sums while the second's runs, the second's
    after its own wait: one exposed promotion, barrier
    wait, row-scale read and fence a step instead of one a block. The same additions in the same order
    as 1 (outputs bit-equal); 64 more fp32 registers a thread (a 64 x 128 part: 64 of sums and two
    fresh 64, where one block a step reaches R155 of the 232 a compute thread gets)."""
    stagger_warpgroups: bool = False
    """fp8, warp-specialized, scaled: at a tile's first step (chained: the program's first tile's) compute
    warpgroup w issues its products only once warpgroup w - 1's first step is done. Released by one stage
    barrier, the warpgroups otherwise issue together, share the tensor cores, finish together and all
    promote while the tensor cores idle; started apart they stay apart if the tensor cores are shared
    between the warpgroups' products (a model of that: docs/perf.md, 2026-12-07 thirty-third session).
    The same additions in the same order: outputs bit-equal to the tiling without."""
    k_splits: int = 1
    """Programs per output tile, each summing k_steps / k_splits consecutive K steps into an fp32
    partial [k_splits, P, N] that the call adds up after the kernel (split-K; no fused gate/up). For
    calls with fewer output tiles than SMs: a decode-sized dense linear (one row tile, N / block_n
    tiles, e.g. 16 for a 2048-wide output) otherwise streams its weights through 16 of 132 SMs."""


def shape_error(x, w, tiling: Tiling, fp8: bool = False) -> str | None:
    """Why the kernel cannot take these operands (None: it can). fp8: w is [E, N, K]."""
    P, K = x.shape
    if fp8:
        _, N, K2 = w.shape
        if x.dtype != jnp.float8_e4m3fn or w.dtype != jnp.float8_e4m3fn:
            return f"fp8 operands must be float8_e4m3fn (got {x.dtype}, {w.dtype})"
        if tiling.block_k != FP8_BLOCK or FP8_BLOCK % tile_columns(tiling) and scale_slices(tiling) < 2:
            return (f"fp8 needs block_k {FP8_BLOCK} (one scale block per step) and a tile's output columns dividing "
                    f"it, or slices of a 128-row tile's columns in two compute warpgroups (scale_slices; {tiling})")
    else:
        _, K2, N = w.shape
    if not fp8 and (jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
                    or x.dtype != w.dtype):
        return f"operands must be bf16 or f16 of one dtype (got {x.dtype}, {w.dtype})"
    if K != K2:
        return f"x has {K} columns, the weights {K2} rows"
    if K % tiling.block_k or N % tile_columns(tiling) or N == 0:
        return (f"K {K} and N {N} must be multiples of block_k {tiling.block_k} and of a tile's output columns "
                f"{tile_columns(tiling)}, N not 0")
    if P % tiling.block_m:
        return f"rows {P} must be a multiple of block_m {tiling.block_m} (the padded layout)"
    if tiling.block_m % 64 or tiling.block_n % 8 or tiling.block_k * x.dtype.itemsize != 128:
        return f"tiling {tiling} does not fit one warpgroup's wgmma with 128-byte swizzled K blocks"
    if tiling.programs < 0:
        return f"programs {tiling.programs}: a count, or 0 for one a tile"
    if tiling.compute_wgs not in (1, 2, 3):
        return f"compute_wgs {tiling.compute_wgs}: 1, 2 or 3"
    if tiling.compute_wgs == 2 and (tiling.block_m not in (64, 128) or tiling.block_m == 64 and tiling.block_n % 128):
        return f"two compute warpgroups split 128 rows or, at block_m 64, a multiple of 128 columns ({tiling})"
    if tiling.compute_wgs == 3 and tiling.block_m != 192:
        return f"three compute warpgroups split 192 rows ({tiling})"
    pair = 2 if tiling.column_pairs else 1
    if tiling.column_pairs and (not fp8 or tiling.compute_wgs != 2 or N % (2 * tiling.block_n)):
        return f"column_pairs: fp8, two compute warpgroups and N {N} a multiple of 2 x block_n ({tiling})"
    if tiling.joint_products:
        part = tiling.block_m * tiling.block_n // 2
        if not fp8 or tiling.compute_wgs != 2 or part > 64 * 64:
            return (f"joint_products: fp8, two compute warpgroups and each one's part of the tile at most 64 x 64 "
                    f"({tiling})")
    k_steps = K // tiling.block_k
    if tiling.k_splits < 1 or k_steps % tiling.k_splits:
        return f"k_splits {tiling.k_splits}: a divisor of the {k_steps} K steps"
    if tiling.interleaved_gate_up and not (
            fp8 and warp_specialized(tiling) and (tiling.block_m, tiling.block_n) in INTERLEAVED_TILES
            and not (tiling.column_pairs or tiling.joint_products or tiling.k_splits > 1)):
        tiles = " or ".join(f"{m} x {n}" for m, n in INTERLEAVED_TILES)
        return (f"interleaved_gate_up: fp8, warp-specialized, on {tiles} tiles (a warpgroup's part one chunk of "
                f"each), without column pairs, joint products or K splits ({tiling})")
    if tiling.step_blocks not in (1, 2) or tiling.step_blocks > 1 and not (
            fp8 and warp_specialized(tiling) and k_steps % (tiling.step_blocks * tiling.k_splits) == 0
            and not (tiling.joint_products or tiling.column_pairs)):
        return (f"step_blocks {tiling.step_blocks}: 1, or 2 with fp8, warp-specialized, one product a K "
                f"block (no joint or column-pair products) and the K steps of a split a multiple "
                f"of it ({tiling})")
    if tiling.unscaled_probe and not (fp8 and warp_specialized(tiling)):
        return f"unscaled_probe: fp8, warp-specialized ({tiling})"
    if tiling.stagger_warpgroups and not (fp8 and warp_specialized(tiling) and not tiling.unscaled_probe):
        return f"stagger_warpgroups: fp8, warp-specialized, scaled ({tiling})"
    if tiling.chained_tiles and not can_chain(tiling, K):
        return (f"chained_tiles: warp-specialized, each tile's {k_steps // tiling.k_splits} K steps a "
                f"multiple of the {tiling.stages} stages, and not interleaved gate_up with step_blocks 2 and row "
                f"scales in shared memory ({tiling})")
    if tiling.cluster_n not in (1, 2) or tiling.cluster_n == 2 and (
            not warp_specialized(tiling) or (column_tiles(tiling, N) // pair) % 2 or tiling.programs % 2):
        return (f"cluster_n {tiling.cluster_n}: 1, or 2 with two compute warpgroups, an even number of column "
                f"blocks ({column_tiles(tiling, N) // pair}) and of programs")
    return None


WIDE_TILE = 192
"""Weight rows of the wide fp8 tiles (KernelPolicy.fp8_wide_tiles): one m64n192 product a warpgroup,
its fresh accumulator and its sums 96 fp32 registers each, within the 232 a compute thread gets (one
weight's; gate and up interleaved in 128 x 192 tiles, 96-row chunks of each promoted in 32-column slices,
ran slower than 128 x 128 on the H200: docs/perf.md, 2026-12-06 nineteenth session)."""
INTERLEAVED_TILES = ((128, 128), (64, 256), (192, 128))
"""(block_m, block_n) of Tiling.interleaved_gate_up: a warpgroup's part holds one chunk of gate's rows and
one of up's, 64 each (128 x 128 prefill, 64 x 256 decode tiles, 192 x 128 in three compute warpgroups)."""


def scale_slices(t: Tiling) -> int:
    """Slices of slice_columns(t) columns, each with its own weight block scale, in which a warpgroup of
    fp8 tiling t promotes its product (of each weight, interleaved): 1 where its output columns lie in one
    128-wide scale block (they divide it), else 3: a 192-column tile of one weight straddles two blocks
    (DeepGEMM's widest Hopper tile with 128 x 128 weight blocks) in 64-column slices. Only 128-row tiles in
    two compute warpgroups, one K block a step, neither joint nor paired, take slices (0: t cannot)."""
    _, _, out_sn = warpgroup_part(t)
    if FP8_BLOCK % out_sn == 0:
        return 1
    if (out_sn % 32 or t.compute_wgs != 2 or t.block_m != 128 or t.step_blocks != 1
            or t.joint_products or t.column_pairs):
        return 0
    return out_sn // slice_columns(t)


def slice_columns(t: Tiling) -> int:
    """Columns of a slice of a warpgroup's output columns that takes one weight block scale
    (scale_slices): the largest that divides both them and the 128-wide scale block."""
    return math.gcd(warpgroup_part(t)[2], FP8_BLOCK)


def column_tiles(t: Tiling, N: int) -> int:
    """Column tiles of tiling t over N output columns."""
    return -(-N // tile_columns(t))


def can_chain(t: Tiling, K: int) -> bool:
    """Whether t's tiles can run chained (chained_tiles) over K inputs: warp-specialized, each tile's K
    pipeline steps (K / block_k / step_blocks, over its K splits) a multiple of the stages or fewer, and
    not interleaved gate_up in two-block steps (its weight slots are views of one shared buffer; chained,
    that kernel never finishes in the interpreter: its compute warpgroups wait on a produced barrier the
    producer never fills. One weight in two-block steps finishes, bit-equal; so did interleaved gate_up
    with its row scales read from global memory, a probe since removed)."""
    steps = K // t.block_k // t.k_splits // t.step_blocks
    return (warp_specialized(t) and (steps <= t.stages or steps % t.stages == 0)
            and not (t.interleaved_gate_up and t.step_blocks > 1))


def chained(t: Tiling, K: int) -> Tiling:
    """t with chained_tiles where it applies (can_chain), else t."""
    return dataclasses.replace(t, chained_tiles=True) if can_chain(t, K) else t


def warp_specialized(t: Tiling) -> bool:
    """Whether tiling t runs the warp-specialized kernel (_kernel_ws: a producer and compute warpgroups)."""
    return t.compute_wgs >= 2


def split_rows(t: Tiling) -> bool:
    """Whether the warp-specialized kernel's compute warpgroups split a tile's rows, 64 each (else two
    split a 64-row tile's columns)."""
    return t.block_m == 64 * max(t.compute_wgs, 2)


def warpgroup_part(t: Tiling) -> tuple[int, int, int]:
    """(rows, columns, output columns) of the part of a tile one compute warpgroup of the warp-specialized
    kernel holds: 128- and 192-row tiles split by rows, 64-row ones by columns; interleaved gate_up outputs
    half of its columns (gate's, paired with up's)."""
    sm, sn = (64, t.block_n) if split_rows(t) else (t.block_m, t.block_n // 2)
    return sm, sn, sn // 2 if t.interleaved_gate_up else sn


SMEM_BYTES = 232448
"""Shared memory a Hopper thread block may allocate (227 KB; Mosaic GPU refuses a kernel above it)."""


def ws_fp8_smem_bytes(t: Tiling) -> int:
    """Shared memory the warp-specialized fp8 kernel allocates for one-product-a-block tiling t
    (interleaved gate_up or one weight) with 2-byte outputs: each stage's K blocks (x, row scales,
    weights) and the double-buffered output tile, plus 2 KB for the pipeline's barriers and alignment
    (a three-stage two-block down tile: 233520 bytes measured against 232448 estimated before that
    allowance)."""
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    block = bm * bk + bn * bk + 4 * bm
    sm, _, out_sn = warpgroup_part(t)
    return t.stages * t.step_blocks * block + t.compute_wgs * sm * out_sn * 2 + 2048


STEP_BLOCK_STAGES = 3
"""Shared-memory stages of two-block steps at most (two where three do not fit, ws_fp8_smem_bytes, for
64-row tiles only): on the H100 two blocks in three stages beat one block in four, and three blocks in
two stages lost to both (docs/perf.md, 2026-12-05 sixteenth session); 128-row tiles in two stages lost
too (down at 8192 x 256: 2.446 ms against 2.268), 64-row ones won (decode gate_up at 64 x 256: 2.045
against 2.093; 2026-12-06)."""


def with_step_blocks(t: Tiling, K: int, step_blocks: int) -> Tiling:
    """fp8 tiling t of one product a K block (one weight, or gate and up interleaved) with step_blocks
    128-deep K blocks a pipeline step (Tiling.step_blocks) where it takes them (two compute warpgroups,
    K's blocks a split a multiple of them), in as many stages as fit (STEP_BLOCK_STAGES, or two for
    64-row tiles); else t."""
    if step_blocks not in (1, 2):
        raise ValueError(f"step_blocks {step_blocks}: 1 or 2 K blocks a pipeline step")
    if step_blocks == 1 or not (warp_specialized(t) and (K // t.block_k // t.k_splits) % step_blocks == 0 and not (
            t.joint_products or t.column_pairs or scale_slices(t) > 1)):
        return t
    fits = [dataclasses.replace(t, step_blocks=step_blocks, stages=s)
            for s in range(STEP_BLOCK_STAGES, 2 if t.block_m == 128 else 1, -1)]
    fits = [f for f in fits if ws_fp8_smem_bytes(f) <= SMEM_BYTES]
    return fits[0] if fits else t


def tile_columns(tiling: Tiling) -> int:
    """Output columns of a tile: block_n, or half of it where gate and up share the block
    (interleaved_gate_up)."""
    return tiling.block_n // 2 if tiling.interleaved_gate_up else tiling.block_n


def _add_scaled(total, part, scale):
    """total + part x scale [rows]: the step's row scales times its weight block's scale (multiplied
    first, before the step's products are issued), so one multiply and one add per element."""
    return total + part * jax.lax.broadcast_in_dim(scale, part.shape, [0])


def _step_scales(row_scale, load, step, n: int, slices: int = 1):
    """Each of n weights' scale for this step (of each of its slices, scale_slices): row_scale [rows] x its
    block scale (load(j, step, c): a global-memory scalar)."""
    return [row_scale * load(j, step, c) for j in range(n) for c in range(slices)]


def _silu_mul(gate, up):
    return gate / (1.0 + jnp.exp(-gate)) * up


def _operand_refs(refs, fp8: bool):
    """The kernel's refs after x, as grouped_matmul passes them: (row scales or None, weights, their
    block scales (empty for bf16), output)."""
    if not fp8:
        return None, refs[:-1], (), refs[-1]
    xs_ref, *refs = refs
    n_w = (len(refs) - 1) // 2
    return xs_ref, refs[:n_w], refs[n_w:2 * n_w], refs[-1]


def program_count(tiling: Tiling, tiles: int) -> int:
    """Programs a call of `tiles` output tiles launches: Tiling.programs, or (0) one a tile and K split."""
    return tiling.programs or tiles * tiling.k_splits


def _split_tile(index, k_splits: int, k_steps: int):
    """(output tile, K split, the pipeline's K steps, its first K step) of the tile loop's index: the
    k_splits programs of one output tile are neighbours in the loop, so they run at once."""
    if k_splits == 1:
        return index, 0, k_steps, 0
    steps = k_steps // k_splits
    return index // k_splits, index % k_splits, steps, index % k_splits * steps


def _out_block(o_ref, split, rows, cols):
    """The output block of a tile: o_ref [P, N], or its K split's partial of o_ref [k_splits, P, N]."""
    return o_ref.at[rows, cols] if len(o_ref.shape) == 2 else o_ref.at[split, rows, cols]


def _kernel(tile_expert_ref, x_ref, *refs, tiling: Tiling, grid_m: int, grid_n: int, k_steps: int, fp8: bool):
    xs_ref, w_refs, ws_refs, o_ref = _operand_refs(refs, fp8)
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k

    @plgpu.nd_loop((grid_m * grid_n * tiling.k_splits,), collective_axes="sm")
    def _tile(info):
        tile, split, steps, start = _split_tile(info.index[0], tiling.k_splits, k_steps)
        mi, ni = plgpu.planar_snake(tile, (grid_m, grid_n), 1, tiling.grid_block_n)
        expert = tile_expert_ref[mi]

        @pl.when(expert >= 0)
        def _():
            def accumulate(*accs):
                def step(_, x_smem, *w_smems):
                    for acc, w_smem in zip(accs, w_smems):
                        plgpu.wgmma(acc, x_smem, w_smem)

                plgpu.emit_pipeline(
                    step, grid=(steps,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (mi, k + start), delay_release=1)]
                    + [plgpu.BlockSpec((bk, bn), lambda k: (k + start, ni), delay_release=1)] * len(w_refs),
                    max_concurrent_steps=tiling.stages,
                )(x_ref, *[w.at[expert] for w in w_refs])
                return tuple(acc[...] for acc in accs)

            def accumulate_fp8():
                def load(j, k, c=0):      # one slice a weight (scale_slices takes no one-warpgroup tiles): c 0
                    return ws_refs[j][expert, (ni * bn) // FP8_BLOCK, k + start]

                def step(idx, x_smem, xs_smem, *rest):
                    *w_smems, sums = rest
                    row_scale = plgpu.load(xs_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))   # [bm]
                    plgpu.commit_smem()   # the read above ordered before the pipeline's next TMA write there
                    scales = _step_scales(row_scale, load, idx[0], len(w_smems))
                    new = []
                    for total, w_smem, scale in zip(sums, w_smems, scales):
                        def product(acc_ref, w_smem=w_smem):
                            plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                            return acc_ref[...]
                        part = pl.run_scoped(product, plgpu.ACC((bm, bn), jnp.float32))
                        new.append(_add_scaled(total, part, scale))
                    return tuple(new)

                zeros = plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
                sums = plgpu.emit_pipeline(
                    step, grid=(steps,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (mi, k + start)),
                              plgpu.BlockSpec((1, bm), lambda k: (k + start, mi))]
                    + [plgpu.BlockSpec((bn, bk), lambda k: (ni, k + start))] * len(w_refs),
                    max_concurrent_steps=tiling.stages,
                    init_carry=(zeros,) * len(w_refs),
                )(x_ref, xs_ref, *[w.at[expert] for w in w_refs])
                return sums

            if fp8:
                accs = accumulate_fp8()
            else:
                accs = pl.run_scoped(accumulate, *[plgpu.ACC((bm, bn))] * len(w_refs))
            out = _silu_mul(*accs) if len(accs) == 2 else accs[0]

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_ref.dtype))
            def _store(o_smem):
                o_smem[...] = out.astype(o_smem.dtype)
                plgpu.commit_smem()
                block = _out_block(o_ref, split, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn))
                plgpu.copy_smem_to_gmem(o_smem, block)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel_ws(tile_expert_ref, x_ref, *refs, tiling: Tiling, grid_m: int, grid_n: int, k_steps: int,
               fp8: bool):
    """The kernel with a producer warpgroup and two compute warpgroups (axis "wg": 0, 1 compute, 2
    memory), which each own half of the tile: 64 of its 128 rows, or half of its columns when block_m
    is 64. bf16: each accumulates its wgmma in place. fp8: every step each waits on its own 128-deep
    product and adds it scaled into its fp32 sums while the other's wgmma occupies the tensor cores."""
    interleaved = tiling.interleaved_gate_up
    xs_ref, w_refs, ws_refs, o_ref = _operand_refs(refs, fp8)
    n_w = len(w_refs)
    n_out = n_w if tiling.column_pairs else 1      # output column blocks per tile (w passed twice: pairs)
    fused = n_w == 2 and not tiling.column_pairs   # gate and up: silu(gate) * up
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    by_rows = split_rows(tiling)
    W = tiling.compute_wgs
    sm, sn, out_sn = warpgroup_part(tiling)        # a warpgroup's part (out_sn: its output columns, sums' width)
    n_slices = scale_slices(tiling) if fp8 else 1  # its slices, each with its own block scale (of each weight)
    slice_n = out_sn // n_slices                   # columns of a sum (and of an output block in o_smem)
    out_n = tile_columns(tiling)                   # output columns of a tile (interleaved: gate's half of its block)
    # interleaved: the tile's (gate, up) pairs of out_sn-row chunks, side by side in one buffer of bn rows
    half = out_sn
    n_blocks = bn // half if interleaved else n_w   # weight blocks a K block
    S = tiling.step_blocks                          # K blocks a pipeline step (each its x, row scales, weights)
    n_xs = S if fp8 else 0                          # row-scale blocks a step (in shared memory)
    wg = jax.lax.axis_index("wg")
    cn = tiling.cluster_n
    # fp8 weights are K-major [E, N, K] (a block [bn, bk]), bf16 ones [E, K, N] (a block [bk, bn]);
    # in a cluster the two programs share the row tile: its x (and row scales) arrive by multicast
    shared = dict(collective_axes=("cluster",)) if cn == 2 else {}

    def pipeline(body, context, start=0, steps=k_steps, state=None):
        """The tile's K pipeline over `steps` K blocks from block `start` (k_splits: the split's
        consecutive blocks), step_blocks of them a step; state: its place in the program's chain of
        pipelines (chained_tiles). A step's refs: its blocks' x, their row scales (fp8), their weights."""
        def kb(s):
            return lambda k: S * k + s + start

        def w_spec(s):
            if interleaved:
                return plgpu.BlockSpec((half, bk), lambda k: (0, kb(s)(k)))
            if fp8:
                return plgpu.BlockSpec((bn, bk), lambda k: (0, kb(s)(k)))
            return plgpu.BlockSpec((bk, bn), lambda k: (kb(s)(k), 0))
        specs = ([plgpu.BlockSpec((bm, bk), lambda k, s=s: (0, kb(s)(k)), **shared) for s in range(S)]
                 + [plgpu.BlockSpec((1, bm), lambda k, s=s: (kb(s)(k), 0), **shared) for s in range(n_xs)]
                 + [w_spec(s) for s in range(S) for _ in range(n_blocks)])
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps // S,), memory_registers=40 if W == 2 else 24, wg_axis="wg", num_compute_wgs=W,
            max_concurrent_steps=tiling.stages, compute_context=context, in_specs=specs, pipeline_state=state)

    def column(ni, j):
        """First output column of weight j's block in tile column ni (gate and up share one block; column
        pairs take two neighbouring ones; interleaved: the tile's first output column)."""
        if interleaved:
            return ni * out_n
        return (ni * n_out + min(j, n_out - 1)) * bn

    def operands(mi, ni, expert):
        """The pipeline's inputs for the tile (row tile mi, column block ni) of `expert`."""
        tile_rows = pl.ds(mi * bm, bm)
        scales = [xs_ref.at[:, tile_rows]] if n_xs else []
        if interleaved:           # gate's and up's blocks of each of the tile's output chunks
            ws = [w.at[expert, pl.ds(column(ni, 0) + c * half, half)] for c in range(n_blocks // 2) for w in w_refs]
        else:
            ws = [w.at[expert, pl.ds(column(ni, j), bn)] if fp8 else w.at[expert, :, pl.ds(column(ni, j), bn)]
                  for j, w in enumerate(w_refs)]
        return (*[x_ref.at[tile_rows]] * S, *scales * S, *ws * S)

    ignore = lambda *_, **__: None   # noqa: E731 (allocations depend on neither the body nor the tile)

    allocs = pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0))
    pairs_alloc = {}
    if interleaved:               # one buffer for the weight blocks, each block a view of it (_scope)
        in_allocs = allocs["flat_in_smem_refs"]   # x's, the row scales', then the weight blocks' (slots first)
        block = in_allocs[-1]
        allocs = dict(allocs, flat_in_smem_refs=in_allocs[:-S * n_blocks])
        pairs_alloc["pairs"] = plgpu.SMEM((block.shape[0], S * bn, bk), block.dtype, transforms=block.transforms)

    o_smem = plgpu.SMEM((W * n_out * n_slices, sm, slice_n), o_ref.dtype)   # each warpgroup's output blocks

    stagger = fp8 and tiling.stagger_warpgroups
    # stagger: order[w] completes a phase when compute warpgroup w has finished its tile's first step
    order_alloc = dict(order=plgpu.Barrier(num_arrivals=1, num_barriers=W - 1)) if stagger else {}

    @functools.partial(pl.run_scoped, allocs=allocs, o_smem=o_smem,
                       collective_axes="wg", **pairs_alloc, **order_alloc)
    def _scope(allocs, o_smem, pairs=None, order=None):
        if interleaved:           # the pipeline writes each weight block into its rows of `pairs`
            allocs = dict(allocs, flat_in_smem_refs=[
                *allocs["flat_in_smem_refs"], *[pairs.at[:, pl.ds(b * half, half)] for b in range(S * n_blocks)]])

        loop = (grid_m * grid_n // cn * tiling.k_splits,)

        def tile_at(info):
            """(row tile, column block, its expert or -1, K split, its steps, its first step) of a loop step."""
            tile, split, steps, start = _split_tile(info.index[0], tiling.k_splits, k_steps)
            mi, nc = plgpu.planar_snake(tile, (grid_m, grid_n // cn), 1, max(1, tiling.grid_block_n // cn))
            ni = nc * cn + jax.lax.axis_index("cluster") if cn == 2 else nc
            return mi, ni, tile_expert_ref[mi], split, steps, start

        if tiling.chained_tiles:  # the program's first and last loop steps with a used tile (-1: none)
            @plgpu.nd_loop(loop, collective_axes="sm", init_carry=(jnp.int32(-1), jnp.int32(-1)))
            def used_steps(info, carry):
                first, last = carry
                used, k = tile_at(info)[2] >= 0, jnp.asarray(info.local_index, jnp.int32)
                return jnp.where(used & (first < 0), k, first), jnp.where(used, k, last)
            first_used, last_used = used_steps

        @plgpu.nd_loop(loop, collective_axes="sm")
        def _tile(info):
            mi, ni, expert, split, steps, start = tile_at(info)
            rows = pl.ds(wg * sm, sm) if by_rows else pl.ds(0, sm)
            cols = pl.ds(0, sn) if by_rows else pl.ds(wg * sn, sn)

            def load_scale(j, i, c=0):
                """Weight j's block scale at the pipeline's step i for this warpgroup's columns of the tile
                (interleaved: j 0 gate's, 1 up's, for the warpgroup's chunk of each), of its slice c
                (n_slices)."""
                col = column(ni, j) + (0 if by_rows else wg * out_sn) + c * slice_n
                return ws_refs[j][expert, col // FP8_BLOCK, i + start]

            def pair_slot(idx, s=0):
                """interleaved: the step's slot of `pairs`: K block s's gate and up blocks side by side."""
                return pairs.at[jax.lax.rem(idx[0], pairs.shape[0]), pl.ds(s * bn, bn)]

            def step_fp8(idx, *refs):
                x_smem, xs_smems, (*w_smems, sums) = refs[0], refs[S:S + n_xs], refs[S + n_xs:]
                row_scales = [plgpu.load(xs.at[0, rows], layout=plgpu.Layout.WGMMA.reduce(1)) for xs in xs_smems]
                if tiling.fence_row_scales:
                    plgpu.commit_smem()   # the shared-memory reads above ordered before the next TMA write there
                if S > 1:                     # one product a block, two in flight, added in order
                    # every block's scales first: their block-scale reads in flight before any product
                    block_scales = [tuple(_step_scales(row_scales[s], load_scale, S * idx[0] + s, len(ws_refs)))
                                    for s in range(S)]

                    def promote(out, acc_ref, wait_n, scales):
                        """out plus acc_ref's product (awaited until wait_n products are in flight) scaled."""
                        return add_part(out, plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n), scales)

                    def issue(acc_ref, s):
                        w_smem = pair_slot(idx, s) if interleaved else w_smems[s]
                        plgpu.wgmma(acc_ref, refs[s].at[rows], w_smem.at[cols].transpose((1, 0)))

                    def chain(s, out, in_flight):
                        """Issue block s's product into a fresh accumulator, then add block s - 1's (in_flight)
                        while it runs; the last block's is added after its own wait."""
                        if s == S:
                            return promote(out, in_flight, 0, block_scales[S - 1])

                        def issued(acc_ref):
                            issue(acc_ref, s)
                            return chain(s + 1, out if in_flight is None else
                                         promote(out, in_flight, 1, block_scales[s - 1]), acc_ref)
                        return pl.run_scoped(issued, plgpu.ACC((sm, sn), jnp.float32))
                    return chain(0, sums, None)
                row_scale = row_scales[0]

                def products(smems):
                    """This step's products with the weight blocks `smems`, issued together, awaited once."""
                    def issue(*acc_refs):
                        for acc_ref, w_smem in zip(acc_refs, smems):
                            plgpu.wgmma(acc_ref, x_smem.at[rows], w_smem.at[cols].transpose((1, 0)))
                        return tuple(acc_ref[...] for acc_ref in acc_refs)
                    return pl.run_scoped(issue, *[plgpu.ACC((sm, sn), jnp.float32)] * len(smems))

                scales = _step_scales(row_scale, load_scale, idx[0], len(ws_refs), n_slices)
                if interleaved or n_slices > 1:   # one product: each slice of each weight's part by its scale
                    return add_part(sums, products([pair_slot(idx)] if interleaved else w_smems)[0], scales)
                if tiling.joint_products:
                    return tuple(_add_scaled(total, part, scale)
                                 for total, part, scale in zip(sums, products(w_smems), scales))
                # one product at a time, each rescaled before the next is issued
                return tuple(_add_scaled(total, products([w_smem])[0], scale)
                             for total, w_smem, scale in zip(sums, w_smems, scales))

            def step_in_place(idx, *refs):
                """bf16, and fp8's unscaled_probe: the step's products added to accumulators kept across
                steps (fp8: no scales; its row scales, after x, unused)."""
                *w_smems, accs = refs[S + n_xs:]
                for s in range(S):
                    blocks = [pair_slot(idx, s)] if interleaved else w_smems[s * n_w:(s + 1) * n_w]
                    for acc, w_smem in zip(accs, blocks):
                        plgpu.wgmma(acc, refs[s].at[rows],
                                    w_smem.at[cols].transpose((1, 0)) if fp8 else w_smem.at[:, cols])
                plgpu.wgmma_wait(0)
                return accs

            def store(outs):
                """This warpgroup's part of each of the tile's output column blocks, through shared memory."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                n_blocks_out = len(outs)
                for j, out in enumerate(outs):
                    o_smem[wg * n_blocks_out + j] = out.astype(o_smem.dtype)
                plgpu.commit_smem()
                for j in range(n_blocks_out):
                    if interleaved and n_slices == 1:
                        out_cols = pl.ds(0, out_n) if by_rows else pl.ds(wg * out_sn, out_sn)
                        block = o_ref.at[pl.ds(mi * bm, bm), pl.ds(column(ni, 0), out_n)].at[rows, out_cols]
                    elif n_slices > 1:    # slice j of the warpgroup's columns (all of the tile's: 128-row tiles)
                        block = _out_block(o_ref, split, pl.ds(mi * bm, bm),
                                           pl.ds(column(ni, 0) + j * slice_n, slice_n)).at[rows]
                    else:
                        block = _out_block(o_ref, split, pl.ds(mi * bm, bm), pl.ds(column(ni, j), bn)).at[rows, cols]
                    plgpu.copy_smem_to_gmem(o_smem.at[wg * n_blocks_out + j], block)

            def outputs(vals):
                """The output blocks of sums vals (fused: gate's slices, then up's)."""
                vals = list(vals)
                return [_silu_mul(g, u) for g, u in zip(vals[:n_slices], vals[n_slices:])] if fused else vals

            def parts(part):
                """A [sm, sn] product's parts, as the sums hold them: interleaved, its gate half then its up
                half; each in its slices (scale_slices)."""
                halves = (part[:, :out_sn], part[:, out_sn:]) if interleaved else (part,)
                return [h[:, c * slice_n:(c + 1) * slice_n] if n_slices > 1 else h
                        for h in halves for c in range(n_slices)]

            def add_part(sums, part, scales):
                """sums plus a [sm, sn] product's parts scaled."""
                return tuple(_add_scaled(total, h, scale) for total, h, scale in zip(sums, parts(part), scales))

            def context_fp8(run):
                # interleaved: gate's and up's sums, each the [sm, out_sn] half of the step's product
                zeros = plgpu.layout_cast(jnp.zeros((sm, slice_n), jnp.float32), plgpu.Layout.WGMMA)
                store(outputs(run((zeros,) * (len(ws_refs) * n_slices))))

            def context_in_place(run):
                def scoped(*accs):
                    run(accs)
                    vals = [acc[...] for acc in accs]
                    if interleaved or n_slices > 1:   # stored as the scaled tiling stores its sums
                        vals = parts(vals[0])
                    store(outputs(vals))
                pl.run_scoped(scoped, *[plgpu.ACC((sm, sn), jnp.float32)] * (1 if interleaved else n_w))

            k = jnp.asarray(info.local_index, jnp.int32)     # this loop step, among the program's

            def step_staggered(idx, *refs):
                """step_fp8, the warpgroups started in turn at the tile's first step (stagger_warpgroups)."""
                first = idx[0] == 0
                if tiling.chained_tiles:          # started apart once, they stay apart through the chain
                    first = first & (k == first_used)
                for i in range(1, W):
                    pl.when(first & (wg == i))(lambda i=i: plgpu.barrier_wait(order.at[i - 1]))
                sums = step_fp8(idx, *refs)
                for i in range(W - 1):
                    pl.when(first & (wg == i))(lambda i=i: plgpu.barrier_arrive(order.at[i]))
                return sums

            in_place = tiling.unscaled_probe or not fp8
            step, context = (step_in_place, context_in_place) if in_place else (step_fp8, context_fp8)
            if stagger:
                step = step_staggered

            def run(state=None):
                pipeline(step, context, start, steps, state)(*operands(mi, ni, expert), allocations=allocs)

            if not tiling.chained_tiles:
                pl.when(expert >= 0)(run)
                return
            pl.when((expert >= 0) & (first_used == last_used))(run)     # the program's one used tile
            chain = plgpu.PipelinePipeline

            @pl.when((expert >= 0) & (first_used != last_used))
            def _():
                run(jnp.where(k == first_used, int(chain.START), jnp.where(
                    k == last_used, int(chain.STOP), int(chain.STEADY))).astype(jnp.int32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul(x, w, tile_expert, *, up=None, tiling: Tiling = Tiling(), interpret=False, x_scale=None,
                   w_scale=None, up_scale=None, out_dtype=None):
    """x [P, K] in the padded layout (P a multiple of block_m), w [E, K, N], tile_expert [P // block_m]
    int32. Returns [P, N] in x's dtype: x @ w per tile, or silu(x @ w) * (x @ up) with up [E, K, N].
    Rows of unused tiles are left unwritten. interpret: True (or plgpu.InterpretGPUParams) runs Mosaic
    GPU's interpreter, on any backend.
    fp8 (x_scale given): x [P, K] e4m3 with x_scale [K / 128, P] fp32; w (and up) [E, N, K] e4m3 with
    w_scale (up_scale) [E, ceil(N / 128), K / 128] fp32; out_dtype (default bf16)."""
    fp8 = x_scale is not None
    interleaved = tiling.interleaved_gate_up
    err = shape_error(x, w, tiling, fp8) or (None if up is None or up.shape == w.shape else
                                             f"up {up.shape} must match gate {w.shape}")
    if err is None and interleaved and (up is None or not fp8):
        err = "interleaved_gate_up is fp8 gate_up: it takes gate in w and up in up"
    P, K = x.shape
    N = w.shape[1] if fp8 else w.shape[2]
    if err is None and fp8:
        E = w.shape[0]
        want = {"x_scale": (K // FP8_BLOCK, P), "w_scale": (E, -(-N // FP8_BLOCK), K // FP8_BLOCK)}
        got = {"x_scale": x_scale, "w_scale": w_scale}
        if up is not None:
            want["up_scale"], got["up_scale"] = want["w_scale"], up_scale
        err = next((f"{name} must be fp32 {want[name]}, got "
                    f"{None if a is None else (tuple(a.shape), str(a.dtype))}" for name, a in got.items()
                    if a is None or tuple(a.shape) != want[name] or a.dtype != jnp.float32), None)
    if err is not None:
        raise ValueError(f"grouped_matmul: {err}")
    if tile_expert.shape != (P // tiling.block_m,):
        raise ValueError(f"grouped_matmul: tile_expert {tile_expert.shape} must hold one expert per "
                         f"{tiling.block_m}-row tile of {P} rows")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    if tiling.column_pairs and up is not None:
        raise ValueError("grouped_matmul: column_pairs takes no up (gate_up already holds two accumulators)")
    if tiling.step_blocks > 1 and up is not None and not interleaved:
        raise ValueError("grouped_matmul: step_blocks above 1 takes gate and up interleaved (one product a K block)")
    if fp8 and up is not None and scale_slices(tiling) > 1 and not interleaved:
        raise ValueError(f"grouped_matmul: tiles of {tile_columns(tiling)} columns straddle scale blocks: "
                         f"fp8 with one weight, or gate and up interleaved")
    if tiling.k_splits > 1 and up is not None:
        raise ValueError("grouped_matmul: k_splits takes no up (silu(gate) * up needs whole sums)")
    pair = 2 if tiling.column_pairs else 1
    weights = (w,) * pair if up is None else (w, up)
    if fp8:
        weights = (x_scale,) + weights + ((w_scale,) * pair if up is None else (w_scale, up_scale))
    grid = dict(tiling=tiling, grid_m=P // tiling.block_m, grid_n=column_tiles(tiling, N) // pair,
                k_steps=K // tiling.block_k)
    if warp_specialized(tiling):
        body = functools.partial(_kernel_ws, fp8=fp8, **grid)
    else:
        body = functools.partial(_kernel, fp8=fp8, **grid)
    threads = dict(num_threads=tiling.compute_wgs + 1, thread_name="wg") if warp_specialized(tiling) else {}
    if tiling.cluster_n == 2:
        threads.update(cluster=(2,), cluster_names=("cluster",))
    out_dtype = out_dtype or (jnp.bfloat16 if fp8 else x.dtype)
    S = tiling.k_splits
    clusters = program_count(tiling, grid["grid_m"] * grid["grid_n"]) // tiling.cluster_n
    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((S, P, N), jnp.float32) if S > 1
                        else jax.ShapeDtypeStruct((P, N), out_dtype)),
        grid=(clusters,), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret, **threads,
    )
    out = kernel(tile_expert.astype(jnp.int32), x, *weights)
    return out.sum(axis=0).astype(out_dtype) if S > 1 else out
