"""The indexer in plain jnp, the definition the kernels are checked against: the lightning indexer's
scores (HF order of operations) over dequantized keys, and the top-k selection by lax.top_k in the
package's result convention (ascending positions, -1 padding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.indexer.common import NEG_INF
from pallas_kernels.indexer.quant import dequantize_index_k

def select_topk_reference(scores, k: int):
    """lax.top_k (stable: ties to the lower position), -inf never selected, then ascending positions
    with -1 padding. scores [..., N] fp32."""
    n = scores.shape[-1]
    scores = jnp.where(scores == 0, jnp.zeros((), scores.dtype), scores)
    vals, idx = jax.lax.top_k(scores, min(k, n))
    idx = jnp.sort(jnp.where(vals == NEG_INF, n, idx), axis=-1)
    idx = jnp.where(idx == n, -1, idx).astype(jnp.int32)
    if k > n:
        idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (k - n,), -1, jnp.int32)], axis=-1)
    return idx


def index_scores_reference(q, w, keys, positions, head_dim: int):
    """The lightning indexer's scores (HF order of operations): q [B, T, H, D], w [B, T, H] (already
    scaled by H**-0.5), keys [B, S, D] fp32 (dequantized), positions [B, T] (-1 = padding lane).
    Key j is visible to (b, t) iff j <= positions[b, t]; invisible scores are -inf."""
    scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys) * head_dim ** -0.5
    scores = jax.nn.relu(scores)
    index_scores = jnp.einsum("bth,bths->bts", w, scores)
    visible = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    return jnp.where(visible, index_scores, NEG_INF)


def index_keys_fp32(index_k, index_scale, layer, slot_table):
    """The keys at `layer` in table order as fp32, dequantized (index_scale given) or widened: what the
    reference scores are computed from. [B, S, D]."""
    keys = index_k[layer][slot_table]
    if index_scale is None:
        return keys.astype(jnp.float32)
    return dequantize_index_k(keys, index_scale[layer][slot_table])

