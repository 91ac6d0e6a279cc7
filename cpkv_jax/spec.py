"""NextN (EAGLE-style) speculative decoding with the checkpoint's MTP layer. After every target step the
draft model extends its own KV over the step's lanes and proposes a chain of num_draft_tokens tokens;
a decode step is a verify round: one executable (cpkv_jax.runner.run_round) runs the target step over
each request's last token and its drafts with the acceptance (greedy match or rejection sampling),
the draft extend over the same lanes and, on one rank, the chain of the next drafts, which stay on the
device for the next round; the host reads the round's results once. Under CP (or with the trace's
per-layer probes) the chain runs after the read, one dispatch per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.batch import BatchBuilder, bucket
from cpkv_jax.cp import CPPlan, CPRequest
from cpkv_jax.runner import ModelRunner
from cpkv_jax.sampling import is_stochastic
from cpkv_jax.scheduler import Chunk, Request, Scheduler, TokenEvent


def samples(reqs: list[Request]) -> bool:
    """Whether any of the requests samples (its drafts then carry their distributions): the sampler's
    own rule (sampling.is_stochastic) over their temperatures."""
    return is_stochastic([r.params.temperature for r in reqs])


@dataclasses.dataclass
class Round:
    """A verify round dispatched to the device whose results the host has not read yet."""
    reqs: list[Request]
    verified: list                  # what the host reads: accepted counts, tokens, log-probabilities, ...
    top_n: int
    split_chain: tuple | None       # under CP: (the extend's MTP hidden, distributions) for the chain after the read


class SpecDecoder:
    """One engine's speculative decoding: the draft extend that follows each target step and the
    verify round that replaces a plain decode step."""

    def __init__(self, runner: ModelRunner, batch_builder: BatchBuilder, scheduler: Scheduler, *,
                 num_draft_tokens: int, attn_path: str | None, token_rows: int):
        """`token_rows`: where speculative decoding's rows of the runner's token buffer begin: two
        regions of num_draft_tokens x max_running rows for the draft chains' proposals (prefill steps'
        chains, verify rounds' chains), then max_running rows for each request's token after its
        accepted drafts and max_running for the position after it (`rows`)."""
        self.runner = runner
        self.batch_builder = batch_builder
        self.scheduler = scheduler
        self.num_draft_tokens = num_draft_tokens
        self.attn_path = attn_path
        self.stride = batch_builder.config.max_running
        self.token_rows = token_rows
        self.round_rows = token_rows + num_draft_tokens * self.stride
        self.keep_rows = (token_rows + 2 * num_draft_tokens * self.stride,
                          token_rows + (2 * num_draft_tokens + 1) * self.stride)

    @staticmethod
    def rows(num_draft_tokens: int, max_running: int) -> int:
        """Rows of the token buffer speculative decoding keeps (see __init__)."""
        return (2 * num_draft_tokens + 2) * max_running

    @property
    def fused_chain(self) -> bool:
        """The chain runs in the round's executable: one rank (a chain step's lanes are placed by the
        device's positions) and no per-layer probes (one forward per executable for the trace)."""
        return self.runner.cp == 1 and not self.runner.taps

    def extend(self, chunks: list[Chunk], plan: CPPlan, requests: list[CPRequest], hidden) -> None:
        """MTP over the lanes of a target step (hidden rows stay where they were computed; the MTP input
        at position i is (h_i, token i+1)) with the first proposal of every row in the same executable,
        then, for requests that have a next token to draft for, n-1 chain steps; their drafts are read
        at the chain's end."""
        next_tokens = [ch.req.tokens()[ch.start + 1:ch.start + len(ch.tokens) + 1] for ch in chunks]
        step = self.batch_builder.build(chunks, True, plan, requests, next_tokens, lanes=hidden.shape[1])
        live = [i for i, ch in enumerate(chunks) if not ch.req.prefilling and ch.req.finish_reason is None]
        position = np.zeros(step.rows, np.int32)   # of each live request's first draft
        position[live] = [chunks[i].req.seq_len for i in live]
        x_last, *head = self.runner.draft_forward(
            hidden, step.batch.tokens, step.batch, step.last_lane, attn_path=self.attn_path, last_rank=step.last_rank,
            page_aligned=plan.page_aligned, propose=self._first_proposal(chunks, step.rows, position))
        if live:
            self._propose(chunks, live, head, x_last)

    def _first_proposal(self, chunks, rows: int, position) -> tuple:
        """The extend's `propose` argument (ModelRunner.draft_forward): every row of the step proposes
        (only the live ones' proposals are used), into the first rows of the chain's region."""
        return (self.token_rows, np.arange(rows) < len(chunks),
                self.batch_builder.sampling("propose", [ch.req for ch in chunks], rows), position)

    def _propose(self, chunks, live, head, x_last):
        """The chain after a prefill step's extend (_chain), its drafts brought to the host at its end: a
        request handed over to another engine (cpkv_jax.pd) takes them along, and the region is free for
        the next step's chains."""
        first, *rest = jax.device_get([head[0]] + self._chain(chunks, live, head[1], x_last, self.token_rows))
        for i, b in enumerate(live):
            chunks[b].req.drafts = [int(first[b])] + [int(d[i]) for d in rest]

    def _chain(self, chunks, live, q_first, x_last, first: int) -> list:
        """From the extend's first proposal of each row (kept in the token buffer at rows first + row;
        `q_first`: their distributions [rows, V], None when no row samples), chain: each MTP step takes
        its own last hidden and the token just proposed, one position further, read on the device, and
        proposes the next one in the same executable. Proposal k > 0 of live request i stays in the
        token buffer at row first + k * max_running + i; each request's drafts are set as -1 - row (the
        next verify round reads them there), their distributions as (q [live, n, V], i) when one of
        them samples. Returns the chain's proposals [rows] per step."""
        n, stride = self.num_draft_tokens, self.stride
        reqs = [chunks[b].req for b in live]
        for i, (b, r) in enumerate(zip(live, reqs)):
            r.drafts = [-1 - (first + b)] + [-1 - (first + k * stride + i) for k in range(1, n)]
        proposals, dists = [], []
        if n > 1:
            B = self.batch_builder.rows(len(reqs))
            pad = B - len(reqs)
            params = self.batch_builder.sampling("propose", reqs, B)
            x = jnp.pad(x_last[jnp.asarray(live)], ((0, pad), (0, 0)))
            for k in range(1, n):
                step = self.batch_builder.build([Chunk(r, r.seq_len - 2 + k, [r.drafts[k - 1]]) for r in reqs], False)
                pos = np.array([r.seq_len + k for r in reqs] + [0] * pad, np.int32)  # of the drafted token
                x, d, q = self.runner.draft_forward(
                    x, step.batch.tokens, step.batch, step.last_lane, attn_path="absorbed", last_rank=step.last_rank,
                    page_aligned=step.plan.page_aligned,
                    propose=(first + k * stride, np.arange(B) < len(reqs), params, pos))
                proposals.append(d)
                dists.append(q)
        q = jnp.stack([q_first[jnp.asarray(live)]] + [d[:len(reqs)] for d in dists], axis=1) if samples(reqs) else None
        for i, r in enumerate(reqs):
            r.draft_q = None if q is None else (q, i)
        return proposals

    def _draft_probs(self, reqs: list[Request], rows: int):
        """The round's draft distributions as run_round takes them: (q [rows, n, V] or the previous
        round's, the row of each request there (-1: none, a greedy request's)), or None when no
        request samples (the greedy round, which reads none)."""
        if not samples(reqs):
            return None
        q_rows = np.full(rows, -1, np.int32)
        arrays, offset = [], {}     # the distinct arrays the requests' distributions are in, end to end
        for b, r in enumerate(reqs):
            if r.draft_q is not None:
                src, row = r.draft_q
                if id(src) not in offset:
                    offset[id(src)] = sum(len(a) for a in arrays)
                    arrays.append(src)
                q_rows[b] = offset[id(src)] + row
        if len(arrays) == 1 and len(arrays[0]) == rows:   # the previous round's, as the last round ran
            return arrays[0], q_rows
        n, V = self.num_draft_tokens, self.runner.model.cfg.vocab_size
        every = jnp.concatenate(arrays) if arrays else jnp.zeros((1, n, V), jnp.float32)
        return every[jnp.asarray(np.maximum(q_rows, 0))], np.where(q_rows >= 0, np.arange(rows), -1)

    def launch(self, reqs: list[Request]) -> Round:
        """Dispatch a verify round: every request's drafts verified and accepted (greedy match or
        rejection sampling) in one target step, with the draft extend over the same lanes and its first
        proposals (each request's last kept lane is known on the device only; lanes past it write draft
        KV at positions no later query reads before a later step rewrites them) and, on one rank, the
        rest of the next drafts' chain, all in one dispatch that reads nothing. A request whose previous
        round is still running (the overlapped loop: `pending`) starts where that round's accepted
        tokens end, which only the device knows: its first token, drafts and start are read there, and
        its pages are allocated for the furthest start (n positions on)."""
        n, fused, stride = self.num_draft_tokens, self.fused_chain, self.stride
        chunks = [Chunk(r, r.seq_len, [-1 - r.token_slot] + r.drafts) if r.pending
                  else Chunk(r, r.seq_len - 1, [r.output[-1]] + r.drafts) for r in reqs]
        reach = (n - 1 + n * any(r.pending for r in reqs)) if fused else 0
        step = self.batch_builder.build(chunks, False, lanes=bucket(n + 1, 1, 2 * (n + 1)), reach=reach)
        B, plan = step.rows, step.plan
        rank_idx, lane_idx = np.zeros((B, n + 1), np.int32), np.zeros((B, n + 1), np.int32)
        lane_token = np.full(step.batch.tokens.shape, -1, np.int32)
        for b in range(len(reqs)):
            rank_idx[b], lane_idx[b] = plan.lanes(b)
            lane_token[rank_idx[b] * B + b, lane_idx[b]] = np.arange(n + 1)
        drafts = np.zeros((B, n), np.int32)
        drafts[:len(reqs)] = [r.drafts for r in reqs]
        start = np.zeros(B, np.int32)
        start[:len(reqs)] = [-1 - (r.token_slot + stride) if r.pending else r.seq_len - 1 for r in reqs]
        top_n = self.batch_builder.top_logprobs_width(reqs)
        verified, (x_last, _, dists) = self.runner.round(
            step.batch, step.last_lane, start, (rank_idx, lane_idx, lane_token, drafts), self._draft_probs(reqs, B),
            self.batch_builder.sampling("verify", reqs, B, top_n), len(reqs), self.round_rows, self.keep_rows,
            stride=stride, chain=n - 1 if fused else 0, placed=fused, attn_path=self.attn_path,
            last_rank=step.last_rank, page_aligned=plan.page_aligned, top_n=top_n)
        for b, r in enumerate(reqs):
            r.pending, r.token_slot = r.pending + 1, self.keep_rows[0] + b
        if fused:
            self._keep_drafts(reqs, dists)
        *verified, target = verified
        if any(r.logits is not None for r in reqs):
            verified.append(target)
        return Round(reqs, verified, top_n, None if fused else (x_last, dists))

    def take(self, rnd: Round) -> list[TokenEvent]:
        """Read a round's results (its one device-to-host read) and hand the emitted tokens to the
        scheduler, which releases the pages of rejected positions but those a newer round of the
        request, still running, may write (up to 2n - 1 past its start, where this round's kept KV
        ends). A request that finished or was aborted since the launch drops its tokens. Under CP the
        chain of the requests still running follows the read."""
        a, _, emitted, lps, top_ids, top_lps, *host_target = jax.device_get(rnd.verified)
        chunks = [Chunk(r, r.seq_len - 1, []) for r in rnd.reqs]
        for r in rnd.reqs:
            r.pending -= 1
        tokens = [emitted[b, :a[b] + 1].tolist() if r.finish_reason is None else [] for b, r in enumerate(rnd.reqs)]

        def chain_kept(taken):
            """The next drafts of the requests still running, from the extend's last kept lanes."""
            x_last, dists = rnd.split_chain
            live = [i for i, ch in enumerate(chunks) if ch.req.finish_reason is None]
            if live:
                self._chain(chunks, live, None if dists is None else dists[:, 0], x_last, self.round_rows)

        return self.scheduler.complete_step(chunks, tokens, lps, host_target[0] if host_target else None,
                                            top=[top_ids, top_lps] if rnd.top_n else None, verified=True,
                                            before_release=None if rnd.split_chain is None else chain_kept,
                                            in_flight_reach=2 * self.num_draft_tokens - 1)

    def _keep_drafts(self, reqs: list[Request], dists) -> None:
        """Each request's next drafts where a fused round's chain kept them (token buffer rows
        round_rows + k * max_running + row) and their distributions (dists [B, n, V], None when none
        samples)."""
        for b, r in enumerate(reqs):
            r.drafts = [-1 - (self.round_rows + k * self.stride + b) for k in range(self.num_draft_tokens)]
            r.draft_q = None if dists is None else (dists, b)
