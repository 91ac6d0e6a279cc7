"""HF safetensors -> params, fp8 dequantization, orbax conversion round trip, sharded restore, errors."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from safetensors.numpy import load_file, save_file

from models.config import ModelConfig
from models.weights import (FORMAT_VERSION, CheckpointError, SafetensorsReader, abstract_model, iter_hf_parts,
                            load_checkpoint, load_hf, load_model, model_parts, save_checkpoint)
from tests.helpers import FIXTURES, hf_model


def pure(model):
    return nnx.to_pure_dict(nnx.state(model))


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, p
        assert np.array_equal(x, y), p


def convert(src, out, dtype=None):
    cfg = ModelConfig.from_json_file(src)
    dtype = jnp.dtype(dtype or cfg.dtype)
    reader = SafetensorsReader(src)
    return save_checkpoint(out, json.loads((src / "config.json").read_text()),
                           iter_hf_parts(reader, cfg, abstract_model(cfg, dtype), dtype))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "glm_indexcache"
    convert(FIXTURES / "glm_indexcache", out)
    return out


def test_hf_params_are_the_checkpoint_tensors():
    """Spot-check the key mapping against the raw safetensors (transposes, expert stacking, MTP)."""
    raw = load_file(FIXTURES / "glm_indexcache" / "model.safetensors")
    m = hf_model("glm_indexcache")
    # layer 3 is a full MoE layer; the plan puts it in group 1 (unit [F, S] x 2), repeat 1, position 0
    g, j, r = 1, 0, 1
    assert m.groups_plan[g].layer_ids[r][j] == 3
    layer = m.groups[g].unit[j]
    np.testing.assert_array_equal(layer.self_attn.q_b_proj.kernel[...][r], raw["model.layers.3.self_attn.q_b_proj.weight"].T)
    np.testing.assert_array_equal(layer.mlp.experts_down[...][r, 5], raw["model.layers.3.mlp.experts.5.down_proj.weight"].T)
    np.testing.assert_array_equal(layer.mlp.e_score_correction_bias[...][r], raw["model.layers.3.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(layer.self_attn.indexer.k_norm.bias[...][r], raw["model.layers.3.self_attn.indexer.k_norm.bias"])
    assert m.groups[1].unit[1].self_attn.indexer is None  # shared layer: no indexer weights
    np.testing.assert_array_equal(m.mtp.eh_proj.kernel[...], raw["model.layers.5.eh_proj.weight"].T)
    np.testing.assert_array_equal(m.mtp.head.kernel[...], raw["model.layers.5.shared_head.head.weight"].T)


def test_fp8_block_dequantization():
    raw = load_file(FIXTURES / "glm_tiny" / "model.safetensors")
    reader = SafetensorsReader(FIXTURES / "glm_tiny_fp8")
    key = "model.layers.1.self_attn.q_b_proj.weight"  # [192, 64]: 2 x 1 blocks of 128 x 128
    w = reader.get(key)
    rel = np.abs(w - raw[key]) / np.abs(raw[key]).max()
    assert 0 < rel.max() <= 2 ** -4  # e4m3 rounding, relative to the block max
    # by hand: fp8 bytes x the block's scale
    import ml_dtypes
    from models.weights import _safetensors_header
    header, start = _safetensors_header(reader.dir / reader.weight_map[key])
    b, e = header[key]["data_offsets"]
    q = np.fromfile(reader.dir / reader.weight_map[key], np.uint8, e - b, offset=start + b)
    q = q.view(ml_dtypes.float8_e4m3fn).reshape(192, 64).astype(np.float32)
    scale = reader._raw(key.replace("weight", "weight_scale_inv"))
    assert scale.shape == (2, 1)
    np.testing.assert_array_equal(w[:128], q[:128] * scale[0, 0])
    np.testing.assert_array_equal(w[128:], q[128:] * scale[1, 0])


def test_conversion_round_trip(converted):
    assert_trees_equal(pure(load_checkpoint(converted)), pure(hf_model("glm_indexcache")))
    parts = sorted(p.name for p in converted.iterdir())
    assert "layer_0" in parts and "layer_4" in parts and "mtp" in parts and "top" in parts


def test_conversion_streams_one_layer_at_a_time():
    """Between two yielded parts the converter reads only that part's tensors: peak host memory is one
    layer (plus the one being written), never the model."""
    src = FIXTURES / "glm_indexcache"
    cfg = ModelConfig.from_json_file(src)
    reader = SafetensorsReader(src)
    reads = []
    orig = reader.get
    reader.get = lambda k: (reads.append(k), orig(k))[1]
    for name, _ in iter_hf_parts(reader, cfg, abstract_model(cfg, jnp.float32), jnp.float32):
        if name.startswith("layer:"):
            i = int(name.split(":")[1])
            assert reads and all(k.startswith(f"model.layers.{i}.") for k in reads), (name, reads[:3])
        reads.clear()


def test_sharded_restore_on_8_device_mesh(converted):
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    model = load_checkpoint(converted, mesh=mesh)
    experts = model.groups[1].unit[0].mlp.experts_gate[...]
    assert isinstance(experts.sharding, NamedSharding)
    assert experts.sharding.spec == jax.sharding.PartitionSpec(None, "ep", None, None)
    assert len({s.device for s in experts.addressable_shards}) == 8
    assert experts.addressable_shards[0].data.shape == (2, 1, 64, 32)  # 8 experts / 8 devices
    assert model.embed_tokens[...].sharding.is_fully_replicated
    assert_trees_equal(pure(model), pure(hf_model("glm_indexcache")))


def test_fp8_experts_round_trip_k_major_and_restore_sharded(tmp_path):
    """The fp8 fixture converted with its fp8 kept: the manifest records the routed experts K-major
    ([E, N, K]: gate [E, I, D], scales [E, I/128, D/128]), the checkpoint loads back equal to the in-memory
    HF load, restores sharded over 8 devices with the expert axis split (values and scales alike), and a
    live model's parts (model_parts) save and load back unchanged."""
    src = FIXTURES / "glm_tiny_fp8"
    cfg = ModelConfig.from_json_file(src)
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = tmp_path / "fp8"
    reader = SafetensorsReader(src)
    kept_cfg = cfg.replace(fp8_linears=reader.fp8_linears())
    save_checkpoint(out, {**json.loads((src / "config.json").read_text()), "fp8_linears": list(kept_cfg.fp8_linears)},
                    iter_hf_parts(reader, kept_cfg, abstract_model(kept_cfg, jnp.dtype(cfg.dtype)), cfg.dtype))
    arrays = json.loads((out / "cpkv_checkpoint.json").read_text())["arrays"]["layer:1"]
    assert arrays["mlp/experts_gate"] == [[E, I, D], "float8_e4m3fn"]
    assert arrays["mlp/experts_down"] == [[E, D, I], "float8_e4m3fn"]
    assert arrays["mlp/experts_gate_scale_inv"] == [[E, -(-I // 128), -(-D // 128)], "float32"]
    ref = pure(hf_model("glm_tiny_fp8"))
    assert_trees_equal(pure(load_checkpoint(out)), ref)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    model = load_checkpoint(out, mesh=mesh)
    for leaf, shape in (("experts_gate", (1, I, D)), ("experts_down", (1, D, I)), ("experts_up_scale_inv", (1, 1, 1))):
        arr = getattr(model.groups[1].unit[0].mlp, leaf)[...]
        assert arr.sharding.spec == jax.sharding.PartitionSpec(None, "ep", None, None), leaf
        assert arr.addressable_shards[0].data.shape[1:] == shape, leaf      # 8 experts / 8 devices
    assert_trees_equal(pure(model), ref)
    again = save_checkpoint(tmp_path / "again", json.loads((out / "config.json").read_text()), model_parts(model))
    assert_trees_equal(pure(load_checkpoint(again)), ref)


def test_restore_with_dtype_override(converted):
    model = load_checkpoint(converted, dtype="bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    assert model.groups[1].unit[0].mlp.e_score_correction_bias[...].dtype == jnp.float32  # selection bias stays fp32


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path):
    src = FIXTURES / "glm_tiny"
    cfg = ModelConfig.from_json_file(src)

    def dying_parts():
        for n, (name, tree) in enumerate(iter_hf_parts(SafetensorsReader(src), cfg, abstract_model(cfg), jnp.float32)):
            if n == 2:
                raise KeyboardInterrupt
            yield name, tree

    out = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, {}, dying_parts())
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    # a directory without the manifest (e.g. killed -9 mid-rename target) is refused
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="not a complete cpkv checkpoint"):
        load_checkpoint(tmp_path / "half")


def _broken_copy(tmp_path, edit):
    dst = tmp_path / "hf"
    shutil.copytree(FIXTURES / "glm_tiny", dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), r"missing tensor.*experts\.3\.up_proj"),
    (lambda t: t.update({"model.layers.0.self_attn.bogus.weight": np.zeros(3, np.float32)}), r"unexpected.*bogus"),
    (lambda t: t.update({"model.layers.2.self_attn.o_proj.weight": np.zeros((64, 100), np.float32)}),
     r"model\.layers\.2\.self_attn\.o_proj\.weight.*shape"),
    (lambda t: t.pop("model.layers.3.eh_proj.weight"), r"missing.*model\.layers\.3\.eh_proj"),
])
def test_checkpoint_errors_name_the_key(tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_hf(_broken_copy(tmp_path, edit))


def test_fp8_errors(tmp_path):
    dst = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "glm_tiny_fp8", dst)
    st = dst / "model.safetensors"
    from models.weights import _safetensors_header
    header, _ = _safetensors_header(st)
    reader = SafetensorsReader(dst)
    tensors = {k: reader._raw(k) for k in header}
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = np.ones((3, 3), np.float32)
    from safetensors.flax import save_file as save_flax
    save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, st)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv has shape \(3, 3\)"):
        load_hf(dst)
    tensors.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, st)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight is fp8 but has no .*weight_scale_inv"):
        load_hf(dst)


