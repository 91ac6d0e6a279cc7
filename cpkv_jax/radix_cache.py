"""Radix tree over page-aligned token keys, mapping prefixes to KV pages (host-side, pure Python).

Keys are token ids truncated to whole pages (or, in bigram mode for speculative decoding, the pairs
(t_i, t_{i+1}): draft KV at position i depends on token i+1, so a cached draft page is valid only for
the same next token). Each edge holds whole pages; nodes split on page boundaries. A node's pages are
protected while any request holds a lock on it or a descendant (`lock` walks to the root);
eviction frees unlocked leaves in LRU order. The tree never allocates: `insert` adopts the caller's
pages for the new part and reports how much was already present so the caller frees its duplicates.

Two tiers (with a host cache, cpkv_jax.hicache): a node also has a host value (host pages, set only
when a backup of every layer is acknowledged) and may lose its device value. Device eviction of a
backed-up node keeps it as host-only; of a node without a host value removes it (and any host-only
nodes under it). Device-present nodes always form a subtree at the root: along any path the device
prefix comes first, then host-only nodes. Host eviction takes host-only, unlocked leaves.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Callable, Iterable, Sequence

import numpy as np


EMPTY = np.zeros(0, np.int32)


class TreeNode:
    __slots__ = ("key", "pages", "host_pages", "children", "parent", "lock_ref", "last_access", "hits", "id")
    _ids = itertools.count()

    def __init__(self, key: tuple = (), pages: np.ndarray | None = None, parent: "TreeNode | None" = None):
        self.key = key                  # token ids (or bigrams) of this edge, a whole number of pages
        self.pages = EMPTY if pages is None else pages   # device pages; empty once device-evicted
        self.host_pages: np.ndarray | None = None        # host pages of a committed backup
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0          # admissions that matched through this node (write-through-selective)
        self.id = next(TreeNode._ids)

    @property
    def on_device(self) -> bool:
        return len(self.pages) > 0

    def __lt__(self, other):
        return (self.last_access, self.id) < (other.last_access, other.id)


@dataclasses.dataclass
class Match:
    device_pages: np.ndarray
    device_node: TreeNode           # where the device prefix ends
    host_pages: np.ndarray          # host pages of the host-only nodes after it
    host_nodes: list[TreeNode]
    node: TreeNode                  # where the whole match ends


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
        """Pages of the longest cached page-aligned prefix on the device, and the node where it ends
        (split so that the match ends exactly at a node). Touches the path for LRU."""
        m = self.match(tokens)
        return m.device_pages, m.device_node

    def match(self, tokens: Sequence[int], *, count_hit: bool = False) -> "Match":
        """Longest cached prefix over both tiers: device pages up to `device_node`, then host pages of
        host-only nodes up to `node`."""
        key = self.key_of(tokens)
        node, i = self.root, 0
        device, host, host_nodes = [], [], []
        device_node = self.root
        now = next(self._clock)
        node.last_access = now
        while i < len(key):
            child = self._descend(node, key, i)
            if child is None:
                break
            if not child.on_device and child.host_pages is None:
                raise AssertionError("a radix node with neither a device nor a host value")
            child.last_access = now
            if count_hit:
                child.hits += 1
            if child.on_device:
                if host_nodes:
                    raise AssertionError("a device-present node below a host-only node")
                device.append(child.pages)
                device_node = child
            else:
                host.append(child.host_pages)
                host_nodes.append(child)
            node, i = child, i + len(child.key)
        cat = lambda parts: np.concatenate(parts).astype(np.int32) if parts else EMPTY  # noqa: E731
        return Match(cat(device), device_node, cat(host), host_nodes, node)

    def _descend(self, node: TreeNode, key: tuple, i: int) -> TreeNode | None:
        """The child of `node` that continues key[i:], split so that it ends within the match; None
        if no child does."""
        child = node.children.get(self._page_key(key, i))
        if child is None:
            return None
        n = self._common_pages(child.key, key[i:])
        if n * self.page_size < len(child.key):
            child = self._split(child, n)
        return child

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
        upper.hits = child.hits
        if child.host_pages is not None:
            upper.host_pages = child.host_pages[:n_pages]
            child.host_pages = child.host_pages[n_pages:]
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
        node, i, present, adopted = self.root, 0, 0, False
        now = next(self._clock)
        while i < len(key):
            child = self._descend(node, key, i)
            if child is None:
                new = TreeNode(key[i:], pages[i // self.page_size: len(key) // self.page_size].copy(), node)
                new.last_access = now
                node.children[self._page_key(key, i)] = new
                self.evictable_pages += len(new.pages)
                return present
            child.last_access = now
            if not child.on_device:  # host-only: the caller's pages become its device value again
                p0 = i // self.page_size
                self._set_device(child, pages[p0:p0 + len(child.key) // self.page_size].copy())
                adopted = True
            elif adopted:
                raise AssertionError("a device-present node below a host-only node")
            else:
                present = i + len(child.key)
            node, i = child, i + len(child.key)
        return present

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
    def _set_device(self, node: TreeNode, pages: np.ndarray) -> None:
        """Give a host-only node its device value back (its lock state decides the accounting)."""
        node.pages = pages.astype(np.int32)
        if node.lock_ref:
            self.protected_pages += len(pages)
        else:
            self.evictable_pages += len(pages)

    def restore_device(self, nodes: Sequence[TreeNode], pages: np.ndarray) -> None:
        """Host-only nodes (a path, in order) get device pages (loaded back from their host value)."""
        i = 0
        for n in nodes:
            if n.on_device:
                raise AssertionError("restore_device of a node that is on the device")
            k = len(n.key) // self.page_size
            self._set_device(n, np.asarray(pages[i:i + k]))
            i += k
        if i != len(pages):
            raise AssertionError(f"restore_device got {len(pages)} pages for {i}")

    def _device_leaf(self, n: TreeNode) -> bool:
        return n.on_device and n.lock_ref == 0 and not any(c.on_device for c in n.children.values())

    def evict(self, num_pages: int, free: Callable[[np.ndarray], None],
              free_host: Callable[[np.ndarray], None] | None = None) -> int:
        """Free at least `num_pages` device pages (if that many are evictable) from unlocked device
        leaves, least recently used first. A backed-up node stays as host-only; one without a host
        value is removed with whatever host-only nodes hang under it (their host pages go to
        free_host). Returns the number of device pages freed."""
        def take(leaf: TreeNode) -> int:
            n = len(leaf.pages)
            free(leaf.pages)
            self.evictable_pages -= n
            self.evicted_pages += n
            leaf.pages = EMPTY
            if leaf.host_pages is None:
                self._remove_subtree(leaf, free_host)
            return n
        return self._evict_lru(num_pages, self._device_leaf, take)

    def _evict_lru(self, num_pages: int, is_leaf: Callable[[TreeNode], bool],
                   take: Callable[[TreeNode], int]) -> int:
        """Take leaves (least recently used first; a parent that becomes a leaf joins) until
        num_pages are freed or none is left."""
        heap = [n for n in self._nodes() if is_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += take(leaf)
            if parent is not self.root and is_leaf(parent):
                heapq.heappush(heap, parent)
        return freed

    def _remove_subtree(self, node: TreeNode, free_host) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.on_device or n.lock_ref:
                raise AssertionError("removing a device-present or locked node")
            if n.host_pages is not None:
                if free_host is None:
                    raise AssertionError("host pages to free but no host tier")
                free_host(n.host_pages)
            stack.extend(n.children.values())
        del node.parent.children[self._page_key(node.key)]

    def evict_host(self, num_pages: int, free_host: Callable[[np.ndarray], None]) -> int:
        """Free at least `num_pages` host pages from host-only, unlocked leaves, LRU first."""
        def host_leaf(n):
            return not n.on_device and n.host_pages is not None and n.lock_ref == 0 and not n.children
        def take(leaf: TreeNode) -> int:
            free_host(leaf.host_pages)
            del leaf.parent.children[self._page_key(leaf.key)]
            return len(leaf.host_pages)
        return self._evict_lru(num_pages, host_leaf, take)

    def host_covered(self, tokens: Sequence[int]) -> np.ndarray:
        """[pages of key_of(tokens)] bool: page i of the key already has a committed host value."""
        key = self.key_of(tokens)
        out = np.zeros(len(key) // self.page_size, bool)
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                break
            n = self._common_pages(child.key, key[i:])
            if child.host_pages is not None:
                out[i // self.page_size: i // self.page_size + n] = True
            if n * self.page_size < len(child.key):
                break
            node, i = child, i + len(child.key)
        return out

    def set_host(self, tokens: Sequence[int], page_index: np.ndarray, host_pages: np.ndarray) -> np.ndarray:
        """Commit: page page_index[j] of key_of(tokens) gets host page host_pages[j]. Nodes are split so
        a node's host value is all or nothing; a node that already has one (or no longer exists)
        leaves its host pages unused. Returns the unused host pages (the caller frees them)."""
        key = self.key_of(tokens)
        want = dict(zip((int(i) for i in page_index), (int(h) for h in host_pages)))
        used = set()
        node, i = self.root, 0
        while i < len(key) and len(used) < len(want):
            child = self._descend(node, key, i)
            if child is None:
                break
            p0, k = i // self.page_size, len(child.key) // self.page_size
            idx = list(range(p0, p0 + k))
            inside = [j in want for j in idx]
            if any(inside) and not all(inside):  # split at the first boundary and look again
                cut = inside.index(not inside[0])
                self._split(child, cut)
                continue
            if all(inside) and child.host_pages is None:
                child.host_pages = np.array([want[j] for j in idx], np.int32)
                used.update(idx)
            node, i = child, i + len(child.key)
        return np.array([h for j, h in want.items() if j not in used], np.int32)

    # ---- inspection ------------------------------------------------------------------------------
    def _nodes(self) -> Iterable[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def all_pages(self) -> np.ndarray:
        """Device pages held by the tree."""
        parts = [n.pages for n in self._nodes()]
        return np.concatenate(parts) if parts else EMPTY

    def all_host_pages(self) -> np.ndarray:
        parts = [n.host_pages for n in self._nodes() if n.host_pages is not None]
        return np.concatenate(parts) if parts else EMPTY

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
                "host_pages": int(len(self.all_host_pages())),
                "evictable_pages": self.evictable_pages, "protected_pages": self.protected_pages,
                "evicted_pages": self.evicted_pages}
