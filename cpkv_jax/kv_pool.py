"""Device KV pool (a pytree donated to every step), the page allocator, and the page arithmetic (pages
for a token count, the token slots of pages, a batch's slot table from its page tables) — the one
place that knows slot = page * page_size + offset. Page 0 is the dummy page that absorbs padded
writes and is never allocated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kv import KVCache, kv_cache_shapes
from models.sharding import KV_LEAF_AXES, RULES


class OutOfPages(RuntimeError):
    """The pool cannot provide the pages asked for (the caller queues the request or evicts cache)."""


class PageAllocator:
    """Free lists of pages, per CP rank: the pool's pages are split into `ranks` equal shards, global
    page g living on rank g // pages_per_rank, and the first page of every shard is that rank's dummy
    (never allocated). Double frees and frees of dummies or unknown pages raise: a corrupted free list
    would hand one page to two requests."""

    def __init__(self, num_pages: int, ranks: int = 1):
        if ranks < 1 or num_pages % ranks:
            raise ValueError(f"{num_pages} pages cannot be split over {ranks} CP ranks")
        self.pages_per_rank = num_pages // ranks
        if self.pages_per_rank < 2:
            raise ValueError(f"a pool needs at least 2 pages per rank (one is the dummy), got "
                             f"{self.pages_per_rank}")
        self.num_pages = num_pages
        self.ranks = ranks
        P = self.pages_per_rank
        self._free = [list(range((r + 1) * P - 1, r * P, -1)) for r in range(ranks)]
        self._is_free = np.ones(num_pages, bool)
        self._is_free[::P] = False

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the dummies)."""
        return self.num_pages - self.ranks

    def free_per_rank(self) -> np.ndarray:
        return np.array([len(f) for f in self._free], np.int64)

    def owner(self, pages) -> np.ndarray:
        return np.asarray(pages, np.int64) // self.pages_per_rank

    def alloc(self, n: int, rank: int | None = None) -> np.ndarray:
        """n pages from `rank`, or (rank None) from the ranks with the most free pages."""
        if rank is None:
            if n > self.num_free:
                raise OutOfPages(f"asked for {n} pages, {self.num_free} free of {self.capacity}")
            out = []
            for _ in range(n):
                out.extend(self.alloc(1, int(np.argmax(self.free_per_rank()))))
            return np.array(out, np.int32)
        free = self._free[rank]
        if n > len(free):
            raise OutOfPages(f"asked for {n} pages on rank {rank}, {len(free)} free there")
        pages = np.array([free.pop() for _ in range(n)], np.int32)
        self._is_free[pages] = False
        return pages

    def free(self, pages) -> None:
        pages = np.asarray(pages, np.int64).reshape(-1)
        if pages.size == 0:
            return
        bad = (pages < 0) | (pages >= self.num_pages)
        bad[~bad] |= pages[~bad] % self.pages_per_rank == 0
        if bad.any():
            raise ValueError(f"free of invalid page ids {pages[bad][:5]}")
        if self._is_free[pages].any() or len(np.unique(pages)) != len(pages):
            raise ValueError(f"double free of pages {pages[self._is_free[pages]][:5]}")
        self._is_free[pages] = True
        for p in pages[::-1]:
            self._free[int(p) // self.pages_per_rank].append(int(p))


@dataclasses.dataclass
class KVPool:
    """The device cache plus its page geometry."""

    cache: KVCache
    page_size: int
    draft: KVCache | None = None   # the MTP layer's one-layer cache, addressed by the same slots

    @classmethod
    def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, index_dtype: str = "fp8",
               mesh=None, draft: bool = False, **kw) -> "KVPool":
        """With a mesh, the slot axis is placed by the sharding rules (`kv_slots`: over 'cp', each rank
        stores num_pages / cp pages). With draft, a one-layer cache for the MTP layer beside the
        target's, same slots and sharding. Placed (committed) like every step's output, so the first
        step does not compile a variant of its own for an uncommitted input."""
        where = jax.devices()[0] if mesh is None else RULES.sharding(mesh, *KV_LEAF_AXES)

        def zeros(**shape_kw):
            shapes = kv_cache_shapes(cfg, num_pages * page_size, dtype, index_dtype, **shape_kw)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=where), shapes)
        return cls(zeros(**kw), page_size, zeros(num_layers=1, num_full=1) if draft else None)

    @property
    def num_pages(self) -> int:
        return self.cache.num_slots // self.page_size

    def bytes_per_rank(self) -> int:
        """Target cache bytes each device holds (under CP: its shard of every leaf)."""
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.cache))

    def bytes_per_token(self) -> int:
        """Cache bytes per token slot over all layers, target and draft (every leaf is [layers, slots, ...])."""
        return sum(x.dtype.itemsize * x.size // x.shape[1] for x in jax.tree.leaves((self.cache, self.draft)))


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` token slots."""
    return -(-num_tokens // page_size)


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Token slots of a run of pages, in order."""
    pages = np.asarray(pages, np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)[None]).reshape(-1).astype(np.int32)


def paged_slot_table(page_table: np.ndarray, page_size: int, width: int) -> np.ndarray:
    """[B, width] token slots from per-request page lists [B, pages] (unused entries: page 0)."""
    j = np.arange(width)
    pages = np.take_along_axis(page_table, np.broadcast_to(j // page_size, (len(page_table), width)), axis=1)
    return (pages * page_size + j % page_size).astype(np.int32)
