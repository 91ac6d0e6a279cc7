"""Checkpoints: HF safetensors <-> params, fp8 block dequantization, orbax save and sharded restore.

Our orbax checkpoint is a directory of small orbax PyTree checkpoints, one per decoder layer plus
`top` (embedding, final norm, lm_head) and `mtp`, and a `cpkv_checkpoint.json` manifest written last.
One checkpoint per layer is what lets `convert` stream (peak host RAM = one layer, never the model)
and lets `load` restore each layer straight into its target sharding and write it into the stacked
group arrays in place (peak device memory = the model + one layer). Conversion writes into a
temporary sibling directory renamed into place only when complete, so an interrupted conversion
never leaves anything that loads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from models import fp8
from models.config import FP8_LINEARS_ALL, ModelConfig
from models.model import DsaModel, layer_places
from pallas_kernels.moe.layout import FP8_EXPERT_DTYPE

MANIFEST = "cpkv_checkpoint.json"
FORMAT_VERSION = 4                # 4: kept-fp8 dense linears stored as HF's [out, in] (Dense.fp8_weight)
READABLE_VERSIONS = (1, 2, 3, 4)  # 3: kept-fp8 routed experts stored K-major [E, N, K] (pallas_kernels/moe/layout.py)
                                  # 2: the manifest holds each part's content hash and array shapes / dtypes;
                                  # 1: parts only, nothing to verify. A checkpoint older than the layout of
                                  # the fp8 linears it keeps is refused (read_manifest); one without loads
FP8_EXPERTS_K_MAJOR_SINCE = 3
FP8_DENSE_K_MAJOR_SINCE = 4
EXPERT_LINEARS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
DENSE_FP8_LINEARS = tuple(n for n in FP8_LINEARS_ALL if n not in EXPERT_LINEARS)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the offending key."""


# ---- HF key layout ---------------------------------------------------------------------------------

