"""Indexer top-k as Pallas kernels beside their jnp references: selection over a score matrix, and the
indexer's scores computed through the page table (fp8 or plain keys) feeding that selection.

Result convention (reference and kernel alike): per row, the positions of the k largest scores
(k = min(k, visible)), ties broken toward the lower position, listed in ascending position order and
padded with -1. Ascending order makes the result a canonical set (the attention consumes a set) and
keeps the later row gathers in address order.

Selection is a radix select over the order-preserving int32 key of each fp32 score (Pallas has no
sort/top_k lowering): the threshold T (the k-th largest key) is found most significant bits first,
`bits` bits per pass, each pass counting for every row how many keys reach each of the 2**bits
candidate thresholds. Then one pass counts keys above T, and the last pass writes the positions of
keys above T plus the first (k - above) keys equal to T, at offsets given by running prefix sums.
Every pass streams the row (from L2 when the rows fit there); rows with a visible length stop at it.

Both kernels use Pallas's Triton backend: they need masked scatter stores, data-dependent row
gathers through the page table and per-lane compare/prefix-sum work, which Triton expresses directly;
Mosaic GPU's strengths (TMA, wgmma pipelines over dense tiles) fit none of the selection and only the
small per-tile dots of the scores kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG_INF = float("-inf")
INT_MIN = -(2 ** 31)


def order_keys(scores):
    """int32 keys with the order of the fp32 scores (-0.0 and +0.0 equal; -inf the smallest
    non-NaN key)."""
    s = jnp.where(scores == 0, jnp.zeros((), jnp.float32), scores.astype(jnp.float32))
    b = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


NEG_INF_KEY = -2139095041  # order_keys(-inf)


def select_topk_reference(scores, k: int):
    """lax.top_k (stable: ties to the lower position), -inf never selected, then ascending positions
    with -1 padding. scores [..., N] fp32."""
    n = scores.shape[-1]
    scores = jnp.where(scores == 0, jnp.zeros((), scores.dtype), scores)
    vals, idx = jax.lax.top_k(scores, min(k, n))
    idx = jnp.sort(jnp.where(vals == NEG_INF, n, idx), axis=-1)
    idx = jnp.where(idx == n, -1, idx).astype(jnp.int32)
    if k > n:
        idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (k - n,), -1, jnp.int32)], axis=-1)
    return idx


def _select_kernel(len_ref, s_ref, *refs, k: int, rows: int, chunk: int, bits: int, out_chunk: int):
    o_ref = refs[-1]                                           # (refs[0] is the poisoned input, tests)
    row0 = pl.program_id(0) * rows
    row_ids = row0 + jnp.arange(rows, dtype=jnp.int32)
    lengths = len_ref[pl.ds(row0, rows)]                       # [rows] visible columns per row
    n_chunks = (jnp.max(lengths) + chunk - 1) // chunk
    cols = jnp.arange(chunk, dtype=jnp.int32)

    def load_keys(c):
        col = c * chunk + cols
        start = c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk)
        x = s_ref[pl.ds(row0, rows), pl.ds(start, chunk)]
        key = order_keys(x)
        return jnp.where(col[None, :] < lengths[:, None], key, NEG_INF_KEY), col

    single = s_ref.shape[1] == chunk   # the whole row is one chunk: load it once, keep it in registers
    resident = load_keys(0) if single else None

    def keys_at(c):
        return resident if single else load_keys(c)

    def over_chunks(body, init):
        return body(0, init) if single else jax.lax.fori_loop(0, n_chunks, body, init)

    def count_at_least(thresholds):                            # [rows, m] -> [rows, m]
        def body(c, acc):
            key, _ = keys_at(c)
            hits = (key[:, :, None] >= thresholds[:, None, :]).astype(jnp.int32)
            return acc + jnp.sum(hits, axis=1)
        return over_chunks(body, jnp.zeros(thresholds.shape, jnp.int32))

    n_visible = count_at_least(jnp.full((rows, 1), NEG_INF_KEY + 1, jnp.int32))[:, 0]
    k_eff = jnp.minimum(n_visible, k)
    # Threshold search in the unsigned domain (u ^ INT_MIN is the signed key).
    digits = jnp.arange(2 ** bits, dtype=jnp.int32)
    u = jnp.zeros((rows,), jnp.int32)
    for p in range(32 // bits):
        shift = 32 - bits * (p + 1)
        cand = (u[:, None] | (digits[None, :] << shift)) ^ INT_MIN
        ok = count_at_least(cand) >= k_eff[:, None]            # a prefix of the digits
        u = u | ((jnp.sum(ok.astype(jnp.int32), axis=1) - 1) << shift)
    threshold = u ^ INT_MIN
    above = count_at_least(jnp.where(threshold == 2 ** 31 - 1, threshold, threshold + 1)[:, None])[:, 0]
    above = jnp.where(threshold == 2 ** 31 - 1, 0, above)
    need_equal = k_eff - above

    def emit(c, carry):
        n_sel, n_eq = carry
        key, col = keys_at(c)
        gt = key > threshold[:, None]
        eq = key == threshold[:, None]
        eq_rank = n_eq[:, None] + jnp.cumsum(eq.astype(jnp.int32), axis=1) - 1
        sel = (gt | (eq & (eq_rank < need_equal[:, None]))) & (k_eff[:, None] > 0)
        pos = n_sel[:, None] + jnp.cumsum(sel.astype(jnp.int32), axis=1) - 1
        pos = jnp.where(sel, pos, o_ref.shape[1] - 1)          # the trash column (never read back)
        r = jnp.broadcast_to(row_ids[:, None], pos.shape)
        plt.store(o_ref.at[r, pos], jnp.broadcast_to(col[None, :], pos.shape), mask=sel)
        return n_sel + jnp.sum(sel.astype(jnp.int32), axis=1), n_eq + jnp.sum(eq.astype(jnp.int32), axis=1)

    over_chunks(emit, (jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32)))

    out_cols = jnp.arange(out_chunk, dtype=jnp.int32)

    def pad(c, _):
        col = c * out_chunk + out_cols
        plt.store(o_ref.at[pl.ds(row0, rows), pl.ds(pl.multiple_of(c * out_chunk, out_chunk), out_chunk)],
                  jnp.full((rows, out_chunk), -1, jnp.int32), mask=col[None, :] >= k_eff[:, None])
        return 0

    jax.lax.fori_loop(0, (k + out_chunk - 1) // out_chunk, pad, 0)


def _pad_to(x, axis: int, multiple: int, value):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _call(kernel, grid, args, out_shape, poison, num_warps: int, num_stages: int, interpret: bool):
    """pallas_call with every operand left in HBM (the kernels index it themselves). `poison` (tests):
    the output buffer starts filled with it (an extra input aliased to the output), so an element the
    kernel fails to write shows."""
    aliases = {}
    if poison is not None:
        aliases = {len(args): 0}
        args = list(args) + [jnp.full(out_shape.shape, poison, out_shape.dtype)]
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(args),
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)


def select_topk_pallas(scores, k: int, lengths=None, *, rows: int = 1, chunk: int = 4096, bits: int = 4,
                       num_warps: int = 16, num_stages: int = 1, interpret: bool = False,
                       poison: int | None = None):
    """scores [..., N] fp32; lengths [...] (optional): columns at or past a row's length are not
    visible (as if -inf). Returns [..., k] int32 in the module's convention. `poison` (tests): the
    output buffer starts filled with it, so an element the kernel fails to write shows."""
    if 32 % bits:
        raise ValueError(f"bits per pass must divide 32, got {bits}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    s = scores.reshape(-1, n).astype(jnp.float32)
    r = s.shape[0]
    ln = jnp.full((r,), n, jnp.int32) if lengths is None else jnp.minimum(lengths.reshape(-1), n).astype(jnp.int32)
    chunk = min(chunk, pl.next_power_of_2(n))
    s = _pad_to(_pad_to(s, 1, chunk, NEG_INF), 0, rows, NEG_INF)
    ln = _pad_to(ln, 0, rows, 0)
    out_chunk = min(1024, pl.next_power_of_2(k))
    k_pad = -(-k // out_chunk) * out_chunk
    out = _call(functools.partial(_select_kernel, k=k, rows=rows, chunk=chunk, bits=bits, out_chunk=out_chunk),
                (s.shape[0] // rows,), [ln, s], jax.ShapeDtypeStruct((s.shape[0], k_pad + 1), jnp.int32), poison,
                num_warps, num_stages, interpret)
    return out[:r, :k].reshape(lead + (k,))


def index_scores_reference(q, w, keys, positions, head_dim: int):
    """The lightning indexer's scores (HF order of operations): q [B, T, H, D], w [B, T, H] (already
    scaled by H**-0.5), keys [B, S, D] fp32 (dequantized), positions [B, T] (-1 = padding lane).
    Key j is visible to (b, t) iff j <= positions[b, t]; invisible scores are -inf."""
    scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys) * head_dim ** -0.5
    scores = jax.nn.relu(scores)
    index_scores = jnp.einsum("bth,bths->bts", w, scores)
    visible = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    return jnp.where(visible, index_scores, NEG_INF)


def _scores_kernel(layer_ref, q_ref, w_ref, pos_ref, table_ref, k_ref, *rest, heads: int, block_t: int,
                   block_n: int, fp8: bool, head_dim: int):
    """One (request, query block, key block) tile. The query block's heads are the dot's rows
    ([block_t * H, D] x [D, block_n]), so a single decode token still fills an MMA tile."""
    scale_ref, o_ref = (rest[0] if fp8 else None), rest[-1]
    b, it, jn = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    t0, n0 = it * block_t, jn * block_n
    pos = pos_ref[b, pl.ds(t0, block_t)]                       # [bt]
    cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
    out = o_ref.at[b, pl.ds(t0, block_t), pl.ds(n0, block_n)]

    @pl.when(n0 > jnp.max(pos))                                # causal: nothing visible in this tile
    def _():
        out[...] = jnp.full((block_t, block_n), NEG_INF, jnp.float32)

    @pl.when(n0 <= jnp.max(pos))
    def _():
        slots = table_ref[b, pl.ds(n0, block_n)]              # [bn] pool slots of these positions
        d = jnp.arange(head_dim, dtype=jnp.int32)
        keys = k_ref[layer, slots[:, None], d[None, :]]       # [bn, D] gathered through the page table
        dot_dtype = jnp.float32 if q_ref.dtype == jnp.float32 else jnp.bfloat16
        precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None  # fp32: no tf32
        q = q_ref[b, pl.ds(t0 * heads, block_t * heads), :].astype(dot_dtype)   # [bt * H, D]
        s = jnp.dot(q, keys.astype(dot_dtype).T, precision=precision, preferred_element_type=jnp.float32)
        if fp8:
            s = s * scale_ref[layer, slots][None, :]
        s = jnp.maximum(s * head_dim ** -0.5, 0.0).reshape(block_t, heads, block_n)
        w = w_ref[b, pl.ds(t0, block_t), :]                   # [bt, H] fp32
        acc = jnp.sum(w[:, :, None] * s, axis=1)
        out[...] = jnp.where(cols[None, :] <= pos[:, None], acc, NEG_INF)


def index_scores_pallas(q, w, index_k, index_scale, layer, slot_table, positions, *, block_m: int = 128,
                        block_n: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                        poison: float | None = None):
    """The indexer's scores with the keys read through the page table inside the kernel (no gathered
    key copy, no [B, T, H, S] per-head intermediate). q [B, T, H, D]; w [B, T, H] fp32; index_k
    [L, slots, D] (fp8 with index_scale [L, slots], or plain with index_scale None), read at `layer`
    (the stacked pool is passed whole: slicing a layer out would copy it); slot_table [B, S];
    positions [B, T]. Returns [B, T, S] fp32 with -inf where invisible. block_m: query rows x heads
    per tile."""
    B, T, H, D = q.shape
    S = slot_table.shape[1]
    block_t = max(-(-16 // H), min(block_m // H, pl.next_power_of_2(T)))  # a dot needs >= 16 rows
    block_n = min(block_n, max(16, pl.next_power_of_2(S)))
    q = _pad_to(q, 1, block_t, 0)
    Tp = q.shape[1]
    q = q.reshape(B, Tp * H, D)
    w = _pad_to(w.astype(jnp.float32), 1, block_t, 0)
    pos = _pad_to(positions.astype(jnp.int32), 1, block_t, -1)
    table = _pad_to(slot_table.astype(jnp.int32), 1, block_n, 0)
    fp8 = index_scale is not None
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    out = _call(functools.partial(_scores_kernel, heads=H, block_t=block_t, block_n=block_n, fp8=fp8, head_dim=D),
                (B, Tp // block_t, table.shape[1] // block_n),
                [layer, q, w, pos, table, index_k] + ([index_scale] if fp8 else []),
                jax.ShapeDtypeStruct((B, Tp, table.shape[1]), jnp.float32), poison, num_warps, num_stages, interpret)
    return out[:, :T, :S]


KERNELS_ENABLED = True  # read at trace time; tests flip it (and clear jit caches) to compare on/off


def _on_gpu() -> bool:
    return KERNELS_ENABLED and jax.default_backend() == "gpu"


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


# One program per row: with fewer rows than this the kernel leaves most of the H200's 132 SMs idle
# and lax.top_k is faster (measured: 8 rows x 131072 took 0.49 ms in the kernel; see docs/perf.md).
MIN_KERNEL_ROWS = 64


def select_tiling(width: int) -> dict:
    """Measured on the H200 (docs/perf.md): rows up to 8192 stay in registers as one chunk with
    2-bit passes (4 candidate counts per element keep the compare tensor small enough not to
    spill); wider rows stream 4096-column chunks with 4-bit passes."""
    if width <= 8192:
        return {"bits": 2, "chunk": 8192, "num_warps": 16, "num_stages": 1}
    return {"bits": 4, "chunk": 4096, "num_warps": 16, "num_stages": 3}


def select_topk(scores, k: int, lengths=None):
    """The dispatch for selection over a given score matrix."""
    if _on_gpu() and scores.size // scores.shape[-1] >= MIN_KERNEL_ROWS:
        return select_topk_pallas(scores, k, lengths, **select_tiling(scores.shape[-1]))
    if lengths is not None:
        cols = jnp.arange(scores.shape[-1], dtype=jnp.int32)
        scores = jnp.where(cols < lengths[..., None], scores, NEG_INF)
    return select_topk_reference(scores, k)


def indexer_topk(q, w, index_k, index_scale, layer, slot_table, positions, k: int):
    """The dispatch for the whole indexer selection on one device: kernels on GPU (scores through the
    page table, then selection over each row's visible length), the jnp composition elsewhere."""
    if _on_gpu() and _pow2(q.shape[-1]) and _pow2(q.shape[-2]):  # Triton tiles: power-of-two dims
        scores = index_scores_pallas(q, w, index_k, index_scale, layer, slot_table, positions)
        return select_topk(scores, k, positions + 1)
    keys = index_k[layer][slot_table].astype(jnp.float32)
    if index_scale is not None:
        keys = keys * index_scale[layer][slot_table][..., None]
    return select_topk_reference(index_scores_reference(q, w, keys, positions, q.shape[-1]), k)
