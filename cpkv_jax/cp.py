"""Context-parallel split planning (pure numpy): which CP rank computes each new token of a batch and
which rank owns (stores) each new KV page.

The pool's page axis is sharded over the 'cp' mesh axis; global page g lives on rank g // pages_per_rank.
Every logical page of a request has exactly one owner. When every token is computed by the owner of
its page the plan is `page_aligned` and ranks write their KV directly; otherwise off-owner rows are
shipped to their owners inside the forward (models.kv.KVAccess).

Per request (tokens at positions start .. start+n-1; pages that already exist there — a partial page at
`start`, or pages allocated ahead for speculative tokens — keep their owners):
- zigzag: with >= 2*cp new pages, the new pages are cut into 2*cp contiguous page segments as evenly
  as possible (the first P % 2cp segments one page longer) and rank r computes and owns segments r and
  2cp-1-r (balanced causal work; token counts per rank may differ by up to two pages). Existing pages
  are computed by their owners.
- short requests (fewer than 2*cp new pages), policy 'owner' (default): each new page goes whole to
  one rank, ranks rotating per request, so the plan stays page-aligned; policy 'token_balanced': the
  upstream split (2*cp token segments, T // 2cp each, the first T % 2cp one longer), each new page
  owned by the rank computing its first token, off-owner tokens shipped (not page-aligned).
- round_robin: token at position p -> rank p % cp; new page j owned by rank j % cp (not page-aligned
  unless page_size == 1).
A page's owner is moved to the rank with the most free pages when its planned rank has none left.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("zigzag", "round_robin")
SHORT_POLICIES = ("owner", "token_balanced")


@dataclasses.dataclass(frozen=True)
class CPRequest:
    start: int                 # first new position (tokens before it are in the pool)
    num_tokens: int            # new tokens
    known_owners: tuple[int, ...] = ()  # owners of the pages from start // page_size on that already
                                        # exist (a partial page at `start`; speculative pages ahead)


@dataclasses.dataclass
class CPPlan:
    cp: int
    page_size: int
    page_aligned: bool
    token_rank: list[np.ndarray]        # per request [n]: the rank that computes each new token
    new_page_owner: list[np.ndarray]    # per request: owner rank of each new page, in page order
    first_new_page: list[int]           # per request: logical index of its first new page

    @property
    def local_lengths(self) -> np.ndarray:
        """[cp, B] tokens each rank computes for each request (possibly unequal)."""
        return np.stack([np.bincount(r, minlength=self.cp) for r in self.token_rank], axis=1) \
            if self.token_rank else np.zeros((self.cp, 0), np.int64)

    def truncated(self, requests: list["CPRequest"], keep: list[int]) -> tuple["CPPlan", list["CPRequest"]]:
        """The same split restricted to each request's first keep[b] tokens (same owners; kept tokens
        stay in the same rank lanes, since a rank's lanes are in position order)."""
        plan = dataclasses.replace(self, token_rank=[r[:k] for r, k in zip(self.token_rank, keep)])
        return plan, [dataclasses.replace(r, num_tokens=k) for r, k in zip(requests, keep)]

    def lanes(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(rank, lane) of each new token of request b in the rows cpkv_jax.batch.build_batch makes."""
        ranks = self.token_rank[b]
        lane = np.zeros(len(ranks), np.int64)
        for r in np.unique(ranks):
            lane[ranks == r] = np.arange(int((ranks == r).sum()))
        return ranks, lane

    def local_tokens(self, rank: int, b: int) -> np.ndarray:
        """Indices (0..n-1, in order) of request b's new tokens computed on `rank`."""
        return np.flatnonzero(self.token_rank[b] == rank)

    def page_owner(self, b: int, req: CPRequest) -> np.ndarray:
        """Owner rank of the page of each new token of request b."""
        page = (req.start + np.arange(len(self.token_rank[b]))) // self.page_size
        every = np.concatenate([np.asarray(req.known_owners, np.int64), self.new_page_owner[b]])
        return every[page - req.start // self.page_size]


def _segments(total: int, parts: int) -> np.ndarray:
    """Boundaries of `parts` contiguous segments of `total` units, the first total % parts one longer."""
    sizes = np.full(parts, total // parts) + (np.arange(parts) < total % parts)
    return np.concatenate([[0], np.cumsum(sizes)])


def _zigzag_rank(segment: np.ndarray, cp: int) -> np.ndarray:
    """Rank of zigzag segment s: r for s < cp, 2cp-1-s otherwise."""
    return np.where(segment < cp, segment, 2 * cp - 1 - segment)


def plan(requests: list[CPRequest], page_size: int, cp: int, free_per_rank, *, mode: str = "zigzag",
         short_policy: str = "owner") -> CPPlan:
    if mode not in MODES:
        raise ValueError(f"CP mode must be one of {MODES}, got {mode!r}")
    if short_policy not in SHORT_POLICIES:
        raise ValueError(f"short_policy must be one of {SHORT_POLICIES}, got {short_policy!r}")
    free = np.array(free_per_rank, np.int64).copy()
    token_rank, owners, first_pages = [], [], []
    for b, req in enumerate(requests):
        ps, n = page_size, req.num_tokens
        pos = req.start + np.arange(n)
        page = pos // ps
        known = np.asarray(req.known_owners, np.int64)
        first_new = req.start // ps + len(known)
        n_new = max(0, (req.start + n - 1) // ps + 1 - first_new) if n else 0
        new_idx = np.arange(n_new)
        if mode == "round_robin":
            ranks = pos % cp
            planned = (first_new + new_idx) % cp
        elif n_new >= 2 * cp:
            seg = np.searchsorted(_segments(n_new, 2 * cp), new_idx, side="right") - 1
            planned = _zigzag_rank(seg, cp)
            ranks = None  # tokens follow their page's owner
        elif short_policy == "owner":
            planned = (b + new_idx) % cp
            ranks = None
        else:
            seg = np.searchsorted(_segments(n, 2 * cp), np.arange(n), side="right") - 1
            ranks = (_zigzag_rank(seg, cp) + b) % cp
            first_tok = np.searchsorted(page, first_new + new_idx)
            planned = ranks[first_tok] if n_new else np.zeros(0, np.int64)
        owner = np.empty(n_new, np.int64)
        for j, r in enumerate(planned):
            if free[r] <= 0:
                r = int(np.argmax(free))
                if free[r] <= 0:
                    raise RuntimeError("CP plan: no free page on any rank (the scheduler's reservation "
                                       "should have prevented this)")
            owner[j] = r
            free[r] -= 1
        if ranks is None:  # page-aligned: every token is computed by its page's owner
            ranks = np.concatenate([known, owner])[page - req.start // ps]
        token_rank.append(np.asarray(ranks, np.int64))
        owners.append(owner)
        first_pages.append(first_new)
    out = CPPlan(cp, page_size, True, token_rank, owners, first_pages)
    # page-aligned = every token computed on its page's owner (by construction in zigzag/owner; by
    # coincidence possible elsewhere), checked rather than assumed: it licenses direct writes
    out.page_aligned = all((out.page_owner(b, r) == out.token_rank[b]).all()
                           for b, r in enumerate(requests))
    return out

