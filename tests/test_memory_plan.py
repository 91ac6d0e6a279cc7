"""The memory plan (cpkv_jax/memory_plan.py) against arrays actually placed on a mesh, and the real
configs on an 8 x H200 node."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cpkv_jax.kv_pool import KVPool
from cpkv_jax.memory_plan import MeshPlanError, MeshShape, kv_bytes_per_token, plan, weight_bytes
from models.config import FP8_LINEARS_ALL, ModelConfig
from models.sharding import place_state
from models.weights import load_hf
from tests.helpers import FIXTURES

H200_GIB = 140.4   # 143,771 MiB as nvidia-smi reports it


def _device0_param_bytes(model) -> int:
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model)) for s in x.addressable_shards
               if s.device == dev)


@pytest.mark.parametrize("axes", [dict(ep=8), dict(ep=2, tp=4), dict(tp=8)])
def test_per_device_weight_bytes_equal_the_shards_placed_on_a_mesh(axes):
    """The planner's per-device bytes equal what device 0 holds after the model is placed by the same
    sharding table on a real (8 simulated devices) mesh: experts 1/(ep tp), head/vocab/MLP splits 1/tp."""
    names = tuple(axes)
    mesh = jax.make_mesh(tuple(axes.values()), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    model = load_hf(FIXTURES / "glm_indexcache")
    state = nnx.state(model)
    nnx.update(model, place_state(state, mesh))
    held = _device0_param_bytes(model)
    tp = axes.get("tp", 1)      # the engine's experts split over 'ep' and 'tp': the planner's ep is the product
    _, per_device = weight_bytes(model.cfg, jnp.float32, MeshShape(tp=tp, ep=axes.get("ep", 1) * tp, dp=8 // tp))
    assert sum(per_device.values()) == held
    if "tp" in axes:   # the head split is real: q_b_proj's shard is 1/tp of its columns
        q_b = model.groups[0].unit[0].self_attn.q_b_proj.kernel[...]
        assert q_b.addressable_shards[0].data.shape[-1] == q_b.shape[-1] // axes["tp"]


def test_kv_bytes_per_token_equal_a_created_pool():
    cfg = ModelConfig.named("tiny")
    for index_dtype in ("fp8", "same"):
        pool = KVPool.create(cfg, 4, 16, jnp.bfloat16, index_dtype, draft=True)
        assert kv_bytes_per_token(cfg, jnp.bfloat16, index_dtype) == pool.bytes_per_token()


@pytest.mark.parametrize("name", ["glm-5", "deepseek-v3.2"])
def test_real_configs_fit_an_8_h200_node_in_fp8_but_not_in_bf16(name):
    cfg = ModelConfig.named(name)
    fp8 = plan(cfg, devices=8, device_memory_gib=H200_GIB, mesh=MeshShape(dp=8, ep=8))
    assert fp8["fits"] and fp8["kv_tokens"] >= 500_000, fp8
    assert fp8["total_weight_bytes"] > 600 * 2**30            # the whole model, not a slice
    total, _ = weight_bytes(cfg.replace(fp8_linears=FP8_LINEARS_ALL), jnp.bfloat16, MeshShape())
    assert fp8["per_device_bytes"]["weights_experts"] * 8 == total["experts"]   # ep = 8: no replication
    bf16 = plan(cfg, devices=8, device_memory_gib=H200_GIB, mesh=MeshShape(dp=8, ep=8), weights="bf16")
    assert not bf16["fits"] and bf16["kv_tokens"] == 0
    tp = plan(cfg, devices=8, device_memory_gib=H200_GIB, mesh=MeshShape(tp=8, ep=8))
    assert tp["per_device_bytes"]["weights"] < fp8["per_device_bytes"]["weights"]   # attention split 8 ways
    assert tp["kv_tokens"] < fp8["kv_tokens"]                                       # but the latent is replicated


def test_the_dispatch_buffers_count_the_capacity_free_exchange_and_auto_falls_back_where_they_do_not_fit():
    """dispatch_bytes counts what models.moe.dispatched_expert_mlp allocates: a rank sends its own rows'
    k slots and receives into ep x that many (no capacity factor); psum holds fp32 partials of every
    row. At dp = ep = 8 and 8192 prefill tokens per device the all-to-all's buffers leave GLM-5 no KV page,
    so 'auto' (the engine's rule: fewer bytes sent) falls back to psum and says so; at 2048 tokens, or
    with tp = 8 (each of the 8 ranks dispatches 1/8 of the shared rows), the all-to-all stays."""
    from cpkv_jax.memory_plan import dispatch_bytes
    cfg = ModelConfig.named("glm-5")
    D, k, inter, ep = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size, 8
    slots = 8192 * k
    assert dispatch_bytes(cfg, 8192, MeshShape(dp=8, ep=8), "all_to_all") == (
        2 * D * (2 * slots + 2 * ep * slots + 8192) + 2 * 2 * inter * ep * slots + 4 * ep * slots)
    assert dispatch_bytes(cfg, 8192, MeshShape(dp=8, ep=8), "psum") == 8192 * D * 4
    own = 8192 // 8                      # tp = 8: the 8 ranks share the rows, each dispatches 1/8, all-gathers
    assert dispatch_bytes(cfg, 8192, MeshShape(tp=8, ep=8), "all_to_all") == (
        2 * D * (2 * own * k + 2 * ep * own * k + 8192) + 2 * 2 * inter * ep * own * k + 4 * ep * own * k)
    assert dispatch_bytes(cfg, 8192, MeshShape(dp=8), "all_to_all") == 0            # no expert split
    node = dict(devices=8, device_memory_gib=H200_GIB)
    forced = plan(cfg, mesh=MeshShape(dp=8, ep=8), ep_dispatch="all_to_all", **node)
    assert not forced["fits"] and forced["per_device_bytes"]["ep_dispatch_buffers"] > 16 * 2**30
    auto = plan(cfg, mesh=MeshShape(dp=8, ep=8), **node)
    assert auto["fits"] and auto["ep_dispatch"] == "psum" and "leave no KV page" in auto["ep_dispatch_reason"]
    short = plan(cfg, mesh=MeshShape(dp=8, ep=8), prefill_tokens=2048, **node)
    assert short["fits"] and short["ep_dispatch"] == "all_to_all" and short["ep_dispatch_reason"] == "fewer bytes sent"
    tp = plan(cfg, mesh=MeshShape(tp=8, ep=8), **node)
    assert tp["ep_dispatch"] == "all_to_all" and tp["fits"]
    tbo = plan(cfg, mesh=MeshShape(tp=8, ep=8), two_batch_overlap=True, **node)
    assert tbo["two_batch_overlap"] and abs(tbo["kv_tokens"] - tp["kv_tokens"]) < 0.01 * tp["kv_tokens"]


@pytest.mark.parametrize("mesh, devices, message", [
    (MeshShape(tp=3, dp=1), 3, "tp=3 does not divide num_attention_heads=64"),
    (MeshShape(dp=3, ep=3), 3, "ep=3 does not divide n_routed_experts=256"),
    (MeshShape(dp=4, ep=8), 8, "dp x cp x tp = 4 x 1 x 1 = 4 devices, but 8 are given"),
    (MeshShape(dp=8, ep=16), 8, "ep=16 does not divide the 8 devices"),
    (MeshShape(tp=32, ep=32), 32, "does not split 32 ways into whole 128-wide fp8 blocks"),  # 2048 / 32 = 64
])
def test_meshes_that_do_not_divide_the_model_are_rejected_naming_the_count(mesh, devices, message):
    with pytest.raises(MeshPlanError, match=re.escape(message)):
        plan(ModelConfig.named("glm-5"), devices=devices, device_memory_gib=H200_GIB, mesh=mesh)


def test_mesh_flag_parsing():
    assert MeshShape.parse("ep=8,dp=8") == MeshShape(dp=8, ep=8)
    for bad in ("ep=0", "xp=2", "ep", "tp=two"):
        with pytest.raises(MeshPlanError, match="axis=N"):
            MeshShape.parse(bad)
    tiny = plan(ModelConfig.named("tiny"), devices=1, device_memory_gib=1.0, page_size=64)
    assert tiny["fits"] and tiny["kv_tokens"] % 64 == 0 and tiny["kv_tokens"] > 0


def test_plan_cli_prints_one_json_object_and_refuses_a_bad_mesh(capsys):
    from cpkv_jax.cli import main
    assert main(["plan", "--model", "glm-5", "--devices", "8", "--device-memory", str(H200_GIB), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["kv_tokens"] > 0 and out["per_device_bytes"]["weights"] > 0
    assert out == plan(ModelConfig.named("glm-5"), devices=8, device_memory_gib=H200_GIB)
    assert main(["plan", "--model", "glm-5", "--devices", "8", "--device-memory", "140", "--mesh", "tp=3,ep=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dp x cp x tp = 1 x 1 x 3 = 3 devices, but 8 are given" in err[0]
