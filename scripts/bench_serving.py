"""Serving benchmark: an async load generator against an OpenAI-compatible server (`cpkv-jax serve`, or
any server with /v1/completions), at several concurrency levels. Each level keeps C requests in flight
(closed loop) until --num-prompts have completed, and reports request throughput, output tokens/s, and
p50 / p99 of time to first token (TTFT), time per output token after the first (TPOT, per request) and
inter-token latency (ITL, every gap between two tokens); prints a table and writes JSON.

Workloads (--dataset), prompts as random token ids (no tokenizer needed), greedy with ignore_eos so every
request produces exactly its output length:
  random    lengths uniform in [L(1 - r), L(1 + r)] around --input-len / --output-len (r = --range-ratio)
  sharegpt  ShareGPT-shaped lengths (not the dataset): lognormal with median --input-len / --output-len
            and sigma 1.0 (prompts) / 0.8 (outputs), the long right tail of chat conversations, clipped to
            [4, --max-input-len] and [1, --max-output-len]
Requests stream with `logprobs: 0`, so the server sends one chunk per token and the gaps are per token.

    python scripts/bench_serving.py --url http://127.0.0.1:8000 --concurrency 1 8 32 --num-prompts 200
    python scripts/bench_serving.py --model tiny --concurrency 1 4 --num-prompts 8 --input-len 32 \\
        --output-len 8 --page-size 16 --json bench_serving.json

Without --url the script starts the server itself, in this process (the engine options are the CLI's:
--model, --page-size, --max-running, ...; --model random:glm-5 --num-layers L --num-experts E serves a
GLM-5-shaped slice with random weights, as `cpkv-jax bench` does): convenient, but the client then shares the interpreter with
the server; for numbers worth quoting start `cpkv-jax serve` separately and pass --url. Each level
first runs an untimed warm-up pass (the same lengths and concurrency), which compiles the step shapes
the timed pass uses; every pass has its own random prompts, so nothing is served from the prefix cache
of an earlier one.
"""

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpkv_jax.cli import add_random_model_args, engine_config, engine_options  # noqa: E402


def lengths(args, rng) -> list[tuple[int, int]]:
    """(prompt length, output length) of each request."""
    n = args.num_prompts
    if args.dataset == "random":
        r = args.range_ratio
        ins = rng.integers(max(1, int(args.input_len * (1 - r))), int(args.input_len * (1 + r)) + 1, n)
        outs = rng.integers(max(1, int(args.output_len * (1 - r))), int(args.output_len * (1 + r)) + 1, n)
    else:
        ins = np.clip(np.rint(rng.lognormal(np.log(args.input_len), 1.0, n)), 4, args.max_input_len)
        outs = np.clip(np.rint(rng.lognormal(np.log(args.output_len), 0.8, n)), 1, args.max_output_len)
    return [(int(i), int(o)) for i, o in zip(ins, outs)]


