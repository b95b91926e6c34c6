"""Qwen3.5 / Qwen3.6 MoE: ``general.architecture = qwen35moe``.

The Qwen3.5 hybrid recipe (``qwen35.py``) with a routed-expert FFN in every
block: softmax router over ``expert_count`` experts, top ``expert_used_count``
with weights renormalised to sum 1, SwiGLU experts of width
``expert_feed_forward_length``, plus a shared expert of width
``expert_shared_feed_forward_length`` scaled by ``sigmoid(x ffn_gate_inp_shexp)``
(llama.cpp ``src/models/qwen35moe.cpp``; transformers ``modeling_qwen3_5_moe.py``).
"""

from __future__ import annotations

from opencoti.engine.arch.qwen35 import Qwen35


class Qwen35MoE(Qwen35):
    arch_names = ("qwen35moe",)
