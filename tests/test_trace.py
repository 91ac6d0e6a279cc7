"""KV-integrity trace (cpkv_jax.trace): level 0 compiles nothing in; faults injected into one run of a
workload are found by `trace diff` against a clean run of it and blamed on the right part — a flipped
byte of a host page's index-K and a corrupted host page's main KV (host tier), two swapped page-table
entries (page mapping), one perturbed expert weight (residual / MoE), a corrupted draft-layer page
(draft main KV on the device; host tier for its host copy, through the side-stream path); a clean run
agrees with itself."""

import ctypes
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpkv_jax.cli import build_parser, engine_config, main
from cpkv_jax.config import EngineConfigError
from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.kv_pool import page_slots
from cpkv_jax.sampling import SamplingParams
from cpkv_jax.trace import STAGES, diff, diff_files, read_trace
from models.config import ModelConfig
from models.kv import contiguous_batch
from models.model import DsaModel, layer_places

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPTS = [list(range(7, 47)), list(range(100, 150))]       # 40 and 50 tokens: 2 and 3 full pages of 16
# every prefill chunk (first pass, and the short extends after a reload) in one 64-lane bucket: fewer
# executables to compile
HOST = dict(page_size=16, kv_pages=64, hicache_pages=64, kv_trace=3, min_prefill_lanes=64)


@pytest.fixture(scope="module")
def model(tiny):
    """The tiny model's first three layers (dense + full indexer, MoE + full, MoE + shared), with its
    embedding, head and MTP layer: every kind of layer at half the compile time of six. Sliced from its
    weights (its layers 1 and 2 are repeat 0 of its stacked MoE group), so nothing is initialized again."""
    cfg = ModelConfig.named("tiny", num_hidden_layers=3)
    assert cfg.full_layers == (0, 1) and cfg.num_nextn_predict_layers == 1
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DsaModel(cfg, dtype=tiny.dtype, rngs=nnx.Rngs(0))))
    pure = nnx.to_pure_dict(nnx.state(tiny))
    moe = pure["groups"][1]["unit"]

    def repeat_0(tree):
        return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[:1]), tree)

    pure["groups"] = {0: pure["groups"][0], 1: {"unit": {0: repeat_0(moe[0])}}, 2: {"unit": {0: repeat_0(moe[1])}}}
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def run_workload(model, config: EngineConfig, path, fault=None):
    """Both prompts prefilled in one step, decoded to the end; with a host tier, the prompts again after
    every device copy was evicted (their pages reload from host). `fault(engine, moment)` is called
    at 'prefilled' (after the first step) and 'backed_up' (every backup committed). Returns the
    trace's records."""
    eng = Engine(model, dataclasses.replace(config, trace_out=str(path)))
    fault = fault or (lambda engine, moment: None)
    for p in PROMPTS:
        eng.add_request(p, GREEDY)
    eng.step()
    fault(eng, "prefilled")
    while eng.has_unfinished():
        eng.step()
    if eng.hicache is not None:
        eng.hicache.settle()
        fault(eng, "backed_up")
        eng.radix.evict(10 ** 9, eng.allocator.free, eng.scheduler._free_host)
        eng.generate(PROMPTS, GREEDY)
    eng.tracer.close()
    return read_trace(path)


def poke_host_page(eng, leaf: str, layer: int, host_page: int, draft: bool = False, byte: int = 0) -> None:
    """Flip every bit of one byte of a host page (first row) of one layer of a host pool leaf, in place
    behind JAX's back (like a faulty copy or stray write would)."""
    host = eng.hicache.host
    arr = getattr(host.draft if draft else host.cache, leaf)
    rank = int(host.host_rank([host_page])[0])
    local = host_page - rank * host.allocator.pages_per_rank
    shard = next(s for s in arr.addressable_shards if s.device == host.devices[rank])
    row = host.row_bytes(leaf)
    offset = (layer * shard.data.shape[1] + local * host.page_size) * row + byte
    cell = ctypes.c_uint8.from_address(shard.data.unsafe_buffer_pointer() + offset)
    cell.value ^= 0xFF


