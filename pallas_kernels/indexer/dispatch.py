"""The indexer's dispatch: which path one indexer call takes (the kernels or the jnp composition; the
fused indexer; which scores kernel; query chunks of bounded score memory), chosen from the call's
shapes and the caller's KernelPolicy.

Scores: the gathered Mosaic GPU kernel for calls that gather their keys and have enough programs
(prefill), the paged Mosaic GPU kernel for short calls over a table of whole 64-slot blocks (decode),
the Triton kernel for the rest; then the selection over each row's visible length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.indexer import scores_mgpu
from pallas_kernels.indexer.common import check_indexer_args, fold_query_scale
from pallas_kernels.indexer.fused import indexer_topk_fused
from pallas_kernels.indexer.reference import index_keys_fp32, index_scores_reference, select_topk_reference
from pallas_kernels.indexer.scores import index_scores_pallas
from pallas_kernels.indexer.select import select_topk
from pallas_kernels.indexer.tuning import gathers_keys, paged_block_t, paged_blocks_per_program
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


def _pow2(n: int) -> bool:
    """Whether the Triton kernels' tiles take a dimension of n (a power of two, at least 16)."""
    return n >= 16 and n & (n - 1) == 0


def use_mgpu_scores(B: int, T: int, H: int, D: int, q_dtype, contiguous_blocks: bool = False,
                    key_dtype=None, *, policy: KernelPolicy = DEFAULT_POLICY) -> bool:
    """Whether the dispatch runs these scores through a Mosaic GPU kernel: the gathered one
    (policy.mgpu_scores, keys gathered because enough query blocks read them, at least
    policy.mgpu_min_programs programs) or the paged one (policy.mgpu_paged, contiguous_blocks, keys not
    gathered), where its shapes fit."""
    if gathers_keys(T, H):
        programs = B * pl.cdiv(T, scores_mgpu.COMPUTE_WGS * scores_mgpu.DEFAULT_TILING["block_t"])
        return (policy.mgpu_scores and programs >= policy.mgpu_min_programs
                and scores_mgpu.mgpu_shape_error(H, D, q_dtype, **scores_mgpu.DEFAULT_TILING) is None)
    return (policy.mgpu_paged and contiguous_blocks and scores_mgpu.mgpu_shape_error(
        H, D, q_dtype, block_t=paged_block_t(T, H), key_dtype=key_dtype) is None)


@jax.named_call     # profiles name the ops inside by this scope
def indexer_topk(q, w, index_k, index_scale, layer, slot_table, positions, k: int, contiguous_blocks: bool = False,
                 q_scale=None, *, policy: KernelPolicy = DEFAULT_POLICY, head_axis: str | None = None):
    """The dispatch for the whole indexer selection on one device: kernels on GPU (scores through the
    page table, then selection over each row's visible length; or the fused path with
    policy.fused_indexer), the jnp composition elsewhere; in query chunks of at most
    policy.scores_max_bytes of scores.
    contiguous_blocks: the caller promises that each 64-position block of slot_table is 64
    consecutive slots (pages of a multiple of 64 slots), which lets short calls read the keys from
    the pool by TMA (the paged Mosaic GPU kernel). q_scale [B, T, H]: q is fp8 with that scale per
    token and head (fold_query_scale: every path, kernels or not, then sees plain queries).
    head_axis: q and w hold this rank's heads of a tensor-parallel split over that mesh axis; the
    per-rank head sums of the scores are added before the selection (the fused path, which never
    holds the scores, is not taken)."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    B, T, H, D = q.shape
    kernels = policy.on_gpu() and _pow2(D) and _pow2(H)  # Triton tiles: power-of-two dims
    if kernels and policy.fused_indexer and head_axis is None:
        return indexer_topk_fused(q, w, index_k, index_scale, layer, slot_table, positions, k, policy=policy)
    chunk = max(1, policy.scores_max_bytes // (B * slot_table.shape[1] * 4 * (1 if kernels else H)))
    chunk -= chunk % 128 if chunk >= 128 else 0
    keys = None if kernels else index_keys_fp32(index_k, index_scale, layer, slot_table)

    def select(t0):
        q_, w_, pos_ = q[:, t0:t0 + chunk], w[:, t0:t0 + chunk], positions[:, t0:t0 + chunk]
        if kernels:
            mgpu = use_mgpu_scores(B, q_.shape[1], H, D, q.dtype, contiguous_blocks, index_k.dtype, policy=policy)
            if mgpu and policy.mgpu_paged_one_wave:      # (the gathered kernel's tiling ignores the key)
                mgpu = {"blocks_per_program": paged_blocks_per_program(B, q_.shape[1], H, slot_table.shape[1])}
            scores = index_scores_pallas(q_, w_, index_k, index_scale, layer, slot_table, pos_, write_invisible=False,
                                         mgpu=mgpu, contiguous_blocks=contiguous_blocks)
            return select_topk(sum_heads(scores), k, pos_ + 1, policy=policy)
        return select_topk_reference(sum_heads(index_scores_reference(q_, w_, keys, pos_, D)), k)

    def sum_heads(scores):
        return scores if head_axis is None else jax.lax.psum(scores, head_axis)
    if T <= chunk:
        return select(0)
    return jnp.concatenate([select(t0) for t0 in range(0, T, chunk)], axis=1)
