"""What the model reads and writes per token: the KV layout the engine's pool uses, and the batch
description of one forward. Token slots are flat (slot = page * page_size + offset); the engine owns
the pages, the model only sees slot indices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from pallas_kernels.indexer.quant import FP8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per layer: MLA latent (kv_lora_rank) and rope key (qk_rope_head_dim) per token slot; per *full*
    indexer layer: the indexer key (index_head_dim), fp8 e4m3 with one fp32 scale per token, or plain
    (index_scale is then None). Slot 0 (the dummy page) absorbs padded writes."""

    latent: jax.Array        # [L, slots, kv_lora_rank]
    k_rope: jax.Array        # [L, slots, qk_rope_head_dim]
    index_k: jax.Array       # [L_full, slots, index_head_dim]
    index_scale: jax.Array | None  # [L_full, slots] fp32, or None when index_k is not fp8

    @property
    def num_slots(self) -> int:
        return self.latent.shape[1]

    @property
    def index_fp8(self) -> bool:
        return self.index_scale is not None


def kv_cache_shapes(cfg: ModelConfig, num_slots: int, dtype, index_dtype: str = "same",
                    num_layers: int | None = None, num_full: int | None = None) -> KVCache:
    """ShapeDtypeStructs of a cache; index_dtype 'fp8' or 'same' (the compute dtype)."""
    L = cfg.num_hidden_layers if num_layers is None else num_layers
    F = len(cfg.full_layers) if num_full is None else num_full
    fp8 = index_dtype == "fp8"
    if index_dtype not in ("fp8", "same", "bfloat16", "float32"):
        raise ValueError(f"index_dtype must be 'fp8', 'same', 'bfloat16' or 'float32', got {index_dtype!r}")
    idt = FP8 if fp8 else (dtype if index_dtype == "same" else jnp.dtype(index_dtype))
    S = jax.ShapeDtypeStruct
    return KVCache(
        latent=S((L, num_slots, cfg.kv_lora_rank), dtype),
        k_rope=S((L, num_slots, cfg.qk_rope_head_dim), dtype),
        index_k=S((F, num_slots, cfg.index_head_dim), idt),
        index_scale=S((F, num_slots), jnp.float32) if fp8 else None,
    )


