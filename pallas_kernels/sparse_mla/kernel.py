"""Sparse MLA as a Pallas kernel (Triton backend): one program per (query token, head block, split of
its selected rows). The query's heads are the dots' M (DeepSeek/GLM: 64 heads, one MMA tile); each
block of selected rows is gathered from the pool through its slots (data-dependent row gathers, which
Triton expresses as pointer arithmetic and Hopper's TMA cannot), its scores against the latent and
rope parts computed, and an online softmax accumulates the latent rows themselves as the values
(absorbed MLA: W_UK is folded into q before, W_UV applied after). Nothing of size [N, K, C] reaches
HBM, and at prefill the pool's rows of one layer (8k tokens: 9.4 MB) stay in L2 across queries.

With splits > 1 (decode: few queries, too few programs for the SMs) each program covers a share of
the selected rows and writes its partial output with the log-sum-exp; `combine_splits` merges them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.sparse_mla.common import check_sparse_mla_args

_NEG = -1e30   # the running max starts finite, so a block with nothing selected yields exp(-inf) = 0, never NaN


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_h: int = 64        # heads per program (a power of two >= 16; fewer heads are padded)
    block_k: int = 64        # selected rows per loop step
    splits: int = 1          # programs sharing one query's selected rows
    num_warps: int = 8
    num_stages: int = 2


def _sparse_mla_kernel(layer_ref, ends_ref, q_lat_ref, q_rope_ref, slots_ref, lat_ref, rope_ref, o_ref, lse_ref, *,
                       block_h: int, block_k: int, steps: int, scale: float):
    n, hb, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    h0 = hb * block_h
    dtype = q_lat_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None   # fp32: no tf32
    q_lat = q_lat_ref[n, pl.ds(h0, block_h), :]                  # [bh, C]
    q_rope = q_rope_ref[n, pl.ds(h0, block_h), :]                # [bh, R]
    c = jnp.arange(q_lat.shape[-1], dtype=jnp.int32)
    r = jnp.arange(q_rope.shape[-1], dtype=jnp.int32)
    first = g * steps
    blocks = jnp.clip((ends_ref[n] + block_k - 1) // block_k - first, 0, steps)

    def block(j, carry):
        m, l, acc = carry
        slots = slots_ref[n, pl.ds((first + j) * block_k, block_k)]      # [bk]
        valid = slots >= 0
        safe = jnp.maximum(slots, 0)
        lat = lat_ref[layer, safe[:, None], c[None, :]].astype(dtype)      # [bk, C] gathered from the pool
        rope = rope_ref[layer, safe[:, None], r[None, :]].astype(dtype)    # [bk, R]
        s = (jnp.dot(q_lat, lat.T, precision=precision, preferred_element_type=jnp.float32)
             + jnp.dot(q_rope, rope.T, precision=precision, preferred_element_type=jnp.float32))
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(dtype), lat, precision=precision,
                                             preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    m0 = jnp.full((block_h,), _NEG, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    acc0 = jnp.zeros((block_h, q_lat.shape[-1]), jnp.float32)
    m, l, acc = jax.lax.fori_loop(0, blocks, block, (m0, l0, acc0))
    some = l > 0
    o_ref[g, n, pl.ds(h0, block_h), :] = jnp.where(some[:, None], acc / jnp.where(some, l, 1.0)[:, None],
                                                   0.0).astype(o_ref.dtype)
    lse_ref[g, n, pl.ds(h0, block_h)] = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)


def combine_splits(o, lse, dtype):
    """Merges the splits' partial outputs o [G, N, H, C] (each normalized over its own rows) by their
    log-sum-exp lse [G, N, H]; a query with no selected row anywhere stays zero."""
    top = jnp.max(lse, axis=0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)   # [G, N, H]
    total = jnp.sum(w, axis=0)
    out = jnp.einsum("gnh,gnhc->nhc", w, o.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0).astype(dtype)


def sparse_mla_pallas(q_lat, q_rope, latent, k_rope, layer, slots, scale: float, *, tiling: Tiling = Tiling(),
                      interpret: bool = False):
    """sparse_mla_reference as one kernel call (plus the split merge). q_lat [N, H, C], q_rope [N, H, R]
    (C, R powers of two >= 16); latent [L, P, C], k_rope [L, P, R], read at `layer` (the stacked pool is
    passed whole); slots [N, K] (< 0: not selected, anywhere in the row). Returns [N, H, C] in q's dtype."""
    check_sparse_mla_args(q_lat, q_rope, latent, k_rope, slots)
    N, H, C = q_lat.shape
    t = tiling
    bh = t.block_h
    Hp = -(-H // bh) * bh
    if Hp != H:
        pad = ((0, 0), (0, Hp - H), (0, 0))
        q_lat, q_rope = jnp.pad(q_lat, pad), jnp.pad(q_rope, pad)
    K = slots.shape[1]
    blocks = -(-K // t.block_k)
    splits = max(1, min(t.splits, blocks))
    steps = -(-blocks // splits)
    slots = slots.astype(jnp.int32)
    # the loop stops after a query's last selected row: rows past it (unselected tail) are never read
    ends = jnp.max(jnp.where(slots >= 0, jnp.arange(1, K + 1, dtype=jnp.int32), 0), axis=1)
    slots = jnp.pad(slots, ((0, 0), (0, splits * steps * t.block_k - K)), constant_values=-1)
    out_dtype = q_lat.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_sparse_mla_kernel, block_h=bh, block_k=t.block_k, steps=steps, scale=scale)
    spec = pl.BlockSpec(memory_space=pl.ANY)
    o, lse = pl.pallas_call(
        kernel, grid=(N, Hp // bh, splits),
        in_specs=[spec] * 7,
        out_specs=(spec, spec),
        out_shape=(jax.ShapeDtypeStruct((splits, N, Hp, C), out_dtype),
                   jax.ShapeDtypeStruct((splits, N, Hp), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), ends, q_lat, q_rope, slots, latent, k_rope)
    out = o[0] if splits == 1 else combine_splits(o, lse, q_lat.dtype)
    return out[:, :H]