def first_backed_up_host_page(eng) -> int:
    return min(eng.tracer.host_fingerprint)


def verdict_of(path_a, path_b) -> tuple[int, list[str]]:
    out = io.StringIO()
    rc = diff_files(path_a, path_b, out)
    return rc, out.getvalue().strip().splitlines()


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory):
    """The clean run of the host-tier workload (jitted copies on CPU, the side stream on GPU) and its
    trace file."""
    path = tmp_path_factory.mktemp("trace") / "clean.jsonl"
    return path, run_workload(model, EngineConfig(**HOST), path)


def test_level_0_compiles_the_step_of_an_engine_without_a_trace(model, tmp_path):
    """Levels 0-2 lower the target and draft steps to the same program as an engine without a trace,
    with no host callback in it; level 3 (the per-layer probe) adds the callbacks."""
    from cpkv_jax.runner import _draft_step

    batch = contiguous_batch(np.arange(2, 34).reshape(1, 32), 0, slot_table=np.arange(16, 80).reshape(1, 64))

    def programs(**trace):
        eng = Engine(model, EngineConfig(page_size=16, kv_pages=64, speculative="nextn", **trace))
        target = eng.runner.lower(batch, None, attn_path="absorbed").as_text()
        b, kw = eng.runner._common(batch, None, None, True)
        kw.update(eng.runner._trace_kw("draft"))
        hidden = jnp.zeros((1, 32, model.cfg.hidden_size), model.dtype)
        draft = _draft_step.lower(eng.runner.graph, eng.runner.leaves, hidden, b.tokens, b, eng.pool.draft,
                                  eng.runner.last_tokens,
                                  attn_path="absorbed", **kw).as_text()
        return target, draft

    untraced = programs()
    assert not any("callback" in text for text in untraced)
    for level in (1, 2):
        assert programs(kv_trace=level, trace_out=str(tmp_path / f"l{level}.jsonl")) == untraced, level
    traced = programs(kv_trace=3, trace_out=str(tmp_path / "l3.jsonl"))
    assert all("callback" in text for text in traced)


def test_clean_run_agrees_with_itself_and_records_every_level(model, clean):
    path, records = clean
    rc, lines = verdict_of(path, path)
    assert rc == 0 and lines[-1] == "verdict: no divergence: the runs agree", lines
    kinds = {r["kind"] for r in records}
    assert kinds == {"meta", "forward", "backup", "load", "page_hash"}, kinds
    # every layer of both requests in the first forward, each stage hashed, no zero / non-finite flags
    first = [r for r in records if r["kind"] == "forward" and r["forward"] == 0]
    assert {(r["rid"], r["layer"]) for r in first} == {(rid, L) for rid in (0, 1) for L in range(3)}
    assert all(set(r["hashes"]) == set(STAGES) and not r["flags"] for r in first)
    shared = [r for r in first if r["layer"] not in model.cfg.full_layers]
    assert shared and all(r["hashes"]["index_read"] == "00000000" for r in shared)
    # every backed-up page reloads with its backup's hashes (level 2); level 1 counts the bytes
    backups = {r["fp"]: r for r in records if r["kind"] == "page_hash" and r["event"] == "backup"}
    reloads = [r for r in records if r["kind"] == "page_hash" and r["event"] == "reload"]
    assert len(backups) == 5 and len(reloads) == 5
    assert all(r["main_kv"] == backups[r["fp"]]["main_kv"] and r["index_k"] == backups[r["fp"]]["index_k"]
               for r in reloads)
    backup = next(r for r in records if r["kind"] == "backup")
    tokens = len(backup["pages"]) * 16
    assert backup["bytes"]["latent"] == tokens * 3 * model.cfg.kv_lora_rank * 4
    assert backup["bytes"]["index_k"] == tokens * len(model.cfg.full_layers) * model.cfg.index_head_dim


