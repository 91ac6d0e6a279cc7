"""A step's padded batch. Every step pads its chunks to a (requests, tokens, key-width) bucket drawn from
small power-of-two sets, so the number of compiled step and sampler variants is bounded
(`BatchBuilder.max_compilations`) whatever the traffic. Host arrays only (numpy); the runner places them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cpkv_jax.config import EngineConfig
from cpkv_jax.cp import CPPlan, CPRequest, plan as cp_plan
from cpkv_jax.kv_pool import page_slots, pages_for
from cpkv_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams, is_stochastic
from cpkv_jax.scheduler import Chunk, Request, Scheduler
from models.kv import Batch


def bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n, clamped to [lo, hi] (hi itself is a bucket)."""
    return min(hi, max(lo, 1 << max(0, n - 1).bit_length()))


def bucket_set(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def build_batch(cp_plan: CPPlan, requests: list[CPRequest], tokens: list, page_tables: list, *, rows: int,
                lanes: int, table_pages: int):
    """Host arrays of one CP step: rank r's lanes of request b at row r*rows + b (tokens, positions,
    global write slots; -1 / 0 padding), the replicated slot table [rows, table_pages*page_size], and
    where each request's last token sits (rank, lane) for the narrow collection."""
    cp, ps = cp_plan.cp, cp_plan.page_size
    tok = np.zeros((cp, rows, lanes), np.int32)
    pos = np.full((cp, rows, lanes), -1, np.int32)
    write = np.zeros((cp, rows, lanes), np.int32)
    table = np.zeros((rows, table_pages * ps), np.int32)
    last_rank = np.zeros(rows, np.int32)
    last_lane = np.zeros(rows, np.int32)
    for b, req in enumerate(requests):
        slots = page_slots(np.asarray(page_tables[b][:table_pages]), ps)
        table[b, :len(slots)] = slots
        toks = np.asarray(tokens[b], np.int32)
        for r in range(cp):
            idx = cp_plan.local_tokens(r, b)
            k = len(idx)
            tok[r, b, :k] = toks[idx]
            pos[r, b, :k] = req.start + idx
            write[r, b, :k] = table[b, req.start + idx]
        if req.num_tokens:
            last_rank[b] = cp_plan.token_rank[b][-1]
            last_lane[b] = int((cp_plan.token_rank[b] == last_rank[b]).sum()) - 1
    batch = Batch(tok.reshape(cp * rows, lanes), pos.reshape(cp * rows, lanes), write.reshape(cp * rows, lanes),
                  table)
    return batch, last_lane, last_rank


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's padded host batch and the CP plan it was laid out from."""
    plan: CPPlan
    requests: list[CPRequest]
    batch: Batch
    last_lane: np.ndarray              # [rows] lane of each request's last token (on rank last_rank)
    last_rank: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.last_lane)


