"""Speculative decoding inside the overlapped loop (EngineConfig.overlap with speculative='nextn', one
rank): the host dispatches round n+1 before it reads round n, whose accepted tokens, next drafts and
next start stay on the device. Against the loop without overlap on the same scripts: the same tokens,
finish reasons, texts, alternatives and streams, log-probabilities and captured logits within rounding,
every event once and in order; greedy requests equal plain greedy decoding; stop tokens that end a request inside a
round, aborts while a round is in flight, requests admitted while others decode; no page leaked, at
any step no more pages held than the rounds in flight can reach, and the compile bound holds."""

import dataclasses

import numpy as np
import pytest

from cpkv_jax.engine import Engine, EngineConfig, _load_tokenizer
from cpkv_jax.kv_pool import pages_for
from cpkv_jax.sampling import SamplingParams
from tests.test_engine import pool_is_clean
from tests.test_spec import copy_draft_model
from tests.test_spec_fused import CONFIG, workload


def held_pages_are_bounded(eng) -> None:
    """Every page is free, in the prefix cache or held by one running request, and the reservations
    add up. A request with a round in flight holds the pages that round writes (its start is the last
    position the host knows of; its lanes and its chain reach 2n - 1 past it), as far as its
    reservation goes, and no request holds a page past the furthest position its rounds can reach
    (a round in flight was planned to start up to n positions past the host's sequence)."""
    s, n, ps = eng.scheduler, eng.spec_tokens, eng.config.page_size
    held = sum(len(r.pages) - r.shared_pages for r in s.running)
    assert s.allocator.num_free + held + eng.radix.stats()["pages"] == s.allocator.capacity
    assert s.reserved_pages == sum(r.reserved for r in s.running)
    for r in s.running:
        if r.pending:
            assert len(r.pages) >= min(pages_for(r.seq_len + 2 * n - 1, ps), len(r.pages) + r.reserved), r.rid
        assert len(r.pages) <= pages_for(r.seq_len + (r.pending + 2) * n, ps), (r.rid, len(r.pages), r.seq_len)


def run(model, overlap: bool, n: int, stops: bool = True):
    """test_spec_fused's workload (greedy and seeded rows, logprobs with alternatives, a one-token
    request, captured logits, stop tokens reached inside a round): three steps, an abort of request 1
    (its round in flight, with the overlap), two late requests (one sharing request 3's cached
    prefix), then to the end, checking the pages after every step; then a stream. Returns the outputs,
    the step events, the streamed events and the engine."""
    eng = Engine(model, dataclasses.replace(CONFIG, num_draft_tokens=n, overlap=overlap),
                 tokenizer=_load_tokenizer("tiny-random"))
    assert eng.overlap == overlap
    prompts, params, late = workload(model.cfg.vocab_size)
    if not stops:
        params = [dataclasses.replace(p, stop_token_ids=()) for p in params]
    rids = [eng._enqueue(pr, sp, i == 5, True) for i, (pr, sp) in enumerate(zip(prompts, params))]
    events = []
    for _ in range(3):
        events += eng.step()
        held_pages_are_bounded(eng)
    in_flight = bool(eng._in_flight)
    eng.abort(rids[1])
    rids += [eng.add_request(late[0], SamplingParams(max_new_tokens=7, ignore_eos=True), stream_text=True),
             eng.add_request(late[1], SamplingParams(max_new_tokens=8, temperature=0.9, seed=11, ignore_eos=True,
                                                     logprobs=True), stream_text=True)]
    while eng.has_unfinished():
        events += eng.step()
        held_pages_are_bounded(eng)
    outs = [eng.output(r) for r in rids]
    streamed = [(e.index, e.token_id, e.text, e.finish_reason)
                for e in eng.stream(late, SamplingParams(max_new_tokens=6, temperature=0.7, seed=2, ignore_eos=True))]
    assert pool_is_clean(eng)
    assert eng.compilations() <= eng.max_compilations()
    assert in_flight == overlap          # the abort did come while a round ran
    return outs, events, streamed, eng


