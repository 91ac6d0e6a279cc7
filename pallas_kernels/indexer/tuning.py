"""The indexer kernels' tuning rules: which tiling the dispatch gives a call of a given shape (selection,
scores, the Mosaic GPU kernels' tiles) and the shape limits behind them. Each rule is the fastest
measured on the H200 (docs/perf.md); kept apart from the kernels so a re-tuning touches only this
module."""

from __future__ import annotations

from jax.experimental import pallas as pl

from pallas_kernels.indexer import scores_mgpu

# A key read by at least this many query blocks is gathered (fp8 -> bf16, exact) once before the
# kernel: at prefill, fp8 keys read through the table and converted in the kernel took 15.3 ms against
# 9.8 ms gathered (H200, docs/perf.md), while the copy costs 3 bytes per key per request.
GATHER_KEYS_MIN_QUERY_BLOCKS = 8


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

