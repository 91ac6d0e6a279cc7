"""fp8 weights kept fp8: e4m3 values and 128 x 128 block scales from the checkpoint, stored as such by
conversion, dequantized where a linear uses them. Baselines: the same checkpoint dequantized at load
(the path HF parity was proven on) and the checkpoint's own bytes."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from cpkv_jax.cli import main
from models import fp8
from models.config import FP8_LINEARS_ALL, ModelConfig
from models.model import DsaModel, prefill_logits
from models.weights import SafetensorsReader, load_checkpoint, read_weight
from tests.helpers import FIXTURES, hf_model, reference

FIXTURE = FIXTURES / "glm_tiny_fp8"


def param_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def test_fixture_linears_stay_fp8_and_equal_the_dequantized_model():
    """Loaded with no dtype, the fixture's fp8 linears stay fp8 (fewer bytes); its logits equal those of
    the same checkpoint dequantized at load to fp32 (both compute value x scale in fp32), and HF's."""
    reader = SafetensorsReader(FIXTURE)
    names = reader.fp8_linears()
    assert {"self_attn.q_b_proj", "mlp.experts.gate_proj", "mlp.shared_experts.down_proj", "eh_proj"} <= set(names)
    assert "self_attn.kv_a_proj_with_mqa" not in names           # stored unquantized in this fixture
    kept, wide = hf_model("glm_tiny_fp8"), hf_model("glm_tiny_fp8", "float32")
    assert kept.cfg.fp8_linears == names and wide.cfg.fp8_linears == ()
    q_b = kept.groups[0].unit[0].self_attn.q_b_proj
    assert q_b.kernel is None and q_b.fp8_weight[...].dtype == jnp.float8_e4m3fn
    assert param_bytes(kept) < 0.6 * param_bytes(wide)
    ref = reference("glm_tiny_fp8")
    a = np.asarray(prefill_logits(kept, ref["prefill_tokens"]))
    b = np.asarray(prefill_logits(wide, ref["prefill_tokens"]))
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    assert np.abs(a - ref["prefill_logits"]).max() <= 1e-5 * np.abs(ref["prefill_logits"]).max()


def test_conversion_keeps_the_checkpoint_fp8_bytes_and_scales(tmp_path, capsys):
    """`convert` with no dtype stores every fp8 weight's bytes and block scales as the checkpoint has
    them, not transposed at all: a Dense's fp8_weight is HF's [out, in], the routed experts K-major
    [E, N, K] (HF's own [out, in] per expert): bit-equal bytes, same shapes; with --dtype it stores no
    fp8 at all, a Dense's kernel is [in, out] and the experts are [E, K, N]."""
    out = tmp_path / "kept"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(out), "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    reader = SafetensorsReader(FIXTURE)
    assert tuple(printed["fp8_linears"]) == reader.fp8_linears()
    model = load_checkpoint(out)
    assert model.cfg.fp8_linears == reader.fp8_linears()
    layer = model.groups[1].unit[0]                                  # layer 1: a sparse MoE layer
    r = 0
    for key, dense in (("model.layers.1.self_attn.q_b_proj.weight", layer.self_attn.q_b_proj),
                       ("model.layers.1.mlp.shared_experts.up_proj.weight", layer.mlp.shared_experts.up_proj)):
        raw, scale = reader.fp8_block(key)
        assert raw.shape[0] != raw.shape[1] and dense.kernel is None   # a transposed copy cannot pass
        np.testing.assert_array_equal(np.asarray(dense.fp8_weight[...][r]).view(np.uint8), raw.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(dense.scale_inv[...][r]), scale)
    eh = model.mtp.eh_proj
    raw, scale = reader.fp8_block(f"model.layers.{model.cfg.num_hidden_layers}.eh_proj.weight")
    np.testing.assert_array_equal(np.asarray(eh.fp8_weight[...]).view(np.uint8), raw.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(eh.scale_inv[...]), scale)
    cfg = model.cfg
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert D != I                                      # so a transposed expert cannot pass for one in place
    for name, shape in (("gate_proj", (E, I, D)), ("up_proj", (E, I, D)), ("down_proj", (E, D, I))):
        ours = name.replace("_proj", "")
        w, s = getattr(layer.mlp, f"experts_{ours}")[...][r], getattr(layer.mlp, f"experts_{ours}_scale_inv")[...][r]
        assert w.dtype == jnp.float8_e4m3fn and w.shape == shape and s.shape == (E, *fp8.scale_shape(shape[1:]))
        for e in range(E):
            raw, scale = reader.fp8_block(f"model.layers.1.mlp.experts.{e}.{name}.weight")
            np.testing.assert_array_equal(np.asarray(w[e]).view(np.uint8), raw.view(np.uint8))
            np.testing.assert_array_equal(np.asarray(s[e]), scale)
    mtp = model.mtp.layer.mlp                          # the MTP layer's experts: stored the same way
    raw, scale = reader.fp8_block(f"model.layers.{cfg.num_hidden_layers}.mlp.experts.3.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(mtp.experts_up[...][3]).view(np.uint8), raw.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mtp.experts_up_scale_inv[...][3]), scale)
    wide = tmp_path / "wide"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(wide), "--dtype", "float32", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8_linears"] == []
    wide_model = load_checkpoint(wide)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(wide_model))}
    assert dtypes == {"float32"}
    wide_down = wide_model.groups[1].unit[0].mlp.experts_down[...][r]          # plain: [E, K, N] = [E, I, D]
    assert wide_down.shape == (E, I, D)
    np.testing.assert_array_equal(np.asarray(wide_down[2]),
                                  reader.get("model.layers.1.mlp.experts.2.down_proj.weight").T)


