"""The OpenAI-compatible server (cpkv_jax/server.py) through FastAPI's test client, on the tiny model:
every answer is checked against the same request run by a plain engine."""

import asyncio
import json
import shutil
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams
from cpkv_jax.server import create_app
from models.model import prefill_logits
from tests.helpers import pool_is_clean, wait_idle

CONFIG = EngineConfig(page_size=16, kv_pages=64, max_running=8, max_prefill_tokens=128)
PROMPT = [11, 42, 7, 300, 5, 19, 64, 128]


@pytest.fixture(scope="module")
def ref():
    return Engine("tiny", CONFIG)


@pytest.fixture(scope="module")
def client():
    app = create_app(Engine("tiny", CONFIG), model_name="tiny", max_queued=4)
    with TestClient(app) as c:
        c.app_state = app.state
        yield c


def expected(ref, prompt, **kw):
    out = ref.generate([prompt], SamplingParams(**kw))[0]
    return out


def token_text(engine, t):
    return engine.tokenizer.decode([t], skip_special_tokens=False)


def recompute_logprobs(engine, tokens):
    """log_softmax of a no-cache teacher-forced prefill of `tokens` [len, V] (indexer keys as the engine's)."""
    logits = np.asarray(prefill_logits(engine.model, np.asarray([tokens]), index_dtype=engine.config.index_dtype))[0]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def sse(resp) -> list:
    lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_completion_equals_the_engine_and_streams_the_same_text(client, ref):
    want = expected(ref, PROMPT, max_new_tokens=12, ignore_eos=True, logprobs=True)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    choice = got["choices"][0]
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-6)
    assert got["usage"] == {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20,
                            "prompt_tokens_details": {"cached_tokens": got["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
        chunks = sse(s)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 5,
                                                 "temperature": 0}).json()["choices"][0]["text"]
    assert text == ref.generate(["The quick brown fox"], SamplingParams(max_new_tokens=5))[0].text


def test_n_seeds_stop_strings_and_stop_ids(client, ref):
    """n samples use seeds seed, seed + 1, ...; a stop string cuts the text before its first occurrence
    (streamed or not) and ends the request; a stop token id ends it too."""
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": 3,
                                             "n": 2, "ignore_eos": True}).json()
    for i in range(2):
        want = expected(ref, PROMPT, max_new_tokens=6, temperature=0.9, seed=3 + i, ignore_eos=True)
        assert r["choices"][i]["text"] == want.text
    full = expected(ref, PROMPT, max_new_tokens=16, ignore_eos=True)
    stop = full.text[5:8]
    cut = full.text[:full.text.find(stop)]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop, "\x00never"]}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    assert got["text"] == cut and got["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
        assert "".join(c["choices"][0]["text"] for c in sse(s)) == cut
    stop_id = full.token_ids[3]
    got = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                "stop_token_ids": [stop_id]}).json()["choices"][0]
    want = expected(ref, PROMPT, max_new_tokens=16, stop_token_ids=[stop_id])
    assert got["text"] == want.text and got["finish_reason"] == "stop"


def test_top_logprobs_and_echoed_prompt_logprobs(client, ref):
    """logprobs: N gives each token's N alternatives; with echo the prompt's tokens come first with
    their log-probabilities (the first None), all equal to the log-softmax of a no-cache recompute;
    streamed chunks carry the same per-token logprobs."""
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3, "echo": True}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    want = ref.generate([PROMPT], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3,
                                                 prompt_logprobs=True))[0]
    lp = recompute_logprobs(ref, PROMPT + want.token_ids)
    ids = PROMPT + want.token_ids
    logprobs = got["logprobs"]
    assert got["text"] == ref.decode(PROMPT) + want.text
    assert logprobs["tokens"] == [token_text(ref, t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], lp[np.arange(len(ids) - 1), ids[1:]], atol=2e-5)
    for k in range(1, len(ids)):
        top = logprobs["top_logprobs"][k]
        best = np.argsort(-lp[k - 1])[:3]
        assert top == pytest.approx({token_text(ref, int(i)): float(lp[k - 1, i]) for i in best}, abs=2e-5)
    with client.stream("POST", "/v1/completions", json=dict(body, echo=False, stream=True)) as s:
        chunks = [c["choices"][0] for c in sse(s)]
    assert [c["logprobs"]["tokens"][0] for c in chunks] == logprobs["tokens"][len(PROMPT):]
    assert [c["logprobs"]["token_logprobs"][0] for c in chunks] == pytest.approx(
        logprobs["token_logprobs"][len(PROMPT):], abs=2e-5)
    for c, top in zip(chunks, logprobs["top_logprobs"][len(PROMPT):]):
        assert c["logprobs"]["top_logprobs"][0] == pytest.approx(top, abs=2e-5)


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 10 ** 6]}, "outside the vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 10 ** 7}, "exceeds the model's context"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt": [1, 2], "logprobs": 6}, "logprobs"),
    ({"prompt": [1, 2], "stop": ["ok", ""]}, "stop strings must be non-empty"),
    ({"prompt": [1, 2], "n": 0}, "n"),
    ({"prompt": [1, 2], "logprobs": 1, "echo": True, "stream": True}, "not supported with stream"),
])
def test_bad_requests_are_400_with_an_openai_error(client, body, message):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


