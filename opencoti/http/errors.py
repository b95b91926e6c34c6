"""HTTP error vocabulary: one exception type that carries an HTTP status and
llama.cpp's error ``type`` string, and the JSON body every error response uses.

The body shape and the type/status pairs follow llama.cpp's
``tools/server/server-common.cpp`` (``format_error_response``)::

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}

Handlers raise ``HTTPError`` (or one of the helpers below); the server turns it
into that body. Anything else raised inside a handler becomes a 500
``server_error`` with the exception's message, never a traceback.
"""

from __future__ import annotations

from typing import Any, Optional

# llama.cpp error types and the HTTP status each one maps to.
ERROR_TYPE_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "exceed_context_size_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
}


class HTTPError(Exception):
    """An error that becomes a JSON error response.

    status: HTTP status code (int).
    type: llama.cpp's error type string (see ``ERROR_TYPE_STATUS``).
    message: human-readable text for the client.
    extra: additional fields merged into the ``error`` object (e.g. ``n_ctx``
    and ``n_prompt_tokens`` for ``exceed_context_size_error``, as llama.cpp does).
    headers: extra response headers (e.g. ``Allow`` for 405).
    """

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        extra: Optional[dict[str, Any]] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = int(status)
        self.type = type
        self.message = message
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The response body: ``{"error": {"code", "message", "type", ...extra}}``."""
        return error_body(self.status, self.type, self.message, self.extra)


def error_body(status: int, type: str, message: str, extra: Optional[dict] = None) -> dict:
    """Build llama.cpp's error JSON object for ``status``/``type``/``message``."""
    err: dict[str, Any] = {"code": int(status), "message": str(message), "type": type}
    if extra:
        err.update(extra)
    return {"error": err}


def invalid_request(message: str, **extra: Any) -> HTTPError:
    """400 ``invalid_request_error``: malformed body, wrong field types or values."""
    return HTTPError(400, "invalid_request_error", message, extra or None)


def not_found(message: str = "File Not Found") -> HTTPError:
    """404 ``not_found_error`` (llama.cpp's text for an unknown route is "File Not Found")."""
    return HTTPError(404, "not_found_error", message)


def not_supported(message: str) -> HTTPError:
    """501 ``not_supported_error``: a feature this server does not offer."""
    return HTTPError(501, "not_supported_error", message)


def unavailable(message: str) -> HTTPError:
    """503 ``unavailable_error``: e.g. the model is still loading."""
    return HTTPError(503, "unavailable_error", message)


def server_error(message: str) -> HTTPError:
    """500 ``server_error``: an internal failure."""
    return HTTPError(500, "server_error", message)


def exceed_context(n_prompt_tokens: int, n_ctx: int, at_least: bool = False) -> HTTPError:
    """400 ``exceed_context_size_error`` with llama.cpp's extra fields.

    Raised when a prompt does not fit the slot's context (``n_prompt_tokens >= n_ctx``).
    ``at_least``: the count is a lower bound (a text refused before it was tokenized).
    """
    return HTTPError(
        400,
        "exceed_context_size_error",
        f"the request exceeds the available context size, try increasing it "
        f"(prompt has {'at least ' if at_least else ''}{n_prompt_tokens} tokens, context is {n_ctx})",
        {"n_prompt_tokens": int(n_prompt_tokens), "n_ctx": int(n_ctx)},
    )
