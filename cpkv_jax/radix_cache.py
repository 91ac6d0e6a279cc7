"""Radix tree over page-aligned token keys, mapping prefixes to KV pages (host-side, pure Python).

Keys are token ids truncated to whole pages (or, in bigram mode for speculative decoding, the pairs
(t_i, t_{i+1}): draft KV at position i depends on token i+1, so a cached draft page is valid only for
the same next token). Each edge holds whole pages; nodes split on page boundaries. A node's pages are
protected while any request holds a lock on it or a descendant (`lock` walks to the root);
eviction frees unlocked leaves in LRU order. The tree never allocates: `insert` adopts the caller's
pages for the new part and reports how much was already present so the caller frees its duplicates.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Sequence

import numpy as np


class TreeNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key: tuple = (), pages: np.ndarray | None = None, parent: "TreeNode | None" = None):
        self.key = key                  # token ids (or bigrams) of this edge, a whole number of pages
        self.pages = np.zeros(0, np.int32) if pages is None else pages
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(TreeNode._ids)

    def __lt__(self, other):
        return (self.last_access, self.id) < (other.last_access, other.id)


class RadixCache:
    def __init__(self, page_size: int, *, bigram: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.bigram = bigram
        self.root = TreeNode()
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.evictable_pages = 0
        self.protected_pages = 0
        self.evicted_pages = 0  # total over the cache's life

    # ---- keys ------------------------------------------------------------------------------------
    def key_of(self, tokens: Sequence[int]) -> tuple:
        """The page-aligned key of a token sequence (bigrams in spec mode: one fewer element)."""
        toks = [int(t) for t in tokens]
        key = tuple(zip(toks, toks[1:])) if self.bigram else tuple(toks)
        return key[: len(key) // self.page_size * self.page_size]

    def _page_key(self, key: tuple, i: int = 0) -> tuple:
        return key[i: i + self.page_size]

    # ---- lookup ----------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[np.ndarray, TreeNode]:
        """Pages of the longest cached page-aligned prefix, and the node where it ends (split so that
        the match ends exactly at a node). Touches the path for LRU."""
        key = self.key_of(tokens)
        node, pages, i = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                break
            n = self._common_pages(child.key, key[i:])
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.append(child.pages)
            node, i = child, i + len(child.key)
        return (np.concatenate(pages) if pages else np.zeros(0, np.int32)), node

    def _common_pages(self, a: tuple, b: tuple) -> int:
        n, ps = 0, self.page_size
        while (n + 1) * ps <= min(len(a), len(b)) and a[n * ps:(n + 1) * ps] == b[n * ps:(n + 1) * ps]:
            n += 1
        return n

    def _split(self, child: TreeNode, n_pages: int) -> TreeNode:
        """Cut child's edge after n_pages; returns the new upper node."""
        cut = n_pages * self.page_size
        upper = TreeNode(child.key[:cut], child.pages[:n_pages], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {self._page_key(child.key, cut): child}
        child.parent.children[self._page_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[cut:]
        child.pages = child.pages[n_pages:]
        return upper

    # ---- insert ----------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: np.ndarray) -> int:
        """Insert the page-aligned prefix of `tokens` whose KV lives in `pages` (one page per page of
        key). Returns the number of key elements already present: the caller still owns
        pages[:returned // page_size] (duplicates to free); the tree now owns the rest."""
        key = self.key_of(tokens)
        pages = np.asarray(pages, np.int32)
        if len(pages) < len(key) // self.page_size:
            raise ValueError(f"insert needs {len(key) // self.page_size} pages for a {len(key)}-element key, "
                             f"got {len(pages)}")
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                new = TreeNode(key[i:], pages[i // self.page_size: len(key) // self.page_size].copy(), node)
                new.last_access = now
                node.children[self._page_key(key, i)] = new
                self.evictable_pages += len(new.pages)
                return i
            n = self._common_pages(child.key, key[i:])
            if n * self.page_size < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + len(child.key)
        return i

    # ---- locks -----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, num_pages: int, free: Callable[[np.ndarray], None]) -> int:
        """Free at least `num_pages` pages (if that many are evictable) from unlocked leaves, least
        recently used first. Returns the number of pages freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)
            free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            self.evicted_pages += len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    # ---- inspection ------------------------------------------------------------------------------
    def _nodes(self) -> Iterable[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def all_pages(self) -> np.ndarray:
        parts = [n.pages for n in self._nodes()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def prefixes(self) -> dict[tuple, int]:
        """Every cached page-aligned prefix key -> the page holding its last page (for checking)."""
        out, stack = {}, [(n, ()) for n in self.root.children.values()]
        while stack:
            n, prefix = stack.pop()
            for p in range(len(n.pages)):
                out[prefix + n.key[: (p + 1) * self.page_size]] = int(n.pages[p])
            stack.extend((c, prefix + n.key) for c in n.children.values())
        return out

    def stats(self) -> dict:
        return {"nodes": sum(1 for _ in self._nodes()), "pages": int(len(self.all_pages())),
                "evictable_pages": self.evictable_pages, "protected_pages": self.protected_pages,
                "evicted_pages": self.evicted_pages}
