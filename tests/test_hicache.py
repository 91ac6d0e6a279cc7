"""HiCache (host KV tier under the radix cache): byte-perfect round trips, outputs with eviction to
host and reload equal to an unbounded device pool, no duplicate backups for repeated prompts,
nothing visible after a failed backup, host exhaustion, IndexCache bytes, config errors."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax.config import EngineConfigError
from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.kv_pool import page_slots
from cpkv_jax.sampling import SamplingParams
from tests.helpers import check_hicache_invariants as check_invariants, shared_prefix_prompts

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def page_hashes(pool_tree, pages, page_size):
    """sha1 per (leaf, layer) of the rows of `pages` (in order)."""
    slots = page_slots(np.asarray(pages), page_size)
    out = {}
    for name in ("latent", "k_rope", "index_k", "index_scale"):
        leaf = getattr(pool_tree, name)
        if leaf is None:
            continue
        rows = np.asarray(leaf)[:, slots]
        for layer in range(rows.shape[0]):
            out[name, layer] = hashlib.sha1(rows[layer].tobytes()).hexdigest()
    return out


def nodes_with(radix, want_device, want_host):
    return [n for n in radix._nodes() if (n.on_device == want_device) and ((n.host_pages is not None) == want_host)]


def record_round_trips(eng):
    """Wrap the engine's HiCache so every committed backup (every layer acknowledged) has its host pages
    hashed per (leaf, layer) against the device pages it was copied from, and every loaded page can be
    compared (`verify_loads`, after the step that loaded it: side-stream loads land in the forward)
    with the hashes of the backup it came from."""
    h, ps = eng.hicache, eng.config.page_size
    at_backup, loaded, checked = {}, [], {"pages": 0, "loads": 0, "host_pages": set()}
    commit, load = h.commit, h.load

    def trees():
        # host pools read through a device copy: the side stream writes them behind JAX's back
        host = [jax.device_put(h.host.cache, jax.memory.Space.Device)]
        if h.host.draft is not None:
            host.append(jax.device_put(h.host.draft, jax.memory.Space.Device))
        return list(zip([eng.pool.cache, eng.pool.draft][:len(host)], host))

    def wrapped_commit(res):
        pairs = trees()
        for hp, dp in zip(res.host_pages, res.src_pages):
            dev = [page_hashes(d, [dp], ps) for d, _ in pairs]
            assert dev == [page_hashes(hh, [hp], ps) for _, hh in pairs]
            at_backup[int(hp)] = dev
        commit(res)

    def wrapped_load(host_pages, dev_pages, rid=None):
        load(host_pages, dev_pages, rid)
        loaded.extend(zip(np.asarray(host_pages).tolist(), np.asarray(dev_pages).tolist()))
        checked["loads"] += 1

    def verify_loads():
        pairs = trees()
        for hp, dp in loaded:
            assert [page_hashes(d, [dp], ps) for d, _ in pairs] == at_backup[hp]
            checked["pages"] += 1
            checked["host_pages"].add(hp)
        loaded.clear()

    h.commit, h.load = wrapped_commit, wrapped_load
    checked["verify_loads"] = verify_loads
    return checked


@pytest.mark.parametrize("speculative,cp,copy", [(None, 1, "auto"), ("nextn", 2, "side_stream")])
def test_backup_and_reload_are_byte_perfect_per_layer(tiny, speculative, cp, copy):
    """Main KV, index-K and its scales (and the draft layer in spec mode), every layer: the bytes
    loaded back equal the bytes at backup, after the freed device pages were overwritten. Under CP
    (with the draft layer) every rank backs up and reloads the pages it owns, on its own host shard.
    Copy paths: 'auto' is the jitted copies on CPU, the side stream on GPU; 'side_stream' is the
    layer-hook path everywhere (memmoves at the boundaries on CPU)."""
    rng = np.random.default_rng(0)
    prompts = shared_prefix_prompts(rng, tiny.cfg.vocab_size, 2, 3)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=96, max_prefill_tokens=64, index_dtype="fp8",
                                    hicache_pages=128, speculative=speculative, cp_size=cp, hicache_copy=copy))
    checked = record_round_trips(eng)
    first = eng.generate(prompts, GREEDY)
    assert nodes_with(eng.radix, True, True), "nothing was backed up"
    eng.radix.evict(10 ** 9, eng.allocator.free, eng.scheduler._free_host)
    assert not nodes_with(eng.radix, True, True) and nodes_with(eng.radix, False, True)
    eng.generate([rng.integers(2, tiny.cfg.vocab_size, 300).tolist()], GREEDY)  # overwrites freed pages
    again = eng.generate(prompts, GREEDY)
    checked["verify_loads"]()
    assert checked["loads"] > 0 and checked["pages"] >= 6, checked
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.cached_tokens > 0 for o in again)
    if cp > 1:
        ranks = eng.hicache.host_rank(np.fromiter(checked["host_pages"], np.int64))
        assert set(ranks.tolist()) == set(range(cp)), ranks
    if eng.runner.copier is not None:
        assert not eng.runner.copier.errors and eng.hicache.stats["failed_backups"] == 0, eng.hicache.stats
    check_invariants(eng)


@pytest.mark.parametrize("speculative", [None, "nextn"])
def test_repeated_prompts_prepare_no_duplicate_backups(tiny, speculative):
    """The same prompts again and again (one at a time and several at once): each page is backed up
    once, and no reservation is rolled back as an insert miss. Without the final-prefix probe the
    same traffic does roll back (the counter can fail)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, int(n)).tolist() for n in (70, 50)]
    for probe in (True, False):
        eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=128, max_prefill_tokens=64, hicache_pages=64,
                                        speculative=speculative))
        eng.hicache.probe_final_prefix = probe
        for _ in range(2):
            eng.generate(prompts, GREEDY)
        eng.generate(prompts * 3, GREEDY)
        h = eng.hicache.stats
        if probe:
            assert h["insert_miss_rollbacks"] == 0 and h["rollbacks"] == 0, h
            backed = sum(len(eng.radix.key_of(p)) // 16 for p in prompts)
            out_pages = sum(len(eng.radix.key_of(p + o.token_ids[:-1])) // 16
                            for p, o in zip(prompts, eng.generate(prompts, GREEDY)))
            assert backed <= h["backup_pages"] <= out_pages, h
        else:
            assert h["insert_miss_rollbacks"] > 0, h
        check_invariants(eng)


@pytest.mark.parametrize("copy", ["auto", "side_stream"])
def test_failed_backup_leaves_nothing_visible_and_returns_slots(tiny, copy):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, 60).tolist()]
    want = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, GREEDY)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, hicache_pages=32, hicache_copy=copy))
    eng.hicache.copies.fail_at_layer = 2               # layers 0, 1 are copied and acknowledged, then a failure
    got = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    h = eng.hicache.stats
    assert h["failed_backups"] >= 1 and h["rollbacks"] == h["failed_backups"] and h["commits"] == 0
    assert len(eng.radix.all_host_pages()) == 0 and not eng.hicache.pending
    assert eng.hicache.allocator.num_free == eng.hicache.allocator.capacity
    # an aborted request rolls back its reservation
    eng.hicache.copies.fail_at_layer = None
    rid = eng.add_request(rng.integers(2, tiny.cfg.vocab_size, 90).tolist(), GREEDY)
    eng.scheduler.admit()                       # reserved before its forward, then aborted
    assert eng.hicache.pending
    eng.abort(rid)
    assert not eng.hicache.pending and eng.hicache.allocator.num_free == eng.hicache.allocator.capacity
    check_invariants(eng)


