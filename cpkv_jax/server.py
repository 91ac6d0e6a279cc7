"""OpenAI-compatible HTTP server on FastAPI + uvicorn: /v1/completions, /v1/chat/completions (SSE
streaming when asked), /v1/models, /health and /metrics (Prometheus).

The engine is not thread-safe, so it lives on one thread (`EngineLoop`): HTTP handlers send it
commands through a queue (add a request, abort one) and receive their request's token events on an
asyncio queue. A client that goes away has its request aborted and its pages freed; past `max_queued`
requests in flight the server answers 503; a bad request is a 400 with an OpenAI-style error body.
Stop strings are matched on the decoded text across token boundaries (the request is aborted at the
first match and the text cut before it); `n` runs n requests (sampling seeds seed, seed + 1, ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from cpkv_jax.engine import Engine, EngineInputError
from cpkv_jax.sampling import SamplingError, SamplingParams


class ServerInputError(ValueError):
    """A request the server refuses (400)."""


# ---- the engine thread ---------------------------------------------------------------------------

class EngineLoop:
    """Owns the engine on one thread. `add` returns a request id (or raises the engine's input error);
    the request's TokenEvents, then ('done', GenerationOutput), arrive on the asyncio queue given."""

    def __init__(self, engine: Engine, metrics: "ServerMetrics | None" = None):
        self.engine = engine
        self.metrics = metrics
        self.commands: queue.Queue = queue.Queue()
        self.subscribers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.aborted = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpkv-engine", daemon=True)
        self.thread.start()

    def add(self, ids: list[int], params: SamplingParams, events: asyncio.Queue) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("add", ids, params, asyncio.get_running_loop(), events, fut))
        return fut

    def abort(self, rid: int) -> None:
        self.commands.put(("abort", rid))

    def in_flight(self) -> int:
        return len(self.subscribers) + self.commands.qsize()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

    def _deliver(self, rid: int, item) -> None:
        sub = self.subscribers.get(rid)
        if sub is not None:
            loop, events = sub
            loop.call_soon_threadsafe(events.put_nowait, item)

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, ids, params, loop, events, fut = cmd
            try:
                rid = self.engine.add_request(ids, params)
            except (EngineInputError, SamplingError) as e:
                fut.set_exception(e)
                return
            self.subscribers[rid] = (loop, events)
            fut.set_result(rid)
        else:
            rid = cmd[1]
            if rid in self.subscribers:
                self.engine.abort(rid)
                out = self.engine.output(rid)
                self._deliver(rid, ("done", out))
                self.subscribers.pop(rid)
                self.aborted += 1

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                cmd = self.commands.get(timeout=0.0 if eng.has_unfinished() else 0.02)
                self._command(cmd)
                while True:
                    self._command(self.commands.get_nowait())
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            events = eng.step()
            now = time.perf_counter()
            for ev in events:
                self._deliver(ev.rid, ev)
                if ev.finish_reason is not None and ev.rid in self.subscribers:
                    self._deliver(ev.rid, ("done", eng.output(ev.rid)))
                    self.subscribers.pop(ev.rid)
            if self.metrics is not None:
                self.metrics.after_step(eng, now)


# ---- metrics -------------------------------------------------------------------------------------

