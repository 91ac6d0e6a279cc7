"""Speculative verify rounds with fused dispatches (cpkv_jax.spec): the same numbers as the round that
ran every piece as its own dispatch and read the device twice, and at most the dispatches and host
reads a round is meant to cost.

The reference numbers (tests/fixtures/spec_rounds.npz) were recorded on the CPU backend by the unfused
implementation, so a change that alters any token, log-probability, alternative, captured logit or
acceptance count of these scripts turns the test red: integers exactly, floats to FLOAT_ATOL (XLA's
CPU code rounds the last bits differently on other processors: a 2-core Xeon without the recording
machine's vector extensions read differences up to 9.5e-7 in logits and log-probabilities, every token
and count equal). Regenerate them (`python -m tests.test_spec_fused`) only
for a change meant to alter the numbers."""

import dataclasses
import os

import numpy as np
import pytest

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams
from tests.helpers import random_prompts
from tests.test_engine import pool_is_clean
from tests.test_spec import copy_draft_model

SNAPSHOT = os.path.join(os.path.dirname(__file__), "fixtures", "spec_rounds.npz")
CONFIG = EngineConfig(page_size=16, kv_pages=64, max_running=8, max_prefill_tokens=64, speculative="nextn",
                      overlap=False)   # the recorded loop (tests/test_spec_overlap.py: the overlapped one against it)
STOP = (9, 38)   # stop tokens of requests 0 (greedy) and 4 (seeded), reached mid-round
FLOAT_ATOL = 1e-5
CASES = {"n1": dict(num_draft_tokens=1), "n3": dict(num_draft_tokens=3), "cp2_n2": dict(num_draft_tokens=2, cp_size=2)}


def workload(vocab):
    """Mixed prompt lengths; greedy and seeded sampling (top-p, top-k); logprobs with alternatives; a
    one-token request; stop tokens that end requests inside a round (ids that the greedy / seeded
    outputs reach at their 4th-6th token); one request capturing its logits."""
    prompts = random_prompts(np.random.default_rng(21), [3, 21, 47, 90, 9, 33], vocab)
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    params = [dataclasses.replace(p, stop_token_ids=(STOP[0],)),
              dataclasses.replace(p, temperature=0.8, top_p=0.9, seed=3, max_new_tokens=12, logprobs=True),
              dataclasses.replace(p, max_new_tokens=1),
              dataclasses.replace(p, logprobs=True, top_logprobs=3, max_new_tokens=9),
              dataclasses.replace(p, temperature=1.0, top_k=20, seed=5, max_new_tokens=11, logprobs=True,
                                  stop_token_ids=(STOP[1],)),
              dataclasses.replace(p, max_new_tokens=12, logprobs=True)]
    late = [prompts[3][:40] + [7, 8, 9], prompts[0]]
    return prompts, params, late


@pytest.fixture(scope="module")
def copy(tiny):
    """A draft that is right for greedy rows (every draft kept) and partly right for sampled ones."""
    return copy_draft_model(tiny)


def run_script(tiny, **kw):
    """Six requests, three steps, an abort of request 1 mid-decode, two late requests (one sharing
    request 3's cached prefix, one seeded), then to the end. Returns every number the run produced."""
    eng = Engine(tiny, dataclasses.replace(CONFIG, **kw))
    prompts, params, late = workload(tiny.cfg.vocab_size)
    rids = [eng.add_request(pr, sp, return_logits=i == 5) for i, (pr, sp) in enumerate(zip(prompts, params))]
    events = []
    for _ in range(3):
        events += eng.step()
    eng.abort(rids[1])
    rids += [eng.add_request(late[0], SamplingParams(max_new_tokens=7, ignore_eos=True)),
             eng.add_request(late[1], SamplingParams(max_new_tokens=8, temperature=0.9, seed=11, ignore_eos=True,
                                                     logprobs=True))]
    while eng.has_unfinished():
        events += eng.step()
    outs = [eng.output(r) for r in rids]
    assert pool_is_clean(eng)
    assert eng.compilations() <= eng.max_compilations()
    rec = {"events_rid": [e.rid for e in events], "events_token": [e.token_id for e in events],
           "events_logprob": [e.logprob for e in events],
           "metrics": [eng.metrics[k] for k in ("spec_rounds", "spec_request_rounds", "spec_accepted")]}
    for i, o in enumerate(outs):
        rec[f"{i}_tokens"] = o.token_ids
        rec[f"{i}_finish"] = ["stop", "length", "abort"].index(o.finish_reason)
        rec[f"{i}_cached"] = o.cached_tokens
        if o.logprobs is not None:
            rec[f"{i}_logprobs"] = o.logprobs
        if o.top_logprobs:
            rec[f"{i}_top_ids"] = [[t for t, _ in alt] for alt in o.top_logprobs]
            rec[f"{i}_top_values"] = [[v for _, v in alt] for alt in o.top_logprobs]
        if o.logits:
            rec[f"{i}_logits"] = np.stack(o.logits)
    return {k: np.asarray(v) for k, v in rec.items()}


def recorded(case: str) -> dict:
    with np.load(SNAPSHOT) as f:
        return {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith(case + "/")}


