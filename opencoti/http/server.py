"""The HTTP server: stdlib ``ThreadingHTTPServer`` in front of one engine thread.

Each connection gets a handler thread that reads the request, checks CORS /
readiness / API key, dispatches to a route (``opencoti.http.routes``), and
writes JSON or a chunked SSE stream. Handler threads only parse, validate,
tokenize and submit; the engine thread alone runs the model and owns the KV
cache (DESIGN.md "How a request flows").

Entry points:

- ``serve(params)``: what ``opencoti --server`` runs. Starts listening at once
  (``/health`` answers 503 while the model loads, as llama.cpp does), loads the
  model, starts the engine, prints the KV cache sizes, serves until Ctrl-C /
  SIGTERM, then stops gracefully (``stop_server``: requests in flight end with
  a 503 error at once, the process exits promptly).
- ``make_server(model, params)``: build a ready server around an already
  loaded model (tests, embedding); returns ``(httpd, engine)``; run it with
  ``start_in_thread(httpd)`` and stop it with ``stop_server(httpd, engine)``.

Middleware order follows llama.cpp ``server-http.cpp``: CORS header on every
response, OPTIONS preflight answered without auth, 503 while loading, API key
check (``Authorization: Bearer KEY`` or ``X-Api-Key``) except on public
routes, then routing (404 unknown path, 405 wrong method).
"""

from __future__ import annotations

import functools
import hmac
import select
import signal
import socket
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qsl, urlsplit

from opencoti.http.errors import HTTPError, error_body
from opencoti.http.routes import PUBLIC_PATHS, Request, Response, Router, StreamResponse, build_router
from opencoti.http.sse import ChunkedWriter, ClientDisconnected, json_bytes, sse_event
from opencoti.http.state import ServerState
from opencoti.params import Params

# Largest request body we read (bytes); larger bodies get 413.
MAX_BODY_BYTES = 64 * 1024 * 1024


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class OpencotiHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer carrying the shared state and route table.

    ``url``: ``http://host:port`` the server is bound to.
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog

    def __init__(self, address: tuple[str, int], state: ServerState, router: Router):
        self.state = state
        self.router = router
        self._active = 0  # requests being dispatched now (not idle keep-alive connections)
        self._active_cv = threading.Condition()
        if ":" in address[0]:  # an IPv6 literal such as "::" or "::1"
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def enter(self) -> None:
        with self._active_cv:
            self._active += 1

    def leave(self) -> None:
        with self._active_cv:
            self._active -= 1
            self._active_cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is being dispatched (at most ``timeout`` s); True if idle."""
        with self._active_cv:
            return self._active_cv.wait_for(lambda: self._active <= 0, timeout)

    def handle_error(self, request, client_address) -> None:
        """A client that closed its connection (reset, broken pipe) is routine: nothing is
        printed; anything else gets the stdlib's traceback on stderr."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"


