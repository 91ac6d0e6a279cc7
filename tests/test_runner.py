"""The jitted step over a paged, donated pool: equals a no-cache recompute; the pool is aliased."""

import jax
import numpy as np
import pytest

from cpkv_jax.kv_pool import KVPool, PageAllocator, page_slots, paged_slot_table
from cpkv_jax.runner import ModelRunner
from models.kv import contiguous_batch
from models.model import prefill_logits
from tests.helpers import hf_model, rel_err


def make_batch(tokens, starts, page_table, page_size, width):
    return contiguous_batch(tokens, np.asarray(starts), paged_slot_table(page_table, page_size, width))


@pytest.mark.parametrize("page_size", [4, 16])
def test_chunked_paged_prefill_and_decode_equal_no_cache_recompute(page_size):
    """Two requests on shuffled pages: prefill in two chunks, then decode steps; every step's
    last-token logits equal the model's full recompute of the sequence so far."""
    model = hf_model("glm_indexcache")
    rng = np.random.default_rng(page_size)
    total, chunks = 48, [(0, 29), (29, 40)]
    toks = rng.integers(0, model.cfg.vocab_size, size=(2, total)).astype(np.int32)
    n_pages = 2 * (total // page_size + 1) + 1
    pool = KVPool.create(model.cfg, n_pages, page_size, model.dtype, index_dtype="same")
    alloc = PageAllocator(n_pages)
    perm = rng.permutation(alloc.alloc(n_pages - 1))  # scattered, non-contiguous pages
    per_req = (n_pages - 1) // 2
    page_table = np.stack([perm[:per_req], perm[per_req:2 * per_req]])
    width = per_req * page_size
    runner = ModelRunner(model, pool)
    steps = chunks + [(s, s + 1) for s in range(40, total)]
    worst = 0.0
    for a, b in steps:
        logits = np.asarray(runner.forward(make_batch(toks[:, a:b], [a, a], page_table, page_size, width)))
        ref = np.asarray(prefill_logits(model, toks[:, :b]))[:, -1]
        worst = max(worst, rel_err(logits, ref))
    assert worst <= 1e-5, worst
    # slots written are exactly the pages of the two requests (dummy page untouched)
    latent = np.asarray(pool.cache.latent)
    assert not latent[:, page_slots(np.array([0]), page_size)].any()


def test_pool_is_donated_and_aliased():
    model = hf_model("glm_tiny")
    pool = KVPool.create(model.cfg, 9, 16, model.dtype)
    runner = ModelRunner(model, pool)
    batch = make_batch(np.ones((1, 20), np.int32), [0], np.arange(1, 9)[None], 16, 128)
    compiled = runner.lower(batch, np.array([19]), attn_path="expanded").compile()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(pool.cache))
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
    before = pool.cache.latent
    runner.forward(batch)
    assert before.is_deleted()  # the old buffer was donated, not copied


def test_pool_bytes_per_token_fp8_index():
    model = hf_model("glm_indexcache")  # 5 layers, 3 full indexer layers
    pool = KVPool.create(model.cfg, 4, 16, model.dtype, index_dtype="fp8")
    c = model.cfg
    expected = 5 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4 + 3 * (c.index_head_dim + 4)
    assert pool.bytes_per_token() == expected