def _layer_keys(cfg: ModelConfig, mlp_kind: str, has_indexer: bool) -> dict[str, tuple]:
    """HF key suffix (after `model.layers.{i}.`) -> (our path within a DecoderLayer, transpose?). A
    routed expert's `transpose` holds for plain experts only: kept fp8 they stay [out, in] (hf_layer_tree)."""
    keys = {"input_layernorm.weight": (("input_layernorm", "weight"), False),
            "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), False)}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        keys[f"self_attn.{name}.weight"] = (("self_attn", name, "kernel"), True)
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        keys[f"self_attn.{name}.weight"] = (("self_attn", name, "weight"), False)
    if has_indexer:
        for name in ("wq_b", "wk", "weights_proj"):
            keys[f"self_attn.indexer.{name}.weight"] = (("self_attn", "indexer", name, "kernel"), True)
        keys["self_attn.indexer.k_norm.weight"] = (("self_attn", "indexer", "k_norm", "weight"), False)
        keys["self_attn.indexer.k_norm.bias"] = (("self_attn", "indexer", "k_norm", "bias"), False)
    if mlp_kind == "dense":
        for name in ("gate_proj", "up_proj", "down_proj"):
            keys[f"mlp.{name}.weight"] = (("mlp", name, "kernel"), True)
    else:
        keys["mlp.gate.weight"] = (("mlp", "gate", "kernel"), True)
        keys["mlp.gate.e_score_correction_bias"] = (("mlp", "e_score_correction_bias"), False)
        for e in range(cfg.n_routed_experts):
            for name, ours in (("gate_proj", "experts_gate"), ("up_proj", "experts_up"), ("down_proj", "experts_down")):
                keys[f"mlp.experts.{e}.{name}.weight"] = (("mlp", ours, e), True)
        if cfg.n_shared_experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                keys[f"mlp.shared_experts.{name}.weight"] = (("mlp", "shared_experts", name, "kernel"), True)
    return keys


def mtp_mlp_kind(cfg: ModelConfig) -> str:
    return "sparse" if "sparse" in cfg.mlp_layer_types else "dense"


# ---- reading HF safetensors --------------------------------------------------------------------------

class SafetensorsReader:
    """Tensor-at-a-time access to an HF checkpoint directory (single file or sharded with an index),
    fp8 block-scaled weights dequantized on read."""

    def __init__(self, hf_dir):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.dir} does not exist")
        index = self.dir / "model.safetensors.index.json"
        self._handles = {}
        if index.exists():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a "
                                      f"'weight_map'): {type(e).__name__}: {e}") from None
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                weight_map.update({k: f.name for k in self._open(f.name)[1][0] if k != "__metadata__"})
        self.weight_map = weight_map
        hf_cfg = json.loads((self.dir / "config.json").read_text()) if (self.dir / "config.json").exists() else {}
        q = hf_cfg.get("quantization_config") or {}
        self.block = tuple(q.get("weight_block_size") or (128, 128))

    def _open(self, fname: str):
        """(safe_open handle, (header, data start)) of one file; a missing, truncated or malformed file
        is a CheckpointError naming it."""
        if fname not in self._handles:
            path = self.dir / fname
            try:
                self._handles[fname] = (safe_open(path, "np"), _safetensors_header(path))
            except Exception as e:  # safetensors raises its own SafetensorError, OSError, ValueError
                raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                                      f"{str(e)[:200]})") from None
        return self._handles[fname]

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _raw(self, key: str) -> np.ndarray:
        fname = self.weight_map[key]
        handle, (header, data_start) = self._open(fname)
        info = header[key]
        if info["dtype"] in _FP8_DTYPES:
            # safetensors' numpy reader has no fp8 (it would need torch): map the bytes ourselves.
            begin, end = info["data_offsets"]
            raw = np.memmap(self.dir / fname, np.uint8, "r", offset=data_start + begin, shape=(end - begin,))
            return raw.view(_FP8_DTYPES[info["dtype"]]).reshape(info["shape"])
        return handle.get_tensor(key)

    def _scaled(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(stored values, fp32 block scales) of a weight stored block-scaled, else None."""
        if key not in self.weight_map:
            raise CheckpointError(f"checkpoint is missing tensor {key!r}")
        scale_key = _scale_key(key)
        if not scale_key or scale_key not in self.weight_map:
            return None
        w = self._raw(key)
        scale = self._raw(scale_key).astype(np.float32)
        bo, bi = self.block
        o, i = w.shape
        if scale.shape != (-(-o // bo), -(-i // bi)):
            raise CheckpointError(f"{scale_key} has shape {scale.shape}, expected "
                                  f"{(-(-o // bo), -(-i // bi))} for {key} {w.shape} in {bo}x{bi} blocks")
        return w, scale

    def fp8_block(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 values [out, in], fp32 scales [out/128, in/128]) of a weight kept fp8."""
        got = self._scaled(key)
        if got is None or self.block != (fp8.BLOCK, fp8.BLOCK) or got[0].dtype != ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{key}: kept fp8 only as e4m3 in {fp8.BLOCK}x{fp8.BLOCK} blocks (stored: "
                                  f"{'no scales' if got is None else f'{got[0].dtype} in {self.block} blocks'}); "
                                  f"load or convert with a dtype to dequantize")
        return got

    def fp8_linears(self) -> tuple[str, ...]:
        """Our names (config.FP8_LINEARS_ALL) of the linears whose every stored weight is block-scaled
        fp8: those the model keeps fp8. A linear stored fp8 in some layers only is dequantized."""
        seen: dict[str, bool] = {}
        for key in self.weight_map:
            name = fp8_linear_name(key)
            if name is not None:
                scaled = _scale_key(key) in self.weight_map
                seen[name] = seen.get(name, True) and scaled
        return tuple(sorted(n for n, all_scaled in seen.items() if all_scaled))

    def get(self, key: str) -> np.ndarray:
        """The tensor as float32 (fp8 weights dequantized with their weight_scale_inv blocks)."""
        scaled = self._scaled(key)
        if scaled is not None:
            w, scale = scaled
            bo, bi = self.block
            full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:w.shape[0], :w.shape[1]]
            return w.astype(np.float32) * full
        w = self._raw(key)
        if w.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{key} is fp8 but has no {_scale_key(key)}")
        return w.astype(np.float32)

    def close(self):
        self._handles.clear()


_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _scale_key(key: str) -> str | None:
    """The key of a weight's block scales (`...weight` -> `...weight_scale_inv`); None for a non-weight."""
    return key[: -len("weight")] + "weight_scale_inv" if key.endswith("weight") else None


def fp8_linear_name(key: str) -> str | None:
    """The config.FP8_LINEARS_ALL name of an HF weight key (None: not one of those linears)."""
    parts = key.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 4 or parts[-1] != "weight":
        return None
    rest = parts[3:-1]
    if rest[:2] == ["mlp", "experts"] and len(rest) == 4:
        rest = rest[:2] + rest[3:]                       # mlp.experts.{e}.gate_proj -> mlp.experts.gate_proj
    name = ".".join(rest)
    return name if name in FP8_LINEARS_ALL else None


