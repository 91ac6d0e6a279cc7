"""Shared test helpers: HF fixtures, error metric, prompts with shared prefixes, HiCache invariants."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"


def rel_err(a, b) -> float:
    """max |a - b| / max |b| — the metric every parity assertion reports."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same_greedy_outputs(got, want, tol: float = 1e-5) -> float:
    """Engine outputs (generate(..., return_logits=True)) of one run against a baseline's: the same
    greedy tokens and logits within `tol` (relative); returns the worst relative error."""
    errs = [rel_err(np.stack(g.logits), np.stack(w.logits)) for g, w in zip(got, want)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
    assert max(errs) <= tol, max(errs)
    return max(errs)


@lru_cache(maxsize=None)
def hf_model(name: str, dtype: str | None = None):
    from models.weights import load_hf
    return load_hf(FIXTURES / name, dtype)


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def shared_prefix_prompts(rng, vocab, n_systems=3, n_suffixes=4):
    systems = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(33, 80, n_systems)]
    suffixes = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(1, 40, n_suffixes)]
    return [s + u for s in systems for u in suffixes]


def random_prompts(rng, lengths, vocab):
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def pool_is_clean(engine) -> bool:
    """Nothing running or waiting, no page held by a request, reserved or locked, every page free or held
    by the prefix cache, no stream inbox left behind."""
    s = engine.stats()
    return (s["running"] == s["waiting"] == 0 and s["request_pages"] == s["reserved_pages"] == 0
            and s["radix"]["protected_pages"] == 0 and s["free_pages"] + s["radix"]["pages"] == s["total_pages"]
            and not engine._inboxes)


def wait_idle(engine_loop, timeout: float = 60) -> None:
    """Until a server's engine thread (cpkv_jax.server.EngineLoop) has nothing in flight: no subscriber,
    no unfinished request, no queued command (aborts are asynchronous)."""
    import time
    deadline = time.time() + timeout
    while engine_loop.subscribers or engine_loop.engine.has_unfinished() or engine_loop.commands.qsize():
        assert time.time() < deadline, "requests still in flight"
        time.sleep(0.05)


def check_hicache_invariants(eng):
    """Device pages: free + tree + requests = all; host pages: tree + in flight + free = all."""
    s = eng.stats()
    assert s["free_pages"] + s["radix"]["pages"] + s["request_pages"] == s["total_pages"]
    eng.hicache.check()


def glm5_kernel_slice(**over):
    """(model, wide, run): a bf16 GLM-5-shaped model at the GPU kernels' shapes (hidden 1024, 64 experts,
    top-8, 3 layers; `over` changes the config), the same weights widened to fp32 (fp8 ones stay fp8,
    dequantized at use), and run(model, **policy) -> its teacher-forced logits on 2 x 200 random
    tokens (absorbed attention, KernelPolicy(**policy))."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.config import ModelConfig
    from models.model import DsaModel, prefill_logits
    from pallas_kernels.policy import KernelPolicy
    cfg = ModelConfig.named("glm-5", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=64,
                            hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048, vocab_size=4096,
                            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, index_n_heads=32,
                            index_topk=64, **over)
    model = DsaModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    wide = nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, state))
    wide.dtype = jnp.float32
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 200))

    def run(m, **policy):
        return np.asarray(prefill_logits(m, tokens, attn_path="absorbed", kernels=KernelPolicy(**policy)))
    return model, wide, run
