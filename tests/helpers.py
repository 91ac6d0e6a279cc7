"""Shared test helpers: HF fixtures, error metric, prompts with shared prefixes, HiCache invariants."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"


def rel_err(a, b) -> float:
    """max |a - b| / max |b| — the metric every parity assertion reports."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same_greedy_outputs(got, want, tol: float = 1e-5) -> float:
    """Engine outputs (generate(..., return_logits=True)) of one run against a baseline's: the same
    greedy tokens and logits within `tol` (relative); returns the worst relative error."""
    errs = [rel_err(np.stack(g.logits), np.stack(w.logits)) for g, w in zip(got, want)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
    assert max(errs) <= tol, max(errs)
    return max(errs)


@lru_cache(maxsize=None)
def hf_model(name: str, dtype: str | None = None):
    from models.weights import load_hf
    return load_hf(FIXTURES / name, dtype)


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def shared_prefix_prompts(rng, vocab, n_systems=3, n_suffixes=4):
    systems = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(33, 80, n_systems)]
    suffixes = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(1, 40, n_suffixes)]
    return [s + u for s in systems for u in suffixes]


def random_prompts(rng, lengths, vocab):
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def check_hicache_invariants(eng):
    """Device pages: free + tree + requests = all; host pages: tree + in flight + free = all."""
    s = eng.stats()
    assert s["free_pages"] + s["radix"]["pages"] + s["request_pages"] == s["total_pages"]
    eng.hicache.check()
