"""NextN (EAGLE-style) speculative decoding with the checkpoint's MTP layer. After every target step the
draft model extends its own KV over the step's lanes and proposes a chain of num_draft_tokens tokens;
a decode step is a verify round: one target step over each request's last token and its drafts,
acceptance (greedy match or rejection sampling), then the draft extend over the kept positions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cpkv_jax.batch import BatchBuilder, bucket
from cpkv_jax.cp import CPPlan, CPRequest
from cpkv_jax.runner import ModelRunner
from cpkv_jax.sampling import verify_tokens
from cpkv_jax.scheduler import Chunk, Request, Scheduler, TokenEvent


class SpecDecoder:
    """One engine's speculative decoding: the draft extend that follows each target step and the
    verify round that replaces a plain decode step."""

    def __init__(self, runner: ModelRunner, batch_builder: BatchBuilder, scheduler: Scheduler, *,
                 num_draft_tokens: int, attn_path: str | None, token_rows: int):
        """`token_rows`: where the draft chain keeps its proposals in the runner's token buffer."""
        self.runner = runner
        self.batch_builder = batch_builder
        self.scheduler = scheduler
        self.num_draft_tokens = num_draft_tokens
        self.attn_path = attn_path
        self.token_rows = token_rows

    def extend(self, chunks: list[Chunk], plan: CPPlan, requests: list[CPRequest], hidden) -> None:
        """MTP over the lanes of a target step (hidden rows stay where they were computed; the MTP input
        at position i is (h_i, token i+1)), then, for requests that have a next token to draft for, the
        first proposal and n-1 chain steps."""
        next_tokens = [ch.req.tokens()[ch.start + 1:ch.start + len(ch.tokens) + 1] for ch in chunks]
        step = self.batch_builder.build(chunks, True, plan, requests, next_tokens, lanes=hidden.shape[1])
        dlogits, x_last = self.runner.draft_forward(hidden, step.batch.tokens, step.batch, step.last_lane,
                                                    attn_path=self.attn_path, last_rank=step.last_rank,
                                                    page_aligned=plan.page_aligned)
        live = [i for i, ch in enumerate(chunks) if not ch.req.prefilling and ch.req.finish_reason is None]
        if live:
            self._propose(chunks, live, dlogits, x_last)

    def _propose(self, chunks, live, dlogits, x_last):
        """Draw the first draft from the extend's logits, then chain: each MTP step takes its own last
        hidden and the token it just proposed, one position further, read on the device (the chain's
        proposals reach the host once, at its end)."""
        n, first = self.num_draft_tokens, self.token_rows
        reqs = [chunks[i].req for i in live]
        for r in reqs:
            r.draft_q = []
        idx = jnp.asarray(live)
        dlogits, x_last = dlogits[idx], x_last[idx]
        proposals = []
        for k in range(n):
            B = self.batch_builder.rows(len(reqs))
            pad = B - len(reqs)
            pos = np.array([r.seq_len + k for r in reqs] + [0] * pad, np.int32)  # position of the drafted token
            dl = jnp.pad(dlogits, ((0, pad), (0, 0)))
            d, q = self.runner.propose(first, dl, *self.batch_builder.sampling("propose", reqs, B), pos)
            proposals.append(d[:len(reqs)])
            for i, r in enumerate(reqs):
                r.draft_q.append(q[i])
            if k == n - 1:
                break
            step = self.batch_builder.build([Chunk(r, r.seq_len - 1 + k, [-1 - (first + i)])
                                             for i, r in enumerate(reqs)], False)
            xs = jnp.pad(x_last, ((0, step.rows - len(reqs)), (0, 0)))
            dlogits, x_last = self.runner.draft_forward(xs, step.batch.tokens, step.batch, step.last_lane,
                                                        attn_path="absorbed", last_rank=step.last_rank,
                                                        page_aligned=step.plan.page_aligned)
            dlogits, x_last = dlogits[:len(reqs)], x_last[:len(reqs)]
        drafts = np.asarray(jnp.stack(proposals, axis=1))
        for i, r in enumerate(reqs):
            r.drafts = drafts[i].tolist()

    def round(self, reqs: list[Request]) -> list[TokenEvent]:
        """Verify every request's drafts in one target step, accept (greedy match or rejection
        sampling), hand the emitted tokens to the scheduler (which releases the pages of rejected
        positions), re-extend the draft over the kept positions and propose the next drafts."""
        n = self.num_draft_tokens
        chunks = [Chunk(r, r.seq_len - 1, [r.output[-1]] + r.drafts) for r in reqs]
        step = self.batch_builder.build(chunks, False, lanes=bucket(n + 1, 1, 2 * (n + 1)))
        B, plan = step.rows, step.plan
        logits, hidden = self.runner.forward(step.batch, step.last_lane, attn_path=self.attn_path,
                                             output="logits_hidden", last_rank=step.last_rank,
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
        top_n = self.batch_builder.top_logprobs_width(reqs)
        a, tok, lps, *top = verify_tokens(target, q, jnp.asarray(drafts),
                                          *self.batch_builder.sampling("verify", reqs, B, top_n),
                                          jnp.asarray(position), top_n=top_n)
        a, tok, lps = np.asarray(a), np.asarray(tok), np.asarray(lps)
        host_target = np.asarray(target) if any(r.logits is not None for r in reqs) else None
        emitted = [r.drafts[:a[b]] + [int(tok[b])] for b, r in enumerate(reqs)]

        def extend_kept(taken):
            """Draft KV over the kept positions (next token of each: the emitted tokens), from the verify's hidden."""
            kept_plan, kept_requests = plan.truncated(step.requests, taken)
            self.extend([Chunk(ch.req, ch.start, ch.tokens[:k]) for ch, k in zip(chunks, taken)], kept_plan,
                        kept_requests, hidden)

        return self.scheduler.complete_step(chunks, emitted, lps, host_target,
                                            top=[np.asarray(x) for x in top] if top_n else None, verified=True,
                                            before_release=extend_kept)
