"""Speculative decoding against plain decoding on the trained `tiny`, batch 1: greedy continuations
of held-out text prompts (the eval's text windows, first 48 tokens), timed after a warm-up that
compiles every bucket; plain with and without the overlapped loop, NextN with 1 and 3 drafts. Prints a
table (ms per token, acceptance length, speed-up over plain, same tokens as plain) and writes JSON.

    python3 scripts/bench_spec_ratio.py --new-tokens 64 --json spec_ratio.json
"""

import argparse
import time

import jax

from cpkv_jax.engine import Engine, EngineConfig
from cpkv_jax.eval import TaskTokenizer, _spec_counts, text_windows
from cpkv_jax.perf import report
from cpkv_jax.sampling import SamplingParams
from models.weights import TINY_DIR

VARIANTS = {"plain": {}, "plain_no_overlap": {"overlap": False},
            "nextn1": {"speculative": "nextn", "num_draft_tokens": 1},
            "nextn3": {"speculative": "nextn", "num_draft_tokens": 3}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tt = TaskTokenizer.from_dir(TINY_DIR)
    prompts = [w[:48] for w in text_windows(tt, args.prompts, 96)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    res = {"jax": jax.__version__, "device": str(jax.devices()[0]), "prompts": len(prompts),
           "new_tokens": args.new_tokens}
    outs = {}
    for name, kw in VARIANTS.items():
        eng = Engine(str(TINY_DIR), EngineConfig(page_size=16, kv_pages=256, max_running=8, **kw))
        for _ in range(2):          # warm-up: every bucket compiled (the second pass hits the prefix cache)
            for prompt in prompts:
                eng.generate([prompt], params)
        before = _spec_counts(eng)
        t = time.perf_counter()
        toks = [eng.generate([prompt], params)[0].token_ids for prompt in prompts]
        dt = time.perf_counter() - t
        n = sum(len(x) for x in toks)
        r = {"s": dt, "tok_per_s": n / dt, "ms_per_token": 1e3 * dt / n}
        after = _spec_counts(eng)
        if before is not None and after is not None and after[1] > before[1]:
            accepted, rounds = after[0] - before[0], after[1] - before[1]
            r["acceptance_length"] = (accepted + rounds) / rounds
        outs[name] = toks
        r["same_tokens_as_plain"] = toks == outs["plain"]
        r["speedup_vs_plain"] = res["plain"]["s"] / dt if "plain" in res else 1.0
        res[name] = r
    rows = [["variant", "ms/token", "acceptance", "vs plain", "same tokens"]]
    for name in VARIANTS:
        r = res[name]
        rows.append([name, f"{r['ms_per_token']:.3f}", f"{r.get('acceptance_length', 1.0):.3f}",
                     f"{r['speedup_vs_plain']:.2f}x", r["same_tokens_as_plain"]])
    report(rows, res, args.json)


if __name__ == "__main__":
    main()
