"""The engine's options: `EngineConfig` and every check of a value or of a combination of values, so a
bad configuration fails before a model is loaded or a byte of the pool is allocated."""

from __future__ import annotations

import dataclasses

from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


class EngineConfigError(ValueError):
    """An invalid or inconsistent EngineConfig."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 64              # tokens per KV page
    kv_pages: int = 256              # device pool size in pages (page 0 is the dummy)
    max_running: int = 32            # requests decoding/prefilling at once (decode batch bucket cap)
    max_prefill_tokens: int = 1024   # prefill token budget per step (chunked prefill)
    prefix_cache: bool = True        # radix prefix cache over finished and prefilled requests
    dtype: str | None = None         # compute dtype; None -> the checkpoint's
    index_dtype: str = "fp8"         # indexer key cache: 'fp8' (e4m3 + per-token fp32 scale) or 'same'
    attn_path: str | None = None     # force 'expanded' / 'absorbed'; None -> by tokens per request
    min_prefill_lanes: int = 16      # smallest prefill token bucket
    cp_size: int = 1                 # context-parallel ranks (mesh axis 'cp'); the pool's pages are split over them
    cp_mode: str = "zigzag"          # 'zigzag' (page-aligned) or 'round_robin'
    ep_size: int = 1                 # expert-parallel ranks (mesh axis 'ep', beside 'cp'): the routed experts split over ep x tp
    tp_size: int = 1                 # tensor-parallel ranks (mesh axis 'tp'): heads, MLP intermediate, vocabulary and experts split
    ep_dispatch: str = "auto"        # how rows meet their experts over 'ep' (models.moe.choose_ep_dispatch): 'psum'
                                     # (each rank its experts over every row, fp32 partials all-reduced),
                                     # 'all_to_all' (each rank dispatches its 1/ep of the rows to the experts'
                                     # ranks and all-gathers the combined rows back), 'auto': both are exact
                                     # (capacity-free), so the one sending fewer bytes per rank for the model's
                                     # top-k and dtype (bf16, top-8: all_to_all from ep 8, psum below)
    two_batch_overlap: bool = False  # each forward's rows as two micro-batches (models.model.MicroBatches): one's
                                     # MoE dispatch/combine overlaps the other's attention; IndexCache top-k
                                     # carried per micro-batch
    cp_short_policy: str = "owner"   # requests with < 2*cp new pages: 'owner' (page-aligned) or 'token_balanced'
    speculative: str | None = None   # 'nextn': EAGLE/NextN speculative decoding with the checkpoint's MTP layer
    num_draft_tokens: int = 2        # draft tokens proposed per decode round (chain)
    hicache_pages: int = 0           # host KV tier size in pages (pinned host memory); 0 = off
    hicache_policy: str = "write_through"  # or 'write_through_selective' (back up on the second hit)
    hicache_copy: str = "auto"       # 'side_stream' (GPU: copies at layer boundaries), 'jit', 'auto' (GPU -> side_stream)
    overlap: bool = True             # the host plans and dispatches step n+1 before taking step n's tokens
                                     # (sampled tokens stay on the device; with speculative decoding a round's
                                     # accepted tokens and next drafts too, on one rank: off under CP)
    kernels: KernelPolicy = DEFAULT_POLICY  # which Pallas kernels every step runs on GPU (pallas_kernels.policy)
    kv_trace: int = 0                # KV-integrity trace level (cpkv_jax.trace): 0 off, 1 transfers, 2 + page
                                     # hashes, 3 + per-layer forward hashes
    trace_out: str | None = None     # the trace's JSONL file (needed with kv_trace > 0)
    pd_prefill_devices: int = 0      # prefill/decode disaggregation (cpkv_jax.pd): prefill on a cp mesh over the
                                     # first N devices; 0 = off (one engine does both)
    pd_decode_replicas: int = 1      # PD: decode engines, one device each after the prefill devices, each with
                                     # its own pool and radix cache
    pd_router: str = "least_loaded"  # PD: the decode replica a request goes to: 'least_loaded' or 'prefix'
                                     # (the longest cached prefix first)

    def validate(self) -> "EngineConfig":
        """Self, or EngineConfigError naming the first bad option or combination."""
        def positive(name, minimum=1):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise EngineConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")
        if not isinstance(self.kernels, KernelPolicy):
            raise EngineConfigError(f"kernels must be a pallas_kernels.policy.KernelPolicy, got {self.kernels!r}")
        for name in ("prefix_cache", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.hicache_pages != 0:
            positive("hicache_pages", 2)
        positive("page_size")
        positive("kv_pages", 2)
        positive("max_running")
        positive("max_prefill_tokens")
        positive("min_prefill_lanes")
        if self.index_dtype not in ("fp8", "same", "bfloat16", "float32"):
            raise EngineConfigError(f"index_dtype must be 'fp8', 'same', 'bfloat16' or 'float32', "
                                    f"got {self.index_dtype!r}")
        if self.attn_path not in (None, "expanded", "absorbed"):
            raise EngineConfigError(f"attn_path must be None, 'expanded' or 'absorbed', got {self.attn_path!r}")
        positive("cp_size")
        positive("ep_size")
        positive("tp_size")
        from models.moe import EP_DISPATCH_CHOICES
        if self.ep_dispatch not in EP_DISPATCH_CHOICES:
            raise EngineConfigError(f"ep_dispatch must be 'auto', 'psum' or 'all_to_all', got {self.ep_dispatch!r}")
        if not isinstance(self.two_batch_overlap, bool):
            raise EngineConfigError(f"two_batch_overlap must be True or False, got {self.two_batch_overlap!r}")
        if self.two_batch_overlap and self.cp_size > 1 and self.max_running < 2:
            raise EngineConfigError("two_batch_overlap with cp_size > 1 needs max_running >= 2: under CP a step is "
                                    "cut into micro-batches along its requests (a rank's lanes are not in "
                                    "position order, so a request's lanes cannot be cut), and with one request "
                                    "per step there is nothing to cut")
        from cpkv_jax.cp import MODES, SHORT_POLICIES
        if self.cp_mode not in MODES:
            raise EngineConfigError(f"cp_mode must be one of {MODES}, got {self.cp_mode!r}")
        if self.cp_short_policy not in SHORT_POLICIES:
            raise EngineConfigError(f"cp_short_policy must be one of {SHORT_POLICIES}, got {self.cp_short_policy!r}")
        if self.kv_pages % self.cp_size or self.kv_pages // self.cp_size < 2:
            raise EngineConfigError(f"kv_pages ({self.kv_pages}) must be a multiple of cp_size ({self.cp_size}) "
                                    f"with at least 2 pages per rank (each rank keeps a dummy page)")
        if self.speculative not in (None, "nextn"):
            raise EngineConfigError(f"speculative must be None or 'nextn', got {self.speculative!r}")
        positive("num_draft_tokens")
        if self.hicache_pages:
            from cpkv_jax.hicache import WRITE_POLICIES
            positive("hicache_pages", 2)
            if not self.prefix_cache:
                raise EngineConfigError("hicache_pages needs prefix_cache=True: the host tier lives under the "
                                        "radix prefix cache")
            if self.hicache_pages % self.cp_size or self.hicache_pages // self.cp_size < 2:
                raise EngineConfigError(f"hicache_pages ({self.hicache_pages}) must be a multiple of cp_size "
                                        f"({self.cp_size}) with at least 2 pages per rank")
            if self.hicache_policy not in WRITE_POLICIES:
                raise EngineConfigError(f"hicache_policy must be one of {WRITE_POLICIES}, got "
                                        f"{self.hicache_policy!r}")
            if self.hicache_copy not in ("auto", "side_stream", "jit"):
                raise EngineConfigError(f"hicache_copy must be 'auto', 'side_stream' or 'jit', got "
                                        f"{self.hicache_copy!r}")
        if self.pd_prefill_devices:
            positive("pd_prefill_devices")
            positive("pd_decode_replicas")
            if self.cp_size not in (1, self.pd_prefill_devices):
                raise EngineConfigError(f"cp_size ({self.cp_size}) must be 1 or pd_prefill_devices "
                                        f"({self.pd_prefill_devices}): the prefill engine's cp mesh is those devices")
            if self.ep_size > 1 or self.tp_size > 1:
                raise EngineConfigError("pd_prefill_devices with ep_size or tp_size > 1 is not supported yet: "
                                        "the transfer moves pages per CP rank")
            if self.kv_pages % self.pd_prefill_devices or self.kv_pages // self.pd_prefill_devices < 2:
                raise EngineConfigError(f"kv_pages ({self.kv_pages}) must be a multiple of pd_prefill_devices "
                                        f"({self.pd_prefill_devices}) with at least 2 pages per rank")
        if self.pd_router not in ("least_loaded", "prefix"):
            raise EngineConfigError(f"pd_router must be 'least_loaded' or 'prefix', got {self.pd_router!r}")
        if self.kv_trace not in (0, 1, 2, 3) or isinstance(self.kv_trace, bool):
            raise EngineConfigError(f"kv_trace must be 0 (off), 1, 2 or 3, got {self.kv_trace!r}")
        if self.kv_trace and not self.trace_out:
            raise EngineConfigError("kv_trace > 0 needs trace_out: the file the trace's JSONL records go to")
        if self.trace_out is not None and not self.kv_trace:
            raise EngineConfigError("trace_out is set but kv_trace is 0 (off): give a trace level 1-3")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise EngineConfigError(f"dtype must be None, 'float32' or 'bfloat16', got {self.dtype!r}")
        return self
