"""Continuous batching on the host: admission against the page pool, prefix-cache reuse, chunked
prefill under a token budget, decode batches, and the page bookkeeping of finished requests.

Pages are reserved for a request's whole lifetime at admission (prompt + max_new_tokens - 1 KV
positions, less its cached prefix), so a running request never runs short and nothing is ever
preempted or overwritten; a request that does not fit waits (FIFO, no overtaking) until finished
requests or cache eviction free enough pages. A reservation is a count: pages are allocated step by
step as positions are reached, from the rank the CP plan names (the free pages always cover the
outstanding reservations, so an allocation never fails). The scheduler never touches the device: it hands the
engine step plans and is told what was sampled.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from cpkv_jax.kv_pool import PageAllocator, pages_for
from cpkv_jax.radix_cache import RadixCache, TreeNode
from cpkv_jax.sampling import SamplingParams
from cpkv_jax.stop import StopMatcher


@dataclasses.dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[tuple] = dataclasses.field(default_factory=list)    # per token: ((id, logprob), ...)
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)  # of prompt tokens 1, 2, ...
    prompt_top_logprobs: list[tuple] = dataclasses.field(default_factory=list)
    text: StopMatcher | None = None     # the decoded output and its stop strings (streams, stop strings)
    pages: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    reserved: int = 0                   # pages reserved but not yet allocated
    drafts: list[int] = dataclasses.field(default_factory=list)   # speculative proposals for the next round
    draft_q: tuple | None = None        # the distributions they were drawn from: (q [R, n, V], row), None: greedy
    node: TreeNode | None = None        # locked radix node covering pages[:shared_pages]
    host_res: object | None = None      # HiCache reservation for the prompt's pages (set by its write policy)
    shared_pages: int = 0               # leading pages owned by the radix tree (not freed by us)
    cached_tokens: int = 0              # prompt tokens served by the prefix cache at admission
    computed: int = 0                   # positions whose KV is in the pool
    finish_reason: str | None = None
    t_arrival: float = 0.0
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_finish: float | None = None
    logits: list[np.ndarray] | None = None  # fp32 [vocab] per sampled token, when asked for (return_logits)
    decode_elsewhere: bool = False      # PD prefill side: pages reserved for the prompt only (cpkv_jax.pd)
    pending: int = 0                    # tokens sampled on the device whose values the host has not taken yet
    token_slot: int = -1                # where the pending token is in the engine's device buffer of sampled tokens

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def kv_capacity(self) -> int:
        """KV positions the request can ever write: the last sampled token's KV is never needed (on a PD
        prefill engine only the prompt's: the decode replica writes the rest)."""
        if self.decode_elsewhere:
            return len(self.prompt)
        return len(self.prompt) + self.params.max_new_tokens - 1

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's lanes in a step: tokens at positions start .. start+len(tokens)-1."""
    req: Request
    start: int
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    rid: int
    token_id: int
    logprob: float
    finish_reason: str | None
    top_logprobs: tuple = ()            # ((id, logprob), ...) when the request asks for alternatives
    text: str = ""                      # newly decided text, for requests that track theirs (Request.text)


