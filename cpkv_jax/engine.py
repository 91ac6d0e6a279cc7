"""The engine: requests in, tokens out. Owns the paged KV pool, the page allocator, the radix prefix
cache and the scheduler, and drives the jitted step (cpkv_jax.runner) over padded, bucketed batches.

    engine = Engine("tiny", EngineConfig(kv_pages=256, page_size=16))
    outs = engine.generate(["Hello", [5, 6, 7]], SamplingParams(max_new_tokens=8))

Every step pads its batch to a (requests, tokens, key-width) bucket drawn from small power-of-two
sets, so the number of compilations is bounded by `max_compilations()` whatever the traffic.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.cp import CPPlan, CPRequest, build_batch as build_cp_batch, plan as cp_plan
from cpkv_jax.kv_pool import KVPool, PageAllocator
from cpkv_jax.radix_cache import RadixCache
from cpkv_jax.runner import ModelRunner, choose_attn_path
from cpkv_jax.sampling import SamplingParams, sample_tokens
from cpkv_jax.scheduler import Chunk, Request, Scheduler, pages_for
from models.model import DsaModel


class EngineConfigError(ValueError):
    """An invalid or inconsistent EngineConfig."""


class EngineInputError(ValueError):
    """A request the engine cannot run (nothing else is affected)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 64              # tokens per KV page
    kv_pages: int = 256              # device pool size in pages (page 0 is the dummy)
    max_running: int = 32            # requests decoding/prefilling at once (decode batch bucket cap)
    max_prefill_tokens: int = 1024   # prefill token budget per step (chunked prefill)
    prefix_cache: bool = True        # radix prefix cache over finished and prefilled requests
    dtype: str | None = None         # compute dtype; None -> the checkpoint's
    index_dtype: str = "fp8"         # indexer key cache: 'fp8' (e4m3 + per-token fp32 scale) or 'same'
    attn_path: str | None = None     # force 'expanded' / 'absorbed'; None -> by tokens per request
    min_prefill_lanes: int = 16      # smallest prefill token bucket
    cp_size: int = 1                 # context-parallel ranks (mesh axis 'cp'); the pool's pages are split over them
    cp_mode: str = "zigzag"          # 'zigzag' (page-aligned) or 'round_robin'
    cp_short_policy: str = "owner"   # requests with < 2*cp new pages: 'owner' (page-aligned) or 'token_balanced'

    def validate(self) -> "EngineConfig":
        def positive(name, minimum=1):
            v = getattr(self, name)
            if not isinstance(v, int) or v < minimum:
                raise EngineConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")
        positive("page_size")
        positive("kv_pages", 2)
        positive("max_running")
        positive("max_prefill_tokens")
        positive("min_prefill_lanes")
        if self.index_dtype not in ("fp8", "same", "bfloat16", "float32"):
            raise EngineConfigError(f"index_dtype must be 'fp8', 'same', 'bfloat16' or 'float32', "
                                    f"got {self.index_dtype!r}")
        if self.attn_path not in (None, "expanded", "absorbed"):
            raise EngineConfigError(f"attn_path must be None, 'expanded' or 'absorbed', got {self.attn_path!r}")
        positive("cp_size")
        from cpkv_jax.cp import MODES, SHORT_POLICIES
        if self.cp_mode not in MODES:
            raise EngineConfigError(f"cp_mode must be one of {MODES}, got {self.cp_mode!r}")
        if self.cp_short_policy not in SHORT_POLICIES:
            raise EngineConfigError(f"cp_short_policy must be one of {SHORT_POLICIES}, got {self.cp_short_policy!r}")
        if self.kv_pages % self.cp_size or self.kv_pages // self.cp_size < 2:
            raise EngineConfigError(f"kv_pages ({self.kv_pages}) must be a multiple of cp_size ({self.cp_size}) "
                                    f"with at least 2 pages per rank (each rank keeps a dummy page)")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise EngineConfigError(f"dtype must be None, 'float32' or 'bfloat16', got {self.dtype!r}")
        return self


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str               # 'stop' (stop/eos token), 'length' (max_new_tokens) or 'abort'
    prompt_token_ids: list[int]
    cached_tokens: int               # prompt tokens served by the prefix cache
    logprobs: list[float] | None     # of each sampled token under the unmodified distribution
    timing: dict                     # ttft_s, latency_s, decode_tokens_per_s
    logits: list[np.ndarray] | None = None  # fp32 [vocab] per sampled token (return_logits=True)

    def to_json(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "cached_tokens": self.cached_tokens, "logprobs": self.logprobs, "timing": self.timing}


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    rid: int
    token_id: int
    logprob: float
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    index: int                       # position of the request in the prompts given to stream()
    token_id: int
    text: str                        # newly decodable text ('' while a UTF-8 sequence is incomplete)
    finish_reason: str | None


def bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n, clamped to [lo, hi] (hi itself is a bucket)."""
    return min(hi, max(lo, 1 << max(0, n - 1).bit_length()))


def bucket_set(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def _load_tokenizer(spec):
    from tokenizers import Tokenizer

    from models.weights import tiny_checkpoint
    if isinstance(spec, DsaModel) or spec is None:
        return None
    path = tiny_checkpoint() if spec == "tiny" else Path(spec)
    f = path / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.exists() else None


def _generation_eos(spec) -> set[int]:
    """eos ids from generation_config.json beside the checkpoint (HF keeps the chat eos list there)."""
    if isinstance(spec, (str, Path)) and spec != "tiny":
        f = Path(spec) / "generation_config.json"
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return set()


class Engine:
    def __init__(self, model: str | Path | DsaModel = "tiny", config: EngineConfig | None = None, *,
                 tokenizer=None):
        from models.weights import load_model

        self.config = config = (config or EngineConfig()).validate()
        self.model = model if isinstance(model, DsaModel) else load_model(model, dtype=config.dtype)
        self.cfg = self.model.cfg
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model)
        self.eos_ids = frozenset(self.cfg.eos_token_id) | _generation_eos(model)
        ps = config.page_size
        self.mesh = None
        if config.cp_size > 1:
            from jax.sharding import Mesh
            if config.cp_size > len(jax.devices()):
                raise EngineConfigError(f"cp_size {config.cp_size} needs {config.cp_size} devices, "
                                        f"{len(jax.devices())} visible")
            self.mesh = Mesh(np.array(jax.devices()[:config.cp_size]), ("cp",))
        self.pool = KVPool.create(self.cfg, config.kv_pages, ps, self.model.dtype, config.index_dtype,
                                  mesh=self.mesh)
        self.runner = ModelRunner(self.model, self.pool, mesh=self.mesh)
        self.allocator = PageAllocator(config.kv_pages, config.cp_size)
        self.radix = RadixCache(ps) if config.prefix_cache else None
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=ps, max_running=config.max_running,
                                   max_prefill_tokens=config.max_prefill_tokens)
        self.max_context = min(self.cfg.max_position_embeddings, self.allocator.capacity * ps)
        self._rids = itertools.count()
        self._requests: dict[int, Request] = {}
        self._capture_logits: dict[int, list[np.ndarray]] = {}
        self._sampler_batches: set[int] = set()
        self.metrics = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prefill_tokens": 0,
                        "decode_tokens": 0, "padded_lanes": 0, "prefill_s": 0.0, "decode_s": 0.0}

    # ---- requests --------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineInputError("this model has no tokenizer.json: give prompts as token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, (list, tuple)) and not prompt:
            return []
        arr = np.asarray(prompt)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise EngineInputError(f"a prompt must be a string or a flat sequence of integer token ids, "
                                   f"got {prompt!r:.80}")
        return [int(t) for t in arr]

    def decode(self, token_ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _validate(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        params = (params or SamplingParams()).validate(self.cfg.vocab_size)
        ids = self.encode(prompt)
        V = self.cfg.vocab_size
        if not ids:
            raise EngineInputError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise EngineInputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {V})")
        total = len(ids) + params.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise EngineInputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                                   f"{total} exceeds the model's context of {self.cfg.max_position_embeddings}")
        need = pages_for(total - 1, self.config.page_size)
        if need > self.allocator.capacity:
            raise EngineInputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                                   f"{need} KV pages of {self.config.page_size} tokens; the pool has "
                                   f"{self.allocator.capacity} (raise kv_pages)")
        return ids, params

    def add_request(self, prompt, params: SamplingParams | None = None, *, return_logits: bool = False) -> int:
        """Validate and queue one request; returns its id. Invalid input raises EngineInputError (or
        SamplingError) before anything is touched, so requests in flight are unaffected."""
        return self._enqueue(*self._validate(prompt, params), return_logits)

    def _enqueue(self, ids: list[int], params: SamplingParams, return_logits: bool) -> int:
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        rid = next(self._rids)
        req = Request(rid, ids, params, stop, t_arrival=time.perf_counter())
        self._requests[rid] = req
        if return_logits:
            self._capture_logits[rid] = []
        self.scheduler.add(req)
        return rid

    def abort(self, rid: int) -> None:
        """Stop a request now; its pages are released (nothing of it enters the prefix cache)."""
        req = self._requests.get(rid)
        if req is not None and req.finish_reason is None:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Admit what fits, run one prefill batch (chunks within the token budget) and one decode batch;
        returns the tokens sampled in this step."""
        self.scheduler.admit()
        decode = self.scheduler.plan_decode()   # planned first: requests finishing prefill now decode next step
        prefill = self.scheduler.plan_prefill()
        events = []
        if prefill:
            events += self._run(prefill, prefill=True)
        if decode:
            events += self._run(decode, prefill=False)
        self.metrics["steps"] += 1
        return events

    def max_compilations(self) -> int:
        """Upper bound on compiled step variants (prefill B x T x S buckets, decode B x S; twice that
        under CP, where a plan is page-aligned or not) plus the sampler's B buckets."""
        c = self.config
        nB = len(bucket_set(1, c.max_running))
        nT = len(bucket_set(min(c.min_prefill_lanes, c.max_prefill_tokens), c.max_prefill_tokens))
        nS = len(bucket_set(1, pages_for(self.max_context, c.page_size)))
        return (nB * nT * nS + nB * nS) * (2 if c.cp_size > 1 else 1) + nB

    def compilations(self) -> int:
        """Distinct compiled variants this engine has used (step shapes + sampler batch sizes)."""
        return self.runner.compilations + len(self._sampler_batches)

    def _plan(self, chunks: list[Chunk]) -> tuple[CPPlan, list[CPRequest]]:
        """Split the step's tokens over the CP ranks (one rank: all on rank 0) and allocate the pages
        the chunks reach, from the ranks the plan names."""
        ps = self.config.page_size
        reqs = []
        for ch in chunks:
            head = ch.start % ps != 0
            if len(ch.req.pages) != ch.start // ps + head:
                raise AssertionError(f"request {ch.req.rid}: {len(ch.req.pages)} pages at position {ch.start}")
            reqs.append(CPRequest(ch.start, len(ch.tokens),
                                  int(self.allocator.owner(ch.req.pages[-1])) if head else None))
        plan = cp_plan(reqs, ps, self.config.cp_size, self.allocator.free_per_rank(), mode=self.config.cp_mode,
                       short_policy=self.config.cp_short_policy)
        for ch, owners in zip(chunks, plan.new_page_owner):
            self.scheduler.allocate(ch.req, owners)
        return plan, reqs

    def _run(self, chunks: list[Chunk], prefill: bool) -> list[TokenEvent]:
        t0 = time.perf_counter()
        c = self.config
        plan, reqs = self._plan(chunks)
        B = bucket(len(chunks), 1, c.max_running)
        longest = int(plan.local_lengths.max())
        T = bucket(longest, c.min_prefill_lanes, c.max_prefill_tokens) if prefill else bucket(longest, 1, 1 << 30)
        S = bucket(pages_for(max(ch.start + len(ch.tokens) for ch in chunks), c.page_size), 1,
                   pages_for(self.max_context, c.page_size))
        batch, last_lane, last_rank = build_cp_batch(plan, reqs, [ch.tokens for ch in chunks],
                                                     [ch.req.pages for ch in chunks], rows=B, lanes=T, table_pages=S)
        logits = self.runner.forward(batch, last_lane, attn_path=c.attn_path or choose_attn_path(T),
                                     last_rank=last_rank, page_aligned=plan.page_aligned)
        n_tok = sum(len(ch.tokens) for ch in chunks)
        self.metrics["prefill_steps" if prefill else "decode_steps"] += 1
        self.metrics["prefill_tokens" if prefill else "decode_tokens"] += n_tok
        self.metrics["padded_lanes"] += B * T - n_tok

        params = [ch.req.params for ch in chunks] + [SamplingParams()] * (B - len(chunks))
        position = np.zeros(B, np.int32)
        for i, ch in enumerate(chunks):
            ch.req.computed = ch.start + len(ch.tokens)
            position[i] = ch.req.computed  # position of the token being sampled
        self._sampler_batches.add(B)
        toks, lps = sample_tokens(logits, jnp.asarray([p.temperature for p in params], jnp.float32),
                                  jnp.asarray([p.top_p for p in params], jnp.float32),
                                  jnp.asarray([p.top_k for p in params], jnp.int32),
                                  jnp.asarray([p.seed for p in params], jnp.uint32), jnp.asarray(position))
        toks, lps = np.asarray(toks), np.asarray(lps)
        host_logits = (np.asarray(logits) if any(ch.req.rid in self._capture_logits for ch in chunks) else None)
        self.metrics["prefill_s" if prefill else "decode_s"] += time.perf_counter() - t0

        events = []
        for i, ch in enumerate(chunks):
            req = ch.req
            if req.prefilling:
                continue  # a middle chunk: its logits are not a prediction anyone asked for
            if prefill:
                self.scheduler.prefill_done(req)
            self.scheduler.append_token(req, toks[i], lps[i])
            if host_logits is not None and req.rid in self._capture_logits:
                self._capture_logits[req.rid].append(host_logits[i].copy())
            if req.finish_reason is not None:
                self.scheduler.finish(req)
            events.append(TokenEvent(req.rid, int(toks[i]), float(lps[i]), req.finish_reason))
        return events

    # ---- results ---------------------------------------------------------------------------------
    def output(self, rid: int) -> GenerationOutput:
        """The result of a finished request (its bookkeeping is dropped)."""
        req = self._requests.pop(rid)
        if req.finish_reason is None:
            self._requests[rid] = req
            raise EngineInputError(f"request {rid} has not finished")
        timing = {"ttft_s": None if req.t_first_token is None else req.t_first_token - req.t_arrival,
                  "latency_s": req.t_finish - req.t_arrival,
                  "decode_tokens_per_s": ((len(req.output) - 1) / (req.t_finish - req.t_first_token)
                                          if len(req.output) > 1 and req.t_finish > req.t_first_token else None)}
        return GenerationOutput(token_ids=list(req.output), text=self.decode(req.output),
                                finish_reason=req.finish_reason, prompt_token_ids=list(req.prompt),
                                cached_tokens=req.cached_tokens,
                                logprobs=list(req.logprobs) if req.params.logprobs else None, timing=timing,
                                logits=self._capture_logits.pop(rid, None))

    def _add_all(self, prompts, params, return_logits: bool) -> list[int]:
        """Validate every prompt first, so a bad one queues nothing."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise EngineInputError("generate takes a list of prompts (strings or token id lists); wrap a "
                                   "single prompt in a list")
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise EngineInputError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        checked = [self._validate(p, sp) for p, sp in zip(prompts, plist)]
        return [self._enqueue(ids, sp, return_logits) for ids, sp in checked]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Run prompts (strings or token id lists) to completion, batched continuously with anything
        else in flight; outputs in prompt order."""
        rids = self._add_all(prompts, params, return_logits)
        pending = set(rids)
        while pending:
            for ev in self.step():
                if ev.finish_reason is not None:
                    pending.discard(ev.rid)
        return [self.output(r) for r in rids]

    def stream(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Like generate, yielding each token as it is sampled. Closing the iterator early aborts the
        requests still running."""
        rids = self._add_all(prompts, params, False)
        index = {r: i for i, r in enumerate(rids)}
        texts = {r: "" for r in rids}
        pending = set(rids)
        try:
            while pending:
                for ev in self.step():
                    if ev.rid not in index:
                        continue
                    delta = ""
                    if self.tokenizer is not None:
                        full = self.decode(self._requests[ev.rid].output)
                        if not full.endswith("\ufffd") or ev.finish_reason is not None:
                            delta, texts[ev.rid] = full[len(texts[ev.rid]):], full
                    if ev.finish_reason is not None:
                        pending.discard(ev.rid)
                        self._requests.pop(ev.rid, None)
                    yield StreamEvent(index[ev.rid], ev.token_id, delta, ev.finish_reason)
        finally:
            for r in pending:
                self.abort(r)
                self._requests.pop(r, None)

    # ---- inspection ------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler.stats()
        s.update(self.metrics)
        s["compilations"] = self.compilations()
        s["pool_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.pool.cache)))
        return s
