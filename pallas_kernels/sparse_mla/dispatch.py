"""Which sparse MLA runs: the kernel on GPU where its shapes fit, else the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.sparse_mla.kernel import Tiling, sparse_mla_pallas
from pallas_kernels.sparse_mla.kernel_mgpu import BLOCK, mgpu_shape_error, sparse_mla_mgpu, sparse_mla_mgpu_rows
from pallas_kernels.sparse_mla.reference import sparse_mla_reference

_SM_COUNT = 132   # H200: below about two programs per SM the selected rows are split over programs


def kernel_shape_error(q_lat, q_rope) -> str | None:
    """Why the kernel cannot take these operands (None: it can)."""
    C, R = q_lat.shape[-1], q_rope.shape[-1]
    for name, d in (("latent width", C), ("rope width", R)):
        if d < 16 or d & (d - 1):
            return f"{name} {d} is not a power of two >= 16"
    if q_lat.dtype not in (jnp.bfloat16, jnp.float16):
        # fp32: compiled on the H200 it equals the reference at the tiny model's widths (latent <= 128,
        # tests/test_sparse_mla.py); left off until the GPU HF-parity suite has run through it
        return f"queries are {q_lat.dtype}, the dispatch takes the kernel for bf16 and fp16"
    return None


def tiling_for(N: int, H: int, K: int, dtype=jnp.bfloat16) -> Tiling:
    """The tiling of a call (measured on the H200, docs/perf.md): 64 heads per program (fewer heads: the
    next power of two >= 16). Enough queries for two programs per SM (prefill): 128 rows per step in
    one stage; fewer (decode, verify): 64-row steps in two stages, each query's rows split over
    programs until they cover the SMs twice. fp32: 32-row steps, four warps."""
    block_h = min(64, max(16, 1 << (H - 1).bit_length()))
    programs = N * -(-H // block_h)
    if jnp.dtype(dtype) == jnp.float32:
        return Tiling(block_h=block_h, block_k=32, num_warps=4, num_stages=2)
    if programs >= 2 * _SM_COUNT:
        return Tiling(block_h=block_h, block_k=128, num_stages=1)
    splits = max(1, min(-(-K // 64), -(-2 * _SM_COUNT // programs)))
    return Tiling(block_h=block_h, block_k=64, num_stages=2, splits=splits)


def kernel_applies(q_lat, q_rope, policy: KernelPolicy) -> bool:
    """Whether sparse_mla runs the kernel for these operands (shapes or ShapeDtypeStructs)."""
    return policy.on_gpu() and policy.sparse_mla_kernel and kernel_shape_error(q_lat, q_rope) is None


def mgpu_applies(q_lat, q_rope, policy: KernelPolicy) -> bool:
    """Whether a kernel call takes the Mosaic GPU kernel: with one program per query for prefill-sized
    calls (two programs per SM at least); fewer queries cut their rows in shares (row_splits_for)
    with policy.mgpu_sparse_mla_rows, else they take the Triton kernel."""
    return policy.mgpu_sparse_mla and mgpu_shape_error(q_lat, q_rope) is None


def row_splits_for(N: int, K: int) -> int:
    """Programs per query of a decode-sized Mosaic GPU call: one wave over the SMs (the kernel holds
    one program per SM), each share at least one 64-row block. Measured on the H200 (docs/perf.md,
    2026-12-04): at 64 queries 2 shares 78.7 us, 1 / 3 / 4 / 5 shares 117 / 100 / 90 / 106 us; at 8
    queries 8 and 16 shares 31 us, 4 and 32 shares 42 us."""
    return max(1, min(_SM_COUNT // N, -(-K // BLOCK)))


@jax.named_call     # profiles name the ops inside by this scope
def sparse_mla(q_lat, q_rope, latent, k_rope, layer, slots, scale: float, *, policy: KernelPolicy = DEFAULT_POLICY,
               packed: bool = False):
    """The dispatch (see sparse_mla_reference for the arguments). packed: the caller promises each row
    of slots lists its selected slots first, -1 after them (the indexer's selection does); the Mosaic
    GPU kernel then skips compacting them (kernel_mgpu.packed_slots)."""
    if kernel_applies(q_lat, q_rope, policy):
        N, H, _ = q_lat.shape
        if mgpu_applies(q_lat, q_rope, policy):
            if N >= 2 * _SM_COUNT:
                return sparse_mla_mgpu(q_lat, q_rope, latent, k_rope, layer, slots, scale,
                                       scores="alternate" if policy.mgpu_sparse_mla_alternate else "both",
                                       l2_prefetch=policy.mgpu_sparse_mla_l2_prefetch, packed=packed)
            if policy.mgpu_sparse_mla_rows:
                return sparse_mla_mgpu_rows(q_lat, q_rope, latent, k_rope, layer, slots, scale,
                                            row_splits=row_splits_for(N, slots.shape[1]),
                                            l2_prefetch=policy.mgpu_sparse_mla_l2_prefetch, packed=packed)
        return sparse_mla_pallas(q_lat, q_rope, latent, k_rope, layer, slots, scale,
                                 tiling=tiling_for(N, H, slots.shape[1], q_lat.dtype))
    return sparse_mla_reference(q_lat, q_rope, latent, k_rope, layer, slots, scale)
