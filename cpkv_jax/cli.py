"""`cpkv-jax` command line: generate | bench | serve | score | convert | plan | trace."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def token_ids(text: str) -> list[int]:
    """argparse type of --tokens: comma-separated non-negative integers, none empty (argparse turns the
    error into a usage message and exit 2)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give comma-separated token ids, e.g. 1,2,3")
    parts = text.replace(" ", "").split(",")
    bad = next((t for t in parts if not t.isdecimal()), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 0, got {text!r} "
                                         f"({'an empty entry' if bad == '' else repr(bad)})")
    return [int(t) for t in parts]


def kernel_policy(text: str):
    """argparse type of --kernels: a KernelPolicy from 'field=value,...'."""
    from pallas_kernels.policy import KernelPolicy
    try:
        return KernelPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_score(args) -> int:
    import numpy as np

    from cpkv_jax.engine import EngineInputError
    from models.model import prefill_logits
    from models.weights import load_model

    model = load_model(args.model, dtype=args.dtype)
    toks = args.tokens
    bad = [t for t in toks if not 0 <= t < model.cfg.vocab_size]
    if bad:
        raise EngineInputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {model.cfg.vocab_size})")
    if len(toks) > model.cfg.max_position_embeddings:
        raise EngineInputError(f"{len(toks)} tokens exceed max_position_embeddings "
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
    from tqdm import tqdm

    from models.config import ModelConfig
    from models.weights import (SafetensorsReader, hf_load_config, hf_mtp_flags, abstract_model, iter_hf_parts,
                                save_checkpoint)

    hf = Path(args.hf)
    cfg = ModelConfig.from_json_file(hf)
    reader = SafetensorsReader(hf)
    cfg, dtype = hf_load_config(cfg, reader, args.dtype)
    own_embed, own_head = hf_mtp_flags(reader, cfg)
    model_abs = abstract_model(cfg, dtype, mtp_own_embed=own_embed, mtp_own_head=own_head)
    hf_json = json.loads((hf / "config.json").read_text())
    hf_json["dtype"] = str(dtype)
    hf_json.pop("torch_dtype", None)
    hf_json.pop("quantization_config", None)  # fp8_linears says what stays fp8 (128 x 128 e4m3 blocks)
    hf_json["fp8_linears"] = list(cfg.fp8_linears)
    extras = [hf / n for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                               "special_tokens_map.json") if (hf / n).exists()]
    total = 1 + cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
    with tqdm(total=total, desc="convert", unit="part", disable=args.quiet) as bar:
        out = save_checkpoint(args.out, hf_json, iter_hf_parts(reader, cfg, model_abs, dtype),
                              extra_files=extras, progress=lambda name: bar.update(1))
    print(json.dumps({"out": str(out), "parts": total, "dtype": str(dtype), "fp8_linears": list(cfg.fp8_linears)}))
    return 0


def engine_config(args, **over):
    """The EngineConfig of parsed engine options (engine_options: one flag per field), with `over` on top."""
    from cpkv_jax.config import EngineConfig
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)} | over)


def compile_cache(args) -> None:
    """Keep compiled XLA executables under the cache directory ($CPKV_CACHE_DIR/xla), so a second start
    loads every bucket's step instead of compiling it again; not with --no-compile-cache, and not over a
    cache directory already set (JAX_COMPILATION_CACHE_DIR, or a program embedding the CLI)."""
    import jax

    from models.weights import cache_dir
    if args.compile_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def distributed_init(args) -> None:
    """Join a multi-process run (jax.distributed) when --nnodes > 1 or --dist-init-addr is given: every
    process then sees every process's devices, runs the same steps (cpkv_jax.distributed) and its CPU
    collectives go over gloo. 'auto' leaves the coordinator, process count and rank to JAX's cluster
    auto-detection."""
    from cpkv_jax.distributed import initialize
    if (args.nnodes or 1) > 1 or args.dist_init_addr:
        initialize(args.dist_init_addr, args.nnodes, args.node_rank)


