"""The routed experts' MLP over (row, slot) pairs, two ways, and the dispatch between them.

    y[s] = down_e(silu(gate_e x[s // k]) * up_e x[s // k]),   e = flat_expert[s]   (0 when e == E)

`expert_mlp_ragged` sorts the slots by expert and runs XLA's lax.ragged_dot per projection (the
reference on every backend; on the GPU XLA turns it into padded per-expert dense matmuls, 6% of the
dense rate at 16 experts and unrunnable at 256: docs/perf.md). `expert_mlp_blocked` lays the slots out
by `plan.block_plan` and runs the grouped_matmul kernel twice: gate/up fused with SiLU * up, then down.
`expert_mlp_blocked_fp8` does the same with fp8 experts kept fp8.

Layouts (pallas_kernels/moe/layout.py): plain experts are [E, K, N] (gate / up [E, D, I], down
[E, I, D]); fp8 experts are K-major [E, N, K] (gate / up [E, I, D], down [E, D, I]) with block scales
[E, N/128, K/128], as stored by the model: the fp8 kernel reads them as they are, every other path
dequantizes them to the plain layout first.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.moe.fp8_rows import quantize_rows
from pallas_kernels.moe.grouped_matmul import Tiling, chained, column_tiles, grouped_matmul, shape_error, tile_columns
from pallas_kernels.moe.grouped_matmul import WIDE_TILE, scale_slices, with_step_blocks
from pallas_kernels.moe.layout import check_experts, fp8_experts_as_plain
from pallas_kernels.moe.plan import block_plan, padded_rows
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.row_gather import combine_rows, expert_order, gather_rows


class ExpertRows(NamedTuple):
    """The experts' outputs where the grouped matmul left them: rows [P, D] in x's dtype, and the row
    of each slot, slot_row [S] (-1: the slot joined no expert; its output is zero). Read out either in
    slot order or as each token's weighted sum, straight from these rows."""
    rows: jax.Array
    slot_row: jax.Array

    def slots(self, policy: KernelPolicy = DEFAULT_POLICY):
        """[S, D] in slot order."""
        return gather_rows(self.rows, self.slot_row, policy=policy)

    def weighted_sum(self, w, policy: KernelPolicy = DEFAULT_POLICY):
        """fp32 [N, D]: each token's k slots (slot s = t * k + j) times w [N, k], summed in slot order
        (row_gather.combine_rows: one read of the rows, no [S, D] intermediate)."""
        return combine_rows(self.rows, self.slot_row.reshape(w.shape), w, policy=policy)


