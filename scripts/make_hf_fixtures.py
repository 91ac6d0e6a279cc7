"""Build the HF reference fixtures the JAX model is tested against.

Runs in its own Python 3.11 venv (torch 2.13.0 CPU + transformers 5.23.0), because our code needs
Python >= 3.12 and torch must not be a dependency of the tests. Writes, per model, under
tests/fixtures/<name>/: the HF checkpoint (config.json + model.safetensors with MTP weights added
as `model.layers.{N}.*`), and reference.npz with

  prefill_tokens [B, T]          prefill_logits [B, T, V]
  decode_tokens  [B, S]          decode_logits  [B, S, V]   (prefill of P tokens, then 1 token/step)
  mtp_tokens     [B, T+1]        mtp_logits     [B, T, V]   (MTP over the final-normed target hidden)

Every top-k decision the references contain (the indexer's key selection, the router's experts) is
checked for a margin: the k-th and (k+1)-th candidates must differ by at least MIN_TOPK_MARGIN of the
row's largest score, else the inputs are redrawn. Paths that are equal up to fp32 rounding (~1e-6
relative) would otherwise break a near-tie differently and diverge for every later position. The margin
reached is stored as `topk_margin` (and the input seed as `token_seed`); tests/test_hf_parity.py checks it.

Usage: a venv with torch and transformers (any CPU torch; the CUDA wheel from PyPI works without a GPU):
  python -m venv .venv-hf && .venv-hf/bin/pip install torch transformers safetensors numpy
  .venv-hf/bin/python scripts/make_hf_fixtures.py [NAME ...]
"""

import contextlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
MIN_TOPK_MARGIN = 1e-5   # 10x the relative rounding noise between our paths and HF's (fp32)

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    torch_dtype="float32",
)

