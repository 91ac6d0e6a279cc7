"""The engine against a no-cache recompute of the model: per-step logits and greedy tokens, batch and
chunk independence, prefix-cache hits, bounded compilations, streaming, aborts and bad input."""


import collections

import numpy as np
import pytest

from cpkv_jax.config import EngineConfigError
from cpkv_jax.engine import Engine, EngineConfig, EngineInputError
from cpkv_jax.sampling import SamplingError, SamplingParams
from models.model import prefill_logits
from models.weights import CheckpointError
from tests.helpers import pool_is_clean, random_prompts, rel_err


def recompute_step_logits(model, prompts, outs, index_dtype="same"):
    """Per request, the logits that predicted each output token, from one teacher-forced prefill with
    no cache. Sequences are padded at the end (causal: padding never reaches earlier positions) to a
    shared [8, 256 * n] shape, so every call reuses one compilation."""
    seqs = [list(p) + o.token_ids[:-1] for p, o in zip(prompts, outs)]
    width = 256 * -(-max(map(len, seqs)) // 256)
    rows = -(-len(seqs) // 8) * 8
    tokens = np.zeros((rows, width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    full = np.asarray(prefill_logits(model, tokens, index_dtype=index_dtype))
    return [full[i, len(p) - 1:len(s)] for i, (p, s) in enumerate(zip(prompts, seqs))]


def assert_outputs_equal(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@pytest.mark.parametrize("index_dtype", ["same", "fp8"])
def test_greedy_steps_equal_no_cache_recompute(tiny, index_dtype):
    """Mixed lengths (1 token to 9 pages), prefill chunked by a 32-token budget, then decode: every
    step's logits equal a full recompute of the sequence so far, and the token is its argmax."""
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [1, 7, 33, 70, 140], tiny.cfg.vocab_size)
    engine = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, max_prefill_tokens=32,
                                       index_dtype=index_dtype))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), return_logits=True)
    worst = 0.0
    for o, ref in zip(outs, recompute_step_logits(tiny, prompts, outs, index_dtype)):
        assert len(o.logits) == len(o.token_ids) == 6
        worst = max(worst, rel_err(np.stack(o.logits), ref))
        assert o.token_ids == ref.argmax(-1).tolist()
    assert worst <= 1e-5, worst
    assert engine.metrics["prefill_steps"] >= 8  # 251 prompt tokens under a 32-token budget


def test_output_independent_of_batch_and_chunk_size(tiny):
    rng = np.random.default_rng(1)
    target = rng.integers(2, tiny.cfg.vocab_size, 90).tolist()
    others = random_prompts(rng, [3, 50, 120, 17], tiny.cfg.vocab_size)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True),
              SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7)]
    alone = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, max_prefill_tokens=128))
    ref = alone.generate([target, target], params, return_logits=True)
    for budget in (16, 32):
        eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, max_prefill_tokens=budget))
        mixed = eng.generate([others[0], target, others[1], others[2], target, others[3]],
                             [params[0], params[0], params[1], params[0], params[1], params[1]],
                             return_logits=True)
        assert_outputs_equal([mixed[1], mixed[4]], ref)
        assert rel_err(np.stack(mixed[1].logits), np.stack(ref[0].logits)) <= 1e-5
        assert rel_err(np.stack(mixed[4].logits), np.stack(ref[1].logits)) <= 1e-5


def test_prefix_cache_hit_equals_cold_run(tiny):
    """Exact repeats, page-aligned and partial-page shared prefixes: same output as a cold engine,
    with the cached token count the page size implies."""
    rng = np.random.default_rng(2)
    base = rng.integers(2, tiny.cfg.vocab_size, 70).tolist()
    variants = [base, base[:45] + rng.integers(2, 500, 20).tolist(), base[:32] + [7, 8, 9],
                base[:16], base + [11, 12]]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    cold = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, prefix_cache=False))
    cold_outs = [cold.generate([v], params, return_logits=True)[0] for v in variants]
    warm = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    first = warm.generate([base], params)[0]
    assert first.cached_tokens == 0
    hits = [warm.generate([v], params, return_logits=True)[0] for v in variants]
    # cached = whole pages of prompt[:-1] present in the tree
    assert [h.cached_tokens for h in hits] == [64, 32, 32, 0, 64]
    assert_outputs_equal(hits, cold_outs)
    for h, c in zip(hits, cold_outs):
        assert rel_err(np.stack(h.logits), np.stack(c.logits)) <= 1e-5
    s = warm.stats()
    assert s["radix"]["protected_pages"] == 0
    assert s["free_pages"] + s["radix"]["pages"] == s["total_pages"]