def cmd_generate(args) -> int:
    import time

    from cpkv_jax.pd import make_engine
    from cpkv_jax.sampling import SamplingParams

    prompts = [value for _, value in args.requests]
    engine = make_engine(args.model, engine_config(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                            stop=tuple(args.stop), n=args.n, top_logprobs=args.top_logprobs,
                            prompt_logprobs=args.prompt_logprobs)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    timing = {"wall_s": wall, "output_tokens": n_out, "output_tokens_per_s": n_out / wall if wall else None,
              "ttft_s": [o.timing["ttft_s"] for o in outs], "steps": engine.metrics["steps"],
              "compilations": engine.compilations(),
              **{k: v for k, v in engine.stats().items() if k.startswith("spec_")}}
    if args.json:
        print(json.dumps({"outputs": [o.to_json() for o in outs], "timing": timing}))
    else:
        for i, o in enumerate(outs):
            text = f" {o.text!r}" if o.text is not None else ""
            print(f"[{i}] {o.finish_reason}: {o.token_ids}{text}")
        print(f"{n_out} tokens in {wall:.2f} s ({timing['output_tokens_per_s']:.1f} tok/s, "
              f"{timing['compilations']} compilations)", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    """Task accuracy (exact match, greedy) or held-out perplexity through the engine (cpkv_jax.eval)."""
    from cpkv_jax.eval import run_eval
    from cpkv_jax.pd import make_engine
    from models.weights import resolve_model_dir

    engine = make_engine(str(resolve_model_dir(args.model)), engine_config(args))
    r = run_eval(args.model, args.task, args.n, engine=engine, batch=args.batch)
    answers = r.pop("answers", None)
    if args.json:
        print(json.dumps(r | ({"answers": answers} if args.answers else {})))
    else:
        metric = "accuracy" if "accuracy" in r else "perplexity"
        extra = (f", acceptance length {r['acceptance_length']:.3f}" if "acceptance_length" in r else "")
        print(f"{args.task}: {metric} {r[metric]:.4f} over {r['n']}{extra}")
    return 0


class _Request(argparse.Action):
    """--prompt/--tokens keep their relative order in one list (one request each)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, "requests", None) or [])
        items.append(("prompt" if option_string == "--prompt" else "tokens", values))
        namespace.requests = items


def add_random_model_args(p: argparse.ArgumentParser) -> None:
    """The options that shape a `--model random:NAME` model (read by bench_model), declared once for
    `cpkv-jax bench` and the scripts under scripts/."""
    p.add_argument("--num-layers", type=int, default=None, help="with --model random:NAME: layers")
    p.add_argument("--num-experts", type=int, default=None, help="with --model random:NAME: routed experts")
    p.add_argument("--fp8-weights", action="store_true",
                   help="with --model random:NAME: every linear DeepSeek stores in fp8 kept fp8 (block scales)")
    p.add_argument("--max-positions", type=int, default=None,
                   help="with --model random:NAME: max_position_embeddings")


def add_model_args(p: argparse.ArgumentParser, default: str = "tiny") -> None:
    """--model (a checkpoint dir, 'tiny', or random:NAME), --dtype and the random model's options: what
    bench_model reads, for the scripts that build their model without engine_options()."""
    p.add_argument("--model", default=default, help="'tiny', a checkpoint dir, or random:NAME (a shipped config)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the model's)")
    add_random_model_args(p)


def bench_model(args):
    """'random:NAME' -> a shipped config with random weights (few layers/experts allowed)."""
    from flax import nnx
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.model import DsaModel
    from models.weights import load_model

    if not args.model.startswith("random:"):
        return load_model(args.model, dtype=args.dtype)
    over = {}
    if args.num_layers:
        over.update(num_hidden_layers=args.num_layers, first_k_dense_replace=min(args.num_layers - 1, 1))
    if args.num_experts:
        over["n_routed_experts"] = args.num_experts
    if args.fp8_weights:
        from models.config import FP8_LINEARS_ALL
        over["fp8_linears"] = list(FP8_LINEARS_ALL)
    if args.max_positions:
        over["max_position_embeddings"] = args.max_positions
    cfg = ModelConfig.named(args.model.split(":", 1)[1], **over)
    return DsaModel(cfg, dtype=jnp.dtype(args.dtype or cfg.dtype), rngs=nnx.Rngs(0))


def cmd_bench(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from cpkv_jax.engine import Engine
    from cpkv_jax.perf import decode_step_bytes, forward_flops, measure_ceilings, print_table
    from cpkv_jax.sampling import SamplingParams
    from cpkv_jax.kv_pool import pages_for
    from models.model import matmul_precision

    model = bench_model(args)
    cfg = model.cfg
    B, L, N = args.batch, args.prompt_len, args.decode_tokens
    kv_pages = args.kv_pages or args.cp_size * -(-(B * pages_for(L + N, args.page_size) + 2) // args.cp_size + 1)
    budget = args.max_prefill_tokens or min(B * L, 8192)
    config = engine_config(args, kv_pages=kv_pages, max_running=args.max_running or B, max_prefill_tokens=budget,
                           speculative=None)
    engine = Engine(model, config)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    rng = np.random.default_rng(args.seed)
    prompts = lambda: [rng.integers(0, cfg.vocab_size, L).tolist() for _ in range(B)]  # noqa: E731
    engines = [engine]
    if args.speculative:
        engines.append(Engine(model, dataclasses.replace(
            config, speculative=args.speculative, num_draft_tokens=args.num_draft_tokens,
            trace_out=config.trace_out and config.trace_out + ".spec")))   # its own trace file

    def timed(eng, bar):
        """Warm-up run (compiles every bucket the timed runs use), then the best of the timed runs."""
        eng.generate(prompts(), params)
        bar.update(1)
        runs = []
        for _ in range(args.repeat):
            for k in eng.metrics:
                eng.metrics[k] = 0
            eng.generate(prompts(), params)
            runs.append(dict(eng.metrics, **{k: v for k, v in eng.stats().items() if k.startswith("spec_")}))
            bar.update(1)
        return min(runs, key=lambda m: m["prefill_s"] + m["decode_s"])

    with tqdm(total=len(engines) * (1 + args.repeat), desc="bench (warm-up, then timed runs)", unit="run",
              disable=args.quiet, file=sys.stderr) as bar:
        bests = [timed(e, bar) for e in engines]
    best = bests[0]
    with jax.default_matmul_precision(matmul_precision(model.dtype)):
        ceilings = measure_ceilings(model.dtype)  # the matmul rate at the model's own dtype and precision

    prefill_flops = B * forward_flops(cfg, np.arange(L), sampled=1)
    steps = max(best["decode_steps"], 1)
    mean_ctx = L + N // 2
    param_bytes = jnp.dtype(model.dtype).itemsize
    cache = engine.pool.cache
    idx_bytes = cache.index_k.dtype.itemsize * cfg.index_head_dim + (4 if cache.index_fp8 else 0)
    decode_flops = steps * forward_flops(cfg, np.full(B, mean_ctx), sampled=B)
    decode_bytes = steps * decode_step_bytes(cfg, B, mean_ctx, param_bytes, param_bytes, idx_bytes)
    p_s, d_s = best["prefill_s"], best["decode_s"]
    result = {
        "model": args.model, "dtype": str(model.dtype), "layers": cfg.num_hidden_layers,
        "experts": cfg.n_routed_experts, "batch": B, "prompt_len": L, "decode_tokens": N,
        "page_size": args.page_size, "prefill_budget": budget, "device": ceilings["device"], "cp": args.cp_size,
        "pool_bytes_per_rank": engine.pool.bytes_per_rank(),
        "prefill": {"tokens": best["prefill_tokens"], "seconds": p_s, "tokens_per_s": best["prefill_tokens"] / p_s,
                    "flops": prefill_flops, "flops_per_s": prefill_flops / p_s,
                    "mfu": prefill_flops / p_s / ceilings["matmul_flops_per_s"]},
        "decode": {"tokens": best["decode_tokens"], "steps": steps, "seconds": d_s,
                   "tokens_per_s": best["decode_tokens"] / d_s if d_s else None,
                   "ms_per_step": 1e3 * d_s / steps, "bytes": decode_bytes,
                   "bytes_per_s": decode_bytes / d_s if d_s else None,
                   "bandwidth_util": decode_bytes / d_s / ceilings["copy_bytes_per_s"] if d_s else None,
                   "flops_per_s": decode_flops / d_s if d_s else None},
        "ceilings": ceilings, "compilations": engine.compilations(), "repeat": args.repeat,
        "speculative": None if len(bests) == 1 else {
            "method": args.speculative, "num_draft_tokens": args.num_draft_tokens,
            "decode_tokens_per_s": bests[1]["decode_tokens"] / bests[1]["decode_s"],
            "speedup_vs_plain": (bests[1]["decode_tokens"] / bests[1]["decode_s"]) / (best["decode_tokens"] / d_s),
            "acceptance_length": bests[1].get("spec_acceptance_length"),
            "accept_rate": bests[1].get("spec_accept_rate"), "rounds": bests[1]["spec_rounds"]},
        "jax": jax.__version__,
    }
    rows = [("phase", "tokens", "seconds", "tokens/s", "counted rate", "utilisation"),
            ("prefill", result["prefill"]["tokens"], f"{p_s:.4f}", f"{result['prefill']['tokens_per_s']:.1f}",
             f"{result['prefill']['flops_per_s'] / 1e12:.2f} TFLOP/s", f"MFU {result['prefill']['mfu']:.1%}"),
            ("decode", result["decode"]["tokens"], f"{d_s:.4f}", f"{result['decode']['tokens_per_s'] or 0:.1f}",
             f"{(result['decode']['bytes_per_s'] or 0) / 1e9:.1f} GB/s",
             f"BW {result['decode']['bandwidth_util'] or 0:.1%}")]
    print_table(rows)
    if result["speculative"]:
        sp = result["speculative"]
        print(f"speculative {sp['method']} n={sp['num_draft_tokens']}: decode {sp['decode_tokens_per_s']:.1f} tok/s "
              f"({sp['speedup_vs_plain']:.2f}x plain), acceptance length {sp['acceptance_length']:.2f}, "
              f"accept rate {sp['accept_rate']:.1%}")
    print(f"ceilings ({ceilings['device']}): matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s "
          f"({ceilings['matmul_dtype']}), copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cmd_plan(args) -> int:
    """Per-device memory of a model on a mesh (cpkv_jax.memory_plan): a table, or one JSON object."""
    from cpkv_jax.memory_plan import MeshShape, plan, print_plan
    from models.config import ModelConfig
    path = Path(args.model)
    cfg = ModelConfig.from_json_file(path) if path.exists() else ModelConfig.named(args.model)
    mesh = MeshShape.parse(args.mesh) if args.mesh else MeshShape(dp=args.devices, ep=args.devices)
    result = plan(cfg, devices=args.devices, device_memory_gib=args.device_memory, mesh=mesh, weights=args.weights,
                  page_size=args.page_size, prefill_tokens=args.prefill_tokens, host_memory_gib=args.host_memory,
                  ep_dispatch=args.ep_dispatch, two_batch_overlap=args.two_batch_overlap)
    if args.json:
        print(json.dumps(result))
    else:
        print_plan(result)
    return 0


def cmd_serve(args) -> int:
    import jax

    from cpkv_jax.pd import make_engine
    from cpkv_jax.server import serve
    from models.weights import resolve_model_dir

    engine = make_engine(args.model, engine_config(args))
    if jax.process_index() != 0:        # a multi-process run: process 0 serves, the others follow its steps
        from cpkv_jax.distributed import follow
        follow(engine)
        return 0
    model_dir = resolve_model_dir(args.model)
    serve(engine, host=args.host, port=args.port, model_name=args.served_model_name or Path(str(args.model)).name,
          model_dir=model_dir if model_dir.is_dir() else None, max_queued=args.max_queued)
    return 0


def cmd_trace_diff(args) -> int:
    from cpkv_jax.trace import diff_files
    return diff_files(args.run_a, args.run_b, sys.stdout)


def engine_options() -> argparse.ArgumentParser:
    """The options of the verbs that run the engine (generate, bench, serve), defined once: --model, one
    flag per EngineConfig field (dest = the field, default = EngineConfig's, read back by engine_config),
    and --no-compile-cache."""
    from cpkv_jax.config import EngineConfig
    from cpkv_jax.cp import MODES, SHORT_POLICIES
    from models.moe import EP_DISPATCH_CHOICES
    from pallas_kernels.policy import DEFAULT_POLICY

    d = EngineConfig()
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("--model", default="tiny", help="'tiny' (default: the trained tiny model), 'tiny-random', a cpkv (orbax) checkpoint dir, or an HF dir")
    q.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (default %(default)s)")
    q.add_argument("--kv-pages", type=int, default=d.kv_pages,
                   help="device KV pool size in pages (default %(default)s)")
    q.add_argument("--max-running", type=int, default=d.max_running,
                   help="requests prefilling or decoding at once (default %(default)s)")
    q.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prefill tokens per step, chunked prefill (default %(default)s)")
    q.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=d.prefix_cache,
                   help="radix prefix cache over finished and prefilled requests")
    q.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=d.overlap,
                   help="plan and dispatch each step before taking the previous step's tokens (default on)")
    q.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="compute dtype (default: checkpoint's)")
    q.add_argument("--index-dtype", choices=("fp8", "same", "bfloat16", "float32"), default=d.index_dtype,
                   help="indexer key cache: fp8 e4m3 + per-token scale, or unquantized ('same': the compute "
                        "dtype; what score and HF compute) (default %(default)s)")
    q.add_argument("--attn-path", choices=("expanded", "absorbed"), default=d.attn_path,
                   help="force one attention path (default: by tokens per request)")
    q.add_argument("--min-prefill-lanes", type=int, default=d.min_prefill_lanes,
                   help="smallest prefill token bucket (default %(default)s)")
    q.add_argument("--cp", dest="cp_size", type=int, default=d.cp_size, metavar="N",
                   help="context-parallel ranks (devices); the KV pool is split over them (default 1)")
    q.add_argument("--cp-mode", choices=MODES, default=d.cp_mode, help="CP token split (default: page-aligned zigzag)")
    q.add_argument("--ep", dest="ep_size", type=int, default=d.ep_size, metavar="N",
                   help="expert-parallel ranks: the routed experts split over N x the --tp ranks (default 1)")
    q.add_argument("--tp", dest="tp_size", type=int, default=d.tp_size, metavar="N",
                   help="tensor-parallel ranks: heads, MLP intermediate and vocabulary split N ways, and the routed "
                        "experts with --ep's (default 1)")
    q.add_argument("--ep-dispatch", choices=EP_DISPATCH_CHOICES, default=d.ep_dispatch,
                   help="how rows meet their experts over --ep: every rank runs its experts over every row and "
                        "the partials are psummed, or each rank dispatches its 1/ep of the rows to the experts' "
                        "ranks (all-to-all) and gathers them back (default auto: the fewer bytes)")
    q.add_argument("--two-batch-overlap", action=argparse.BooleanOptionalAction, default=d.two_batch_overlap,
                   help="split each forward into two micro-batches whose collectives overlap the other's "
                        "compute, IndexCache top-k carried per micro-batch (default off)")
    q.add_argument("--cp-short-policy", choices=SHORT_POLICIES, default=d.cp_short_policy,
                   help="CP split of requests with fewer than 2*cp new pages: whole pages per rank ('owner', "
                        "default) or token-balanced segments")
    q.add_argument("--speculative", choices=("nextn",), default=d.speculative,
                   help="EAGLE/NextN speculative decoding with the checkpoint's MTP layer")
    q.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens,
                   help="draft tokens per round (default %(default)s)")
    q.add_argument("--hicache-pages", type=int, default=d.hicache_pages,
                   help="host KV tier (pinned host memory) under the prefix cache, in pages (default 0: off)")
    q.add_argument("--hicache-policy", choices=("write_through", "write_through_selective"),
                   default=d.hicache_policy, help="back pages up on first insert (default) or on the second hit")
    q.add_argument("--hicache-copy", choices=("auto", "side_stream", "jit"), default=d.hicache_copy,
                   help="host tier copies: on a side CUDA stream at layer boundaries, or jitted after the "
                        "step (default auto: side stream on GPU)")
    q.add_argument("--kernels", type=kernel_policy, default=DEFAULT_POLICY, metavar="FIELD=VALUE,...",
                   help="kernel choices over the defaults, e.g. moe_kernel=false (the fields of "
                        "pallas_kernels.policy.KernelPolicy)")
    q.add_argument("--kv-trace", type=int, choices=(0, 1, 2, 3), default=d.kv_trace, metavar="N",
                   help="KV-integrity trace level: 1 host-tier transfers, 2 + page hashes at backup and reload, "
                        "3 + per-layer forward hashes (default 0: off, nothing compiled in); needs --trace-out")
    q.add_argument("--trace-out", default=d.trace_out, metavar="PATH",
                   help="the trace's JSONL file (compare two with `cpkv-jax trace diff`)")
    q.add_argument("--pd-prefill-devices", type=int, default=d.pd_prefill_devices, metavar="N",
                   help="prefill/decode disaggregation: prefill on a cp mesh over the first N devices, decode on "
                        "--pd-decode-replicas devices after them (default 0: off)")
    q.add_argument("--pd-decode-replicas", type=int, default=d.pd_decode_replicas, metavar="M",
                   help="PD decode engines, one device each, each its own pool and prefix cache (default 1)")
    q.add_argument("--pd-router", choices=("least_loaded", "prefix"), default=d.pd_router,
                   help="PD: decode replica for a request: least loaded (default) or longest cached prefix first")
    q.add_argument("--nnodes", type=int, default=None,
                   help="processes of a multi-process run (jax.distributed); default: one, or what the cluster "
                        "environment (SLURM, ...) says when --dist-init-addr is 'auto'")
    q.add_argument("--node-rank", type=int, default=None, help="this process's rank in a multi-process run")
    q.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="the coordinator (process 0) of a multi-process run, or 'auto' (cluster auto-detection)")
    q.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not keep compiled executables in $CPKV_CACHE_DIR/xla (default: kept, so a second "
                        "start does not compile again)")
    return q


def build_parser() -> argparse.ArgumentParser:
    from models.moe import EP_DISPATCH_CHOICES

    p = argparse.ArgumentParser(prog="cpkv-jax", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    g = sub.add_parser("generate", parents=[engine_options()],
                       help="generate tokens for one or more prompts (one batch)",
                       description="Run prompts through the engine (continuous batching, paged KV, prefix "
                                   "cache). --prompt/--tokens may repeat: one request each, outputs in order.")
    g.add_argument("--prompt", action=_Request, dest="requests", metavar="TEXT", help="a text prompt (repeatable)")
    g.add_argument("--tokens", action=_Request, dest="requests", metavar="IDS", type=token_ids,
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos token")
    g.add_argument("--logprobs", action="store_true", help="include each token's log-probability")
    g.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with --logprobs / --prompt-logprobs: each token's N most likely alternatives")
    g.add_argument("--prompt-logprobs", action="store_true",
                   help="include each prompt token's log-probability given the tokens before it")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop at this text (repeatable; matched across tokens, the output cut before it)")
    g.add_argument("--n", type=int, default=1,
                   help="samples per prompt, seeds seed, seed + 1, ... (consecutive in the output)")
    g.add_argument("--json", action="store_true", help='print one JSON object {"outputs": [...], "timing": {...}}')
    g.set_defaults(fn=cmd_generate, requests=[])

    b = sub.add_parser("bench", parents=[engine_options()],
                       help="prefill / decode throughput with counted FLOPs and bytes",
                       description="Batch of random prompts through the engine: a warm-up run (compiles), then "
                                   "timed runs; prints prefill and decode tokens/s, MFU and bandwidth "
                                   "utilisation against ceilings measured in the same run. Unless given, "
                                   "--kv-pages, --max-running and --max-prefill-tokens follow the workload "
                                   "(a pool for the batch, B, min(B*L, 8192)); the prompts are random, so "
                                   "no prefix cache unless --prefix-cache.")
    b.set_defaults(kv_pages=None, max_running=None, max_prefill_tokens=None, prefix_cache=False)
    add_random_model_args(b)
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--prompt-len", type=int, default=256)
    b.add_argument("--decode-tokens", type=int, default=32)
    b.add_argument("--repeat", type=int, default=2)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="write the results as JSON to this path")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_bench)

    v = sub.add_parser("serve", parents=[engine_options()],
                       help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       description="Serve the model over HTTP: /v1/completions and /v1/chat/completions (SSE "
                                   "streaming, n, stop strings and token ids), /v1/models, /health, /metrics.")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    v.add_argument("--max-queued", type=int, default=256, help="requests in flight before 503 (default 256)")
    v.set_defaults(fn=cmd_serve)

    e = sub.add_parser("eval", parents=[engine_options()],
                       help="task accuracy (recall, arith) or text perplexity of a model through the engine",
                       description="Greedy exact-match accuracy on a held-out generated set (recall: a key's "
                                   "value more than index_topk tokens back; arith: 2-3 digit + and -) or "
                                   "perplexity on held-out text, through the engine with the given options; "
                                   "with --speculative nextn also the draft acceptance length (cpkv_jax/eval.py).")
    e.add_argument("--task", required=True, choices=("recall", "arith", "text"))
    e.add_argument("--n", type=int, default=100, help="examples (text: windows) (default %(default)s)")
    e.add_argument("--batch", type=int, default=32, help="requests per generate call (default %(default)s)")
    e.add_argument("--answers", action="store_true", help="with --json: include the generated answers")
    e.add_argument("--json", action="store_true",
                   help='print one object {"accuracy" | "perplexity", "n", "acceptance_length"?, ...}')
    e.set_defaults(fn=cmd_eval)

    s = sub.add_parser("score", help="per-position fp32 logits of a teacher-forced prefill",
                       description="Teacher-forced prefill of one token sequence; writes the per-position "
                                   "fp32 logits [T, vocab] to --out (.npy) and prints NLL/perplexity.")
    s.add_argument("--model", required=True, help="'tiny', 'tiny-random', a cpkv (orbax) checkpoint dir, or an HF dir")
    s.add_argument("--tokens", required=True, type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    s.add_argument("--out", required=True, type=Path, help="output .npy path")
    s.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: checkpoint's)")
    s.add_argument("--attn-path", choices=("expanded", "absorbed"), default="expanded")
    s.set_defaults(fn=cmd_score)

    c = sub.add_parser("convert", help="HF safetensors -> cpkv orbax checkpoint",
                       description="Stream an HF checkpoint (bf16/fp32, or fp8 with 128x128 block scales, "
                                   "kept fp8) tensor by tensor into a cpkv orbax checkpoint.")
    c.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="output directory (must not exist)")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="stored dtype; default: the checkpoint's, with its "
                   "fp8 linears kept fp8 + 128x128 block scales (a dtype dequantizes them)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)

    m = sub.add_parser("plan", help="will a model fit a mesh: per-device bytes and KV capacity",
                       description="Per-device bytes of weights (by kind), KV pool and one prefill step's "
                                   "activations for a mesh of dp x cp x tp devices with experts split ep ways.")
    m.add_argument("--model", required=True, help="a shipped config name (glm-5, deepseek-v3.2, ...) or a "
                   "checkpoint directory / config.json")
    m.add_argument("--devices", type=int, required=True)
    m.add_argument("--device-memory", type=float, required=True, metavar="GIB", help="memory per device in GiB")
    m.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="dp/cp/tp/ep sizes, e.g. ep=8,dp=8 (default: dp = ep = devices)")
    m.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    m.add_argument("--page-size", type=int, default=64)
    m.add_argument("--prefill-tokens", type=int, default=8192, help="one prefill step's tokens (activations)")
    m.add_argument("--host-memory", type=float, default=0.0, metavar="GIB", help="host KV tier size in GiB")
    m.add_argument("--ep-dispatch", choices=EP_DISPATCH_CHOICES, default="auto",
                   help="the expert-parallel exchange whose buffers are counted (as the engine's --ep-dispatch)")
    m.add_argument("--two-batch-overlap", action="store_true", help="count a step as two micro-batches")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(fn=cmd_plan)

    t = sub.add_parser("trace", help="KV-integrity traces (--kv-trace N --trace-out PATH): compare two runs",
                       description="Analyze KV-integrity traces written by generate / serve / bench with "
                                   "--kv-trace N --trace-out PATH.")
    tsub = t.add_subparsers(dest="trace_verb", required=True)
    td = tsub.add_parser("diff", help="name the first place two runs of the same workload diverge",
                         description="Compare two traces of the same workload: prints the first (request, "
                                     "positions, layer, stage) or host page that differs and, last, the "
                                     "verdict (top-k differs -> index-K cache; attention output with equal "
                                     "top-k -> main KV or page mapping; MoE input with equal attention -> "
                                     "residual / MoE; reload != backup -> host tier). Exit 0 when the runs "
                                     "agree, 1 when they diverge.")
    td.add_argument("run_a", help="trace JSONL of the reference run")
    td.add_argument("run_b", help="trace JSONL of the run to check")
    td.set_defaults(fn=cmd_trace_diff)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fn is cmd_generate and not args.requests:
        parser.error("generate: give at least one --prompt TEXT or --tokens IDS")
    from models.config import ModelConfigError
    from models.weights import CheckpointError
    from cpkv_jax.config import EngineConfigError
    from cpkv_jax.engine import EngineInputError
    from cpkv_jax.memory_plan import MeshPlanError
    from cpkv_jax.sampling import SamplingError
    from cpkv_jax.trace import TraceFormatError
    try:
        if "compile_cache" in vars(args):
            compile_cache(args)
            distributed_init(args)
        return args.fn(args)
    except (ModelConfigError, CheckpointError, FileNotFoundError, EngineConfigError, EngineInputError,
            SamplingError, MeshPlanError, TraceFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
