"""Two-batch overlap (EngineConfig(two_batch_overlap=True), models.model.MicroBatches): a forward's rows
as two micro-batches, each with its own hidden state and its own IndexCache top-k carried from layer to
layer, against the same forward in one piece; and the compiled schedule of the two micro-batches'
collectives on 8 simulated CPU devices."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import assert_same_greedy_outputs, rel_err


def _steps(tiny, tokens, more, micro_batches: int, attn_paths=("expanded", "absorbed")):
    """Every position's logits of a prefill of `tokens` [B, T] from an empty pool, then of an extend by
    `more` [B, T2] over it (reading the prefill's keys from the pool), and the pool after both."""
    from models.kv import contiguous_batch, empty_kv_cache
    from models.model import run_model_jit
    graphdef, state = nnx.split(tiny)
    B, T = tokens.shape
    width = 128
    cache = empty_kv_cache(tiny.cfg, 1 + B * width, tiny.dtype, "fp8")
    out = []
    for start, toks, path in ((0, tokens, attn_paths[0]), (T, more, attn_paths[1])):
        table = 1 + np.arange(B)[:, None] * width + np.arange(width)[None]
        batch = contiguous_batch(toks, start, slot_table=table)
        logits, cache = run_model_jit(graphdef, state, batch, cache, attn_path=path, output="logits",
                                      micro_batches=micro_batches)
        out.append(np.asarray(logits))
    return out, cache


@pytest.mark.parametrize("shape, axis", [((2, 48), 0), ((1, 64), 1)])
def test_micro_batches_equal_one_batch_with_the_index_cache(tiny, shape, axis):
    """The forward as two micro-batches — cut along the requests (B=2) or, for one request, along its
    lanes (the second half's attention reads the first half's keys, written earlier in the same layer)
    — equals the forward in one piece: every position's logits within 1e-5 (fp32) in a prefill longer
    than the indexer's top-k and an extend over it, and the same pool. The tiny model's layers 2 and 4
    reuse the top-k of the full layer before them (IndexCache), so a micro-batch whose top-k were not
    carried through the layers would attend elsewhere."""
    from models.kv import Batch
    from models.model import MicroBatches
    cfg = tiny.cfg
    assert set(cfg.full_layers) != set(range(cfg.num_hidden_layers))    # IndexCache: shared layers exist
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, cfg.vocab_size, shape).astype(np.int32)
    assert shape[1] > cfg.index_topk                                     # the top-k selects
    more = rng.integers(2, cfg.vocab_size, (shape[0], 4)).astype(np.int32)
    z = np.zeros(shape, np.int32)
    micro = MicroBatches.of(Batch(z, z, z, np.zeros((shape[0], 8), np.int32)), 2)
    assert micro.axis == axis and len(micro.parts) == 2
    want, want_cache = _steps(tiny, tokens, more, 1)
    got, got_cache = _steps(tiny, tokens, more, 2)
    for g, w in zip(got, want):
        err = rel_err(g, w)
        print(f"{shape}: rel err {err:.2e}")
        assert err <= 1e-5
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        assert rel_err(np.asarray(g, np.float32), np.asarray(w, np.float32)) <= 1e-5


@pytest.fixture(scope="module")
def one_device(tiny):
    """(prompts longer than the indexer's top-k, sampling params, their outputs on one device, no TBO)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, n).tolist() for n in (70, 9, 45, 100)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    return prompts, params, Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params,
                                                                                         return_logits=True)


@pytest.mark.parametrize("kw", [dict(),
                                 dict(max_running=1),
                                 dict(cp_size=2, ep_size=2, ep_dispatch="all_to_all"),
                                 dict(ep_size=4, ep_dispatch="all_to_all", speculative="nextn"),
                                 dict(ep_size=2, tp_size=2, speculative="nextn")])
def test_engine_with_two_batch_overlap_equals_one_device(tiny, one_device, kw):
    """EngineConfig(two_batch_overlap=True): greedy tokens equal and logits within 1e-5 of the one-device
    engine without it: on one device (batches of several requests cut along the requests; with
    max_running=1 every step one request, cut along its lanes), with CP x EP and the all-to-all
    dispatch, and with speculative decoding (the draft's MTP layer in micro-batches too) on EP and
    EP x TP meshes."""
    from cpkv_jax.engine import Engine, EngineConfig
    prompts, params, want = one_device
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, two_batch_overlap=True, **kw))
    assert eng.runner.micro_batches == 2
    print(kw, "rel err", assert_same_greedy_outputs(eng.generate(prompts, params, return_logits=True), want))


def test_two_batch_overlap_with_hicache_reloads(tiny):
    """TBO with the host tier's layer hook (side-stream copies, which see both micro-batches' rows at
    every layer boundary) on a CP x EP mesh: prompts backed up, evicted, every replica of the pool
    overwritten with noise, the prompts again (prefixes loaded back from host): greedy tokens equal and
    logits within 1e-5 of one device without TBO or a host tier."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from tests.helpers import shared_prefix_prompts
    from tests.test_mesh import _scramble_every_replica
    prompts = shared_prefix_prompts(np.random.default_rng(7), tiny.cfg.vocab_size, 2, 2)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = Engine(tiny, EngineConfig(page_size=16, kv_pages=64)).generate(prompts, params, return_logits=True)
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, hicache_pages=64, hicache_copy="side_stream",
                                    cp_size=2, ep_size=2, ep_dispatch="all_to_all", two_batch_overlap=True))
    eng.generate(prompts, params)
    eng.radix.evict(10 ** 9, eng.allocator.free, eng.scheduler._free_host)
    _scramble_every_replica(eng.pool, np.random.default_rng(8))
    got = eng.generate(prompts, params, return_logits=True)
    assert eng.hicache.stats["load_pages"] >= 4 and all(o.cached_tokens >= 16 for o in got), eng.hicache.stats
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert rel_err(np.stack(g.logits), np.stack(w.logits)) <= 1e-5
    assert not eng.runner.copier.errors and eng.hicache.stats["failed_backups"] == 0


