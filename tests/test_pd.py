"""Prefill→decode disaggregation on simulated CPU devices (fp32), with an 8-layer IndexCache model
(freq 4 / offset 3: full layers 0, 1, 2, 6) and NextN speculative decoding, so every transfer moves the
draft layer's KV and no index key of a shared layer: PD outputs equal the colocated engine's token for
token (greedy speculative decoding equals plain greedy decoding, tests/test_spec.py, so the plain
colocated engine is the reference), the moved bytes equal the layout's formula and the moved pages equal
the prefill pages bit for bit; the router spreads requests and follows cached prefixes; faults: a
metadata mismatch commits nothing, a transfer failing part way leaves nothing on the decode side and
frees the prefill pages, a full decode replica makes requests wait without losing any; and a
two-process PD server whose CP prefill mesh spans both processes and whose decode replica is on one of
them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax import pd
from cpkv_jax.config import EngineConfigError
from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.kv_pool import pages_for
from cpkv_jax.sampling import SamplingParams
from tests.helpers import pool_is_clean

PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)
BASE = dict(page_size=16, kv_pages=24, max_running=4, max_prefill_tokens=128, index_dtype="fp8")
SPEC = dict(speculative="nextn", num_draft_tokens=2)


def page_rows(engine, page):
    """Every cache leaf's rows of one page (target and draft), as host arrays."""
    ps = engine.config.page_size
    leaves = jax.tree.leaves((engine.pool.cache, engine.pool.draft))
    return [np.asarray(x[:, page * ps:(page + 1) * ps]) for x in leaves]


def pool_state(engine):
    s = engine.stats()
    return s["free_pages"], s["reserved_pages"], s["request_pages"], s["radix"]["pages"], s["radix"]["protected_pages"]


def assert_nothing_held(eng):
    for e in [eng.prefill] + eng.decoders:
        assert pool_is_clean(e)


def evict_all(eng):
    for e in [eng.prefill] + eng.decoders:
        e.radix.evict(e.radix.stats()["evictable_pages"], e.scheduler._free_device)


def assert_moved_pages_equal(eng):
    """Every prompt page a decode replica caches holds the bytes of the prefill page of the same key
    (target and draft caches, every layer)."""
    src = eng.prefill.radix.prefixes()
    compared = 0
    for dec in eng.decoders:
        for key, page in dec.radix.prefixes().items():
            if key in src:
                for a, b in zip(page_rows(dec, page), page_rows(eng.prefill, src[key])):
                    np.testing.assert_array_equal(a, b)
                compared += 1
    assert compared > 0


@pytest.fixture(scope="module")
def model():
    from flax import nnx

    from models.config import ModelConfig
    from models.model import DsaModel

    cfg = ModelConfig.named("tiny", num_hidden_layers=8, index_head_dim=128, index_topk_freq=4,
                            index_skip_topk_offset=3)
    assert cfg.full_layers == (0, 1, 2, 6)
    return DsaModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(33)
    first = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in (3, 37, 70)]
    second = [first[2][:48] + rng.integers(2, model.cfg.vocab_size, 9).tolist()]   # a cached 3-page prefix
    return first, second


@pytest.fixture(scope="module")
def colocated(model, prompts):
    eng = Engine(model, EngineConfig(**BASE))
    return [[o.token_ids for o in eng.generate(wave, PARAMS)] for wave in prompts]


@pytest.fixture(scope="module")
def pd_engine(model):
    return pd.PDEngine(model, EngineConfig(**BASE, **SPEC, pd_prefill_devices=2, pd_decode_replicas=1))


