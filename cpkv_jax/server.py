"""OpenAI-compatible HTTP server on FastAPI + uvicorn: /v1/completions, /v1/chat/completions (SSE
streaming when asked), /v1/models, /health and /metrics (Prometheus).

The engine is not thread-safe, so it lives on one thread (`EngineLoop`): HTTP handlers send it
commands through a queue (add a request, abort one) and receive their request's token events on an
asyncio queue. A client that goes away has its request aborted and its pages freed; past `max_queued`
requests in flight the server answers 503; a bad request is a 400 with an OpenAI-style error body.
Stop strings, `n` (seeds seed, seed + 1, ...), top-N logprobs and prompt logprobs are the engine's
(SamplingParams): the engine decodes each request's text as it goes and ends it at a stop string.
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
from cpkv_jax.sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingParams


class ServerInputError(ValueError):
    """A request the server refuses (400)."""


# ---- the engine thread ---------------------------------------------------------------------------

class EngineLoop:
    """Owns the engine on one thread. `add` returns a request id (or raises the engine's input error);
    the request's TokenEvents, then ('done', GenerationOutput), arrive on the asyncio queue given."""

    def __init__(self, engine: Engine, metrics: "ServerMetrics | None" = None):
        import jax
        self.engine = engine
        self.metrics = metrics
        # a multi-process run: the other processes apply the same commands (cpkv_jax.distributed.follow)
        self.replicated = jax.process_count() > 1
        self.commands: queue.Queue = queue.Queue()
        self.subscribers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.aborted = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpkv-engine", daemon=True)
        self.thread.start()

    async def add(self, ids: list[int], params: SamplingParams, events: asyncio.Queue) -> int:
        """Queue a request; its id once the engine thread has added it. Cancelled before then (the
        client left), the request is never added, or is aborted as soon as it has an id."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("add", ids, params, asyncio.get_running_loop(), events, fut))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise

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
            if not loop.is_closed():            # a subscriber whose event loop has ended hears nothing
                loop.call_soon_threadsafe(events.put_nowait, item)

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, ids, params, loop, events, fut = cmd
            try:
                rid = self.engine.add_request(ids, params, stream_text=True)
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
                if self.metrics is not None:      # its pages are back without a step
                    self.metrics.observe_engine(self.engine)

    def _drain(self) -> list:
        """The queued commands, less adds whose client left first (their futures cancelled). An add
        kept is marked running, so it can no longer be cancelled: its id will come back."""
        cmds = []
        try:
            cmds.append(self.commands.get(timeout=0.0 if self.engine.has_unfinished() else 0.02))
            while True:
                cmds.append(self.commands.get_nowait())
        except queue.Empty:
            return [c for c in cmds if c[0] != "add" or c[5].set_running_or_notify_cancel()]

    def _run(self) -> None:
        from cpkv_jax.distributed import broadcast_object, portable
        eng = self.engine
        while not self._stop.is_set():
            cmds = self._drain()
            if self.replicated:
                broadcast_object([portable(c) for c in cmds])
            for cmd in cmds:
                self._command(cmd)
            if not eng.has_unfinished():
                continue
            events = eng.step()
            for ev in events:
                self._deliver(ev.rid, ev)
                if ev.finish_reason is not None and ev.rid in self.subscribers:
                    self._deliver(ev.rid, ("done", eng.output(ev.rid)))
                    self.subscribers.pop(ev.rid)
            if self.metrics is not None:
                self.metrics.observe_engine(eng)
        if self.replicated:
            broadcast_object([("stop",)])


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

    def observe_engine(self, eng: Engine) -> None:
        """The gauges from the engine's stats (after each step and each abort)."""
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
    logprobs: int | None = Field(default=None, ge=0, le=5)     # OpenAI's limit for completions
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


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

    def sampling(body: _Body, max_tokens: int, top_logprobs: int = 0, prompt_logprobs: bool = False):
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed or 0, stop_token_ids=tuple(body.stop_token_ids),
                              ignore_eos=body.ignore_eos, logprobs=True, stop=tuple(stops), n=body.n,
                              top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)

    def token_text(token_id: int) -> str:
        """A token as the logprobs show it (special tokens by name, as the text never shows them)."""
        if engine.tokenizer is None:
            return f"token_id:{token_id}"
        return engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(ids, logprobs, alternatives) -> dict:
        """The completions API's logprobs of tokens `ids` (alternatives: None when not asked for)."""
        return {"tokens": [token_text(t) for t in ids], "token_logprobs": logprobs,
                "top_logprobs": None if alternatives is None else [
                    None if a is None else {token_text(t): lp for t, lp in a} for a in alternatives]}

    def chat_logprobs(ids, logprobs, alternatives) -> dict:
        """The chat API's logprobs: one entry per token with its top alternatives."""
        return {"content": [{"token": token_text(t), "logprob": lp,
                             "top_logprobs": [{"token": token_text(i), "logprob": v} for i, v in a or ()]}
                            for t, lp, a in zip(ids, logprobs, alternatives or [None] * len(ids))]}

    async def run(ids: list[int], params: SamplingParams, on_token=None):
        """One request (one sample) through the engine loop; returns its GenerationOutput. on_token(event)
        is awaited for each TokenEvent as it arrives (streaming)."""
        events: asyncio.Queue = asyncio.Queue()
        rid = await loop.add(ids, params, events)
        t_last, first = time.perf_counter(), True
        try:
            while True:
                item = await events.get()
                if isinstance(item, tuple):                   # ('done', GenerationOutput)
                    metrics.finished(item[1])
                    return item[1]
                now = time.perf_counter()
                (metrics.ttft if first else metrics.itl).observe(now - t_last)
                t_last, first = now, False
                if on_token is not None:
                    await on_token(item)
        except asyncio.CancelledError:                        # the client went away
            loop.abort(rid)
            raise

    async def until_disconnect(raw: Request, work):
        """Await work, cancelling it (which aborts its requests) if the client goes away first."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
        return task.result()

    async def respond(raw: Request, body: _Body, prompt, kind: str, want_logprobs: bool,
                      top_logprobs: int = 0, echo: bool = False):
        """Check the request (400 before anything runs or streams), then answer it: its n samples as one
        response, or as SSE chunks. prompt: text or token ids."""
        ids = engine.encode(prompt)
        max_tokens = body.max_tokens or max(1, cfg.max_position_embeddings - len(ids))
        ids, params = engine.validate(ids, sampling(body, max_tokens, top_logprobs, echo and want_logprobs))
        if loop.in_flight() + body.n > max_queued:
            raise OverflowError
        created, rid = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        echo_text = (engine.decode(ids) or "") if echo else ""
        if body.stream:
            return StreamingResponse(stream(ids, params, kind, rid, created, echo_text, want_logprobs),
                                     media_type="text/event-stream")
        outs = await until_disconnect(raw, asyncio.gather(*[run(ids, p) for p in params.samples()]))
        choices = []
        for i, out in enumerate(outs):
            choice: dict[str, Any] = {"index": i, "finish_reason": _openai_reason(out.finish_reason)}
            text = out.text or ""
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = (chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs)
                                      if want_logprobs else None)
            else:
                choice["text"] = echo_text + text
                choice["logprobs"] = None
                if want_logprobs and echo:                    # the prompt's tokens first (the first has none)
                    choice["logprobs"] = completion_logprobs(
                        ids + out.token_ids, out.prompt_logprobs + out.logprobs,
                        None if not top_logprobs else out.prompt_top_logprobs + out.top_logprobs)
                elif want_logprobs:
                    choice["logprobs"] = completion_logprobs(out.token_ids, out.logprobs, out.top_logprobs)
            choices.append(choice)
        completion = sum(len(out.token_ids) for out in outs)
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion,
                          "prompt_tokens_details": {"cached_tokens": max(out.cached_tokens for out in outs)}}}

    async def stream(ids, params, kind, rid, created, echo_text, want_logprobs):
        """SSE chunks of the n samples as their tokens come (one chunk per token that decides text, or
        per token when logprobs are asked for), then [DONE]."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        out_q: asyncio.Queue = asyncio.Queue()

        def chunk(i, delta, reason, ev=None):
            if kind == "chat":
                c = {"index": i, "delta": {"content": delta} if delta or reason is None else {},
                     "finish_reason": _openai_reason(reason)}
            else:
                c = {"index": i, "text": delta, "finish_reason": _openai_reason(reason)}
            if want_logprobs and ev is not None and ev.token_id >= 0:   # -1: ended without a token (PD abort)
                alternatives = [ev.top_logprobs] if params.top_logprobs else None
                c["logprobs"] = (chat_logprobs if kind == "chat" else completion_logprobs)(
                    [ev.token_id], [ev.logprob], alternatives)
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [c]}

        async def one(i, sample):
            async def on_token(ev):
                if ev.text or ev.finish_reason is not None or want_logprobs:
                    await out_q.put(chunk(i, ev.text, ev.finish_reason, ev))
            await run(ids, sample, on_token)

        samples = params.samples()
        if kind == "chat":
            for i in range(len(samples)):
                yield _sse({"id": rid, "object": obj, "created": created, "model": model_name,
                            "choices": [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]})
        elif echo_text:
            for i in range(len(samples)):
                yield _sse(chunk(i, echo_text, None))
        tasks = [asyncio.create_task(one(i, sample)) for i, sample in enumerate(samples)]
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
            if body.echo and body.logprobs is not None and body.stream:
                raise ServerInputError("echo with logprobs (prompt logprobs) is not supported with stream; "
                                       "send stream: false")
            return await respond(raw, body, body.prompt, "text", body.logprobs is not None, body.logprobs or 0,
                                 body.echo)
        return await guarded(go)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, raw: Request):
        async def go():
            if template is None:
                raise ServerInputError("this model has no chat template (chat_template.jinja or "
                                       "tokenizer_config.json's chat_template); use /v1/completions")
            if body.top_logprobs and not body.logprobs:
                raise ServerInputError("top_logprobs needs logprobs: true")
            text = template.render(messages=[m.model_dump(exclude_none=True) for m in body.messages],
                                   add_generation_prompt=True, **special)
            return await respond(raw, body, text, "chat", body.logprobs, body.top_logprobs or 0)
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