def close(x, y) -> bool:
    """Equal shapes, values within 1e-5 of the largest: the overlapped loop's rounds hold other rows
    (a finished request's round still in flight, another batch bucket), whose matmul shapes round the
    last bits differently."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return x.shape == y.shape and np.abs(x - y).max(initial=0) <= 1e-5 * max(1.0, np.abs(y).max(initial=0))


def assert_same_run(ref, got):
    """Equal tokens, finish reasons, texts, cached prefixes, alternatives and streams; log-probabilities
    and logits close; every token an event once, in order per request."""
    (ref, ref_events, ref_stream, _), (got, events, stream, _) = ref, got
    for a, b in zip(ref, got, strict=True):
        assert (a.token_ids, a.finish_reason, a.text, a.cached_tokens) == (b.token_ids, b.finish_reason, b.text,
                                                                           b.cached_tokens)
        assert (a.logprobs is None) == (b.logprobs is None) and close(a.logprobs or [], b.logprobs or [])
        ids = [[[t for t, _ in alt] for alt in o.top_logprobs or []] for o in (a, b)]
        assert ids[0] == ids[1]
        assert close([[v for _, v in alt] for alt in a.top_logprobs or []],
                     [[v for _, v in alt] for alt in b.top_logprobs or []])
        assert len(a.logits or []) == len(b.logits or []) and all(map(close, a.logits or [], b.logits or []))
    key = lambda e: (e.rid, e.token_id, e.finish_reason, e.text)   # noqa: E731
    for r in {e.rid for e in ref_events} | {e.rid for e in events}:
        assert [key(e) for e in events if e.rid == r] == [key(e) for e in ref_events if e.rid == r]
        assert close([e.logprob for e in events if e.rid == r], [e.logprob for e in ref_events if e.rid == r])
    assert stream == ref_stream


@pytest.fixture(scope="module")
def copy(tiny):
    return copy_draft_model(tiny)


@pytest.mark.parametrize("n", [1, 3])
def test_overlapped_rounds_equal_the_rounds_without_overlap(copy, n):
    """A draft right for greedy rows (every round accepts n, so each round starts n + 1 positions
    past the last) and partly right for sampled ones (their rounds start 1 to n + 1 past it)."""
    ref, got = run(copy, False, n), run(copy, True, n)
    assert_same_run(ref, got)
    outs = ref[0]
    assert [o.finish_reason for o in outs].count("stop") >= 1 and outs[1].finish_reason == "abort"
    assert 0 < len(outs[1].token_ids) < 12
    assert got[3].metrics["spec_accepted"] == ref[3].metrics["spec_accepted"] > 0


def test_overlapped_rounds_with_a_random_draft(tiny):
    """A draft almost never right: every round emits one token and the next starts one further."""
    ref, got = run(tiny, False, 2, stops=False), run(tiny, True, 2, stops=False)
    assert_same_run(ref, got)


def test_greedy_overlapped_rounds_equal_plain_greedy(copy, tiny):
    """Greedy requests, overlapped rounds: the tokens of plain greedy decoding (with the overlapped
    loop too), stop tokens included."""
    prompts, params, _ = workload(copy.cfg.vocab_size)
    greedy = [p for p in params if p.temperature == 0]
    prompts = [pr for pr, p in zip(prompts, params) if p.temperature == 0]
    for model in (copy, tiny):
        plain = Engine(model, dataclasses.replace(CONFIG, speculative=None, overlap=True)).generate(prompts, greedy)
        eng = Engine(model, dataclasses.replace(CONFIG, num_draft_tokens=3, overlap=True))
        out = eng.generate(prompts, greedy)
        assert [(o.token_ids, o.finish_reason) for o in out] == [(o.token_ids, o.finish_reason) for o in plain]
        assert pool_is_clean(eng)


def test_trained_draft_mixed_acceptance():
    """The trained tiny model, whose drafts are right some of the time (rounds accept 0 to n drafts,
    so each round's start is known on the device only): held-out text continued greedily, a batch of
    four, overlapped rounds give plain greedy decoding's tokens, with and without the overlap."""
    from cpkv_jax.eval import TaskTokenizer, text_windows
    from models.weights import TINY_DIR
    tt = TaskTokenizer.from_dir(TINY_DIR)
    prompts = [w[:40 + 9 * i] for i, w in enumerate(text_windows(tt, 4, 96))]
    params = [SamplingParams(max_new_tokens=18 + 5 * i, ignore_eos=True) for i in range(4)]
    config = EngineConfig(page_size=16, kv_pages=64, max_running=4)
    plain = [o.token_ids for o in Engine(str(TINY_DIR), config).generate(prompts, params)]
    accepted = []
    for overlap in (False, True):
        eng = Engine(str(TINY_DIR), dataclasses.replace(config, speculative="nextn", num_draft_tokens=3,
                                                        overlap=overlap))
        assert [o.token_ids for o in eng.generate(prompts, params)] == plain
        assert 1.3 < eng.stats()["spec_acceptance_length"] < 3.5
        assert pool_is_clean(eng)
        accepted.append(eng.metrics["spec_accepted"])
    assert accepted[0] == accepted[1]      # the same drafts: the draft KV the chains read is the same