def empty_kv_cache(cfg: ModelConfig, num_slots: int, dtype, index_dtype: str = "same", **kw) -> KVCache:
    shapes = kv_cache_shapes(cfg, num_slots, dtype, index_dtype, **kw)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One forward over B requests × T token lanes (T padded; a lane with position < 0 is padding).

    tokens      [B, T]  token ids
    positions   [B, T]  absolute position of each token in its request (-1 = padding lane)
    write_slots [B, T]  cache slot to store each token's KV (padding lanes -> dummy slot 0)
    slot_table  [B, S]  cache slot of each position 0..S-1 of the request (beyond its length: 0)
    Token (b, t) attends to positions j <= positions[b, t] of its own request."""

    tokens: jax.Array
    positions: jax.Array
    write_slots: jax.Array
    slot_table: jax.Array

    @property
    def valid(self):
        return self.positions >= 0


def contiguous_batch(tokens: np.ndarray, start: np.ndarray | int = 0, slot_table: np.ndarray | None = None,
                     kv_width: int | None = None) -> Batch:
    """A batch where request b's tokens sit at positions start[b], start[b]+1, ... and, without a slot
    table, request b owns slots [1 + b*kv_width, 1 + (b+1)*kv_width) (slot 0 is the dummy)."""
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    start = np.broadcast_to(np.asarray(start, np.int32), (B,))
    positions = start[:, None] + np.arange(T, dtype=np.int32)[None, :]
    if slot_table is None:
        width = int(kv_width or (start.max() + T))
        slot_table = 1 + np.arange(B, dtype=np.int32)[:, None] * width + np.arange(width, dtype=np.int32)[None]
    write_slots = np.take_along_axis(slot_table, positions, axis=1)
    return Batch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(write_slots, jnp.int32),
                 jnp.asarray(slot_table, jnp.int32))


@dataclasses.dataclass(frozen=True)
class KVAccess:
    """How a forward reaches the KV pool: on one device (axis None), or inside a shard_map over the CP
    axis where the pool's slot axis is sharded and each global slot has one owner rank
    (owner = slot // local slots). Static (hashable): it selects the code, not the data.

    write  — store rows at global slots. page_aligned: every valid local token's slot is owned by this
             rank (the planner guarantees it), so it writes directly; otherwise the new rows are
             all-gathered and each owner writes its own (off-owner tokens shipped to the page owner).
    gather — rows of the same global slots on every rank (a request's visible keys): each owner
             contributes its rows, zeros elsewhere, summed over the axis (exact: x + 0 = x).
    fetch  — rows of global slots that differ per rank (each rank's selected top-k rows): slots are
             all-gathered, owners look up what every rank asked for, and a reduce-scatter returns to
             each rank only its own request.
    pick   — rows at per-rank positions of each request: a fetch, or a gather of every visible row
             followed by a local pick, whichever moves fewer rows across ranks.
    contiguous_blocks — every 64-position block of a slot table is 64 consecutive slots (the pool's
             pages hold a multiple of 64 slots): the indexer may read its keys block by block
             (pallas_kernels.indexer.indexer_topk)."""

    axis: str | None = None
    page_aligned: bool = True
    contiguous_blocks: bool = False

    def _local(self, slots, n_local: int):
        """(local slot or 0, owned mask) of global slots on this rank."""
        me = jax.lax.axis_index(self.axis)
        mine = (slots // n_local) == me
        return jnp.where(mine, slots - me * n_local, 0), mine

    def write(self, arr, layer, slots, rows):
        """arr [L, n_local, ...] (this rank's shard); slots [B, T] global; rows [B, T, ...]."""
        if self.axis is None:
            return arr.at[layer, slots].set(rows.astype(arr.dtype))
        if not self.page_aligned:
            slots = jax.lax.all_gather(slots, self.axis)
            rows = jax.lax.all_gather(rows, self.axis)
        local, _ = self._local(slots, arr.shape[1])
        return arr.at[layer, local].set(rows.astype(arr.dtype))

    def gather(self, rows_at, slots, n_local: int):
        """rows_at(local_slots) -> rows; slots global, identical on every rank."""
        if self.axis is None:
            return rows_at(slots)
        local, mine = self._local(slots, n_local)
        rows = rows_at(local)
        rows = jnp.where(mine.reshape(mine.shape + (1,) * (rows.ndim - mine.ndim)), rows, 0)
        return jax.lax.psum(rows, self.axis)

    def fetch(self, rows_at, slots, n_local: int):
        """rows_at(local_slots) -> rows; slots global, different on every rank."""
        if self.axis is None:
            return rows_at(slots)
        every = jax.lax.all_gather(slots, self.axis)          # [cp, ...]
        local, mine = self._local(every, n_local)
        rows = rows_at(local)
        rows = jnp.where(mine.reshape(mine.shape + (1,) * (rows.ndim - mine.ndim)), rows, 0)
        return jax.lax.psum_scatter(rows, self.axis, scatter_dimension=0, tiled=False)

    def rows_for(self, rows_at, slot_table, positions, n_local: int):
        """(rows [R, ...], index [B, T, K] into them): the rows at `positions` [B, T, K] (per rank; < 0
        reads position 0) of each request whose slots are slot_table [B, S], as a compact set of rows and
        each query's indexes into it. A fetch moves cp·T·K rows per request, a gather S: long prefill
        chunks gather every visible row (T·K ≫ S), decode and short extends fetch the selected ones."""
        positions = jnp.maximum(positions, 0)
        B, T, K = positions.shape
        if self.axis is not None and T * K > slot_table.shape[1]:
            S = slot_table.shape[1]
            every = self.gather(rows_at, slot_table, n_local)                  # [B, S, ...]
            return every.reshape(B * S, *every.shape[2:]), positions + (jnp.arange(B) * S)[:, None, None]
        rows = self.fetch(rows_at, jnp.take_along_axis(slot_table[:, None, :], positions, axis=2), n_local)
        return rows.reshape(B * T * K, *rows.shape[3:]), jnp.arange(B * T * K, dtype=jnp.int32).reshape(B, T, K)

    def pick(self, rows_at, slot_table, positions, n_local: int):
        """The rows at `positions` [B, T, K] as [B, T, K, ...] (rows_for, indexed)."""
        rows, index = self.rows_for(rows_at, slot_table, positions, n_local)
        return rows[index]


SINGLE_DEVICE = KVAccess()
