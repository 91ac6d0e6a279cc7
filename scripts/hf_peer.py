"""The HF transformers peer of `cpkv-jax bench`'s prefill: the same shipped config (layers and routed
experts cut the way bench_model cuts them), random bf16 weights on the GPU, eager PyTorch with sdpa
attention; times a batch-1 prefill of each prompt length (logits of the last position only, as a
serving prefill computes them) and prints one JSON object. Runs on the GPU box's torch + transformers
(not a dependency of the package).

    python3 scripts/hf_peer.py --model glm-5 --num-layers 4 --num-experts 16 --prompt-lens 8192
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="glm-5", help="a config under models/configs")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--prompt-lens", default="8192")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chunk", type=int, default=0,
                   help="prefill prompts longer than this in chunks of it through the KV cache (0: whole); "
                        "eager sdpa and the indexer hold [T, S] scores, so one 32768-token call does not fit")
    p.add_argument("--decode", default="", help="batch x context pairs ('1x8192,8x2048'): time greedy decode "
                                               "steps after a cached prefill")
    p.add_argument("--decode-steps", type=int, default=16)
    args = p.parse_args()
    raw = json.loads((CONFIGS / f"{args.model}.json").read_text())
    raw.update(num_hidden_layers=args.num_layers, first_k_dense_replace=min(args.num_layers - 1, 1),
               n_routed_experts=args.num_experts, num_nextn_predict_layers=0)
    arch = raw.pop("architectures")[0]
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = getattr(transformers, arch)(cfg).eval()
    out = {"model": args.model, "layers": args.num_layers, "experts": args.num_experts, "peer": "hf",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(), "prefill": {}}
    for L in [int(x) for x in args.prompt_lens.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (1, L), device="cuda")
        times = []
        with torch.inference_mode():
            for i in range(args.repeat + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                if args.chunk and L > args.chunk:
                    cache = None
                    for c in range(0, L, args.chunk):
                        cache = model(input_ids=ids[:, c:c + args.chunk], past_key_values=cache,
                                      use_cache=True, logits_to_keep=1).past_key_values
                else:
                    model(input_ids=ids, logits_to_keep=1, use_cache=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        s = min(times[1:])
        out["prefill"][str(L)] = {"seconds": s, "tokens_per_s": L / s, "warmup_s": times[0],
                                  "chunk": args.chunk if args.chunk and L > args.chunk else L}
        print(f"hf prefill L={L}: {s * 1e3:.1f} ms, {L / s:.0f} tok/s", flush=True)
    out["decode"] = {}
    for pair in filter(None, args.decode.split(",")):
        B, L = (int(x) for x in pair.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (B, L), device="cuda")
        with torch.inference_mode():
            res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(args.decode_steps + 2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = model(input_ids=tok, past_key_values=cache, use_cache=True)
                cache, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t)
        ms = 1e3 * sorted(steps[2:])[len(steps[2:]) // 2]
        out["decode"][pair] = {"ms_per_step": ms, "tokens_per_s": B * 1e3 / ms}
        print(f"hf decode {pair}: {ms:.2f} ms/step (median of {args.decode_steps})", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
