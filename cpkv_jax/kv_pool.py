"""Device KV pool (a pytree donated to every step), the host page allocator and request->page tables.
The model sees only token slots (slot = page * page_size + offset); page 0 is the dummy page that
absorbs padded writes and is never allocated."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from models.config import ModelConfig
from models.kv import KVCache, empty_kv_cache


class OutOfPages(RuntimeError):
    """The pool cannot provide the pages asked for (the caller queues the request or evicts cache)."""


class PageAllocator:
    """Free list of pages 1..num_pages-1 (page 0 is the dummy). Double frees and frees of the dummy or
    of unknown pages raise: a corrupted free list would hand one page to two requests."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is the dummy), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = np.ones(num_pages, bool)
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = np.array([self._free.pop() for _ in range(n)], np.int32)
        self._is_free[pages] = False
        return pages

    def free(self, pages) -> None:
        pages = np.asarray(pages, np.int64).reshape(-1)
        if pages.size == 0:
            return
        if (pages <= 0).any() or (pages >= self.num_pages).any():
            raise ValueError(f"free of invalid page ids {pages[(pages <= 0) | (pages >= self.num_pages)][:5]}")
        if self._is_free[pages].any() or len(np.unique(pages)) != len(pages):
            raise ValueError(f"double free of pages {pages[self._is_free[pages]][:5]}")
        self._is_free[pages] = True
        self._free.extend(int(p) for p in pages[::-1])


@dataclasses.dataclass
class KVPool:
    """The device cache plus its page geometry."""

    cache: KVCache
    page_size: int

    @classmethod
    def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, index_dtype: str = "fp8",
               **kw) -> "KVPool":
        # committed to its device like every step's output, so the first step does not compile a
        # variant of its own for an uncommitted input
        cache = jax.device_put(empty_kv_cache(cfg, num_pages * page_size, dtype, index_dtype, **kw),
                               jax.devices()[0])
        return cls(cache, page_size)

    @property
    def num_pages(self) -> int:
        return self.cache.num_slots // self.page_size

    def bytes_per_token(self) -> int:
        """Cache bytes per token slot over all layers (every leaf is [layers, slots, ...])."""
        return sum(x.dtype.itemsize * x.size // x.shape[1] for x in jax.tree.leaves(self.cache))


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Token slots of a run of pages, in order."""
    pages = np.asarray(pages, np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)[None]).reshape(-1).astype(np.int32)