def _safetensors_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _set_path(tree: dict, path: tuple, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _expect_shape(key: str, arr: np.ndarray, shape: tuple):
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")


def hf_layer_tree(reader: SafetensorsReader, cfg: ModelConfig, prefix: str, mlp_kind: str, has_indexer: bool,
                  abstract_layer: dict, dtype) -> dict:
    """Our (unstacked) DecoderLayer pure-dict for the HF layer at `prefix`, in `dtype` (router bias and
    indexer weights_proj stay fp32)."""
    out: dict = {}
    experts: dict[str, list] = {}
    for suffix, (path, transpose) in _layer_keys(cfg, mlp_kind, has_indexer).items():
        key = prefix + suffix
        expert = isinstance(path[-1], int)              # one expert of a stacked expert tensor
        if path[-1] == "kernel" and "fp8_weight" in _get_path(abstract_layer, path[:-1]):
            path, transpose = path[:-1] + ("fp8_weight",), False   # a Dense kept fp8: [out, in] as stored
        target = _get_path(abstract_layer, path[:-1] if expert else path)
        # routed experts kept fp8 stay as HF stores them, [out, in] = [N, K] per expert (the K-major
        # layout of pallas_kernels/moe/layout.py, the fp8 kernel's); plain ones become [K, N]
        fp8_expert = expert and jnp.dtype(target.dtype) == jnp.dtype(FP8_EXPERT_DTYPE)
        got = read_weight(reader, key, transpose and not fp8_expert, target.dtype)
        items = [(path, got[0]), (_scale_path(path), got[1])] if isinstance(got, tuple) else [(path, got)]
        for p, arr in items:
            want = _get_path(abstract_layer, p[:-1] if expert else p).shape
            _expect_shape(key, arr, want[1:] if expert else want)
            if expert:
                experts.setdefault(p[:-1], []).append(arr)
            else:
                _set_path(out, p, arr)
    for path, arrs in experts.items():
        _set_path(out, path, np.stack(arrs))
    return _cast_like(out, abstract_layer)


def read_weight(reader: SafetensorsReader, key: str, transpose: bool, target_dtype):
    """An HF tensor in our layout (a Linear's [out, in] transposed where `transpose`); for an fp8 target,
    the pair (e4m3 values, block scales), both transposed or both as stored (the model keeps every fp8
    linear, dense or routed expert, as stored: [out, in])."""
    if jnp.dtype(target_dtype) == jnp.float8_e4m3fn:
        w, scale = reader.fp8_block(key)
        return (w.T, scale.T) if transpose else (w, scale)
    arr = reader.get(key)
    if transpose:
        if arr.ndim != 2:
            raise CheckpointError(f"tensor {key!r} should be 2-D, has shape {arr.shape}")
        arr = arr.T
    return arr


def _scale_path(path: tuple) -> tuple:
    """Where a kept-fp8 weight's block scales live: a Dense's `scale_inv` beside its `fp8_weight`, a stacked
    expert tensor's `<name>_scale_inv`."""
    if isinstance(path[-1], int):
        return path[:-2] + (path[-2] + "_scale_inv", path[-1])
    return path[:-1] + ("scale_inv",)


def _get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _strip_stack(sds_tree):
    """Abstract per-layer tree from a stacked one (drop the leading repeat axis)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), sds_tree)


# ---- abstract model ------------------------------------------------------------------------------------

def abstract_model(cfg: ModelConfig, dtype=None, *, mtp_own_embed=True, mtp_own_head=True) -> DsaModel:
    return nnx.eval_shape(lambda: DsaModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), mtp_own_embed=mtp_own_embed,
                                           mtp_own_head=mtp_own_head))


def _cast_like(tree: dict, abstract: dict) -> dict:
    """Each array in its abstract leaf's dtype (the model's dtype; fp32 for the router bias and the
    indexer's weights_proj; fp8 and fp32 scales for kept-fp8 linears)."""
    return {k: (_cast_like(v, abstract[k]) if isinstance(v, dict) else np.asarray(v, abstract[k].dtype))
            for k, v in tree.items()}


# ---- HF -> parts (shared by in-memory load and conversion) ------------------------------------------------

def hf_mtp_flags(reader: SafetensorsReader, cfg: ModelConfig) -> tuple[bool, bool]:
    n = cfg.num_hidden_layers
    return (f"model.layers.{n}.embed_tokens.weight" in reader.keys(),
            f"model.layers.{n}.shared_head.head.weight" in reader.keys())


def iter_hf_parts(reader: SafetensorsReader, cfg: ModelConfig, model_abs: DsaModel, dtype) -> Iterator[tuple[str, dict]]:
    """Yield ('top', tree), ('layer:{i}', tree) for every target layer, then ('mtp', tree): our pure-dict
    pieces built from the HF checkpoint, one layer at a time. Unexpected HF keys raise first."""
    pure_abs = nnx.to_pure_dict(nnx.state(model_abs))
    expected = set()
    n = cfg.num_hidden_layers
    for i in range(n):
        m, ix = cfg.layer_kind(i)
        expected |= {f"model.layers.{i}.{k}" for k in _layer_keys(cfg, m, ix == "full")}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        expected.add("lm_head.weight")
    own_embed, own_head = hf_mtp_flags(reader, cfg)
    if cfg.num_nextn_predict_layers:
        p = f"model.layers.{n}."
        expected |= {p + k for k in _layer_keys(cfg, mtp_mlp_kind(cfg), True)}
        expected |= {p + k for k in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
        if own_embed:
            expected.add(p + "embed_tokens.weight")
        if own_head:
            expected.add(p + "shared_head.head.weight")
    present = {k for k in reader.keys() if not k.endswith("weight_scale_inv")}
    unexpected = sorted(present - expected)
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in checkpoint: {unexpected[:5]}"
                              + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s): {missing[:5]}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    def plain(key, target, transpose=False):
        arr = reader.get(key)
        arr = arr.T if transpose else arr
        _expect_shape(key, arr, target.shape)
        return arr.astype(target.dtype)

    def linear(key, target):
        """A Dense's tree: {kernel} ([in, out]) or, kept fp8, {fp8_weight, scale_inv} as stored ([out, in])."""
        if "fp8_weight" in target:
            w, scale = read_weight(reader, key, False, target["fp8_weight"].dtype)
            tree = {"fp8_weight": w, "scale_inv": scale}
        else:
            tree = {"kernel": read_weight(reader, key, True, target["kernel"].dtype)}
        for k, arr in tree.items():
            _expect_shape(key, arr, target[k].shape)
        return tree

    top = {"embed_tokens": plain("model.embed_tokens.weight", pure_abs["embed_tokens"]),
           "norm": {"weight": plain("model.norm.weight", pure_abs["norm"]["weight"])}}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = {"kernel": plain("lm_head.weight", pure_abs["lm_head"]["kernel"], True)}
    yield "top", top

    places = layer_places(model_abs.groups_plan)
    for i in range(n):
        m, ix = cfg.layer_kind(i)
        g, j, _ = places[i]
        layer_abs = _strip_stack(pure_abs["groups"][g]["unit"][j])
        tree = hf_layer_tree(reader, cfg, f"model.layers.{i}.", m, ix == "full", layer_abs, dtype)
        yield f"layer:{i}", tree

    if cfg.num_nextn_predict_layers:
        p = f"model.layers.{n}."
        mabs = pure_abs["mtp"]
        tree = {"layer": hf_layer_tree(reader, cfg, p, mtp_mlp_kind(cfg), True, mabs["layer"], dtype),
                "eh_proj": linear(p + "eh_proj.weight", mabs["eh_proj"]),
                "enorm": {"weight": plain(p + "enorm.weight", mabs["enorm"]["weight"])},
                "hnorm": {"weight": plain(p + "hnorm.weight", mabs["hnorm"]["weight"])},
                "norm": {"weight": plain(p + "shared_head.norm.weight", mabs["norm"]["weight"])}}
        if own_embed:
            tree["embed_tokens"] = plain(p + "embed_tokens.weight", mabs["embed_tokens"])
        if own_head:
            tree["head"] = {"kernel": plain(p + "shared_head.head.weight", mabs["head"]["kernel"], True)}
        yield "mtp", _cast_like(tree, mabs)


def assemble(model_abs: DsaModel, parts: Iterator[tuple[str, dict]], put: Callable | None = None) -> DsaModel:
    """Build a concrete model from per-layer parts: each group's leaves are allocated stacked and every
    layer is written into its slot (`put(path, array)` places an unstacked host array on device, e.g.
    with a sharding; the default is jnp.asarray)."""
    graphdef, state = nnx.split(model_abs)
    pure_abs = nnx.to_pure_dict(state)
    put = put or (lambda path, a: jnp.asarray(a))
    where = layer_places(model_abs.groups_plan)
    stacked = {g: {j: None for j in range(len(grp.unit))} for g, grp in enumerate(model_abs.groups_plan)}
    out: dict = {}
    set_slot = jax.jit(lambda s, x, r: s.at[r].set(x), donate_argnums=0)
    for name, tree in parts:
        if name == "top":
            out.update(_put_tree(tree, (), put))
        elif name == "mtp":
            out["mtp"] = _put_tree(tree, ("mtp",), put)
        else:
            g, j, r = where[int(name.split(":")[1])]
            path = ("groups", g, "unit", j)
            layer = _put_tree(tree, path, put)
            if stacked[g][j] is None:
                abs_leaves = _get_path(pure_abs, path)
                stacked[g][j] = jax.tree.map(lambda s, x: jnp.zeros(s.shape, x.dtype, device=_stacked_sharding(x)),
                                             abs_leaves, layer)
            stacked[g][j] = jax.tree.map(lambda s, x: set_slot(s, x, r), stacked[g][j], layer)
    out["groups"] = {g: {"unit": stacked[g]} for g in stacked}
    missing = [f"groups/{g}/unit/{j}" for g in stacked for j, v in stacked[g].items() if v is None]
    if missing:
        raise CheckpointError(f"no weights for {missing}")
    nnx.replace_by_pure_dict(state, out)
    return nnx.merge(graphdef, state)


def _stacked_sharding(x):
    """The sharding of a stacked group leaf whose per-layer slices are sharded like x: a leading
    `layers` axis (ShardingRules.layers) before x's own."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from models.sharding import RULES
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, P(*RULES.spec("layers", mesh=sh.mesh), *sh.spec), memory_kind=sh.memory_kind)
    return sh


def _put_tree(tree, path, put):
    return {k: (_put_tree(v, path + (k,), put) if isinstance(v, dict) else put(path + (k,), v))
            for k, v in tree.items()}


def hf_load_config(cfg: ModelConfig, reader: SafetensorsReader, dtype=None) -> tuple[ModelConfig, jnp.dtype]:
    """(config, dtype) an HF checkpoint loads or converts as: with no dtype asked for, its fp8 linears stay
    fp8 (reader.fp8_linears) and the rest is in the checkpoint's dtype; a dtype dequantizes everything."""
    if dtype is None:
        return cfg.replace(fp8_linears=reader.fp8_linears()), jnp.dtype(cfg.dtype)
    return cfg.replace(fp8_linears=()), jnp.dtype(dtype)


def load_hf(hf_dir, dtype=None, cfg: ModelConfig | None = None) -> DsaModel:
    """HF safetensors directory -> a concrete model in memory (small models, tests)."""
    cfg = cfg or ModelConfig.from_json_file(hf_dir)
    reader = SafetensorsReader(hf_dir)
    cfg, dtype = hf_load_config(cfg, reader, dtype)
    own_embed, own_head = hf_mtp_flags(reader, cfg)
    model_abs = abstract_model(cfg, dtype, mtp_own_embed=own_embed, mtp_own_head=own_head)
    return assemble(model_abs, iter_hf_parts(reader, cfg, model_abs, dtype))


# ---- orbax checkpoint: save (streaming) and restore (sharded) -----------------------------------------

def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def save_checkpoint(out_dir, cfg_json: dict, parts: Iterator[tuple[str, dict]], *, extra_files=(),
                    progress: Callable | None = None) -> Path:
    """Write parts (see iter_hf_parts) as our orbax checkpoint directory. Everything goes to
    `<out>.partial-<pid>` first; the manifest is written last and the directory renamed into place, so
    an interrupted save leaves no directory at `out_dir` that loads."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        raise CheckpointError(f"output directory {out_dir} already exists")
    tmp = out_dir.with_name(out_dir.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ckptr = _checkpointer()
    names = []
    try:
        digests, arrays = {}, {}
        for name, tree in parts:
            sub = tmp / name.replace(":", "_")
            ckptr.save(sub, tree)
            ckptr.wait_until_finished()
            names.append(name)
            digests[name] = part_digest(sub)
            arrays[name] = {"/".join(str(k.key) for k in path): [list(np.shape(x)), str(np.asarray(x).dtype)]
                            for path, x in jax.tree_util.tree_leaves_with_path(tree)}
            if progress:
                progress(name)
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
        for f in extra_files:
            shutil.copy(f, tmp / Path(f).name)
        (tmp / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "parts": names,
                                                "digests": digests, "arrays": arrays}, indent=2))
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckptr.close()
    return out_dir


def is_checkpoint(path) -> bool:
    return (Path(path) / MANIFEST).exists()


def part_digest(sub: Path) -> str:
    """sha256 over a part directory's files (relative names and bytes, in name order): any changed,
    truncated, missing or extra file changes it."""
    h = hashlib.sha256()
    for f in sorted(q for q in sub.rglob("*") if q.is_file()):
        h.update(str(f.relative_to(sub)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def expected_parts(cfg: ModelConfig) -> list[str]:
    return ["top"] + [f"layer:{i}" for i in range(cfg.num_hidden_layers)] + (["mtp"] if cfg.num_nextn_predict_layers
                                                                           else [])


def read_manifest(path: Path, cfg: ModelConfig, verify: bool) -> dict:
    """The checkpoint's manifest, checked: JSON of a known format, exactly the parts the config needs,
    every part directory present and (format 2, with `verify`) its files' hash as written at
    conversion. Any failure is a CheckpointError naming the file and the problem."""
    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not a readable JSON manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") not in READABLE_VERSIONS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{where}: checkpoint format {version!r} unsupported (expected one of "
                              f"{READABLE_VERSIONS})")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not all(isinstance(n, str) for n in parts):
        raise CheckpointError(f"{where}: 'parts' must be a list of part names, got {parts!r}")
    want = expected_parts(cfg)
    missing, unknown = [n for n in want if n not in parts], [n for n in parts if n not in want]
    if missing or unknown or len(set(parts)) != len(parts):
        raise CheckpointError(f"{where}: parts do not match config.json ({cfg.num_hidden_layers} layers"
                              f"{', MTP' if cfg.num_nextn_predict_layers else ''}): missing {missing}, "
                              f"unknown {unknown}{', duplicated entries' if len(set(parts)) != len(parts) else ''}")
    old_fp8_experts = [n for n in EXPERT_LINEARS if cfg.fp8(n)]
    if manifest["format_version"] < FP8_EXPERTS_K_MAJOR_SINCE and old_fp8_experts:
        raise CheckpointError(f"{where}: checkpoint format {manifest['format_version']} stores the fp8 routed "
                              f"experts ({', '.join(old_fp8_experts)}) in the old [E, K, N] layout; this version "
                              f"keeps them K-major [E, N, K] (HF's [out, in] per expert, format "
                              f"{FP8_EXPERTS_K_MAJOR_SINCE}): re-convert it from the HF checkpoint with "
                              f"`cpkv-jax convert`")
    old_fp8_dense = [n for n in DENSE_FP8_LINEARS if cfg.fp8(n)]
    if manifest["format_version"] < FP8_DENSE_K_MAJOR_SINCE and old_fp8_dense:
        raise CheckpointError(f"{where}: checkpoint format {manifest['format_version']} stores the fp8 linears "
                              f"({', '.join(old_fp8_dense)}) as [in, out]; this version keeps them as HF's "
                              f"[out, in] (format {FP8_DENSE_K_MAJOR_SINCE}): re-convert it from the HF "
                              f"checkpoint with `cpkv-jax convert`")
    if manifest["format_version"] >= 2:
        for key in ("digests", "arrays"):
            if not isinstance(manifest.get(key), dict) or set(manifest[key]) != set(parts):
                raise CheckpointError(f"{where}: '{key}' must map every part to its entry")
    for name in parts:
        sub = path / name.replace(":", "_")
        if not sub.is_dir():
            raise CheckpointError(f"{path}: part {name} is missing (no directory {sub.name})")
        if verify and manifest["format_version"] >= 2 and part_digest(sub) != manifest["digests"][name]:
            raise CheckpointError(f"{sub}: content hash differs from the one recorded at conversion (a damaged, "
                                  f"truncated or changed file); re-convert the checkpoint")
    return manifest


def load_checkpoint(path, dtype=None, mesh=None, *, verify: bool = True) -> DsaModel:
    """Restore our orbax checkpoint; with `mesh`, every array is restored straight into its sharding
    (models/sharding.py) and layers are written into the stacked group arrays in place. The manifest
    is checked first (read_manifest); `verify` also hashes every part's files against the manifest,
    which reads the checkpoint once more from disk (sha256, ~1-2 GB/s per core)."""
    from models.sharding import param_sharding

    path = Path(path).absolute()     # orbax restores from absolute paths only
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not is_checkpoint(path):
        raise CheckpointError(f"{path} is not a complete cpkv checkpoint (no {MANIFEST}; an interrupted "
                              f"conversion, or an HF directory: run `cpkv-jax convert` first)")
    cfg = ModelConfig.from_json_file(path / "config.json")
    manifest = read_manifest(path, cfg, verify)
    dtype = jnp.dtype(dtype or cfg.dtype)
    if "arrays" in manifest:
        mtp_meta = {k.split("/")[0] for k in manifest["arrays"].get("mtp", {})}
    else:
        mtp_meta = _part_tree_metadata(path / "mtp") if "mtp" in manifest["parts"] else {}
    model_abs = abstract_model(cfg, dtype, mtp_own_embed="embed_tokens" in mtp_meta,
                               mtp_own_head="head" in mtp_meta)
    pure_abs = nnx.to_pure_dict(nnx.state(model_abs))
    ckptr = _checkpointer()

    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def target(abs_tree, path_prefix, stacked):
        """Restore targets: per-layer shapes (a stacked leaf minus its repeat axis), placed by the
        sharding rules when a mesh is given, else on the default device. Every target names its
        sharding: without one orbax falls back to the sharding recorded at save time, which names the
        saving machine's devices (a checkpoint written on a CPU then fails to restore on a GPU)."""
        def leaf(p, s):
            shape = s.shape[1:] if stacked else s.shape
            if mesh is None:
                return jax.ShapeDtypeStruct(shape, s.dtype, sharding=one_device)
            keys = path_prefix + tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)
            return jax.ShapeDtypeStruct(shape, s.dtype, sharding=param_sharding(keys, len(shape), mesh))
        return jax.tree_util.tree_map_with_path(leaf, abs_tree)

    def parts():
        for name in manifest["parts"]:
            sub = path / name.replace(":", "_")
            if name == "top":
                abs_tree = {k: pure_abs[k] for k in ("embed_tokens", "norm", "lm_head") if k in pure_abs
                            and pure_abs[k] is not None}
                tgt = target(abs_tree, (), False)
            elif name == "mtp":
                tgt = target(pure_abs["mtp"], ("mtp",), False)
            else:
                g, j, _ = layer_places(model_abs.groups_plan)[int(name.split(":")[1])]
                lp = ("groups", g, "unit", j)
                tgt = target(_get_path(pure_abs, lp), lp, True)
            try:
                restored = ckptr.restore(sub, tgt)
            except Exception as e:  # orbax / tensorstore raise many types for a damaged part
                raise CheckpointError(f"{sub}: orbax could not restore part {name}: {type(e).__name__}: "
                                      f"{str(e)[:300]}") from e
            yield name, restored

    try:
        model = assemble(model_abs, parts(), put=lambda path, a: a)  # orbax already placed each array
    finally:
        ckptr.close()
    return model