def test_pd_equals_colocated_and_moves_pages_exactly(model, pd_engine, prompts, colocated):
    """Bytes moved = pages x page size x (8 layers' latent + rope key in fp32, 4 full layers' fp8 index
    key + scale (132 B), the MTP layer's latent + rope key + index key)."""
    eng, cfg = pd_engine, model.cfg
    first, second = prompts
    assert [o.token_ids for o in eng.generate(first, PARAMS)] == colocated[0]
    m = eng.metrics
    pages = sum(pages_for(len(p), 16) for p in first)
    assert m["pd_transfers"] == 3 and m["pd_pages"] == pages == 9
    tokens, f32 = pages * 16, 4
    moved = m["pd_bytes"]
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * f32
    assert moved["latent"] + moved["k_rope"] == tokens * cfg.num_hidden_layers * per_layer
    assert moved["index_k"] + moved["index_scale"] == tokens * len(cfg.full_layers) * (128 + 4)
    assert moved["draft_latent"] + moved["draft_k_rope"] == tokens * per_layer
    assert moved["draft_index_k"] + moved["draft_index_scale"] == tokens * 132
    assert eng.decoders[0].metrics["spec_rounds"] > 0
    # the decode replica caches the first wave's prompts: the second wave's request moves only what it
    # lacks. In spec mode the cache keys are bigrams (token i, token i + 1) and the two prompts differ at
    # token 48, so 2 of its 3 shared pages match and pages 2 and 3 move.
    assert [o.token_ids for o in eng.generate(second, PARAMS)] == colocated[1]
    assert m["pd_pages"] == 9 + 2
    assert_moved_pages_equal(eng)
    assert_nothing_held(eng)


def test_metadata_mismatch_commits_nothing(model, pd_engine, prompts):
    """A decode replica storing its index keys unquantized ('same') cannot take fp8 ones: the transfer
    raises naming the tensor before writing, the decode pool's pages and tree are as before, the
    prefill side holds nothing for the request, which ends 'abort'. check_meta also names a layer
    sent as shared where the pool expects a full one, and a wrong page size."""
    eng = pd.PDEngine(model, EngineConfig(**BASE, **SPEC, pd_prefill_devices=2, pd_decode_replicas=1))
    dec = Engine(model, dataclasses.replace(eng.decoders[0].config, index_dtype="same"),
                 devices=eng.decoders[0].mesh.devices.flat)
    eng.decoders = [dec]
    before = pool_state(dec)
    with pytest.raises(pd.PDTransferError, match="index_k"):
        eng.generate([prompts[0][1]], PARAMS)
    assert pool_state(dec) == before and dec.radix.stats()["pages"] == 0
    assert [r.finish_reason for r in eng._requests.values()] == ["abort"]
    assert_nothing_held(eng)

    layout = pd.pool_layout(model.cfg, pd_engine.decoders[0].pool)
    assert [m.kind for m in layout] == ["full"] * 3 + ["shared"] * 3 + ["full", "shared", "draft"]
    wrong = tuple(dataclasses.replace(m, kind="shared") if m.layer == 6 else m for m in layout)
    with pytest.raises(pd.PDTransferError, match="layer 6, shared"):
        pd.check_meta(pd.TransferMeta(16, (0,), wrong), pd.TransferMeta(16, (0,), layout))
    with pytest.raises(pd.PDTransferError, match="page size"):
        pd.check_meta(pd.TransferMeta(32, (0,), layout), pd.TransferMeta(16, (0,), layout))


def test_transfer_failing_part_way_leaves_nothing(pd_engine, prompts, monkeypatch):
    """The second wave's request again: its last page moves as two units (target, then draft cache) and
    the second fails after the first landed in staging. The request ends 'abort', the decode pools'
    bytes, pages and trees are unchanged, the prefill side frees its pages."""
    eng = pd_engine
    before = [(pool_state(d), [np.asarray(x) for x in jax.tree.leaves((d.pool.cache, d.pool.draft))])
              for d in eng.decoders]
    real, calls = pd.move_unit, []

    def failing(rows, device):
        calls.append(device)
        if len(calls) == 2:
            raise RuntimeError("link down")
        return real(rows, device)

    monkeypatch.setattr(pd, "move_unit", failing)
    out = eng.generate(prompts[1], PARAMS)[0]
    assert out.finish_reason == "abort" and len(calls) == 2
    assert eng.metrics["pd_aborted_transfers"] == 1
    for d, (state, leaves) in zip(eng.decoders, before):
        assert pool_state(d) == state
        for a, b in zip(jax.tree.leaves((d.pool.cache, d.pool.draft)), leaves):
            np.testing.assert_array_equal(np.asarray(a), b)
    assert_nothing_held(eng)


