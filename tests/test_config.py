import json

import pytest
from hypothesis import given, settings, strategies as st

from models.config import ModelConfig, ModelConfigError, indexer_types_for
from models.model import plan_layer_groups
from tests.helpers import FIXTURES


def test_real_configs_parse():
    glm = ModelConfig.named("glm-5")
    assert (glm.vocab_size, glm.hidden_size, glm.num_hidden_layers, glm.num_attention_heads) == (154880, 6144, 78, 64)
    assert (glm.q_lora_rank, glm.kv_lora_rank, glm.qk_nope_head_dim, glm.qk_rope_head_dim, glm.v_head_dim) == \
        (2048, 512, 192, 64, 256)
    assert (glm.index_n_heads, glm.index_head_dim, glm.index_topk) == (32, 128, 2048)
    assert glm.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert glm.indexer_types == ("full",) * 78 and glm.indexer_rope_interleaved
    assert glm.rope.type == "default" and glm.rope.theta == 1e6
    ds = ModelConfig.named("deepseek-v3.2")
    assert (ds.n_group, ds.topk_group, ds.index_n_heads, ds.num_hidden_layers) == (8, 4, 64, 61)
    assert ds.rope.type == "yarn" and ds.rope.factor == 40 and ds.rope.original_max_position_embeddings == 4096
    assert not ds.indexer_rope_interleaved
    # yarn: scale = qk_head_dim^-0.5 * mscale(40, 1)^2
    m = 0.1 * 1.0 * __import__("math").log(40) + 1
    assert ds.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    tiny = ModelConfig.named("tiny")
    assert tiny.index_n_heads >= 16 and "shared" in tiny.indexer_types and tiny.num_nextn_predict_layers == 1


def test_glm52_indexcache_78_layers_exact():
    cfg = ModelConfig.named("glm-5.2")
    expected = [0, 1, 2] + list(range(6, 78, 4))
    assert list(cfg.full_layers) == expected
    assert len(expected) == 21 and expected[-1] == 74
    assert indexer_types_for(78, freq=4, offset=3) == cfg.indexer_types


def test_indexer_types_priority():
    assert indexer_types_for(3, indexer_types=["full", "shared", "shared"], pattern="FFF", freq=1) == \
        ("full", "shared", "shared")
    assert indexer_types_for(3, pattern="FSF", freq=1) == ("full", "shared", "full")
    assert indexer_types_for(4, freq=2, offset=2) == ("full", "full", "shared", "full")
    assert indexer_types_for(4) == ("full",) * 4  # default freq 1


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(model_type="llama"), "unsupported model_type"),
    (lambda d: d.pop("kv_lora_rank"), "missing required field 'kv_lora_rank'"),
    (lambda d: d.update(n_group=3), "not divisible by n_group"),
    (lambda d: d.update(topk_group=9, n_group=8), "topk_group"),
    (lambda d: d.update(index_topk_pattern="FSX"), "may only contain"),
    (lambda d: d.update(indexer_types=["shared"] * 6), "layer 0 must be a 'full'"),
    (lambda d: d.update(indexer_types=["full"] * 5), "5 entries for 6 layers"),
    (lambda d: d.update(mlp_layer_types=["dense"] * 2), "mlp_layer_types"),
    (lambda d: d.update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.update(index_head_dim=8), "qk_rope_head_dim"),
    (lambda d: d.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), "rope type"),
    (lambda d: d.update(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_config_errors(mutate, message):
    d = json.loads((FIXTURES.parent.parent / "models/configs/tiny.json").read_text())
    mutate(d)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_deepseek_rejects_indexcache_fields():
    d = json.loads((FIXTURES.parent.parent / "models/configs/deepseek-v3.2.json").read_text())
    d["index_topk_pattern"] = "F" * 61
    with pytest.raises(ModelConfigError, match="GLM IndexCache field"):
        ModelConfig.from_hf_dict(d)


def test_config_file_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_json_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path)
    with pytest.raises(ModelConfigError, match="no shipped config"):
        ModelConfig.named("glm-9")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["dense", "sparse"]), st.sampled_from(["full", "shared"])),
                min_size=1, max_size=90))
def test_layer_groups_cover_every_layer_once(kinds):
    groups = plan_layer_groups(kinds)
    ids = [i for g in groups for row in g.layer_ids for i in row]
    assert ids == list(range(len(kinds)))
    for g in groups:
        for row in g.layer_ids:
            assert [kinds[i] for i in row] == list(g.unit)
        assert len(g.unit) == 1 or g.repeats >= 2


def test_glm52_groups_are_few():
    cfg = ModelConfig.named("glm-5.2")
    groups = plan_layer_groups([cfg.layer_kind(i) for i in range(78)])
    assert [(len(g.unit), g.repeats) for g in groups] == [(1, 3), (4, 18), (1, 3)]