def test_load_model_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither a cpkv checkpoint"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(tmp_path, {}, iter([]))


def test_tiny_is_deterministic():
    a, b = load_model("tiny-random"), load_model("tiny-random")
    assert_trees_equal(pure(a), pure(b))
    assert a.cfg.num_nextn_predict_layers == 1 and a.mtp is not None


def test_model_names_resolve_to_their_tokenizer():
    """'tiny' and 'tiny-random' by name get their own checkpoint's tokenizer and eos ids (the engine,
    PD engines and `cpkv-jax serve` resolve names through resolve_model_dir)."""
    from cpkv_jax.engine import Engine, EngineConfig, _generation_eos, _load_tokenizer
    from models.weights import TINY_DIR, is_checkpoint, resolve_model_dir, tiny_random_checkpoint

    assert resolve_model_dir("tiny-random") == tiny_random_checkpoint()
    assert resolve_model_dir("some/dir") == Path("some/dir")
    rnd = _load_tokenizer("tiny-random")
    assert rnd is not None and rnd.get_vocab_size() == load_model("tiny-random").cfg.vocab_size
    assert _generation_eos("tiny-random") == set()
    eng = Engine("tiny-random", EngineConfig(page_size=16, kv_pages=16))
    assert eng.tokenizer is not None and eng.tokenizer.to_str() == rnd.to_str()
    assert is_checkpoint(TINY_DIR) and resolve_model_dir("tiny") == TINY_DIR
    trained = _load_tokenizer("tiny")
    assert trained is not None and trained.to_str() != rnd.to_str()
    assert trained.to_str() == _load_tokenizer(str(TINY_DIR)).to_str()


