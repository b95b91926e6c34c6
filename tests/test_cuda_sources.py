"""The CUDA sources' launch contract, checked on their text (no GPU needed).

Inside a captured decode step every kernel is launched with programmatic dependent launch
(``cuda_kernels.Kernel``, ``cuda_src/pdl.cuh``): its blocks may start while the kernel before it
still runs, so a kernel must wait on ``GRID_DEP_WAIT()`` before it reads or writes anything an
earlier kernel touches. A kernel that forgot the wait would race its predecessor only now and
then; this test finds it on the source.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from importlib import resources

import pytest

from opencoti.engine.backend import cuda_kernels, cuda_kv
from opencoti.engine.kv_tiers import TIER_NAMES

_KERNEL = re.compile(r'__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)\s*\(')
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
MODULES = sorted(p.name for p in resources.files("opencoti.cuda_src").iterdir() if p.name.endswith(".cu"))


def kernel_bodies(src: str) -> list[tuple[str, str]]:
    """``[(kernel name, the text from its body's start to the end of src)]`` for every
    ``__global__`` function of the CUDA text ``src`` in order (macro-defined kernels by their
    ``##`` pattern or macro parameter, comments removed; a name defined twice, in two macros or
    two ``#if`` branches, is listed twice, each with its own body)."""
    src = _COMMENT.sub("", src)
    out = []
    for m in _KERNEL.finditer(src):
        depth, i = 0, m.end() - 1
        while True:  # the parameter list's closing parenthesis
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            if depth == 0:
                break
            i += 1
        out.append((m.group(1), src[src.index("{", i) + 1:]))
    return out


def _squeeze(text: str) -> str:
    return re.sub(r"[\s\\]+", "", text)  # whitespace and line continuations removed


def kernel_first_statements(src: str) -> list[tuple[str, str]]:
    """``[(kernel name, its body's first statement)]`` for every ``__global__`` function of the
    CUDA text ``src`` in order (``kernel_bodies``; line continuations, comments and whitespace
    removed)."""
    return [(name, _squeeze(body[:body.index(";") + 1])) for name, body in kernel_bodies(src)]


@functools.cache
def _sources() -> dict[str, str]:
    srcs = {name: cuda_kernels.read_source(name) for name in MODULES}
    srcs["kv_write (generated)"] = cuda_kv.write_source()
    for t in TIER_NAMES:
        srcs[f"attention {t} (generated)"] = cuda_kv.attention_source(t, t, 128)
    srcs["rope_store q8_0 turbo3 (generated)"] = cuda_kv.rope_store_source("q8_0", "turbo3", 128)
    return srcs


# kernels that call a device function which waits itself, after reading only constants (name,
# first statement's start): the one-column-tile GEMV (gemv_int.cu gemvi_ring_at: its weights'
# first ring slots and an L2 prefetch before the wait, pdl.cuh OPENCOTI_PDL_EARLY; gemvi_impl
# waits first), alone or two weights' in one grid (gemvi_duo: either branch is gemvi_ring_at);
# the attention kernels over KV tiers (attention.cu attn_kv_impl, attn_stream.cuh
# attn_stream_impl: their shared-memory tables from __constant__ levels before the wait), the f16
# streaming kernel through the same attn_stream_impl, and the short-row kernels (attn_kv_impl,
# f16's attn_partial_impl: early_rows, their first tile's old cells asked for before the wait)
_WAIT_INSIDE = {("gemvi_12_##SUFFIX", "F12("), ("gemvi_14_##SUFFIX", "F14("),
                ("gemvi_duo_##A##r##RA##_##B##r##RB##SFX", "if(blockIdx.y<ny1)gemvi_ring_at<"),
                ("NAME", "ifconstexpr(OK)attn_kv_impl<"), ("attn_kv_stream", "ifconstexpr(AS_KV_OK)attn_stream_impl<"),
                ("NAME", "attn_stream_impl<D,HN,AsF16<D>,AsF16<D>>("), ("NAME", "attn_partial_impl<D,G,LPC>(")}
# the fused rope + KV store kernels compute their rope angle and read their norm weights and
# biases (rope.cuh rope_pre: pos, the host-staged positions, and weights) before the wait, the tier
# store its rotation's sign word as well (rope_store.cu rs_sign_word); kv_write.cu's turbo
# quantizers read their sign word (kv_tiers.cuh kv_sign_word): name -> the statements up to and
# with the wait, nothing else
_PREAMBLES = {"rope_kv_write": "constRopePrepre=ROPE_PRE();GRID_DEP_WAIT();",
              "rope_kv_write_q": "constRopePrepre=ROPE_PRE();constu32sw=rs_sign_word();GRID_DEP_WAIT();",
              "kv_quant_##T##_d##D": "constu32sw=kv_sign_word<D>();GRID_DEP_WAIT();"}
# the device functions those kernels call, which wait themselves: (source, function) -> waits
_IMPL_WAITS = {("gemv_int.cu", "gemvi_ring_at("): 2, ("gemv_int.cu", "gemvi_impl("): 1,
               ("attention.cu", "attn_kv_impl("): 1, ("attention.cu", "attn_partial_impl("): 1,
               ("attn_stream.cuh", "attn_stream_impl("): 1}
# the one call before an attention kernel's wait that may name its memory: early_rows, handed the
# plan's arrays and the K / V stores (test_early_rows_reads_only_the_plan)
_EARLY_CALL = re.compile(r"early_rows<[^;]*>\(q_pos, row_view, view_off, cells, cell_pos, K, V, n_kv, kh,\s*n_split,"
                         r"\s*warp,\s*lane\);")
# what an attention kernel's implementation may not name before its wait: its pointer parameters
_ATTN_MEMORY = re.compile(r"\b(q|q_pos|row_view|view_off|cells|cell_pos|K|V|out|part_acc|part_ml)\b")
# ... but for the streaming kernel's: the plan's arrays (host-staged) and the K / V rows of its
# early copies (attn_stream.cuh: cells no running kernel writes), issued last before the wait
_STREAM_EARLY_NAMES = {"q_pos", "row_view", "view_off", "cells", "cell_pos", "K", "V"}
_STREAM_EARLY_FILLS = ("autoearly=[&](intj,intcell){returnATTN_EARLY!=0&&(cell<0||c0+j*CT+crow<c_new);};"
                       "#pragmaunrollfor(intj=0;j<NS-1;j++)if(j<ntile&&early(j,pre[j]))fill(j,pre[j]);")


def _function_body(src: str, fn: str) -> str:
    """The text of device function ``fn``'s body in ``src`` (from its parameter list's end to the
    first line that closes it: a "}" in column 0)."""
    body = src[src.index(f"void {fn}"):]
    body = body[:body.index("\n}\n")]
    return body[body.index(") {") + 3:]


@pytest.mark.parametrize("module", list(_sources()))
def test_every_kernel_waits_first(module):
    """Every kernel of every module (the generated tier modules included) starts with
    GRID_DEP_WAIT() (GRID_DEP_WAIT_LATE() for gemv_int.cu's gemmi, the only ones): nothing is read
    or written before it but for the fused rope + KV stores' rope inputs (ROPE_PRE, then the
    wait: test_rope_angle_before_the_wait_reads_no_kernel_output) and the turbo encoders' sign word
    (test_turbo_sign_word_before_the_wait_reads_a_constant); the GEMV pair and duo delegate to gemvi_ring_at / gemvi_impl, and the
    attention kernels over KV tiers (and f16's streaming one) to attn_kv_impl / attn_stream_impl,
    which each wait once (the ring once per #if branch), before their first read of the
    activations / of any memory a kernel writes."""
    src = _sources()[module]
    first = kernel_first_statements(src)
    assert first, module
    waits = ("GRID_DEP_WAIT();", "GRID_DEP_WAIT_LATE();")
    late = [(name, stmt) for name, stmt in first
            if stmt not in waits and not any(name == n and stmt.startswith(p) for n, p in _WAIT_INSIDE)
            and not _PREAMBLES.get(name, "").startswith(stmt)]
    assert not late, (module, late)
    for (name, stmt), (_, body) in zip(first, kernel_bodies(src)):
        if stmt not in waits and name in _PREAMBLES:  # its preamble, then the wait, nothing else
            assert _squeeze(body)[:len(_PREAMBLES[name])] == _PREAMBLES[name], (module, name)
    assert {name for name, stmt in first if stmt == waits[1]} == (
        {f"gemmi_{t}_{v}_n##NT##SFX" for t in (12, 14) for v in ("o##B##", "s##S##")} if module == "gemv_int.cu" else set())
    names = {name for name, _ in first}
    if "gemvi_12_##SUFFIX" in names:  # every pair's functions are the two that wait inside
        pairs = re.findall(r"^GEMVI_PAIR\(\w+, \((\w+)<[^)]*\), \((\w+)<[^)]*\)\)$", src, re.M)
        assert len(pairs) == src.count("\nGEMVI_PAIR(") >= 5
        assert {f for p in pairs for f in p} == {"gemvi_ring", "gemvi_impl"}, pairs
    for (name, fn), n in _IMPL_WAITS.items():
        if name == module or (name == "attn_stream.cuh" and "attn_stream_impl<" in src):
            body = _function_body(src if name == module else cuda_kernels.read_source("attention.cu"), fn)
            body = _COMMENT.sub(lambda m: " " * len(m.group()), body)  # (offsets kept)
            at = [m.start() for m in re.finditer(r"GRID_DEP_WAIT\(\);", body)]
            assert len(at) == n, (fn, at)
            if fn.startswith("gemvi"):
                assert max(at) < body.index("superblock"), fn  # before the activations
            else:
                pre = body[:at[0]]
                if fn in ("attn_kv_impl(", "attn_partial_impl("):  # the early_rows call, then the wait
                    assert len(_EARLY_CALL.findall(pre)) == 1, fn
                    assert _EARLY_CALL.search(pre).end() == len(pre.rstrip()), fn
                    pre = _EARLY_CALL.sub("", pre)
                if fn == "attn_stream_impl(":  # the plan's arrays, and K / V in the early copies only
                    assert set(_ATTN_MEMORY.findall(pre)) == _STREAM_EARLY_NAMES, fn
                    assert _squeeze(pre).endswith(_STREAM_EARLY_FILLS), fn
                    assert _squeeze(pre).count("fill(") == 1 and "early(" in pre, fn
                else:
                    assert not _ATTN_MEMORY.findall(pre), (fn, _ATTN_MEMORY.findall(pre))
                if fn != "attn_partial_impl(":
                    assert "tab" in pre, fn  # (what it moved before the wait)


def test_kernel_scan_finds_the_kernels():
    """The scan sees plain, bounded and macro-defined kernels, and a kernel that does not wait."""
    src = ('extern "C" __global__ void a(int* x) { GRID_DEP_WAIT(); x[0] = 1; }\n'
           'extern "C" __global__ void __launch_bounds__(128, 2) b(const float* __restrict__ y,\n'
           '                                                       int (*z)[4]) {\n    GRID_DEP_WAIT();\n}\n'
           '#define K(T) extern "C" __global__ void k_##T(T* p) {  \\\n        p[0] = 0; GRID_DEP_WAIT(); }\n')
    assert kernel_first_statements(src) == [("a", "GRID_DEP_WAIT();"), ("b", "GRID_DEP_WAIT();"), ("k_##T", "p[0]=0;")]
    # comments are not statements; a name defined twice is listed twice
    src2 = ('extern "C" __global__ void c(int* x) { /* x; */ GRID_DEP_WAIT(); }\n'
            'extern "C" __global__ void c(int* x) {  // x[0] = 1;\n    x[1] = 2; GRID_DEP_WAIT(); }\n')
    assert kernel_first_statements(src2) == [("c", "GRID_DEP_WAIT();"), ("c", "x[1]=2;")]
    assert len(kernel_first_statements(cuda_kernels.read_source("kernels.cu"))) >= 20


def test_rope_store_source_defines_the_pair():
    """rope_store.cu's module per (K tier, V tier): the pair's tier structs, the head size only
    where a tier is rotated (one module for every head size of a scalar pair), and ValueError
    for a tier without the fused store (the trellis tiers) or a rotated tier at head size 512."""
    head = lambda *a: cuda_kv.rope_store_source(*a).split("\n")[:3]  # noqa: E731
    assert head("q8_0", "q4_0", 512) == ["#define RS_TK KQ8_0", "#define RS_TV KQ4_0", "#define RS_D 0"]
    assert head("f16", "turbo3", 256) == ["#define RS_TK KF16", "#define RS_TV KTurbo3", "#define RS_D 256"]
    assert head("turbo2", "bf16", 64)[2] == "#define RS_D 64"
    with pytest.raises(ValueError, match="turbo3_tcq"):
        cuda_kv.rope_store_source("turbo3_tcq", "q8_0", 128)
    with pytest.raises(ValueError, match="head size 64, 128 or 256, not 512"):
        cuda_kv.rope_store_source("q8_0", "turbo4", 512)


def test_attention_sources_define_the_v_prefetch():
    """The f16 attention module (first) and every tier module (after its KV_* defines and
    tables) define ATTN_V_PREFETCH (attention.cu prefetch_row) from their argument (default 1,
    L1); another value than 0 / 1 / 2 is a ValueError, not a module that silently prefetches
    nothing."""
    assert cuda_kv.f16_attention_source().startswith("#define ATTN_V_PREFETCH 1\n")
    assert cuda_kv.f16_attention_source(2).startswith("#define ATTN_V_PREFETCH 2\n")
    src = cuda_kv.attention_source("turbo3", "q8_0", 256, v_prefetch=0)
    assert "#define ATTN_V_PREFETCH 0\n" in src and "#define ATTN_V_PREFETCH 1\n" not in src
    with pytest.raises(ValueError, match="0, 1 or 2, not 3"):
        cuda_kv.f16_attention_source(3)


def test_early_rows_reads_only_the_plan():
    """early_rows (attention.cu), which the short-row attention kernels run before their PDL wait,
    reads only the plan's row_view, view_off and cells (host-staged), asks for its q_pos /
    cell_pos, and names the K / V stores only in prefetch addresses (no load of a cache value),
    and only for a split's cells below
    the view's length less the ubatch's rows (gridDim.x): a ubatch's new cells, which the store
    before it writes, end each view (test_kv_fastpath's new_cells_end_each_view). ATTN_EARLY 0
    (``early=False``) defines it away."""
    src = _COMMENT.sub("", cuda_kernels.read_source("attention.cu"))
    head = src[src.index("void early_rows("):]
    body = head[head.index("{"):head.index("\n}\n")]
    on = body[:body.index("#else")]
    assert re.findall(r"(?<![.\w])(?:row_view|view_off|cells)\[", on) == ["row_view[", "view_off[", "view_off[", "cells["]
    assert not re.findall(r"(?<![.\w])(q|out|part_acc|part_ml)\b", on)
    # q_pos / cell_pos (host-staged): only asked for
    assert [x.group() for x in re.finditer(r"(?<![.\w])(q_pos|cell_pos)\b.{0,12}", on)] == [
        "q_pos + blockIdx.", "cell_pos + i));"]
    # K and V: each once, in a prefetch's address (K's through the row pointer `row`, used in
    # the prefetch alone): no load of a cache value
    stmts = [re.sub(r"\s+", " ", x).strip() for x in re.split(r"[;{}]", on.replace('[%0];"', '[%0]"'))]
    kv = [x for x in stmts if re.search(r"(?<![.\w])(K|V|row)\b", x)]
    assert len(kv) == 3 and kv[0].startswith("const char* row = (const char*)K +"), kv
    for x in kv[1:]:  # (a loop's header may lead the statement)
        at = x.index('asm volatile("prefetch.global.L1 [%0]" ::"l"(')
        assert all(m.start() > at for m in re.finditer(r"(?<![.\w])(K|V|row)\b", x)), x
    assert "(const char*)V +" in kv[2] and "row +" in kv[1]
    assert on.count("prefetch.global.L1") == 4 and "ld." not in on
    assert "min(c0 + chunk, b0 + len - (int)gridDim.x)" in re.sub(r"\s+", " ", on)
    assert "cells[" not in on.replace("i < c1 ? cells[i]", "")  # the one index read, of a cell below c1
    assert "#define ATTN_EARLY 0\n" in cuda_kv.attention_source("turbo3", "q8_0", 256, early=False)
    assert "ATTN_EARLY 0" not in cuda_kv.f16_attention_source() + cuda_kv.attention_source("turbo3", "q8_0", 256)


def test_rope_angle_before_the_wait_reads_no_kernel_output():
    """rope_pre (rope.cuh), which the fused rope + KV store kernels run before their PDL wait
    (ROPE_PRE), reads only pos[t], the norm weights and biases (q_norm / k_norm, bq / bk: model
    weights) and, through rope_cs, ff[k] (and the scalars): not q / k / v, the cells or the caches,
    which the kernels before it write. The macro hands it exactly the kernel parameters of those
    names; its only pointers are pos, ff and the weights."""
    src = _COMMENT.sub("", cuda_kernels.read_source("rope_store.cu"))
    macro = re.search(r"#define ROPE_PRE\(\) \\\s*rope_pre\(([^)]*)\)", src)
    assert macro and re.sub(r"\s+", "", macro.group(1)) == (
        "T,Hq,Hk,pos,D,n_rot,base,freq_scale,mode,ff,ext_factor,corr_lo,corr_hi,mscale,q_norm,k_norm,bq,bk")
    head = src[src.index("RopePre rope_pre(int T"):]
    body = head[head.index("{"):head.index("\n}\n")]
    assert re.findall(r"[\w:]+\*\s*(?:__restrict__\s*)?(\w+)", head[:head.index("{")]) == [
        "pos", "ff", "q_norm", "k_norm", "bq", "bk"]
    # pos[t]; ff handed to rope_cs; the weights chosen by the block's role, read through nw / bias
    assert re.findall(r"(?<![.\w])(?:pos|ff|q_norm|k_norm|bq|bk|nw|bias)\b ?[^\w\s]", body) == [
        "nw =", "q_norm :", "k_norm;", "bias =", "bq :", "bk;", "nw)", "nw[", "nw[", "bias)", "bias[", "bias[", "pos[",
        "ff,"]
    assert not re.findall(r"(?<![.\w])(q|k|v|in|cell|K|V|q_out|x|xr|buf)\b", body)  # (not blockIdx.x)
    cs = src[src.index("float2 rope_cs(int i"):]
    cs = cs[:cs.index("\n}\n")]
    assert re.findall(r"const float\* __restrict__ (\w+)", cs) == ["ff"]
    assert re.findall(r"(?<![.\w])(?:ff)\b\W*", cs) == ["ff, ", "ff) ", "ff["]  # the parameter, if (ff), ff[k]


def test_turbo_sign_word_before_the_wait_reads_a_constant():
    """The turbo encoders' sign word, read before the wait (kv_tiers.cuh kv_sign_word; rope_store.cu
    rs_sign_word, kv_write.cu's kv_quant_<T>_d<D>), comes from KV_SIGNS, the generated
    __constant__ array that no kernel writes, at the thread's own index; rs_sign_word calls
    nothing else."""
    sign = re.search(r"u32 kv_sign_word\(\) (\{[^\n]*\})\n", cuda_kernels.read_source("kv_tiers.cuh"))
    assert sign and sign.group(1) == "{ return KV_SIGNS[(threadIdx.x & (D - 1)) >> 5]; }"
    rs = re.search(r"u32 rs_sign_word\(\) (\{[^\n]*\})\n", cuda_kernels.read_source("rope_store.cu"))
    assert rs and rs.group(1) == "{ return RS_TK::ROT || RS_TV::ROT ? kv_sign_word<RS_DT>() : 0u; }"
    assert re.search(r"^__constant__ unsigned int KV_SIGNS\[16\]", cuda_kv.tables_prefix(), re.M)


def test_store_phases_stamps_the_current_sources():
    """bench/store_phases.py's stamps find each of their anchors exactly once in the fused rope +
    KV store modules as they are (f16's kernels.cu, a turbo pair's and a scalar pair's
    rope_store.cu), so the tool stamps the phases it names; an anchor that moved fails it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import store_phases

    def probes(src):  # stamps: PROBE_DEFS defines the two macros; the first stamp inserts two
        return src.count("PROBE(") + src.count("PROBE_V(") - 3

    f16 = store_phases.stamped(cuda_kernels.read_source("kernels.cu"), "f16")
    assert probes(f16) == sum(w in ("both", "f16") for w, *_ in store_phases.STAMPS)
    for tk, d in (("turbo3", 256), ("q8_0", 0)):
        tier = store_phases.stamped(cuda_kv.rope_store_source(tk, tk, d), "tier")
        assert probes(tier) == sum(w in ("both", "tier") for w, *_ in store_phases.STAMPS)
    with pytest.raises(ValueError, match="occurs 0 times"):
        store_phases.stamped("", "f16")
