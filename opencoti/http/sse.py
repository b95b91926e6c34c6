"""Server-sent events and JSON serialization for responses.

An SSE event is ``data: <json>\\n\\n`` (WHATWG HTML "Server-sent events";
llama.cpp ``format_oai_sse``); OpenAI-style streams end with ``data: [DONE]``.
The stream goes out with HTTP/1.1 chunked transfer encoding (RFC 9112 §7.1),
one chunk per event, flushed at once.
"""

from __future__ import annotations

import json
import math
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"

# llama.cpp writes -inf log-probabilities as the lowest float (nlohmann::json
# would turn them into null); we do the same for any non-finite number.
_FLOAT_LOWEST = -3.4028234663852886e38
_FLOAT_MAX = 3.4028234663852886e38


class ClientDisconnected(Exception):
    """The client closed the connection (a write failed or the peer hung up)."""


def _finite(obj: Any) -> Any:
    """Copy of ``obj`` with NaN -> None and +-inf -> +-FLT_MAX (valid JSON)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return _FLOAT_MAX if obj > 0 else _FLOAT_LOWEST
        return obj
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_bytes(obj: Any) -> bytes:
    """Serialize ``obj`` as compact UTF-8 JSON (non-ASCII kept as UTF-8, as
    llama.cpp does). Non-finite floats are made valid first."""
    try:
        s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        s = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # lone surrogates cannot be encoded; replace them like nlohmann's error_handler::replace
    return s.encode("utf-8", errors="replace")


def sse_event(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON: ``b"data: {...}\\n\\n"``."""
    return b"data: " + json_bytes(obj) + b"\n\n"


class ChunkedWriter:
    """Writes an HTTP/1.1 chunked body to a socket file, one flush per chunk.

    ``wfile``: the handler's binary write file. Any ``OSError`` while writing
    (broken pipe, reset, timeout) becomes ``ClientDisconnected``.
    """

    def __init__(self, wfile):
        self._wfile = wfile
        self.closed = False

    def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk (empty data is skipped: a zero chunk ends the body)."""
        if not data:
            return
        try:
            self._wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self._wfile.flush()
        except (OSError, ValueError) as e:
            self.closed = True
            raise ClientDisconnected(str(e)) from e

    def finish(self) -> None:
        """Send the terminating zero-length chunk."""
        if self.closed:
            return
        try:
            self._wfile.write(b"0\r\n\r\n")
            self._wfile.flush()
        except (OSError, ValueError) as e:
            raise ClientDisconnected(str(e)) from e
        finally:
            self.closed = True
