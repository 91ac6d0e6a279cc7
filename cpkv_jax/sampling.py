"""Sampling parameters and the per-request token choice (jitted, batched). Greedy is argmax; seeded
sampling draws from a key derived from (seed, position), so a request's tokens do not depend on what
else is in its batch or on how its steps were scheduled."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """Invalid sampling parameters."""


MAX_TOP_LOGPROBS = 20   # alternatives per token a request may ask for (OpenAI's chat limit)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# The type check of each field, by its annotation: the dataclass is the one schema.
_FIELD_TYPES = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, (float, np.floating)), "a number"),
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "tuple[int, ...]": (lambda v: isinstance(v, (tuple, list)) and all(_is_int(t) for t in v),
                        "a list or tuple of integer token ids"),
    "tuple[str, ...]": (lambda v: isinstance(v, (tuple, list)) and all(isinstance(t, str) for t in v),
                        "a list or tuple of strings"),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0       # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0                 # 0 -> no top-k cut
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False       # do not stop at the model's eos token(s)
    logprobs: bool = False         # return each sampled token's log-probability
    stop: tuple[str, ...] = ()     # stop strings: matched on the decoded text, which is cut before the first
    n: int = 1                     # samples per prompt, drawn with seeds seed, seed + 1, ... (see samples())
    top_logprobs: int = 0          # the most likely alternatives (and their log-probabilities) per token
    prompt_logprobs: bool = False  # log-probability of each prompt token given the ones before (the first: None)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """These parameters with stop_token_ids / stop as tuples, or SamplingError naming the first field
        of the wrong type (by its annotation) or out of range."""
        for f in dataclasses.fields(self):
            check, what = _FIELD_TYPES[f.type]
            v = getattr(self, f.name)
            if not check(v):
                raise SamplingError(f"{f.name} must be {what}, got {v!r:.80} ({type(v).__name__})")
        if not isinstance(self.stop_token_ids, tuple) or not isinstance(self.stop, tuple):
            return dataclasses.replace(self, stop_token_ids=tuple(int(t) for t in self.stop_token_ids),
                                       stop=tuple(self.stop)).validate(vocab_size)
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
            raise SamplingError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids {list(self.stop_token_ids)} outside [0, {vocab_size})")
        if "" in self.stop:
            raise SamplingError(f"stop strings must be non-empty, got {list(self.stop)!r:.80}")
        if self.n < 1 or self.seed + self.n > 2 ** 32:
            raise SamplingError(f"n must be an integer >= 1 with seed + n <= 2**32 (the samples' seeds are seed, "
                                f"seed + 1, ...), got n={self.n!r} with seed={self.seed!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise SamplingError("top_logprobs needs logprobs=True or prompt_logprobs=True (the tokens whose "
                                "alternatives to return)")
        return self

    def samples(self) -> list["SamplingParams"]:
        """The n requests these parameters stand for: n = 1 each, seeds seed, seed + 1, ..."""
        return [dataclasses.replace(self, n=1, seed=self.seed + i) for i in range(self.n)]


def _truncated(logits, temperature, top_p, top_k):
    """(order, sorted logits / temperature with everything outside top-k / top-p at -inf) per row."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (cum_before < top_p[:, None])  # always keeps the most likely token
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def _key(seed, position, salt: int):
    """The random key of a request's draw at `position`; salts separate the draws of one position."""
    k = jax.random.fold_in(jax.random.key(seed), position)
    return k if salt == 0 else jax.random.fold_in(k, salt)


def _unsorted(order, values, fill):
    """Rows of `values` given in `order` (per row), put back in vocabulary order."""
    B = values.shape[0]
    return jnp.full_like(values, fill).at[jnp.arange(B)[:, None], order].set(values)


def _sample_rows(logits, temperature, top_p, top_k, seed, position):
    """The draw: one Gumbel per vocabulary entry, in vocabulary order, so two near-equal logits that
    rounding noise (another batch's shapes) sorts the other way round do not change the token drawn."""
    order, masked = _truncated(logits, temperature, top_p, top_k)
    keys = jax.vmap(lambda s, p: _key(s, p, 0))(seed, position)
    return jax.vmap(jax.random.categorical)(keys, _unsorted(order, masked, -jnp.inf))


def _top(logprobs, n: int):
    """The n largest log-probabilities over the last axis and their token ids (n static; 0: empty)."""
    if n == 0:
        shape = logprobs.shape[:-1] + (0,)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, logprobs.dtype)
    values, ids = jax.lax.top_k(logprobs, n)
    return ids.astype(jnp.int32), values


def is_stochastic(temperature) -> bool:
    """Whether a batch's host-side temperatures [B] sample any row (sample_tokens' `stochastic`)."""
    return bool(np.any(np.asarray(temperature) > 0))