@pytest.mark.parametrize("leaf,layer,part", [("index_k", 1, "index-K (+ scale)"), ("latent", 2, "main KV")])
def test_corrupted_host_page_is_blamed_on_the_host_tier(model, clean, tmp_path, leaf, layer, part):
    """One byte of a host page's index-K (full layer 1: index slot 1) or of its latent (layer 2) is
    flipped after the backup: the page's reload hash differs from its backup's at that layer (host
    tier), and the first forward that reads it differs in what it reads at that layer."""
    clean_path, _ = clean
    slot = model.cfg.full_layers.index(layer) if leaf == "index_k" else layer
    corrupted = {}

    def fault(eng, moment):
        if moment == "backed_up":
            corrupted["page"] = first_backed_up_host_page(eng)
            poke_host_page(eng, leaf, slot, corrupted["page"])

    run_workload(model, EngineConfig(**HOST), tmp_path / "bad.jsonl", fault)
    rc, lines = verdict_of(clean_path, tmp_path / "bad.jsonl")
    assert rc == 1, lines
    where = next(line for line in lines if line.startswith("first divergence:"))
    assert f"host page {corrupted['page']}" in where and f"target layer {layer}," in where and part in where, lines
    assert lines[-1].startswith("verdict: host tier") and part in lines[-1], lines
    forward = next(line for line in lines if line.startswith("first forward divergence:"))
    read = "index_read" if leaf == "index_k" else "kv_read"
    assert f"target layer {layer}, stage {read}" in forward, forward


def test_swapped_page_table_entries_are_blamed_on_the_page_mapping(model, clean, tmp_path):
    """Request 0's first two page-table entries are swapped after its prefill: its first decode step
    reads main KV and index-K at the same positions differently, from layer 0 on."""
    def fault(eng, moment):
        if moment == "prefilled":
            req = eng._requests[0]
            req.pages[[0, 1]] = req.pages[[1, 0]]

    records = run_workload(model, EngineConfig(**HOST), tmp_path / "bad.jsonl", fault)
    first, _ = diff(read_trace(clean[0]), records)
    assert first.where == "request 0, positions [40, 41), target layer 0, stage kv_read", first
    assert first.verdict.startswith("page mapping"), first


def test_perturbed_expert_weight_is_blamed_on_the_moe(model, clean, tmp_path):
    """One weight of one routed expert of layer 1: the first difference is that layer's MLP output
    in the prefill, with everything before it equal."""
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    group, position, repeat = layer_places(model.groups_plan)[1]
    mlp = pure["groups"][group]["unit"][position]["mlp"]
    mlp["experts_down"] = mlp["experts_down"].at[repeat, 0, 0, 0].add(1.0)
    nnx.replace_by_pure_dict(state, pure)
    perturbed = nnx.merge(graphdef, state)

    records = run_workload(perturbed, EngineConfig(**HOST), tmp_path / "bad.jsonl")
    first, _ = diff(read_trace(clean[0]), records)
    assert first.where.endswith("target layer 1, stage mlp_out") and "positions [0, " in first.where, first
    assert first.verdict.startswith("residual / MoE"), first


def test_cp_trace_agrees_with_single_device_and_blames_a_rank_1_host_page(model, clean, tmp_path):
    """Under CP (2 ranks, the pool's pages and the host pool split between them) each rank hashes the
    tokens and pages it owns and the host adds them up: the trace equals the single-device run's, hash
    for hash. A byte flipped in a host page of rank 1 is blamed on the host tier at CP rank 1."""
    config = EngineConfig(**dict(HOST, cp_size=2))
    records = run_workload(model, config, tmp_path / "cp.jsonl")
    assert {p["rank"] for r in records if r["kind"] == "backup" for p in r["pages"]} == {0, 1}
    rc, lines = verdict_of(clean[0], tmp_path / "cp.jsonl")
    assert rc == 0, lines

    def fault(eng, moment):
        if moment == "backed_up":
            page = max(h for h in eng.tracer.host_fingerprint if eng.hicache.host_rank([h])[0] == 1)
            poke_host_page(eng, "latent", 0, page)

    run_workload(model, config, tmp_path / "bad.jsonl", fault)
    rc, lines = verdict_of(clean[0], tmp_path / "bad.jsonl")
    assert rc == 1 and "CP rank 1), target layer 0, main KV" in lines[1], lines
    assert lines[-1].startswith("verdict: host tier"), lines