def _part_tree_metadata(sub: Path) -> dict:
    ckptr = _checkpointer()
    try:
        meta = ckptr.metadata(sub)
    finally:
        ckptr.close()
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return dict(tree)


def model_parts(model: DsaModel) -> Iterator[tuple[str, dict]]:
    """The checkpoint parts (as iter_hf_parts yields them) of a live model: its stacked groups cut back
    into one tree per layer."""
    pure_state = nnx.to_pure_dict(nnx.state(model))
    yield "top", {k: pure_state[k] for k in ("embed_tokens", "norm", "lm_head") if pure_state.get(k) is not None}
    for layer, (g, j, r) in enumerate(layer_places(model.groups_plan)):
        yield f"layer:{layer}", jax.tree.map(lambda x: np.asarray(x[r]), pure_state["groups"][g]["unit"][j])
    if model.mtp is not None:
        yield "mtp", jax.tree.map(np.asarray, pure_state["mtp"])


TINY_SEED = 0


def cache_dir() -> Path:
    """Where derived artifacts (the tiny checkpoint) are cached: $CPKV_CACHE_DIR or ~/.cache/cpkv_jax."""
    return Path(os.environ.get("CPKV_CACHE_DIR") or Path.home() / ".cache" / "cpkv_jax")


def tiny_tokenizer_json(vocab_size: int, bos_id: int, eos_id: int) -> str:
    """A byte-level tokenizer for the tiny model: ids 2..257 are the 256 bytes (no merges), so any text
    round-trips; bos/eos and the unused tail of the vocabulary are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models as tok_models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    byte_chars = sorted(ByteLevel.alphabet(), key=lambda c: ord(c))
    specials = {bos_id: "<bos>", eos_id: "<eos>"}
    vocab, next_id = {}, 0
    for ch in byte_chars:
        while next_id in specials:
            next_id += 1
        vocab[ch] = next_id
        next_id += 1
    used = set(vocab.values())
    names = {**specials, **{i: f"<unused_{i}>" for i in range(vocab_size) if i not in used and i not in specials}}
    vocab.update({name: i for i, name in names.items()})
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(names[i], special=True) for i in sorted(names)])
    for i, name in names.items():
        if tok.token_to_id(name) != i:
            raise AssertionError(f"tiny tokenizer: {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok.to_str()


TINY_DIR = Path(__file__).parent / "checkpoints" / "tiny"
"""The embedded default model `tiny`: a small DSA model trained by scripts/train_tiny.py (recall,
arithmetic, Python source), shipped as an orbax checkpoint with its BPE tokenizer."""


def tiny_checkpoint() -> Path:
    """The trained `tiny` checkpoint shipped in the package (models/checkpoints/tiny)."""
    if not is_checkpoint(TINY_DIR):
        raise CheckpointError(f"the trained tiny checkpoint is missing at {TINY_DIR} (rebuild it with "
                              f"scripts/train_tiny.py --out {TINY_DIR}); 'tiny-random' needs none")
    return TINY_DIR


MODEL_NAMES = ("tiny", "tiny-random")


def resolve_model_dir(spec) -> Path:
    """The directory a model name or path stands for: 'tiny' (trained, shipped), 'tiny-random' (the
    shipped tiny config with deterministic random weights, created on first use), else the path."""
    if spec == "tiny":
        return tiny_checkpoint()
    if spec == "tiny-random":
        return tiny_random_checkpoint()
    return Path(spec)


def tiny_random_checkpoint() -> Path:
    """`tiny-random`: models/configs/tiny.json with deterministic random weights and a byte-level
    tokenizer, as an orbax checkpoint created on first use and cached under cache_dir() (keyed by the
    shipped config and seed, so a changed config never loads stale weights)."""

    cfg_text = (Path(__file__).parent / "configs" / "tiny.json").read_text()
    digest = hashlib.sha256(f"{cfg_text}|seed={TINY_SEED}|v{FORMAT_VERSION}".encode()).hexdigest()[:12]
    path = cache_dir() / f"tiny-{digest}"
    if is_checkpoint(path):
        return path
    cfg = ModelConfig.named("tiny")
    model = DsaModel(cfg, dtype=jnp.dtype(cfg.dtype), rngs=nnx.Rngs(TINY_SEED))
    staging = path.with_name(path.name + f".tokenizer-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    try:
        tok_file = staging / "tokenizer.json"
        hf = json.loads(cfg_text)
        tok_file.write_text(tiny_tokenizer_json(cfg.vocab_size, hf["bos_token_id"], hf["eos_token_id"]))
        try:
            save_checkpoint(path, json.loads(cfg_text), model_parts(model), extra_files=[tok_file])
        except (CheckpointError, OSError):
            if not is_checkpoint(path):  # another process won the race and renamed its copy into place
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def model_config(spec) -> ModelConfig:
    """The config of what load_model(spec) would load, without loading it (to plan its mesh first)."""
    return ModelConfig.from_json_file(resolve_model_dir(spec))


def load_model(spec, dtype=None, mesh=None, *, verify: bool = True) -> DsaModel:
    """'tiny' (the trained tiny model shipped in the package), 'tiny-random' (the shipped tiny config,
    deterministic random weights, cached as a checkpoint on first use), one of our orbax checkpoints, or
    an HF safetensors directory (converted in memory; small models)."""
    path = resolve_model_dir(spec)
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist (expected 'tiny', 'tiny-random', a cpkv checkpoint "
                              f"directory or an HF safetensors directory)")
    if is_checkpoint(path):
        return load_checkpoint(path, dtype, mesh, verify=verify)
    if (path / "config.json").exists() and (list(path.glob("*.safetensors")) or
                                            (path / "model.safetensors.index.json").exists()):
        return load_hf(path, dtype)
    raise CheckpointError(f"{path} is neither a cpkv checkpoint (no {MANIFEST}) nor an HF checkpoint "
                          f"(config.json + *.safetensors)")
