"""The lightning indexer's scores as a Pallas kernel (Triton backend), read through the page table, and
the entry point (index_scores_pallas) that also reaches the Mosaic GPU kernels (scores_mgpu.py).

The Triton kernel reads each key block's rows through the page table (data-dependent row gathers,
which Triton expresses directly and Hopper's TMA cannot), or a dense copy of the keys gathered once
when many query blocks read them. With a bracket per row it also serves the fused indexer: it keeps
each row's candidate keys instead of writing the scores."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.indexer import scores_mgpu
from pallas_kernels.indexer.common import (_CAND, _HI_KEY, _LO_KEY, _PAST, _VIS, NEG_INF, NEG_INF_KEY, _call, _pad_to,
                                           check_indexer_args, fold_query_scale, order_keys)
from pallas_kernels.indexer.select import _keep_candidates, _search_start
from pallas_kernels.indexer.tuning import gathers_keys, mgpu_tiling, query_block


def _dot_dtype(q_dtype):
    """The scores dot's operand dtype: fp32 queries stay fp32, anything else (bf16) runs in bf16; fp8
    keys widen to it exactly."""
    return jnp.float32 if q_dtype == jnp.float32 else jnp.bfloat16


def _scores_kernel(layer_ref, q_ref, w_ref, pos_ref, table_ref, k_ref, *rest, heads: int, block_t: int,
                   block_n: int, steps: int, fp8: bool, gathered: bool, epilogue: bool, write_invisible: bool,
                   capacity: int | None, bits: int, width: int):
    """One (request, query block, group of `steps` key blocks) program; the query block is loaded once
    and the key blocks stream through a pipelined loop. The key block is the dot's M ([block_n, D] x
    [D, block_t * H]): a token's heads are adjacent accumulator columns, so the weighted head sum stays
    within a thread and its quad (no cross-warp reduction), and one decode token's heads still make
    an MMA tile's N. Query blocks run last-first: with causal masks the late ones have the most keys.
    gathered: k_ref (and the scales) are this request's keys already in table order, [B, S, D].
    epilogue=False (timing only) sums the raw dot over heads instead of relu, weights and scale.
    write_invisible=False leaves the key blocks no query of the block sees unwritten.
    capacity (the fused indexer; one group of all key blocks per program, so a token's keys arrive in
    column order): instead of writing the scores, keep each token's keys >= the lo of its bracket
    (br_ref [B * Tp, 2], before the outputs) as the selection's first call does, in rec_ref
    [B * Tp, 1, 8] and cand_ref [B * Tp, 1, capacity + 1, 2]: the selection's second call then runs
    without the [T, S] scores ever written. Keys at or past `width` (the table's padding) are not
    visible."""
    scale_ref = rest[0] if fp8 else None
    if capacity is None:
        o_ref = rest[-1]
    else:
        br_ref, rec_ref, cand_ref = rest[-3:]
    b, g = pl.program_id(0), pl.program_id(2)
    it = pl.num_programs(1) - 1 - pl.program_id(1)
    layer = layer_ref[0]
    t0, m = it * block_t, block_t * heads
    pos = pos_ref[b, pl.ds(t0, block_t)]                                     # [bt]
    dot_dtype = _dot_dtype(q_ref.dtype)
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None  # fp32: no tf32
    q = q_ref[b, pl.ds(t0 * heads, m), :].astype(dot_dtype)                   # [bt * H, D]
    w = w_ref[b, pl.ds(t0 * heads, m)]                                       # [bt * H] fp32, D**-0.5 folded in
    d = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)
    first = g * steps
    n_here = jnp.minimum(steps, table_ref.shape[1] // block_n - first)
    n_vis = jnp.clip((jnp.max(pos) + block_n) // block_n - first, 0, n_here)  # blocks with a visible key
    if capacity is not None:
        rows = b * pos_ref.shape[1] + t0 + jnp.arange(block_t, dtype=jnp.int32)   # [bt] rows of B * Tp
        lo, hi = br_ref[rows, 0], br_ref[rows, 1]
        _, _, end, top = _search_start(lo, hi, bits)

    def block(j, carry):
        n0 = (first + j) * block_n
        cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
        if gathered:
            keys = k_ref[b, pl.ds(n0, block_n), :]                            # [bn, D]
            scale = scale_ref[b, pl.ds(n0, block_n)] if fp8 else None
        else:
            slots = table_ref[b, pl.ds(n0, block_n)]                          # pool slots of these keys
            keys = k_ref[layer, slots[:, None], d[None, :]]                   # [bn, D] through the page table
            scale = scale_ref[layer, slots] if fp8 else None
        s = jnp.dot(keys.astype(dot_dtype), q.T, precision=precision, preferred_element_type=jnp.float32)
        if epilogue:
            s = jnp.maximum(s, 0.0) * w[None, :]
        acc = jnp.sum(s.reshape(block_n, block_t, heads), axis=-1)            # [bn, bt]
        if fp8 and epilogue:
            acc = acc * scale[:, None]
        if capacity is None:
            o_ref[b, pl.ds(t0, block_t), pl.ds(n0, block_n)] = jnp.where(cols[:, None] <= pos[None, :], acc, NEG_INF).T
            return carry
        key = jnp.where((cols[:, None] <= pos[None, :]) & (cols[:, None] < width), order_keys(acc), NEG_INF_KEY)
        return _keep_candidates(key, cols[:, None], lo[None, :], end[None, :], top, *carry, capacity,
                                lambda at, pair, keep: plt.store(
                                    cand_ref.at[rows[None, :, None], 0, at[0], at[1]], pair, mask=keep))

    def masked_block(j, carry):
        o_ref[b, pl.ds(t0, block_t), pl.ds((first + j) * block_n, block_n)] = jnp.full(
            (block_t, block_n), NEG_INF, jnp.float32)
        return carry

    if capacity is not None:
        zeros = jnp.zeros((block_t,), jnp.int32)
        n_cand, n_past = jax.lax.fori_loop(0, n_vis, block, (zeros, zeros))
        for field, value in ((_VIS, jnp.clip(pos + 1, 0, width)), (_PAST, n_past), (_CAND, n_cand),
                             (_LO_KEY, lo), (_HI_KEY, hi)):
            plt.store(rec_ref.at[rows, 0, field], value)
        return
    jax.lax.fori_loop(0, n_vis, block, jnp.int32(0))
    if write_invisible:
        jax.lax.fori_loop(n_vis, n_here, masked_block, jnp.int32(0))



def index_scores_pallas(q, w, index_k, index_scale, layer, slot_table, positions, *, block_m: int = 128,
                        block_n: int = 64, steps: int = 32, num_warps: int = 4, num_stages: int = 3,
                        gather_keys: bool | None = None, interpret: bool = False, poison: float | None = None,
                        epilogue: bool = True, write_invisible: bool = True, mgpu: bool | dict = False,
                        contiguous_blocks: bool = False, q_scale=None):
    """The indexer's scores, the keys read through the page table (in the kernel, or gathered once
    before it when many query blocks read them), with no [B, T, H, S] per-head intermediate.
    q [B, T, H, D]; w [B, T, H] fp32; index_k [L, slots, D] (fp8 with index_scale [L, slots], or plain
    with index_scale None), read at `layer` (the stacked pool is passed whole: slicing a layer out would
    copy it); slot_table [B, S]; positions [B, T]. Returns [B, T, S] fp32 with -inf where invisible.
    block_m: query rows x heads per program; steps: key blocks per program; gather_keys (None: by
    GATHER_KEYS_MIN_QUERY_BLOCKS): copy each request's keys in table order, in the dot's dtype, before
    the kernel. The defaults were the fastest tiling measured on the H200 for prefill and decode alike
    (docs/perf.md); they fit shared memory with fp32 queries. write_invisible=False: key blocks that
    no query of a query block sees are not written (their values are undefined), for a consumer that
    reads each row only below its length (positions + 1), as the selection does; at a causal prefill
    that is half of the [T, S] matrix. mgpu (True, or a scores_mgpu tiling dict): the gathered path
    runs the Mosaic GPU kernel instead (bf16 queries; the keys are then always gathered; operands it
    cannot take raise ValueError naming why). interpret: True, or Mosaic GPU interpreter parameters
    for the mgpu kernel (plgpu.InterpretGPUParams). q_scale [B, T, H]: q is fp8 with that scale per
    token and head (fold_query_scale)."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    T, S = q.shape[1], slot_table.shape[1]
    out = _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, block_m=block_m, block_n=block_n,
                       steps=steps, num_warps=num_warps, num_stages=num_stages, gather_keys=gather_keys,
                       interpret=interpret, poison=poison, epilogue=epilogue, write_invisible=write_invisible,
                       mgpu=mgpu, contiguous_blocks=contiguous_blocks)
    return out[:, :T, :S]



