"""The overlapped decode loop (EngineConfig.overlap: step n+1 is planned and dispatched before the host
takes step n's tokens, which stay on the device for the next decode step) against the loop without it,
on one scripted workload: many mixed requests (greedy, seeded sampling, stop tokens and strings, logprobs
and alternatives, prompt logprobs, captured logits, one-token requests, requests waiting for room), aborts
mid-decode and while waiting, requests added while others run (one sharing a cached prefix), and a
stream: the same tokens, every number bit-equal when the schedule is the same, every event arrives, no
page is leaked."""

import dataclasses
import re

import numpy as np
import pytest

from cpkv_jax.engine import Engine, EngineConfig, _load_tokenizer
from cpkv_jax.sampling import SamplingParams
from tests.helpers import assert_same_greedy_outputs, random_prompts
from tests.test_engine import pool_is_clean

CONFIG = EngineConfig(page_size=16, kv_pages=40, max_running=4, max_prefill_tokens=64)
LENGTHS = [1, 5, 17, 33, 40, 64, 70, 90, 3, 21]


def workload(tiny, stops):
    rng = np.random.default_rng(11)
    prompts = random_prompts(rng, LENGTHS, tiny.cfg.vocab_size)
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    params = [p, dataclasses.replace(p, temperature=0.8, top_p=0.9, seed=3),
              dataclasses.replace(p, max_new_tokens=1), dataclasses.replace(p, logprobs=True, top_logprobs=3),
              dataclasses.replace(p, temperature=1.0, top_k=20, seed=5, max_new_tokens=14),
              dataclasses.replace(p, prompt_logprobs=True, logprobs=True), p,
              dataclasses.replace(p, max_new_tokens=16), p, dataclasses.replace(p, temperature=0.7, seed=9, max_new_tokens=16)]
    params = [dataclasses.replace(sp, **stops.get(i, {})) for i, sp in enumerate(params)]
    late = [prompts[3][:32] + rng.integers(2, tiny.cfg.vocab_size, 9).tolist(), prompts[1][:3]]
    return prompts, params, late


def run(tiny, overlap, config=CONFIG, stops=None):
    """The script: 10 requests, 3 steps, aborts of request 1 (mid-decode) and 7 (waiting, when only 4
    run at once), 2 more requests (one sharing request 3's prompt pages), then to the end; then a stream."""
    eng = Engine(tiny, dataclasses.replace(config, overlap=overlap), tokenizer=_load_tokenizer("tiny-random"))
    device_tokens = []
    forward = eng.runner.forward

    def recording_forward(batch, *a, **kw):
        device_tokens.append(int((np.asarray(batch.tokens) < 0).sum()))
        return forward(batch, *a, **kw)
    eng.runner.forward = recording_forward
    prompts, params, late = workload(tiny, stops or {})
    rids = [eng._enqueue(pr, sp, True, True) for pr, sp in zip(prompts, params)]
    events = []
    for _ in range(3):
        events += eng.step()
    eng.abort(rids[1])
    eng.abort(rids[7])
    rids += [eng.add_request(pr, SamplingParams(max_new_tokens=6, ignore_eos=True), stream_text=True)
             for pr in late]
    while eng.has_unfinished():
        events += eng.step()
    outs = [eng.output(r) for r in rids]
    streamed = [(e.index, e.token_id, e.text, e.finish_reason)
                for e in eng.stream(late, SamplingParams(max_new_tokens=5, temperature=0.9, seed=1, ignore_eos=True))]
    assert pool_is_clean(eng)
    return outs, events, streamed, device_tokens