def test_two_batch_overlap_trace_matches_one_batch(model, clean, tmp_path):
    """With two-batch overlap each layer runs as two micro-batches and the per-layer probe sees the
    layer once, over both micro-batches' values joined: the same records (every forward, request,
    position range and layer) with the same flags; the bit-exact stages hash the same — the embedded
    attention input of layer 0 and every layer's top-k selection (the IndexCache top-k each
    micro-batch carries into the shared layer). The float stages after the first matmul are not
    bitwise those of one batch (XLA:CPU rounds a matmul over half the rows differently, <= 4e-6 here),
    so their hashes differ by design."""
    def forwards(records):
        return {(r["forward"], r["model"], r["rid"], r["start"], r["end"], r["layer"]): r
                for r in records if r.get("kind") == "forward"}
    want = forwards(clean[1])
    got = forwards(run_workload(model, EngineConfig(**dict(HOST, two_batch_overlap=True)), tmp_path / "tbo.jsonl"))
    assert got.keys() == want.keys() and len(want) > 0
    for key, w in want.items():
        assert got[key]["flags"] == w["flags"], key
        assert got[key]["hashes"]["topk"] == w["hashes"]["topk"], key
        if key[5] == 0 and key[1] == "target":
            assert got[key]["hashes"]["attn_in"] == w["hashes"]["attn_in"], key


SPEC = dict(HOST, speculative="nextn", num_draft_tokens=1, hicache_copy="side_stream")


@pytest.fixture(scope="module")
def clean_spec(model, tmp_path_factory):
    """The clean run of the workload with NextN speculative decoding, its host tier on the side-stream
    path (memmoves at the forward's layer boundaries on CPU)."""
    path = tmp_path_factory.mktemp("trace") / "clean_spec.jsonl"
    return path, run_workload(model, EngineConfig(**SPEC), path)


def test_corrupted_draft_page_on_device_is_blamed_on_the_draft_main_kv(model, clean_spec, tmp_path):
    """Request 0's first page of the draft layer's latent is changed on the device after the prefill:
    the target agrees, the draft layer's next forward reads different main KV (its index-K agrees)."""
    clean_path, records = clean_spec
    assert any(r["kind"] == "forward" and r["model"] == "draft" for r in records)

    def fault(eng, moment):
        if moment == "prefilled":
            slots = page_slots(eng._requests[0].pages[:1], 16)
            draft = eng.pool.draft
            eng.pool.draft = dataclasses.replace(draft, latent=draft.latent.at[0, slots].add(1.0))

    bad = run_workload(model, EngineConfig(**SPEC), tmp_path / "bad.jsonl", fault)
    first, _ = diff(read_trace(clean_path), bad)
    assert first.where.startswith("request 0, positions [40, ") and first.where.endswith(
        "draft layer (MTP), stage kv_read"), first
    assert first.verdict.startswith("main KV") and first.verdict.endswith("(draft layer)"), first


def test_corrupted_draft_host_page_is_blamed_on_the_host_tier(model, clean_spec, tmp_path):
    """The draft layer's latent of a host page is flipped after its side-stream backup: its reload
    differs from its backup (host tier, draft layer)."""
    def fault(eng, moment):
        if moment == "backed_up":
            poke_host_page(eng, "latent", 0, first_backed_up_host_page(eng), draft=True)

    run_workload(model, EngineConfig(**SPEC), tmp_path / "bad.jsonl", fault)
    rc, lines = verdict_of(clean_spec[0], tmp_path / "bad.jsonl")
    assert rc == 1 and "draft layer (MTP), main KV" in lines[1], lines
    assert lines[-1].startswith("verdict: host tier") and lines[-1].endswith("(draft layer)"), lines


