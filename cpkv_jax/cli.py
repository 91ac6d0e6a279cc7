"""`cpkv-jax` command line: score | convert."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def _parse_tokens(text: str) -> list[int]:
    try:
        toks = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(f"error: --tokens must be comma-separated integers, got {text!r}")
    if not toks:
        raise SystemExit("error: --tokens is empty")
    return toks


def cmd_score(args) -> int:
    import numpy as np

    from models.model import prefill_logits
    from models.weights import load_model

    model = load_model(args.model, dtype=args.dtype)
    toks = _parse_tokens(args.tokens)
    bad = [t for t in toks if not 0 <= t < model.cfg.vocab_size]
    if bad:
        raise SystemExit(f"error: token id(s) {bad[:5]} outside the vocabulary [0, {model.cfg.vocab_size})")
    if len(toks) > model.cfg.max_position_embeddings:
        raise SystemExit(f"error: {len(toks)} tokens exceed max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    logits = np.asarray(prefill_logits(model, np.asarray([toks]), attn_path=args.attn_path))[0]
    np.save(args.out, logits.astype(np.float32))
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    nll = -logp[np.arange(len(toks) - 1), toks[1:]] if len(toks) > 1 else np.zeros(0)
    summary = {"tokens": len(toks), "logits_shape": list(logits.shape), "out": str(args.out),
               "mean_nll": float(nll.mean()) if nll.size else None,
               "perplexity": float(np.exp(nll.mean())) if nll.size else None,
               "dtype": str(model.dtype), "argmax_next": int(logits[-1].argmax())}
    print(json.dumps(summary))
    return 0


def cmd_convert(args) -> int:
    import jax.numpy as jnp
    from tqdm import tqdm

    from models.config import ModelConfig
    from models.weights import (SafetensorsReader, hf_mtp_flags, abstract_model, iter_hf_parts,
                                save_checkpoint)

    hf = Path(args.hf)
    cfg = ModelConfig.from_json_file(hf)
    dtype = jnp.dtype(args.dtype or cfg.dtype)
    reader = SafetensorsReader(hf)
    own_embed, own_head = hf_mtp_flags(reader, cfg)
    model_abs = abstract_model(cfg, dtype, mtp_own_embed=own_embed, mtp_own_head=own_head)
    hf_json = json.loads((hf / "config.json").read_text())
    hf_json["dtype"] = str(dtype)
    hf_json.pop("torch_dtype", None)
    hf_json.pop("quantization_config", None)  # weights are stored dequantized
    extras = [hf / n for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                               "special_tokens_map.json") if (hf / n).exists()]
    total = 1 + cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
    with tqdm(total=total, desc="convert", unit="part", disable=args.quiet) as bar:
        out = save_checkpoint(args.out, hf_json, iter_hf_parts(reader, cfg, model_abs, dtype),
                              extra_files=extras, progress=lambda name: bar.update(1))
    print(json.dumps({"out": str(out), "parts": total, "dtype": str(dtype)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpkv-jax", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    s = sub.add_parser("score", help="per-position fp32 logits of a teacher-forced prefill",
                       description="Teacher-forced prefill of one token sequence; writes the per-position "
                                   "fp32 logits [T, vocab] to --out (.npy) and prints NLL/perplexity.")
    s.add_argument("--model", required=True, help="'tiny', a cpkv (orbax) checkpoint dir, or an HF dir")
    s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    s.add_argument("--out", required=True, type=Path, help="output .npy path")
    s.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: checkpoint's)")
    s.add_argument("--attn-path", choices=("expanded", "absorbed"), default="expanded")
    s.set_defaults(fn=cmd_score)

    c = sub.add_parser("convert", help="HF safetensors -> cpkv orbax checkpoint",
                       description="Stream an HF checkpoint (bf16/fp32, or fp8 with 128x128 block scales, "
                                   "dequantized) tensor by tensor into a cpkv orbax checkpoint.")
    c.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="output directory (must not exist)")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="stored dtype (default: checkpoint's; "
                                                                  "fp8 checkpoints -> bfloat16)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from models.config import ModelConfigError
    from models.weights import CheckpointError
    try:
        return args.fn(args)
    except (ModelConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