def test_concurrent_requests_share_a_prefilled_prompt(tiny):
    """A prompt is published to the cache when its prefill completes, so a request arriving while the
    first decodes reuses its pages."""
    rng = np.random.default_rng(3)
    p = rng.integers(2, tiny.cfg.vocab_size, 40).tolist()
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    first = eng.add_request(p, params)
    eng.step()
    second = eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
    a, b = eng.output(first), eng.output(second)
    assert b.cached_tokens == 32 and a.token_ids == b.token_ids


def test_compilations_bounded_under_random_traffic(tiny):
    from cpkv_jax.runner import _step, _step_sampled
    rng = np.random.default_rng(4)
    cfg = EngineConfig(page_size=16, kv_pages=96, max_running=8, max_prefill_tokens=64)
    eng = Engine(tiny, cfg)
    bound = eng.max_compilations()
    cache_before = _step._cache_size() + _step_sampled._cache_size()
    for wave in range(3):
        lengths = rng.integers(1, 150, 20)
        params = [SamplingParams(max_new_tokens=int(rng.integers(1, 12)), ignore_eos=True) for _ in lengths]
        eng.generate(random_prompts(rng, lengths, tiny.cfg.vocab_size), params)
    assert eng.compilations() <= bound, (eng.compilations(), bound)
    # the jit cache grew by at most the variants this engine counted (the count is not an undercount)
    assert _step._cache_size() + _step_sampled._cache_size() - cache_before <= eng.runner.compilations
    # B x T x S buckets: (1,2,4,8) x (16,32,64) x (1,2,4,8,16,32,64,95 pages) prefill (last-token logits
    # sampled in the step greedy or not or by the sampler, or every position's) + decode (the three
    # last-token ways) + sampler per B, greedy or not and top-N width (0,1,2,4,8,16,20) + prompt
    # logprobs per B x T x width
    assert bound == 4 * 4 * 3 * 8 + 3 * 4 * 8 + 2 * 4 * 7 + 4 * 3 * 7
    assert eng.metrics["steps"] > 3 * eng.compilations()


def test_attention_path_keeps_expanded_scores_bounded():
    """Expanded attention materializes rows x heads x lanes x width fp32 scores: above 2**32 (16 GiB)
    a long chunk takes the absorbed path (GLM-5, 64 heads: an 8192-token chunk over 8192 keys is the
    largest expanded one)."""
    from cpkv_jax.runner import choose_attn_path
    assert choose_attn_path(1, 16, 8192, 64) == "absorbed"            # short extends always
    assert choose_attn_path(1, 8192, 8192, 64) == "expanded"
    assert choose_attn_path(1, 8192, 16384, 64) == "absorbed"
    assert choose_attn_path(8, 2048, 2048, 64) == "expanded"
    assert choose_attn_path(8, 4096, 4096, 64) == "absorbed"