def _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, *, block_m: int, block_n: int, steps: int,
                 num_warps: int, num_stages: int, gather_keys: bool | None, interpret: bool, poison=None,
                 epilogue: bool = True, write_invisible: bool = True, bracket=None, capacity: int | None = None,
                 bits: int = 4, mgpu: bool | dict = False, contiguous_blocks: bool = False):
    """The scores kernel on padded operands: [B, Tp, Sp] scores, or with a bracket ([B * Tp, 2] lo/hi
    per padded row) the fused indexer's (record, candidates) over all key blocks in one group."""
    B, T, H, D = q.shape
    S = slot_table.shape[1]
    block_t = query_block(T, H, block_m)
    block_n = min(block_n, max(16, pl.next_power_of_2(S)))
    wants_mgpu = mgpu is True or isinstance(mgpu, dict)          # ({} : the default tiling)
    if gather_keys is None:
        gather_keys = gathers_keys(T, H, block_m)
    paged = wants_mgpu and contiguous_blocks and not gather_keys
    tiling = (mgpu_tiling(mgpu, T, H, paged)
              if wants_mgpu and bracket is None and epilogue else None)
    if tiling is not None and poison is not None:
        raise ValueError("index_scores_pallas(mgpu=...) cannot poison its output (Mosaic GPU's interpreter "
                         "starts outputs as NaN)")
    if tiling is not None and paged:
        block_t, block_n = tiling["block_t"], scores_mgpu.BLOCK_KV
    elif tiling is not None:
        block_t, block_n, gather_keys = scores_mgpu.COMPUTE_WGS * tiling["block_t"], tiling["block_kv"], True
    q = _pad_to(q, 1, block_t, 0)
    Tp = q.shape[1]
    q = q.reshape(B, Tp * H, D)
    w = _pad_to(w.astype(jnp.float32) * D ** -0.5, 1, block_t, 0).reshape(B, Tp * H)  # relu(x) c = relu(x c), c > 0
    pos = _pad_to(positions.astype(jnp.int32), 1, block_t, -1)
    table = _pad_to(slot_table.astype(jnp.int32), 1, block_n, 0)
    n_blocks = table.shape[1] // block_n
    steps = n_blocks if bracket is not None else max(1, min(steps, n_blocks))
    fp8 = index_scale is not None
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if tiling is not None and paged:
        L, R = index_k.shape[:2]                 # the pool as rows (a free reshape): block bases by layer
        return scores_mgpu.paged_scores_mgpu(
            q, w, pos, index_k.reshape(L * R, D), index_scale.reshape(L * R) if fp8 else None,
            layer[0] * R + table[:, ::block_n], heads=H, block_t=block_t, stages=tiling["stages"],
            blocks_per_program=tiling["blocks_per_program"], write_invisible=write_invisible, interpret=interpret)
    keys = [index_k] + ([index_scale] if fp8 else [])
    if gather_keys:
        # (one gather indexed by layer and slot: slicing the layer out first could copy it whole)
        keys = [index_k[layer[0], table].astype(_dot_dtype(q.dtype))]
        keys += [index_scale[layer[0], table]] if fp8 else []
    if tiling is not None:
        return scores_mgpu.gathered_scores_mgpu(q, w, pos, keys[0], keys[1] if fp8 else None, heads=H,
                                                write_invisible=write_invisible, interpret=interpret, **tiling)
    kernel = functools.partial(_scores_kernel, heads=H, block_t=block_t, block_n=block_n, steps=steps, fp8=fp8,
                               gathered=gather_keys, epilogue=epilogue, write_invisible=write_invisible,
                               capacity=capacity if bracket is not None else None, bits=bits, width=S)
    args = [layer, q, w, pos, table] + keys
    if bracket is None:
        out_shape = jax.ShapeDtypeStruct((B, Tp, table.shape[1]), jnp.float32)
    else:
        args.append(bracket)
        out_shape = (jax.ShapeDtypeStruct((B * Tp, 1, 8), jnp.int32),
                     jax.ShapeDtypeStruct((B * Tp, 1, capacity + 1, 2), jnp.int32))
    return _call(kernel, (B, Tp // block_t, -(-n_blocks // steps)), args, out_shape, poison, num_warps, num_stages,
                 interpret)

