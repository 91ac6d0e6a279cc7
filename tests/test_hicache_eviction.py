"""HiCache under device-pool pressure: eviction to host and reload gives the outputs of a pool that
never evicts; a host pool too small for the traffic still completes every request."""

import dataclasses

import numpy as np

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams
from tests.helpers import check_hicache_invariants as check_invariants, shared_prefix_prompts

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def test_small_device_pool_with_host_tier_equals_unbounded_pool(tiny):
    """Many prompts sharing prefixes, arriving over time, through a device pool that must evict to
    host and reload: greedy outputs equal those of a pool that never evicts. Through the layer-hook
    copy path (memmoves on CPU, the side stream on GPU): staged backups, loads inside the forward,
    settling before device pages are freed."""
    rng = np.random.default_rng(1)
    prompts = shared_prefix_prompts(rng, tiny.cfg.vocab_size, 4, 4)
    order = [int(i) for i in rng.integers(0, len(prompts), 36)]
    base = EngineConfig(page_size=16, kv_pages=512, max_running=4, max_prefill_tokens=64, index_dtype="fp8")
    want = Engine(tiny, base).generate([prompts[i] for i in order], GREEDY)

    eng = Engine(tiny, dataclasses.replace(base, kv_pages=40, hicache_pages=400, hicache_copy="side_stream"))
    got, pending, k = {}, {}, 0
    while k < len(order) or eng.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if k < len(order):
                pending[eng.add_request(prompts[order[k]], GREEDY)] = k
                k += 1
        for ev in eng.step():
            if ev.finish_reason is not None:
                got[pending.pop(ev.rid)] = eng.output(ev.rid).token_ids
        check_invariants(eng)
    assert [got[i] for i in range(len(order))] == [o.token_ids for o in want]
    h = eng.hicache.stats
    assert eng.radix.evicted_pages > 0 and h["loads"] > 0 and h["load_pages"] > 0, h
    assert h["insert_miss_rollbacks"] == 0 and h["failed_backups"] == 0 and h["commits"] > 0, h
    assert not eng.runner.copier.errors
    # only forwards with copies carry the layer hook: prefill steps do, plain decode steps do not
    hooked = {v[1][1] > 1 for v in eng.runner.variants if v[0] == "target" and v[-1]}
    assert True in hooked and any(v[0] == "target" and not v[-1] and v[1][1] == 1 for v in eng.runner.variants)


def test_host_pool_exhaustion(tiny):
    rng = np.random.default_rng(4)
    prompts = shared_prefix_prompts(rng, tiny.cfg.vocab_size, 3, 3)
    base = EngineConfig(page_size=16, kv_pages=40, max_prefill_tokens=128)
    want = Engine(tiny, dataclasses.replace(base, kv_pages=512)).generate(prompts * 2, GREEDY)
    eng = Engine(tiny, dataclasses.replace(base, hicache_pages=6))
    got = eng.generate(prompts * 2, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    h = eng.hicache.stats
    assert h["skipped_backups"] + h["host_evicted_pages"] > 0, h
    check_invariants(eng)
