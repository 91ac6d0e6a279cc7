"""The routed experts' grouped matmuls: the block plan, the Mosaic GPU kernel, and the dispatch."""

from pallas_kernels.moe.dispatch import (ExpertRows, expert_mlp, expert_mlp_blocked, expert_mlp_blocked_fp8, expert_mlp_ragged,
                                        fp8_kernel_applies)
from pallas_kernels.moe.fp8_rows import dequantize_blocks, quantize_rows
from pallas_kernels.moe.grouped_matmul import Tiling, grouped_matmul
from pallas_kernels.moe.layout import check_experts, expert_shape, fp8_experts_as_plain
from pallas_kernels.moe.plan import block_plan, padded_rows

__all__ = ["ExpertRows", "expert_mlp", "expert_mlp_blocked", "expert_mlp_blocked_fp8", "expert_mlp_ragged", "fp8_kernel_applies",
           "dequantize_blocks", "quantize_rows", "Tiling", "grouped_matmul", "block_plan",
           "padded_rows", "check_experts", "expert_shape", "fp8_experts_as_plain"]