def test_selective_policy_backs_up_on_the_second_hit(tiny):
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, tiny.cfg.vocab_size, 60).tolist()
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, hicache_pages=32,
                                    hicache_policy="write_through_selective"))
    eng.generate([prompt], GREEDY)
    assert eng.hicache.stats["backups"] == 0
    eng.generate([prompt], GREEDY)               # first hit
    eng.generate([prompt], GREEDY)               # second hit: the matched pages are backed up
    assert eng.hicache.stats["backups"] == 1 and eng.hicache.stats["backup_pages"] == 3
    check_invariants(eng)


def test_indexcache_moves_index_keys_of_full_layers_only():
    """freq 4 / offset 3 over 8 layers: full layers 0, 1, 2, 6 (REFERENCE.md's formula); index-K bytes
    per backed-up page = full layers x 132 B (128 fp8 + a 4-byte scale) per token; the 4 shared
    layers move none, while main KV moves for all 8."""
    from flax import nnx

    from models.config import ModelConfig
    from models.model import DsaModel

    cfg = ModelConfig.named("tiny", num_hidden_layers=8, index_head_dim=128, index_topk_freq=4,
                            index_skip_topk_offset=3)
    assert cfg.full_layers == (0, 1, 2, 6)
    model = DsaModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    eng = Engine(model, EngineConfig(page_size=16, kv_pages=32, hicache_pages=16, index_dtype="fp8"))
    eng.generate([list(range(2, 50))], GREEDY)
    h = eng.hicache.stats
    pages = h["backup_pages"]
    assert pages == 3
    index_bytes = h["d2h_bytes"]["index_k"] + h["d2h_bytes"]["index_scale"]
    assert index_bytes == pages * 16 * len(cfg.full_layers) * 132
    main = h["d2h_bytes"]["latent"] + h["d2h_bytes"]["k_rope"]
    assert main == pages * 16 * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_hicache_config_errors(tiny):
    with pytest.raises(EngineConfigError, match="prefix_cache"):
        EngineConfig(hicache_pages=8, prefix_cache=False).validate()
    with pytest.raises(EngineConfigError, match="multiple of cp_size"):
        EngineConfig(hicache_pages=9, cp_size=2, kv_pages=64).validate()
    with pytest.raises(EngineConfigError, match="hicache_policy"):
        EngineConfig(hicache_pages=8, hicache_policy="write_back").validate()
    with pytest.raises(EngineConfigError, match="hicache_pages"):
        EngineConfig(hicache_pages=1).validate()
    with pytest.raises(EngineConfigError, match="hicache_copy"):
        EngineConfig(hicache_pages=8, hicache_copy="dma").validate()


def test_page_runs_merge_pages_consecutive_on_both_sides():
    """Copies are planned as runs: pages that advance by one on the device and on the host are one
    copy, in either allocation direction; any break on either side starts a new run."""
    from cpkv_jax.hicache.side_stream import page_runs

    dev = np.array([9, 8, 7, 3, 4, 12, 13])
    host = np.array([5, 4, 3, 10, 11, 20, 22])
    runs = page_runs(dev, host)
    assert runs.tolist() == [[3, 10, 2], [7, 3, 3], [12, 20, 1], [13, 22, 1]]
    covered = sorted((d + k, h + k) for d, h, n in runs.tolist() for k in range(n))
    assert covered == sorted(zip(dev.tolist(), host.tolist()))
    assert page_runs([], []).shape == (0, 3)
