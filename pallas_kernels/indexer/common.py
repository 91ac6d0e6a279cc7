"""What the indexer's kernels share: the order-preserving int32 key of an fp32 score, the per-row path
ids and record fields the selection reports, argument checks, and the pallas_call form every kernel
uses (operands left in HBM; the kernels index them themselves)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG_INF = float("-inf")
INT_MIN = -(2 ** 31)


def order_keys(scores):
    """int32 keys with the order of the fp32 scores (-0.0 and +0.0 equal; -inf the smallest
    non-NaN key)."""
    s = jnp.where(scores == 0, jnp.zeros((), jnp.float32), scores.astype(jnp.float32))
    b = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


NEG_INF_KEY = -2139095041  # order_keys(-inf)

PATHS = ("all visible", "sampled bracket", "full search")  # per-row path ids the kernel reports
_VIS, _PAST, _CAND, _LO_KEY, _HI_KEY = range(5)           # the per-segment record the first call writes

def check_selection_args(scores, k, lengths):
    """Clear errors for what the kernels would otherwise read out of bounds or silently convert."""
    if not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if scores.ndim < 1 or not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"scores must be a float array of at least one dimension, got {scores.dtype} "
                        f"{scores.shape}")
    if lengths is not None and tuple(lengths.shape) != tuple(scores.shape[:-1]):
        raise ValueError(f"lengths {tuple(lengths.shape)} must have the shape of scores without its last axis "
                         f"{tuple(scores.shape[:-1])}")


def check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions):
    """Clear errors for mismatched indexer operands: the kernels index them unchecked, so a short
    positions or table would be read out of bounds."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got {tuple(q.shape)}")
    B, T, H, D = q.shape
    for name, x, want in (("w", w, (B, T, H)), ("positions", positions, (B, T))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} {tuple(x.shape)} must be {want} for q {tuple(q.shape)}")
    if slot_table.ndim != 2 or slot_table.shape[0] != B:
        raise ValueError(f"slot_table {tuple(slot_table.shape)} must be [B, S] with B = {B}")
    if index_k.ndim != 3 or index_k.shape[2] != D:
        raise ValueError(f"index_k {tuple(index_k.shape)} must be [layers, slots, {D}]")
    if index_scale is not None and tuple(index_scale.shape) != tuple(index_k.shape[:2]):
        raise ValueError(f"index_scale {tuple(index_scale.shape)} must be {tuple(index_k.shape[:2])}")
    if isinstance(layer, int) and not 0 <= layer < index_k.shape[0]:
        raise ValueError(f"layer {layer} out of range for {index_k.shape[0]} layers")


def fold_query_scale(q, w, q_scale, key_dtype):
    """fp8 queries with their scale per (token, head) [B, T, H] (DeepSeek's indexer format: amax /
    448 over the head's D values, so positive) as the kernels take them: the queries widened
    exactly, to bf16 (fp32 over fp32 keys, which a bf16 dot would round), and the scale folded into
    the head weights, since relu(s x) = s relu(x) for s >= 0 (DeepSeek's own indexer folds it so).
    Plain queries (q_scale None) pass through. ValueError for a scale without fp8 queries, fp8
    queries without one, or a scale of the wrong shape."""
    fp8 = jnp.dtype(q.dtype).itemsize == 1
    if fp8 != (q_scale is not None):
        raise ValueError(f"q_scale is given exactly for fp8 queries (their per-token, per-head scale); got q "
                         f"{jnp.dtype(q.dtype).name} with q_scale "
                         f"{None if q_scale is None else tuple(q_scale.shape)}")
    if q_scale is None:
        return q, w
    if tuple(q_scale.shape) != tuple(q.shape[:3]):
        raise ValueError(f"q_scale {tuple(q_scale.shape)} must be {tuple(q.shape[:3])} for q {tuple(q.shape)}")
    wide = jnp.float32 if jnp.dtype(key_dtype) == jnp.float32 else jnp.bfloat16
    return q.astype(wide), w * q_scale.astype(jnp.float32)


def _pad_to(x, axis: int, multiple: int, value):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _call(kernel, grid, args, out_shape, poison, num_warps: int, num_stages: int, interpret: bool):
    """pallas_call with every operand left in HBM (the kernels index it themselves). `poison` (tests):
    the first output buffer starts filled with it (an extra input aliased to the output), so an
    element the kernel fails to write shows. out_shape: one shape or a tuple (the first is poisoned)."""
    aliases = {}
    first = out_shape[0] if isinstance(out_shape, tuple) else out_shape
    if poison is not None:
        aliases = {len(args): 0}
        args = list(args) + [jnp.full(first.shape, poison, first.dtype)]
    spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[spec] * len(args),
        out_specs=tuple(spec for _ in out_shape) if isinstance(out_shape, tuple) else spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)