def test_stream_matches_generate_and_early_close_aborts(tiny):
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, [5, 30], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    got = {0: [], 1: []}
    finished = {}
    for ev in eng.stream(prompts, params):
        got[ev.index].append(ev.token_id)
        if ev.finish_reason:
            finished[ev.index] = ev.finish_reason
    assert [got[0], got[1]] == [o.token_ids for o in ref] and finished == {0: "length", 1: "length"}

    it = eng.stream(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    next(it)
    it.close()
    assert pool_is_clean(eng)


def test_streams_and_generates_interleave_without_losing_events(tiny, monkeypatch):
    """A stream resumed after a generate() that stepped the engine meanwhile, and two streams consumed
    alternately, each receive every token of their own requests (equal to a run of all prompts in one
    generate) and nothing of another's; a stream dropped without close() aborts its requests."""
    import gc

    rng = np.random.default_rng(8)
    prompts = random_prompts(rng, [7, 20, 33, 12, 26], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    cfg = EngineConfig(page_size=16, kv_pages=96)
    ref = [o.token_ids for o in Engine(tiny, cfg).generate(prompts, params)]
    eng = Engine(tiny, cfg)
    step, budget = eng.step, iter(range(300))

    def bounded_step():   # a stream waiting for events another caller took would step forever
        if next(budget, None) is None:
            raise AssertionError("300 engine steps for 5 requests of 9 tokens: some stream never sees its events")
        return step()
    monkeypatch.setattr(eng, "step", bounded_step)
    got = {i: [] for i in range(5)}

    def take(it, offset, n=None):
        for k, ev in enumerate(it):
            got[offset + ev.index].append(ev.token_id)
            if n is not None and k + 1 == n:
                return

    s1 = eng.stream(prompts[0:2], params)
    take(s1, 0, 3)                                       # s1 stops mid-way; generate steps on without it
    assert [o.token_ids for o in eng.generate(prompts[4:5], params)] == ref[4:5]
    s2 = eng.stream(prompts[2:4], params)
    alive = {0: s1, 2: s2}
    while alive:                                         # consumed alternately, one event at a time
        for offset, it in list(alive.items()):
            ev = next(it, None)
            if ev is None:
                del alive[offset]
            else:
                got[offset + ev.index].append(ev.token_id)
    assert [got[i] for i in range(4)] == ref[:4]
    assert pool_is_clean(eng)

    dropped = eng.stream(prompts[0:2], SamplingParams(max_new_tokens=40, ignore_eos=True))
    next(dropped)
    del dropped
    gc.collect()
    assert pool_is_clean(eng)


def test_text_prompts_round_trip_through_the_tokenizer():
    eng = Engine("tiny", EngineConfig(page_size=16, kv_pages=64))
    text = "Hello, wörld!"
    assert eng.decode(eng.encode(text)) == text
    outs = eng.generate([text, eng.encode(text)], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert outs[0].token_ids == outs[1].token_ids and outs[0].text == eng.decode(outs[0].token_ids)
    pieces = "".join(ev.text for ev in eng.stream([text], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert pieces == outs[0].text


def test_stop_tokens_and_logprobs(tiny):
    rng = np.random.default_rng(6)
    p = rng.integers(2, tiny.cfg.vocab_size, 12).tolist()
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    free = eng.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True),
                        return_logits=True)[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = eng.generate([p], SamplingParams(max_new_tokens=8, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    ref_lp = [float(lg[t] - np.logaddexp.reduce(lg)) for lg, t in zip(free.logits, free.token_ids)]
    np.testing.assert_allclose(free.logprobs, ref_lp, atol=1e-5)
    assert stopped.logprobs is None


def test_abort_releases_pages_and_others_continue(tiny):
    rng = np.random.default_rng(7)
    a, b = random_prompts(rng, [20, 33], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate([b], params)[0]
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    ra = eng.add_request(a, SamplingParams(max_new_tokens=30, ignore_eos=True))
    rb = eng.add_request(b, params)
    eng.step()
    eng.step()
    eng.abort(ra)
    while eng.has_unfinished():
        eng.step()
    assert eng.output(ra).finish_reason == "abort"
    assert eng.output(rb).token_ids == ref.token_ids
    s = eng.stats()
    assert s["free_pages"] + s["radix"]["pages"] == s["total_pages"] and s["radix"]["protected_pages"] == 0


def test_an_abort_that_takes_the_last_tokens_still_returns_their_events(tiny):
    """Overlapped loop: b's last token is still on the device when a is aborted, so the abort takes it
    and b finishes with nothing left to schedule. Its events (finish included) must still come out of
    a step; a caller that steps while has_unfinished() (the server's engine thread) saw none of them
    and b's client waited forever."""
    rng = np.random.default_rng(8)
    a, b = random_prompts(rng, [20, 33], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ref = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate([b], params)[0]
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))
    assert eng.overlap
    ra = eng.add_request(a, SamplingParams(max_new_tokens=30, ignore_eos=True))
    rb = eng.add_request(b, params)
    events = []
    req_b = eng._requests[rb]
    while not (req_b.pending and len(req_b.output) + req_b.pending == params.max_new_tokens):
        events += eng.step()
    eng.abort(ra)
    assert eng.finished(rb)
    while eng.has_unfinished():
        events += eng.step()
    of_b = [ev for ev in events if ev.rid == rb]
    assert [ev.token_id for ev in of_b] == ref.token_ids
    assert of_b[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in of_b[:-1])
    assert eng.output(rb).token_ids == ref.token_ids and eng.output(ra).finish_reason == "abort"
    assert not eng.has_unfinished() and eng.step() == []


@pytest.mark.parametrize("seed", [0, 1])
def test_random_adds_aborts_and_steps_return_every_token_once(tiny, seed):
    """A random schedule of adds, aborts (often of a request while others' last tokens are on the
    device) and steps on the overlapped loop, then steps while has_unfinished(): the events the steps
    returned are, per request, exactly its output's tokens in order, the finish last (what the server
    streams); a finished request's tokens equal a greedy run of its prompt alone, an aborted one's are
    a prefix of it; the pool is clean."""
    rng = np.random.default_rng(seed)
    cfg = EngineConfig(page_size=16, kv_pages=96)
    prompts = random_prompts(rng, rng.integers(1, 40, 14).tolist(), tiny.cfg.vocab_size)
    ref = [o.token_ids for o in Engine(tiny, cfg).generate(prompts, SamplingParams(max_new_tokens=8,
                                                                                  ignore_eos=True))]
    eng = Engine(tiny, cfg)
    rids, events, aborted = {}, collections.defaultdict(list), set()

    def step():
        for ev in eng.step():
            events[ev.rid].append(ev)

    while len(rids) < len(prompts) or eng.has_unfinished():
        op = rng.random()
        live = [r for r in rids if r not in aborted and not eng.finished(r)]
        if op < 0.3 and len(rids) < len(prompts):
            i, n = len(rids), int(rng.integers(1, 9))
            rids[eng.add_request(prompts[i], SamplingParams(max_new_tokens=n, ignore_eos=True))] = i, n
        elif op < 0.45 and live:
            rid = live[int(rng.integers(len(live)))]
            eng.abort(rid)
            aborted.add(rid)
        else:
            step()
    assert aborted and eng.step() == []
    for rid, (i, n) in rids.items():
        out = eng.output(rid)
        evs = events[rid]
        assert [ev.token_id for ev in evs] == out.token_ids, rid
        if rid in aborted and out.finish_reason == "abort":
            assert out.token_ids == ref[i][:len(out.token_ids)] and all(ev.finish_reason is None for ev in evs)
        else:
            assert out.finish_reason == "length" and out.token_ids == ref[i][:n]
            assert evs[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in evs[:-1])
    assert pool_is_clean(eng)


BAD_REQUESTS = [
    ([], SamplingParams(), EngineInputError, "empty prompt"),
    ([1, 2, 512], SamplingParams(), EngineInputError, "outside the vocabulary"),
    ([-1, 2], SamplingParams(), EngineInputError, "outside the vocabulary"),
    ([1.5, 2.0], SamplingParams(), EngineInputError, "integer token ids"),
    ([[1, 2]], SamplingParams(), EngineInputError, "flat sequence"),
    ([1] * 4000, SamplingParams(max_new_tokens=200), EngineInputError, "exceeds the model's context"),
    ([1] * 900, SamplingParams(max_new_tokens=200), EngineInputError, "KV pages"),
    ([1, 2], SamplingParams(max_new_tokens=0), SamplingError, "max_new_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), SamplingError, "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), SamplingError, "top_p"),
    ([1, 2], SamplingParams(top_k=-3), SamplingError, "top_k"),
    ([1, 2], SamplingParams(seed=-1), SamplingError, "seed"),
    ([1, 2], SamplingParams(stop_token_ids=(600,)), SamplingError, "stop_token_ids"),
    ([[1, 2], [3]], SamplingParams(), EngineInputError, "flat sequence"),
    ([1, 2], SamplingParams(temperature="hot"), SamplingError, "temperature must be a number"),
    ([1, 2], SamplingParams(temperature=None), SamplingError, "temperature must be a number"),
    ([1, 2], SamplingParams(max_new_tokens=4.0), SamplingError, "max_new_tokens must be an integer"),
    ([1, 2], SamplingParams(top_k=True), SamplingError, "top_k must be an integer"),
    ([1, 2], SamplingParams(ignore_eos="yes"), SamplingError, "ignore_eos must be True or False"),
    ([1, 2], SamplingParams(stop_token_ids=7), SamplingError, "stop_token_ids must be a list or tuple"),
    ([1, 2], SamplingParams(stop_token_ids=None), SamplingError, "stop_token_ids must be a list or tuple"),
    ([1, 2], SamplingParams(stop_token_ids=("a",)), SamplingError, "stop_token_ids must be a list or tuple"),
    ([1, 2], SamplingParams(stop_token_ids=((1, 2),)), SamplingError, "stop_token_ids must be a list or tuple"),
    ([1, 2], SamplingParams(stop_token_ids=(1.5,)), SamplingError, "stop_token_ids must be a list or tuple"),
    ([1, 2], {"max_new_tokens": 4}, SamplingError, "must be a cpkv_jax.sampling.SamplingParams"),
]


def test_bad_input_raises_and_leaves_requests_in_flight_untouched(tiny):
    rng = np.random.default_rng(8)
    good = random_prompts(rng, [25, 40], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(good, params)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64))  # 63 usable pages = 1008 tokens
    rids = [eng.add_request(p, params) for p in good]
    eng.step()
    for prompt, sp, exc, msg in BAD_REQUESTS:
        with pytest.raises(exc, match=msg):
            eng.add_request(prompt, sp)
    with pytest.raises(EngineInputError, match="no tokenizer"):
        eng.add_request("text needs a tokenizer")
    with pytest.raises(EngineInputError, match="empty prompt"):
        Engine("tiny", EngineConfig(page_size=16, kv_pages=64)).add_request("")
    with pytest.raises(EngineInputError, match="wrap a single prompt"):
        eng.generate([1, 2, 3])
    with pytest.raises(EngineInputError, match="must be a list of prompts"):
        eng.generate(None)
    with pytest.raises(EngineInputError, match="no request 12345"):
        eng.output(12345)
    # one bad prompt in a generate call queues nothing
    with pytest.raises(EngineInputError):
        eng.generate([good[0], []], params)
    assert eng.stats()["waiting"] == 0
    while eng.has_unfinished():
        eng.step()
    assert [eng.output(r).token_ids for r in rids] == [o.token_ids for o in ref]
    stops = eng.add_request([3, 4], SamplingParams(max_new_tokens=2, stop_token_ids=[5, 6]))
    assert eng._requests[stops].params.stop_token_ids == (5, 6)   # a list is taken, stored as a tuple


def test_bad_model_and_config_errors():
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine("/nonexistent/model/dir")
    for kw, msg in [({"page_size": 0}, "page_size"), ({"kv_pages": 1}, "kv_pages"),
                    ({"index_dtype": "int4"}, "index_dtype"), ({"attn_path": "dense"}, "attn_path"),
                    ({"max_running": 0}, "max_running"), ({"page_size": True}, "page_size"),
                    ({"kv_pages": "256"}, "kv_pages"), ({"prefix_cache": "yes"}, "prefix_cache"),
                    ({"hicache_pages": 1.5}, "hicache_pages"), ({"num_draft_tokens": 2.0}, "num_draft_tokens")]:
        with pytest.raises(EngineConfigError, match=msg):
            EngineConfig(**kw).validate()
