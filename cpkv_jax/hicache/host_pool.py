"""The host pool: a pinned-host twin of every device pool leaf, and the allocator of its pages.

Every leaf of the device pool (MLA latent and rope key per layer; index key and scale per *full*
indexer layer only — shared IndexCache layers have none, so they move none; the MTP layer's
one-layer pool in speculative mode) has a host twin in `pinned_host` memory with the same
[layers, slots, width] layout. A page of one layer is then one contiguous block of page_size rows on
both sides, so every transfer is a list of block copies, never a gather or scatter on host memory.
Host pages come from their own page allocator (page 0 unused, like the device dummy). Under CP the
host pool is sharded like the device pool: host page h lives on rank h // pages_per_rank, and a
device page is only ever copied to or from a host page of its own rank. On a mesh with 'ep'/'tp'
axes the table replicates the pool's slots over them, so every device of a CP rank holds the same
pages, and the host twin is replicated the same way: each device backs up its own replica into its
own host twin and loads from it (no copy crosses devices or waits on another device's stream; the
host bytes grow by ep x tp).
"""

from __future__ import annotations

import jax
import numpy as np

from cpkv_jax.kv_pool import KVPool, PageAllocator
from models.kv import KVCache
from models.sharding import KV_LEAF_AXES, RULES

LEAVES = ("latent", "k_rope", "index_k", "index_scale")   # the pool tree's leaf order


class HostPool:
    """Host twins of the device pool's target (`cache`) and draft (`draft`) trees, the host page
    allocator, and the page/rank/layer bookkeeping both copy paths plan with."""

    def __init__(self, pool: KVPool, num_pages: int, *, full_layers: tuple[int, ...], mesh=None):
        self.page_size = pool.page_size
        self.mesh = mesh
        self.ranks = 1 if mesh is None else mesh.shape[RULES.kv_slots]
        # every device holding a pool shard, in the mesh's order (the layer hook's device index), and
        # the CP rank whose pages it holds
        self.devices = list(jax.devices()[:1]) if mesh is None else list(mesh.devices.flat)
        self.device_ranks = ([0] if mesh is None else
                             np.indices(mesh.devices.shape)[mesh.axis_names.index(RULES.kv_slots)].reshape(-1).tolist())
        self.allocator = PageAllocator(num_pages, self.ranks)
        self.device_pages_per_rank = pool.num_pages // self.ranks

        where = (jax.memory.Space.Host if mesh is None
                 else RULES.sharding(mesh, *KV_LEAF_AXES, memory_kind="pinned_host"))

        def host_twin(cache: KVCache | None):
            # from a host numpy buffer: the pool never passes through device memory; its aval is
            # host-resident inside jit, so block copies into it stay copies
            if cache is None:
                return None
            return jax.tree.map(lambda x: jax.device_put(
                np.zeros((x.shape[0], num_pages * self.page_size) + x.shape[2:], x.dtype), where), cache)
        self.cache, self.draft = host_twin(pool.cache), host_twin(pool.draft)
        self.num_layers = pool.cache.latent.shape[0]
        self.full_index = {layer: i for i, layer in enumerate(full_layers)}

    def layer_leaves(self, layer: int, draft: bool):
        """(leaf names, layer id per leaf) of one unit: target layer `layer` (index leaves only on
        full layers) or the draft's single layer."""
        names, ids = ["latent", "k_rope"], [0 if draft else layer] * 2
        full = 0 if draft else self.full_index.get(layer)
        if full is not None:
            names.append("index_k")
            ids.append(full)
            if self.cache.index_fp8:
                names.append("index_scale")
                ids.append(full)
        return names, ids

    def units(self) -> list[tuple[int, bool]]:
        """Every (layer, draft) unit a backup or load moves; a backup is committed when all are acked."""
        units = [(layer, False) for layer in range(self.num_layers)]
        return units + ([(0, True)] if self.draft is not None else [])

    def row_bytes(self, name: str) -> int:
        leaf = getattr(self.cache, name)
        return leaf.dtype.itemsize * int(np.prod(leaf.shape[2:], dtype=np.int64))

    def add_bytes(self, counter: dict, names, pages: int) -> None:
        """Count the bytes of `pages` pages of each named leaf (one layer) into counter[leaf]."""
        for k in names:
            counter[k] = counter.get(k, 0) + pages * self.page_size * self.row_bytes(k)

    def device_rank(self, dev_pages) -> np.ndarray:
        return np.asarray(dev_pages, np.int64) // self.device_pages_per_rank

    def host_rank(self, host_pages) -> np.ndarray:
        return self.allocator.owner(host_pages)

    def rank_pairs(self, host_pages, dev_pages) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank, its (host, device) pages as rank-local indices."""
        host_pages, dev_pages = np.asarray(host_pages, np.int64), np.asarray(dev_pages, np.int64)
        rank = self.host_rank(host_pages)
        if (self.device_rank(dev_pages) != rank).any():
            raise AssertionError("a host page on another rank than its device page")
        return [(host_pages[rank == r] - r * self.allocator.pages_per_rank,
                 dev_pages[rank == r] - r * self.device_pages_per_rank) for r in range(self.ranks)]

    def take(self, src: np.ndarray) -> np.ndarray | None:
        """A host page for each device page, from the device page's rank; None if a rank is short."""
        ranks = self.device_rank(src)
        need = np.bincount(ranks, minlength=self.ranks)
        if (need > self.allocator.free_per_rank()).any():
            return None
        return np.array([int(self.allocator.alloc(1, int(r))[0]) for r in ranks], np.int32)
