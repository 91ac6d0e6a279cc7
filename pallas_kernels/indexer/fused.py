"""The fused indexer (indexer_topk_fused): the indexer's top-k without the [T, S] scores in HBM.

The scores of a sample of the columns give each row's bracket, the scores kernel itself keeps the
keys >= lo (the same column-ordered candidates as the selection's filter pass), and the selection's
second call finishes from them; rows whose bracket missed are redone the unfused way. Not the
dispatch's default (KernelPolicy.fused_indexer): on the H200 keeping candidates inside the scores loop
cost more than writing the scores and reading them back (docs/perf.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.indexer.common import (INT_MIN, NEG_INF, _call, _pad_to, check_indexer_args, fold_query_scale,
                                           order_keys)
from pallas_kernels.indexer.reference import select_topk_reference
from pallas_kernels.indexer.scores import _scores_call, index_scores_pallas
from pallas_kernels.indexer.select import TAKE_ALL, _Row, _sampled_bracket, _threshold_emit_kernel, select_topk
from pallas_kernels.indexer.tuning import query_block, selects_by_kernel
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


def _sample_bracket_kernel(len_ref, m_ref, s_ref, br_ref, *, k: int, bits: int, capacity: int, sub: int):
    """Program (row) of the fused indexer: the bracket of a row of len_ref[row] visible keys from the
    scores of its m_ref[row] visible sampled columns (s_ref [rows, S_s]: the sample's columns are
    spread evenly over the table, so a row's visible ones are spread evenly over the row)."""
    r = _Row(len_ref, None, pl.program_id(0), sub, bits, width=2 ** 31 - 1)
    row, length, m = r.row, r.length, m_ref[pl.program_id(0)]

    def sample_keys(i):
        at = i * sub + jnp.arange(sub, dtype=jnp.int32)
        return jnp.where(at < m, order_keys(s_ref[row, pl.ds(pl.multiple_of(i * sub, sub), sub)]), INT_MIN)

    lo, hi = jax.lax.cond(length > capacity, lambda: _sampled_bracket(r, sample_keys, (m + sub - 1) // sub, m, length, k),
                          lambda: (length * 0 + TAKE_ALL[0], length * 0 + TAKE_ALL[1]))
    br_ref[row, 0] = lo
    br_ref[row, 1] = hi


def sample_columns(S: int, sample: int) -> np.ndarray:
    """The fused indexer's sample: blocks of 16 consecutive columns spread evenly over a table of S."""
    n_blocks = max(1, min(sample, S) // 16)
    start = (np.arange(n_blocks) * S // n_blocks) // 16 * 16
    return (start[:, None] + np.arange(16)[None, :]).reshape(-1)


def indexer_topk_fused(q, w, index_k, index_scale, layer, slot_table, positions, k: int, *,
                       capacity: int | None = None, sample: int = 2048, sample_sub: int = 256, sub: int = 1024,
                       bits: int = 4, block_m: int = 128, block_n: int = 64, num_warps: int = 4, num_stages: int = 3,
                       select_warps: int = 8, fallback_rows: int = 64, interpret: bool = False,
                       poison: int | None = None, return_path: bool = False, q_scale=None,
                       policy: KernelPolicy = DEFAULT_POLICY):
    """The indexer's top-k without the [T, S] scores in HBM (for prefill: T query tokens per request).
    1. The scores of a sample of the columns (blocks of 16 spread over the table) give each row's
       bracket [lo, hi) (_sample_bracket_kernel; rows of at most `capacity` visible keys keep all).
    2. The scores kernel, one program per query block over all its key blocks, keeps each token's
       keys >= lo with their columns instead of writing the scores (_scores_kernel with a capacity).
    3. The selection's second call finds each row's threshold among its candidates and writes the
       positions.
    A row whose bracket missed or whose candidates overflowed (path 2) is redone the unfused way,
    `fallback_rows` rows at a time (so at most fallback_rows x S scores exist at once). Same result convention
    as indexer_topk; with return_path also each row's path (before any redo). poison (tests): the
    positions buffer starts filled with it, so a position the kernels fail to write shows. q_scale:
    fp8 queries' scale, as in indexer_topk. policy: whether the redo runs the kernels."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    B, T, H, D = q.shape
    S = slot_table.shape[1]
    capacity = capacity or max(4096, -(-3 * k // 1024) * 1024)
    if capacity % sub or sub % 16 or sample_sub % 16 or k > capacity:
        raise ValueError(f"capacity ({capacity}) must be a multiple of sub ({sub}) and at least k ({k}); "
                         f"sub and sample_sub ({sample_sub}) multiples of 16")
    block_t = query_block(T, H, block_m)
    q, w = _pad_to(q, 1, block_t, 0), _pad_to(w, 1, block_t, 0)
    positions = _pad_to(positions.astype(jnp.int32), 1, block_t, -1)
    Tp = q.shape[1]
    rows = B * Tp
    length = jnp.clip(positions + 1, 0, S).reshape(rows)
    common = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if S > capacity:
        cols = sample_columns(S, sample)
        n_visible = jnp.searchsorted(jnp.asarray(cols), positions, side="right",
                                     method="scan_unrolled").astype(jnp.int32)
        s_scores = _scores_call(q, w, index_k, index_scale, layer, slot_table[:, cols], n_visible - 1, steps=32,
                                gather_keys=None, write_invisible=False, **common)[:, :, :cols.size]
        s_scores = _pad_to(s_scores.reshape(rows, cols.size), 1, sample_sub, NEG_INF)
        bracket = _call(functools.partial(_sample_bracket_kernel, k=k, bits=bits, capacity=capacity, sub=sample_sub),
                        (rows,), [length, n_visible.reshape(rows), s_scores],
                        jax.ShapeDtypeStruct((rows, 2), jnp.int32), None, select_warps, 1, interpret)
    else:
        bracket = jnp.broadcast_to(jnp.asarray(TAKE_ALL, jnp.int32), (rows, 2))
    record, cands = _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, steps=0, gather_keys=None,
                                 bracket=bracket, capacity=capacity, bits=bits, **common)
    out_chunk = min(1024, pl.next_power_of_2(k))
    k_pad = -(-k // out_chunk) * out_chunk
    emit = functools.partial(_threshold_emit_kernel, k=k, chunk=sub, bits=bits, capacity=capacity, sub=sub, segs=1,
                             seg_chunks=1, out_chunk=out_chunk, stop_after=None, width=S)
    out, path = _call(lambda len_ref, rec_ref, cand_ref, *refs: emit(len_ref, None, rec_ref, cand_ref, *refs),
                      (rows, 1), [length, record, cands],
                      (jax.ShapeDtypeStruct((rows, k_pad + 1), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32)),
                      poison, select_warps, 1, interpret)
    out = out[:, :k].reshape(B, Tp, k)[:, :T]
    path = path.reshape(B, Tp)[:, :T]
    q, w, positions = q[:, :T], w[:, :T], positions[:, :T]

    redo = (path == 2).reshape(-1)
    n_redo = jnp.sum(redo.astype(jnp.int32))
    n_fix = min(fallback_rows, B * T)
    redo_rows = jnp.nonzero(redo, size=B * T, fill_value=0)[0]

    def unfused(q_, w_, table_, pos_):
        scores = index_scores_pallas(q_, w_, index_k, index_scale, layer, table_, pos_, write_invisible=False,
                                     **common)
        if interpret or not policy.on_gpu() or not selects_by_kernel(scores.size // S, S):
            return select_topk_reference(jnp.where(jnp.arange(S) <= pos_[..., None], scores, NEG_INF), k)
        return select_topk(scores, k, pos_ + 1, policy=policy)

    def redo_chunk(c, out):
        at = c * n_fix + jnp.arange(n_fix)
        valid = at < n_redo
        idx = redo_rows[jnp.minimum(at, B * T - 1)]
        b, t = idx // T, idx % T
        pos_r = jnp.where(valid, positions[b, t], -1)[:, None]
        sel = unfused(q[b, t][:, None], w[b, t][:, None], slot_table[b], pos_r)[:, 0]
        return out.at[jnp.where(valid, idx, B * T)].set(sel, mode="drop")

    out = jax.lax.fori_loop(0, (n_redo + n_fix - 1) // n_fix, redo_chunk, out.reshape(B * T, k)).reshape(B, T, k)
    return (out, path) if return_path else out
