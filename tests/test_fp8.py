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
    assert kept.groups[0].unit[0].self_attn.q_b_proj.kernel[...].dtype == jnp.float8_e4m3fn
    assert param_bytes(kept) < 0.6 * param_bytes(wide)
    ref = reference("glm_tiny_fp8")
    a = np.asarray(prefill_logits(kept, ref["prefill_tokens"]))
    b = np.asarray(prefill_logits(wide, ref["prefill_tokens"]))
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    assert np.abs(a - ref["prefill_logits"]).max() <= 1e-5 * np.abs(ref["prefill_logits"]).max()


def test_conversion_keeps_the_checkpoint_fp8_bytes_and_scales(tmp_path, capsys):
    """`convert` with no dtype stores every fp8 weight's bytes and block scales as the checkpoint has
    them (transposed to our [in, out]); with --dtype it stores no fp8 at all."""
    out = tmp_path / "kept"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(out), "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    reader = SafetensorsReader(FIXTURE)
    assert tuple(printed["fp8_linears"]) == reader.fp8_linears()
    model = load_checkpoint(out)
    assert model.cfg.fp8_linears == reader.fp8_linears()
    layer = model.groups[1].unit[0]                                  # layer 1: a sparse MoE layer
    r = 0
    for key, w, s in (("model.layers.1.self_attn.q_b_proj.weight", layer.self_attn.q_b_proj.kernel,
                       layer.self_attn.q_b_proj.scale_inv),
                      ("model.layers.1.mlp.shared_experts.up_proj.weight", layer.mlp.shared_experts.up_proj.kernel,
                       layer.mlp.shared_experts.up_proj.scale_inv)):
        raw, scale = reader.fp8_block(key)
        np.testing.assert_array_equal(np.asarray(w[...][r]).T.view(np.uint8), raw.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(s[...][r]).T, scale)
    for e in range(model.cfg.n_routed_experts):
        raw, scale = reader.fp8_block(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
        np.testing.assert_array_equal(np.asarray(layer.mlp.experts_down[...][r, e]).T.view(np.uint8), raw.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(layer.mlp.experts_down_scale_inv[...][r, e]).T, scale)
    wide = tmp_path / "wide"
    assert main(["convert", "--hf", str(FIXTURE), "--out", str(wide), "--dtype", "float32", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8_linears"] == []
    dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(load_checkpoint(wide)))}
    assert dtypes == {"float32"}


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
    assert model.groups[-1].unit[0].mlp.experts_up[...].dtype == jnp.float8_e4m3fn
    assert np.isfinite(np.asarray(prefill_logits(model, np.arange(24)[None] % cfg.vocab_size))).all()