MODELS = {
    "glm_tiny": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, dict(
        num_hidden_layers=3, first_k_dense_replace=1, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # IndexCache: 5 layers, freq 2 / offset 2 -> full [0, 1, 3], shared [2, 4].
    "glm_indexcache": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, dict(
        num_hidden_layers=5, first_k_dense_replace=1, n_group=1, topk_group=1,
        index_topk_freq=2, index_skip_topk_offset=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "dsv32_tiny": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(
        num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=2560,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """HF's init leaves norms at 1, biases at 0 and tiny weights; make every parameter matter."""
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def mtp_layer_config(config_cls, cfg_kwargs):
    """A config of N+1 layers whose last layer (index N) is the MTP's decoder layer (MoE, full indexer)."""
    n = cfg_kwargs["num_hidden_layers"]
    kw = dict(COMMON, **cfg_kwargs)
    kw["num_hidden_layers"] = n + 1
    kw.pop("index_topk_freq", None)
    kw.pop("index_skip_topk_offset", None)
    if config_cls is GlmMoeDsaConfig:
        kw["indexer_types"] = ["full"] * (n + 1)
    return config_cls(**kw)


def mtp_forward(mtp, model, tokens, target_hidden):
    """h' = eh_proj(cat(enorm(embed(next)), hnorm(h))) -> decoder layer -> shared_head.norm -> head."""
    inner = model.model
    next_emb = mtp["embed_tokens"](tokens[:, 1:])
    x = mtp["eh_proj"](torch.cat([mtp["enorm"](next_emb), mtp["hnorm"](target_hidden)], dim=-1))
    bsz, t = x.shape[:2]
    pos = torch.arange(t).unsqueeze(0).expand(bsz, t)
    cos_sin = inner.rotary_emb(x, position_ids=pos)
    mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None].expand(bsz, 1, t, t)
    out = mtp["layer"](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    h = out[0] if isinstance(out, tuple) else out
    return mtp["head"](mtp["norm"](h))


@contextlib.contextmanager
def topk_margins():
    """Record, for every top-k taken inside the block, the smallest gap between the k-th and (k+1)-th
    largest unmasked candidates relative to the row's largest magnitude. Yields a list that holds
    (margin, call description) of the narrowest decision once the block ends."""
    narrowest = [(math.inf, None)]
    tensor_topk, torch_topk = torch.Tensor.topk, torch.topk

    def record(x, k, dim=-1):
        if not x.is_floating_point() or x.dim() == 0 or k >= x.shape[dim]:
            return
        v = torch.sort(x.detach().float().movedim(dim, -1), dim=-1, descending=True).values
        candidate = torch.isfinite(v) & (v > -1e30)   # HF masks with -inf or the dtype's minimum
        decided = candidate[..., k]                   # rows with more candidates than k
        if not decided.any():
            return
        finite = torch.where(candidate, v.abs(), torch.zeros_like(v))
        rel = (v[..., k - 1] - v[..., k]) / finite.amax(-1).clamp(min=1e-30)
        rel = torch.where(decided, rel, torch.full_like(rel, math.inf))
        m = float(rel.min())
        if m < narrowest[0][0]:
            narrowest[0] = (m, f"topk(k={k}) over {tuple(x.shape)} at row {np.unravel_index(int(rel.argmin()), rel.shape)}")

    def spy(original):
        def topk(x, k, dim=-1, *args, **kwargs):
            record(x, k, dim)
            return original(x, k, dim, *args, **kwargs)
        return topk

    torch.Tensor.topk, torch.topk = spy(tensor_topk), spy(torch_topk)
    try:
        yield narrowest
    finally:
        torch.Tensor.topk, torch.topk = tensor_topk, torch_topk


def references(model, mtp, config, rng):
    """The reference logits for one draw of input tokens."""
    ref = {}
    with torch.no_grad():
        # Prefill: two sequences of 96 tokens, logits at every position.
        toks = torch.tensor(rng.integers(0, config.vocab_size, size=(2, 96)))
        out = model(toks, use_cache=False, output_hidden_states=True)
        ref["prefill_tokens"] = toks.numpy().astype(np.int32)
        ref["prefill_logits"] = out.logits.float().numpy()

        # Prefill 40 then 12 single-token steps through HF's KV cache (incl. indexer key cache).
        dec = torch.tensor(rng.integers(0, config.vocab_size, size=(2, 52)))
        o = model(dec[:, :40], use_cache=True)
        pkv, logits = o.past_key_values, [o.logits]
        for s in range(40, 52):
            o = model(dec[:, s:s + 1], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            logits.append(o.logits)
        ref["decode_tokens"] = dec.numpy().astype(np.int32)
        ref["decode_prefill_len"] = np.int32(40)
        ref["decode_logits"] = torch.cat(logits, dim=1).float().numpy()

        # MTP on the final-normed hidden of a 64-token prefill, fed token i+1 at position i.
        mt = torch.tensor(rng.integers(0, config.vocab_size, size=(2, 65)))
        h = model.model(mt[:, :64]).last_hidden_state
        ref["mtp_tokens"] = mt.numpy().astype(np.int32)
        ref["mtp_logits"] = mtp_forward(mtp, model, mt, h).float().numpy()
    return ref


def references_clear_of_ties(name, compute, seed, attempts=50):
    """Draw input tokens (`compute(rng)` with seed, then seed + 7919 i) until every top-k decision
    clears MIN_TOPK_MARGIN."""
    for i in range(attempts):
        token_seed = seed + 7919 * i
        with topk_margins() as narrowest:
            ref = compute(np.random.default_rng(token_seed))
        margin, where = narrowest[0]
        print(f"{name}: token seed {token_seed}: narrowest top-k margin {margin:.2e} ({where})")
        if margin >= MIN_TOPK_MARGIN:
            return dict(ref, topk_margin=np.float32(margin), token_seed=np.int64(token_seed))
    raise SystemExit(f"{name}: no input draw in {attempts} clears the top-k margin {MIN_TOPK_MARGIN}")


def build(name, config_cls, model_cls, cfg_kwargs, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = config_cls(**dict(COMMON, **cfg_kwargs))
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    randomize(model, gen)

    # MTP layer: one full decoder layer at index N built from an (N+1)-layer config.
    big = mtp_layer_config(config_cls, cfg_kwargs)
    big._attn_implementation = "eager"
    layer_cls = type(model.model.layers[0])
    n = config.num_hidden_layers
    norm_cls = type(model.model.norm)
    mtp = torch.nn.ModuleDict({
        "layer": layer_cls(big, n),
        "eh_proj": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
        "enorm": norm_cls(config.hidden_size, config.rms_norm_eps),
        "hnorm": norm_cls(config.hidden_size, config.rms_norm_eps),
        "norm": norm_cls(config.hidden_size, config.rms_norm_eps),
        "embed_tokens": torch.nn.Embedding(config.vocab_size, config.hidden_size),
        "head": torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False),
    }).eval()
    randomize(mtp, gen)

    out_dir = OUT / name
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Append the MTP weights under the checkpoint's own key names.
    st_files = sorted(out_dir.glob("*.safetensors"))
    assert len(st_files) == 1, st_files
    tensors = load_file(st_files[0])
    prefix = f"model.layers.{n}."
    layer_sd = mtp["layer"].state_dict()
    for k, v in layer_sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # HF packs experts; checkpoints keep one key each
            base = prefix + k[: -len("gate_up_proj")]
            for e, w in enumerate(v):
                gate, up = w.chunk(2, dim=0)
                tensors[f"{base}{e}.gate_proj.weight"] = gate
                tensors[f"{base}{e}.up_proj.weight"] = up
        elif k.endswith("mlp.experts.down_proj"):
            base = prefix + k[: -len("down_proj")]
            for e, w in enumerate(v):
                tensors[f"{base}{e}.down_proj.weight"] = w
        else:
            tensors[prefix + k] = v
    tensors[prefix + "eh_proj.weight"] = mtp["eh_proj"].weight
    tensors[prefix + "enorm.weight"] = mtp["enorm"].weight
    tensors[prefix + "hnorm.weight"] = mtp["hnorm"].weight
    tensors[prefix + "shared_head.norm.weight"] = mtp["norm"].weight
    tensors[prefix + "shared_head.head.weight"] = mtp["head"].weight
    tensors[prefix + "embed_tokens.weight"] = mtp["embed_tokens"].weight
    save_file({k: v.contiguous() for k, v in tensors.items()}, st_files[0], metadata={"format": "pt"})

    ref = references_clear_of_ties(name, lambda rng: references(model, mtp, config, rng), seed)
    np.savez_compressed(out_dir / "reference.npz", **ref)
    cfg = json.loads((out_dir / "config.json").read_text())
    print(f"{name}: {len(tensors)} tensors, model_type={cfg['model_type']}, keys e.g. "
          f"{sorted(k for k in tensors if '.mlp.experts' in k)[:3]}")
    return model, out_dir


def fp8_variant(model, src_dir, name, seed):
    """Block-quantize every 2-D linear weight to fp8 e4m3 (128x128 blocks, weight_scale_inv) and record
    the prefill logits of the HF model loaded with the dequantized weights (its own input draw: the
    quantized model's top-k decisions have their own near-ties)."""
    out_dir = OUT / name
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(src_dir, out_dir)
    st = sorted(out_dir.glob("*.safetensors"))[0]
    tensors = load_file(st)
    new, deq = {}, {}
    for k, v in tensors.items():
        quantize = (k.endswith("proj.weight") or k.endswith("wq_b.weight") or k.endswith("wk.weight")) \
            and v.ndim == 2 and "weights_proj" not in k and "indexer.k_norm" not in k
        if not quantize:
            new[k] = v
            continue
        o, i = v.shape
        bo, bi = math.ceil(o / 128), math.ceil(i / 128)
        pad = torch.zeros(bo * 128, bi * 128)
        pad[:o, :i] = v
        blocks = pad.view(bo, 128, bi, 128)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        d = (q.float() * scale[:, None, :, None]).view(bo * 128, bi * 128)[:o, :i]
        new[k] = q.view(bo * 128, bi * 128)[:o, :i].contiguous()
        new[k.replace(".weight", ".weight_scale_inv")] = scale.contiguous()
        deq[k] = d
    save_file(new, st, metadata={"format": "pt"})
    sd = model.state_dict()
    hf_sd = {}
    for k, v in deq.items():
        if k in sd:
            hf_sd[k] = v
    # Expert weights are packed inside the HF module; re-pack from the dequantized per-expert tensors.
    for key in list(sd):
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            e = sd[key].shape[0]
            hf_sd[key] = torch.stack([torch.cat([deq[f"{base}{j}.gate_proj.weight"],
                                                 deq[f"{base}{j}.up_proj.weight"]], 0) for j in range(e)])
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            e = sd[key].shape[0]
            hf_sd[key] = torch.stack([deq[f"{base}{j}.down_proj.weight"] for j in range(e)])
    missing = [k for k in hf_sd if k not in sd]
    assert not missing, missing
    model.load_state_dict(hf_sd, strict=False)
    def prefill(rng):
        toks = torch.tensor(rng.integers(0, model.config.vocab_size, size=(2, 96)))
        with torch.no_grad():
            return {"prefill_tokens": toks.numpy().astype(np.int32),
                    "prefill_logits": model(toks, use_cache=False).logits.float().numpy()}

    ref = references_clear_of_ties(name, prefill, seed)
    np.savez_compressed(out_dir / "reference.npz", **ref)
    print(f"{name}: {len(deq)} fp8 tensors")


def main():
    torch.set_num_threads(2)
    only = set(sys.argv[1:])
    for seed, (name, (ccls, mcls, kw)) in enumerate(MODELS.items()):
        if only and name not in only:
            continue
        model, out_dir = build(name, ccls, mcls, kw, seed=1000 + seed)
        if name == "glm_tiny":
            fp8_variant(model, out_dir, "glm_tiny_fp8", seed)


if __name__ == "__main__":
    main()
