"""The DSA lightning indexer's top-k as GPU kernels beside their jnp references: the scores through the
page table (Triton, or Mosaic GPU in scores_mgpu), the selection over them (select), the fused path
without a score matrix (fused), the tuning rules (tuning) and the dispatch that picks among them for
a KernelPolicy (dispatch). The public entry points are re-exported here."""

from pallas_kernels.indexer.common import PATHS, check_indexer_args, check_selection_args, fold_query_scale
from pallas_kernels.indexer.dispatch import indexer_topk, use_mgpu_scores
from pallas_kernels.indexer.fused import indexer_topk_fused, sample_columns
from pallas_kernels.indexer.quant import FP8, FP8_MAX, dequantize_index_k, quantize_index_k
from pallas_kernels.indexer.reference import index_keys_fp32, index_scores_reference, select_topk_reference
from pallas_kernels.indexer.scores import index_scores_pallas
from pallas_kernels.indexer.select import sample_block_start, sample_size, select_topk, select_topk_pallas
from pallas_kernels.indexer.tuning import (MAX_SEGMENTS, MIN_KERNEL_ROWS, RESIDENT_MAX_WIDTH, bracket_tiling,
                                           gathers_keys, paged_block_t, paged_blocks_per_program, query_block,
                                           select_tiling, selects_by_kernel)

__all__ = ["FP8", "FP8_MAX", "MAX_SEGMENTS", "MIN_KERNEL_ROWS", "PATHS", "RESIDENT_MAX_WIDTH", "bracket_tiling",
           "check_indexer_args", "check_selection_args", "dequantize_index_k", "fold_query_scale", "gathers_keys",
           "index_keys_fp32", "index_scores_pallas", "index_scores_reference", "indexer_topk", "indexer_topk_fused",
           "paged_block_t", "paged_blocks_per_program", "query_block", "quantize_index_k", "sample_block_start",
           "sample_columns", "sample_size", "select_tiling", "select_topk", "select_topk_pallas",
           "select_topk_reference", "selects_by_kernel", "use_mgpu_scores"]