def test_two_batch_overlap_is_refused_only_where_nothing_can_be_cut():
    """Under CP a step is cut along its requests only (a rank's lanes are not its request's positions
    in order), so CP with one request per step has nothing to cut: refused, saying why. One device
    with one request per step, or CP with several, is accepted."""
    from cpkv_jax.engine import EngineConfig, EngineConfigError
    with pytest.raises(EngineConfigError, match="two_batch_overlap with cp_size > 1 needs max_running >= 2"):
        EngineConfig(two_batch_overlap=True, cp_size=2, max_running=1).validate()
    with pytest.raises(EngineConfigError, match="two_batch_overlap must be True or False"):
        EngineConfig(two_batch_overlap=1).validate()
    EngineConfig(two_batch_overlap=True, max_running=1).validate()
    EngineConfig(two_batch_overlap=True, cp_size=2, max_running=2).validate()


COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute", "ragged-all-to-all")


def _schedule(hlo: str):
    """The layer scan's body of a compiled step, in its scheduled order: (micro-batch or None, 'attention'
    / 'mlp' / None, collective op or None, whether it is a matmul) per instruction."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
        elif line == "}":
            cur = None
        elif cur is not None:
            cur.append(line)
    fused = {name: any(" dot(" in ln or " convolution(" in ln for ln in body) for name, body in comps.items()}
    layer_scan = [ln for ln in hlo.splitlines()
                  if " while(" in ln and re.search(r'op_name="[^"]*/shard_map/while"', ln)]
    body = re.search(r"body=%([^,\s]+)", layer_scan[0]).group(1)
    out = []
    for line in comps[body]:
        m = re.match(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z\-]*)\(", line)
        if not m:
            continue
        op = m.group(2)
        name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        mb = re.search(r"/micro_batch(\d)/", name)
        part = "attention" if "/attention/" in name else "mlp" if "/mlp/" in name else None
        calls = re.search(r"calls=%([^,\s]+)", line)
        matmul = op in ("dot", "convolution") or (op == "fusion" and calls is not None and fused.get(calls.group(1)))
        out.append((int(mb.group(1)) if mb else None, part, op if op in COLLECTIVES else None, bool(matmul)))
    return out


def test_the_compiled_schedule_interleaves_the_micro_batches(tiny):
    """The compiled (scheduled) step with TBO over ep=2 and the all-to-all dispatch: in the layer scan's
    body, every span from a micro-batch's dispatch (its first all-to-all) to its combine (the
    all-gather of its combined rows) has matmuls of the other micro-batch scheduled inside it.

    What the CPU scheduler shows (XLA:CPU, jax 0.12): collectives are synchronous there and its
    scheduler minimizes memory, not latency. It runs the two micro-batches in lock step: their
    attentions interleaved op by op, then their MoEs the same way, so each micro-batch's all-to-alls
    sit between the other's MoE matmuls (router, experts) — but no attention matmul of the other
    micro-batch lands inside a dispatch-to-combine span (the overlap TBO is for on GPU: one's MoE
    collectives under the other's attention). No two ops run at once on CPU: the order shows which
    compute the data flow leaves free to overlap each collective, not overlap itself; the GPU's
    latency-hiding schedule was not inspected (one GPU lent, no multi-GPU mesh)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from models.kv import contiguous_batch
    from pallas_kernels.policy import KernelPolicy
    # the layer scan kept (its body is what is read), though 8 tokens per request would unroll it
    eng = Engine(tiny, EngineConfig(page_size=16, kv_pages=64, ep_size=2, ep_dispatch="all_to_all",
                                    two_batch_overlap=True, kernels=KernelPolicy(unroll_layers_max_tokens=0)))
    batch = contiguous_batch(np.arange(16).reshape(2, 8) + 3, kv_width=64)
    hlo = eng.runner.lower(batch, None, attn_path="expanded", last_rank=np.zeros(2, np.int32)).compile().as_text()
    sched = _schedule(hlo)
    spans = {0: [], 1: []}
    for mb in (0, 1):
        start = None
        for i, (m, _, coll, _) in enumerate(sched):
            if m != mb or coll is None:
                continue
            if coll == "all-to-all" and start is None:
                start = i
            elif coll == "all-gather" and start is not None:
                spans[mb].append((start, i))
                start = None
    moe_layers = sum(1 for m, part, coll, _ in sched if m == 0 and coll == "all-gather") // 2
    assert moe_layers >= 1 and len(spans[0]) == len(spans[1]) == moe_layers, (spans, moe_layers)
    inside = {mb: [[(part, matmul) for m, part, _, matmul in sched[a + 1:b] if m == 1 - mb and matmul]
                   for a, b in spans[mb]] for mb in (0, 1)}
    print("the other micro-batch's matmuls inside each dispatch-to-combine span:",
          {mb: [[p for p, _ in s] for s in inside[mb]] for mb in (0, 1)})
    assert all(inside[0]) and all(inside[1]), inside
