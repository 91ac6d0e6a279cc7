"""A fault soak: many requests through one engine with everything that goes wrong in serving mixed in
(aborts, bad requests, streams consumed in turns and dropped, a pool small enough to evict, the host
tier on with copy failures injected), checked against each request run alone on a plain engine."""

import dataclasses
import os

import numpy as np
import pytest

from cpkv_jax.engine import Engine, EngineConfig, EngineInputError
from cpkv_jax.sampling import SamplingError, SamplingParams
from tests.helpers import check_hicache_invariants, random_prompts

# ~2.5 min on 2 CPU cores, mostly compiling the step shapes it meets; CPKV_SOAK_REQUESTS scales it.
SOAK_REQUESTS = int(os.environ.get("CPKV_SOAK_REQUESTS", "1000"))

BAD_REQUESTS = [
    (lambda V: ([], SamplingParams()), EngineInputError),                              # empty prompt
    (lambda V: ([1, V + 5], SamplingParams()), EngineInputError),                      # outside the vocabulary
    (lambda V: ([1, 2], SamplingParams(temperature="hot")), SamplingError),
    (lambda V: ([1, 2], SamplingParams(max_new_tokens=-1)), SamplingError),
    (lambda V: ([1, 2], {"max_new_tokens": 2}), SamplingError),                        # not SamplingParams
    (lambda V: ([[1, 2], [3]], SamplingParams()), EngineInputError),                   # nested / ragged
    (lambda V: ([1, 2] * 400, SamplingParams(max_new_tokens=4)), EngineInputError),    # more pages than the pool
]


