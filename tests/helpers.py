"""Shared test helpers: HF fixtures, error metric."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"


def rel_err(a, b) -> float:
    """max |a - b| / max |b| — the metric every parity assertion reports."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@lru_cache(maxsize=None)
def hf_model(name: str, dtype: str | None = None):
    from models.weights import load_hf
    return load_hf(FIXTURES / name, dtype)


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))