class BatchBuilder:
    """Lays out one engine's steps: splits a step's chunks over the CP ranks, has the scheduler allocate
    the pages they reach, and pads the batch and the sampler's per-row parameters to buckets (counting
    the sampler variants used)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, max_context: int):
        self.config = config
        self.scheduler = scheduler
        self.max_pages = pages_for(max_context, config.page_size)
        self.sampler_variants: set[tuple] = set()
        self.trace = None   # cpkv_jax.trace.Tracer: told which request each row of the next forward is

    def rows(self, requests: int) -> int:
        return bucket(requests, 1, self.config.max_running)

    def plan(self, chunks: list[Chunk]) -> tuple[CPPlan, list[CPRequest]]:
        """Split the step's tokens over the CP ranks (one rank: all on rank 0) and allocate the pages
        the chunks reach, from the ranks the plan names."""
        c, allocator = self.config, self.scheduler.allocator
        ps = c.page_size
        reqs = []
        for ch in chunks:
            if len(ch.req.pages) < ch.start // ps + (ch.start % ps != 0):
                raise AssertionError(f"request {ch.req.rid}: {len(ch.req.pages)} pages at position {ch.start}")
            ahead = ch.req.pages[ch.start // ps:pages_for(ch.start + len(ch.tokens), ps)]
            reqs.append(CPRequest(ch.start, len(ch.tokens), tuple(int(o) for o in allocator.owner(ahead))))
        plan = cp_plan(reqs, ps, c.cp_size, allocator.free_per_rank(), mode=c.cp_mode, short_policy=c.cp_short_policy)
        for ch, owners in zip(chunks, plan.new_page_owner):
            self.scheduler.allocate(ch.req, owners)
        return plan, reqs

    def build(self, chunks: list[Chunk], prefill: bool, plan: CPPlan | None = None,
              requests: list[CPRequest] | None = None, tokens: list | None = None, lanes: int | None = None,
              reach: int = 0) -> StepBatch:
        """Plan (allocating the pages the chunks reach; or reuse `plan`) and the padded host batch of
        one step (`tokens` replaces the chunks' tokens, `lanes` forces the lane count: both to line up
        with an earlier step's rows). `reach` (one rank): the step also writes up to that many
        positions past each chunk (a fused round's draft chain): their pages are allocated too, as far
        as the request's reservation goes (positions past it are never a running request's), and the
        slot table covers them."""
        c = self.config
        if plan is None:
            plan, requests = self.plan(chunks)
        ends = [ch.start + len(ch.tokens) for ch in chunks]
        if reach:
            for ch, end in zip(chunks, ends):
                more = min(pages_for(end + reach, c.page_size) - len(ch.req.pages), ch.req.reserved)
                if more > 0:
                    self.scheduler.allocate(ch.req, [0] * more)
        B = self.rows(len(chunks))
        longest = max(int(plan.local_lengths.max()), 1)
        T = lanes or (bucket(longest, c.min_prefill_lanes, c.max_prefill_tokens) if prefill
                      else bucket(longest, 1, 1 << 30))
        S = bucket(pages_for(max(ends) + reach, c.page_size), 1, self.max_pages)
        batch, last_lane, last_rank = build_batch(plan, requests, tokens or [ch.tokens for ch in chunks],
                                                  [ch.req.pages for ch in chunks], rows=B, lanes=T, table_pages=S)
        if self.trace is not None:
            self.trace.batch_rows(chunks)
        return StepBatch(plan, requests, batch, last_lane, last_rank)

    @staticmethod
    def top_logprobs_width(reqs: list[Request]) -> int:
        """The static top-N width of a step: 0 when no request asks for alternatives, else the largest
        N asked for bucketed to a power of two (capped at MAX_TOP_LOGPROBS), so N does not recompile."""
        n = max((r.params.top_logprobs for r in reqs), default=0)
        return 0 if n == 0 else bucket(n, 1, MAX_TOP_LOGPROBS)

    def sampling(self, sampler: str, reqs: list[Request], rows: int, top_n: int = 0):
        """Per-row (temperature, top_p, top_k, seed) for `sampler` over `rows` rows (padding rows: the
        defaults), host arrays the jitted sampler takes as they are; each (sampler, rows, top_n) is one
        compiled sampler variant, twice for "sample" (with and without a row that samples:
        sampling.sample_tokens' `stochastic`)."""
        params = [r.params for r in reqs] + [SamplingParams()] * (rows - len(reqs))
        temperature = np.asarray([p.temperature for p in params], np.float32)
        stochastic = (is_stochastic(temperature),) if sampler == "sample" else ()
        self.sampler_variants.add((sampler, rows, top_n) + stochastic)
        return (temperature,
                np.asarray([p.top_p for p in params], np.float32),
                np.asarray([p.top_k for p in params], np.int32),
                np.asarray([p.seed for p in params], np.uint32))

    def max_compilations(self, *, speculative: bool, hooked: bool) -> int:
        """Upper bound on compiled step variants: prefill B x T x S buckets (last-token logits, sampled in
        the step greedy or not or handed to the sampler, or every position's for prompt logprobs) and
        decode B x S (the same three last-token ways; with speculative decoding the prefill's draft
        extend, the round (cpkv_jax.runner.run_round) per top-N width and the chain step, each greedy
        or not), twice that under CP (a plan is page-aligned or not), twice again with the host tier's
        layer hook (`hooked`: a step that copies and one that does not), plus the samplers: one
        variant per B bucket, sampler and top-N width (two for the token sampler, with and without
        stochastic rows), and the prompt log-probability gather per prefill B x T bucket and width."""
        c = self.config
        nB = len(bucket_set(1, c.max_running))
        nT = len(bucket_set(min(c.min_prefill_lanes, c.max_prefill_tokens), c.max_prefill_tokens))
        nS = len(bucket_set(1, self.max_pages))
        nK = 1 + len(bucket_set(1, MAX_TOP_LOGPROBS))
        # without speculative decoding a last-token step either samples in its own executable (greedy or
        # not: two variants) or, with top-N alternatives, hands its logits to the sampler (a third);
        # with speculative decoding a prefill step returns its hidden rows (last-token or every
        # position's logits) and its draft extend proposes greedy or not, and a round holds the
        # acceptance, whose top-N width is static
        steps = (4 * nB * nT * nS + 2 * (nK + 1) * nB * nS) if speculative else (4 * nB * nT * nS + 3 * nB * nS)
        samplers = nB * nK * (4 if speculative else 2) + nB * nT * nK
        return steps * (2 if c.cp_size > 1 else 1) * (2 if hooked else 1) + samplers
