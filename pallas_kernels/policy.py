"""Which kernels a forward runs: one frozen, hashable value passed down as a static argument (jit
keys its compilations on it), so a path is chosen by the caller instead of by module switches read at
trace time. The defaults are the fastest paths measured on the H200 (docs/perf.md)."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    enabled: bool = True
    """Pallas kernels on GPU at all (row gather, indexer scores and selection); off: the jnp references
    everywhere, to compare the two."""
    fused_indexer: bool = False
    """The indexer's top-k without the [T, S] scores in HBM (indexer_topk_fused). Off by default: on
    the H200 keeping candidates inside the scores loop cost more than writing and re-reading the scores,
    at prefill and decode alike (docs/perf.md)."""
    mgpu_scores: bool = True
    """Calls that gather their keys (prefill) compute their scores with the Mosaic GPU kernel where its
    shapes fit: faster than the Triton kernel on the H200 (docs/perf.md). The two round differently, so
    a near-tie can rank differently between them."""
    mgpu_paged: bool = True
    """Calls that read their keys through the page table (decode, short chunks) over a table of whole
    64-slot blocks compute their scores with the paged Mosaic GPU kernel, which reads the pool by TMA:
    faster than the Triton kernel's row gathers on the H200 (docs/perf.md)."""
    mgpu_paged_one_wave: bool = False
    """The paged scores kernel takes as few key blocks per program as keep a call within about one wave
    of the SMs (tuning.paged_blocks_per_program), instead of the 64 of its default tiling, which was
    measured at 8 x 131072 keys and leaves a batch-1 decode at 8k context on 2 programs (30 us a
    layer in the H200 profile of docs/perf.md, 2026-12-04 sixth session). Off until measured."""
    mgpu_min_programs: int = 132
    """The fewest programs (16 query tokens of a request each) for which the gathered Mosaic GPU kernel
    is used: below one program per SM of the H200 it loses to the Triton kernel (docs/perf.md)."""
    moe_kernel: bool = True
    """The routed experts' grouped matmuls run the Mosaic GPU kernel (pallas_kernels/moe) where its
    shapes fit; off: XLA's lax.ragged_dot (the reference)."""
    moe_compute_wgs: int = 2
    """Compute warpgroups of the bf16 expert kernel: 2, the warp-specialized kernel (a producer
    warpgroup's TMA loads feeding two compute warpgroups, each with half of the tile), or 1 (one
    warpgroup pipelining its own loads). On the H200 (docs/perf.md, 2026-12-03 third session), 8192
    tokens x top-8 over 256 experts, gate_up 5.87 vs 7.13 ms, down 3.18 vs 3.61."""
    moe_tile_program_rows: int = 256
    """bf16 prefill expert calls (128 rows a tile or more) with at most this many routed rows an expert (slots /
    E) run one program a tile (Tiling.programs 0) instead of 132 persistent ones: an expert's neighbouring row
    tiles start together, so their weight reads can share the L2. On the H100 (docs/perf.md, 2026-12-07
    twenty-eighth session), 8192 tokens x top-8 over 256 experts (256 rows an expert): gate_up 6.49-6.52 ms in
    four calls against the persistent programs' 6.84-9.84 in six (which vary from call to call where one
    program a tile does not), down 3.64-3.67 against 3.76-4.08; a GLM-5-shaped 3-layer slice's bf16 prefill of
    8192 tokens 63.2 / 63.2 ms against 67.8 / 65.0. At 512 rows an expert even (gate_up -1.7%, down +3.4%),
    from 1024 slower (gate_up +5%; +8-12% at 4096 and 16384). fp8 calls keep persistent programs: one program
    a tile ran their gate_up 5% slower at 256 rows an expert. 0: never."""
    moe_pairwise_plan_slots: int = 512
    """Expert calls of at most this many routed slots (tokens x top-k; decode, verify) compute their
    block plan pairwise (plan._pairwise_plan: a few fused comparisons) instead of by a sort, searches
    and scatters (~27 small XLA ops of 1-3 us at 1 token). H200 (docs/perf.md, 2026-12-04 third
    session), fp8 experts over 256: 1 token 0.157 vs 0.172 ms, 8 tokens 0.707 vs 0.705, 64 tokens 2.612
    vs 2.637. 0: always sort."""
    fp8_moe_kernel: bool = True
    """fp8 routed experts stay fp8 through the grouped matmul (fp8 x fp8, block scales, fp32 sums;
    rows quantized per 128 columns) where its shapes fit; off: they are dequantized to the compute
    dtype first. On the H200 (docs/perf.md, 2026-12-03 third session), GLM-5 widths, 256 experts:
    decode of 1 / 8 / 64 tokens 0.16 / 0.65 / 2.40 ms (bf16 weights 0.23 / 1.33 / 5.45); prefill of
    8192 tokens over 16 experts 6.3 ms (bf16 8.4, dequantizing per call 9.0), over 256 8.0 (bf16
    12.1, dequantizing 19.2)."""
    fp8_moe_compute_wgs: int = 2
    """Compute warpgroups of the fp8 expert kernel: 2, the warp-specialized kernel (a producer
    warpgroup's TMA loads feeding two compute warpgroups, each rescaling its half of the tile while
    the other's wgmma runs), or 1 (one warpgroup pipelining its own loads; 9.8 ms where the two take
    6.3 in the prefill above)."""
    chained_tiles: bool = False
    """The grouped matmul kernel's warp-specialized calls (routed experts, bf16 and fp8; fp8 dense
    linears) run each program's tiles as one continued K pipeline (grouped_matmul.Tiling.chained_tiles),
    where a tile's K steps are a multiple of the stages: the next tile's first loads overlap this
    tile's last products and its store. Off until timed on the GPU."""
    fp8_moe_interleaved_gate_up: bool = True
    """The fp8 gate_up call with each step's gate and up blocks side by side in shared memory, one
    m64n128 product a step per warpgroup (grouped_matmul.Tiling.interleaved_gate_up; clusters of two,
    128 x 128 tiles at prefill, 64 x 256 at decode), read from gate and up as stored. On the H100
    (docs/perf.md, 2026-12-05 fourteenth session): the call at 8192 x 16 3.14 ms against the joint
    tiling's 3.45, at 8192 x 256 4.28 against 4.44, decode (1 / 8 / 64 tokens x 256) equal within 2%;
    the fp8 prefill of 8192 tokens (4 layers, two runs each) over 16 experts 61.8 / 64.1 ms against 64.5 /
    65.0, over 256 70.7 / 69.7 against 69.0 / 70.0: within the runs' order effect (up to 2.5%), where the
    calls' difference predicts -1.9% and -0.9%."""
    fp8_step_blocks: int = 2
    """2: the fp8 expert calls and dense linears whose tiling takes it (with_step_blocks: two compute
    warpgroups, three stages fit or 64-row tiles: the interleaved gate_up calls, decode-sized linears and
    kv_a_proj's 64-wide prefill tiles; the prefill down call and the 128 x 128 prefill linears keep one
    block a step) load two 128-deep K blocks a pipeline step and add the first block's product into the
    fp32 sums while the second's runs (grouped_matmul.Tiling.step_blocks): bit-equal outputs. On the H100 (docs/perf.md, 2026-12-06) the
    interleaved gate_up call 3.167 -> 2.947 ms at 8192 x 16 and 4.295 -> 3.994 at 8192 x 256, decode
    gate_up 2.093 -> 2.045 at 64 x 256; 1: one block a step."""
    fp8_wide_tiles: bool = True
    """fp8 one-weight prefill calls (128-row tiles) whose outputs are a multiple of 192 columns (the routed
    experts' down call; dense linears: a multiple of 384) take 192-column tiles instead of 128 (each
    warpgroup one m64n192 product a K block, promoted in 64-column slices with their own weight block
    scales: grouped_matmul.scale_slices), with a program's tiles chained (Tiling.chained_tiles): a third
    less of x and of the products' A operand read from shared memory per output column (DeepGEMM's
    widest Hopper tile). On the H100 (docs/perf.md, 2026-12-06 eighteenth session) the down call at
    8192 x 16 1.565 -> 1.392 ms (fp8 / bf16 1.44x -> 1.62x), at 8192 x 256 2.252 -> 1.996."""
    fp8_three_wgs: bool = True
    """fp8 prefill expert calls with at least THREE_WG_ROWS routed rows per expert run 192-row tiles in
    three compute warpgroups (grouped_matmul.Tiling.compute_wgs 3: 64 rows each, 160 registers a compute
    thread): gate_up interleaved 192 x 128 and down 192 x 128 chained, in clusters of two (moe.dispatch
    .expert_tilings), so one warpgroup promotes while two have products on the tensor cores; bit-equal
    outputs. On the H100 (docs/perf.md, 2026-12-06 twentieth session; kernel calls alone, three runs) both
    calls fp8 / bf16 1.49-1.51x -> 1.58-1.64x at 8192 x 16 (4.42 -> 4.16 ms), 1.43-1.52x -> 1.60-1.69x at
    32768 x 16, 1.55-1.61x -> 1.58-1.67x at 8192 x 64; at 8192 x 256 (256 rows an expert: a third more
    padding rows) slower, 5.94 -> 6.52 ms, hence the threshold. The fp8 prefill of 8192 tokens over 16
    experts end to end within its noise (60.2 / 64.4 ms against 60.5 / 63.7; the expert calls are ~a
    quarter of it). Off: the two-warpgroup 128-row tilings everywhere."""
    fp8_linear_kernel: bool = True
    """Kept-fp8 dense linears (attention projections, shared experts, dense MLP, MTP's eh_proj) run
    fp8 x fp8 (pallas_kernels/fp8_linear.py: the expert kernel with one expert; rows quantized per 128
    columns) where their shapes fit; off: they are dequantized to the compute dtype at use."""
    sparse_mla_kernel: bool = True
    """Absorbed attention over the selected rows runs the sparse MLA kernel (pallas_kernels/sparse_mla)
    where its shapes fit, reading the rows from the pool in the kernel; with it, long prefill chunks
    take the absorbed path too (its cost grows with top-k, the expanded path's with the context). Off:
    the jnp composition, which gathers the rows first."""
    mgpu_sparse_mla: bool = True
    """Prefill-sized sparse MLA calls (at least two queries per SM) with GLM-5's widths run the Mosaic
    GPU kernel (pallas_kernels/sparse_mla/kernel_mgpu.py: rows gathered by a producer warpgroup's
    cp.async, two consumer warpgroups) instead of the Triton one: on the H200 (docs/perf.md,
    2026-12-03) 278 vs 238 TFLOP/s at 8192 queries, and a GLM-5-slice prefill of 8192 tokens in 85.6
    vs 92.0 ms. Off: the Triton kernel, which also serves decode, verify and small chunks."""
    mgpu_sparse_mla_alternate: bool = False
    """The Mosaic GPU prefill kernel's two compute warpgroups take turns computing a block's scores and
    softmax, sharing the probabilities through shared memory (kernel_mgpu's "alternate", FlashMLA's
    scheme), instead of each computing every score ("both": the 576-wide score product twice). Off:
    correct, and slower on the H200 (docs/perf.md, 2026-12-03 fifth session): 8192 queries 9.10 vs
    7.05 ms, 32768 38.4 vs 32.3; a GLM-5-slice prefill of 8192 tokens 101.9 vs 93.4 ms. Each block's
    value products wait for the probabilities the other warpgroup publishes, so the two no longer
    overlap one's softmax with the other's matmuls."""
    mgpu_sparse_mla_rows: bool = True
    """Decode- and verify-sized sparse MLA calls (fewer than two queries per SM) with GLM-5's widths run
    the Mosaic GPU kernel with each query's selected rows cut in shares over one wave of programs,
    their outputs merged by their softmax statistics (kernel_mgpu.sparse_mla_mgpu_rows), instead of
    the Triton kernel's splits. On the H200 (docs/perf.md, 2026-12-04): 64 queries 78.7 against 181.7
    us, 8 queries 31 against 50 us, 1 query 22.6 against 22.5 us."""
    mgpu_sparse_mla_l2_prefetch: bool = True
    """The Mosaic GPU sparse MLA kernel's row copies carry PTX's L2::256B prefetch hint (kernel_mgpu
    _gather_block, FlashMLA's sparse producer does). On the H200 (docs/perf.md, 2026-12-04 fourth
    session): decode 8 queries 42 -> 31 us, 64: 74 -> 73, 128: 113 -> 109, prefill 8192 4.75 -> 4.68 ms."""
    fp8_linear_split_k: bool = True
    """Decode-sized fp8 dense linears (at most 64 rows: one row tile) split K over programs up to one
    wave of the SMs (fp8_linear.linear_tiling), instead of one program per 128 output columns: q_a_proj
    (2048 outputs) otherwise reads its 12.6 MB through 16 of 132 SMs, o_proj through 48. On the H200
    (docs/perf.md, 2026-12-04 sixth session; GLM-5 slice, 4 layers, fp8, 256 experts): the model step
    at 1 x 8k 3.313 -> 2.912 ms (profiled: the dense linears' kernels 730 -> 422 us a step, o_proj
    51 -> 35 us), at 8 x 2k 3.986 -> 3.697 ms."""
    unroll_layers_max_tokens: int = 16
    """Forwards of at most this many tokens per request (decode, verify, short extends) run their layer
    groups unrolled instead of as a lax.scan (0: always the scan). A deep scan stays a while loop, whose
    body XLA:GPU launches from the host once per iteration; a short one XLA unrolls itself, yet into a
    slower step than the one unrolled here. On the H200
    (docs/perf.md, 2026-12-02 fifth session), with sampling inside the step, a GLM-5-shaped slice's
    engine step took 2.72 ms unrolled vs 3.26 with the scan at b1 8k, and 2.92 vs 3.64 at b8 2k.
    The cost is compile time, which grows with the depth (one decode bucket of a 78-layer model
    compiles every layer's ops); 0 keeps the scan's depth-independent compile."""
    scores_max_bytes: int = 4 << 30
    """The largest score buffer one indexer call may hold (the kernels' [B, T, S] fp32 scores, or the jnp
    composition's [B, T, H, S]): a longer call runs its query tokens in chunks, so a long prefill's
    memory stays bounded. 4 GiB is T = S = 32768 on the kernels."""

    def __post_init__(self):
        if self.fp8_step_blocks not in (1, 2):
            raise ValueError(f"kernel policy: fp8_step_blocks takes 1 or 2, got {self.fp8_step_blocks}")

    @classmethod
    def parse(cls, text: str) -> "KernelPolicy":
        """'field=value,...' (e.g. 'moe_kernel=false,mgpu_min_programs=64') over the defaults; ValueError
        naming an unknown field or a value of the wrong type. 'default' or '' is the default policy."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        over = {}
        for item in filter(None, (t.strip() for t in ("" if text == "default" else text).split(","))):
            name, eq, value = item.partition("=")
            if not eq or name not in fields:
                raise ValueError(f"kernel policy: {item!r} is not field=value with a field of "
                                 f"{', '.join(fields)}")
            if fields[name] in (bool, "bool"):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"kernel policy: {name} takes true or false, got {value!r}")
                over[name] = value.lower() in ("true", "1")
            else:
                try:
                    over[name] = int(value)
                except ValueError:
                    raise ValueError(f"kernel policy: {name} takes an integer, got {value!r}") from None
        return cls(**over)

    def on_gpu(self) -> bool:
        """Whether the Pallas kernels run: enabled, on a GPU backend."""
        return self.enabled and jax.default_backend() == "gpu"


DEFAULT_POLICY = KernelPolicy()
