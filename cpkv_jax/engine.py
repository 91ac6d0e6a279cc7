"""The engine: requests in, tokens out. Owns the paged KV pool, the page allocator, the radix prefix
cache and the scheduler, and drives each step: the scheduler plans it, cpkv_jax.batch pads it into a
bucketed batch, the runner runs it, and the scheduler takes its sampled tokens (with speculative
decoding, cpkv_jax.spec runs the draft model and the verify rounds).

    engine = Engine("tiny", EngineConfig(kv_pages=256, page_size=16))
    outs = engine.generate(["Hello", [5, 6, 7]], SamplingParams(max_new_tokens=8))

Bucketing bounds the number of compilations by `max_compilations()` whatever the traffic.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.batch import BatchBuilder
from cpkv_jax.config import EngineConfig, EngineConfigError
from cpkv_jax.kv_pool import KVPool, PageAllocator, pages_for
from cpkv_jax.radix_cache import RadixCache
from cpkv_jax.runner import ModelRunner
from cpkv_jax.sampling import SamplingError, SamplingParams, position_logprobs
from cpkv_jax.scheduler import Chunk, Request, Scheduler, TokenEvent
from cpkv_jax.spec import Round, SpecDecoder
from cpkv_jax.stop import StopMatcher
from models.model import DsaModel
from models.sharding import CP, EP, TP


class EngineInputError(ValueError):
    """A request the engine cannot run (nothing else is affected)."""


TopLogprobs = list[tuple[int, float]]   # a token's most likely alternatives: (token id, log-probability), best first


@dataclasses.dataclass
class Launch:
    """A target step dispatched to the device whose sampled tokens the host has not taken yet."""
    chunks: list[Chunk]
    prefill: bool
    emits: list[bool]                # chunk i samples a token (not a middle prefill chunk)
    tokens: jax.Array                # [rows] sampled ids, on the device
    logprobs: jax.Array
    top: list                        # top-N alternatives (ids, log-probabilities) when asked for
    logits: jax.Array | np.ndarray | None   # [rows, V] for requests that capture their logits
    draft: tuple | None = None       # speculative decoding: (the step's batch, its hidden rows) for the draft extend


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]             # every sampled token (with stop strings: through the one that completed it)
    text: str | None                 # their text; cut before the first stop string when one matched
    finish_reason: str               # 'stop' (stop/eos token or stop string), 'length' (max_new_tokens) or 'abort'
    prompt_token_ids: list[int]
    cached_tokens: int               # prompt tokens served by the prefix cache
    logprobs: list[float] | None     # of each sampled token under the unmodified distribution
    timing: dict                     # ttft_s, latency_s, decode_tokens_per_s
    logits: list[np.ndarray] | None = None  # fp32 [vocab] per sampled token (return_logits=True)
    top_logprobs: list[TopLogprobs] | None = None         # per sampled token (params.top_logprobs > 0)
    prompt_logprobs: list[float | None] | None = None     # per prompt token, the first None (params.prompt_logprobs)
    prompt_top_logprobs: list[TopLogprobs | None] | None = None  # per prompt token, the first None

    def to_json(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "cached_tokens": self.cached_tokens, "logprobs": self.logprobs, "top_logprobs": self.top_logprobs,
                "prompt_logprobs": self.prompt_logprobs, "prompt_top_logprobs": self.prompt_top_logprobs,
                "timing": self.timing}


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    index: int                       # the output's position in generate's order (prompt i, sample j: i * n + j)
    token_id: int
    text: str                        # newly decided text ('' while a UTF-8 sequence is incomplete or the
                                     # end of the text could still begin a stop string)
    finish_reason: str | None


def _load_tokenizer(spec):
    """The tokenizer.json beside a model (a name such as 'tiny' / 'tiny-random', or a directory), or None."""
    from tokenizers import Tokenizer

    from models.weights import resolve_model_dir
    if isinstance(spec, DsaModel) or spec is None:
        return None
    path = resolve_model_dir(spec)
    f = path / "tokenizer.json"
    if not f.exists():
        return None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        from models.weights import CheckpointError
        raise CheckpointError(f"{f}: not a valid tokenizer.json ({e})") from None


def _generation_eos(spec) -> set[int]:
    """eos ids from generation_config.json beside the checkpoint (HF keeps the chat eos list there)."""
    from models.weights import resolve_model_dir
    if isinstance(spec, (str, Path)):
        f = resolve_model_dir(spec) / "generation_config.json"
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return set()


def _mesh(cp_size: int, ep_size: int, tp_size: int, model_config, devices=None):
    """The step's mesh: 'cp' over cp_size devices (the pool's pages split); with ep_size or tp_size > 1
    also 'ep' and 'tp': the routed experts split over both (ep x tp ways), the heads, MLP intermediate
    and vocabulary over 'tp'; attention and the pool replicated over 'ep', the latent pool over 'tp'
    (the table: models.sharding.RULES). None for one device,
    unless `devices` names them (a PD engine's own devices: cpkv_jax.pd). `model_config()` gives the
    model's config (read only when there is a mesh), whose counts each axis must divide."""
    if cp_size == ep_size == tp_size == 1 and devices is None:
        return None
    from jax.sharding import Mesh
    from cpkv_jax.memory_plan import split_error
    error = split_error(model_config(), ep_size * tp_size, tp_size, label=lambda axis, n: f"{axis}_size {n}",
                        expert_label=f"ep_size {ep_size} x tp_size {tp_size} = {ep_size * tp_size}" if tp_size > 1
                        else None)
    if error:
        raise EngineConfigError(error)
    n = cp_size * ep_size * tp_size
    devices = jax.devices() if devices is None else list(devices)
    if n > len(devices):
        raise EngineConfigError(f"cp_size {cp_size} x ep_size {ep_size} x tp_size {tp_size} needs {n} devices, "
                                f"{len(devices)} visible")
    if ep_size == tp_size == 1:
        return Mesh(np.array(devices[:cp_size]), (CP,))
    return Mesh(np.array(devices[:n]).reshape(cp_size, ep_size, tp_size), (CP, EP, TP))


def _side_stream_copier(config: EngineConfig):
    """The host tier's side-stream copier (cpkv_jax.hicache.side_stream), or None when its copies are jitted."""
    if not config.hicache_pages or config.hicache_copy == "jit":
        return None
    from cpkv_jax.hicache.side_stream import install
    copier = install()
    if copier is None and config.hicache_copy == "side_stream":
        raise EngineConfigError("hicache_copy='side_stream' needs a CUDA GPU backend and libcudart")
    return copier


LAUNCHES_PER_STEP = 3   # target steps one engine step may launch: prefill, prefill with prompt logprobs, decode


class Engine:
    def __init__(self, model: str | Path | DsaModel = "tiny", config: EngineConfig | None = None, *,
                 tokenizer=None, devices=None):
        """`devices`: the devices this engine's mesh is made of (default: the first of jax.devices());
        a PD engine (cpkv_jax.pd) gets its own."""
        from models.weights import load_model, model_config

        self.config = config = (config or EngineConfig()).validate()
        if config.pd_prefill_devices:
            raise EngineConfigError("pd_prefill_devices needs the disaggregated engine: cpkv_jax.pd.make_engine")
        # the mesh first, so a checkpoint is restored straight into its shards
        self.mesh = _mesh(config.cp_size, config.ep_size, config.tp_size,
                          lambda: model.cfg if isinstance(model, DsaModel) else model_config(model), devices)
        self.model = model if isinstance(model, DsaModel) else load_model(model, dtype=config.dtype, mesh=self.mesh)
        self.cfg = self.model.cfg
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model)
        self.eos_ids = frozenset(self.cfg.eos_token_id) | _generation_eos(model)
        ps = config.page_size
        speculative = config.speculative is not None
        if speculative and self.model.mtp is None:
            raise EngineConfigError("speculative='nextn' needs a model with an MTP layer "
                                    "(num_nextn_predict_layers >= 1)")
        self.pool = KVPool.create(self.cfg, config.kv_pages, ps, self.model.dtype, config.index_dtype,
                                  mesh=self.mesh, draft=speculative)
        copier = _side_stream_copier(config)
        self.allocator = PageAllocator(config.kv_pages, config.cp_size)
        # spec mode: bigram keys, since the draft KV at position i depends on token i+1
        self.radix = RadixCache(ps, bigram=speculative) if config.prefix_cache else None
        self.spec_tokens = config.num_draft_tokens if speculative else 0
        self.hicache = None
        if config.hicache_pages:
            from cpkv_jax.hicache import HiCache
            self.hicache = HiCache(self.pool, self.radix, config.hicache_pages, full_layers=self.cfg.full_layers,
                                   policy=config.hicache_policy, mesh=self.mesh, copier=copier)
        from models.moe import choose_ep_dispatch
        self.ep_dispatch = choose_ep_dispatch(config.ep_dispatch, config.ep_size * config.tp_size,
                                              self.cfg.num_experts_per_tok,
                                              self.cfg.hidden_size, jnp.dtype(self.model.dtype).itemsize)
        self.runner = ModelRunner(self.model, self.pool, mesh=self.mesh, copier=copier,
                                  step_copies=self.hicache.copies.take_step if copier is not None else None,
                                  kernels=config.kernels, ep_dispatch=self.ep_dispatch,
                                  micro_batches=2 if config.two_batch_overlap else 1)
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=ps, max_running=config.max_running,
                                   max_prefill_tokens=config.max_prefill_tokens, lookahead=self.spec_tokens,
                                   hicache=self.hicache)
        self.max_context = min(self.cfg.max_position_embeddings, self.allocator.capacity * ps)
        self.batch_builder = BatchBuilder(config, self.scheduler, self.max_context)
        self.spec_decoder = (SpecDecoder(self.runner, self.batch_builder, self.scheduler,
                                         num_draft_tokens=config.num_draft_tokens, attn_path=config.attn_path,
                                         token_rows=2 * LAUNCHES_PER_STEP * config.max_running)
                             if speculative else None)
        # the KV-integrity trace (cpkv_jax.trace), wired into the batch builder, runner and host tier
        self.tracer = None
        if config.kv_trace:
            from cpkv_jax.trace import Tracer
            self.tracer = Tracer.attach(self)
        # the overlapped loop: a step's sampled tokens (a round's results) are taken by the host during
        # the next step; with speculative decoding on one rank, where a round's chain runs on the device
        self.overlap = config.overlap and (self.spec_decoder is None or self.spec_decoder.fused_chain)
        self._in_flight: list[Launch | Round] = []
        self._taken_early: list[TokenEvent] = []     # taken by an abort between steps: the next step returns them
        # the device buffer of sampled tokens: per step parity, one region of max_running rows per launch
        # (prefill, prefill with prompt logprobs, decode), a step reading the previous step's regions
        # only; then speculative decoding's rows (SpecDecoder.rows: the draft chains' proposals, read
        # by the next round there, and each request's next round's first token and position)
        self.runner.hold_tokens(2 * LAUNCHES_PER_STEP * config.max_running
                                + SpecDecoder.rows(max(self.spec_tokens, 1), config.max_running))
        self._rids = itertools.count()
        self._requests: dict[int, Request] = {}
        # the events of requests an open stream() yields, whichever caller's step sampled them
        self._inboxes: dict[int, collections.deque[TokenEvent]] = {}
        self.metrics = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prefill_tokens": 0,
                        "decode_tokens": 0, "padded_lanes": 0, "prefill_s": 0.0, "decode_s": 0.0,
                        "spec_rounds": 0, "spec_request_rounds": 0, "spec_drafts": 0, "spec_accepted": 0}

    # ---- requests --------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineInputError("this model has no tokenizer.json: give prompts as token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, (list, tuple)) and not prompt:
            return []
        try:
            arr = np.asarray(prompt)
        except (ValueError, TypeError):   # ragged nesting
            arr = np.zeros((0, 0))
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise EngineInputError(f"a prompt must be a string or a flat sequence of integer token ids, "
                                   f"got {prompt!r:.80}")
        return [int(t) for t in arr]

    def decode(self, token_ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def validate(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the checked params, or the EngineInputError / SamplingError that
        add_request would raise (reads nothing that steps change: a server checks requests with it before
        it starts answering)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be a cpkv_jax.sampling.SamplingParams (or None), got "
                                f"{type(params).__name__}")
        params = (params or SamplingParams()).validate(self.cfg.vocab_size)
        ids = self.encode(prompt)
        V = self.cfg.vocab_size
        if not ids:
            raise EngineInputError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise EngineInputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {V})")
        if params.stop and self.tokenizer is None:
            raise EngineInputError("stop strings need the model's tokenizer.json (the text is matched); this "
                                   "model has none: use stop_token_ids")
        total = len(ids) + params.max_new_tokens + self.spec_tokens
        if total > self.cfg.max_position_embeddings:
            raise EngineInputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens})"
                                   + (f" + draft tokens ({self.spec_tokens})" if self.spec_tokens else "")
                                   + f" = {total} exceeds the model's context of {self.cfg.max_position_embeddings}")
        need = pages_for(total - 1, self.config.page_size)
        if need > self.allocator.capacity:
            raise EngineInputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                                   f"{need} KV pages of {self.config.page_size} tokens; the pool has "
                                   f"{self.allocator.capacity} (raise kv_pages)")
        return ids, params

    def add_request(self, prompt, params: SamplingParams | None = None, *, return_logits: bool = False,
                    stream_text: bool = False) -> int:
        """Validate and queue one request (one sample: n = 1); returns its id. Invalid input raises
        EngineInputError (or SamplingError) before anything is touched, so requests in flight are
        unaffected. `stream_text`: each TokenEvent carries the text its token decides."""
        ids, params = self.validate(prompt, params)
        if params.n != 1:
            raise SamplingError(f"add_request queues one sample, got n={params.n}: add each of params.samples()")
        return self._enqueue(ids, params, return_logits, stream_text)

    def _enqueue(self, ids: list[int], params: SamplingParams, return_logits: bool, stream_text: bool) -> int:
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        rid = next(self._rids)
        req = Request(rid, ids, params, stop, t_arrival=time.perf_counter(), logits=[] if return_logits else None)
        if self.tokenizer is not None and (params.stop or stream_text):
            req.text = StopMatcher(self.decode, params.stop)
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, rid: int) -> None:
        """Stop a request now; its pages are released (nothing of it enters the prefix cache). A token
        it sampled in the step in flight is taken first, so it keeps every token sampled before the
        abort (those events come with the next step's)."""
        req = self._requests.get(rid)
        if req is not None:
            self.abort_request(req)

    def abort_request(self, req: Request) -> None:
        """Abort one of this engine's requests (`abort`, or a PD engine's for a request it runs here)."""
        if req.pending:
            self._taken_early += self._take_in_flight()
        if req.finish_reason is None:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        """Whether stepping has more to do: requests to run, or events an abort took early (the last
        tokens of requests it finished) that only the next step returns."""
        return self.scheduler.has_work() or bool(self._taken_early)

    def finished(self, rid: int) -> bool:
        """Whether request `rid` (from add_request) has finished. `step` returns only its own step's
        events, so a caller sharing the engine with streams or generate calls (whose steps sample for
        its requests too) polls this instead of waiting for a finish event."""
        if rid not in self._requests:
            raise EngineInputError(f"no request {rid!r} (unknown, or its output was already taken)")
        return self._requests[rid].finish_reason is not None

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Admit what fits, run one prefill batch (chunks within the token budget) and one decode batch;
        returns the tokens sampled in this step (streams' tokens also wait in their own inboxes). With
        the overlapped loop (EngineConfig.overlap) this step's batches are dispatched first and the
        previous step's tokens are taken while they run: the events returned are the previous step's,
        and a decode lane whose token the host has not seen reads it on the device (with speculative
        decoding: a round's results, its first token, drafts and start read where the previous round
        left them; prefill steps are taken at once, their drafts with their tokens)."""
        if self.hicache is not None:
            self.hicache.poll()
        self.scheduler.admit()
        decode = self.scheduler.plan_decode()   # planned first: requests finishing prefill now decode next step
        prefill = self.scheduler.plan_prefill()
        events, self._taken_early = self._taken_early, []
        launched, lagged = [], []
        region = (self.metrics["steps"] % 2) * LAUNCHES_PER_STEP

        def run(chunks, prefill):
            launch = self._launch(chunks, prefill, region + len(launched))
            launched.append(launch)
            if self.overlap and self.spec_decoder is None:   # with speculative decoding the drafts come with the tokens
                lagged.append(launch)
                return []
            return self._take(launch)

        for every_position in (False, True):     # prompt logprobs: a forward with every position's logits
            chunks = [ch for ch in prefill if ch.req.params.prompt_logprobs == every_position]
            if chunks:
                events += run(chunks, prefill=True)
        if decode and self.spec_decoder is not None:
            rnd = self._spec_launch(decode)
            if self.overlap:
                lagged.append(rnd)
            else:
                events += self._spec_take(rnd)
        elif decode:
            events += run(decode, prefill=False)
        events += self._take_in_flight()
        self._in_flight = lagged
        self.metrics["steps"] += 1
        self._file(events)
        return events

    def _take_in_flight(self) -> list[TokenEvent]:
        in_flight, self._in_flight = self._in_flight, []
        return [ev for x in in_flight for ev in (self._spec_take(x) if isinstance(x, Round) else self._take(x))]

    def _file(self, events: list[TokenEvent]) -> None:
        """Put each event in the inbox of the stream that owns its request, if one does."""
        for ev in events:
            inbox = self._inboxes.get(ev.rid)
            if inbox is not None:
                inbox.append(ev)

    def max_compilations(self) -> int:
        """Upper bound on compiled step and sampler variants (cpkv_jax.batch.BatchBuilder.max_compilations)."""
        return self.batch_builder.max_compilations(speculative=self.spec_decoder is not None,
                                                   hooked=self.runner.copier is not None)

    def compilations(self) -> int:
        """Distinct compiled variants this engine has used (step shapes + sampler batch sizes)."""
        return self.runner.compilations + len(self.batch_builder.sampler_variants)

    def _launch(self, chunks: list[Chunk], prefill: bool, region: int) -> Launch:
        """Dispatch one target step over the chunks: build the padded batch, run it and sample each
        request's next token, keeping the tokens on the device (in region `region` of the buffer the
        next step reads them from) for `_take`. A prefill step of requests that want prompt logprobs has
        the forward return every position's logits, records them and takes its sampled tokens' logits
        from them."""
        t0 = time.perf_counter()
        step = self.batch_builder.build(chunks, prefill)
        if self.hicache is not None:
            self.hicache.stage_backups([(ch.req.host_res, ch.req.pages, ch.start + len(ch.tokens)) for ch in chunks])
        every_position = prefill and chunks[0].req.params.prompt_logprobs
        output = ("logits" if every_position else "last_logits") + ("" if self.spec_decoder is None else "_hidden")
        reqs = [ch.req for ch in chunks]
        top_n = self.batch_builder.top_logprobs_width(reqs)
        position = np.zeros(step.rows, np.int32)   # of the token being sampled
        position[:len(chunks)] = [ch.start + len(ch.tokens) for ch in chunks]
        first = region * self.config.max_running
        params = self.batch_builder.sampling("sample", reqs, step.rows, top_n)
        # the common step samples inside its own executable; prompt logprobs, alternatives and the
        # draft model's hidden rows take the separate sampler
        fused = output == "last_logits" and top_n == 0
        out = self.runner.forward(step.batch, step.last_lane, attn_path=self.config.attn_path, output=output,
                                  last_rank=step.last_rank, page_aligned=step.plan.page_aligned,
                                  sample=(first, params, position) if fused else None)
        if fused:
            logits, (toks, lps, *_) = out
            top, hidden = [], None
        else:
            logits, hidden = (out, None) if self.spec_decoder is None else out
            if every_position:
                logits = self._prompt_logprobs(chunks, step, logits, top_n)
            toks, lps, *top = self.runner.sample(first, logits, *params, position, top_n=top_n)
        n_tok = sum(len(ch.tokens) for ch in chunks)
        self.metrics["prefill_steps" if prefill else "decode_steps"] += 1
        self.metrics["prefill_tokens" if prefill else "decode_tokens"] += n_tok
        self.metrics["padded_lanes"] += step.batch.tokens.size - n_tok   # every rank's lanes under CP

        for ch in chunks:
            ch.req.computed = ch.start + len(ch.tokens)
        # a middle chunk emits nothing: its logits are not a prediction anyone asked for
        emits = [not r.prefilling for r in reqs]
        for i, r in enumerate(reqs):
            if emits[i]:
                r.pending, r.token_slot = r.pending + 1, first + i
            if prefill and emits[i]:
                self.scheduler.prefill_done(r)   # now, as the loop without overlap does before admitting more
        keep_logits = logits if any(r.logits is not None for r in reqs) else None
        self.metrics["prefill_s" if prefill else "decode_s"] += time.perf_counter() - t0
        return Launch(chunks, prefill, emits, toks, lps, top if top_n else [], keep_logits,
                      None if self.spec_decoder is None else (step, hidden))

    def _take(self, launch: Launch) -> list[TokenEvent]:
        """Bring a launched step's tokens to the host (the one device-to-host read of a step) and hand
        them to the scheduler; a request that finished or was aborted since the launch drops its token
        (its KV write landed in pages it held then). With speculative decoding the draft extend runs
        over the same lanes before the scheduler releases anything."""
        t0 = time.perf_counter()
        toks, lps = np.asarray(launch.tokens), np.asarray(launch.logprobs)
        host_logits = None if launch.logits is None else np.asarray(launch.logits)
        emitted = []
        for i, ch in enumerate(launch.chunks):
            ch.req.pending -= launch.emits[i]
            emitted.append([toks[i]] if launch.emits[i] and ch.req.finish_reason is None else [])
        draft = None
        if launch.draft is not None:
            step, hidden = launch.draft
            draft = lambda taken: self.spec_decoder.extend(launch.chunks, step.plan, step.requests, hidden)
        events = self.scheduler.complete_step(launch.chunks, emitted, lps[:, None], host_logits,
                                              top=[np.asarray(x) for x in launch.top] if launch.top else None,
                                              before_release=draft)
        self.metrics["prefill_s" if launch.prefill else "decode_s"] += time.perf_counter() - t0
        return events

    def _prompt_logprobs(self, chunks: list[Chunk], step, logits, top_n: int):
        """From a prefill step's every-position logits ([B, T, V]; under CP [cp, B, T, V]): record each
        chunk's prompt-token log-probabilities (position p predicts prompt token p + 1; the prompt's last
        position predicts the sampled token, which the sampler covers) and return each request's
        last-token logits [B, V] for the sampler."""
        B, T = step.rows, logits.shape[-2]
        L = T * (logits.shape[0] if logits.ndim == 4 else 1)    # a request's lanes over every rank
        rank, lane, targets = (np.zeros((B, L), np.int32) for _ in range(3))
        counts = []
        for b, ch in enumerate(chunks):
            prompt = ch.req.prompt
            k = max(0, min(len(ch.tokens), len(prompt) - 1 - ch.start))
            rank[b, :len(ch.tokens)], lane[b, :len(ch.tokens)] = step.plan.lanes(b)
            targets[b, :k] = prompt[ch.start + 1:ch.start + 1 + k]
            counts.append(k)
        self.batch_builder.sampler_variants.add(("prompt", B, T, top_n))
        lps, top_ids, top_lps = (np.asarray(x) for x in position_logprobs(
            logits, jnp.asarray(rank), jnp.asarray(lane), jnp.asarray(targets), top_n=top_n))
        for b, (ch, k) in enumerate(zip(chunks, counts)):
            req, n = ch.req, ch.req.params.top_logprobs
            req.prompt_logprobs.extend(lps[b, :k].tolist())
            if n:
                req.prompt_top_logprobs.extend(tuple(zip(i[:n].tolist(), v[:n].tolist()))
                                               for i, v in zip(top_ids[b, :k], top_lps[b, :k]))
        rows = np.arange(B)
        if logits.ndim == 3:
            return logits[rows, step.last_lane]
        return logits[step.last_rank, rows, step.last_lane]

    def _spec_launch(self, chunks: list[Chunk]) -> Round:
        """A decode step as a speculative verify round (cpkv_jax.spec), dispatched."""
        t0 = time.perf_counter()
        rnd = self.spec_decoder.launch([ch.req for ch in chunks])
        self.metrics["decode_s"] += time.perf_counter() - t0
        return rnd

    def _spec_take(self, rnd: Round) -> list[TokenEvent]:
        """A round's tokens, and its acceptance counts."""
        t0 = time.perf_counter()
        events = self.spec_decoder.take(rnd)
        took = len({ev.rid for ev in events})     # each request emits its accepted drafts and one more
        m = self.metrics
        m["spec_accepted"] += len(events) - took
        m["spec_rounds"] += 1
        m["spec_request_rounds"] += took
        m["spec_drafts"] += self.spec_decoder.num_draft_tokens * took
        m["decode_steps"] += 1
        m["decode_tokens"] += len(events)
        m["decode_s"] += time.perf_counter() - t0
        return events

    # ---- results ---------------------------------------------------------------------------------
    def output(self, rid: int) -> GenerationOutput:
        """The result of a finished request (its bookkeeping is dropped)."""
        if rid not in self._requests:
            raise EngineInputError(f"no request {rid!r} (unknown, or its output was already taken)")
        req = self._requests.pop(rid)
        if req.finish_reason is None:
            self._requests[rid] = req
            raise EngineInputError(f"request {rid} has not finished")
        timing = {"ttft_s": None if req.t_first_token is None else req.t_first_token - req.t_arrival,
                  "latency_s": req.t_finish - req.t_arrival,
                  "decode_tokens_per_s": ((len(req.output) - 1) / (req.t_finish - req.t_first_token)
                                          if len(req.output) > 1 and req.t_finish > req.t_first_token else None)}
        p = req.params
        return GenerationOutput(
            token_ids=list(req.output), text=self.decode(req.output) if req.text is None else req.text.final_text(),
            finish_reason=req.finish_reason, prompt_token_ids=list(req.prompt), cached_tokens=req.cached_tokens,
            logprobs=list(req.logprobs) if p.logprobs else None, timing=timing, logits=req.logits,
            top_logprobs=[list(a) for a in req.top_logprobs] if p.logprobs and p.top_logprobs else None,
            prompt_logprobs=[None] + list(req.prompt_logprobs) if p.prompt_logprobs else None,
            prompt_top_logprobs=([None] + [list(a) for a in req.prompt_top_logprobs]
                                 if p.prompt_logprobs and p.top_logprobs else None))

    def _add_all(self, prompts, params, return_logits: bool, stream_text: bool = False) -> list[int]:
        """Validate every prompt first, so a bad one queues nothing; a prompt whose params ask for n
        samples queues n requests (params.samples()), consecutive in the returned ids."""
        if not isinstance(prompts, (list, tuple, str)):
            raise EngineInputError(f"prompts must be a list of prompts (strings or token id lists), got "
                                   f"{type(prompts).__name__}")
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise EngineInputError("generate takes a list of prompts (strings or token id lists); wrap a "
                                   "single prompt in a list")
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise EngineInputError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        checked = [self.validate(p, sp) for p, sp in zip(prompts, plist)]
        return [self._enqueue(ids, one, return_logits, stream_text) for ids, sp in checked for one in sp.samples()]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Run prompts (strings or token id lists) to completion, batched continuously with anything
        else in flight; outputs in prompt order (params.n > 1: n consecutive outputs per prompt, seeds
        seed, seed + 1, ...)."""
        rids = self._add_all(prompts, params, return_logits)
        reqs = [self._requests[r] for r in rids]
        while any(r.finish_reason is None for r in reqs):   # steps made by others count too
            self.step()
        if self.hicache is not None:
            self.hicache.settle()   # backups still in flight become visible before returning
        return [self.output(r) for r in rids]

    def stream(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Like generate, yielding each token as it is sampled (with its new text: the concatenation is
        generate's text, stop strings cut alike). Streams and generate calls interleave
        freely on one engine: a step samples for everything in flight, and each stream's events wait
        in its own inbox until it asks. Closing (or dropping) the iterator early aborts the requests
        still running."""
        rids = self._add_all(prompts, params, False, stream_text=True)
        index = {r: i for i, r in enumerate(rids)}
        pending = set(rids)
        inbox: collections.deque[TokenEvent] = collections.deque()
        for r in rids:
            self._inboxes[r] = inbox
        try:
            while pending:
                if not inbox:
                    self.step()   # another stream's or generate's steps may have filled the inbox already
                    continue
                ev = inbox.popleft()
                if ev.finish_reason is not None:
                    pending.discard(ev.rid)
                    self._inboxes.pop(ev.rid, None)
                    self._requests.pop(ev.rid, None)
                yield StreamEvent(index[ev.rid], ev.token_id, ev.text, ev.finish_reason)
        finally:
            for r in pending:
                self._inboxes.pop(r, None)
                self.abort(r)
                self._requests.pop(r, None)

    # ---- inspection ------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler.stats()
        s.update(self.metrics)
        s["compilations"] = self.compilations()
        if self.spec_decoder is not None and self.metrics["spec_request_rounds"]:
            rr = self.metrics["spec_request_rounds"]
            s["spec_acceptance_length"] = (self.metrics["spec_accepted"] + rr) / rr  # tokens per request per round
            s["spec_accept_rate"] = self.metrics["spec_accepted"] / self.metrics["spec_drafts"]
        s["pool_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.pool.cache)))
        return s
