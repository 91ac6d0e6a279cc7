"""Sampling parameters and the per-request token choice (jitted, batched). Greedy is argmax; seeded
sampling draws from a key derived from (seed, position), so a request's tokens do not depend on what
else is in its batch or on how its steps were scheduled."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """Invalid sampling parameters."""


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

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
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
        return self


def _sample_rows(logits, temperature, top_p, top_k, seed, position):
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (cum_before < top_p[:, None])  # always keeps the most likely token
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


@jax.jit
def sample_tokens(logits, temperature, top_p, top_k, seed, position):
    """logits [B, V] fp32; per-request temperature/top_p/top_k/seed/position [B]. Returns token ids [B]
    and their log-probabilities under the unmodified distribution. An all-greedy batch skips the
    vocabulary sort (lax.cond runs one branch)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = jax.lax.cond(jnp.any(temperature > 0), _sample_rows, lambda *a: greedy,
                           logits, temperature, top_p, top_k, seed, position)
    tokens = jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