_PLAIN_ERRORS = {414: "the request line (method, URL, version) is longer than 65,536 bytes"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "opencoti"
    sys_version = ""
    server: OpencotiHTTPServer

    def version_string(self) -> str:  # the Server header
        return self.server_version

    def setup(self) -> None:
        self.timeout = self.server.state.params.timeout or None
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    # quiet access log unless --verbose
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.state.params.verbose:
            _log("srv  %s - %s" % (self.address_string(), format % args))

    def parse_request(self) -> bool:
        """The stdlib parser, minus HTTP/0.9: a request line without a version
        (``GET /``) gets a 400, as llama.cpp's httplib answers any request line
        that is not ``METHOD TARGET HTTP/1.x``."""
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":
            self.send_error(400, f"Bad request line {self.requestline!r}: expected METHOD TARGET HTTP/1.1")
            return False
        return True

    # stdlib parse errors (bad request line, headers too long...) answer in JSON too
    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        self.close_connection = True
        # the stdlib marks a request it could not parse as HTTP/0.9, which would make the
        # reply a bare body without status line and headers: always answer HTTP/1.1
        self.request_version = "HTTP/1.1"
        etype = {400: "invalid_request_error", 404: "not_found_error", 501: "not_supported_error"}.get(
            code, "server_error" if code >= 500 else "invalid_request_error")
        try:
            if not (message or explain):  # the stdlib's bare codes: 414 for a request line over 64 KiB
                message = _PLAIN_ERRORS.get(code) or HTTPStatus(code).phrase
            self._send_json(code, error_body(code, etype, message or explain))
        except OSError:
            pass

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

    def do_OPTIONS(self) -> None:
        # CORS preflight: answered for any path, without auth (browsers send no Authorization)
        try:
            self._read_body()
        except HTTPError as e:
            self._safe(functools.partial(self._send_error, e))
            return
        self.send_response(200)
        self._cors_headers()
        self.send_header("Access-Control-Allow-Credentials", "true")
        self.send_header("Access-Control-Allow-Methods", "GET, POST")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Content-Length", "0")
        self.end_headers()

    # ------------------------------------------------------------------
    def _cors_headers(self) -> None:
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        self.send_header("Access-Control-Allow-Origin", origin or "*")

    def _send_json(self, status: int, obj: Any, headers: Optional[dict] = None) -> None:
        self._send_bytes(status, json_bytes(obj), "application/json; charset=utf-8", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers: Optional[dict] = None) -> None:
        self.send_response(status)
        self._cors_headers()
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, e: HTTPError) -> None:
        self._send_json(e.status, e.body(), e.headers)

    def _read_body(self) -> bytes:
        """Read the whole request body (Content-Length or chunked). Raises HTTPError 400
        (a negative or non-numeric Content-Length, Content-Length fields that disagree, a
        Transfer-Encoding whose last coding is not ``chunked``, a malformed chunk, a short
        body), 501 (a transfer coding other than ``chunked``) or 413 (over
        ``MAX_BODY_BYTES``); all close the connection. Framing as RFC 9112 §6.1 / §6.3: a
        request with both Transfer-Encoding and Content-Length is read chunked and its
        connection closed after the reply (a request-smuggling guard)."""
        te_fields = self.headers.get_all("Transfer-Encoding") or []
        codings = [c.strip().lower() for f in te_fields for c in f.split(",") if c.strip()]
        if te_fields:
            if not codings or codings[-1] != "chunked":
                self.close_connection = True
                raise HTTPError(400, "invalid_request_error",
                                f"unsupported Transfer-Encoding {', '.join(te_fields)!r}: the last coding must be chunked")
            if len(codings) > 1:
                self.close_connection = True
                raise HTTPError(501, "not_supported_error",
                                f"unsupported Transfer-Encoding {', '.join(te_fields)!r}: only chunked is implemented")
            if self.headers.get("Content-Length") is not None:
                self.close_connection = True
        if te_fields:
            parts, total = [], 0
            while True:
                line = self.rfile.readline(65537)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self.close_connection = True
                    raise HTTPError(400, "invalid_request_error", "malformed chunked request body") from None
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                total += size
                if total > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise HTTPError(413, "invalid_request_error", "request body too large")
                parts.append(self.rfile.read(size))
                self.rfile.readline(3)
        lengths = [v.strip() for f in (self.headers.get_all("Content-Length") or []) for v in f.split(",")]
        if len(set(lengths)) > 1:
            self.close_connection = True
            raise HTTPError(400, "invalid_request_error", f"conflicting Content-Length values {', '.join(lengths)}")
        length = lengths[0] if lengths else None
        if not length:
            return b""
        digits = length.strip()
        # negative, signed, "5_0", not a number: 400 (as llama.cpp's httplib)
        if not (digits.isascii() and digits.isdigit()):
            self.close_connection = True
            raise HTTPError(400, "invalid_request_error", f"invalid Content-Length {length!r}")
        n = int(digits)
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise HTTPError(413, "invalid_request_error", "request body too large")
        data = self.rfile.read(n)
        if len(data) < n:
            self.close_connection = True
            raise HTTPError(400, "invalid_request_error", "request body shorter than Content-Length")
        return data

    def _peer_closed(self) -> bool:
        """True when the client has closed its side: the socket is readable and
        a ``MSG_PEEK`` returns no bytes (end of stream), or it is reset.

        Readiness is polled with a zero timeout first: ``recv`` on a socket that
        has a timeout would otherwise wait for data (``select.poll`` has no
        descriptor-number limit; ``select.select`` stands in where it is missing).
        """
        sock = self.connection
        try:
            if hasattr(select, "poll"):
                p = select.poll()
                p.register(sock, select.POLLIN | select.POLLPRI)
                events = p.poll(0)
                if not events:
                    return False
                if events[0][1] & (select.POLLERR | select.POLLNVAL):
                    return True
            else:
                r, _, _ = select.select([sock], [], [], 0)
                if not r:
                    return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (ConnectionError, ValueError):
            return True
        except OSError:
            return False

    def _check_api_key(self, path: str) -> None:
        key = self.server.state.params.api_key
        if not key or path in PUBLIC_PATHS:
            return
        given = self.headers.get("Authorization") or self.headers.get("X-Api-Key") or ""
        if given[:7].lower() == "bearer ":  # the auth scheme is case-insensitive (RFC 7235)
            given = given[7:]
        # http.server decodes header bytes as Latin-1: back to the bytes the client sent (UTF-8)
        try:
            raw = given.strip().encode("latin-1")
        except UnicodeEncodeError:
            raw = given.strip().encode()
        if not hmac.compare_digest(raw, key.encode()):
            raise HTTPError(401, "authentication_error", "Invalid API Key")

    def _dispatch(self) -> None:
        self.server.enter()
        try:
            self._dispatch_inner()
        finally:
            self.server.leave()

    def _dispatch_inner(self) -> None:
        state = self.server.state
        try:
            try:
                body = self._read_body()
            except (OSError, ValueError) as e:
                self.close_connection = True
                raise HTTPError(400, "invalid_request_error", f"could not read request body: {e}") from None
            url = urlsplit(self.path)
            path = url.path or "/"
            if not state.ready:
                msg = state.load_error or "Loading model"
                raise HTTPError(503, "unavailable_error", msg)
            if state.shutting_down:
                self.close_connection = True
                raise HTTPError(503, "unavailable_error", "the server is shutting down")
            self._check_api_key(path)
            fn, path_params = self.server.router.resolve(self.command, path)
            req = Request(method=self.command, path=path, query=dict(parse_qsl(url.query)),
                          headers=self.headers, body=body, is_disconnected=self._peer_closed,
                          path_params=path_params)
            res = fn(state, req)
            if isinstance(res, StreamResponse):
                self._write_stream(res)
            else:
                self._write_response(res)
        except HTTPError as e:
            self._safe(functools.partial(self._send_error, e))
        except ClientDisconnected:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never a traceback to the client
            _log(f"srv  error: unhandled exception in {self.command} {self.path}:\n{traceback.format_exc()}")
            msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._safe(lambda: self._send_json(500, error_body(500, "server_error", msg)))

    def _safe(self, fn) -> None:
        try:
            fn()
        except OSError:
            self.close_connection = True

    def _write_response(self, res: Response) -> None:
        if res.raw is not None:
            self._send_bytes(res.status, res.raw, res.content_type, res.headers)
        else:
            self._send_json(res.status, res.body, res.headers)

    def _write_stream(self, res: StreamResponse) -> None:
        chunks = res.chunks
        try:
            self.send_response(res.status)
            self._cors_headers()
            self.send_header("Content-Type", res.content_type)
            self.send_header("Cache-Control", "no-cache")
            self.send_header("X-Accel-Buffering", "no")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in res.headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.flush()
            out = ChunkedWriter(self.wfile)
            try:
                for data in chunks:
                    out.write(data)
            except (ClientDisconnected, OSError):
                self.close_connection = True
                return
            except Exception as e:  # headers are out: report in-stream, then end it
                _log(f"srv  error: exception while streaming {self.path}:\n{traceback.format_exc()}")
                msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                try:
                    out.write(sse_event(error_body(500, "server_error", msg)))
                except ClientDisconnected:
                    self.close_connection = True
                    return
            out.finish()
        except (ClientDisconnected, OSError):
            self.close_connection = True
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a generator's finally cancels its engine request