def test_full_decode_replica_makes_requests_wait(pd_engine, prompts, colocated):
    """Requests that reserve 13, 15 and 17 of the replica's 23 pages for their whole life (max_new_tokens
    200 + 2 draft positions; each ends at a stop token, its colocated output's last): the replica takes
    one at a time, the others wait with their prefill pages held until it finishes, then run.
    Every output equals the colocated one cut at its stop token; no page leaks."""
    eng = pd_engine
    evict_all(eng)                              # cached prefixes would shorten the reservations
    stops = [out[-1] for out in colocated[0]]
    params = [SamplingParams(max_new_tokens=200, ignore_eos=True, stop_token_ids=(t,)) for t in stops]
    waits = eng.metrics["pd_waits"]
    outs = eng.generate(prompts[0], params)
    assert [o.token_ids for o in outs] == [out[:out.index(t) + 1] for out, t in zip(colocated[0], stops)]
    assert eng.metrics["pd_waits"] > waits
    assert_nothing_held(eng)


def test_host_tier_on_both_sides(model, prompts, colocated):
    """HiCache on the prefill engine and the decode replica: the first wave is backed up on both sides,
    the device caches are evicted, and the second wave's request loads its cached prefix back from the
    host on both sides (the replica's load comes before the transfer of the rest); tokens equal."""
    from tests.helpers import check_hicache_invariants

    eng = pd.PDEngine(model, EngineConfig(**BASE, **SPEC, hicache_pages=32, pd_prefill_devices=2,
                                          pd_decode_replicas=1))
    assert [o.token_ids for o in eng.generate(prompts[0], PARAMS)] == colocated[0]
    for e in (eng.prefill, eng.decoders[0]):    # generate returns with every backup committed
        assert e.hicache.stats["commits"] == e.hicache.stats["backups"] > 0
    evict_all(eng)
    assert [o.token_ids for o in eng.generate(prompts[1], PARAMS)] == colocated[1]
    for e in (eng.prefill, eng.decoders[0]):
        assert e.hicache.stats["loads"] > 0
        # each prompt's backup, reserved at admission, completes once its pages are in (no rollback)
        assert e.hicache.stats["rollbacks"] == 0 and e.hicache.stats["commits"] >= 3
        check_hicache_invariants(e)
    assert eng.metrics["pd_pages"] == 9 + 2


def test_router_least_loaded_and_prefix(model):
    """least_loaded: fewest running requests, then most free pages; prefix: the replica caching the
    longest prefix of the prompt first (then by load). Pure host logic: no step runs."""
    from cpkv_jax.scheduler import Request

    eng = pd.PDEngine(model, EngineConfig(**BASE, pd_prefill_devices=2, pd_decode_replicas=3))
    a, b, c = eng.decoders
    prompt = list(range(2, 60))
    req = Request(0, prompt, PARAMS, frozenset())
    a.scheduler.running.append(Request(1, [5], PARAMS, frozenset()))
    b.scheduler.reserved_pages = 3
    assert eng.route(req) == [c, b, a]
    pages = b.allocator.alloc(3)
    b.radix.insert(prompt[:48], pages)          # b caches 3 pages of the prompt
    assert eng.route(req) == [c, b, a]
    eng.config = dataclasses.replace(eng.config, pd_router="prefix")
    assert eng.route(req) == [b, c, a]