def expert_mlp_ragged(x, flat_expert, gate, up, down, topk: int, *, policy: KernelPolicy = DEFAULT_POLICY):
    """x [N, D]; flat_expert [N * topk] (slot s belongs to row s // topk; E: no expert); plain experts
    gate / up [E, D, I], down [E, I, D]. Returns ExpertRows in x's dtype (rows in expert order)."""
    E = gate.shape[0]
    order, sizes = expert_order(flat_expert, E)
    xs = gather_rows(x, order // topk, policy=policy)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    y = jax.lax.ragged_dot(h.astype(x.dtype), down, sizes)
    used = jnp.arange(order.shape[0]) < sizes.sum()   # rows past the groups: ragged_dot leaves them unspecified
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
    return ExpertRows(y, jnp.where(used[unsort], unsort, -1))


def expert_mlp_blocked(x, flat_expert, gate, up, down, topk: int, *, up_tiling: Tiling, down_tiling: Tiling,
                       policy: KernelPolicy = DEFAULT_POLICY, interpret=False):
    """expert_mlp_ragged through the grouped_matmul kernel (both tilings must share block_m); plain
    experts gate / up [E, D, I], down [E, I, D]."""
    if up_tiling.block_m != down_tiling.block_m:
        raise ValueError(f"the two tilings must share block_m ({up_tiling.block_m} != {down_tiling.block_m})")
    E = gate.shape[0]
    slot_row, row_slot, tile_expert = block_plan(flat_expert, E, up_tiling.block_m,
                                                 pairwise_slots=policy.moe_pairwise_plan_slots)
    xp = gather_rows(x, jnp.where(row_slot >= 0, row_slot // topk, -1), policy=policy)
    with jax.named_scope("gate_up"):
        h = grouped_matmul(xp, gate, tile_expert, up=up, tiling=up_tiling, interpret=interpret)
    with jax.named_scope("down"):
        y = grouped_matmul(h, down, tile_expert, tiling=down_tiling, interpret=interpret)
    return ExpertRows(y, slot_row)


def paired(t: Tiling, N: int) -> Tiling:
    """t, or t without its cluster of two programs or its column pairs where N's column blocks do not
    pair up (the kernel refuses both there)."""
    if (t.cluster_n == 2 or t.column_pairs) and column_tiles(t, N) % 2:
        return dataclasses.replace(t, cluster_n=1, column_pairs=False)
    return t


def blocked_tilings(slots: int, E: int, compute_wgs: int = 2) -> tuple[Tiling, Tiling]:
    """The kernel's tilings for a call of `slots` routed rows (tuning in docs/perf.md, 2026-12-03
    third and fourth sessions): 64-row tiles when few rows reach each expert (decode), else 128. Two
    compute warpgroups (warp-specialized) split a 128-row tile's rows (64 each) or a 64-row tile's
    columns; at decode the gate_up call keeps one (two were no faster there) and the down call runs
    in clusters of two programs sharing their x tiles (cluster_n 2: 1.51 vs 1.73 ms at 64 x 256;
    slower at prefill). Clusters apply where the column blocks pair up (paired)."""
    if slots < 4 * E:
        one = Tiling(block_m=64, block_n=128, grid_block_n=1)
        if compute_wgs == 2:
            return one, Tiling(block_m=64, block_n=256, grid_block_n=1, compute_wgs=2, cluster_n=2)
        return one, one
    if compute_wgs == 2:
        return (Tiling(block_m=128, block_n=128, stages=3, compute_wgs=2),
                Tiling(block_m=128, block_n=256, stages=3, compute_wgs=2))
    # gate_up holds two accumulators: 128 x 128 each spills (4x slower on the H200)
    return Tiling(block_m=128, block_n=64), Tiling(block_m=128, block_n=128)


def by_rows(t: Tiling, N: int) -> Tiling:
    """A 64-row (decode) tiling walking its tiles row by row (grid_block_n: all of N's column blocks).
    The padded buffer's unused row tiles are its last ones, so the used tiles take the first programs:
    walked column by column instead, each column's unused tile sits among the used ones and pushes
    used tiles into a second round of a few programs (1 token x 256 experts: 128 used tiles of 144
    on 132 programs; H200, docs/perf.md 2026-12-04 fifth session: fp8 gate_up 0.083 -> 0.067 ms, bf16
    0.132 -> 0.106, 64 tokens 1.558 -> 1.434 and 3.387 -> 2.689)."""
    return dataclasses.replace(t, grid_block_n=column_tiles(t, N)) if t.block_m == 64 else t


def expert_tilings(slots: int, gate, fp8: bool, compute_wgs: int, interleaved: bool = False,
                   chain: bool = False, step_blocks: int = 1, wide_down: bool = False,
                   three_wgs: bool = False, one_tile: bool = False) -> tuple[Tiling, Tiling]:
    """The (gate_up, down) tilings of a call over these experts (gate plain [E, D, I] or fp8 K-major
    [E, I, D]), clusters kept where the column blocks pair up, decode tiles walked row by row.
    interleaved (fp8, two compute warpgroups): gate_up with Tiling.interleaved_gate_up; chain: each
    call's tiling `chained` where it applies; step_blocks (fp8): Tiling.step_blocks where the tiling takes
    it (with_step_blocks); wide_down (fp8): the prefill down call in WIDE_TILE-column tiles where D is a
    multiple of it (straddling scale blocks: scale_slices; one block a step), chained where it can be (as
    they were timed fastest). three_wgs (fp8, interleaved, two compute warpgroups asked for): calls with at
    least THREE_WG_ROWS rows an expert take three_wg_tilings instead. one_tile: prefill tilings (128 rows
    or more) run one program a tile (Tiling.programs 0)."""
    tilings = _expert_tilings(slots, gate, fp8, compute_wgs, interleaved, chain, step_blocks, wide_down, three_wgs)
    if one_tile and tilings[0].block_m >= 128:
        tilings = tuple(dataclasses.replace(t, programs=0) for t in tilings)
    return tilings


def _expert_tilings(slots, gate, fp8, compute_wgs, interleaved, chain, step_blocks, wide_down,
                    three_wgs) -> tuple[Tiling, Tiling]:
    """expert_tilings in persistent programs (one_tile applied after)."""
    E = gate.shape[0]
    I, D = (gate.shape[1], gate.shape[2]) if fp8 else (gate.shape[2], gate.shape[1])
    if fp8 and three_wgs and interleaved and compute_wgs == 2 and slots >= THREE_WG_ROWS * E:
        up_t, down_t = three_wg_tilings()
        if I % tile_columns(up_t) == 0 and D % down_t.block_n == 0:
            return paired(up_t, I), paired(down_t, D)
    up_t, down_t = (fp8_tilings if fp8 else blocked_tilings)(slots, E, compute_wgs)
    if fp8 and interleaved and compute_wgs == 2:
        il = dataclasses.replace(up_t, block_n=128 if up_t.block_m == 128 else 256, cluster_n=2,
                                 joint_products=False, interleaved_gate_up=True)
        up_t = il if I % tile_columns(il) == 0 else up_t   # else the plain tiling, not a dequantized fallback
    wide_t = dataclasses.replace(down_t, block_n=WIDE_TILE)     # scale_slices: 128-row tiles only
    wide = fp8 and wide_down and D % WIDE_TILE == 0 and scale_slices(wide_t) > 1
    if wide:
        down_t = wide_t
    up_t, down_t = by_rows(paired(up_t, I), I), by_rows(paired(down_t, D), D)
    if fp8:
        up_t = with_step_blocks(up_t, D, step_blocks if up_t.interleaved_gate_up else 1)  # one product
        down_t = with_step_blocks(down_t, I, step_blocks)
    if wide:
        down_t = chained(down_t, I)
    return (chained(up_t, D), chained(down_t, I)) if chain else (up_t, down_t)


THREE_WG_ROWS = 1024
"""Routed rows an expert (slots / E) from which KernelPolicy.fp8_three_wgs takes 192-row tiles: each expert's
rows are padded to a multiple of the tile, ~96 rows on average against 128-row tiles' ~64, under 10% more
rows than 128-row tiles' here (at 256 rows an expert, the 8192 x 256 case, they lost 12%)."""


def three_wg_tilings() -> tuple[Tiling, Tiling]:
    """(gate_up, down) fp8 tilings in three compute warpgroups: 192-row tiles, 128 columns, clusters of two;
    gate_up interleaved (chained, it ran 4% slower), down chained (H100, docs/perf.md 2026-12-06 nineteenth
    session)."""
    t = Tiling(block_m=192, block_n=128, block_k=128, stages=4, compute_wgs=3, grid_block_n=16, cluster_n=2)
    return dataclasses.replace(t, interleaved_gate_up=True), dataclasses.replace(t, chained_tiles=True)


def blocked_shape_error(x, gate, down, slots: int, up_t: Tiling, down_t: Tiling) -> str | None:
    P = padded_rows(slots, gate.shape[0], up_t.block_m)
    h = jax.ShapeDtypeStruct((P, gate.shape[2]), x.dtype)
    return (shape_error(jax.ShapeDtypeStruct((P, x.shape[1]), x.dtype), gate, up_t)
            or shape_error(h, down, down_t))


def fp8_tilings(slots: int, E: int, compute_wgs: int = 2) -> tuple[Tiling, Tiling]:
    """The fp8 kernel's tilings: one 128-wide scale block per K step. Two compute warpgroups
    (warp-specialized) each hold half the tile, 64 of 128 rows or, at block_m 64 (few rows per
    expert), half of 128 columns. H200 timings in docs/perf.md (2026-12-04 third session, kernel calls
    alone at GLM-5's widths, top-8): at prefill gate_up issues a step's gate and up products together
    (joint_products, 64-wide column blocks: 8192 x 256 4.22 vs 7.77 ms single-issue, 8192 x 16 3.18 vs
    3.39) and down runs in clusters of two programs sharing their x tiles by multicast (8192 x 256
    2.16 vs 3.05 ms in column pairs, 8192 x 16 1.56 vs 1.52); at decode both calls run clustered and
    down computes two column blocks per tile with its products issued together (8 x 256 0.210 vs
    0.250 ms, 64 x 256 0.800 vs 0.902). One warpgroup: 64 columns per accumulator (the per-step
    product and the running sum each hold a [block_m, block_n] fp32 tile in registers)."""
    block_m = 64 if slots < 4 * E else 128
    if compute_wgs == 2:
        t = Tiling(block_m=block_m, block_n=128, block_k=128, stages=4, compute_wgs=2,
                   grid_block_n=1 if block_m == 64 else 16)
        if block_m == 64:
            clustered = dataclasses.replace(t, cluster_n=2)
            return clustered, dataclasses.replace(clustered, column_pairs=True, joint_products=True)
        return dataclasses.replace(t, block_n=64, joint_products=True), dataclasses.replace(t, cluster_n=2)
    return (Tiling(block_m=block_m, block_n=64, block_k=128, stages=3),
            Tiling(block_m=block_m, block_n=64, block_k=128, stages=4))


def fp8_shape_error(x, gate, down, slots: int, compute_wgs: int = 2, interleaved: bool = False,
                    chain: bool = False, step_blocks: int = 1, wide_down: bool = False,
                    three_wgs: bool = False) -> str | None:
    """Why the fp8 kernel path cannot take these operands (None: it can): fp8 experts stored K-major,
    gate [E, I, D] and down [E, D, I] e4m3 (layout.py), read by the kernel as they are."""
    if gate.dtype != jnp.float8_e4m3fn or down.dtype != jnp.float8_e4m3fn:
        return f"weights are {gate.dtype} / {down.dtype}, not float8_e4m3fn"
    up_t, down_t = expert_tilings(slots, gate, True, compute_wgs, interleaved, chain, step_blocks, wide_down,
                                  three_wgs)
    P = padded_rows(slots, gate.shape[0], up_t.block_m)
    E, I, D = gate.shape
    return (shape_error(jax.ShapeDtypeStruct((P, D), jnp.float8_e4m3fn), gate, up_t, fp8=True)
            or shape_error(jax.ShapeDtypeStruct((P, I), jnp.float8_e4m3fn), down, down_t, fp8=True))


def fp8_tiling_options(policy: KernelPolicy) -> dict:
    """The policy's choices for the fp8 kernel's tilings, as expert_tilings and fp8_shape_error take them."""
    return dict(compute_wgs=policy.fp8_moe_compute_wgs, interleaved=policy.fp8_moe_interleaved_gate_up,
                chain=policy.chained_tiles, step_blocks=policy.fp8_step_blocks, wide_down=policy.fp8_wide_tiles,
                three_wgs=policy.fp8_three_wgs)


def bf16_tilings(slots: int, gate, policy: KernelPolicy) -> tuple[Tiling, Tiling]:
    """The policy's (gate_up, down) tilings of the bf16 kernel over plain experts gate [E, D, I]: one program a
    tile where an expert averages at most policy.moe_tile_program_rows routed rows."""
    return expert_tilings(slots, gate, False, policy.moe_compute_wgs, chain=policy.chained_tiles,
                          one_tile=slots <= policy.moe_tile_program_rows * gate.shape[0])


def fp8_kernel_applies(x, gate, down, slots: int, policy: KernelPolicy) -> bool:
    """Whether expert_mlp runs fp8 experts (K-major: gate [E, I, D], down [E, D, I]) through the fp8
    kernel (else they are dequantized first): on the GPU, where its shapes fit."""
    return (policy.on_gpu() and policy.moe_kernel and policy.fp8_moe_kernel
            and fp8_shape_error(x, gate, down, slots, **fp8_tiling_options(policy)) is None)


def expert_mlp_blocked_fp8(x, flat_expert, gate, up, down, scales, topk: int, *, up_tiling: Tiling,
                           down_tiling: Tiling, policy: KernelPolicy = DEFAULT_POLICY, interpret=False):
    """expert_mlp_ragged with fp8 experts kept fp8, in their stored K-major layout (layout.py):
    gate / up [E, I, D] and down [E, D, I] e4m3, scales (gate, up, down) [E, N / 128, K / 128] fp32
    (gate / up [E, I/128, D/128], down [E, D/128, I/128]), passed to the kernel as they are (no
    transpose). The rows are quantized per row per 128 columns (quantize_rows) before each grouped
    matmul; fp8 x fp8 products with fp32 sums, x's dtype out. x [N, D]; returns [N * topk, D]."""
    E, _ = check_experts(x.shape[1], gate, up, down, scales)
    slot_row, row_slot, tile_expert = block_plan(flat_expert, E, up_tiling.block_m,
                                                 pairwise_slots=policy.moe_pairwise_plan_slots)
    src = jnp.where(row_slot >= 0, row_slot // topk, -1)
    tq, ts = quantize_rows(x)          # each token once, then its rows gathered as bytes (half of bf16's)
    xq = jax.lax.bitcast_convert_type(
        gather_rows(jax.lax.bitcast_convert_type(tq, jnp.uint8), src, policy=policy), jnp.float8_e4m3fn)
    xs = jnp.where(src >= 0, ts[:, jnp.maximum(src, 0)], 1.0)    # padding rows: zeros at scale 1
    with jax.named_scope("gate_up"):
        h = grouped_matmul(xq, gate, tile_expert, up=up, tiling=up_tiling, interpret=interpret,
                           x_scale=xs, w_scale=scales[0], up_scale=scales[1], out_dtype=x.dtype)
    with jax.named_scope("down"):
        hq, hs = quantize_rows(h)
        y = grouped_matmul(hq, down, tile_expert, tiling=down_tiling, interpret=interpret, x_scale=hs,
                           w_scale=scales[2], out_dtype=x.dtype)
    return ExpertRows(y, slot_row)


@jax.named_call     # profiles (scripts/profile_prefill.py) name the ops inside by these scopes
def expert_mlp(x, flat_expert, gate, up, down, topk: int, *, policy: KernelPolicy = DEFAULT_POLICY, scales=None):
    """The dispatch: the grouped_matmul kernel on GPU with policy.moe_kernel where its shapes fit (K
    and N multiples of its blocks, bf16), else expert_mlp_ragged. x [N, D], flat_expert [N * topk];
    returns ExpertRows (.slots(): [N * topk, D] in slot order; .weighted_sum(w): [N, D] fp32).
    Layouts (layout.py, checked: a mismatch is a ValueError):
      scales None: plain experts gate / up [E, D, I], down [E, I, D];
      scales (gate, up, down): fp8 e4m3 experts, K-major: gate / up [E, I, D], down [E, D, I], scales
        [E, N/128, K/128]. The fp8 kernel takes them as they are where fp8_kernel_applies; else they
        are dequantized to x's dtype in the plain layout first (fp8_experts_as_plain)."""
    slots = flat_expert.shape[0]
    check_experts(x.shape[1], gate, up, down, scales)
    if scales is not None:
        if fp8_kernel_applies(x, gate, down, slots, policy):
            up_t, down_t = expert_tilings(slots, gate, True, **fp8_tiling_options(policy))
            return expert_mlp_blocked_fp8(x, flat_expert, gate, up, down, scales, topk, up_tiling=up_t,
                                          down_tiling=down_t, policy=policy)
        gate, up, down = (fp8_experts_as_plain(w, s, x.dtype) for w, s in zip((gate, up, down), scales))
    up_t, down_t = bf16_tilings(slots, gate, policy)
    if policy.on_gpu() and policy.moe_kernel and blocked_shape_error(x, gate, down, slots, up_t, down_t) is None:
        return expert_mlp_blocked(x, flat_expert, gate, up, down, topk, up_tiling=up_t, down_tiling=down_t,
                                  policy=policy)
    return expert_mlp_ragged(x, flat_expert, gate, up, down, topk, policy=policy)
