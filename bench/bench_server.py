"""Load generator for the HTTP server: aggregate decode throughput and
per-request latency at several client concurrencies, printed as a markdown table.

    python bench/bench_server.py [--clients 1,4,8,16] [--requests 2] [-n 32]
                                 [--max-seconds 120] [-m model.gguf] [--url http://127.0.0.1:8080]

Without ``--url`` it starts an in-process server on a free loopback port
(``-np`` = the largest client count, one unified KV cache of ``-c`` cells) on
the given model (default: the embedded gemma-3-270m). With ``--url`` it drives
a running server, which must be on the loopback interface (127.0.0.1, ::1,
localhost): this tool never sends load anywhere else.

For each concurrency C, C client threads each send ``--requests`` streamed
``/completion`` requests one after another (greedy, ``ignore_eos``, ``-n``
tokens, a distinct short prompt each, so no prompt-cache hits), stopping early
once ``--max-seconds`` have passed for that level (requests already sent
finish; each is bounded by ``-n``). Reported per level:

- ``decode tok/s``: generated tokens of all requests / wall time of the level
  (first request sent to last request done), the server's aggregate rate;
- ``latency p50 / p90``: whole-request wall time seen by the client;
- ``TTFT p50``: time to the first streamed token;
- ``per-req tok/s``: median of the server's own ``timings.predicted_per_second``.

The machine's load average is printed too: on a shared machine other work
competes for the cores, and the numbers move with it.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Optional
from urllib.parse import urlsplit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def one_request(host: str, port: int, prompt: str, n_predict: int, timeout: float) -> dict:
    """A streamed greedy /completion; returns latency, TTFT, tokens and the server timings."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        err = resp.read().decode("utf-8", "replace")
        conn.close()
        raise RuntimeError(f"HTTP {resp.status}: {err[:200]}")
    ttft: Optional[float] = None
    final: dict = {}
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = json.loads(event[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            if ttft is None and data.get("tokens"):
                ttft = time.perf_counter() - t0
            if data.get("stop"):
                final = data
    conn.close()
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "latency": t1 - t0, "ttft": ttft if ttft is not None else t1 - t0,
            "tokens": int(final.get("tokens_predicted", 0)),
            "tps": float(final.get("timings", {}).get("predicted_per_second", 0.0))}


def run_level(host: str, port: int, clients: int, requests: int, n_predict: int, max_seconds: float,
              tag: int) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + max_seconds
    start = threading.Barrier(clients)

    def client(ci: int) -> None:
        start.wait()
        for r in range(requests):
            if time.perf_counter() > deadline:
                break
            prompt = f"Story {tag}.{ci}.{r}: Once upon a time, in a village number {ci * 100 + r},"
            try:
                res = one_request(host, port, prompt, n_predict, timeout=max(60.0, max_seconds * 4))
            except (OSError, RuntimeError, ValueError) as e:
                with lock:
                    errors.append(str(e))
                break
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not results:
        return {"clients": clients, "requests": 0, "errors": errors}
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    lat = [r["latency"] for r in results]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall": wall,
        "agg_tps": tokens / wall if wall > 0 else 0.0,
        "p50": percentile(lat, 50),
        "p90": percentile(lat, 90),
        "ttft50": percentile([r["ttft"] for r in results], 50),
        "req_tps": statistics.median(r["tps"] for r in results),
        "errors": errors,
    }


def start_in_process(args) -> tuple[str, int, object]:
    from opencoti.http.server import make_server, start_in_thread
    from opencoti.model.loader import load_model
    from opencoti.params import Params

    model_path = args.model
    if model_path is None:
        from opencoti.model.default_model import default_model_path

        model_path = str(default_model_path())
    n_slots = args.parallel or max(args.clients)
    params = Params(model=model_path, n_ctx=args.ctx_size, n_parallel=n_slots, kv_unified=True,
                    n_ubatch=args.ubatch_size, port=0, host="127.0.0.1")
    model = load_model(model_path, params)
    httpd, engine = make_server(model, params, host="127.0.0.1", port=0)
    start_in_thread(httpd)
    return "127.0.0.1", httpd.server_address[1], (httpd, engine, model_path, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="drive a running server (loopback only) instead of an in-process one")
    ap.add_argument("-m", "--model", help="GGUF model for the in-process server (default: embedded)")
    ap.add_argument("--clients", default="1,4,8,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per request")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="time budget per level")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048, help="KV cells (in-process server)")
    ap.add_argument("-np", "--parallel", type=int, default=0, help="slots (default: the largest client count)")
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512, help="ubatch (in-process server)")
    args = ap.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    if not args.clients or min(args.clients) < 1 or args.requests < 1 or args.n_predict < 1:
        ap.error("--clients, --requests and -n must be positive")

    server = None
    if args.url:
        u = urlsplit(args.url)
        host, port = u.hostname or "", u.port or 80
        if not is_loopback(host):
            ap.error(f"refusing to load {host!r}: only loopback addresses (127.0.0.1, ::1, localhost)")
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as e:
            print(f"bench_server: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
        where = args.url
    else:
        host, port, server = start_in_process(args)
        httpd, engine, model_path, params = server
        where = (f"in-process server, {os.path.basename(model_path)}, -np {params.n_parallel}, "
                 f"-c {params.n_ctx} --kv-unified, -ub {params.n_ubatch}")

    load0 = os.getloadavg()
    one_request(host, port, "Warm-up:", 2, timeout=600)  # first-use costs out of the way
    rows = []
    for i, c in enumerate(args.clients):
        rows.append(run_level(host, port, c, args.requests, args.n_predict, args.max_seconds, i))
    load1 = os.getloadavg()
    if server is not None:
        from opencoti.http.server import stop_server

        stop_server(server[0], server[1])

    print(f"\nopencoti server load test: {where}")
    print(f"{args.requests} streamed request(s) per client, n_predict {args.n_predict}, greedy, ignore_eos; "
          f"cores: {os.cpu_count()}, load average {load0[0]:.2f} before, {load1[0]:.2f} after\n")
    print("| clients | requests | tokens | wall s | decode tok/s (aggregate) | latency p50 s | latency p90 s "
          "| TTFT p50 s | per-req tok/s (median) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if not r["requests"]:
            print(f"| {r['clients']} | 0 | - | - | - | - | - | - | - |")
            continue
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall']:.1f} | {r['agg_tps']:.1f} "
              f"| {r['p50']:.2f} | {r['p90']:.2f} | {r['ttft50']:.2f} | {r['req_tps']:.1f} |")
    errs = [e for r in rows for e in r["errors"]]
    if errs:
        print(f"\n{len(errs)} request(s) failed, first: {errs[0]}")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
