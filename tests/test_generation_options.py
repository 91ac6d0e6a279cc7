"""Stop strings, n samples, top-N logprobs and prompt logprobs in Engine.generate / Engine.stream, each
against a baseline computed another way: full decodes of the plain output, separate single-sample runs,
and the log-softmax of a no-cache teacher-forced recompute of the model."""

import numpy as np
import pytest

from cpkv_jax.engine import Engine, EngineConfig, EngineInputError
from cpkv_jax.sampling import SamplingError, SamplingParams
from models.model import prefill_logits
from tests.helpers import pool_is_clean

# a 32-token prefill budget: the longer prompts below are prefilled in two chunks
CONFIG = EngineConfig(page_size=16, kv_pages=64, max_running=8, max_prefill_tokens=32)
TOP = 3


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny", CONFIG)


def recompute_logprobs(engine, tokens):
    """log_softmax of the teacher-forced logits [len(tokens), V] of one sequence, from an empty cache
    with the engine's indexer key dtype (padded at the end to 128 tokens: one compilation)."""
    padded = np.zeros((1, 128), np.int32)
    padded[0, :len(tokens)] = tokens
    logits = np.asarray(prefill_logits(engine.model, padded, index_dtype=engine.config.index_dtype))[0, :len(tokens)]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def assert_top_equal(got, lp_row, n):
    """got: n (id, logprob) pairs, best first; lp_row: the reference log-probabilities [V]."""
    assert len(got) == n
    ids, values = zip(*got)
    np.testing.assert_allclose(values, np.sort(lp_row)[::-1][:n], atol=2e-5)
    np.testing.assert_allclose(values, lp_row[list(ids)], atol=2e-5)


def test_top_and_prompt_logprobs_equal_a_full_recompute(engine):
    """A prompt prefilled in two chunks whose prefix is already cached (a prompt-logprobs request
    computes it anyway) and a short one, in one batch: every prompt token's log-probability and top
    alternatives, then the sampled tokens', equal the recompute's log-softmax; the tokens are the
    plain run's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, 45).tolist(), rng.integers(2, 500, 5).tolist()]
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=TOP, prompt_logprobs=True)
    outs = engine.generate(prompts, params)
    for prompt, out, ref in zip(prompts, outs, plain):
        assert out.token_ids == ref.token_ids and out.cached_tokens == 0
        lp = recompute_logprobs(engine, prompt + out.token_ids)
        L = len(prompt)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == L
        np.testing.assert_allclose(out.prompt_logprobs[1:], lp[np.arange(L - 1), prompt[1:]], atol=2e-5)
        for p in range(1, L):
            assert_top_equal(out.prompt_top_logprobs[p], lp[p - 1], TOP)
        steps = np.arange(L - 1, L - 1 + len(out.token_ids))
        np.testing.assert_allclose(out.logprobs, lp[steps, out.token_ids], atol=2e-5)
        for k, s in enumerate(steps):
            assert_top_equal(out.top_logprobs[k], lp[s], TOP)
    assert plain[0].prompt_logprobs is None and plain[0].top_logprobs is None
    assert pool_is_clean(engine)


def test_stop_strings_cut_the_text_and_end_the_request(engine):
    """The text is cut before the first occurrence of the stop string in the plain run's text, the
    request ends at the token that completed it (its pages back), streamed or not."""
    prompt = [11, 42, 7, 300, 5, 19, 64, 128]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    starts = [a for a in range(3, len(full.text) - 2) if "\ufffd" not in full.text[a:a + 2]]
    stop = full.text[starts[len(starts) // 2]:][:2]
    cut = full.text[:full.text.find(stop)]
    ends = next(k for k in range(1, 25) if stop in engine.decode(full.token_ids[:k]))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, stop=("\x00never", stop))
    out = engine.generate([prompt], params)[0]
    assert (out.text, out.finish_reason, out.token_ids) == (cut, "stop", full.token_ids[:ends])
    assert ends < 24 and pool_is_clean(engine)
    events = list(engine.stream([prompt], params))
    assert "".join(ev.text for ev in events) == cut
    assert [ev.token_id for ev in events] == out.token_ids and events[-1].finish_reason == "stop"
    assert pool_is_clean(engine)


def test_n_samples_are_the_runs_with_consecutive_seeds(engine):
    """n = 3 gives, per prompt and in order, the outputs of three single runs with seeds seed, seed + 1,
    seed + 2; the stream yields the same tokens under the same indices."""
    prompts = [[5, 6, 7, 8, 9], "Hello there"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=5, n=3)
    outs = engine.generate(prompts, params)
    assert len(outs) == 6
    for i, prompt in enumerate(prompts):
        for j in range(3):
            one = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9,
                                                           seed=5 + j))[0]
            assert outs[3 * i + j].token_ids == one.token_ids and outs[3 * i + j].text == one.text
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    streamed = {}
    for ev in engine.stream(prompts, params):
        streamed.setdefault(ev.index, []).append(ev.token_id)
    assert [streamed[k] for k in range(6)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(cp_size=2), dict(speculative="nextn", num_draft_tokens=2)])
def test_logprobs_under_cp_and_speculative_decoding(engine, kw):
    """Prompt logprobs gathered from CP ranks' lanes (and from the prefill that also feeds the draft
    model), and top alternatives from the verify round of speculative decoding, equal the single-device
    plain engine's."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 500, 40).tolist(), rng.integers(2, 500, 9).tolist()]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=TOP, prompt_logprobs=True)
    ref = engine.generate(prompts, params)
    other = Engine(engine.model, EngineConfig(page_size=16, kv_pages=64, max_running=8, max_prefill_tokens=32, **kw))
    for got, want in zip(other.generate(prompts, params), ref):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
        for g, w in zip(got.top_logprobs, want.top_logprobs):
            np.testing.assert_allclose([v for _, v in g], [v for _, v in w], atol=2e-5)
        np.testing.assert_allclose(got.prompt_logprobs[1:], want.prompt_logprobs[1:], atol=2e-5)
        for g, w in zip(got.prompt_top_logprobs[1:], want.prompt_top_logprobs[1:]):
            np.testing.assert_allclose([v for _, v in g], [v for _, v in w], atol=2e-5)
    assert other.compilations() <= other.max_compilations()


def test_bad_options_raise_before_anything_runs(engine):
    no_tokenizer = Engine(engine.model, CONFIG)
    with pytest.raises(EngineInputError, match="stop strings need the model's tokenizer"):
        no_tokenizer.generate([[1, 2]], SamplingParams(stop=("x",)))
    with pytest.raises(SamplingError, match="add each of params.samples"):
        engine.add_request([1, 2], SamplingParams(n=2))
    assert pool_is_clean(engine) and not engine.has_unfinished()