def test_fault_soak(tiny):
    """SOAK_REQUESTS requests over 90 (prompt, sampling) pairs with shared system prompts: added one by
    one and through up to three streams at once (read in turns, some dropped mid-way), with aborts,
    bad requests of every kind, a device pool far smaller than the cached content and the host tier
    with copy failures injected. Every good request's tokens equal its run alone on a plain engine
    (a dropped stream's tokens so far are a prefix of it); every bad one raises its error and queues
    nothing; no step loop outruns its budget (a request that never finishes fails, not hangs); at the
    end no device or host page is held by anything but the radix tree."""
    rng = np.random.default_rng(17)
    V = tiny.cfg.vocab_size
    systems = random_prompts(rng, rng.integers(33, 48, 6), V)
    prompts = [s + u for s in systems for u in random_prompts(rng, rng.integers(1, 8, 5), V)]
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True),
              SamplingParams(max_new_tokens=3),
              SamplingParams(max_new_tokens=2, temperature=0.7, top_k=40, seed=5, ignore_eos=True)]
    config = EngineConfig(page_size=16, kv_pages=24, max_running=8, max_prefill_tokens=128, hicache_pages=64)
    alone = Engine(tiny, dataclasses.replace(config, prefix_cache=False, hicache_pages=0))
    isolated = {(i, j): alone.generate([p], [sp])[0].token_ids
                for i, p in enumerate(prompts) for j, sp in enumerate(params)}

    eng = Engine(tiny, config)
    pick = lambda: (int(rng.integers(len(prompts))), int(rng.integers(len(params))))  # noqa: E731
    live, streams = {}, []                      # rid -> key; [(generator, keys, tokens per index)]
    counts = dict(added=0, finished=0, aborted=0, bad=0, streamed=0, dropped=0, failures_injected=0, steps=0,
                  prompt_tokens=0)
    mismatched = []

    def check_stream_tokens(keys, got, finished):
        for n, key in enumerate(keys):
            want = isolated[key]
            if got[n] != want[:len(got[n])] or (n in finished and got[n] != want):
                mismatched.append(("stream", key, got[n]))

    while counts["added"] + counts["streamed"] < SOAK_REQUESTS or live or streams:
        adding = counts["added"] + counts["streamed"] < SOAK_REQUESTS
        action = rng.random() if adding else 0.83 + 0.17 * rng.random() if not streams else 0.62 + 0.38 * rng.random()
        if adding and action < 0.45:
            key = pick()
            live[eng.add_request(prompts[key[0]], params[key[1]])] = key
            counts["added"] += 1
            counts["prompt_tokens"] += len(prompts[key[0]])
        elif action < 0.52:
            make, err = BAD_REQUESTS[int(rng.integers(len(BAD_REQUESTS)))]
            waiting = eng.stats()["waiting"]
            with pytest.raises(err):
                eng.add_request(*make(V))
            assert eng.stats()["waiting"] == waiting           # nothing queued
            counts["bad"] += 1
        elif action < 0.56 and live:
            rid = list(live)[int(rng.integers(len(live)))]
            eng.abort(rid)
            live.pop(rid)
            counts["aborted"] += 1
        elif action < 0.62 and counts["added"] + counts["streamed"] < SOAK_REQUESTS and len(streams) < 3:
            keys = [pick() for _ in range(int(rng.integers(1, 3)))]
            gen = eng.stream([prompts[i] for i, _ in keys], [params[j] for _, j in keys])
            streams.append((gen, keys, [[] for _ in keys], set()))
            counts["streamed"] += len(keys)
            counts["prompt_tokens"] += sum(len(prompts[i]) for i, _ in keys)
        elif action < 0.80 and streams:
            s = int(rng.integers(len(streams)))
            gen, keys, got, finished = streams[s]
            if rng.random() < 0.1:                            # the client goes away
                gen.close()
                check_stream_tokens(keys, got, finished)
                streams.pop(s)
                counts["dropped"] += 1
            else:
                for _ in range(int(rng.integers(1, 4))):
                    ev = next(gen, None)
                    if ev is None:
                        check_stream_tokens(keys, got, finished)
                        streams.pop(s)
                        break
                    got[ev.index].append(ev.token_id)
                    if ev.finish_reason is not None:
                        finished.add(ev.index)
        elif action < 0.83:
            eng.hicache.copies.fail_at_layer = int(rng.integers(tiny.cfg.num_hidden_layers)) if rng.random() < 0.2 else None
            counts["failures_injected"] += eng.hicache.copies.fail_at_layer is not None
        else:
            counts["steps"] += 1
            assert counts["steps"] < 40 * SOAK_REQUESTS, f"no progress: {counts} {eng.stats()}"
            eng.step()
            if counts["steps"] % 20 == 0:
                check_hicache_invariants(eng)
        for rid in [r for r in live if eng.finished(r)]:   # streams' and this loop's steps finish them
            key = live.pop(rid)
            got = eng.output(rid).token_ids
            if got != isolated[key]:
                mismatched.append(("request", key, got))
            counts["finished"] += 1
    eng.hicache.copies.fail_at_layer = None
    while eng.has_unfinished():
        eng.step()
    eng.hicache.settle()
    print("fault soak:", counts, eng.hicache.stats, eng.stats()["radix"])
    assert not mismatched, f"{len(mismatched)} outputs differ from their isolated runs, e.g. {mismatched[0]}"
    s = eng.stats()
    assert s["request_pages"] == 0 and s["radix"]["protected_pages"] == 0
    assert s["free_pages"] + s["radix"]["pages"] == s["total_pages"]
    check_hicache_invariants(eng)
    assert not eng.hicache.pending and not eng._inboxes
    n = SOAK_REQUESTS
    assert counts["finished"] > n // 3 and counts["aborted"] > n // 100 and counts["bad"] > n // 30
    assert counts["streamed"] > n // 20 and counts["dropped"] > 0
    assert eng.hicache.stats["failed_backups"] > 0 and eng.hicache.stats["commits"] > 0
    assert s["radix"]["evicted_pages"] > n // 10 and eng.hicache.stats["loads"] > 0
    assert eng.metrics["prefill_tokens"] < counts["prompt_tokens"] // 2       # prefix hits saved most prefill
