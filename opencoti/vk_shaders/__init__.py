"""GLSL compute shaders of the Vulkan backend and their committed SPIR-V.

Each entry of ``VARIANTS`` is one pipeline: a ``.comp`` source compiled with a
set of ``-D`` defines to ``<name>.spv`` by ``python -m opencoti.vk_shaders.build``
(glslc, Debian package ``glslc``). The ``.spv`` files and ``manifest.json`` (the
source hash each was built from) are committed and shipped as package data, so
users need no shader compiler; ``tests/test_vulkan.py`` fails when one is stale.

Quantized-weight shaders come in one variant per ggml type (``QTYPE`` = the
ggml type id, see ``quants.glsl``); KV shaders in one per KV storage type for
f16 / f32 K and V, plus ``kv_store`` (scalar tiers) / ``kv_rot`` (rotated tiers) /
``attn_any``, which take each half's KV tier (``kv_quant.glsl``) as a push constant.
"""

from __future__ import annotations

from importlib import resources

# ggml type id -> variant suffix (ggml.h ggml_type)
QTYPE_NAMES = {0: "f32", 1: "f16", 30: "bf16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
               10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k"}
KV_NAMES = ("f16", "f32")


def variants() -> dict[str, tuple[str, dict[str, str]]]:
    """``{pipeline name: (source file, defines)}`` for every shipped SPIR-V module."""
    out: dict[str, tuple[str, dict[str, str]]] = {}
    for tid, qn in QTYPE_NAMES.items():
        for src in ("mul_mat_vec", "mul_mm", "get_rows"):
            out[f"{src}_{qn}"] = (f"{src}.comp", {"QTYPE": str(tid)})
        out[f"mul_mat_vec_id_{qn}"] = ("mul_mat_vec.comp", {"QTYPE": str(tid), "MUL_MAT_ID": "1"})  # experts
    for kv in KV_NAMES:
        d = {"KV_F16": "1"} if kv == "f16" else {}
        out[f"kv_write_{kv}"] = ("kv_write.comp", d)
        out[f"attn_{kv}"] = ("attn.comp", d)
    out["attn_any"] = ("attn.comp", {"KV_ANY": "1"})  # any KV tier per half (kv_quant.glsl codes)
    out["moe_route"] = ("moe.comp", {"MOE_ROUTE": "1"})
    out["moe_combine"] = ("moe.comp", {})
    out["ssm_conv"] = ("recurrent.comp", {"SSM_CONV": "1"})
    out["gated_delta_net"] = ("recurrent.comp", {})
    for src in ("copy_rows", "rms_norm", "rope", "unary", "binary", "attn_merge", "kv_store", "kv_rot"):
        out[src] = (f"{src}.comp", {})
    return out


def load_spv(name: str) -> bytes:
    """The committed SPIR-V of pipeline ``name`` (works from a source tree, a wheel or a .pyz)."""
    return resources.files(__name__).joinpath(f"{name}.spv").read_bytes()