class Scheduler:
    def __init__(self, allocator: PageAllocator, radix: RadixCache | None, *, page_size: int,
                 max_running: int, max_prefill_tokens: int, lookahead: int = 0, hicache=None):
        self.allocator = allocator
        self.radix = radix
        self.hicache = hicache  # cpkv_jax.hicache.HiCache: host tier under the radix tree, or None
        self.page_size = page_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.lookahead = lookahead  # speculative positions written beyond the sequence (draft tokens)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.reserved_pages = 0  # sum of running requests' reservations

    # ---- admission -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests (in arrival order) into the running set while pages and lanes last."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._reserve(req):
                break
            self.waiting.popleft()
            req.t_admitted = time.perf_counter()
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _reserve(self, req: Request) -> bool:
        ps = self.page_size
        prefix, host, node, m = np.zeros(0, np.int32), np.zeros(0, np.int32), None, None
        if self.radix is not None:
            # at least the last prompt token is computed: its logits give the first output token; a
            # request that wants every prompt token's log-probability computes its whole prompt
            m = self.radix.match([] if req.params.prompt_logprobs else req.prompt[:-1], count_hit=True)
            prefix, host, node = m.device_pages, m.host_pages, m.node
            if len(host) and not self._can_load(host):  # a rank is short: recompute instead
                host, node = host[:0], m.device_node
            self.radix.lock(node)
        need = pages_for(req.kv_capacity + self.lookahead, ps) - len(prefix)  # host-matched pages included
        short = need - (self.allocator.num_free - self.reserved_pages)
        if short > 0 and self.radix is not None:
            self.radix.evict(short, self._free_device, self._free_host)
        if need > self.allocator.num_free - self.reserved_pages:
            if node is not None:
                self.radix.unlock(node)
            return False
        if len(host):  # host-only prefix: device pages now (on the host pages' ranks), loaded before the first step
            loaded = np.array([int(self.allocator.alloc(1, int(r))[0]) for r in self.hicache.host_rank(host)],
                              np.int32)
            self.hicache.load(host, loaded, rid=req.rid)
            self.radix.restore_device(m.host_nodes, loaded)
            prefix = np.concatenate([prefix, loaded])
            need -= len(host)
        req.pages = prefix.astype(np.int32)
        req.reserved = need
        self.reserved_pages += need
        req.node, req.shared_pages = node, len(prefix)
        req.cached_tokens = req.computed = len(prefix) * ps
        if self.hicache is not None:
            self.hicache.on_admit(req, m)
        return True

    def admit_prefilled(self, req: Request) -> bool:
        """Admit a request whose prompt KV another engine computed (a PD decode replica): the same prefix
        match, lock and whole-life reservation as admission, or False (nothing held) when the pool or
        the running set is full: it waits. The caller allocates the prompt's pages past the matched
        prefix, writes them and calls `start_decoding`, or `release`s it."""
        if len(self.running) >= self.max_running or not self._reserve(req):
            return False
        req.t_admitted = time.perf_counter()
        return True

    def start_decoding(self, req: Request) -> None:
        """The transferred prompt's KV is in the pool: publish its full pages and run the request."""
        req.computed = len(req.prompt)
        self.prefill_done(req)
        self.backup_prompt(req)
        self.running.append(req)

    def hand_over(self, req: Request) -> Request:
        """Take a request whose prompt is computed out of the running set (PD: it decodes on another
        engine). The returned copy holds its pages, lock and reservation until it is `release`d after
        the transfer; the request itself holds nothing here any more."""
        self.running.remove(req)
        held = dataclasses.replace(req)
        req.pages, req.node, req.host_res, req.shared_pages, req.reserved = req.pages[:0], None, None, 0, 0
        return held

    def _can_load(self, host_pages) -> bool:
        """Every host page's rank has a free device page for it (loads stay on their rank)."""
        need = np.bincount(self.hicache.host_rank(host_pages), minlength=self.allocator.ranks)
        return bool((need <= self.allocator.free_per_rank()).all())

    def _free_host(self, pages) -> None:
        self.hicache.allocator.free(pages)

    def _free_device(self, pages) -> None:
        """Return device pages to the allocator, once no host-tier copy still reads them."""
        if self.hicache is not None:
            self.hicache.before_device_free(pages)
        self.allocator.free(pages)

    def allocate(self, req: Request, owners) -> None:
        """Allocate the request's next pages from its reservation, one per entry of `owners` (the CP
        rank to take it from)."""
        owners = list(owners)
        if len(owners) > req.reserved:
            raise AssertionError(f"request {req.rid} asks for {len(owners)} pages with {req.reserved} reserved")
        new = [int(self.allocator.alloc(1, int(r))[0]) for r in owners]
        req.pages = np.concatenate([req.pages, np.asarray(new, np.int32)]).astype(np.int32)
        req.reserved -= len(owners)
        self.reserved_pages -= len(owners)

    def release_pages_after(self, req: Request, position: int) -> None:
        """Return the pages wholly after `position` (written only for rejected speculative tokens) to
        the request's reservation."""
        keep = position // self.page_size + 1
        tail = req.pages[keep:]
        if len(tail):
            self.allocator.free(tail)
            req.pages = req.pages[:keep]
            req.reserved += len(tail)
            self.reserved_pages += len(tail)

    # ---- step plans ------------------------------------------------------------------------------
    def plan_prefill(self) -> list[Chunk]:
        """Chunks of prompts still being prefilled, oldest first, within the token budget. The padded
        area (requests x longest chunk, both bucketed by the engine) is kept near the budget too."""
        chunks, budget, longest = [], self.max_prefill_tokens, 0
        for req in self.running:
            if not req.prefilling or budget <= 0:
                continue
            n = min(len(req.prompt) - req.computed, budget)
            end = req.computed + n
            if end < len(req.prompt) and end % self.page_size and end - end % self.page_size > req.computed:
                n = end - end % self.page_size - req.computed  # a chunk that stops early stops on a page
            if chunks and (len(chunks) + 1) * max(longest, n) > 2 * self.max_prefill_tokens:
                break
            chunks.append(Chunk(req, req.computed, req.prompt[req.computed:req.computed + n]))
            budget -= n
            longest = max(longest, n)
        return chunks

    def plan_decode(self) -> list[Chunk]:
        """One lane per request that has sampled at least one token, is not finished and decodes here.
        A token still on the device (`pending`) is the lane's token as -1 - its buffer slot (the step
        reads it there: cpkv_jax.runner.run_filled); a request whose pending token is its last one
        (max_new_tokens) gets no lane."""
        return [Chunk(r, r.seq_len + r.pending - 1, [-1 - r.token_slot if r.pending else r.output[-1]])
                for r in self.running
                if (r.output or r.pending) and r.finish_reason is None and not r.decode_elsewhere
                and len(r.output) + r.pending < r.params.max_new_tokens]

    # ---- results ---------------------------------------------------------------------------------
    def complete_step(self, chunks: list[Chunk], tokens: list, logprobs: list, logits: np.ndarray | None = None, *,
                      top: list | None = None, verified: bool = False, before_release=None,
                      in_flight_reach: int = 0) -> list[TokenEvent]:
        """Take a step's sampled tokens: chunk i emitted tokens[i] (none for a middle prefill chunk),
        appended until its request finishes; a chunk that ends a prompt publishes it first. `logits`
        (host, [rows, V] or [rows, tokens, V]) feed the requests that capture them; `top` (host ids and
        log-probabilities of the step's top-N alternatives, [rows, N] or [rows, tokens, N]) the requests
        that ask for alternatives (each takes its own first top_logprobs). With `verified`
        (a speculative round) only the lanes that produced a kept token hold KV. Then
        `before_release(taken)` runs with the count each chunk took (the draft extend, which needs the
        tokens and the pages), then prompts' backups complete and finished requests are released;
        after a verified step the others give back the pages wholly past their KV, or past
        `in_flight_reach` positions more for a request with a newer round still running (`pending`:
        the overlapped loop), which writes there."""
        rows = None if logits is None else logits.reshape(len(logits), -1, logits.shape[-1])
        top_ids, top_lps = (None, None) if top is None else (a.reshape(len(a), -1, a.shape[-1]) for a in top)
        events, taken = [], []
        for i, ch in enumerate(chunks):
            req = ch.req
            if len(tokens[i]) and ch.start < len(req.prompt):
                self.prefill_done(req)
            k = 0
            for t, lp in zip(tokens[i], logprobs[i]):
                n = req.params.top_logprobs
                alternatives = (tuple(zip(top_ids[i, k, :n].tolist(), top_lps[i, k, :n].tolist()))
                                if n and top is not None else ())
                text = self.append_token(req, t, lp, alternatives)
                if req.logits is not None:
                    req.logits.append(rows[i, k].copy())
                events.append(TokenEvent(req.rid, int(t), float(lp), req.finish_reason, alternatives, text))
                k += 1
                if req.finish_reason is not None:
                    break
            if verified and k:
                req.computed = ch.start + k
            taken.append(k)
        if before_release is not None:
            before_release(taken)
        for ch, k in zip(chunks, taken):
            if k and ch.start < len(ch.req.prompt):   # after the draft extend: the prompt's draft KV is complete too
                self.backup_prompt(ch.req)
        for ch, k in zip(chunks, taken):
            if k and ch.req.finish_reason is not None:
                self.finish(ch.req)
            elif verified:
                self.release_pages_after(ch.req, ch.req.computed + in_flight_reach * (ch.req.pending > 0))
        return events

    def prefill_done(self, req: Request) -> None:
        """The whole prompt's KV is in the pool: publish its full pages to the prefix cache now, so
        requests admitted while this one decodes already share them."""
        if self.radix is not None:
            self._publish(req, req.prompt[:req.computed])

    def backup_prompt(self, req: Request) -> None:
        """After the step that finished the prompt (and its draft extend): complete the host tier's
        backup of the prompt's pages, if its write policy reserved one."""
        if self.hicache is not None:
            self.hicache.on_prefill_done(req)

    def append_token(self, req: Request, token: int, logprob: float, alternatives: tuple = ()) -> str:
        """Record a sampled token and decide whether the request ends with it (a stop token id, a stop
        string in its text, or its length); returns the text it decides (requests tracking theirs)."""
        now = time.perf_counter()
        if not req.output:
            req.t_first_token = now
        req.output.append(int(token))
        req.logprobs.append(float(logprob))
        if req.params.top_logprobs:
            req.top_logprobs.append(alternatives)
        stop_string = req.text is not None and req.text.append(token)
        if int(token) in req.stop_ids or stop_string:
            req.finish_reason = "stop"
        elif len(req.output) >= req.params.max_new_tokens:
            req.finish_reason = "length"
        return "" if req.text is None else req.text.emit(final=req.finish_reason is not None)

    def finish(self, req: Request, reason: str | None = None) -> None:
        """Release a finished (or aborted) request: its computed full pages go to the prefix cache, the
        rest back to the allocator, and its lock on the tree is dropped."""
        if reason is not None:
            req.finish_reason = reason
        req.t_finish = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            return
        self.release(req, publish=req.finish_reason != "abort")

    def release(self, req: Request, publish: bool = True) -> None:
        """Give back what a request holds (not running or waiting any more): with `publish` its computed
        full pages go to the prefix cache, the rest back to the allocator; its lock is dropped."""
        if self.radix is not None and publish:
            self._publish(req, req.tokens()[:req.computed])
        if self.hicache is not None:
            self.hicache.on_finish(req)
        self._free_device(req.pages[req.shared_pages:])
        req.pages = req.pages[:0]
        self.reserved_pages -= req.reserved
        req.reserved = 0
        if req.node is not None:
            self.radix.unlock(req.node)
            req.node = None
        req.shared_pages = 0

    def _publish(self, req: Request, tokens: list[int]) -> None:
        """Insert the full pages of `tokens` (whose KV the request holds in req.pages). Pages the tree
        already had are freed and replaced by the tree's own, and the request's lock moves to the new
        node, so from here on the tree owns pages[:shared_pages] and the request the rest."""
        ps = self.page_size
        n_full = len(self.radix.key_of(tokens)) // ps
        if n_full <= req.shared_pages:
            return
        present = self.radix.insert(tokens, req.pages) // ps
        dup = req.pages[req.shared_pages:present]
        self._free_device(dup)
        tree_pages, node = self.radix.match_prefix(tokens)
        if len(tree_pages) != n_full:
            raise AssertionError(f"radix holds {len(tree_pages)} pages after inserting {n_full}")
        self.radix.lock(node)
        if req.node is not None:
            self.radix.unlock(req.node)
        req.pages = np.concatenate([tree_pages, req.pages[n_full:]]).astype(np.int32)
        req.node, req.shared_pages = node, n_full

    # ---- inspection ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        out = {"waiting": len(self.waiting), "running": len(self.running),
               "free_pages": self.allocator.num_free, "total_pages": self.allocator.capacity,
               "reserved_pages": self.reserved_pages,
               "request_pages": int(sum(len(r.pages) - r.shared_pages for r in self.running))}
        if self.radix is not None:
            out["radix"] = self.radix.stats()
        if self.hicache is not None:
            out["hicache"] = dict(self.hicache.stats, free_host_pages=self.hicache.allocator.num_free,
                                  host_pages=self.hicache.allocator.capacity)
        return out