def test_pd_config_errors():
    with pytest.raises(EngineConfigError, match="cp_size"):
        EngineConfig(pd_prefill_devices=2, cp_size=4, kv_pages=64).validate()
    with pytest.raises(EngineConfigError, match="pd_router"):
        EngineConfig(pd_prefill_devices=2, pd_router="random").validate()
    with pytest.raises(EngineConfigError, match="needs 9 devices"):
        pd.pd_devices(EngineConfig(pd_prefill_devices=4, pd_decode_replicas=5))


@pytest.mark.gpu
def test_pd_on_gpus_equals_colocated(tiny):
    """On a multi-GPU host (`JAX_PLATFORMS=cuda pytest -m gpu tests/test_pd.py`): prefill on 2 GPUs (1
    on a 2-GPU host), decode on the next, the tiny model in fp32; greedy tokens equal the colocated
    engine's and the moved pages equal the prefill pages bit for bit."""
    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        pytest.skip("PD needs at least 2 GPUs")
    prefill = 2 if len(jax.devices()) >= 3 else 1
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, n).tolist() for n in (7, 130, 300)]
    config = EngineConfig(page_size=64, kv_pages=32, max_running=4, max_prefill_tokens=512)
    want = [o.token_ids for o in Engine(tiny, config).generate(prompts, PARAMS)]
    eng = pd.PDEngine(tiny, dataclasses.replace(config, pd_prefill_devices=prefill, pd_decode_replicas=1))
    assert [o.token_ids for o in eng.generate(prompts, PARAMS)] == want
    assert eng.metrics["pd_pages"] == sum(pages_for(len(p), 64) for p in prompts)
    assert_moved_pages_equal(eng)


@pytest.mark.slow
def test_two_process_server_with_cp_prefill_over_both(tiny):
    """`cpkv-jax serve --pd-prefill-devices 3 --pd-decode-replicas 1` as two processes of 2 CPU devices
    each (jax.distributed on localhost, gloo collectives): the prefill engine's cp mesh is process 0's
    two devices and process 1's first, the decode replica process 1's second, so a request's pages move
    to it from ranks 0 and 1 across processes (two-device ppermute) and from rank 2 within process 1
    (device_put). Process 0 answers HTTP and broadcasts each request; process 1 owns the replica and
    broadcasts its admissions, transfer outcomes and sampled tokens. Two requests, the second sharing
    3 pages the replica caches (only the rest moves): each completion's text is the one-device engine's."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from tokenizers import Tokenizer

    from models.weights import tiny_random_checkpoint

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = np.random.default_rng(12)
    first = rng.integers(2, tiny.cfg.vocab_size, 70).tolist()
    prompts = [first, first[:48] + rng.integers(2, tiny.cfg.vocab_size, 9).tolist()]
    colocated = Engine(tiny, EngineConfig(page_size=16, kv_pages=24))
    want = [colocated.generate([p], PARAMS)[0].token_ids for p in prompts]
    coordinator, http = free_port(), free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir)
    args = ["serve", "--model", "tiny-random", "--pd-prefill-devices", "3", "--pd-decode-replicas", "1", "--page-size", "16",
            "--kv-pages", "24", "--max-running", "4",
            "--max-prefill-tokens", "128", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{coordinator}",
            "--port", str(http)]
    procs = [subprocess.Popen([sys.executable, "-m", "cpkv_jax.cli", *args, "--node-rank", str(rank)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.time() + 240
        while True:
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs]
            assert time.time() < deadline, "the server did not start"
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        texts = []
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "max_tokens": PARAMS.max_new_tokens, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            texts.append(json.loads(urllib.request.urlopen(req, timeout=200).read())["choices"][0]["text"])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    tokenizer = Tokenizer.from_file(str(tiny_random_checkpoint() / "tokenizer.json"))
    assert texts == [tokenizer.decode(w, skip_special_tokens=True) for w in want] and all(texts)