# ---------------------------------------------------------------------------
# construction


def build_chat_template(model: Any, params: Params):
    """The chat template for ``model``, chosen once at startup
    (``--chat-template`` / ``--chat-template-file`` / GGUF / built-in)."""
    from opencoti.model.chat_template import template_for_model

    return template_for_model(model.metadata, params.chat_template, params.chat_template_file)


def make_server(model: Any, params: Params, engine: Any = None,
                host: Optional[str] = None, port: Optional[int] = None):
    """Build a ready-to-serve HTTP server around a loaded ``model``.

    engine: an already built Engine, or None to build and start one
    (``Engine(model, params)``). host/port override ``params.host`` /
    ``params.port``; port 0 picks a free port (read it from ``httpd.url``).
    Returns ``(httpd, engine)``; nothing is served until ``serve_forever`` runs
    (see ``start_in_thread``). Raises OSError if the address cannot be bound,
    ValueError for a bad chat template override.
    """
    if engine is None:
        from opencoti.engine.engine import Engine

        engine = Engine(model, params)
        engine.start()
    state = ServerState(params)
    state.set_ready(model, engine, build_chat_template(model, params))
    httpd = OpencotiHTTPServer((host if host is not None else params.host,
                                port if port is not None else params.port), state, build_router())
    return httpd, engine


