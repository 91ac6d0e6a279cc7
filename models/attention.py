"""MLA attention with the DSA lightning indexer and sparse attention over the selected keys.

Both attention paths read K from the KVCache layout (latent + rope key per token slot):
- expanded: kv_b_proj expands every visible latent to per-head keys/values; scores are masked to the
  selected positions (long prefill, where the expansion is amortized over many queries);
- absorbed: W_UK is folded into the query and W_UV applied after, attention runs over the latents
  of the selected positions only (decode and short extends; on the GPU every chunk, through the
  sparse MLA kernel, which reads the selected rows from the pool itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.kv import SINGLE_DEVICE, Batch, KVAccess, KVCache
from models.layers import (Dense, LayerNorm, RMSNorm, apply_rope_half, apply_rope_interleaved,
                           rope_cos_sin)
from models.sharding import NO_AXES, MeshAxes
from pallas_kernels.indexer import indexer_topk, quantize_index_k
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.sparse_mla import kernel_applies, sparse_mla

# Masked attention scores use the most negative finite float (as HF does), never -inf: a padding lane
# with nothing selected then gets finite garbage instead of NaN that could reach the dummy slot.
MASKED = float(jnp.finfo(jnp.float32).min)
ATTN_PATHS = ("expanded", "absorbed")


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, stack=()):
        self.cfg = cfg
        self.wq_b = Dense(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype=dtype, rngs=rngs,
                          stack=stack, fp8=cfg.fp8("self_attn.indexer.wq_b"))
        self.wk = Dense(cfg.hidden_size, cfg.index_head_dim, dtype=dtype, rngs=rngs, stack=stack,
                        fp8=cfg.fp8("self_attn.indexer.wk"))
        self.k_norm = LayerNorm(cfg.index_head_dim, 1e-6, dtype=dtype, stack=stack)
        # HF keeps weights_proj in fp32 whatever the model dtype.
        self.weights_proj = Dense(cfg.hidden_size, cfg.index_n_heads, dtype=jnp.float32, rngs=rngs, stack=stack)

    def _rope(self, x, cos, sin):
        r = self.cfg.qk_rope_head_dim
        rot = apply_rope_interleaved if self.cfg.indexer_rope_interleaved else apply_rope_half
        return jnp.concatenate([rot(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def __call__(self, x, q_resid, cos, sin, batch: Batch, cache: KVCache, full_id, k_sel: int,
                 access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, axes: MeshAxes = NO_AXES):
        """Writes this layer's indexer keys, returns (top-k positions [B, T, k_sel], cache). Scores
        this rank's queries against every visible key (gathered from the owners under CP). Under
        tensor parallelism each rank scores with its own heads and the per-head sums are added
        (axes.tp) before the selection."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq_b(q_resid, kernels).reshape(B, T, -1, cfg.index_head_dim)   # this rank's heads
        q = self._rope(q, cos[:, :, None, :], sin[:, :, None, :])
        k = self._rope(self.k_norm(self.wk(x, kernels)), cos, sin)  # [B, T, D]

        if cache.index_fp8:
            kq, ks = quantize_index_k(k)
            index_k = access.write(cache.index_k, full_id, batch.write_slots, kq)
            index_scale = access.write(cache.index_scale, full_id, batch.write_slots, ks)
        else:
            index_k = access.write(cache.index_k, full_id, batch.write_slots, k)
            index_scale = None
        cache = KVCache(cache.latent, cache.k_rope, index_k, index_scale)
        w = self.weights_proj(x.astype(jnp.float32)) * cfg.index_n_heads ** -0.5  # [B, T, H]
        if access.axis is None:
            return indexer_topk(q, w, index_k, index_scale, full_id, batch.slot_table, batch.positions, k_sel,
                                contiguous_blocks=access.contiguous_blocks, policy=kernels, head_axis=axes.tp), cache
        keys, scales, table = gather_index_keys(access, index_k, index_scale, full_id, batch.slot_table)
        return indexer_topk(q, w, keys, scales, 0, table, batch.positions, k_sel, policy=kernels,
                            head_axis=axes.tp), cache


