"""Top-k selection over a score matrix as Pallas kernels (Triton backend), and its dispatch.

Result convention (reference and kernel alike): per row, the positions of the k largest scores
(k = min(k, visible)), ties broken toward the lower position, listed in ascending position order and
padded with -1. Ascending order makes the result a canonical set (the attention consumes a set) and
keeps the later row gathers in address order.

Pallas has no sort/top_k lowering, so the kernels find the threshold T (the k-th largest of the
scores' order-preserving int32 keys) and how many keys equal to T to take:
  1. a bracket [lo, hi) for T from a sample of the row (blocks of 16 columns spread over it);
  2. one pass over the row counts its keys and keeps those >= lo with their columns, in column order
     (the candidates: k plus the bracket's margin), as interleaved (key, column) pairs;
  3. an exact digit search among the candidates gives T (over the row when the bracket missed);
  4. a pass over the candidates writes the positions, at offsets from running prefix sums.
So a row is read once plus a sample when the bracket holds; when it misses, the full search keeps the
result exact. Two calls, (1-2) and (3-4), each over (rows, segments): with few rows a row's columns
are split over several programs. Rows short enough to stay in registers take one call instead
(_resident_row_kernel). Each row reports its path (PATHS). Triton, not Mosaic GPU: the selection is
masked scatter stores and per-lane compare / prefix-sum work, not dense tiles. Measurements:
docs/perf.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.indexer.common import (_CAND, _HI_KEY, _LO_KEY, _PAST, _VIS, INT_MIN, NEG_INF, NEG_INF_KEY,
                                           _call, _pad_to, check_selection_args, order_keys)
from pallas_kernels.indexer.reference import select_topk_reference
from pallas_kernels.indexer.tuning import RESIDENT_MAX_WIDTH, select_tiling, selects_by_kernel
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


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


def select_topk(scores, k: int, lengths=None, *, policy: KernelPolicy = DEFAULT_POLICY):
    """The dispatch for selection over a given score matrix: the kernels on GPU where they win
    (tuning.selects_by_kernel), lax.top_k's composition otherwise. (Here, beside its kernels, and not
    in dispatch.py: the fused indexer's redo path uses it, and the indexer's dispatch uses the fused
    indexer.)"""
    check_selection_args(scores, k, lengths)
    rows, width = scores.size // scores.shape[-1], scores.shape[-1]
    if policy.on_gpu() and selects_by_kernel(rows, width):
        return select_topk_pallas(scores, k, lengths, **select_tiling(rows, width, k))
    if lengths is not None:
        cols = jnp.arange(width, dtype=jnp.int32)
        scores = jnp.where(cols < lengths[..., None], scores, NEG_INF)
    return select_topk_reference(scores, k)

