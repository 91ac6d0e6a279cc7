"""Will a model fit a set of devices, and how many KV tokens are left: per-device bytes of weights (from
the abstract model's leaves placed by the sharding table, models/sharding.py), the KV pool, the host
pool and the activations of one prefill step, for a mesh of dp x cp x tp devices with the routed
experts split ep ways.

The layout it plans (issue: the real GLM-5 on a mesh): attention heads, the indexer's heads, dense and
shared-expert MLPs and the vocabulary split over `tp`; routed experts over `ep` (a divisor of the
device count; experts are replicated devices / ep times); the KV pool's pages split over `cp` ranks and
over `dp` replicas (each its own requests), the latent cache replicated over `tp` (MLA's latent is
shared by every head, so a head split cannot split it).

The engine's meshes in these terms: `--tp T --ep E` (cp x ep x tp devices) is tp = T with the experts
split ep = E x T ways and, when E > 1, attention replicated over E (no planner axis: the planner's dp
is data-parallel attention, each replica its own requests and pages, which the engine does not run).
So `--tp 8` on 8 GPUs is the planner's tp=8,ep=8."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from models.config import FP8_LINEARS_ALL, ModelConfig
from models.kv import kv_cache_shapes
from models.moe import choose_ep_dispatch
from models.sharding import RULES, param_logical_axes

GIB = 1 << 30
KINDS = ("experts", "attention", "dense_mlp", "embedding", "other")


class MeshPlanError(ValueError):
    """A mesh that cannot hold the model's layout (a count it does not divide)."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp

    def size(self, mesh_axis: str | None) -> int:
        return 1 if mesh_axis is None else getattr(self, mesh_axis)

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """'ep=8,tp=1,cp=1,dp=8' (any subset; the rest 1)."""
        kw = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            name, eq, value = item.partition("=")
            if not eq or name not in {f.name for f in dataclasses.fields(cls)} or not value.isdigit() or int(value) < 1:
                raise MeshPlanError(f"mesh: {item!r} is not axis=N with an axis of dp, cp, tp, ep and N >= 1")
            kw[name] = int(value)
        return cls(**kw)


def split_error(cfg: ModelConfig, ep: int, tp: int, label=lambda axis, n: f"{axis}={n}",
                expert_label: str | None = None) -> str | None:
    """The first count an ep / tp split does not divide (experts, `ep` ways; heads, index heads,
    vocabulary, MLP intermediate), as a message with the split named by `label(axis, size)` (the
    experts' by `expert_label` if given); None if all divide. Shared by the planner and the engine's
    mesh (whose experts split ep_size x tp_size ways: it passes their product as `ep`)."""
    for axis, size, count, name in (("ep", ep, cfg.n_routed_experts, "n_routed_experts"),
                                    ("tp", tp, cfg.num_attention_heads, "num_attention_heads"),
                                    ("tp", tp, cfg.index_n_heads, "index_n_heads"),
                                    ("tp", tp, cfg.vocab_size, "vocab_size"),
                                    ("tp", tp, cfg.intermediate_size, "intermediate_size"),
                                    ("tp", tp, cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1),
                                     "the shared experts' intermediate size")):
        if count % size:
            named = expert_label if axis == "ep" and expert_label else label(axis, size)
            return f"{named} does not divide {name}={count}"
    return None


def check_mesh(cfg: ModelConfig, mesh: MeshShape, devices: int) -> None:
    """Reject a mesh that does not match the devices or divide the counts its axes split."""
    if mesh.devices != devices:
        raise MeshPlanError(f"dp x cp x tp = {mesh.dp} x {mesh.cp} x {mesh.tp} = {mesh.devices} devices, "
                            f"but {devices} are given")
    if devices % mesh.ep:
        raise MeshPlanError(f"ep={mesh.ep} does not divide the {devices} devices")
    error = split_error(cfg, mesh.ep, mesh.tp)
    if error:
        raise MeshPlanError(error)


def _kind(path: tuple) -> str:
    names = [p for p in path if isinstance(p, str)]
    if names[-1].startswith("experts_"):
        return "experts"
    if "self_attn" in names:
        return "attention"
    if names[-1] == "embed_tokens" or {"lm_head", "head"} & set(names):
        return "embedding"
    if "mlp" in names and names[-1] != "e_score_correction_bias" and "gate" not in names:
        return "dense_mlp"
    return "other"