def requests_of(shape: list[tuple[int, int]], vocab: int, rng) -> list[tuple[list[int], int]]:
    """Requests of these lengths with fresh random token ids: each pass (the warm-up, every level) its
    own prompts, so none is served from the prefix cache of an earlier pass."""
    return [(rng.integers(2, vocab, i).tolist(), o) for i, o in shape]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; the arrival time of each token (one SSE chunk per token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    t0 = time.perf_counter()
    arrivals, error = [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    arrivals += [time.perf_counter()] * len((choice.get("logprobs") or {}).get("tokens") or [])
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"start": t0, "end": time.perf_counter(), "arrivals": arrivals, "prompt_len": len(prompt),
            "max_tokens": max_tokens, "error": error}


async def run_level(url: str, model: str, requests, concurrency: int) -> tuple[list[dict], float]:
    """Every request, at most `concurrency` in flight; (results, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        async def gated(prompt, max_tokens):
            async with gate:
                return await one_request(client, model, prompt, max_tokens)
        t = time.perf_counter()
        results = await asyncio.gather(*[gated(p, m) for p, m in requests])
        return results, time.perf_counter() - t


def summarize(results: list[dict], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r["error"] is None and r["arrivals"]]
    ttft = [r["arrivals"][0] - r["start"] for r in ok]
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (len(r["arrivals"]) - 1) for r in ok if len(r["arrivals"]) > 1]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    out_tokens = sum(len(r["arrivals"]) for r in ok)

    def pct(xs):
        return {"p50_ms": float(np.percentile(xs, 50)) * 1e3, "p99_ms": float(np.percentile(xs, 99)) * 1e3,
                "mean_ms": float(np.mean(xs)) * 1e3} if xs else None
    return {"concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3], "duration_s": wall,
            "request_throughput": len(ok) / wall, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "input_tokens": sum(r["prompt_len"] for r in ok),
            "short_outputs": sum(len(r["arrivals"]) < r["max_tokens"] for r in ok),
            "ttft": pct(ttft), "tpot": pct(tpot), "itl": pct(itl),
            "latency": pct([r["end"] - r["start"] for r in ok])}


def start_server(args):
    """The server on a free 127.0.0.1 port, on a thread of this process: (url, the model's vocabulary size)."""
    import uvicorn

    from cpkv_jax.cli import bench_model, compile_cache
    from cpkv_jax.engine import Engine
    from cpkv_jax.server import create_app

    compile_cache(args)
    model = bench_model(args) if str(args.model).startswith("random:") else args.model
    engine = Engine(model, engine_config(args))
    app = create_app(engine, model_name=Path(str(args.model)).name, max_queued=max(256, 2 * max(args.concurrency)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", engine.cfg.vocab_size


def served_model(url: str) -> tuple[str, int]:
    """The first model the server lists, and its context length (max_model_len, else 2048)."""
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    return data["id"], int(data.get("max_model_len") or 2048)


def print_levels(levels: list[dict]) -> None:
    from cpkv_jax.perf import print_table

    def cell(m, key):
        return "-" if m[key] is None else f"{m[key]['p50_ms']:.1f} / {m[key]['p99_ms']:.1f}"
    rows = [("concurrency", "done", "failed", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
             "ITL p50/p99 ms", "latency p50/p99 ms")]
    rows += [(m["concurrency"], m["completed"], m["failed"], f"{m['request_throughput']:.2f}",
              f"{m['output_tokens_per_s']:.1f}", cell(m, "ttft"), cell(m, "tpot"), cell(m, "itl"), cell(m, "latency"))
             for m in levels]
    print_table(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[engine_options()],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one here with --model ...)")
    p.add_argument("--dataset", choices=("random", "sharegpt"), default="random")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random: mean; sharegpt: median)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (random: mean; sharegpt: median)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="random: lengths within L(1 +- r)")
    p.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: the longest prompt")
    p.add_argument("--max-output-len", type=int, default=512, help="sharegpt: the longest output")
    p.add_argument("--vocab", type=int, default=None, help="prompt token ids below this (default: the model's "
                                                              "vocabulary, or 256 with --url: valid for any model)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip each level's untimed warm-up pass")
    p.add_argument("--seed", type=int, default=0)
    add_random_model_args(p)
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.num_prompts < 1:
        p.error("--concurrency and --num-prompts must be >= 1")

    if args.url is None:
        url, model_vocab = start_server(args)
    else:
        url, model_vocab = args.url.rstrip("/"), 256
    model, context = served_model(url)
    vocab = args.vocab or model_vocab
    rng = np.random.default_rng(args.seed)
    shape = lengths(args, rng)
    too_long = [i + o for i, o in shape if i + o > context]
    if too_long:
        p.error(f"{len(too_long)} requests exceed the model's context of {context} tokens (longest "
                f"{max(too_long)}): lower --input-len / --output-len / --max-input-len")
    levels = []
    for c in args.concurrency:
        if args.warmup:                  # the same lengths and concurrency: the step shapes the timed pass uses
            asyncio.run(run_level(url, model, requests_of(shape, vocab, rng), c))
        results, wall = asyncio.run(run_level(url, model, requests_of(shape, vocab, rng), c))
        levels.append(summarize(results, wall, c))
    print_levels(levels)
    result = {"url": url if args.url else None, "model": args.model if args.url is None else model,
              "dataset": args.dataset, "num_prompts": args.num_prompts,
              "input_len": {"mean": float(np.mean([i for i, _ in shape])), "max": max(i for i, _ in shape)},
              "output_len": {"mean": float(np.mean([o for _, o in shape])), "max": max(o for _, o in shape)},
              "engine": None if args.url else {k: str(v) for k, v in vars(engine_config(args)).items()},
              "levels": levels}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(m["failed"] for m in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