def assert_same_run(ref, got, exact: bool):
    """Equal tokens, finish reasons, texts, cached prefixes and streams; log-probabilities and logits
    bit-equal (`exact`) or within 1e-5 of the largest (another batch composition: rows of different
    matmul shapes round differently); every token arrives once as an event, in order per request."""
    (ref, ref_events, ref_stream, ref_dev), (got, events, stream, dev) = ref, got
    assert sum(dev) > 0 and sum(ref_dev) == 0   # the overlapped loop did read tokens on the device
    assert ref[1].finish_reason == ref[7].finish_reason == "abort" and 0 < len(ref[1].token_ids) < 10
    assert ref[10].cached_tokens == 32

    def same(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return np.array_equal(x, y) if exact else x.shape == y.shape and np.abs(x - y).max(initial=0) <= 1e-5 * max(
            1.0, np.abs(y).max(initial=0))
    for a, b in zip(ref, got):
        assert (a.token_ids, a.finish_reason, a.text, a.cached_tokens) == (b.token_ids, b.finish_reason, b.text,
                                                                           b.cached_tokens)
        assert (a.logprobs is None) == (b.logprobs is None) and same(a.logprobs or [], b.logprobs or [])
        assert [[t for t, _ in alt] for alt in a.top_logprobs or []] == [[t for t, _ in alt] for alt in b.top_logprobs or []]
        assert same([[v for _, v in alt] for alt in a.top_logprobs or []], [[v for _, v in alt] for alt in b.top_logprobs or []])
        assert same((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:])
        assert len(a.logits or []) == len(b.logits or []) and all(map(same, a.logits or [], b.logits or []))
    key = lambda e: (e.rid, e.token_id, e.finish_reason, e.text)   # noqa: E731
    for r in {e.rid for e in ref_events}:
        assert [key(e) for e in events if e.rid == r] == [key(e) for e in ref_events if e.rid == r]
        assert same([e.logprob for e in events if e.rid == r], [e.logprob for e in ref_events if e.rid == r])
    assert stream == ref_stream


ROOMY = dataclasses.replace(CONFIG, max_running=16, kv_pages=64)


@pytest.fixture(scope="module")
def roomy(tiny):
    return {overlap: run(tiny, overlap, ROOMY) for overlap in (False, True)}


def test_same_schedule_is_bit_identical(roomy):
    """Every request admitted at once and none ending on a sampled value: the overlapped loop runs the
    same batches (a request's last token is known to be its last before it is sampled), so every
    number is bit-equal."""
    assert_same_run(roomy[False], roomy[True], exact=True)


def test_waiting_requests_and_stops_give_identical_tokens(tiny, roomy):
    """4 requests at once in 40 pages, stop tokens and a stop string (taken from the roomy run, so they
    do end requests): the host learns of a stop one step later, so requests are admitted a step later
    and finished ones fill a lane once more; tokens are still identical."""
    first = roomy[False][0]
    chars = [c for c in first[9].text[2:] if c != "\ufffd"]   # a whole character the text has after its start
    stops = {0: {"stop_token_ids": (first[0].token_ids[4],)},
             3: {"stop_token_ids": (first[3].token_ids[2], first[3].token_ids[6])},
             6: {"ignore_eos": False, "stop_token_ids": (first[6].token_ids[7],)},
             9: {"stop": (chars[0],)}}
    ref, got = (run(tiny, overlap, CONFIG, stops) for overlap in (False, True))
    assert [o.finish_reason for o in ref[0]].count("stop") >= 4
    assert_same_run(ref, got, exact=False)


def _control_flow(compiled_text: str) -> dict:
    return {op: len(re.findall(rf"= [^=]*\b{op}\(", compiled_text)) for op in ("conditional", "while")}


def test_decode_step_and_sampler_hold_no_host_control_flow(tiny):
    """On the GPU a conditional reads its predicate on the host and a while loop is launched by the host
    one iteration at a time: either one makes the overlapped loop's dispatch wait for the device
    (docs/perf.md, 2026-12-02 fourth session). The compiled decode step (the MoE plan's searches
    unrolled, so XLA unrolls the short layer scan) and the sampler (greedy or not: a static flag, not
    a lax.cond) hold neither."""
    import jax.numpy as jnp

    from cpkv_jax.runner import sample_and_keep
    eng = Engine(tiny, dataclasses.replace(CONFIG, overlap=False))
    rng = np.random.default_rng(0)
    for n in (40, 9):
        eng.add_request(rng.integers(2, tiny.cfg.vocab_size, n).tolist(),
                        SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(2):
        eng.step()
    chunks = eng.scheduler.plan_decode()
    assert len(chunks) == 2
    step = eng.batch_builder.build(chunks, False)
    decode = eng.runner.lower(step.batch, step.last_lane, attn_path="absorbed", last_rank=step.last_rank)
    assert _control_flow(decode.compile().as_text()) == {"conditional": 0, "while": 0}

    B, V = step.rows, tiny.cfg.vocab_size
    temperature, top_p, top_k, seed = eng.batch_builder.sampling("sample", [c.req for c in chunks], B)
    args = (eng.runner.last_tokens, np.int32(0), jnp.zeros((B, V), jnp.float32), temperature, top_p, top_k, seed,
            np.zeros(B, np.int32))
    for stochastic in (False, True):
        text = sample_and_keep.lower(*args, stochastic=stochastic).compile().as_text()
        assert _control_flow(text) == {"conditional": 0, "while": 0}, stochastic


def test_unrolled_decode_layers_equal_the_scan(tiny):
    """KernelPolicy.unroll_layers_max_tokens: a decode step with its layer groups unrolled lowers to more
    per-layer ops inside the group loop (the repeats written out, not iterated) and decodes the same
    greedy tokens, logits within 1e-5, as the scan (unroll_layers_max_tokens=0)."""
    from pallas_kernels.policy import KernelPolicy
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, [7, 30], tiny.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    dots, outs = [], []
    for policy in (KernelPolicy(unroll_layers_max_tokens=0), KernelPolicy(unroll_layers_max_tokens=16)):
        eng = Engine(tiny, dataclasses.replace(CONFIG, overlap=False, kernels=policy))
        outs.append(eng.generate(prompts, params, return_logits=True))
        for p in prompts:
            eng.add_request(p, params)
        for _ in range(2):
            eng.step()
        step = eng.batch_builder.build(eng.scheduler.plan_decode(), False)
        text = eng.runner.lower(step.batch, step.last_lane, attn_path="absorbed", last_rank=step.last_rank).as_text()
        dots.append(text.count("stablehlo.dot_general"))
    assert dots[1] > dots[0], dots
    assert_same_greedy_outputs(outs[1], outs[0])
