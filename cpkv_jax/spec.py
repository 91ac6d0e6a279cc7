"""NextN (EAGLE-style) speculative decoding with the checkpoint's MTP layer. After every target step the
draft model extends its own KV over the step's lanes and proposes a chain of num_draft_tokens tokens;
a decode step is a verify round: one target step over each request's last token and its drafts with
the acceptance (greedy match or rejection sampling) in the same executable, the draft extend over the
same lanes dispatched behind it, one read of the round's results, then the chain of the next drafts,
which stay on the device for the next round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.batch import BatchBuilder, bucket
from cpkv_jax.cp import CPPlan, CPRequest
from cpkv_jax.runner import ModelRunner
from cpkv_jax.scheduler import Chunk, Request, Scheduler, TokenEvent


class SpecDecoder:
    """One engine's speculative decoding: the draft extend that follows each target step and the
    verify round that replaces a plain decode step."""

    def __init__(self, runner: ModelRunner, batch_builder: BatchBuilder, scheduler: Scheduler, *,
                 num_draft_tokens: int, attn_path: str | None, token_rows: int):
        """`token_rows`: where the draft chains keep their proposals in the runner's token buffer (two
        regions of num_draft_tokens x max_running rows: prefill steps' chains, verify rounds' chains)."""
        self.runner = runner
        self.batch_builder = batch_builder
        self.scheduler = scheduler
        self.num_draft_tokens = num_draft_tokens
        self.attn_path = attn_path
        self.token_rows = token_rows

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
        first, *rest = jax.device_get([head[0]] + self._chain(chunks, live, head, x_last, self.token_rows))
        for i, b in enumerate(live):
            chunks[b].req.drafts = [int(first[b])] + [int(d[i]) for d in rest]

    def _chain(self, chunks, live, head, x_last, first: int) -> list:
        """From the extend's first proposal of each row (`head`: proposals [rows] and their
        distributions, kept in the token buffer at rows first + row), chain: each MTP step takes its own
        last hidden and the token just proposed, one position further, read on the device, and proposes
        the next one in the same executable. Proposal k > 0 of live request i stays in the token buffer
        at row first + k * max_running + i; each request's drafts are set as -1 - row (the next verify
        round reads them there). Returns the chain's proposals [rows] per step."""
        n, stride = self.num_draft_tokens, self.batch_builder.config.max_running
        reqs = [chunks[b].req for b in live]
        for i, (b, r) in enumerate(zip(live, reqs)):
            r.drafts = [-1 - (first + b)] + [-1 - (first + k * stride + i) for k in range(1, n)]
            r.draft_q = [head[1][b]]
        if n == 1:
            return []
        B = self.batch_builder.rows(len(reqs))
        pad = B - len(reqs)
        params = self.batch_builder.sampling("propose", reqs, B)
        x = jnp.pad(x_last[jnp.asarray(live)], ((0, pad), (0, 0)))
        proposals = []
        for k in range(1, n):
            step = self.batch_builder.build([Chunk(r, r.seq_len - 2 + k, [r.drafts[k - 1]]) for r in reqs], False)
            pos = np.array([r.seq_len + k for r in reqs] + [0] * pad, np.int32)  # position of the drafted token
            x, d, q = self.runner.draft_forward(x, step.batch.tokens, step.batch, step.last_lane, attn_path="absorbed",
                                                last_rank=step.last_rank, page_aligned=step.plan.page_aligned,
                                                propose=(first + k * stride, np.arange(B) < len(reqs), params, pos))
            proposals.append(d)
            for i, r in enumerate(reqs):
                r.draft_q.append(q[i])
        return proposals

    def round(self, reqs: list[Request]) -> list[TokenEvent]:
        """Verify every request's drafts and accept them (greedy match or rejection sampling) in one
        target step; dispatch the draft extend over the same lanes with the first proposals (each
        request's last kept lane is known on the device only; lanes past it write draft KV at
        positions no later query reads before a later step rewrites them); then read the round's
        results (its one device-to-host read), hand the emitted tokens to the scheduler (which releases
        the pages of rejected positions) and chain the next drafts, which stay on the device."""
        n = self.num_draft_tokens
        chunks = [Chunk(r, r.seq_len - 1, [r.output[-1]] + r.drafts) for r in reqs]
        step = self.batch_builder.build(chunks, False, lanes=bucket(n + 1, 1, 2 * (n + 1)))
        B, plan = step.rows, step.plan
        rank_idx, lane_idx = np.zeros((B, n + 1), np.int32), np.zeros((B, n + 1), np.int32)
        lane_token = np.full(step.batch.tokens.shape, -1, np.int32)
        for b in range(len(reqs)):
            rank_idx[b], lane_idx[b] = plan.lanes(b)
            lane_token[rank_idx[b] * B + b, lane_idx[b]] = np.arange(n + 1)
        q = jnp.stack([jnp.stack(r.draft_q) for r in reqs])
        q = jnp.pad(q, ((0, B - len(reqs)), (0, 0), (0, 0)))
        drafts = np.zeros((B, n), np.int32)
        drafts[:len(reqs)] = [r.drafts for r in reqs]
        position = np.array([r.seq_len for r in reqs] + [0] * (B - len(reqs)), np.int32)
        top_n = self.batch_builder.top_logprobs_width(reqs)
        verified, hidden, (next_tokens, last_lane, last_rank, next_position) = self.runner.forward(
            step.batch, step.last_lane, attn_path=self.attn_path, output="logits_hidden", last_rank=step.last_rank,
            page_aligned=plan.page_aligned,
            verify=(rank_idx, lane_idx, lane_token, drafts, q, self.batch_builder.sampling("verify", reqs, B, top_n),
                    position, top_n))
        first = self.token_rows + n * self.batch_builder.config.max_running   # the verify rounds' chain region
        x_last, *head = self.runner.draft_forward(
            hidden, next_tokens, dataclasses.replace(step.batch, tokens=next_tokens), last_lane,
            attn_path=self.attn_path, last_rank=last_rank, page_aligned=plan.page_aligned,
            propose=(first,) + self._first_proposal(chunks, B, next_position)[1:])
        *verified, target = verified
        if any(r.logits is not None for r in reqs):
            verified.append(target)
        a, _, emitted, lps, top_ids, top_lps, *host_target = jax.device_get(verified)

        def chain_kept(taken):
            """The next drafts of the requests still running, from the extend's last kept lanes."""
            live = [i for i, ch in enumerate(chunks) if ch.req.finish_reason is None]
            if live:
                self._chain(chunks, live, head, x_last, first)

        return self.scheduler.complete_step(chunks, [emitted[b, :a[b] + 1].tolist() for b in range(len(reqs))], lps,
                                            host_target[0] if host_target else None,
                                            top=[top_ids, top_lps] if top_n else None, verified=True,
                                            before_release=chain_kept)
