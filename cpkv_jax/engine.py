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
from cpkv_jax.kv_pool import KVPool, PageAllocator, pages_for
from cpkv_jax.radix_cache import RadixCache
from cpkv_jax.runner import ModelRunner
from cpkv_jax.sampling import SamplingParams, propose_tokens, sample_tokens, verify_tokens
from cpkv_jax.scheduler import Chunk, Request, Scheduler
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
    speculative: str | None = None   # 'nextn': EAGLE/NextN speculative decoding with the checkpoint's MTP layer
    num_draft_tokens: int = 2        # draft tokens proposed per decode round (chain)
    hicache_pages: int = 0           # host KV tier size in pages (pinned host memory); 0 = off
    hicache_policy: str = "write_through"  # or 'write_through_selective' (back up on the second hit)
    hicache_copy: str = "auto"       # 'side_stream' (GPU: copies at layer boundaries), 'jit', 'auto' (GPU -> side_stream)

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
        if self.speculative not in (None, "nextn"):
            raise EngineConfigError(f"speculative must be None or 'nextn', got {self.speculative!r}")
        positive("num_draft_tokens")
        if self.hicache_pages:
            from cpkv_jax.hicache import WRITE_POLICIES
            positive("hicache_pages", 2)
            if not self.prefix_cache:
                raise EngineConfigError("hicache_pages needs prefix_cache=True: the host tier lives under the "
                                        "radix prefix cache")
            if self.hicache_pages % self.cp_size or self.hicache_pages // self.cp_size < 2:
                raise EngineConfigError(f"hicache_pages ({self.hicache_pages}) must be a multiple of cp_size "
                                        f"({self.cp_size}) with at least 2 pages per rank")
            if self.hicache_policy not in WRITE_POLICIES:
                raise EngineConfigError(f"hicache_policy must be one of {WRITE_POLICIES}, got "
                                        f"{self.hicache_policy!r}")
            if self.hicache_copy not in ("auto", "side_stream", "jit"):
                raise EngineConfigError(f"hicache_copy must be 'auto', 'side_stream' or 'jit', got "
                                        f"{self.hicache_copy!r}")
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
        self.spec = config.speculative is not None
        if self.spec and self.model.mtp is None:
            raise EngineConfigError("speculative='nextn' needs a model with an MTP layer "
                                    "(num_nextn_predict_layers >= 1)")
        self.pool = KVPool.create(self.cfg, config.kv_pages, ps, self.model.dtype, config.index_dtype,
                                  mesh=self.mesh, draft=self.spec)
        copier = None
        if config.hicache_pages and config.hicache_copy != "jit":
            from cpkv_jax.hicache.side_stream import install
            copier = install()
            if copier is None and config.hicache_copy == "side_stream":
                raise EngineConfigError("hicache_copy='side_stream' needs a CUDA GPU backend and libcudart")
        self.allocator = PageAllocator(config.kv_pages, config.cp_size)
        # spec mode: bigram keys, since the draft KV at position i depends on token i+1
        self.radix = RadixCache(ps, bigram=self.spec) if config.prefix_cache else None
        self.spec_tokens = config.num_draft_tokens if self.spec else 0
        self.hicache = None
        if config.hicache_pages:
            from cpkv_jax.hicache import HiCache
            self.hicache = HiCache(self.pool, self.radix, config.hicache_pages, full_layers=self.cfg.full_layers,
                                   policy=config.hicache_policy, mesh=self.mesh, copier=copier)
        self.runner = ModelRunner(self.model, self.pool, mesh=self.mesh, copier=copier,
                                  step_copies=self.hicache.copies.take_step if copier is not None else None)
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=ps, max_running=config.max_running,
                                   max_prefill_tokens=config.max_prefill_tokens, lookahead=self.spec_tokens,
                                   hicache=self.hicache)
        self.max_context = min(self.cfg.max_position_embeddings, self.allocator.capacity * ps)
        self._rids = itertools.count()
        self._requests: dict[int, Request] = {}
        self._capture_logits: dict[int, list[np.ndarray]] = {}
        self._sampler_batches: set[tuple] = set()
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
        total = len(ids) + params.max_new_tokens + self.spec_tokens
        if total > self.cfg.max_position_embeddings:
            raise EngineInputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens})"
                                   + (f" + draft tokens ({self.spec_tokens})" if self.spec else "")
                                   + f" = {total} exceeds the model's context of {self.cfg.max_position_embeddings}")
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
        if self.hicache is not None:
            self.hicache.poll()
        self.scheduler.admit()
        decode = self.scheduler.plan_decode()   # planned first: requests finishing prefill now decode next step
        prefill = self.scheduler.plan_prefill()
        events = []
        if prefill:
            events += self._run(prefill, prefill=True)
        if decode:
            events += self._spec_round([ch.req for ch in decode]) if self.spec else self._run(decode, prefill=False)
        self.metrics["steps"] += 1
        return events

    def max_compilations(self) -> int:
        """Upper bound on compiled step variants: prefill B x T x S buckets and decode B x S (with
        speculative decoding also the draft extend of each, and the chain step), twice that under CP
        (a plan is page-aligned or not), twice again with the host tier's layer hook (a step that copies
        and one that does not), plus one sampler variant per B bucket and sampler."""
        c = self.config
        nB = len(bucket_set(1, c.max_running))
        nT = len(bucket_set(min(c.min_prefill_lanes, c.max_prefill_tokens), c.max_prefill_tokens))
        nS = len(bucket_set(1, pages_for(self.max_context, c.page_size)))
        steps = (2 * nB * nT * nS + 3 * nB * nS) if self.spec else (nB * nT * nS + nB * nS)
        hooked = 2 if self.runner.copier is not None else 1      # target steps with / without the layer hook
        return steps * (2 if c.cp_size > 1 else 1) * hooked + nB * (3 if self.spec else 1)

    def compilations(self) -> int:
        """Distinct compiled variants this engine has used (step shapes + sampler batch sizes)."""
        return self.runner.compilations + len(self._sampler_batches)

    def _plan(self, chunks: list[Chunk]) -> tuple[CPPlan, list[CPRequest]]:
        """Split the step's tokens over the CP ranks (one rank: all on rank 0) and allocate the pages
        the chunks reach, from the ranks the plan names."""
        ps = self.config.page_size
        reqs = []
        for ch in chunks:
            if len(ch.req.pages) < ch.start // ps + (ch.start % ps != 0):
                raise AssertionError(f"request {ch.req.rid}: {len(ch.req.pages)} pages at position {ch.start}")
            ahead = ch.req.pages[ch.start // ps:pages_for(ch.start + len(ch.tokens), ps)]
            reqs.append(CPRequest(ch.start, len(ch.tokens), tuple(int(o) for o in self.allocator.owner(ahead))))
        plan = cp_plan(reqs, ps, self.config.cp_size, self.allocator.free_per_rank(), mode=self.config.cp_mode,
                       short_policy=self.config.cp_short_policy)
        for ch, owners in zip(chunks, plan.new_page_owner):
            self.scheduler.allocate(ch.req, owners)
        return plan, reqs

    def _layout(self, chunks: list[Chunk], prefill: bool, plan=None, reqs=None, tokens=None, lanes=None):
        """Plan (allocating the pages the chunks reach; or reuse `plan`) and the padded host batch of
        one step (`lanes` forces the lane count, to line up with an earlier step's rows)."""
        c = self.config
        if plan is None:
            plan, reqs = self._plan(chunks)
        B = bucket(len(chunks), 1, c.max_running)
        longest = max(int(plan.local_lengths.max()), 1)
        T = lanes or (bucket(longest, c.min_prefill_lanes, c.max_prefill_tokens) if prefill
                      else bucket(longest, 1, 1 << 30))
        S = bucket(pages_for(max(ch.start + len(ch.tokens) for ch in chunks), c.page_size), 1,
                   pages_for(self.max_context, c.page_size))
        batch, last_lane, last_rank = build_cp_batch(plan, reqs, tokens or [ch.tokens for ch in chunks],
                                                     [ch.req.pages for ch in chunks], rows=B, lanes=T, table_pages=S)
        return plan, reqs, batch, last_lane, last_rank

    def _sampling_args(self, reqs: list[Request], B: int):
        params = [r.params for r in reqs] + [SamplingParams()] * (B - len(reqs))
        return (jnp.asarray([p.temperature for p in params], jnp.float32),
                jnp.asarray([p.top_p for p in params], jnp.float32),
                jnp.asarray([p.top_k for p in params], jnp.int32),
                jnp.asarray([p.seed for p in params], jnp.uint32))

    def _run(self, chunks: list[Chunk], prefill: bool) -> list[TokenEvent]:
        t0 = time.perf_counter()
        c = self.config
        plan, reqs, batch, last_lane, last_rank = self._layout(chunks, prefill)
        B = len(last_lane)
        if self.hicache is not None:
            self.hicache.stage_backups([(ch.req.host_res, ch.req.pages, ch.start + len(ch.tokens)) for ch in chunks])
        out = self.runner.forward(batch, last_lane, attn_path=c.attn_path,
                                  output="last_logits_hidden" if self.spec else "last_logits",
                                  last_rank=last_rank, page_aligned=plan.page_aligned)
        logits, hidden = out if self.spec else (out, None)
        n_tok = sum(len(ch.tokens) for ch in chunks)
        self.metrics["prefill_steps" if prefill else "decode_steps"] += 1
        self.metrics["prefill_tokens" if prefill else "decode_tokens"] += n_tok
        self.metrics["padded_lanes"] += batch.tokens.size - n_tok   # every rank's lanes under CP

        position = np.zeros(B, np.int32)
        for i, ch in enumerate(chunks):
            ch.req.computed = ch.start + len(ch.tokens)
            position[i] = ch.req.computed  # position of the token being sampled
        self._sampler_batches.add(("sample", B))
        toks, lps = sample_tokens(logits, *self._sampling_args([ch.req for ch in chunks], B), jnp.asarray(position))
        toks, lps = np.asarray(toks), np.asarray(lps)
        host_logits = (np.asarray(logits) if any(ch.req.rid in self._capture_logits for ch in chunks) else None)

        events, done = [], []
        for i, ch in enumerate(chunks):
            req = ch.req
            if req.prefilling:
                continue  # a middle chunk: its logits are not a prediction anyone asked for
            if prefill:
                self.scheduler.prefill_done(req)
            self.scheduler.append_token(req, toks[i], lps[i])
            if host_logits is not None and req.rid in self._capture_logits:
                self._capture_logits[req.rid].append(host_logits[i].copy())
            done.append(req)
            events.append(TokenEvent(req.rid, int(toks[i]), float(lps[i]), req.finish_reason))
        if self.spec:
            # draft extend over the same lanes: the MTP input at position i is (h_i, token i+1)
            nxt = [(ch.req.prompt + ch.req.output)[ch.start + 1:ch.start + len(ch.tokens) + 1] for ch in chunks]
            self._draft_extend(chunks, plan, reqs, hidden, nxt)
        if prefill:
            for req in done:    # after the draft extend: the prompt's draft KV is complete too
                self.scheduler.backup_prompt(req)
        for req in done:
            if req.finish_reason is not None:
                self.scheduler.finish(req)
        self.metrics["prefill_s" if prefill else "decode_s"] += time.perf_counter() - t0
        return events

    # ---- speculative decoding --------------------------------------------------------------------
    def _draft_extend(self, chunks, plan, reqs, hidden, next_tokens):
        """MTP over the lanes of a target step (hidden rows stay where they were computed), then, for
        requests that have a next token to draft for, the first proposal and n-1 chain steps."""
        T = hidden.shape[1]
        _, _, batch, last_lane, last_rank = self._layout(chunks, True, plan, reqs, next_tokens, lanes=T)
        dlogits, x_last = self.runner.draft_forward(hidden, batch.tokens, batch, last_lane,
                                                    attn_path=self.config.attn_path,
                                                    last_rank=last_rank, page_aligned=plan.page_aligned)
        live = [i for i, ch in enumerate(chunks) if not ch.req.prefilling and ch.req.finish_reason is None]
        if live:
            self._propose(chunks, live, dlogits, x_last)

    def _propose(self, chunks, live, dlogits, x_last):
        """Draw the first draft from the extend's logits, then chain: each MTP step takes its own last
        hidden and the token it just proposed, one position further."""
        n = self.config.num_draft_tokens
        reqs = [chunks[i].req for i in live]
        for r in reqs:
            r.drafts, r.draft_q = [], []
        idx = jnp.asarray(live)
        dlogits, x_last = dlogits[idx], x_last[idx]
        for k in range(n):
            B = bucket(len(reqs), 1, self.config.max_running)
            pad = B - len(reqs)
            pos = np.array([r.seq_len + k for r in reqs] + [0] * pad, np.int32)  # position of the drafted token
            dl = jnp.pad(dlogits, ((0, pad), (0, 0)))
            self._sampler_batches.add(("propose", B))
            d, q = propose_tokens(dl, *self._sampling_args(reqs, B), jnp.asarray(pos))
            d = np.asarray(d)[:len(reqs)]
            for i, r in enumerate(reqs):
                r.drafts.append(int(d[i]))
                r.draft_q.append(q[i])
            if k == n - 1:
                break
            step = [Chunk(r, r.seq_len - 1 + k, [r.drafts[-1]]) for r in reqs]
            plan, creqs, batch, last_lane, last_rank = self._layout(step, False)
            xs = jnp.pad(x_last, ((0, len(last_lane) - len(reqs)), (0, 0)))
            dlogits, x_last = self.runner.draft_forward(xs, batch.tokens, batch, last_lane, attn_path="absorbed",
                                                        last_rank=last_rank, page_aligned=plan.page_aligned)
            dlogits, x_last = dlogits[:len(reqs)], x_last[:len(reqs)]

    def _spec_round(self, reqs: list[Request]) -> list[TokenEvent]:
        """Verify every request's drafts in one target step, accept (greedy match or rejection
        sampling), release the pages of rejected positions, re-extend the draft over the accepted
        positions and propose the next drafts."""
        t0 = time.perf_counter()
        n = self.config.num_draft_tokens
        chunks = [Chunk(r, r.seq_len - 1, [r.output[-1]] + r.drafts) for r in reqs]
        plan, creqs, batch, last_lane, last_rank = self._layout(chunks, False, lanes=bucket(n + 1, 1, 2 * (n + 1)))
        B = len(last_lane)
        logits, hidden = self.runner.forward(batch, last_lane, attn_path=self.config.attn_path,
                                             output="logits_hidden", last_rank=last_rank,
                                             page_aligned=plan.page_aligned)
        rank_idx = np.zeros((B, n + 1), np.int32)
        lane_idx = np.zeros((B, n + 1), np.int32)
        for b in range(len(reqs)):
            rank_idx[b], lane_idx[b] = plan.lanes(b)
        rows = np.broadcast_to(np.arange(B)[:, None], (B, n + 1))
        target = logits[rows, lane_idx] if logits.ndim == 3 else logits[rank_idx, rows, lane_idx]
        q = jnp.stack([jnp.stack(r.draft_q) for r in reqs])
        q = jnp.pad(q, ((0, B - len(reqs)), (0, 0), (0, 0)))
        drafts = np.zeros((B, n), np.int32)
        drafts[:len(reqs)] = [r.drafts for r in reqs]
        position = np.array([r.seq_len for r in reqs] + [0] * (B - len(reqs)), np.int32)
        self._sampler_batches.add(("verify", B))
        a, tok, lps = verify_tokens(target, q, jnp.asarray(drafts), *self._sampling_args(reqs, B), jnp.asarray(position))
        a, tok, lps = np.asarray(a), np.asarray(tok), np.asarray(lps)
        host_target = np.asarray(target) if any(r.rid in self._capture_logits for r in reqs) else None

        events, keep = [], []
        for b, r in enumerate(reqs):
            start = r.seq_len - 1
            emitted = r.drafts[:a[b]] + [int(tok[b])]
            k = 0
            for j, t in enumerate(emitted):
                self.scheduler.append_token(r, t, lps[b, j])
                if host_target is not None and r.rid in self._capture_logits:
                    self._capture_logits[r.rid].append(host_target[b, j].copy())
                events.append(TokenEvent(r.rid, t, float(lps[b, j]), r.finish_reason))
                k += 1
                if r.finish_reason is not None:
                    break
            r.computed = start + k  # target KV is valid for the verified lanes that produced a kept token
            keep.append(k)
            self.metrics["spec_accepted"] += k - 1
        self.metrics["spec_rounds"] += 1
        self.metrics["spec_request_rounds"] += len(reqs)
        self.metrics["spec_drafts"] += n * len(reqs)
        self.metrics["decode_steps"] += 1
        self.metrics["decode_tokens"] += sum(keep)
        # draft KV over the kept positions (next token of each: the emitted tokens), from the verify's hidden
        tplan, treqs = plan.truncated(creqs, keep)
        nxt = [list(r.output[len(r.output) - k:]) for r, k in zip(reqs, keep)]
        self._draft_extend([Chunk(r, ch.start, ch.tokens[:k]) for r, ch, k in zip(reqs, chunks, keep)],
                           tplan, treqs, hidden, nxt)
        for r in reqs:
            if r.finish_reason is not None:
                self.scheduler.finish(r)
            else:
                self.scheduler.release_pages_after(r, r.computed)
        self.metrics["decode_s"] += time.perf_counter() - t0
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
        if self.hicache is not None:
            self.hicache.settle()   # backups still in flight become visible before returning
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
        if self.spec and self.metrics["spec_request_rounds"]:
            rr = self.metrics["spec_request_rounds"]
            s["spec_acceptance_length"] = (self.metrics["spec_accepted"] + rr) / rr  # tokens per request per round
            s["spec_accept_rate"] = self.metrics["spec_accepted"] / self.metrics["spec_drafts"]
        s["pool_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.pool.cache)))
        return s