def weight_bytes(cfg: ModelConfig, dtype, mesh: MeshShape) -> tuple[dict, dict]:
    """(total bytes by kind, per-device bytes by kind): each leaf of the abstract model divided by the
    mesh sizes of the axes the sharding table gives its dimensions. A split dimension that the mesh
    does not divide, or that cuts an fp8 weight's 128-wide scale blocks, is a MeshPlanError."""
    from models.weights import abstract_model
    state = nnx.to_pure_dict(nnx.state(abstract_model(cfg, dtype)))
    total, per_device = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    for p, leaf in jax.tree_util.tree_leaves_with_path(state):
        path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)
        stacked = path[0] == "groups"
        shape = leaf.shape[1:] if stacked else leaf.shape
        nbytes = leaf.size * leaf.dtype.itemsize
        split = 1
        for dim, logical in enumerate(param_logical_axes(path, len(shape))):
            # the planner's ep is the experts' whole split (the engine's ep_size x tp_size)
            n = mesh.ep if logical == "experts" else mesh.size(getattr(RULES, logical) if logical else None)
            if n == 1:
                continue
            if shape[dim] % n or (leaf.dtype.itemsize == 1 and path[-1] == "fp8_weight" and (shape[dim] // n) % 128):
                raise MeshPlanError(f"{'/'.join(map(str, path))} {tuple(shape)}: dimension {dim} ({logical}) "
                                    f"of {shape[dim]} does not split {n} ways"
                                    + (" into whole 128-wide fp8 blocks" if leaf.dtype.itemsize == 1 else ""))
            split *= n
        kind = _kind(path)
        total[kind] += nbytes
        per_device[kind] += nbytes // split
    return total, per_device


def kv_bytes_per_token(cfg: ModelConfig, dtype, index_dtype: str = "fp8", draft: bool = True) -> int:
    """Pool bytes of one token slot over every layer (target, and the MTP layer's one-layer cache)."""
    def slot_bytes(**kw):
        return sum(s.dtype.itemsize * math.prod(s.shape) for s in jax.tree.leaves(
            kv_cache_shapes(cfg, 1, dtype, index_dtype, **kw)))
    return slot_bytes() + (slot_bytes(num_layers=1, num_full=1) if draft else 0)


def activation_bytes(cfg: ModelConfig, tokens: int, mesh: MeshShape, scores_max_bytes: int = 4 * GIB) -> int:
    """An estimate of the largest buffers alive in one prefill step of `tokens` tokens on one device
    (bf16 activations, fp32 scores), not a bound: the residual stream and its normed copies, the
    per-head queries, the absorbed path's fp32 scores over the top-k, the indexer's score buffer (capped
    by the kernel policy's scores_max_bytes) and the routed rows of the MoE (gathered, gate/up, down)."""
    T, D, H = tokens, cfg.hidden_size, cfg.num_attention_heads // mesh.tp
    k = min(cfg.index_topk, T)
    residual = 4 * T * D * 2
    queries = T * H * (cfg.qk_head_dim + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    attention_scores = T * H * k * 4
    indexer_scores = min(T * T * 4, scores_max_bytes)
    routed = T * cfg.num_experts_per_tok * (2 * D + 2 * cfg.moe_intermediate_size) * 2
    return residual + queries + attention_scores + indexer_scores + routed


def dispatch_bytes(cfg: ModelConfig, tokens: int, mesh: MeshShape, mode: str, itemsize: int = 2) -> int:
    """The expert-parallel exchange's buffers in one MoE layer of a step of `tokens` tokens per replica, on
    one device (models.moe): 'psum' holds the fp32 partial sums of every row the device holds; 'all_to_all'
    sends each of its own rows' k slots (the ranks holding the same rows, tp of them, take 1/tp each),
    receives into a buffer of ep x its slots (the most it can get: no capacity factor), runs the experts
    over that buffer (gate/up intermediate and output rows), returns the slots and all-gathers the
    combined rows back."""
    if mesh.ep == 1:
        return 0
    D, k, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    rows = -(-tokens // mesh.cp)                       # after attention: a cp rank's share of the tokens
    if mode == "psum":
        return rows * D * 4
    if mode != "all_to_all":
        raise MeshPlanError(f"ep_dispatch must be 'psum' or 'all_to_all', got {mode!r}")
    share = min(mesh.tp, mesh.ep)                      # ranks of one ep group holding the same rows
    own = -(-rows // share)
    slots = own * k
    received = mesh.ep * slots
    return (itemsize * D * (2 * slots + 2 * received + own * share)   # send, receive, expert out, back, gather
            + itemsize * 2 * inter * received + 4 * received)        # gate/up rows, the slots' expert ids


def plan(cfg: ModelConfig, *, devices: int, device_memory_gib: float, mesh: MeshShape | None = None,
         weights: str = "fp8", page_size: int = 64, prefill_tokens: int = 8192, index_dtype: str = "fp8",
         memory_fraction: float = 0.92, host_memory_gib: float = 0.0, ep_dispatch: str = "auto",
         two_batch_overlap: bool = False) -> dict:
    """The memory plan as one JSON-able dict: per-device bytes by kind, whether it fits (weights +
    activations + the expert-parallel exchange's buffers + one page per request slot below
    memory_fraction of the device) and how many KV tokens the rest holds over the whole mesh (dp replicas
    x cp ranks). ep_dispatch 'psum' / 'all_to_all', or 'auto': the engine's rule (the fewer bytes sent,
    models.moe.choose_ep_dispatch), unless that mode's buffers leave no page and the other's do (the
    all-to-all's receive buffer holds ep x a rank's slots: 17.6 GiB for GLM-5 at dp = ep = 8 and 8192
    prefill tokens per device); `ep_dispatch_reason` says which. With two_batch_overlap the step runs as
    two micro-batches of half the tokens whose buffers are alive at once (one's exchange in flight while
    the other computes): counted as two half steps."""
    mesh = mesh or MeshShape(dp=devices, ep=devices)
    check_mesh(cfg, mesh, devices)
    if weights not in ("fp8", "bf16"):
        raise MeshPlanError(f"weights must be fp8 or bf16, got {weights!r}")
    dtype = jax.numpy.bfloat16
    wcfg = cfg.replace(fp8_linears=FP8_LINEARS_ALL if weights == "fp8" else ())
    total, per_device_w = weight_bytes(wcfg, dtype, mesh)
    parts = [-(-prefill_tokens // 2), prefill_tokens // 2] if two_batch_overlap else [prefill_tokens]
    act = sum(activation_bytes(cfg, t, mesh) for t in parts)
    usable = int(device_memory_gib * GIB * memory_fraction)
    kv_token = kv_bytes_per_token(cfg, dtype, index_dtype)

    def pages_left(mode):
        exchange = sum(dispatch_bytes(cfg, t, mesh, mode) for t in parts)
        return max((usable - sum(per_device_w.values()) - act - exchange) // (kv_token * page_size), 0), exchange

    dispatch = choose_ep_dispatch(ep_dispatch, mesh.ep, cfg.num_experts_per_tok, cfg.hidden_size,
                                  jax.numpy.dtype(dtype).itemsize)
    pages, exchange = pages_left(dispatch)
    reason = "given" if ep_dispatch != "auto" else "fewer bytes sent"
    if ep_dispatch == "auto" and pages < 1:
        other = "psum" if dispatch == "all_to_all" else "all_to_all"
        if pages_left(other)[0] >= 1:
            reason = f"{dispatch}'s buffers leave no KV page"
            dispatch = other
            pages, exchange = pages_left(other)
    kv_tokens_per_device = int(pages * page_size)
    host_tokens = int(host_memory_gib * GIB // kv_token)
    per_device = {f"weights_{k}": v for k, v in per_device_w.items()}
    per_device.update(weights=sum(per_device_w.values()), activations=act, ep_dispatch_buffers=exchange,
                      kv_pool=kv_tokens_per_device * kv_token)
    return {
        "model": cfg.model_type, "layers": cfg.num_hidden_layers, "devices": devices,
        "mesh": dataclasses.asdict(mesh), "weights": weights, "ep_dispatch": dispatch,
        "ep_dispatch_reason": reason, "two_batch_overlap": two_batch_overlap,
        "device_memory_bytes": int(device_memory_gib * GIB), "usable_bytes": usable,
        "total_weight_bytes": int(sum(total.values())),
        "per_device_bytes": {k: int(v) for k, v in per_device.items()},
        "kv_bytes_per_token": kv_token,
        "kv_tokens_per_device": kv_tokens_per_device,
        "kv_tokens": kv_tokens_per_device * mesh.dp * mesh.cp,   # the latent is replicated over tp
        "max_context_tokens": kv_tokens_per_device * mesh.cp,     # one request's pages live on its replica
        "host_kv_tokens": host_tokens,
        "fits": bool(pages >= 1),
    }


def print_plan(p: dict) -> None:
    rows = [(k, f"{v / GIB:8.2f} GiB") for k, v in p["per_device_bytes"].items()]
    rows += [("usable per device", f"{p['usable_bytes'] / GIB:8.2f} GiB"),
             ("kv bytes per token", str(p["kv_bytes_per_token"])),
             ("kv tokens (mesh)", f"{p['kv_tokens']:,}"), ("max context", f"{p['max_context_tokens']:,}"),
             ("fits", str(p["fits"]))]
    width = max(len(r[0]) for r in rows)
    print(f"{p['model']} ({p['layers']} layers, {p['weights']} weights) on {p['devices']} devices, mesh "
          + ",".join(f"{k}={v}" for k, v in p["mesh"].items()) + f", ep dispatch {p['ep_dispatch']} ({p['ep_dispatch_reason']})"
          + (", two-batch overlap" if p["two_batch_overlap"] else ""))
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
