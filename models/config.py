"""ModelConfig: the static, hashable description of a GLM-5 / DeepSeek-V3.2 model, built from an HF
config.json (never guessed). Every field the math uses is here; bad input raises ModelConfigError."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
CONFIG_DIR = Path(__file__).parent / "configs"

# Our names of the linears DeepSeek-V3.2 and GLM-5 store in fp8 (every Linear but the router, the
# indexer's head weights, the embeddings and the output heads), layer-independent.
FP8_LINEARS_ALL = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                   "self_attn.kv_b_proj", "self_attn.o_proj", "self_attn.indexer.wq_b", "self_attn.indexer.wk",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.experts.gate_proj",
                   "mlp.experts.up_proj", "mlp.experts.down_proj", "mlp.shared_experts.gate_proj",
                   "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj", "eh_proj")


class ModelConfigError(ValueError):
    """An HF config that cannot describe a model we can run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def indexer_types_for(num_layers: int, indexer_types=None, pattern=None, freq: int | None = None,
                      offset: int | None = None) -> tuple[str, ...]:
    """IndexCache: which layers compute their own indexer top-k ("full") and which reuse the previous
    layer's ("shared"). Priority: explicit `indexer_types` > `index_topk_pattern` ("F"/"S") >
    (`index_topk_freq`, `index_skip_topk_offset`): layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    if indexer_types is not None:
        types = tuple(indexer_types)
    elif pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise ModelConfigError(f"index_topk_pattern may only contain 'F' and 'S', got {bad}")
            types = tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        else:
            types = tuple(pattern)
    else:
        freq = max(1 if freq is None else int(freq), 1)
        offset = 2 if offset is None else int(offset)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
    if len(types) != num_layers:
        raise ModelConfigError(f"indexer types list has {len(types)} entries for {num_layers} layers")
    bad = sorted(set(types) - {"full", "shared"})
    if bad:
        raise ModelConfigError(f"indexer types must be 'full' or 'shared', got {bad}")
    if num_layers and types[0] != "full":
        raise ModelConfigError("layer 0 must be a 'full' indexer layer: a shared layer has no previous top-k")
    return types


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's stored dtype: "float32" | "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    fp8_linears: tuple[str, ...] = ()
    """Linears kept as fp8 with 128 x 128 block scales (names of models/fp8.py's FP8_LINEARS_ALL): what
    an fp8 checkpoint stores that way, unless a dtype was asked for at load or conversion."""

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def indexer_rope_interleaved(self) -> bool:
        """GLM rotates indexer rope dims in interleaved pairs; DeepSeek-V3.2 uses rotate_half."""
        return self.model_type == "glm_moe_dsa"

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.type != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def fp8(self, linear: str) -> bool:
        return linear in self.fp8_linears

    def layer_kind(self, i: int) -> tuple[str, str]:
        """(mlp kind, indexer kind) of target layer i."""
        return self.mlp_layer_types[i], self.indexer_types[i]

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope"] = dataclasses.asdict(self.rope)
        return d

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")

        def need(key):
            if key not in hf or hf[key] is None:
                raise ModelConfigError(f"config.json ({model_type}) is missing required field {key!r}")
            return hf[key]

        n_layers = int(need("num_hidden_layers"))
        first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(first_dense, n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        mlp_types = tuple(mlp_types)
        if len(mlp_types) != n_layers or set(mlp_types) - {"dense", "sparse"}:
            raise ModelConfigError(f"mlp_layer_types must list 'dense'/'sparse' for each of {n_layers} layers")
        if model_type == "glm_moe_dsa":
            idx_types = indexer_types_for(n_layers, hf.get("indexer_types"), hf.get("index_topk_pattern"),
                                          hf.get("index_topk_freq"), hf.get("index_skip_topk_offset"))
        else:
            for key in ("indexer_types", "index_topk_pattern"):
                if hf.get(key) is not None:
                    raise ModelConfigError(f"{key} is a GLM IndexCache field; deepseek_v32 runs every indexer")
            idx_types = indexer_types_for(n_layers, hf.get("indexer_types"), hf.get("index_topk_pattern"),
                                          hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset"))

        rope = _rope_from_hf(hf, need)
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ModelConfigError(f"unsupported stored dtype {dtype!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} unsupported (only 'silu')")
        if hf.get("attention_bias", False):
            raise ModelConfigError("attention_bias=True is not supported by these models")
        n_heads = int(need("num_attention_heads"))
        kv_heads = hf.get("num_key_value_heads", n_heads)
        if kv_heads != n_heads:
            raise ModelConfigError(f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} vs {n_heads}")
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        cfg = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            q_lora_rank=int(need("q_lora_rank")),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            index_n_heads=int(need("index_n_heads")),
            index_head_dim=int(need("index_head_dim")),
            index_topk=int(need("index_topk")),
            n_routed_experts=int(need("n_routed_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(need("rms_norm_eps")),
            max_position_embeddings=int(need("max_position_embeddings")),
            rope=rope,
            mlp_layer_types=mlp_types,
            indexer_types=idx_types,
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            eos_token_id=eos,
            fp8_linears=tuple(sorted(hf.get("fp8_linears") or ())),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_json_file(cls, path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelConfigError(f"no config.json at {path}")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf)

    @classmethod
    def named(cls, name: str, **overrides) -> "ModelConfig":
        """One of the shipped configs ('tiny', 'glm-5', 'glm-5.2', 'deepseek-v3.2'), with optional HF
        config.json field overrides (e.g. num_hidden_layers=4 for a few-layer model of real dims)."""
        path = CONFIG_DIR / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
            raise ModelConfigError(f"no shipped config named {name!r}; known: {known}")
        if not overrides:
            return cls.from_json_file(path)
        return cls.from_hf_dict({**json.loads(path.read_text()), **overrides})

    def validate(self) -> None:
        pos = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
               "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "n_group",
               "topk_group", "max_position_embeddings"]
        for f in pos:
            if getattr(self, f) <= 0:
                raise ModelConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and <= index_head_dim "
                f"({self.index_head_dim}): the indexer rotates its first qk_rope_head_dim dims")
        if self.n_routed_experts % self.n_group:
            raise ModelConfigError(f"n_routed_experts ({self.n_routed_experts}) not divisible by n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.topk_group > self.n_group:
            raise ModelConfigError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if per_group < 2:
            raise ModelConfigError("group-limited routing scores each group by its top-2 experts: need >= 2 per group")
        if self.num_experts_per_tok > per_group * self.topk_group:
            raise ModelConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in topk_group "
                f"groups ({per_group * self.topk_group})")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ModelConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: only 0 or 1 supported")
        unknown = sorted(set(self.fp8_linears) - set(FP8_LINEARS_ALL))
        if unknown:
            raise ModelConfigError(f"fp8_linears names unknown linears {unknown}; known: {list(FP8_LINEARS_ALL)}")
        if self.rope.type == "yarn" and not self.rope.original_max_position_embeddings:
            raise ModelConfigError("yarn rope needs original_max_position_embeddings")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(hf: dict, need) -> RopeConfig:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    params = dict(params)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ModelConfigError("config.json has no rope_theta (top level or in rope_parameters)")
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ("default", "yarn"):
        raise ModelConfigError(f"rope type {rtype!r} unsupported (default, yarn)")
    if rtype == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in params:
        raise ModelConfigError("yarn rope parameters need 'factor'")
    omax = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return RopeConfig(
        theta=float(theta), type="yarn", factor=float(params["factor"]),
        original_max_position_embeddings=int(omax),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