def test_cli_trace_flags_and_trace_diff_exit_codes(clean, tmp_path, capsys):
    """--kv-trace N --trace-out PATH configure the engine of generate, bench and serve (every flag's
    mapping: test_cli's table); `trace diff` exits 0 for agreeing runs with the verdict printed last,
    1 with the first divergence when one hash differs (a top-k: the index-K cache), 2 for a missing
    file."""
    parser = build_parser()
    for verb, extra in (("generate", ["--tokens", "1,2"]), ("bench", []), ("serve", [])):
        config = engine_config(parser.parse_args([verb, *extra, "--kv-trace", "3", "--trace-out", "run.jsonl"]))
        assert (config.kv_trace, config.trace_out) == (3, "run.jsonl"), verb

    clean_path, _ = clean
    assert main(["trace", "diff", str(clean_path), str(clean_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "verdict: no divergence: the runs agree"
    lines = clean_path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"forward": 1,' in line and '"layer": 1,' in line)
    assert '"rid": 0, "start": 40, "end": 41' in lines[i], lines[i]
    lines[i] = lines[i].replace('"topk": "', '"topk": "0', 1)
    (tmp_path / "changed.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["trace", "diff", str(clean_path), str(tmp_path / "changed.jsonl")]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert "first divergence: request 0, positions [40, 41), target layer 1, stage topk" in printed, printed
    assert printed[-1].startswith("verdict: index-K cache"), printed
    assert main(["trace", "diff", str(clean_path), str(tmp_path / "missing.jsonl")]) == 2


def test_trace_config_errors():
    with pytest.raises(EngineConfigError, match="trace_out"):
        EngineConfig(kv_trace=2).validate()
    with pytest.raises(EngineConfigError, match="kv_trace"):
        EngineConfig(kv_trace=4, trace_out="t.jsonl").validate()
    with pytest.raises(EngineConfigError, match="kv_trace is 0"):
        EngineConfig(trace_out="t.jsonl").validate()


@pytest.mark.gpu
def test_side_stream_host_index_k_flip_is_blamed_on_the_host_tier_on_gpu(model, tmp_path):
    """On the GPU's side-stream path (cudaMemcpyAsync at the forward's layer boundaries into pinned host
    memory): two clean runs agree hash for hash (the premise of a diff), and one byte of a host page's
    index-K flipped after the backup is found at reload (host tier, full layer 1); the first forward
    reading it differs in its index-K read at that layer."""
    import jax

    assert jax.default_backend() == "gpu", "gpu tests must run with JAX_PLATFORMS=cuda on a GPU machine"
    config = EngineConfig(**dict(HOST, hicache_copy="side_stream"))
    engines = []

    def fault(eng, moment):
        engines.append(eng)
        if moment == "backed_up" and eng.config.trace_out.endswith("bad.jsonl"):
            poke_host_page(eng, "index_k", 1, first_backed_up_host_page(eng))

    for name in ("clean", "again", "bad"):
        run_workload(model, config, tmp_path / f"{name}.jsonl", fault)
    copier = engines[-1].runner.copier
    assert copier is not None and copier.rt.asynchronous and not copier.errors
    assert any(v[0] == "target" and v[-1] for v in engines[-1].runner.variants), "no forward carried the layer hook"
    rc, lines = verdict_of(tmp_path / "clean.jsonl", tmp_path / "again.jsonl")
    assert rc == 0, ["two clean GPU runs differ"] + lines
    rc, lines = verdict_of(tmp_path / "clean.jsonl", tmp_path / "bad.jsonl")
    assert rc == 1 and "target layer 1, index-K (+ scale)" in lines[1], lines
    assert lines[-1].startswith("verdict: host tier"), lines
    forward = next(line for line in lines if line.startswith("first forward divergence:"))
    assert "target layer 1, stage index_read" in forward, forward
