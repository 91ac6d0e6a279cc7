"""The jnp reference of sparse MLA: gather each query's selected rows, softmax, weighted sum.

    s[h, j] = scale * (q_lat[h] . latent[slot_j] + q_rope[h] . k_rope[slot_j])     (slot_j >= 0)
    o_lat[h] = sum_j softmax_j(s[h, :]) latent[slot_j]

A query with no selected row gets zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_mla.common import check_sparse_mla_args


def selected_scores(q_lat, q_rope, latent, k_rope, layer, slots, scale: float):
    """(scores [N, H, K] fp32, scale applied, -inf where a slot is not selected; the selected rows'
    latents [N, K, C] in q's dtype; the selection mask [N, K]) for the arguments of sparse_mla_reference."""
    check_sparse_mla_args(q_lat, q_rope, latent, k_rope, slots)
    valid = slots >= 0
    safe = jnp.maximum(slots, 0)
    lat = latent[layer][safe].astype(q_lat.dtype)                                # [N, K, C]
    rope = k_rope[layer][safe].astype(q_lat.dtype)
    precision = jax.lax.Precision.HIGHEST if q_lat.dtype == jnp.float32 else None
    s = (jnp.einsum("nhc,nkc->nhk", q_lat, lat, precision=precision, preferred_element_type=jnp.float32)
         + jnp.einsum("nhr,nkr->nhk", q_rope, rope, precision=precision, preferred_element_type=jnp.float32))
    return jnp.where(valid[:, None, :], s * scale, -jnp.inf), lat, valid


def sparse_mla_reference(q_lat, q_rope, latent, k_rope, layer, slots, scale: float):
    """q_lat [N, H, C], q_rope [N, H, R]; latent [L, P, C], k_rope [L, P, R] (the pool, read at
    `layer`); slots [N, K] int32 pool slots (< 0: not selected); returns o_lat [N, H, C] in q's dtype,
    the softmax in fp32."""
    s, lat, valid = selected_scores(q_lat, q_rope, latent, k_rope, layer, slots, scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(valid[:, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("nhk,nkc->nhc", p, lat.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0).astype(q_lat.dtype)


def sparse_mla_stats_reference(q_lat, q_rope, latent, k_rope, layer, slots, scale: float):
    """The softmax statistics sparse_mla_mgpu(with_stats=True) returns, [N, 2, H] fp32: each query's
    and head's largest scaled score m and sum l of 2^(s - m) over its selected rows, in log2 units
    (s = scale * score * log2 e); m = -1e30 and l = 0 for a query with none."""
    s, _, valid = selected_scores(q_lat, q_rope, latent, k_rope, layer, slots, scale * 1.4426950408889634)
    m = jnp.maximum(jnp.max(s, axis=-1), -1e30)
    l = jnp.sum(jnp.where(valid[:, None, :], jnp.exp2(s - m[..., None]), 0.0), axis=-1)
    return jnp.stack([m, l], axis=1)
