"""Run-time parameters: one object built by the CLI from flags and their
``LLAMA_ARG_*`` environment twins, read by the model loader, the engine and
the HTTP server. Field names follow llama.cpp's ``common_params``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from opencoti.engine.api import SamplingParams


@dataclass
class Params:
    """Everything the command line can set.

    Sizes are in tokens (KV cells) unless stated. ``n_ctx`` 0 means the
    model's training context. ``n_threads`` -1 means all cores.
    """

    model: Optional[str] = None  # -m; None -> the embedded default model
    prompt: Optional[str] = None  # -p
    n_predict: int = -1  # -n
    n_ctx: int = 4096  # -c
    n_batch: int = 2048  # -b (logical batch)
    n_ubatch: int = 512  # -ub (physical batch: tokens per forward)
    n_threads: int = -1  # -t
    n_parallel: int = 1  # -np
    kv_unified: bool = False  # --kv-unified
    spm_infill: bool = False  # --spm-infill: /infill lays out suffix then prefix (SPM), not PSM
    # KV tiers (opencoti.engine.kv_tiers). None = not given: f16, unless auto-tier picks
    cache_type_k: Optional[str] = None  # -ctk / --cache-type-k
    cache_type_v: Optional[str] = None  # -ctv / --cache-type-v
    cache_type_k_tail: Optional[str] = None  # -ctkt: tier of a spilled tail (None = as K)
    cache_type_v_tail: Optional[str] = None  # -ctvt (None = as V)
    kv_auto_tier: bool = False  # OPENCOTI_KV_AUTO_TIER=1 (engine/kv_auto_tier.py)
    kv_budget_mib: Optional[float] = None  # OPENCOTI_KV_BUDGET_MIB: auto-tier's budget for the whole KV
    admission_poolless: str = "enforced"  # --admission-poolless {off,warn,enforced}
    cache_idle_slots: bool = True  # --no-cache-idle-slots sets False
    polykv_max_pools: int = 0  # --polykv-max-pools M: pool seq_ids above the slots (0 = PolyKV off)
    ctx_shift: bool = False  # --context-shift: drop old tokens instead of stopping at the context limit
    n_gpu_layers: int = -1  # -ngl (-1: backend default)
    main_gpu: int = 0
    gpu: str = "auto"  # --gpu {auto,nvidia,vulkan,amd,apple,disable}
    flash_attn: str = "auto"  # -fa {on,off,auto}
    # --override-kv KEY=TYPE:VALUE (repeatable): GGUF metadata replaced at load
    # (opencoti.model.kv_override.KVOverride, applied by the model loader)
    kv_overrides: list = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # server
    server: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    alias: Optional[str] = None
    timeout: int = 600  # seconds, HTTP read/write
    endpoint_slots: bool = True  # --slots / --no-slots: GET /slots (llama.cpp's default: on)
    endpoint_metrics: bool = False  # --metrics: GET /metrics (Prometheus text)
    endpoint_props: bool = False  # --props: POST /props (acknowledged, as llama.cpp's; 501 without)
    # chat
    chat_template: Optional[str] = None  # --chat-template NAME or inline template
    chat_template_file: Optional[str] = None
    system_prompt: Optional[str] = None
    display_prompt: bool = True  # -p: echo the prompt before its completion
    verbose: bool = False
