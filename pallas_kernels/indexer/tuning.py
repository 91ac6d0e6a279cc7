"""The indexer kernels' tuning rules: which tiling the dispatch gives a call of a given shape (selection,
scores, the Mosaic GPU kernels' tiles) and the shape limits behind them. Each rule is the fastest
measured on the H200 (docs/perf.md); kept apart from the kernels so a re-tuning touches only this
module."""

from __future__ import annotations

from jax.experimental import pallas as pl

from pallas_kernels.indexer import scores_mgpu

# A key read by at least this many query blocks is gathered (fp8 -> bf16, exact) once before the
# kernel: converting fp8 keys inside the kernel for every query block costs more than the 3-byte copy
# per key (docs/perf.md, the prefill scores).
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


def paged_blocks_per_program(B: int, T: int, H: int, S: int, programs: int = 132) -> int:
    """Key blocks per program of the paged scores kernel that spread a call of B requests x T query
    tokens x S keys over about one wave of `programs`: the fewest, a power of two and at least
    scores_mgpu.PAGED_BLOCKS_ALIGN (4: what the kernel takes over several programs), at most the default
    tiling's 64 (measured at 8 x 131072, where this rule gives 64 too). KernelPolicy.mgpu_paged_one_wave."""
    blocks = B * pl.cdiv(T, paged_block_t(T, H)) * pl.cdiv(S, scores_mgpu.BLOCK_KV)
    most = scores_mgpu.PAGED_TILING["blocks_per_program"]
    return min(most, max(scores_mgpu.PAGED_BLOCKS_ALIGN, pl.next_power_of_2(pl.cdiv(blocks, programs))))


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

# Below this many rows a row too wide for the resident kernel takes lax.top_k's composition (the
# two-call kernel wins from 8 rows; docs/perf.md).
MIN_KERNEL_ROWS = 8


def select_tiling(rows: int, width: int, k: int = 2048) -> dict:
    """The selection kernel's parameters, the fastest measured on the H200 at k = 2048 (docs/perf.md,
    the resident-row sections): rows in registers (one call, one bit per pass) up to 8192 columns, and
    at 16384 columns up to 512 rows (above, the two calls win); 16 warps up to 512 rows, 8 above.
    Wider rows take the two calls (bracket_tiling)."""
    if width <= 8192 or (width <= RESIDENT_MAX_WIDTH and rows <= 512):
        return {"resident": True, "bits": 1, "num_warps": 16 if rows <= 512 else 8}
    return bracket_tiling(rows, width, k)


def selects_by_kernel(rows: int, width: int) -> bool:
    """Whether the selection of rows x width takes a kernel on the GPU (else lax.top_k's composition):
    the resident-row kernel at any row count (on the H200, docs/perf.md 2026-12-04 sixth session: 1 x
    8192 13 us against the composition's 65, which a batch-1 decode step paid in every layer), the
    two-call kernel from MIN_KERNEL_ROWS rows."""
    return rows >= MIN_KERNEL_ROWS or bool(select_tiling(rows, width).get("resident"))


# The most programs the two-call selection splits a row's columns over: 8 for decode's 8 x 131072
# (docs/perf.md, fourth session of 2026-12-01); 16 to 32 rows at 8 segments are not measured.
MAX_SEGMENTS = 8


def bracket_tiling(rows: int, width: int, k: int = 2048) -> dict:
    """The two-call selection's parameters (k = 2048 over 64 x 8192, 2048 x 32768, 64 x 131072 and
    8 x 131072 on the H200). Few rows split their columns over several programs (segments) to use
    more of the 132 SMs. Wide rows need the larger sample (a 2048-key sample missed the bracket on
    some rows of 131072). The candidates (keys >= lo: k plus the bracket's margin) need room for about
    3k (random rows with k = 2048 kept at most ~4100; tests/test_kernels.py keeps random rows on the
    bracket). With segments, a row whose candidates fit held_cands is finished from registers by one
    program (_threshold_emit_kernel), which wins there and loses with one segment, so it is off there
    (docs/perf.md)."""
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

