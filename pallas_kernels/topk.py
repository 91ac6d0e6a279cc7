"""Indexer top-k as Pallas kernels beside their jnp references: selection over a score matrix, and the
indexer's scores computed through the page table (fp8 or plain keys) feeding that selection.

Queries are bf16 or fp32, or fp8 with a scale per token and head (q_scale): those are widened exactly
(to bf16; fp32 over fp32 keys) and the scale is folded into the head weights before any kernel
(fold_query_scale), so every kernel sees plain queries.

Result convention (reference and kernel alike): per row, the positions of the k largest scores
(k = min(k, visible)), ties broken toward the lower position, listed in ascending position order and
padded with -1. Ascending order makes the result a canonical set (the attention consumes a set) and
keeps the later row gathers in address order.

Selection (Pallas has no sort/top_k lowering) works on the order-preserving int32 key of each fp32
score and needs only the threshold T, the k-th largest key, and how many keys equal to T to take:
  1. a bracket [lo, hi) for T from a sample of the row (blocks of 16 columns spread over it; the
     sample's digit search stops once the bracket is tight);
  2. one pass over the row counts the visible keys and those past the search's starting bucket (the
     digits lo and hi - 1 share), and keeps the keys >= lo with their columns, in column order (the
     candidates: at most `capacity`, k plus the margin), as interleaved (key, column) pairs so one
     masked store writes both (two stores took 75 µs more of the 2048 x 32768 filter pass's 250);
  3. an exact digit search (`bits` per pass, only below the bits lo and hi - 1 share) among the
     candidates gives T; when the bracket missed (counts say so) the same search runs over the row;
  4. a pass over the candidates writes the positions of keys above T and of the first keys equal
     to T, at offsets given by running prefix sums (over the row when the candidates are not complete).
  With a row's columns over several programs, a row whose candidates fit `held_cands` does 3-4 in
  one program from registers: its candidates gathered once, the search one bit per pass stopping as
  soon as exactly k keys reach the prefix; counting them in HBM pass after pass cost a dependent load
  per block and pass.
So a row is read once plus a sample when the bracket holds (3-sigma margins on the sampled ranks);
when it misses, the full search (8 counting passes over the row) keeps the result exact.
Two calls, (1-2) and (3-4), each over (rows, segments): with few rows a row's columns are split over
several programs, whose counts the second call combines. Each row reports its path (PATHS) so tests
and benchmarks see it. Rows of up to RESIDENT_MAX_WIDTH columns (all up to 8192, and up to 16384 while
there are at most 512 rows) take one call instead (_resident_row_kernel): the row stays in registers,
the threshold is searched one bit per pass over it, stopping as soon as exactly k keys are above the
prefix, and the positions are emitted from the same registers; on the H200 that halves the two-call
time at 64 x 8192 (docs/perf.md).

The fused indexer (indexer_topk_fused) never writes the [T, S] scores: the scores of a sample of the
columns give each row's bracket, the scores kernel itself keeps the keys >= lo (the same column-ordered
candidates as step 2), and the selection's second call finishes from them; rows whose bracket missed
are redone the unfused way. It is not the dispatch's choice (USE_FUSED): on the H200 the candidates
kept inside the scores loop cost more than writing the scores and reading them back (docs/perf.md).

Both kernels use Pallas's Triton backend: they need masked scatter stores, data-dependent row
gathers through the page table and per-lane compare/prefix-sum work, which Triton expresses directly;
Mosaic GPU's strengths (TMA, wgmma pipelines over dense tiles) fit none of the selection. The scores
kernel's prefill path (keys gathered once into a dense copy) fits them: there Triton's pipelined loop
runs at 59% of the bf16 matmul rate on the H200, its per-block head sum waiting on each wgmma, and
scores_mgpu.py's warp-specialized Mosaic GPU kernel at 74-78%. The dispatch runs that one for calls
that gather their keys and have enough programs (USE_MGPU_SCORES, MGPU_MIN_PROGRAMS); for short
calls (decode) over a table the caller says is made of whole 64-slot blocks (contiguous_blocks), its
paged mode, which reads the pool's fp8 keys by TMA (USE_MGPU_PAGED); and this module's Triton
kernel for the rest, which reads the keys through the page table row by row (TMA has no row gather
on Hopper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from models.kv import dequantize_index_k
from pallas_kernels import scores_mgpu

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


PATHS = ("all visible", "sampled bracket", "full search")  # per-row path ids the kernel reports
_VIS, _PAST, _CAND, _LO_KEY, _HI_KEY = range(5)           # the per-segment record the first call writes


class _Row:
    """The keys of one score row as the selection sees them: order keys, -inf past the row's length,
    in chunks; the digit search over any set of keys; small-vector helpers Triton lacks."""

    def __init__(self, len_ref, s_ref, row, chunk: int, bits: int, width: int | None = None):
        """s_ref None (the fused indexer: no score rows in HBM): only the search helpers, over
        rows of `width` columns."""
        self.s_ref, self.row, self.chunk, self.bits = s_ref, row, chunk, bits
        self.length = jnp.minimum(len_ref[row], s_ref.shape[1] if width is None else width)
        self.n_chunks = (self.length + chunk - 1) // chunk

    def segment(self, seg, seg_chunks: int):
        """The chunk range [first, last) of segment seg."""
        first = seg * seg_chunks
        return first, jnp.minimum(first + seg_chunks, self.n_chunks)

    def keys(self, c):
        start = pl.multiple_of(c * self.chunk, self.chunk)
        key = order_keys(self.s_ref[self.row, pl.ds(start, self.chunk)])
        col = start + jnp.arange(self.chunk, dtype=jnp.int32)
        return jnp.where(col < self.length, key, NEG_INF_KEY), col

    @staticmethod
    def pick(v, i):                                             # v[i] of a small vector (no slicing in Triton)
        return jnp.sum(jnp.where(jnp.arange(v.shape[0]) == i, v, 0))

    @staticmethod
    def count_held(blocks, n_pad):
        """count_ge over keys held in registers (a list of blocks), n_pad of them INT_MIN padding, not
        counted (only the threshold INT_MIN would count them). Block by block: one compare of all the
        keys against every threshold would be [keys, m, 2**bits] registers, and their spills slow the
        whole kernel."""
        def count(thresholds):
            counts = sum(jnp.sum((b[:, None, None] >= thresholds[None]).astype(jnp.int32), axis=0) for b in blocks)
            return counts - jnp.where(thresholds == INT_MIN, n_pad, 0)
        return count

    @staticmethod
    def count_ge(load, n, thresholds):
        """For each threshold [m, 2**bits], how many keys of the n loaded blocks reach it."""
        def body(i, acc):
            key = load(i)
            return acc + jnp.sum((key[:, None, None] >= thresholds[None]).astype(jnp.int32), axis=0)
        return jax.lax.fori_loop(0, n, body, jnp.zeros(thresholds.shape, jnp.int32))

    def search(self, count, ranks, u, p0, tight=None, past=None, bits=None):
        """Digit search, most significant first, for the ranks-th largest keys ([m] ranks). u: the
        unsigned-domain prefix fixed above pass p0; past: the count of keys past u's bucket (none by
        default); bits: digits per pass (the row's by default). Returns (u, count >= u's key,
        count >= the end of u's bucket, bucket shift): after all passes u ^ INT_MIN is the key itself."""
        bits = bits or self.bits
        digits = jnp.arange(2 ** bits, dtype=jnp.int32)

        def body(st):
            p, u, _, upper, shift, _ = st
            shift = 32 - bits * (p + 1)
            counts = count((u[:, None] | (digits[None, :] << shift)) ^ INT_MIN)    # [m, 2**bits]
            d = jnp.sum((counts >= ranks[:, None]).astype(jnp.int32), axis=1) - 1  # a prefix of digits
            n_at = jnp.sum(jnp.where(digits[None, :] == d[:, None], counts, 0), axis=1)
            nxt = jnp.sum(jnp.where(digits[None, :] == d[:, None] + 1, counts, 0), axis=1)
            upper = jnp.where(d == 2 ** bits - 1, upper, nxt)
            u = u | (d << shift)
            # (never a literal: Triton's regions cannot yield one)
            done = tight(u, n_at, upper, shift) if tight is not None else shift < 0
            return p + 1, u, n_at, upper, shift, done

        zeros = jnp.zeros(ranks.shape, jnp.int32)
        p0 = jnp.asarray(p0, jnp.int32)
        st = (p0, u, zeros, zeros if past is None else past, 32 - bits * p0, jnp.zeros((), jnp.bool_))
        st = jax.lax.while_loop(lambda st: (st[0] < 32 // bits) & ~st[5], body, st)
        return st[1:5]


def sample_size(length, sample: int, sub: int):
    """Keys a row's bracket is estimated from: at most `sample` and half the row, whole `sub` blocks."""
    return jnp.minimum(sample, (length // 2) // sub * sub)


def sample_block_start(b, length, n_blocks):
    """First column of sample block b of n_blocks (16 columns each, spread evenly over the row)."""
    return (b * length // jnp.maximum(n_blocks, 1)) // 16 * 16


def _bucket_is_top(u, shift):
    """Whether u's bucket of 2**shift unsigned-domain values is the last one (nothing past it)."""
    return (u | ((1 << shift) - 1)) == -1


def _bucket_end_key(u, shift):
    """The first key past u's bucket of 2**shift unsigned-domain values (INT_MAX at the top)."""
    return jnp.where(_bucket_is_top(u, shift), 2 ** 31 - 1, (u + (1 << shift)) ^ INT_MIN)


def _search_start(lo, hi, bits: int):
    """Where the digit search for a threshold in [lo, hi) starts: the passes p0 whose digits lo and
    hi - 1 share, the unsigned-domain prefix u0 they fix, and the first key past u0's bucket with
    whether nothing is past it (the bucket ends at the top)."""
    p0 = jax.lax.clz(lo ^ (hi - 1)) // bits
    low_bits = jnp.minimum(32 - bits * p0, 31)                  # (p0 = 0: the whole range; no shift by 32)
    u0 = jnp.where(p0 == 0, 0, ((lo ^ INT_MIN) >> low_bits) << low_bits)
    return p0, u0, _bucket_end_key(u0, low_bits), (p0 == 0) | _bucket_is_top(u0, low_bits)


def _sampled_bracket(r, sample_keys, n_blocks, n_sample, length, k: int):
    """[lo, hi) meant to hold the k-th largest of a row's `length` keys (and about k plus a 3-sigma
    margin of keys >= lo), from n_sample of them spread evenly over the row: sample_keys(i) is block
    i of n_blocks (INT_MIN past the sample). The digit search stops once
    the bracket is tight."""
    expect = k * n_sample.astype(jnp.float32) / length.astype(jnp.float32)
    margin = 3.0 * jnp.sqrt(expect) + 3.0
    r_hi = jnp.floor(expect - margin).astype(jnp.int32)
    r_lo = jnp.minimum(jnp.ceil(expect + margin).astype(jnp.int32), n_sample)
    ranks = jnp.where(jnp.arange(2) == 0, jnp.maximum(r_hi, 1), r_lo)
    spread = (3 * (r_lo - r_hi)) // 2 + 2

    def tight(u, n_at, upper, shift):
        return r.pick(n_at, 1) - jnp.where(r_hi < 1, 0, r.pick(upper, 0)) <= spread

    u, _, _, shift = r.search(lambda t: r.count_ge(sample_keys, n_blocks, t), ranks,
                              jnp.zeros((2,), jnp.int32), 0, tight)
    hi = jnp.where(r_hi < 1, 2 ** 31 - 1, _bucket_end_key(r.pick(u, 0), shift))
    return r.pick(u, 1) ^ INT_MIN, hi


def _keep_candidates(key, col, lo, end, top, n_cand, n_past, capacity: int, store):
    """The filter step the selection and the fused indexer share, over axis 0 of key (a chunk of one
    row, or [keys, tokens] with lo, end, top, n_cand, n_past per token): keep the keys >= lo as
    (key, column) pairs at the running offsets n_cand, in column order (none past `capacity`), and
    count the keys past the threshold search's starting bucket (from _search_start: end, top). One
    masked store of the pairs, store(index, pair, mask): two separate stores cost more (docs/perf.md)."""
    inside = key >= lo
    at = n_cand + jnp.cumsum(inside.astype(jnp.int32), axis=0) - 1
    keep = inside & (at < capacity)
    at = jnp.where(keep, at, capacity)                          # (a trash column)
    key_or_col = jnp.arange(2, dtype=jnp.int32).reshape((1,) * key.ndim + (2,))
    pair = jnp.where(key_or_col == 0, key[..., None], jnp.broadcast_to(col, key.shape)[..., None])
    store((at[..., None], key_or_col), pair, keep[..., None])
    return (n_cand + jnp.sum(inside.astype(jnp.int32), axis=0),
            n_past + jnp.where(top, 0, jnp.sum((key >= end).astype(jnp.int32), axis=0)))


TAKE_ALL = (NEG_INF_KEY + 1, 2 ** 31 - 1)   # the bracket of a row of at most `capacity` keys: keep them all


def _bracket_filter_kernel(len_ref, s_ref, rec_ref, cand_ref, *, k: int, chunk: int, bits: int,
                           capacity: int, sample: int, sub: int, seg_chunks: int, stop_after: int | None):
    """Program (row, segment). 1. A bracket [lo, hi) meant to hold the row's k-th largest key and at
    most `capacity` keys, from a sample of the whole row (blocks of 16 contiguous columns spread over
    it; every segment of the row computes the same one). Rows of at most `capacity` take all keys.
    2. One pass over the segment's columns: count the visible keys and those past the bucket the
    threshold search starts from (_search_start), and keep the keys >= lo with their columns, in
    column order, as (key, column) pairs in cand_ref [rows, segments, capacity + 1, 2] (all the
    row's selected keys when the bracket holds, so the emit pass reads them instead of the row)."""
    r = _Row(len_ref, s_ref, pl.program_id(0), chunk, bits)
    row, seg, length = r.row, pl.program_id(1), r.length
    n_sample = sample_size(length, sample, sub)

    def sample_keys(i):
        e = i * sub + jnp.arange(sub, dtype=jnp.int32)
        return order_keys(s_ref[row, sample_block_start(e // 16, length, n_sample // 16) + e % 16])

    def sampled_bracket():
        # (read per pass: the sample held in registers measured 3x slower on the H200, docs/perf.md)
        return _sampled_bracket(r, sample_keys, n_sample // sub, n_sample, length, k)

    lo, hi = jax.lax.cond(length > capacity, sampled_bracket, lambda: (length * 0 + TAKE_ALL[0], length * 0 + TAKE_ALL[1]))
    rec_ref[row, seg, _LO_KEY] = lo
    rec_ref[row, seg, _HI_KEY] = hi
    if stop_after == 1:                                         # (timing a prefix of the stages)
        return

    _, _, end, top = _search_start(lo, hi, bits)

    def filter_chunk(c, carry):
        n_vis, n_past, n_cand = carry
        key, col = r.keys(c)
        n_cand, n_past = _keep_candidates(key, col, lo, end, top, n_cand, n_past, capacity,
                                          lambda at, pair, keep: plt.store(cand_ref.at[row, seg, at[0], at[1]],
                                                                           pair, mask=keep))
        return n_vis + jnp.sum((key > NEG_INF_KEY).astype(jnp.int32)), n_past, n_cand

    zero = jnp.int32(0)
    n_vis, n_past, n_cand = jax.lax.fori_loop(*r.segment(seg, seg_chunks), filter_chunk, (zero, zero, zero))
    rec_ref[row, seg, _VIS] = n_vis
    rec_ref[row, seg, _PAST] = n_past
    rec_ref[row, seg, _CAND] = n_cand


def _threshold_emit_kernel(len_ref, s_ref, rec_ref, cand_ref, *refs, k: int, chunk: int, bits: int,
                           capacity: int, sub: int, segs: int, seg_chunks: int, out_chunk: int,
                           stop_after: int | None, width: int | None = None, held_cands: int = 0,
                           held_bits: int = 1):
    """Program (row, segment). 3. The threshold key T (the row's k-th largest) and how many keys equal
    to T to take: an exact digit search among all segments' candidates when the bracket held, else
    over the whole row. 4. The segment's selected positions (keys above T, and equal ones in position
    order while the quota lasts), written after those of the segments before it: from its candidates
    when they hold every key the row selects (T >= lo, none dropped), else from its columns.
    s_ref None (the fused indexer: rows of `width` columns, not in HBM): a row whose bracket missed
    or whose candidates are incomplete is only reported (path 2), for the caller to redo.
    held_cands (a multiple of sub; refs[0] is then cand_ref flattened to [rows, segs * (capacity + 1) * 2]):
    a row whose bracket held with at most held_cands candidates over all its segments is finished by
    its segment-0 program alone, from registers (finish_held); its other programs do nothing.
    Counting candidates in HBM costs a dependent load per block and pass, which bounds these programs'
    time at few rows (docs/perf.md)."""
    o_ref, path_ref = refs[-2:]                                 # (the poisoned input before them, tests)
    flat_ref = refs[0] if held_cands else None
    r = _Row(len_ref, s_ref, pl.program_id(0), chunk, bits, width)
    rows_in_hbm = s_ref is not None
    assert rows_in_hbm or segs == 1, "without score rows a row is one segment"
    row, seg = r.row, pl.program_id(1)
    at_segs = jnp.arange(segs, dtype=jnp.int32)
    vis_s, past_s, cand_s = (rec_ref[row, at_segs, f] for f in (_VIS, _PAST, _CAND))   # [segs] each
    lo, hi = rec_ref[row, 0, _LO_KEY], rec_ref[row, 0, _HI_KEY]
    n_vis, n_past, n_cand = jnp.sum(vis_s), jnp.sum(past_s), jnp.sum(cand_s)
    k_eff = jnp.minimum(n_vis, k)

    def seg_cands(i, n, with_cols=False):
        """The loader of segment i's candidates (n of them), sub at a time; INT_MIN past n. with_cols:
        (keys, columns)."""
        def load(j):
            at = j * sub + jnp.arange(sub, dtype=jnp.int32)
            block = pl.ds(pl.multiple_of(j * sub, sub), sub)
            key = jnp.where(at < n, cand_ref[row, i, block, 0], INT_MIN)
            return (key, cand_ref[row, i, block, 1]) if with_cols else key
        return load

    def count_candidates(t):
        n = [r.pick(cand_s, i) for i in range(segs)]
        return sum(r.count_ge(seg_cands(i, n[i]), (n[i] + sub - 1) // sub, t) for i in range(segs))

    def take_all():
        return n_vis * 0 + NEG_INF_KEY, n_vis

    def from_candidates():
        # T is in [lo, end): the search fixes only the digits below the bucket u0 (lo and hi - 1 share
        # its digits), and n_past keys are past it. Every candidate is >= lo and T >= lo: a count of
        # candidates >= t is the row's for t > lo and at least k_eff below, so the search picks the row's
        # digits.
        p0, u0, _, _ = _search_start(lo, hi, bits)
        u, _, upper, _ = r.search(count_candidates, jnp.full((1,), k_eff), jnp.full((1,), u0), p0,
                                  past=jnp.full((1,), n_past))
        return r.pick(u, 0) ^ INT_MIN, r.pick(upper, 0)

    def over_row():
        u, _, upper, _ = r.search(lambda t: r.count_ge(lambda c: r.keys(c)[0], r.n_chunks, t),
                                  jnp.full((1,), k_eff), jnp.zeros((1,), jnp.int32), 0)
        return r.pick(u, 0) ^ INT_MIN, r.pick(upper, 0)

    cands_complete = (n_cand >= k_eff) & (jnp.max(cand_s) <= capacity)   # every selected key is a candidate
    held = (n_past < k_eff) & cands_complete
    path = (n_vis > k).astype(jnp.int32) * (2 - held.astype(jnp.int32))   # (no where of two literals:
    # Pallas Triton lowers that to a bool)

    @pl.when(seg == 0)
    def _():
        path_ref[row] = path

    def emit_block(key, col, carry, threshold, quota):
        n_sel, n_eq = carry
        eq = (key == threshold).astype(jnp.int32)
        n_eq_here = jnp.sum(eq)
        # Equal keys are taken in position order up to the quota: only the block where it runs out
        # needs their ranks (a prefix sum); before it all are taken, after it none.
        quota_ends_here = (n_eq < quota) & (n_eq + n_eq_here > quota)
        take_eq = jax.lax.cond(quota_ends_here, lambda: jnp.where(n_eq + jnp.cumsum(eq) - 1 < quota, eq, 0),
                               lambda: eq * (n_eq < quota).astype(jnp.int32))
        sel = ((key > threshold) | (take_eq > 0)) & (key > NEG_INF_KEY)
        at = n_sel + jnp.cumsum(sel.astype(jnp.int32)) - 1
        plt.store(o_ref.at[row, jnp.where(sel, at, o_ref.shape[1] - 1)], col, mask=sel)
        return n_sel + jnp.sum(sel.astype(jnp.int32)), n_eq + n_eq_here

    def finish_held():
        """The row from its candidates held in registers: gathered once, segment after segment (so in
        column order); the threshold searched held_bits per pass among them from the digits lo and
        hi - 1 share, stopping as soon as exactly k_eff reach the prefix (the prefix then serves as
        the threshold, as in _resident_row_kernel); the positions written by one prefix sum."""
        ends = []
        for i in range(segs - 1):
            ends.append(r.pick(cand_s, i) + (ends[-1] if ends else 0))

        def block(b):
            j = b * sub + jnp.arange(sub, dtype=jnp.int32)
            seg_of, first = jnp.zeros_like(j), jnp.zeros_like(j)
            for end in ends:
                later = j >= end
                seg_of, first = seg_of + later.astype(jnp.int32), jnp.where(later, end, first)
            valid = j < n_cand
            at = jnp.where(valid, (seg_of * (capacity + 1) + j - first) * 2, 0)
            return jnp.where(valid, flat_ref[row, at], INT_MIN), flat_ref[row, at + 1]
        keys, cols = zip(*[block(b) for b in range(held_cands // sub)])
        # (from the bucket of the `bits` digits lo and hi - 1 share: held says T is below its end, not
        # below hi, so a finer bucket of held_bits digits might miss T)
        p0, u0, _, _ = _search_start(lo, hi, bits)
        u, _, _, _ = r.search(r.count_held(keys, held_cands - n_cand), jnp.full((1,), k_eff), jnp.full((1,), u0),
                              p0 * (bits // held_bits), tight=lambda u, n_at, upper, shift: r.pick(n_at, 0) == k_eff,
                              bits=held_bits)
        threshold = r.pick(u, 0) ^ INT_MIN
        need_equal = k_eff - sum(jnp.sum((key > threshold).astype(jnp.int32)) for key in keys)
        if stop_after == 3:                                     # (timing a prefix of the stages)
            path_ref[row] = threshold ^ need_equal
            return
        carry = (jnp.int32(0), jnp.int32(0))
        for key, col in zip(keys, cols):
            carry = emit_block(key, col, carry, threshold, need_equal)
        _pad_positions(o_ref, row, k_eff, k, out_chunk)

    def finish_in_segments():
        """Each segment's program: the threshold from the candidates in HBM (or the row), then the
        segment's positions after those of the segments before it."""
        threshold, n_above = jax.lax.cond(path == 0, take_all, lambda: jax.lax.cond(
            path == 1, from_candidates,
            over_row if rows_in_hbm else lambda: (n_vis * 0 + (2 ** 31 - 1), n_vis * 0)))
        need_equal = k_eff - n_above
        if stop_after == 3:                                     # (timing a prefix of the stages)
            path_ref[row] = threshold ^ need_equal
            return

        # Where this segment's positions start and how many of its keys equal to T it takes: the
        # counts above and at T of the segments before it (from their candidates, or their columns
        # when those are not complete).
        start, quota = jnp.int32(0), need_equal
        if segs > 1:
            def above_equal(load, first, last):
                """How many of the loaded blocks' keys are above T and equal to T."""
                def body(j, acc):
                    key = load(j)
                    return (acc[0] + jnp.sum((key > threshold).astype(jnp.int32)),
                            acc[1] + jnp.sum((key == threshold).astype(jnp.int32)))
                return jax.lax.fori_loop(first, last, body, (jnp.int32(0), jnp.int32(0)))

            def above_equal_of_candidates(i):
                n = r.pick(cand_s, i)
                return above_equal(seg_cands(i, n), 0, (n + sub - 1) // sub)

            def above_equal_of_columns(i):
                return above_equal(lambda c: r.keys(c)[0], *r.segment(i, seg_chunks))

            equal_before = jnp.int32(0)
            for i in range(segs - 1):
                gt, eq = jax.lax.cond(cands_complete, lambda i=i: above_equal_of_candidates(i),
                                      lambda i=i: above_equal_of_columns(i))
                taken = jnp.clip(need_equal - equal_before, 0, eq)
                before = i < seg
                start = start + jnp.where(before, gt + taken, 0)
                equal_before = equal_before + jnp.where(before, eq, 0)
            quota = jnp.maximum(need_equal - equal_before, 0)

        def emit(load):
            def body(j, carry):
                return emit_block(*load(j), carry, threshold, quota)
            return body

        @pl.when(cands_complete if rows_in_hbm else cands_complete & (path != 2))
        def _():
            n = r.pick(cand_s, seg)
            jax.lax.fori_loop(0, (n + sub - 1) // sub, emit(seg_cands(seg, n, with_cols=True)),
                              (start, jnp.int32(0)))

        if rows_in_hbm:
            @pl.when(~cands_complete)
            def _():
                jax.lax.fori_loop(*r.segment(seg, seg_chunks), emit(r.keys), (start, jnp.int32(0)))

        @pl.when(seg == 0)
        def _():
            _pad_positions(o_ref, row, k_eff, k, out_chunk)

    if held_cands:
        fits = (path == 1) & (n_cand <= held_cands)
        pl.when(fits & (seg == 0))(finish_held)
        pl.when(~fits)(finish_in_segments)
    else:
        finish_in_segments()


def _pad_positions(o_ref, row, k_eff, k: int, out_chunk: int):
    """-1 in o_ref[row, k_eff:k], out_chunk at a time."""
    out_cols = jnp.arange(out_chunk, dtype=jnp.int32)

    def pad(c, carry):
        at = pl.multiple_of(c * out_chunk, out_chunk)
        plt.store(o_ref.at[row, pl.ds(at, out_chunk)], jnp.full((out_chunk,), -1, jnp.int32),
                  mask=at + out_cols >= k_eff)
        return carry

    jax.lax.fori_loop(0, (k + out_chunk - 1) // out_chunk, pad, jnp.int32(0))


def _resident_row_kernel(len_ref, s_ref, *refs, k: int, bits: int, out_chunk: int):
    """Program (row) for rows short enough to stay in registers (s_ref [rows, width], width a power
    of two): the row is read once, the threshold (the k-th largest key) is built `bits` at a time from
    the top, each pass one count of the resident keys against all its digits at once, and the positions
    are written from them: one call, no candidates buffer, no sample. The search stops as soon as
    exactly k keys reach the prefix fixed so far (they are the selection: the prefix with its lower
    bits zero serves as the threshold); only ties at the threshold need all 32 bits. Path 0 (all
    visible) or 2 (searched)."""
    o_ref, path_ref = refs[-2:]                                 # (refs[0] is the poisoned input, tests)
    r = _Row(len_ref, s_ref, pl.program_id(0), s_ref.shape[1], bits)
    row = r.row
    col = jnp.arange(s_ref.shape[1], dtype=jnp.int32)
    key = jnp.where(col < r.length, order_keys(s_ref[row, :]), NEG_INF_KEY)
    n_vis = jnp.sum((key > NEG_INF_KEY).astype(jnp.int32))
    k_eff = jnp.minimum(n_vis, k)

    # (Triton tensors have power-of-two sizes: digit 0, which always passes, is counted too unless
    # bits = 1)
    first = 1 if bits == 1 else 0
    digits = jnp.arange(first, 2 ** bits, dtype=jnp.int32)

    def digit(st):
        # u: the unsigned-domain prefix of the threshold fixed so far, n_ge: how many keys reach it;
        # this pass's digit is how many of u's nonzero extensions keep at least k_eff keys
        p, u, n_ge = st
        shift = 32 - bits * (p + 1)
        counts = jnp.sum((key[:, None] >= ((u | (digits << shift)) ^ INT_MIN)[None, :]).astype(jnp.int32), axis=0)
        d = jnp.sum((counts >= k_eff).astype(jnp.int32)) + first - 1
        n_ge = jnp.where(d >= first, jnp.sum(jnp.where(digits == d, counts, 0)), n_ge)
        return p + 1, u | (d << shift), n_ge

    def search():
        _, u, _ = jax.lax.while_loop(lambda st: (st[0] < 32 // bits) & (st[2] > k_eff), digit,
                                     (jnp.int32(0), jnp.int32(0), k_eff + 1))
        threshold = u ^ INT_MIN
        return threshold, jnp.sum((key > threshold).astype(jnp.int32))

    searched = n_vis > k
    threshold, n_above = jax.lax.cond(searched, search, lambda: (n_vis * 0 + NEG_INF_KEY, n_vis))
    path_ref[row] = searched.astype(jnp.int32) * 2
    eq = ((key == threshold) & (key > NEG_INF_KEY)).astype(jnp.int32)
    need_equal = k_eff - n_above
    # (equal keys in position order up to the quota; a prefix sum only when there are more than it)
    take_eq = jax.lax.cond(jnp.sum(eq) > need_equal, lambda: jnp.where(jnp.cumsum(eq) <= need_equal, eq, 0),
                           lambda: eq)
    sel = ((key > threshold) & (key > NEG_INF_KEY)) | (take_eq > 0)
    at = jnp.cumsum(sel.astype(jnp.int32)) - 1
    plt.store(o_ref.at[row, jnp.where(sel, at, o_ref.shape[1] - 1)], col, mask=sel)
    _pad_positions(o_ref, row, k_eff, k, out_chunk)


def check_selection_args(scores, k, lengths):
    """Clear errors for what the kernels would otherwise read out of bounds or silently convert."""
    if not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if scores.ndim < 1 or not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"scores must be a float array of at least one dimension, got {scores.dtype} "
                        f"{scores.shape}")
    if lengths is not None and tuple(lengths.shape) != tuple(scores.shape[:-1]):
        raise ValueError(f"lengths {tuple(lengths.shape)} must have the shape of scores without its last axis "
                         f"{tuple(scores.shape[:-1])}")


def check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions):
    """Clear errors for mismatched indexer operands: the kernels index them unchecked, so a short
    positions or table would be read out of bounds."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got {tuple(q.shape)}")
    B, T, H, D = q.shape
    for name, x, want in (("w", w, (B, T, H)), ("positions", positions, (B, T))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} {tuple(x.shape)} must be {want} for q {tuple(q.shape)}")
    if slot_table.ndim != 2 or slot_table.shape[0] != B:
        raise ValueError(f"slot_table {tuple(slot_table.shape)} must be [B, S] with B = {B}")
    if index_k.ndim != 3 or index_k.shape[2] != D:
        raise ValueError(f"index_k {tuple(index_k.shape)} must be [layers, slots, {D}]")
    if index_scale is not None and tuple(index_scale.shape) != tuple(index_k.shape[:2]):
        raise ValueError(f"index_scale {tuple(index_scale.shape)} must be {tuple(index_k.shape[:2])}")
    if isinstance(layer, int) and not 0 <= layer < index_k.shape[0]:
        raise ValueError(f"layer {layer} out of range for {index_k.shape[0]} layers")


def fold_query_scale(q, w, q_scale, key_dtype):
    """fp8 queries with their scale per (token, head) [B, T, H] (DeepSeek's indexer format: amax /
    448 over the head's D values, so positive) as the kernels take them: the queries widened
    exactly, to bf16 (fp32 over fp32 keys, which a bf16 dot would round), and the scale folded into
    the head weights, since relu(s x) = s relu(x) for s >= 0 (DeepSeek's own indexer folds it so).
    Plain queries (q_scale None) pass through. ValueError for a scale without fp8 queries, fp8
    queries without one, or a scale of the wrong shape."""
    fp8 = jnp.dtype(q.dtype).itemsize == 1
    if fp8 != (q_scale is not None):
        raise ValueError(f"q_scale is given exactly for fp8 queries (their per-token, per-head scale); got q "
                         f"{jnp.dtype(q.dtype).name} with q_scale "
                         f"{None if q_scale is None else tuple(q_scale.shape)}")
    if q_scale is None:
        return q, w
    if tuple(q_scale.shape) != tuple(q.shape[:3]):
        raise ValueError(f"q_scale {tuple(q_scale.shape)} must be {tuple(q.shape[:3])} for q {tuple(q.shape)}")
    wide = jnp.float32 if jnp.dtype(key_dtype) == jnp.float32 else jnp.bfloat16
    return q.astype(wide), w * q_scale.astype(jnp.float32)


def _pad_to(x, axis: int, multiple: int, value):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _call(kernel, grid, args, out_shape, poison, num_warps: int, num_stages: int, interpret: bool):
    """pallas_call with every operand left in HBM (the kernels index it themselves). `poison` (tests):
    the first output buffer starts filled with it (an extra input aliased to the output), so an
    element the kernel fails to write shows. out_shape: one shape or a tuple (the first is poisoned)."""
    aliases = {}
    first = out_shape[0] if isinstance(out_shape, tuple) else out_shape
    if poison is not None:
        aliases = {len(args): 0}
        args = list(args) + [jnp.full(first.shape, poison, first.dtype)]
    spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[spec] * len(args),
        out_specs=tuple(spec for _ in out_shape) if isinstance(out_shape, tuple) else spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)


def select_topk_pallas(scores, k: int, lengths=None, *, chunk: int = 4096, bits: int = 4, capacity: int = 4096,
                       sample: int = 4096, sub: int = 512, segments: int = 1, num_warps: int = 16,
                       num_stages: int = 1, held_cands: int = 0, held_bits: int = 1, resident: bool = False,
                       interpret: bool = False,
                       poison: int | None = None, return_path: bool = False, stop_after: int | None = None):
    """scores [..., N] fp32; lengths [...] (optional): columns at or past a row's length are not
    visible (as if -inf). Returns [..., k] int32 in the module's convention (and, with return_path,
    each row's path: an index into PATHS). Two calls: bracket + filter, then threshold + emit, each
    over (rows, segments): `segments` programs share a row's columns (for few rows). capacity:
    candidate keys a segment keeps; sample: the most keys a row's bracket is estimated from; sub:
    keys per step when counting those. `poison` (tests): the output buffer starts filled with it, so
    an element the kernel fails to write shows. stop_after (benchmarks): end after stage 1
    (bracket), 2 (filter) or 3 (threshold), to time the stages by difference; the output is then
    not the selection. held_cands (a multiple of sub, 0: off): rows whose bracket held with at most that
    many candidates are finished from registers by one program, the threshold searched held_bits per
    pass (_threshold_emit_kernel). resident: rows of up to RESIDENT_MAX_WIDTH columns in one call of one program per
    row that keeps the row in registers (_resident_row_kernel; bits and num_warps apply, the rest not)."""
    check_selection_args(scores, k, lengths)
    if 32 % bits:
        raise ValueError(f"bits per pass must divide 32, got {bits}")
    if capacity % sub or sample % sub or sub % 16 or capacity < 2 * sub:
        raise ValueError(f"capacity ({capacity}) and sample ({sample}) must be multiples of sub ({sub}), "
                         f"sub of 16, and capacity at least 2 * sub")
    if held_cands and (held_cands % sub or bits % held_bits):
        raise ValueError(f"held_cands ({held_cands}) must be 0 or a multiple of sub ({sub}), and "
                         f"held_bits ({held_bits}) must divide bits ({bits})")
    if segments < 1 or segments & (segments - 1):
        raise ValueError(f"segments must be a power of two, got {segments}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    s = scores.reshape(-1, n).astype(jnp.float32)
    r = s.shape[0]
    ln = jnp.full((r,), n, jnp.int32) if lengths is None else jnp.minimum(lengths.reshape(-1), n).astype(jnp.int32)
    out_chunk = min(1024, pl.next_power_of_2(k))
    k_pad = -(-k // out_chunk) * out_chunk
    if resident:
        if n > RESIDENT_MAX_WIDTH:
            raise ValueError(f"resident rows hold at most {RESIDENT_MAX_WIDTH} columns, got {n}")
        s = _pad_to(s, 1, max(16, pl.next_power_of_2(n)), NEG_INF)
        out, path = _call(functools.partial(_resident_row_kernel, k=k, bits=bits, out_chunk=out_chunk), (r,),
                          [ln, s], (jax.ShapeDtypeStruct((r, k_pad + 1), jnp.int32),
                                    jax.ShapeDtypeStruct((r,), jnp.int32)), poison, num_warps, 1, interpret)
        out = out[:, :k].reshape(lead + (k,))
        return (out, path.reshape(lead)) if return_path else out
    chunk = min(chunk, pl.next_power_of_2(n))
    s = _pad_to(s, 1, chunk, NEG_INF)
    seg_chunks = -(-(s.shape[1] // chunk) // segments)
    common = dict(k=k, chunk=chunk, bits=bits, capacity=capacity, sub=sub, stop_after=stop_after)
    record, cands = _call(
        functools.partial(_bracket_filter_kernel, sample=sample, seg_chunks=seg_chunks, **common), (r, segments),
        [ln, s], (jax.ShapeDtypeStruct((r, segments, 8), jnp.int32),
                  jax.ShapeDtypeStruct((r, segments, capacity + 1, 2), jnp.int32)), None, num_warps, num_stages,
        interpret)
    if stop_after in (1, 2):
        out = jnp.broadcast_to(record[:, :1, 0] ^ record[:, :1, _LO_KEY] ^ cands[:, 0, :1, 0], (r, k_pad + 1))
        path = out[:, 0]
    else:
        out, path = _call(
            functools.partial(_threshold_emit_kernel, segs=segments, seg_chunks=seg_chunks, out_chunk=out_chunk,
                              held_cands=held_cands, held_bits=held_bits, **common), (r, segments),
            [ln, s, record, cands] + ([cands.reshape(r, -1)] if held_cands else []),
            (jax.ShapeDtypeStruct((r, k_pad + 1), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.int32)), poison,
            num_warps, num_stages, interpret)
    out = out[:, :k].reshape(lead + (k,))
    return (out, path.reshape(lead)) if return_path else out


def index_scores_reference(q, w, keys, positions, head_dim: int):
    """The lightning indexer's scores (HF order of operations): q [B, T, H, D], w [B, T, H] (already
    scaled by H**-0.5), keys [B, S, D] fp32 (dequantized), positions [B, T] (-1 = padding lane).
    Key j is visible to (b, t) iff j <= positions[b, t]; invisible scores are -inf."""
    scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys) * head_dim ** -0.5
    scores = jax.nn.relu(scores)
    index_scores = jnp.einsum("bth,bths->bts", w, scores)
    visible = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    return jnp.where(visible, index_scores, NEG_INF)


def index_keys_fp32(index_k, index_scale, layer, slot_table):
    """The keys at `layer` in table order as fp32, dequantized (index_scale given) or widened: what the
    reference scores are computed from. [B, S, D]."""
    keys = index_k[layer][slot_table]
    if index_scale is None:
        return keys.astype(jnp.float32)
    return dequantize_index_k(keys, index_scale[layer][slot_table])


def _dot_dtype(q_dtype):
    """The scores dot's operand dtype: fp32 queries stay fp32, anything else (bf16) runs in bf16; fp8
    keys widen to it exactly."""
    return jnp.float32 if q_dtype == jnp.float32 else jnp.bfloat16


def _scores_kernel(layer_ref, q_ref, w_ref, pos_ref, table_ref, k_ref, *rest, heads: int, block_t: int,
                   block_n: int, steps: int, fp8: bool, gathered: bool, epilogue: bool, write_invisible: bool,
                   capacity: int | None, bits: int, width: int):
    """One (request, query block, group of `steps` key blocks) program; the query block is loaded once
    and the key blocks stream through a pipelined loop. The key block is the dot's M ([block_n, D] x
    [D, block_t * H]): a token's heads are adjacent accumulator columns, so the weighted head sum stays
    within a thread and its quad (no cross-warp reduction), and one decode token's heads still make
    an MMA tile's N. Query blocks run last-first: with causal masks the late ones have the most keys.
    gathered: k_ref (and the scales) are this request's keys already in table order, [B, S, D].
    epilogue=False (timing only) sums the raw dot over heads instead of relu, weights and scale.
    write_invisible=False leaves the key blocks no query of the block sees unwritten.
    capacity (the fused indexer; one group of all key blocks per program, so a token's keys arrive in
    column order): instead of writing the scores, keep each token's keys >= the lo of its bracket
    (br_ref [B * Tp, 2], before the outputs) as the selection's first call does, in rec_ref
    [B * Tp, 1, 8] and cand_ref [B * Tp, 1, capacity + 1, 2]: the selection's second call then runs
    without the [T, S] scores ever written. Keys at or past `width` (the table's padding) are not
    visible."""
    scale_ref = rest[0] if fp8 else None
    if capacity is None:
        o_ref = rest[-1]
    else:
        br_ref, rec_ref, cand_ref = rest[-3:]
    b, g = pl.program_id(0), pl.program_id(2)
    it = pl.num_programs(1) - 1 - pl.program_id(1)
    layer = layer_ref[0]
    t0, m = it * block_t, block_t * heads
    pos = pos_ref[b, pl.ds(t0, block_t)]                                     # [bt]
    dot_dtype = _dot_dtype(q_ref.dtype)
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None  # fp32: no tf32
    q = q_ref[b, pl.ds(t0 * heads, m), :].astype(dot_dtype)                   # [bt * H, D]
    w = w_ref[b, pl.ds(t0 * heads, m)]                                       # [bt * H] fp32, D**-0.5 folded in
    d = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)
    first = g * steps
    n_here = jnp.minimum(steps, table_ref.shape[1] // block_n - first)
    n_vis = jnp.clip((jnp.max(pos) + block_n) // block_n - first, 0, n_here)  # blocks with a visible key
    if capacity is not None:
        rows = b * pos_ref.shape[1] + t0 + jnp.arange(block_t, dtype=jnp.int32)   # [bt] rows of B * Tp
        lo, hi = br_ref[rows, 0], br_ref[rows, 1]
        _, _, end, top = _search_start(lo, hi, bits)

    def block(j, carry):
        n0 = (first + j) * block_n
        cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
        if gathered:
            keys = k_ref[b, pl.ds(n0, block_n), :]                            # [bn, D]
            scale = scale_ref[b, pl.ds(n0, block_n)] if fp8 else None
        else:
            slots = table_ref[b, pl.ds(n0, block_n)]                          # pool slots of these keys
            keys = k_ref[layer, slots[:, None], d[None, :]]                   # [bn, D] through the page table
            scale = scale_ref[layer, slots] if fp8 else None
        s = jnp.dot(keys.astype(dot_dtype), q.T, precision=precision, preferred_element_type=jnp.float32)
        if epilogue:
            s = jnp.maximum(s, 0.0) * w[None, :]
        acc = jnp.sum(s.reshape(block_n, block_t, heads), axis=-1)            # [bn, bt]
        if fp8 and epilogue:
            acc = acc * scale[:, None]
        if capacity is None:
            o_ref[b, pl.ds(t0, block_t), pl.ds(n0, block_n)] = jnp.where(cols[:, None] <= pos[None, :], acc, NEG_INF).T
            return carry
        key = jnp.where((cols[:, None] <= pos[None, :]) & (cols[:, None] < width), order_keys(acc), NEG_INF_KEY)
        return _keep_candidates(key, cols[:, None], lo[None, :], end[None, :], top, *carry, capacity,
                                lambda at, pair, keep: plt.store(
                                    cand_ref.at[rows[None, :, None], 0, at[0], at[1]], pair, mask=keep))

    def masked_block(j, carry):
        o_ref[b, pl.ds(t0, block_t), pl.ds((first + j) * block_n, block_n)] = jnp.full(
            (block_t, block_n), NEG_INF, jnp.float32)
        return carry

    if capacity is not None:
        zeros = jnp.zeros((block_t,), jnp.int32)
        n_cand, n_past = jax.lax.fori_loop(0, n_vis, block, (zeros, zeros))
        for field, value in ((_VIS, jnp.clip(pos + 1, 0, width)), (_PAST, n_past), (_CAND, n_cand),
                             (_LO_KEY, lo), (_HI_KEY, hi)):
            plt.store(rec_ref.at[rows, 0, field], value)
        return
    jax.lax.fori_loop(0, n_vis, block, jnp.int32(0))
    if write_invisible:
        jax.lax.fori_loop(n_vis, n_here, masked_block, jnp.int32(0))


# A key read by at least this many query blocks is gathered (fp8 -> bf16, exact) once before the
# kernel: at prefill, fp8 keys read through the table and converted in the kernel took 15.3 ms against
# 9.8 ms gathered (H200, docs/perf.md), while the copy costs 3 bytes per key per request.
GATHER_KEYS_MIN_QUERY_BLOCKS = 8


def index_scores_pallas(q, w, index_k, index_scale, layer, slot_table, positions, *, block_m: int = 128,
                        block_n: int = 64, steps: int = 32, num_warps: int = 4, num_stages: int = 3,
                        gather_keys: bool | None = None, interpret: bool = False, poison: float | None = None,
                        epilogue: bool = True, write_invisible: bool = True, mgpu: bool | dict = False,
                        contiguous_blocks: bool = False, q_scale=None):
    """The indexer's scores, the keys read through the page table (in the kernel, or gathered once
    before it when many query blocks read them), with no [B, T, H, S] per-head intermediate.
    q [B, T, H, D]; w [B, T, H] fp32; index_k [L, slots, D] (fp8 with index_scale [L, slots], or plain
    with index_scale None), read at `layer` (the stacked pool is passed whole: slicing a layer out would
    copy it); slot_table [B, S]; positions [B, T]. Returns [B, T, S] fp32 with -inf where invisible.
    block_m: query rows x heads per program; steps: key blocks per program; gather_keys (None: by
    GATHER_KEYS_MIN_QUERY_BLOCKS): copy each request's keys in table order, in the dot's dtype, before
    the kernel. The defaults were the fastest tiling measured on the H200 for prefill and decode alike
    (docs/perf.md); they fit shared memory with fp32 queries. write_invisible=False: key blocks that
    no query of a query block sees are not written (their values are undefined), for a consumer that
    reads each row only below its length (positions + 1), as the selection does; at a causal prefill
    that is half of the [T, S] matrix. mgpu (True, or a scores_mgpu tiling dict): the gathered path
    runs the Mosaic GPU kernel instead (bf16 queries; the keys are then always gathered; operands it
    cannot take raise ValueError naming why). interpret: True, or Mosaic GPU interpreter parameters
    for the mgpu kernel (plgpu.InterpretGPUParams). q_scale [B, T, H]: q is fp8 with that scale per
    token and head (fold_query_scale)."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    T, S = q.shape[1], slot_table.shape[1]
    out = _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, block_m=block_m, block_n=block_n,
                       steps=steps, num_warps=num_warps, num_stages=num_stages, gather_keys=gather_keys,
                       interpret=interpret, poison=poison, epilogue=epilogue, write_invisible=write_invisible,
                       mgpu=mgpu, contiguous_blocks=contiguous_blocks)
    return out[:, :T, :S]


def mgpu_tiling(mgpu: bool | dict, T: int, H: int, paged: bool) -> dict:
    """The Mosaic GPU scores kernel's tiling for an mgpu request (ValueError for unknown keys; the
    kernels' entry points reject operands they cannot take). paged: the paged kernel, whose
    programs take paged_block_t(T, H) tokens."""
    user = mgpu if isinstance(mgpu, dict) else {}
    defaults = scores_mgpu.PAGED_TILING if paged else scores_mgpu.DEFAULT_TILING
    unknown = set(user) - set(scores_mgpu.DEFAULT_TILING) - set(scores_mgpu.PAGED_TILING)
    if unknown:
        raise ValueError(f"index_scores_pallas(mgpu=...): unknown tiling keys {sorted(unknown)}")
    tiling = {**defaults, **{k: v for k, v in user.items() if k in defaults}}
    if paged:
        tiling["block_t"] = paged_block_t(T, H)
    return tiling


def paged_block_t(T: int, H: int) -> int:
    """Query tokens per program of the paged Mosaic GPU kernel: T rounded up to a power of two, at
    most 8 and at most 256 columns (the MMA's N) of heads; at least 2 (scores_mgpu.mgpu_shape_error)."""
    return max(2, min(8, 256 // H, pl.next_power_of_2(T)))


def query_block(T: int, H: int, block_m: int = 128) -> int:
    """Query tokens per scores program: block_m rows of heads, at least 16 rows (a dot's minimum)."""
    return max(-(-16 // H), min(block_m // H, pl.next_power_of_2(T)))


def gathers_keys(T: int, H: int, block_m: int = 128) -> bool:
    """Whether a scores call of T query tokens copies its keys into table order before the kernel
    (GATHER_KEYS_MIN_QUERY_BLOCKS query blocks read them)."""
    return pl.cdiv(T, query_block(T, H, block_m)) >= GATHER_KEYS_MIN_QUERY_BLOCKS


def _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, *, block_m: int, block_n: int, steps: int,
                 num_warps: int, num_stages: int, gather_keys: bool | None, interpret: bool, poison=None,
                 epilogue: bool = True, write_invisible: bool = True, bracket=None, capacity: int | None = None,
                 bits: int = 4, mgpu: bool | dict = False, contiguous_blocks: bool = False):
    """The scores kernel on padded operands: [B, Tp, Sp] scores, or with a bracket ([B * Tp, 2] lo/hi
    per padded row) the fused indexer's (record, candidates) over all key blocks in one group."""
    B, T, H, D = q.shape
    S = slot_table.shape[1]
    block_t = query_block(T, H, block_m)
    block_n = min(block_n, max(16, pl.next_power_of_2(S)))
    wants_mgpu = mgpu is True or isinstance(mgpu, dict)          # ({} : the default tiling)
    if gather_keys is None:
        gather_keys = gathers_keys(T, H, block_m)
    paged = wants_mgpu and contiguous_blocks and not gather_keys
    tiling = (mgpu_tiling(mgpu, T, H, paged)
              if wants_mgpu and bracket is None and epilogue else None)
    if tiling is not None and poison is not None:
        raise ValueError("index_scores_pallas(mgpu=...) cannot poison its output (Mosaic GPU's interpreter "
                         "starts outputs as NaN)")
    if tiling is not None and paged:
        block_t, block_n = tiling["block_t"], scores_mgpu.BLOCK_KV
    elif tiling is not None:
        block_t, block_n, gather_keys = scores_mgpu.COMPUTE_WGS * tiling["block_t"], tiling["block_kv"], True
    q = _pad_to(q, 1, block_t, 0)
    Tp = q.shape[1]
    q = q.reshape(B, Tp * H, D)
    w = _pad_to(w.astype(jnp.float32) * D ** -0.5, 1, block_t, 0).reshape(B, Tp * H)  # relu(x) c = relu(x c), c > 0
    pos = _pad_to(positions.astype(jnp.int32), 1, block_t, -1)
    table = _pad_to(slot_table.astype(jnp.int32), 1, block_n, 0)
    n_blocks = table.shape[1] // block_n
    steps = n_blocks if bracket is not None else max(1, min(steps, n_blocks))
    fp8 = index_scale is not None
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if tiling is not None and paged:
        L, R = index_k.shape[:2]                 # the pool as rows (a free reshape): block bases by layer
        return scores_mgpu.paged_scores_mgpu(
            q, w, pos, index_k.reshape(L * R, D), index_scale.reshape(L * R) if fp8 else None,
            layer[0] * R + table[:, ::block_n], heads=H, block_t=block_t, stages=tiling["stages"],
            blocks_per_program=tiling["blocks_per_program"], write_invisible=write_invisible, interpret=interpret)
    keys = [index_k] + ([index_scale] if fp8 else [])
    if gather_keys:
        # (one gather indexed by layer and slot: slicing the layer out first could copy it whole)
        keys = [index_k[layer[0], table].astype(_dot_dtype(q.dtype))]
        keys += [index_scale[layer[0], table]] if fp8 else []
    if tiling is not None:
        return scores_mgpu.gathered_scores_mgpu(q, w, pos, keys[0], keys[1] if fp8 else None, heads=H,
                                                write_invisible=write_invisible, interpret=interpret, **tiling)
    kernel = functools.partial(_scores_kernel, heads=H, block_t=block_t, block_n=block_n, steps=steps, fp8=fp8,
                               gathered=gather_keys, epilogue=epilogue, write_invisible=write_invisible,
                               capacity=capacity if bracket is not None else None, bits=bits, width=S)
    args = [layer, q, w, pos, table] + keys
    if bracket is None:
        out_shape = jax.ShapeDtypeStruct((B, Tp, table.shape[1]), jnp.float32)
    else:
        args.append(bracket)
        out_shape = (jax.ShapeDtypeStruct((B * Tp, 1, 8), jnp.int32),
                     jax.ShapeDtypeStruct((B * Tp, 1, capacity + 1, 2), jnp.int32))
    return _call(kernel, (B, Tp // block_t, -(-n_blocks // steps)), args, out_shape, poison, num_warps, num_stages,
                 interpret)


KERNELS_ENABLED = True  # read at trace time; tests flip it (and clear jit caches) to compare on/off


def _on_gpu() -> bool:
    return KERNELS_ENABLED and jax.default_backend() == "gpu"


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


# The widest row _resident_row_kernel keeps in registers (32 keys per thread at 16 warps).
RESIDENT_MAX_WIDTH = 16384

# Below this many rows lax.top_k's composition is used (measured on the H200, docs/perf.md: the
# kernel is faster from 8 rows of 131072).
MIN_KERNEL_ROWS = 8


def select_tiling(rows: int, width: int, k: int = 2048) -> dict:
    """The selection kernel's parameters, the fastest measured on the H200 at k = 2048 (docs/perf.md):
    rows in registers (one call, one bit per pass) up to 8192 columns, 18 against 37 µs at 64 x 8192
    and 132 against 329 at 2048 x 8192, and at 16384 columns up to 512 rows (87 against 93 µs; at 2048
    rows the two calls win, 291 against 310); 16 warps up to 512 rows, 8 above (184 against 132 µs
    at 2048 x 8192). Wider rows take the two calls (bracket_tiling)."""
    if width <= 8192 or (width <= RESIDENT_MAX_WIDTH and rows <= 512):
        return {"resident": True, "bits": 1, "num_warps": 16 if rows <= 512 else 8}
    return bracket_tiling(rows, width, k)


# The most programs the two-call selection splits a row's columns over. At 8 x 131072 (decode's
# selection), with rows finished from registers: 56.8 us at 4, 52.6 at 8, 50.0 at 16 (docs/perf.md;
# before that 4 won, 87 against 125 for 8). The width rule below keeps 131072 columns at 8; 16 to 32
# rows at 8 segments are not measured.
MAX_SEGMENTS = 8


def bracket_tiling(rows: int, width: int, k: int = 2048) -> dict:
    """The two-call selection's parameters (k = 2048 over 64 x 8192, 2048 x 32768, 64 x 131072 and
    8 x 131072 on the H200). Few rows split their columns over several programs (segments) to use
    more of the 132 SMs. Wide rows need the larger sample: with
    2048 keys, 5 of 64 rows of 131072 missed the bracket and took the full search. The candidates
    (keys >= lo: k plus the bracket's margin) need room for about 3k: on random rows with k = 2048 a
    row kept on average 2414, 2796 and 3086 of 8192, 32768 and 131072 columns, at most 2622, 3552
    and 4073 of 512 rows (interpret mode; tests/test_kernels.py keeps random rows on the bracket).
    With segments, a row whose candidates fit held_cands is finished from registers by one program
    (_threshold_emit_kernel): 105.5 -> 81.6 us at 64 x 131072 and 71.9 -> 57.9 at 8 x 131072 (then
    52.6 with 8 segments); with one segment it lost (374.5 -> 395.8 us at 2048 x 32768), so it is off
    there."""
    capacity = max(4096, -(-3 * k // 1024) * 1024)
    segments = 1
    while segments < MAX_SEGMENTS and rows * segments * 2 <= 256 and width >= 4096 * segments * 4:
        segments *= 2
    held = {"held_cands": max(4096, pl.next_power_of_2(2 * k)), "held_bits": 1} if segments > 1 else {}
    if width <= 8192:
        return {"bits": 4, "chunk": 4096, "capacity": capacity, "sample": 2048, "sub": 1024, "num_warps": 8,
                "num_stages": 2, "segments": segments, **held}
    if width <= 65536:
        return {"bits": 4, "chunk": 2048, "capacity": capacity, "sample": 2048, "sub": 1024, "num_warps": 4,
                "num_stages": 2, "segments": segments, **held}
    return {"bits": 4, "chunk": 4096, "capacity": capacity, "sample": 4096, "sub": 1024,
            "num_warps": 8 if segments > 1 else 16, "num_stages": 3, "segments": segments, **held}


def select_topk(scores, k: int, lengths=None):
    """The dispatch for selection over a given score matrix."""
    check_selection_args(scores, k, lengths)
    rows, width = scores.size // scores.shape[-1], scores.shape[-1]
    if _on_gpu() and rows >= MIN_KERNEL_ROWS:
        return select_topk_pallas(scores, k, lengths, **select_tiling(rows, width, k))
    if lengths is not None:
        cols = jnp.arange(width, dtype=jnp.int32)
        scores = jnp.where(cols < lengths[..., None], scores, NEG_INF)
    return select_topk_reference(scores, k)


# The dispatch runs indexer_topk_fused (no score matrix) instead of scores + selection. Off: on the
# H200 it measured 17.2 ms against 13.2 ms at a T = N = 32768 prefill and 2.8 against 2.0 ms at
# decode T = 64 (docs/perf.md): keeping candidates inside the scores loop costs more than writing and
# re-reading the scores. Tests flip it.
USE_FUSED = False

# The dispatch runs the gathered scores (calls of at least GATHER_KEYS_MIN_QUERY_BLOCKS query blocks:
# prefill) through the Mosaic GPU kernel (scores_mgpu) where its shapes fit: on the H200 at a
# T = N = 32768 GLM-5 prefill the scores take 7.2 against 9.6 ms, the indexer 11.1 against 13.0 ms
# (docs/perf.md). Both kernels equal the fp32 reference to fp32 rounding, but not to the bit: a
# near-tie can rank differently between a call that takes this kernel and one that takes the Triton
# kernel. Read at trace time; tests flip it.
USE_MGPU_SCORES = True

# The largest score buffer one indexer call may hold: the kernels' [B, T, S] fp32 scores, or the jnp
# composition's [B, T, H, S] per-head scores. A longer call runs its query tokens in chunks (each
# chunk's scores, then its selection), so a long prefill's memory stays bounded at the unfused speed.
# 4 GiB is T = S = 32768 on the kernels.
SCORES_MAX_BYTES = 4 << 30


# The gathered Mosaic GPU kernel runs one program per 16 query tokens and request: below one program
# per SM it loses (H200, decode 8 x T = 64 over 131072 keys: 3.57 ms against the Triton kernel's 1.08).
MGPU_MIN_PROGRAMS = 132

# The dispatch runs calls that read their keys through the page table (decode, short chunks) through
# the paged Mosaic GPU kernel when the caller says the table is made of whole 64-slot blocks
# (contiguous_blocks): on the H200 at decode 8 x T = 1 over 131072 fp8 keys it took 55-67 us against
# the Triton kernel's 88-95 us (docs/perf.md). Read at trace time; tests flip it.
USE_MGPU_PAGED = True


def use_mgpu_scores(B: int, T: int, H: int, D: int, q_dtype, contiguous_blocks: bool = False,
                    key_dtype=None) -> bool:
    """Whether the dispatch runs these scores through a Mosaic GPU kernel: the gathered one
    (USE_MGPU_SCORES, keys gathered because enough query blocks read them, at least MGPU_MIN_PROGRAMS
    programs) or the paged one (USE_MGPU_PAGED, contiguous_blocks, keys not gathered), where its
    shapes fit."""
    if gathers_keys(T, H):
        programs = B * pl.cdiv(T, scores_mgpu.COMPUTE_WGS * scores_mgpu.DEFAULT_TILING["block_t"])
        return (USE_MGPU_SCORES and programs >= MGPU_MIN_PROGRAMS
                and scores_mgpu.mgpu_shape_error(H, D, q_dtype, **scores_mgpu.DEFAULT_TILING) is None)
    return (USE_MGPU_PAGED and contiguous_blocks and scores_mgpu.mgpu_shape_error(
        H, D, q_dtype, block_t=paged_block_t(T, H), key_dtype=key_dtype) is None)


def indexer_topk(q, w, index_k, index_scale, layer, slot_table, positions, k: int, contiguous_blocks: bool = False,
                 q_scale=None):
    """The dispatch for the whole indexer selection on one device: kernels on GPU (scores through the
    page table, then selection over each row's visible length; or the fused path with USE_FUSED), the
    jnp composition elsewhere; in query chunks of at most SCORES_MAX_BYTES of scores.
    contiguous_blocks: the caller promises that each 64-position block of slot_table is 64
    consecutive slots (pages of a multiple of 64 slots), which lets short calls read the keys from
    the pool by TMA (the paged Mosaic GPU kernel). q_scale [B, T, H]: q is fp8 with that scale per
    token and head (fold_query_scale: every path, kernels or not, then sees plain queries)."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    B, T, H, D = q.shape
    kernels = _on_gpu() and _pow2(D) and _pow2(H)  # Triton tiles: power-of-two dims
    if kernels and USE_FUSED:
        return indexer_topk_fused(q, w, index_k, index_scale, layer, slot_table, positions, k)
    chunk = max(1, SCORES_MAX_BYTES // (B * slot_table.shape[1] * 4 * (1 if kernels else H)))
    chunk -= chunk % 128 if chunk >= 128 else 0
    keys = None if kernels else index_keys_fp32(index_k, index_scale, layer, slot_table)

    def select(t0):
        q_, w_, pos_ = q[:, t0:t0 + chunk], w[:, t0:t0 + chunk], positions[:, t0:t0 + chunk]
        if kernels:
            mgpu = use_mgpu_scores(B, q_.shape[1], H, D, q.dtype, contiguous_blocks, index_k.dtype)
            scores = index_scores_pallas(q_, w_, index_k, index_scale, layer, slot_table, pos_, write_invisible=False,
                                         mgpu=mgpu, contiguous_blocks=contiguous_blocks)
            return select_topk(scores, k, pos_ + 1)
        return select_topk_reference(index_scores_reference(q_, w_, keys, pos_, D), k)
    if T <= chunk:
        return select(0)
    return jnp.concatenate([select(t0) for t0 in range(0, T, chunk)], axis=1)


def _sample_bracket_kernel(len_ref, m_ref, s_ref, br_ref, *, k: int, bits: int, capacity: int, sub: int):
    """Program (row) of the fused indexer: the bracket of a row of len_ref[row] visible keys from the
    scores of its m_ref[row] visible sampled columns (s_ref [rows, S_s]: the sample's columns are
    spread evenly over the table, so a row's visible ones are spread evenly over the row)."""
    r = _Row(len_ref, None, pl.program_id(0), sub, bits, width=2 ** 31 - 1)
    row, length, m = r.row, r.length, m_ref[pl.program_id(0)]

    def sample_keys(i):
        at = i * sub + jnp.arange(sub, dtype=jnp.int32)
        return jnp.where(at < m, order_keys(s_ref[row, pl.ds(pl.multiple_of(i * sub, sub), sub)]), INT_MIN)

    lo, hi = jax.lax.cond(length > capacity, lambda: _sampled_bracket(r, sample_keys, (m + sub - 1) // sub, m, length, k),
                          lambda: (length * 0 + TAKE_ALL[0], length * 0 + TAKE_ALL[1]))
    br_ref[row, 0] = lo
    br_ref[row, 1] = hi


def sample_columns(S: int, sample: int) -> np.ndarray:
    """The fused indexer's sample: blocks of 16 consecutive columns spread evenly over a table of S."""
    n_blocks = max(1, min(sample, S) // 16)
    start = (np.arange(n_blocks) * S // n_blocks) // 16 * 16
    return (start[:, None] + np.arange(16)[None, :]).reshape(-1)


def indexer_topk_fused(q, w, index_k, index_scale, layer, slot_table, positions, k: int, *,
                       capacity: int | None = None, sample: int = 2048, sample_sub: int = 256, sub: int = 1024,
                       bits: int = 4, block_m: int = 128, block_n: int = 64, num_warps: int = 4, num_stages: int = 3,
                       select_warps: int = 8, fallback_rows: int = 64, interpret: bool = False,
                       poison: int | None = None, return_path: bool = False, q_scale=None):
    """The indexer's top-k without the [T, S] scores in HBM (for prefill: T query tokens per request).
    1. The scores of a sample of the columns (blocks of 16 spread over the table) give each row's
       bracket [lo, hi) (_sample_bracket_kernel; rows of at most `capacity` visible keys keep all).
    2. The scores kernel, one program per query block over all its key blocks, keeps each token's
       keys >= lo with their columns instead of writing the scores (_scores_kernel with a capacity).
    3. The selection's second call finds each row's threshold among its candidates and writes the
       positions.
    A row whose bracket missed or whose candidates overflowed (path 2) is redone the unfused way,
    `fallback_rows` rows at a time (so at most fallback_rows x S scores exist at once). Same result convention
    as indexer_topk; with return_path also each row's path (before any redo). poison (tests): the
    positions buffer starts filled with it, so a position the kernels fail to write shows. q_scale:
    fp8 queries' scale, as in indexer_topk."""
    check_indexer_args(q, w, index_k, index_scale, layer, slot_table, positions)
    q, w = fold_query_scale(q, w, q_scale, index_k.dtype)
    B, T, H, D = q.shape
    S = slot_table.shape[1]
    capacity = capacity or max(4096, -(-3 * k // 1024) * 1024)
    if capacity % sub or sub % 16 or sample_sub % 16 or k > capacity:
        raise ValueError(f"capacity ({capacity}) must be a multiple of sub ({sub}) and at least k ({k}); "
                         f"sub and sample_sub ({sample_sub}) multiples of 16")
    block_t = query_block(T, H, block_m)
    q, w = _pad_to(q, 1, block_t, 0), _pad_to(w, 1, block_t, 0)
    positions = _pad_to(positions.astype(jnp.int32), 1, block_t, -1)
    Tp = q.shape[1]
    rows = B * Tp
    length = jnp.clip(positions + 1, 0, S).reshape(rows)
    common = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if S > capacity:
        cols = sample_columns(S, sample)
        n_visible = jnp.searchsorted(jnp.asarray(cols), positions, side="right").astype(jnp.int32)
        s_scores = _scores_call(q, w, index_k, index_scale, layer, slot_table[:, cols], n_visible - 1, steps=32,
                                gather_keys=None, write_invisible=False, **common)[:, :, :cols.size]
        s_scores = _pad_to(s_scores.reshape(rows, cols.size), 1, sample_sub, NEG_INF)
        bracket = _call(functools.partial(_sample_bracket_kernel, k=k, bits=bits, capacity=capacity, sub=sample_sub),
                        (rows,), [length, n_visible.reshape(rows), s_scores],
                        jax.ShapeDtypeStruct((rows, 2), jnp.int32), None, select_warps, 1, interpret)
    else:
        bracket = jnp.broadcast_to(jnp.asarray(TAKE_ALL, jnp.int32), (rows, 2))
    record, cands = _scores_call(q, w, index_k, index_scale, layer, slot_table, positions, steps=0, gather_keys=None,
                                 bracket=bracket, capacity=capacity, bits=bits, **common)
    out_chunk = min(1024, pl.next_power_of_2(k))
    k_pad = -(-k // out_chunk) * out_chunk
    emit = functools.partial(_threshold_emit_kernel, k=k, chunk=sub, bits=bits, capacity=capacity, sub=sub, segs=1,
                             seg_chunks=1, out_chunk=out_chunk, stop_after=None, width=S)
    out, path = _call(lambda len_ref, rec_ref, cand_ref, *refs: emit(len_ref, None, rec_ref, cand_ref, *refs),
                      (rows, 1), [length, record, cands],
                      (jax.ShapeDtypeStruct((rows, k_pad + 1), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32)),
                      poison, select_warps, 1, interpret)
    out = out[:, :k].reshape(B, Tp, k)[:, :T]
    path = path.reshape(B, Tp)[:, :T]
    q, w, positions = q[:, :T], w[:, :T], positions[:, :T]

    redo = (path == 2).reshape(-1)
    n_redo = jnp.sum(redo.astype(jnp.int32))
    n_fix = min(fallback_rows, B * T)
    redo_rows = jnp.nonzero(redo, size=B * T, fill_value=0)[0]

    def unfused(q_, w_, table_, pos_):
        scores = index_scores_pallas(q_, w_, index_k, index_scale, layer, table_, pos_, write_invisible=False,
                                     **common)
        if interpret or not _on_gpu() or scores.size // S < MIN_KERNEL_ROWS:
            return select_topk_reference(jnp.where(jnp.arange(S) <= pos_[..., None], scores, NEG_INF), k)
        return select_topk(scores, k, pos_ + 1)

    def redo_chunk(c, out):
        at = c * n_fix + jnp.arange(n_fix)
        valid = at < n_redo
        idx = redo_rows[jnp.minimum(at, B * T - 1)]
        b, t = idx // T, idx % T
        pos_r = jnp.where(valid, positions[b, t], -1)[:, None]
        sel = unfused(q[b, t][:, None], w[b, t][:, None], slot_table[b], pos_r)[:, 0]
        return out.at[jnp.where(valid, idx, B * T)].set(sel, mode="drop")

    out = jax.lax.fori_loop(0, (n_redo + n_fix - 1) // n_fix, redo_chunk, out.reshape(B * T, k)).reshape(B, T, k)
    return (out, path) if return_path else out