@functools.partial(jax.jit, static_argnames=("top_n", "stochastic"))
def sample_tokens(logits, temperature, top_p, top_k, seed, position, *, top_n: int = 0, stochastic: bool = True):
    """logits [B, V] fp32; per-request temperature/top_p/top_k/seed/position [B]. Returns token ids [B],
    their log-probabilities under the unmodified distribution, and the top_n alternatives of each row
    under the same log-softmax (ids and log-probabilities [B, top_n]). stochastic=False (the caller
    knows every temperature is 0, `is_stochastic`) compiles the greedy argmax alone, without the
    vocabulary sort. A static flag, not a lax.cond on the temperatures: on the GPU a conditional
    copies its predicate to the host and waits for it, which would stall the overlapped loop's
    dispatch until the step before had run."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    if stochastic:
        sampled = _sample_rows(logits, temperature, top_p, top_k, seed, position)
        tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    else:
        tokens = greedy.astype(jnp.int32)
    return (tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]) + _top(logprobs, top_n)


@functools.partial(jax.jit, static_argnames=("top_n",))
def position_logprobs(logits, rank, lane, targets, *, top_n: int = 0):
    """Log-probabilities of given tokens from a step's every-position logits [B, T, V] (under CP
    [cp, B, T, V]): row b's entries j read rank[b, j], lane lane[b, j] (rank ignored without CP).
    Returns the log-probability of targets [B, L] and the top_n alternatives ([B, L, top_n] ids and
    log-probabilities), all under one log-softmax, on the device."""
    if logits.ndim == 3:
        logits = logits[None]
    picked = logits[rank, jnp.arange(logits.shape[1])[:, None], lane]
    logprobs = jax.nn.log_softmax(picked, axis=-1)
    return (jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0],) + _top(logprobs, top_n)


def token_probs(logits, temperature, top_p, top_k):
    """The distribution a request samples from [B, V]: temperature, top-k, top-p; greedy rows
    (temperature 0) one-hot at the argmax."""
    order, masked = _truncated(logits, temperature, top_p, top_k)
    probs = _unsorted(order, jax.nn.softmax(masked, axis=-1), 0.0)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=logits.dtype)
    return jnp.where((temperature > 0)[:, None], probs, onehot)


@functools.partial(jax.jit, static_argnames=("stochastic",))
def propose_tokens(draft_logits, temperature, top_p, top_k, seed, position, *, stochastic: bool = True):
    """Draft proposals [B] and the distributions q [B, V] they were drawn from (greedy: argmax).
    stochastic=False (no row samples, `is_stochastic`): the argmax alone and no q, which a greedy
    row's verification never reads (verify_tokens)."""
    greedy = jnp.argmax(draft_logits, axis=-1)
    if not stochastic:
        return greedy.astype(jnp.int32), None
    q = token_probs(draft_logits, temperature, top_p, top_k)
    keys = jax.vmap(lambda s, p: _key(s, p, 3))(seed, position)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q))
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32), q


@functools.partial(jax.jit, static_argnames=("top_n", "stochastic"))
def verify_tokens(target_logits, draft_probs, drafts, temperature, top_p, top_k, seed, position, *, top_n: int = 0,
                  stochastic: bool = True):
    """Speculative acceptance. target_logits [B, n+1, V]: lane j predicts the token after drafts[:j];
    draft_probs [B, n, V]: the distributions the drafts were drawn from; drafts [B, n]; position [B]:
    the position of drafts[:, 0]. Greedy rows accept while the draft equals the target's argmax;
    sampling rows accept draft j with probability min(1, p/q) and on the first rejection draw from
    normalize(max(p - q, 0)) (after n acceptances: from p), which leaves the output distributed
    exactly as plain sampling from p. stochastic=False (no row samples): the greedy rule alone, no
    draft_probs (None), none of the sampling rows' sorts and draws compiled. Returns (accepted count a
    [B], the token after the accepted drafts [B], target log-probabilities of drafts and that token
    [B, n+1], and the top_n alternatives of each lane: ids and log-probabilities [B, n+1, top_n])."""
    B, n1, V = target_logits.shape
    n = n1 - 1
    rows = jnp.arange(B)
    argmax = jnp.argmax(target_logits, axis=-1)
    ok = drafts == argmax[:, :n]
    if stochastic:
        rep = lambda x: jnp.repeat(x, n1)  # noqa: E731
        p = token_probs(target_logits.reshape(B * n1, V), rep(temperature), rep(top_p), rep(top_k)).reshape(B, n1, V)
        greedy = temperature <= 0
        p_d = jnp.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        pos = position[:, None] + jnp.arange(n)[None, :]
        u = jax.vmap(jax.vmap(lambda s, q: jax.random.uniform(_key(s, q, 1))))(
            jnp.broadcast_to(seed[:, None], pos.shape), pos)
        ok = jnp.where(greedy[:, None], ok, u * q_d < p_d)
    a = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    token = argmax[rows, a]
    if stochastic:
        p_a = p[rows, a]
        q_a = jnp.where((a < n)[:, None], draft_probs[rows, jnp.minimum(a, n - 1)], 0.0)
        resid = jnp.maximum(p_a - q_a, 0.0)
        total = resid.sum(-1, keepdims=True)
        resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_a)
        keys = jax.vmap(lambda s, q: _key(s, q, 2))(seed, position + a)
        drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(resid))
        token = jnp.where(greedy, token, drawn)
    token = token.astype(jnp.int32)
    chosen = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1).at[rows, a].set(token)
    target_logprobs = jax.nn.log_softmax(target_logits, axis=-1)
    logprobs = jnp.take_along_axis(target_logprobs, chosen[..., None], axis=-1)[..., 0]
    return (a, token, logprobs) + _top(target_logprobs, top_n)