def test_chat_renders_the_checkpoint_template(tmp_path, ref):
    """/v1/chat/completions renders the checkpoint's chat_template.jinja and generates from it, as
    /v1/completions does from the rendered text; a model without a template answers 400."""
    from models.weights import tiny_checkpoint
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint(), model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    engine = Engine("tiny", CONFIG)
    app = create_app(engine, model_name="tiny", model_dir=model_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    with TestClient(app) as c:
        got = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
        with_logprobs = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                             "logprobs": True, "top_logprobs": 2}).json()
        r = c.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2})
        assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                             "stream": True}) as s:
            chunks = sse(s)
    want = ref.generate(["<system>be brief\n<user>hi there\n<assistant>"],
                        SamplingParams(max_new_tokens=6, logprobs=True, top_logprobs=2))[0]
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    content = with_logprobs["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [token_text(ref, t) for t in want.token_ids]
    assert [c["logprob"] for c in content] == pytest.approx(want.logprobs, abs=2e-5)
    assert [[(a["token"], a["logprob"]) for a in c["top_logprobs"]] for c in content] == [
        [(token_text(ref, i), pytest.approx(v, abs=2e-5)) for i, v in top] for top in want.top_logprobs]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    with TestClient(create_app(engine)) as c:            # the first app's engine thread has stopped
        r = c.post("/v1/chat/completions", json={"messages": msgs})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_concurrent_requests_each_equal_their_own_run(client, ref):
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    results = {}

    def call(i):
        results[i] = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 7, "temperature": 0,
                                                           "ignore_eos": True}).json()["choices"][0]["text"]
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i] == expected(ref, p, max_new_tokens=7, ignore_eos=True).text


def test_a_dropped_stream_is_aborted_and_a_full_queue_is_503(client):
    """Closing a stream after its first token aborts the request (its pages come back); past max_queued
    requests in flight the server answers 503."""
    loop = client.app_state.loop
    aborted = loop.aborted
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 500, "temperature": 0,
                                                         "ignore_eos": True, "stream": True}) as s:
        next(ln for ln in s.iter_lines() if ln.startswith("data: "))
    wait_idle(loop, 30)
    assert loop.aborted == aborted + 1 and not loop.subscribers
    assert pool_is_clean(loop.engine)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "n": 5})     # 5 > max_queued = 4
    assert r.status_code == 503 and "server busy" in r.json()["error"]["message"]


def test_clients_leaving_before_their_request_is_added(ref):
    """A client gone while the engine thread adds its request: that request is aborted as soon as it
    has an id. A client gone while its add still waits in the queue: the request is never added.
    Either way the engine thread lives on (it used to die setting a cancelled future's result) and
    the next request equals its own run."""
    from cpkv_jax.server import EngineLoop
    engine = Engine("tiny", CONFIG)
    eloop = EngineLoop(engine)
    in_add, release, added = threading.Event(), threading.Event(), []
    add_request = engine.add_request

    def slow_add(ids, params, **kw):
        added.append(list(ids))
        if ids == [1, 2, 3]:
            in_add.set()
            release.wait(30)
        return add_request(ids, params, **kw)

    engine.add_request = slow_add
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)

    async def main():
        mid_add = asyncio.create_task(eloop.add([1, 2, 3], long, asyncio.Queue()))
        while not in_add.is_set():
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(eloop.add([4, 5, 6], long, asyncio.Queue()))
        await asyncio.sleep(0.05)
        assert eloop.commands.qsize() == 1
        mid_add.cancel()
        queued.cancel()
        for task in (mid_add, queued):   # each future's cancellation lands before the engine thread goes on
            with pytest.raises(asyncio.CancelledError):
                await task
        release.set()
        events = asyncio.Queue()
        await asyncio.wait_for(eloop.add(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True), events), 60)
        while not isinstance(item := await asyncio.wait_for(events.get(), 60), tuple):
            pass
        return item[1]

    try:
        out = asyncio.run(main())
        wait_idle(eloop, 30)
        assert eloop.thread.is_alive()
        assert out.token_ids == expected(ref, PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
        assert added == [[1, 2, 3], PROMPT] and eloop.aborted == 1 and not eloop.subscribers
        assert pool_is_clean(engine)
    finally:
        release.set()
        eloop.close()


def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    text = client.get("/metrics").text
    for name in ("cpkv_time_to_first_token_seconds", "cpkv_requests_total", "cpkv_free_pages",
                 "cpkv_cached_prompt_tokens_total"):
        assert name in text