def test_a_checkpoint_with_fp8_linears_in_an_old_layout_is_refused(tmp_path):
    """Formats 1 and 2 stored kept-fp8 routed experts [E, K, N], 1 to 3 kept-fp8 dense linears [in, out];
    this version keeps both as HF's [out, in]. Such a checkpoint (its manifest says format 2 or 3, its
    config names fp8 experts and dense linears) is refused with a CheckpointError naming the layout,
    instead of loading transposed weights; an old checkpoint with no fp8 linears still loads."""
    import shutil

    import pytest

    from models.weights import CheckpointError, FORMAT_VERSION, MANIFEST
    kept = tmp_path / "kept"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(kept), "--quiet"]) == 0
    assert json.loads((kept / MANIFEST).read_text())["format_version"] == FORMAT_VERSION == 4

    def as_format(src, dst, version=2):
        shutil.copytree(src, dst)
        m = json.loads((dst / MANIFEST).read_text())
        (dst / MANIFEST).write_text(json.dumps({**m, "format_version": version}))
        return dst
    as_format_2 = as_format
    with pytest.raises(CheckpointError, match=r"old \[E, K, N\] layout.*K-major \[E, N, K\].*re-convert"):
        load_checkpoint(as_format_2(kept, tmp_path / "old_kept"))
    with pytest.raises(CheckpointError, match=r"format 3 stores the fp8 linears \(.*self_attn.q_b_proj.*\) as "
                                              r"\[in, out\].*\[out, in\].*re-convert"):
        load_checkpoint(as_format(kept, tmp_path / "v3_kept", 3))
    wide = tmp_path / "wide"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(wide), "--dtype", "float32", "--quiet"]) == 0
    model = load_checkpoint(as_format_2(wide, tmp_path / "old_wide"))
    assert model.cfg.fp8_linears == ()


class BlockReader:
    """A reader of one block-scaled weight [300, 200] with a different scale in each 128 x 128 block."""

    def __init__(self, rng):
        self.w = rng.standard_normal((300, 200)).astype(ml_dtypes.float8_e4m3fn)
        self.scale = (1.0 + np.arange(6, dtype=np.float32).reshape(3, 2)) / 64

    def fp8_block(self, key):
        return self.w, self.scale

    def get(self, key):
        full = np.repeat(np.repeat(self.scale, 128, 0), 128, 1)[:300, :200]
        return self.w.astype(np.float32) * full


def test_read_weight_transposes_values_and_scales_together():
    """A weight larger than one block in both dims, with a distinct scale per block: the kept-fp8 pair,
    transposed to our layout, dequantizes to exactly the transpose of the checkpoint's dequantized
    weight (a scale grid left untransposed, or transposed alone, would not)."""
    reader = BlockReader(np.random.default_rng(0))
    w, s = read_weight(reader, "k", True, jnp.float8_e4m3fn)
    assert w.shape == (200, 300) and s.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(w, s, jnp.float32)), reader.get("k").T)
    np.testing.assert_array_equal(read_weight(reader, "k", True, jnp.float32), reader.get("k").T)


def test_quantize_round_trip_and_random_fp8_model():
    """fp8.quantize puts each block's largest magnitude at the e4m3 maximum: the round trip is within
    e4m3's rounding (2^-4 relative to the block's largest value). A random model with every DeepSeek
    fp8 linear kept fp8 runs and gives finite logits."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 260, 130)).astype(np.float32) * np.array([1e-3, 10.0])[:, None, None]
    q, s = fp8.quantize(w)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (2, 3, 2)
    back = np.asarray(fp8.dequantize(jnp.asarray(q), jnp.asarray(s), jnp.float32))
    assert (np.abs(back - w) <= 2 ** -4 * np.abs(w).max(axis=(1, 2))[:, None, None]).all()
    cfg = ModelConfig.named("tiny", fp8_linears=list(FP8_LINEARS_ALL))
    model = DsaModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    mlp = model.groups[-1].unit[0].mlp
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert mlp.experts_up[...].dtype == jnp.float8_e4m3fn
    assert mlp.experts_up[...].shape[-3:] == (E, I, D) and mlp.experts_down[...].shape[-3:] == (E, D, I)   # K-major
    assert mlp.experts_down_scale_inv[...].shape[-3:] == (E, *fp8.scale_shape((D, I)))
    assert np.isfinite(np.asarray(prefill_logits(model, np.arange(24)[None] % cfg.vocab_size))).all()


def test_moe_with_some_experts_fp8_equals_their_dequantized_weights():
    """A layer whose routed experts are fp8 for one projection only (gate_proj: K-major [E, I, D]) and
    plain for the others: the layer dequantizes that one to [E, D, I] itself and equals a plain layer
    holding the dequantized weights."""
    from models.moe import MoE
    from pallas_kernels.moe import fp8_experts_as_plain
    cfg = ModelConfig.named("tiny", fp8_linears=["mlp.experts.gate_proj"])
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    mixed = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(2))
    assert mixed.experts_gate[...].shape == (E, I, D) and mixed.experts_up[...].shape == (E, D, I)
    assert mixed.experts_up_scale_inv is None
    graph, state = nnx.split(MoE(cfg.replace(fp8_linears=()), dtype=jnp.float32, rngs=nnx.Rngs(3)))
    pure = nnx.to_pure_dict(nnx.state(mixed))
    pure["experts_gate"] = fp8_experts_as_plain(pure.pop("experts_gate"), pure.pop("experts_gate_scale_inv"),
                                                jnp.float32)
    nnx.replace_by_pure_dict(state, pure)
    plain = nnx.merge(graph, state)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 9, D)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(mixed(x)), np.asarray(plain(x)))