def write_snapshot():
    """Record every case's numbers with the current code (`python -m tests.test_spec_fused`); the
    snapshot in the repository was recorded with the unfused round (before the verify step held the
    acceptance)."""
    from models.weights import load_model
    model = copy_draft_model(load_model("tiny-random"))
    out = {f"{case}/{k}": v for case, kw in CASES.items() for k, v in run_script(model, **kw).items()}
    np.savez_compressed(SNAPSHOT, **out)


@pytest.mark.parametrize("case", list(CASES))
def test_rounds_equal_the_recorded_unfused_rounds(copy, case):
    """Every token, finish reason, cached prefix, event and acceptance count equal to the unfused
    implementation's; every log-probability, alternative value and captured logit within FLOAT_ATOL."""
    want = recorded(case)
    got = run_script(copy, **CASES[case])
    assert sorted(got) == sorted(want)
    stops = [int(f) for k, f in want.items() if k.endswith("_finish")].count(0)
    assert stops >= 1 and want["metrics"][2] > 0     # the script does end requests on stop tokens, drafts are kept
    for k in sorted(want):
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        if np.issubdtype(want[k].dtype, np.floating):
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=FLOAT_ATOL, err_msg=k)
        else:
            assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("overlap", [False, True])
def test_round_dispatches_and_host_reads(tiny, monkeypatch, overlap):
    """A verify round with n drafts on one rank is one dispatch (the target step with the acceptance,
    the draft extend with the first proposals and the n - 1 chain steps in one executable), no other
    device operation (greedy requests: no draft distributions gathered, nothing indexed or stacked),
    and one device-to-host read (jax.device_get of the round's results): every array brought to the
    host (ArrayImpl._value, behind tolist, int(), ...; np.asarray in the modules a round runs) is
    counted, and none is read outside that one call. Without the overlapped loop a step dispatches a
    round and reads it; with it a step dispatches the next round first and reads the one before, so
    each round is still read once."""
    import jax
    from jax._src import core
    from jax._src.array import ArrayImpl

    from cpkv_jax import batch, engine, runner, scheduler, spec
    n = 3
    eng = Engine(tiny, dataclasses.replace(CONFIG, num_draft_tokens=n, overlap=overlap))
    assert eng.overlap == overlap
    prompts, _, _ = workload(tiny.cfg.vocab_size)
    for i, pr in enumerate(prompts):
        eng.add_request(pr, SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True))
    while eng.scheduler.plan_prefill() or not eng.scheduler.plan_decode():
        eng.step()
    names = ("round", "forward", "draft_forward", "sample", "device_get", "other_reads", "eager_ops")
    calls = dict.fromkeys(names, 0)
    in_device_get = []

    def counting(name, f):
        def call(*a, **kw):
            calls[name] += 1
            in_device_get.append(name == "device_get")
            try:
                return f(*a, **kw)
            finally:
                in_device_get.pop()
        return call
    for name in ("round", "forward", "draft_forward", "sample"):
        monkeypatch.setattr(eng.runner, name, counting(name, getattr(eng.runner, name)))
    monkeypatch.setattr(spec.jax, "device_get", counting("device_get", jax.device_get))
    value = ArrayImpl._value

    def counted_value(self):
        if self._npy_value is None and not any(in_device_get):
            calls["other_reads"] += 1
        return value.fget(self)
    monkeypatch.setattr(ArrayImpl, "_value", property(counted_value))
    eager = core.EvalTrace.process_primitive

    def counted_primitive(self, *a, **kw):
        calls["eager_ops"] += 1
        return eager(self, *a, **kw)
    monkeypatch.setattr(core.EvalTrace, "process_primitive", counted_primitive)

    class CountingNumpy:
        """numpy, but np.asarray / np.array of a device array (the buffer protocol: no _value) counted."""
        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, x, *a, **kw):
            calls["other_reads"] += isinstance(x, jax.Array) and not any(in_device_get)
            return np.asarray(x, *a, **kw)
        array = asarray
    for module in (spec, scheduler, batch, runner, engine):
        monkeypatch.setattr(module, "np", CountingNumpy())
    steps, carried = [], len(eng._in_flight)     # a round dispatched by the last step above is read below
    while eng.has_unfinished():
        before = dict(calls)
        eng.step()
        steps.append({k: calls[k] - before[k] for k in calls})
    quiet = dict.fromkeys(("forward", "draft_forward", "sample", "other_reads", "eager_ops"), 0)
    for got in steps:
        assert {k: got[k] for k in quiet} == quiet, got
        assert got["round"] <= 1 and got["device_get"] <= 1
        assert overlap or got["device_get"] == got["round"]    # without the overlap a round is read at once
    rounds = sum(got["round"] for got in steps)
    assert rounds >= 4 and sum(got["device_get"] for got in steps) == rounds + carried
    if overlap:   # a step with a round in flight dispatches the next before it reads that one
        assert sum(got["round"] == got["device_get"] == 1 for got in steps) >= rounds - 2
    assert pool_is_clean(eng)


if __name__ == "__main__":
    write_snapshot()
