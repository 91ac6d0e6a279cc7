"""A real uvicorn server on 127.0.0.1 (one per module, on a free port, in a background thread) driven by
the `openai` Python client: every answer equals Engine.generate of the same request on a separate
engine, under concurrency and with clients that disconnect; the pool's pages all come back."""

import asyncio
import socket
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
import uvicorn

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.sampling import SamplingParams
from cpkv_jax.server import create_app
from tests.helpers import wait_idle

CONFIG = EngineConfig(page_size=16, kv_pages=160, max_running=16, max_prefill_tokens=128)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, the app's state) of a server running on its own thread until the module ends."""
    model_dir = tmp_path_factory.mktemp("chat")
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    app = create_app(Engine("tiny", CONFIG), model_name="tiny", model_dir=model_dir, max_queued=256)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def ref():
    return Engine("tiny", CONFIG)


def isolated(ref, prompt, **kw) -> str:
    return ref.generate([prompt], SamplingParams(**kw))[0].text


def pool_from_metrics(url) -> dict:
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith(("cpkv_free_pages", "cpkv_total_pages", "cpkv_radix_pages", "cpkv_running",
                              "cpkv_waiting"))}


def assert_pages_back(url, state):
    """Every page free or held by the prefix cache (from /metrics and from the engine itself)."""
    wait_idle(state.loop)
    m = pool_from_metrics(url)
    assert m["cpkv_running"] == m["cpkv_waiting"] == 0
    assert m["cpkv_free_pages"] + m["cpkv_radix_pages"] == m["cpkv_total_pages"]
    s = state.loop.engine.stats()
    assert s["request_pages"] == s["reserved_pages"] == 0 and s["radix"]["protected_pages"] == 0


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=7)])
def test_completions_and_chat_equal_generate(server, ref, sampling):
    """Non-streamed and streamed completions and chat equal Engine.generate of the same request (greedy
    and seeded); n = 3 gives the seeds seed, seed + 1, seed + 2; a stop string cuts the text exactly."""
    url, state = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kw = dict(max_new_tokens=10, ignore_eos=True, **sampling)
    req = dict(model="tiny", max_tokens=10, extra_body={"ignore_eos": True}, **sampling)
    want = isolated(ref, PROMPT, **kw)
    assert client.completions.create(prompt=PROMPT, **req).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, stream=True, **req)) == want
    messages = [{"role": "user", "content": "hi there"}]
    chat_want = isolated(ref, "<user>hi there\n<assistant>", **kw)
    assert client.chat.completions.create(messages=messages, **req).choices[0].message.content == chat_want
    chunks = client.chat.completions.create(messages=messages, stream=True, **req)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_want
    seed = sampling.get("seed", 0)
    three = client.completions.create(prompt=PROMPT, n=3, **req)
    assert [c.text for c in sorted(three.choices, key=lambda c: c.index)] == [
        isolated(ref, PROMPT, **dict(kw, seed=seed + i)) for i in range(3)]
    stop = next(c for c in want[1:] if c != "\ufffd")
    cut = client.completions.create(prompt=PROMPT, stop=[stop], **req).choices[0]
    assert (cut.text, cut.finish_reason) == (want[:want.find(stop)], "stop")
    assert_pages_back(url, state)


def test_64_concurrent_clients_each_equal_their_isolated_run(server, ref):
    """64 clients at once (mixed prompt and output lengths, streamed or not, greedy or seeded): every
    response is complete and equals the request run alone; afterwards every page is back."""
    url, state = server
    rng = np.random.default_rng(0)
    requests = []
    for i in range(64):
        prompt = rng.integers(2, 500, int(rng.integers(1, 60))).tolist()
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, seed=i)
        requests.append((prompt, int(rng.integers(1, 12)), sampling, i % 3 == 0))

    async def one(client, prompt, max_tokens, sampling, stream):
        kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}, **sampling)
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text, r.choices[0].finish_reason
        text, reason = "", None
        async for c in await client.completions.create(stream=True, **kw):
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*[one(client, *r) for r in requests])

    results = asyncio.run(main())
    for (prompt, max_tokens, sampling, _), (text, reason) in zip(requests, results):
        assert reason == "length"
        assert text == isolated(ref, prompt, max_new_tokens=max_tokens, ignore_eos=True, **sampling)
    assert_pages_back(url, state)


def test_clients_disconnecting_mid_stream_are_aborted_and_others_unaffected(server, ref):
    """10 streaming clients leave after two chunks of a long request while 6 others run: the 10 are
    aborted (their pages back), the others' answers equal their isolated runs."""
    url, state = server
    rng = np.random.default_rng(1)
    leaving = [rng.integers(2, 500, 20).tolist() for _ in range(10)]
    staying = [rng.integers(2, 500, int(n)).tolist() for n in rng.integers(3, 50, 6)]
    aborted = state.loop.aborted

    async def leave(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=400, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async with stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break

    async def stay(client, prompt):
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*[leave(client, p) for p in leaving], *[stay(client, p) for p in staying])

    results = asyncio.run(main())[len(leaving):]
    assert results == [isolated(ref, p, max_new_tokens=8, ignore_eos=True) for p in staying]
    assert_pages_back(url, state)
    assert state.loop.aborted == aborted + len(leaving)
    assert state.metrics.generation_tokens._value.get() < 400 * len(leaving)   # none ran to its end


def test_bench_serving_counts_every_token_of_a_level(server):
    """scripts/bench_serving.py against this server: every request completes with exactly its output
    length counted token by token, and the timings are ordered (TTFT <= latency)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    url, state = server
    shape = [(5, 3), (9, 4), (17, 2), (30, 5)]
    requests = bench.requests_of(shape, 500, np.random.default_rng(2))
    results, wall = asyncio.run(bench.run_level(url, "tiny", requests, 2))
    m = bench.summarize(results, wall, 2)
    assert (m["completed"], m["failed"], m["short_outputs"]) == (4, 0, 0)
    assert m["output_tokens"] == sum(o for _, o in shape) and m["input_tokens"] == sum(i for i, _ in shape)
    assert [len(r["arrivals"]) for r in results] == [o for _, o in shape]
    assert 0 < m["ttft"]["p50_ms"] <= m["latency"]["p50_ms"] and m["itl"]["p50_ms"] > 0
    assert_pages_back(url, state)
