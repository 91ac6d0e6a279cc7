"""The block plan of the routed experts' grouped matmuls: each expert's rows padded to whole row tiles.

Rows routed to expert g are laid out contiguously from a tile boundary, so every row tile of the
padded buffer belongs to exactly one expert (or to none: tiles past the used ones). The matmul kernel
then needs one number per tile (its expert), loads and stores whole tiles by TMA, and skips unused
tiles without reading any weight. vLLM and SGLang's fused MoE align their rows the same way
("moe_align_block_size"). The plan is computed on the device with jnp, one of two ways with equal
results: row_gather.expert_order's stable sort and group sizes, then cumsums and scatters (any number
of slots); or, for few slots (decode, verify), every slot against every other (ranks, group sizes and
tile starts as [S, S] comparisons, the inverse maps as [P, S] ones): a few fused elementwise
reductions instead of a sort, searches and scatters, each its own small launch on the GPU. Nothing
here is data-dependent in shape.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.row_gather import expert_order


def padded_rows(slots: int, experts: int, block_m: int) -> int:
    """Static size of the padded buffer for `slots` routed (row, expert) pairs: every expert touched
    wastes at most block_m - 1 rows, and at most min(experts, slots) experts are touched."""
    return (-(-slots // block_m) + min(experts, slots)) * block_m


def block_plan(flat_expert, experts: int, block_m: int, *, pairwise_slots: int = 0):
    """flat_expert [S] int32: the expert of each routed slot (== experts, or any id outside [0,
    experts): the slot joins no expert).
    Returns
      slot_row  [S] int32   the padded row of each slot (-1 for a slot that joins no expert);
      row_slot  [P] int32   the slot each padded row holds (-1: a padding row);
      tile_expert [P // block_m] int32  the expert of each row tile (-1: an unused tile).
    Slots of one expert keep their order (a stable sort), so the layout is deterministic. At most
    pairwise_slots slots (static): computed pairwise (_pairwise_plan), else by sorting."""
    if flat_expert.shape[0] <= pairwise_slots:
        return _pairwise_plan(flat_expert, experts, block_m)
    return _sorted_plan(flat_expert, experts, block_m)


def _sorted_plan(flat_expert, experts: int, block_m: int):
    S = flat_expert.shape[0]
    P = padded_rows(S, experts, block_m)
    e = flat_expert.astype(jnp.int32)
    order, sizes = expert_order(e, experts)
    tiles = (sizes + block_m - 1) // block_m
    tile_start = jnp.cumsum(tiles) - tiles                          # first tile of each expert
    row_start = jnp.cumsum(sizes) - sizes                           # first sorted position of each expert
    se = e[order]
    ok = (se >= 0) & (se < experts)                                 # ids outside [0, experts): no expert
    sg = jnp.minimum(se, experts - 1)
    rank = jnp.arange(S, dtype=jnp.int32) - row_start[sg]
    dest = jnp.where(ok, tile_start[sg] * block_m + rank, -1)       # padded row of sorted position i
    slot_row = jnp.full(S, -1, jnp.int32).at[order].set(dest, unique_indices=True)
    row_slot = jnp.full(P + 1, -1, jnp.int32).at[jnp.where(ok, dest, P)].set(
        jnp.where(ok, order, -1))[:P]
    n_tiles = P // block_m
    tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
    owner = jnp.searchsorted(jnp.cumsum(tiles), tile_ids, side="right", method="scan_unrolled").astype(jnp.int32)
    tile_expert = jnp.where(owner < experts, owner, -1)
    return slot_row, row_slot, tile_expert


def _pairwise_plan(flat_expert, experts: int, block_m: int):
    """block_plan from [S, S] comparisons: a slot's rank among its expert's slots (those before it),
    its expert's size, and its expert's first tile (the tiles of the experts below it that have
    slots); then each padded row's slot and each tile's expert by comparing against every slot."""
    S = flat_expert.shape[0]
    P = padded_rows(S, experts, block_m)
    e = flat_expert.astype(jnp.int32)
    valid = (e >= 0) & (e < experts)
    i = jnp.arange(S, dtype=jnp.int32)
    same = valid[:, None] & valid[None, :] & (e[:, None] == e[None, :])
    rank = jnp.sum(same & (i[None, :] < i[:, None]), axis=1, dtype=jnp.int32)
    size = jnp.sum(same, axis=1, dtype=jnp.int32)
    first = valid & (rank == 0)                                      # one slot stands for its expert
    tiles = jnp.where(first, (size + block_m - 1) // block_m, 0)
    below = first[None, :] & (e[None, :] < e[:, None])
    tile_start = jnp.sum(jnp.where(below, tiles[None, :], 0), axis=1, dtype=jnp.int32)
    slot_row = jnp.where(valid, tile_start * block_m + rank, -1)
    rows = jnp.arange(P, dtype=jnp.int32)
    row_slot = jnp.max(jnp.where(slot_row[None, :] == rows[:, None], i[None, :], -1), axis=1, initial=-1)
    t = jnp.arange(P // block_m, dtype=jnp.int32)[:, None]
    owns = first[None, :] & (tile_start[None, :] <= t) & (t < tile_start[None, :] + tiles[None, :])
    tile_expert = jnp.max(jnp.where(owns, e[None, :], -1), axis=1, initial=-1)
    return slot_row, row_slot, tile_expert
