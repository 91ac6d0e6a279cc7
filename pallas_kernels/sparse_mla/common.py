"""Argument checks shared by the sparse MLA reference and kernel."""

from __future__ import annotations

import jax.numpy as jnp


def check_sparse_mla_args(q_lat, q_rope, latent, k_rope, slots):
    N, H, C = q_lat.shape
    R = q_rope.shape[-1]
    if (q_rope.shape != (N, H, R) or latent.ndim != 3 or latent.shape[-1] != C or k_rope.ndim != 3
            or k_rope.shape[:2] != latent.shape[:2] or k_rope.shape[-1] != R or slots.ndim != 2
            or slots.shape[0] != N or not jnp.issubdtype(slots.dtype, jnp.integer)):
        raise ValueError(
            f"sparse MLA takes q_lat [N, H, C], q_rope [N, H, R], latent [L, P, C], k_rope [L, P, R], integer "
            f"slots [N, K]; got q_lat {tuple(q_lat.shape)}, q_rope {tuple(q_rope.shape)}, latent "
            f"{tuple(latent.shape)}, k_rope {tuple(k_rope.shape)}, slots {tuple(slots.shape)} {slots.dtype}")