def start_in_thread(httpd: OpencotiHTTPServer) -> threading.Thread:
    """Run ``httpd.serve_forever`` on a daemon thread and return the thread."""
    t = threading.Thread(target=httpd.serve_forever, name="opencoti-http", daemon=True)
    t.start()
    return t


def stop_server(httpd: OpencotiHTTPServer, engine: Any = None, grace_s: float = 5.0) -> int:
    """Graceful stop: refuse new requests (503), stop accepting connections,
    end every request in flight with a 503 ``unavailable_error`` (a streamed
    one gets it as its last event), give the handler threads up to ``grace_s``
    seconds to write those answers, then close the socket and stop the engine.
    Returns the number of requests that were cut short."""
    state = httpd.state
    state.shutting_down = True
    httpd.shutdown()
    n = state.fail_inflight(503, "unavailable_error", "the server is shutting down")
    httpd.wait_idle(grace_s)
    httpd.server_close()
    if engine is not None:
        engine.stop()
    return n


def log_kv_layout(engine: Any) -> None:
    """Print the KV cache sizes per cache and tier at boot, llama.cpp style (``llama_kv_cache: ...``)."""
    from opencoti.engine.kv_report import kv_layout_lines

    for line in kv_layout_lines(engine):
        _log(line)


class StopSignal:
    """The server's stop request, set by SIGINT / SIGTERM (``handler``); a second signal
    raises ``SystemExit(1)``. The handler only counts: a Python signal handler runs
    between any two bytecodes of the main thread, so one that takes a lock
    (``threading.Event.set``) deadlocks when the signal lands while the main thread holds
    that lock (inside ``Event.wait``, or inside a first handler's ``set`` when a second
    signal follows at once, as ``timeout``/process-group kills send)."""

    def __init__(self) -> None:
        self.count = 0

    def handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:  # second Ctrl-C: leave at once
            _log("Received second interrupt, terminating immediately.")
            raise SystemExit(1)

    def is_set(self) -> bool:
        return self.count > 0

    def wait(self, timeout: float) -> bool:
        """Sleep until the stop is requested or ``timeout`` seconds pass; True when requested."""
        deadline = time.monotonic() + timeout
        while not self.count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05))
        return self.count > 0


def serve(params: Params) -> int:
    """Run the server until Ctrl-C or SIGTERM; returns the process exit code.

    Listens first (requests get 503 "Loading model" meanwhile), then loads the
    model (``load_model(params.model, params)``), builds and starts the engine,
    and prints llama.cpp's "server is listening on http://host:port" line.
    Returns 1 if the address cannot be bound or the model fails to load.
    """
    from opencoti.model.loader import load_model

    state = ServerState(params)
    try:
        httpd = OpencotiHTTPServer((params.host, params.port), state, build_router())
    except OSError as e:
        _log(f"main: couldn't bind HTTP server socket, hostname: {params.host}, port: {params.port}: {e}")
        return 1
    _log(f"main: HTTP server is listening, hostname: {params.host}, port: {httpd.server_address[1]}")
    stop = StopSignal()
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, stop.handler)
    http_thread = start_in_thread(httpd)
    engine = None
    try:
        _log("main: loading model")
        try:
            model = load_model(params.model, params)
            from opencoti.engine.engine import Engine

            engine = Engine(model, params)
            engine.start()
            template = build_chat_template(model, params)
        except (OSError, ValueError, RuntimeError) as e:
            _log(f"main: error: failed to load model: {e}")
            return 1
        log_kv_layout(engine)
        state.set_ready(model, engine, template)
        _log(f"main: model loaded, chat template: {getattr(template, 'name', '?')}")
        _log(f"main: server is listening on {httpd.url} - starting the main loop")
        _log("srv  update_slots: all slots are idle")
        while not stop.wait(0.5):
            if not http_thread.is_alive():
                _log("main: HTTP server thread stopped unexpectedly")
                return 1
        _log("srv    operator(): operator(): cleaning up before exit...")
        return 0
    finally:
        n = stop_server(httpd, engine)
        if n:
            _log(f"main: {n} request(s) in flight ended with 503 (shutting down)")
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