def gather_index_keys(access: KVAccess, index_k, index_scale, layer, slot_table):
    """Under CP: every visible indexer key of each request, as stored (fp8 bytes with their fp32 scale,
    or plain), from the owner ranks in one collective, laid out as a one-layer pool [1, B*S, D] with
    its slot table — so the indexer runs the same dispatch (and kernel) on the same values as on one
    device, and moves 132 B per fp8 key instead of a dequantized fp32 copy."""
    B, S = slot_table.shape
    D = index_k.shape[-1]
    if index_scale is None:
        keys = access.gather(lambda s: index_k[layer][s], slot_table, index_k.shape[1])
        scales = None
    else:
        def key_bytes(s):  # [.., D + 4] uint8: the fp8 key, then its scale's bytes
            k = jax.lax.bitcast_convert_type(index_k[layer][s], jnp.uint8)
            return jnp.concatenate([k, jax.lax.bitcast_convert_type(index_scale[layer][s], jnp.uint8)], axis=-1)
        packed = access.gather(key_bytes, slot_table, index_k.shape[1])         # exact: x + 0 on integers
        keys = jax.lax.bitcast_convert_type(packed[..., :D], index_k.dtype)
        scales = jax.lax.bitcast_convert_type(packed[..., D:], jnp.float32).reshape(1, B * S)
    table = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S)
    return keys.reshape(1, B * S, D), scales, table


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, has_indexer: bool, dtype, rngs: nnx.Rngs, stack=()):
        self.cfg = cfg
        H = cfg.num_attention_heads
        dense = lambda name, din, dout: Dense(din, dout, dtype=dtype, rngs=rngs, stack=stack,  # noqa: E731
                                              fp8=cfg.fp8(f"self_attn.{name}"))
        self.q_a_proj = dense("q_a_proj", cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype=dtype, stack=stack)
        self.q_b_proj = dense("q_b_proj", cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = dense("kv_a_proj_with_mqa", cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype=dtype, stack=stack)
        self.kv_b_proj = dense("kv_b_proj", cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = dense("o_proj", H * cfg.v_head_dim, cfg.hidden_size)
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs, stack=stack) if has_indexer else None

    def __call__(self, x, prev_topk, batch: Batch, cache: KVCache, layer_id, full_id, *, attn_path: str,
                 access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, axes: MeshAxes = NO_AXES):
        """x: input_layernorm output [B, T, D]. Writes this layer's KV (and indexer keys on a full layer),
        then attends each token to its top-k positions. Returns (out [B, T, D], topk, cache). Under
        tensor parallelism (axes.tp) each rank holds and attends with its own heads (q_b, kv_b split by
        head, the latent cache whole on every rank) and o_proj's row-parallel partials are added."""
        cfg = self.cfg
        B, T, _ = x.shape
        dn, dr, dv, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        cos, sin = rope_cos_sin(batch.positions, cfg.rope, dr, x.dtype)

        q_resid = self.q_a_layernorm(self.q_a_proj(x, kernels))
        q = self.q_b_proj(q_resid, kernels)
        H = q.shape[-1] // (dn + dr)   # this rank's heads
        q = q.reshape(B, T, H, dn + dr)
        q_nope = q[..., :dn]
        q_rope = apply_rope_interleaved(q[..., dn:], cos[:, :, None, :], sin[:, :, None, :])

        ckv = self.kv_a_proj_with_mqa(x, kernels)
        latent = self.kv_a_layernorm(ckv[..., :C])
        k_rope = apply_rope_interleaved(ckv[..., C:], cos, sin)
        cache = KVCache(access.write(cache.latent, layer_id, batch.write_slots, latent),
                        access.write(cache.k_rope, layer_id, batch.write_slots, k_rope),
                        cache.index_k, cache.index_scale)

        if self.indexer is not None:
            topk, cache = self.indexer(x, q_resid, cos, sin, batch, cache, full_id, prev_topk.shape[-1], access,
                                       kernels, axes)
        else:
            topk = prev_topk
        n_local = cache.latent.shape[1]
        lat_pool, rope_pool = cache.latent[layer_id], cache.k_rope[layer_id]

        def kv_rows(s):  # latent and rope key of local slots, as one array (one collective under CP)
            return jnp.concatenate([lat_pool[s].astype(x.dtype), rope_pool[s].astype(x.dtype)], axis=-1)

        w_kv = self.kv_b_proj.weight(x.dtype).reshape(C, H, dn + dv)
        w_uk, w_uv = w_kv[..., :dn], w_kv[..., dn:]
        scale = cfg.softmax_scale
        if attn_path == "expanded":
            kv_all = access.gather(kv_rows, batch.slot_table, n_local)         # [B, S, C + dr]
            lat_all, rope_all = kv_all[..., :C], kv_all[..., C:]
            k_nope = jnp.einsum("bsc,chd->bshd", lat_all, w_uk)
            v = jnp.einsum("bsc,chd->bshd", lat_all, w_uv)
            s = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope)
                 + jnp.einsum("bthr,bsr->bhts", q_rope, rope_all)) * scale
            S = lat_all.shape[1]
            sel = jnp.zeros((B, T, S + 1), bool)
            sel = sel.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                         jnp.where(topk < 0, S, topk)].set(True)[..., :S]
            s = jnp.where(sel[:, None], s.astype(jnp.float32), MASKED)
            p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
            out = jnp.einsum("bhts,bshd->bthd", p, v)
        elif attn_path == "absorbed":
            q_lat = jnp.einsum("bthd,chd->bthc", q_nope, w_uk)
            if kernel_applies(q_lat, q_rope, kernels):
                K = topk.shape[-1]
                if access.axis is None:
                    # the kernel reads the selected rows from the pool itself: no [B, T, K, C] gather in HBM
                    lat, rope, layer = cache.latent, cache.k_rope, layer_id
                    slots = jnp.take_along_axis(batch.slot_table[:, None, :], jnp.maximum(topk, 0), axis=2)
                else:
                    # under CP: the rows from their owners (every visible row for a long chunk, else the
                    # selected ones), once, as a one-layer pool the kernel reads through `slots`
                    rows, slots = access.rows_for(kv_rows, batch.slot_table, topk, n_local)
                    lat, rope, layer = rows[None, :, :C], rows[None, :, C:], 0
                slots = jnp.where(topk >= 0, slots, -1).reshape(B * T, K)
                # packed: the indexer lists a row's selected positions first, -1 after them
                o_lat = sparse_mla(q_lat.reshape(B * T, H, C), q_rope.reshape(B * T, H, dr), lat, rope, layer,
                                   slots, scale, policy=kernels, packed=True).reshape(B, T, H, C)
            else:
                kv_sel = access.pick(kv_rows, batch.slot_table, topk, n_local)   # [B, T, K, C + dr]
                lat_sel, rope_sel = kv_sel[..., :C], kv_sel[..., C:]
                s = (jnp.einsum("bthc,btkc->bthk", q_lat, lat_sel)
                     + jnp.einsum("bthr,btkr->bthk", q_rope, rope_sel)) * scale
                s = jnp.where((topk >= 0)[:, :, None, :], s.astype(jnp.float32), MASKED)
                p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
                o_lat = jnp.einsum("bthk,btkc->bthc", p, lat_sel)
            out = jnp.einsum("bthc,chd->bthd", o_lat, w_uv)
        else:
            raise ValueError(f"attn_path must be one of {ATTN_PATHS}, got {attn_path!r}")
        return axes.psum_tp(self.o_proj(out.reshape(B, T, H * dv), kernels)), topk, cache