def _damaged(converted, tmp_path, damage):
    """A copy of the converted checkpoint with `damage(dir)` applied."""
    dst = tmp_path / "ck"
    shutil.copytree(converted, dst)
    damage(dst)
    return dst


def _largest_file(part: Path) -> Path:
    return max((f for f in part.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _flip_byte(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x5A
    f.write_bytes(bytes(data))


def _edit_manifest(edit):
    def damage(d):
        m = json.loads((d / "cpkv_checkpoint.json").read_text())
        edit(m)
        (d / "cpkv_checkpoint.json").write_text(json.dumps(m))
    return damage


@pytest.mark.parametrize("damage, message", [
    (lambda d: _flip_byte(_largest_file(d / "layer_1")), "layer_1: content hash differs"),
    (lambda d: _largest_file(d / "layer_0").write_bytes(_largest_file(d / "layer_0").read_bytes()[:-100]),
     "layer_0: content hash differs"),
    (lambda d: _flip_byte(_largest_file(d / "mtp")), "mtp: content hash differs"),
    (lambda d: shutil.rmtree(d / "layer_2"), "part layer:2 is missing"),
    (_edit_manifest(lambda m: m["parts"].remove("layer:1")), "missing ['layer:1']"),
    (_edit_manifest(lambda m: m["parts"].append("layer:99")), "unknown ['layer:99']"),
    (_edit_manifest(lambda m: m.update(parts="top")), "'parts' must be a list"),
    (_edit_manifest(lambda m: m["digests"].pop("top")), "'digests' must map every part"),
    (_edit_manifest(lambda m: m.update(format_version=7)), "format 7 unsupported"),
    (lambda d: (d / "cpkv_checkpoint.json").write_text("{not json"), "not a readable JSON manifest"),
])
def test_damaged_checkpoint_is_refused_naming_the_problem(converted, tmp_path, damage, message):
    """Byte flips, truncation, a deleted part and every kind of bad manifest: a CheckpointError naming
    the file and the problem, never a model with different weights (today's flipped byte or missing
    layer loaded silently)."""
    ck = _damaged(converted, tmp_path, damage)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck)
    assert message in str(e.value), str(e.value)


def test_verified_load_reads_back_what_conversion_wrote(converted):
    """The manifest's hashes and shapes come from the parts as written: a clean checkpoint verifies, and
    skipping verification loads the same weights."""
    m = json.loads((converted / "cpkv_checkpoint.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and set(m["digests"]) == set(m["parts"])
    assert m["arrays"]["top"]["embed_tokens"][0] == [ModelConfig.from_json_file(converted / "config.json").vocab_size,
                                                     ModelConfig.from_json_file(converted / "config.json").hidden_size]
    assert_trees_equal(pure(load_checkpoint(converted, verify=False)), pure(load_checkpoint(converted)))


def test_damaged_hf_files_are_checkpoint_errors_naming_the_file(tmp_path, capsys):
    """A truncated safetensors file, an index that is not JSON and a corrupt tokenizer.json each end in
    one CheckpointError naming the file (the CLI: exit 2 and one line), not a library traceback."""
    from cpkv_jax.cli import main
    from cpkv_jax.engine import Engine
    trunc = tmp_path / "trunc"
    shutil.copytree(FIXTURES / "glm_tiny", trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        SafetensorsReader(trunc)
    assert main(["convert", "--hf", str(trunc), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    index = tmp_path / "index"
    shutil.copytree(FIXTURES / "glm_tiny", index)
    (index / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a safetensors index"):
        SafetensorsReader(index)
    tok = tmp_path / "tok"
    shutil.copytree(FIXTURES / "glm_tiny", tok)
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": {broken')
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizer.json"):
        Engine(str(tok))


def test_checkpoint_saved_on_other_devices_restores_on_this_one(tmp_path):
    """A checkpoint records the sharding its arrays had when saved (here: a mesh of 8 devices); a
    machine without those devices (1 device, like a GPU box loading the CPU-trained `tiny`) must still
    restore it, onto its own default device."""
    import subprocess
    import sys
    from models.weights import model_parts
    model = hf_model("glm_indexcache")
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    on_mesh = NamedSharding(mesh, jax.sharding.PartitionSpec())
    parts = [(name, jax.tree.map(lambda x: jax.device_put(x, on_mesh), tree)) for name, tree in model_parts(model)]
    out = save_checkpoint(tmp_path / "ck", json.loads((FIXTURES / "glm_indexcache" / "config.json").read_text()),
                          iter(parts))
    np.save(tmp_path / "embed.npy", np.asarray(model.embed_tokens[...]))
    code = (f"import numpy as np, jax; from models.weights import load_checkpoint; "
            f"m = load_checkpoint({str(out)!r}); assert jax.device_count() == 1; "
            f"assert np.array_equal(np.asarray(m.embed_tokens[...]), np.load({str(tmp_path / 'embed.npy')!r})); "
            f"print('restored on', m.embed_tokens[...].sharding)")
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "restored on" in r.stdout
