"""Radix cache + page allocator against a simple reference model (hypothesis state machine)."""

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpkv_jax.kv_pool import OutOfPages, PageAllocator
from cpkv_jax.radix_cache import RadixCache

PAGE = 2
NUM_PAGES = 40
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=13)


class RadixMachine(RuleBasedStateMachine):
    """Reference: a dict page-aligned prefix key -> page id, prefix-closed. The tree must agree after
    every step; pages are never lost or shared; locks protect whole root paths."""

    bigram = False

    @initialize()
    def setup(self):
        self.tree = RadixCache(PAGE, bigram=self.bigram)
        self.alloc = PageAllocator(NUM_PAGES)
        self.ref: dict[tuple, int] = {}
        self.held = []  # (node, key) locked by "requests"

    def _key(self, tokens):
        return self.tree.key_of(tokens)

    @rule(tokens=seqs)
    def insert(self, tokens):
        key = self._key(tokens)
        n = len(key) // PAGE
        try:
            pages = self.alloc.alloc(n)
        except OutOfPages:
            return
        present = self.tree.insert(tokens, pages)
        expected_present = 0
        while expected_present < len(key) and key[:expected_present + PAGE] in self.ref:
            expected_present += PAGE
        assert present == expected_present
        self.alloc.free(pages[: present // PAGE])
        for p in range(present // PAGE, n):
            self.ref[key[:(p + 1) * PAGE]] = int(pages[p])

    @rule(tokens=seqs)
    def match(self, tokens):
        key = self._key(tokens)
        pages, node = self.tree.match_prefix(tokens)
        expected = []
        while key[:(len(expected) + 1) * PAGE] in self.ref and (len(expected) + 1) * PAGE <= len(key):
            expected.append(self.ref[key[:(len(expected) + 1) * PAGE]])
        assert pages.tolist() == expected

    @rule(tokens=seqs)
    def lock(self, tokens):
        pages, node = self.tree.match_prefix(tokens)
        self.tree.lock(node)
        self.held.append((node, self._key(tokens)[: len(pages) * PAGE]))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i):
        node, _ = self.held.pop(i % len(self.held))
        self.tree.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        before = dict(self.ref)
        freed = []
        got = self.tree.evict(n, lambda p: (freed.extend(p.tolist()), self.alloc.free(p)))
        assert got == len(freed)
        after = self.tree.prefixes()
        removed = set(before) - set(after)
        assert set(after) <= set(before)
        assert sorted(before[k] for k in removed) == sorted(freed)
        for _, key in self.held:  # locked paths survive
            for p in range(1, len(key) // PAGE + 1):
                assert key[:p * PAGE] in after
        if got < n:  # everything evictable went
            assert self.tree.evictable_pages == 0
        for k in removed:
            del self.ref[k]

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        assert self.tree.prefixes() == self.ref
        tree_pages = self.tree.all_pages()
        assert len(np.unique(tree_pages)) == len(tree_pages)
        assert self.alloc.num_free + len(tree_pages) == NUM_PAGES - 1  # nothing leaked
        locked = sum(len(n.pages) for n in self.tree._nodes() if n.lock_ref > 0)
        assert self.tree.protected_pages == locked
        assert self.tree.evictable_pages == len(tree_pages) - locked

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        for node, _ in self.held:
            self.tree.unlock(node)
        self.tree.evict(NUM_PAGES, self.alloc.free)
        assert self.alloc.num_free == NUM_PAGES - 1
        assert all(n.lock_ref == 0 for n in self.tree._nodes())
        assert self.tree.protected_pages == 0 and self.tree.evictable_pages == 0


class BigramRadixMachine(RadixMachine):
    bigram = True


SETTINGS = settings(max_examples=150, stateful_step_count=100, deadline=None)  # >10k steps each (11.6k plain, 13.2k bigram measured)
TestRadixCache = RadixMachine.TestCase
TestRadixCache.settings = SETTINGS
TestBigramRadixCache = BigramRadixMachine.TestCase
TestBigramRadixCache.settings = SETTINGS


def test_bigram_keys_and_page_truncation():
    t = RadixCache(2, bigram=True)
    assert t.key_of([5, 6, 7, 8]) == ((5, 6), (6, 7))  # 3 bigrams -> one whole page of 2
    assert RadixCache(4).key_of(range(10)) == tuple(range(8))
    # same tokens, different next token -> a different draft page
    t.insert([1, 2, 3], np.array([7]))
    assert t.match_prefix([1, 2, 3])[0].tolist() == [7]
    assert t.match_prefix([1, 2, 4])[0].tolist() == []


def test_split_on_partial_match_and_duplicate_pages():
    t = RadixCache(2)
    assert t.insert([1, 2, 3, 4, 5, 6], np.array([10, 11, 12])) == 0
    assert t.insert([1, 2, 3, 4, 9, 9], np.array([20, 21, 22])) == 4  # caller frees 20, 21
    assert t.match_prefix([1, 2, 3, 4, 9, 9, 1])[0].tolist() == [10, 11, 22]
    assert t.stats()["nodes"] == 3


def test_allocator_rejects_corruption():
    a = PageAllocator(5)
    p = a.alloc(2)
    with pytest.raises(OutOfPages, match="asked for 3 pages, 2 free"):
        a.alloc(3)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p[:1])
    with pytest.raises(ValueError, match="invalid page"):
        a.free([0])
    assert a.num_free == 4


def test_unlock_without_lock_raises():
    t = RadixCache(2)
    t.insert([1, 2], np.array([3]))
    _, node = t.match_prefix([1, 2])
    with pytest.raises(RuntimeError, match="not locked"):
        t.unlock(node)


def test_eviction_takes_the_least_recently_used_leaf_first():
    """Three cached prompts, used in the order B, C, A after insertion: eviction frees B's pages first,
    then C's, then A's; a shared parent goes only after the leaves below it (checked page by page)."""
    tree = RadixCache(2)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [1, 1, 3, 3]     # c shares a's first page
    tree.insert(a, np.array([10, 11]))
    tree.insert(b, np.array([20, 21]))
    tree.insert(c, np.array([10, 31]))                   # page 10 already present: the caller keeps its copy
    for tokens in (b, c, a):
        tree.match_prefix(tokens)
    order = []
    while tree.evict(1, lambda pages: order.append(sorted(int(p) for p in pages))):
        pass
    assert order == [[20, 21], [31], [11], [10]]
