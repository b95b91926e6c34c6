"""Where a decode step's GPU time goes, kernel by kernel, as the server runs it (graph replay
with programmatic dependent launch), through CUPTI's activity records.

    python bench/profile_timeline.py -m model.gguf [--tiers f16,q8_0,turbo3] [--depth 32768] \
        [--replays 20] [-v]

Per tier (``name`` or ``k/v``) a runner is built, prefilled to ``--depth`` cells and decoded for
a few steps (graph capture); then its last step's graph is replayed ``--replays`` times back to
back while CUPTI records every kernel's start and end (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
the GPU's timestamps, kernels not serialized). Inside a decode graph a kernel launches while its
predecessor runs and waits for it (pdl.cuh), so a kernel's duration is not what it adds to the
step: that is its *exposed* time, its end minus the previous kernel's end, and the exposed times
of a step's kernels add up to the step. ncu (``profile_kernels.py``) times kernels one at a time
and sums durations; nsys is not on the device image. Printed per tier: the step (1 / the events'
time a replay, and the traced span a replay), and a table of kernel roles (by name: the KV store,
the short-row and streaming attention, the merge, the projections, the rest) with calls a step,
mean duration and exposed microseconds a step, side by side for the tiers. ``-v`` adds each
tier's kernels by name.

The tracer is a few lines of C against libcupti (``tracer_source``), compiled with the toolkit's
``nvcc`` into the cache directory on first use.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kv_tiers import _decode, replay_step  # noqa: E402
from common import prefill  # noqa: E402

from opencoti.engine.batch import UBatch  # noqa: E402

TRACER_SOURCE = r"""
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
// kernel records (start, end: GPU ns; name) of kernels that start at or after the mark
typedef struct { uint64_t start, end; char* name; } Rec;
static Rec* g_recs; static size_t g_n, g_cap; static uint64_t g_mark = ~(uint64_t)0;
static void CUPTIAPI buf_req(uint8_t** buf, size_t* size, size_t* max_recs) {
    *size = 16 << 20; *buf = (uint8_t*)aligned_alloc(8, *size); *max_recs = 0;
}
static void CUPTIAPI buf_done(CUcontext ctx, uint32_t sid, uint8_t* buf, size_t size, size_t valid) {
    CUpti_Activity* r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)r;
        if (k->start < g_mark) continue;
        if (g_n == g_cap) { g_cap = g_cap ? 2 * g_cap : 4096; g_recs = (Rec*)realloc(g_recs, g_cap * sizeof(Rec)); }
        g_recs[g_n].start = k->start; g_recs[g_n].end = k->end; g_recs[g_n].name = strdup(k->name ? k->name : "?");
        g_n++;
    }
    free(buf);
}
int tl_enable(void) {
    int e = cuptiActivityRegisterCallbacks(buf_req, buf_done);
    return e ? e : cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}
int tl_mark(void) {  // drop what was recorded so far; keep kernels that start from now on
    int e = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    for (size_t i = 0; i < g_n; i++) free(g_recs[i].name);
    g_n = 0;
    return e ? e : cuptiGetTimestamp(&g_mark);
}
long long tl_collect(void) { return cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) ? -1 : (long long)g_n; }
void tl_get(long long i, uint64_t* start, uint64_t* end, const char** name) {
    *start = g_recs[i].start; *end = g_recs[i].end; *name = g_recs[i].name;
}
"""

# a kernel's role in a step, by its name (the first pattern that matches)
ROLES = [("store", r"rope_kv_write|kv_quant"), ("stream", r"attn_stream|attn_kv_stream"),
         ("short", r"^attn_partial|^attn_kv_g|^attn_kv_"), ("merge", r"attn_merge|lse_merge|sp_merge"),
         ("proj", r"gemv|gemmi|mmq"), ("other", r".")]


def role(name: str) -> str:
    """``ROLES``' label of a kernel name."""
    return next(r for r, pat in ROLES if re.search(pat, name))


class Tracer:
    """CUPTI kernel records through a small compiled helper (``TRACER_SOURCE``). Raises
    RuntimeError when the toolkit (nvcc, libcupti) is not found or CUPTI refuses."""

    def __init__(self):
        nvcc = shutil.which("nvcc")
        if not nvcc:
            raise RuntimeError("profile_timeline: nvcc not on PATH (the CUDA toolkit builds the CUPTI helper)")
        roots = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), os.environ.get("CUDA_HOME", ""),
                 os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
        for root in filter(None, roots):
            inc = [d for d in (os.path.join(root, "include"), os.path.join(root, "extras/CUPTI/include"))
                   if os.path.exists(os.path.join(d, "cupti.h"))]
            lib = [d for d in (os.path.join(root, "lib64"), os.path.join(root, "extras/CUPTI/lib64"),
                               os.path.join(root, "targets/x86_64-linux/lib")) if os.path.isdir(d)
                   and any(f.startswith("libcupti.so") for f in os.listdir(d))]
            if inc and lib:
                break
        else:
            raise RuntimeError(f"profile_timeline: cupti.h / libcupti.so not found under {', '.join(filter(None, roots))}")
        from opencoti.version import cache_dir

        tag = hashlib.sha256((TRACER_SOURCE + root).encode()).hexdigest()[:12]
        so = cache_dir() / f"cupti_timeline-{tag}.so"
        if not so.exists():
            src = so.with_suffix(".c")
            src.write_text(TRACER_SOURCE)
            subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-x", "c", str(src), "-o", str(so),
                            f"-I{inc[0]}", f"-L{lib[0]}", "-lcupti", f"-Xlinker=-rpath,{lib[0]}"], check=True)
        self.lib = ctypes.CDLL(str(so))
        self.lib.tl_collect.restype = ctypes.c_longlong
        self.lib.tl_get.argtypes = [ctypes.c_longlong, ctypes.POINTER(ctypes.c_ulonglong),
                                    ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_char_p)]
        e = self.lib.tl_enable()
        if e:
            raise RuntimeError(f"profile_timeline: cuptiActivityEnable failed ({e})")

    def mark(self) -> None:
        """Forget what was recorded; record the kernels that start from now on."""
        e = self.lib.tl_mark()
        if e:
            raise RuntimeError(f"profile_timeline: CUPTI flush failed ({e})")

    def collect(self) -> list[tuple[int, int, str]]:
        """The kernels recorded since ``mark`` (after the GPU finished them): (start ns, end ns,
        name), by start."""
        n = self.lib.tl_collect()
        if n < 0:
            raise RuntimeError("profile_timeline: CUPTI flush failed")
        s, e, nm = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_char_p()
        out = []
        for i in range(n):
            self.lib.tl_get(i, ctypes.byref(s), ctypes.byref(e), ctypes.byref(nm))
            out.append((s.value, e.value, nm.value.decode()))
        return sorted(out)