class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("cpkv_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("cpkv_inter_token_seconds", "Time between a request's tokens", registry=r,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.requests = Counter("cpkv_requests", "Requests by outcome", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("cpkv_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("cpkv_cached_prompt_tokens", "Prompt tokens served by the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("cpkv_generation_tokens", "Generated tokens", registry=r)
        self.gauges = {name: Gauge(f"cpkv_{name}", doc, registry=r) for name, doc in (
            ("waiting", "Requests queued in the scheduler"), ("running", "Requests prefilling or decoding"),
            ("free_pages", "Free device KV pages"), ("total_pages", "Device KV pages"),
            ("radix_pages", "Device pages held by the prefix cache"),
            ("host_pages_used", "Host KV tier pages in use"), ("host_pages_total", "Host KV tier pages"),
            ("spec_acceptance_length", "Speculative decoding: tokens per request per round"))}

    def after_step(self, eng: Engine, now: float) -> None:
        s = eng.stats()
        for name in ("waiting", "running", "free_pages", "total_pages"):
            if name in s:
                self.gauges[name].set(s[name])
        self.gauges["radix_pages"].set(s.get("radix", {}).get("pages", 0))
        if eng.hicache is not None:
            alloc = eng.hicache.allocator
            self.gauges["host_pages_total"].set(alloc.capacity)
            self.gauges["host_pages_used"].set(alloc.capacity - alloc.num_free)
        if "spec_acceptance_length" in s:
            self.gauges["spec_acceptance_length"].set(s["spec_acceptance_length"])

    def finished(self, out) -> None:
        self.requests.labels(out.finish_reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_tokens.inc(out.cached_tokens)
        self.generation_tokens.inc(len(out.token_ids))


# ---- request bodies ------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False


class CompletionBody(_Body):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


# ---- stop strings --------------------------------------------------------------------------------

class StopMatcher:
    """Text of a request's tokens so far, cut before the first stop string; `emit()` returns the new
    text that can no longer become part of a stop string (a tail as long as the longest stop string,
    minus one character, is held back until it is decided)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def update(self, full_text: str) -> None:
        if self.stopped:
            return
        cut = min((i for i in (full_text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = full_text[:cut], True
        else:
            self.text = full_text

    def emit(self, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        if self.text.endswith("\ufffd") and not final:     # a character still being decoded
            end = min(end, len(self.text) - 1)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


# ---- the app -------------------------------------------------------------------------------------

def chat_template(model_dir: Path | None) -> tuple[str | None, dict]:
    """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's
    chat_template) and the special tokens the template may use."""
    if model_dir is None:
        return None, {}
    cfg_file = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    special = {k: (v.get("content") if isinstance(v, dict) else v)
               for k, v in tok_cfg.items() if k in ("bos_token", "eos_token")}
    jinja_file = model_dir / "chat_template.jinja"
    template = jinja_file.read_text() if jinja_file.exists() else tok_cfg.get("chat_template")
    if isinstance(template, list):               # HF: a list of {name, template}; take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special


def create_app(engine: Engine, *, model_name: str = "cpkv", model_dir: str | Path | None = None,
               max_queued: int = 256) -> FastAPI:
    """The FastAPI app over an engine (started on its own thread here; app.state.loop.close() stops
    it). model_dir: where the chat template lives (the checkpoint directory)."""
    import jinja2.sandbox

    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics)
    template_src, special = chat_template(Path(model_dir) if model_dir else None)
    template = None
    if template_src:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(template_src)
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        loop.close()

    app = FastAPI(title="cpkv-jax", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics
    cfg = engine.cfg

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return error_body(f"{where}: {first.get('msg', 'invalid request')}", 400, param=where or None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "cpkv-jax",
                                            "max_model_len": cfg.max_position_embeddings}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    def sampling(body: _Body, max_tokens: int, i: int) -> SamplingParams:
        seed = (body.seed or 0) + i
        return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=seed, stop_token_ids=tuple(body.stop_token_ids),
                              ignore_eos=body.ignore_eos, logprobs=True)

    def prompt_ids(prompt) -> list[int]:
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise ServerInputError("this model has no tokenizer: send the prompt as token ids")
            return engine.tokenizer.encode(prompt, add_special_tokens=False).ids
        return list(prompt)

    async def run(ids: list[int], params: SamplingParams, stops: list[str], on_token=None):
        """One request through the engine loop: (token ids, logprobs, text, finish_reason, output).
        on_token(text_delta, token_id, logprob) is awaited as tokens arrive (streaming)."""
        events: asyncio.Queue = asyncio.Queue()
        rid = await asyncio.wrap_future(loop.add(ids, params, events))
        tokens, logprobs, matcher = [], [], StopMatcher(stops)
        t_last = time.perf_counter()
        try:
            while True:
                item = await events.get()
                if isinstance(item, tuple) and item[0] == "done":   # ('done', GenerationOutput)
                    out = item[1]
                    metrics.finished(out)
                    reason = "stop" if matcher.stopped else out.finish_reason
                    matcher.update(engine.decode(tokens) or "")
                    tail = matcher.emit(final=True)
                    if on_token is not None:
                        await on_token(tail, None, None, reason)
                    return tokens, logprobs, matcher.text, reason, out
                now = time.perf_counter()
                (metrics.ttft.observe(now - t_last) if not tokens else metrics.itl.observe(now - t_last))
                t_last = now
                if matcher.stopped:
                    continue
                tokens.append(item.token_id)
                logprobs.append(item.logprob)
                if stops or on_token is not None:
                    matcher.update(engine.decode(tokens) or "")
                if matcher.stopped:
                    loop.abort(rid)                           # the rest is not wanted
                if on_token is not None and item.finish_reason is None and not matcher.stopped:
                    await on_token(matcher.emit(final=False), item.token_id, item.logprob, None)
        except asyncio.CancelledError:                        # the client went away
            loop.abort(rid)
            raise

    def check(ids: list[int], max_tokens: int, n: int):
        if len(ids) + max_tokens > cfg.max_position_embeddings:
            raise ServerInputError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                   f"context of {cfg.max_position_embeddings} tokens")
        if loop.in_flight() + n > max_queued:
            raise OverflowError

    async def until_disconnect(raw: Request, work):
        """Await work, cancelling it (which aborts its requests) if the client goes away first."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
        return task.result()

    async def respond(raw: Request, body: _Body, ids: list[int], kind: str, want_logprobs: bool,
                      echo_text: str = ""):
        max_tokens = body.max_tokens or max(1, cfg.max_position_embeddings - len(ids))
        check(ids, max_tokens, body.n)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        created, rid = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if body.stream:
            return StreamingResponse(stream(body, ids, max_tokens, stops, kind, rid, created, echo_text),
                                     media_type="text/event-stream")
        results = await until_disconnect(
            raw, asyncio.gather(*[run(ids, sampling(body, max_tokens, i), stops) for i in range(body.n)]))
        choices, completion, cached = [], 0, 0
        for i, (tokens, lps, text, reason, out) in enumerate(results):
            completion += len(tokens)
            cached = max(cached, out.cached_tokens)
            choice: dict[str, Any] = {"index": i, "finish_reason": _openai_reason(reason)}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = ({"content": [{"token": engine.decode([t]), "logprob": lp}
                                                   for t, lp in zip(tokens, lps)]} if want_logprobs else None)
            else:
                choice["text"] = echo_text + text
                choice["logprobs"] = ({"tokens": [engine.decode([t]) for t in tokens], "token_logprobs": lps,
                                       "top_logprobs": None} if want_logprobs else None)
            choices.append(choice)
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    async def stream(body, ids, max_tokens, stops, kind, rid, created, echo_text):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        out_q: asyncio.Queue = asyncio.Queue()

        def chunk(i, delta, reason):
            if kind == "chat":
                c = {"index": i, "delta": {"content": delta} if delta or reason is None else {},
                     "finish_reason": _openai_reason(reason)}
            else:
                c = {"index": i, "text": delta, "finish_reason": _openai_reason(reason)}
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [c]}

        async def one(i):
            async def on_token(delta, token_id, logprob, reason):
                if delta or reason is not None:
                    await out_q.put(chunk(i, delta, reason))
            await run(ids, sampling(body, max_tokens, i), stops, on_token)

        if kind == "chat":
            for i in range(body.n):
                yield _sse({"id": rid, "object": obj, "created": created, "model": model_name,
                            "choices": [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]})
        elif echo_text:
            for i in range(body.n):
                yield _sse(chunk(i, echo_text, None))
        tasks = [asyncio.create_task(one(i)) for i in range(body.n)]
        done = asyncio.gather(*tasks)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no "never retrieved" log
        getter = None
        try:
            while not (done.done() and out_q.empty()):
                getter = asyncio.ensure_future(out_q.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield _sse(getter.result())
                else:
                    getter.cancel()
            done.result()
            yield "data: [DONE]\n\n"
        finally:                                              # client gone (or finished): stop what runs
            for t in tasks:
                t.cancel()
            if getter is not None:
                getter.cancel()

    async def guarded(fn):
        try:
            return await fn()
        except OverflowError:
            return error_body(f"server busy: {max_queued} requests in flight", 503, "server_busy")
        except (ServerInputError, EngineInputError, SamplingError) as e:
            return error_body(str(e), 400)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, raw: Request):
        async def go():
            if body.logprobs and body.logprobs > 1:
                raise ServerInputError("logprobs > 1 (top alternatives) is not supported; use 0 or 1")
            if body.echo and body.logprobs is not None:
                raise ServerInputError("echo with logprobs (prompt logprobs) is not supported yet")
            ids = prompt_ids(body.prompt)
            echo = (engine.decode(ids) or "") if body.echo else ""
            return await respond(raw, body, ids, "text", body.logprobs is not None, echo)
        return await guarded(go)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, raw: Request):
        async def go():
            if template is None:
                raise ServerInputError("this model has no chat template (chat_template.jinja or "
                                       "tokenizer_config.json's chat_template); use /v1/completions")
            if body.top_logprobs:
                raise ServerInputError("top_logprobs > 0 is not supported; use logprobs alone")
            text = template.render(messages=[m.model_dump(exclude_none=True) for m in body.messages],
                                   add_generation_prompt=True, **special)
            return await respond(raw, body, prompt_ids(text), "chat", body.logprobs)
        return await guarded(go)

    return app


def _openai_reason(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(engine: Engine, *, host: str, port: int, model_name: str, model_dir, max_queued: int) -> None:
    import uvicorn
    app = create_app(engine, model_name=model_name, model_dir=model_dir, max_queued=max_queued)
    uvicorn.run(app, host=host, port=port, log_level="info")