def exposed(recs: list[tuple[int, int, str]]) -> list[tuple[str, float, float]]:
    """(name, duration us, exposed us) of each record in start order: exposed = how far its end
    moves the latest end so far (the first record: its duration; a gap before a kernel counts as
    its own; a kernel that ends inside an earlier one's run exposes 0), so the exposed times add up
    to the span from the first start to the last end. In a decode graph every kernel waits for the
    one before it and ends after it: there, its end minus the previous kernel's end."""
    out, prev = [], None
    for s, e, name in recs:
        base = s if prev is None else prev
        out.append((name, (e - s) / 1e3, max(0, e - base) / 1e3))
        prev = e if prev is None else max(prev, e)
    return out


def per_step(rows: list[tuple[str, float, float]], n_steps: int, key) -> dict:
    """key(name) -> (calls a step, mean duration us, exposed us a step) over ``n_steps`` steps."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, dur, exp in rows:
        a = acc[key(name)]
        a[0] += 1
        a[1] += dur
        a[2] += exp
    return {k: (c / n_steps, d / c, x / n_steps) for k, (c, d, x) in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tiers", default="f16,q8_0,turbo3", help="comma list: name (K and V) or k/v")
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("-v", "--verbose", action="store_true", help="each tier's kernels by name")
    a = ap.parse_args()
    from opencoti.engine.runner import ModelRunner
    from opencoti.model.loader import load_model

    tracer = Tracer()  # before any CUDA work: every launch is seen by CUPTI
    model = load_model(a.model, with_tokenizer=False)
    res = {}
    for spec in a.tiers.split(","):
        tk, _, tv = spec.partition("/")
        r = ModelRunner(model, "cuda", n_ctx=a.depth + 512, n_seq_max=1, n_ubatch=512, type_k=tk, type_v=tv or tk)
        if a.depth:
            prefill(r, a.depth)
        _decode(r, a.depth, 8)  # module compiles, graph capture
        # one step at the depth, then its graph replayed: timed by events, then under the tracer
        r.decode(UBatch.build([1000], [a.depth], [0], [0]))
        t_ev = replay_step(r, a.replays)
        tracer.mark()
        replay_step(r, a.replays)
        recs = tracer.collect()
        r.kv.seq_rm(0, a.depth, -1)
        # replay_step launches once before its timed replays: a.replays + 1 graphs
        n_steps = a.replays + 1
        rows = exposed(recs)
        span = (max(e for _, e, _ in recs) - min(s for s, _, _ in recs)) / 1e3 / n_steps
        res[spec] = {"events": t_ev * 1e6, "span": span, "kernels": len(recs) / n_steps,
                     "roles": per_step(rows, n_steps, role), "names": per_step(rows, n_steps, lambda n: n)}
        del r
    specs = list(res)
    print(f"\nopencoti decode step timeline: {model.name}, depth {a.depth}, "
          f"{a.replays} replays traced (CUPTI; us a step)\n")
    print("| | " + " | ".join(specs) + " |")
    print("| --- |" + " ---: |" * len(specs))
    print("| step (events) | " + " | ".join(f"{res[s]['events']:.1f}" for s in specs) + " |")
    print("| step (traced span) | " + " | ".join(f"{res[s]['span']:.1f}" for s in specs) + " |")
    print("| kernels a step | " + " | ".join(f"{res[s]['kernels']:.0f}" for s in specs) + " |")
    for rl, _ in ROLES:
        cells = []
        for s in specs:
            v = res[s]['roles'].get(rl)
            cells.append(f"{v[2]:.1f} ({v[0]:.0f} x {v[1]:.2f})" if v else "-")
        print(f"| {rl}: exposed (calls x mean duration) | " + " | ".join(cells) + " |")
    if a.verbose:
        for s in specs:
            print(f"\n{s}: kernels by exposed time a step\n\n| kernel | calls a step | mean duration us | exposed us a step |\n"
                  "| --- | ---: | ---: | ---: |")
            for name, (c, d, x) in sorted(res[s]['names'].items(), key=lambda kv: -kv[1][2]):
                print(f"| {name} | {c:.0f} | {d:.2f} | {x:.1f} |")


if __name__ == "__main__":
    main()
